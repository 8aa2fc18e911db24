"""The run loop every run shares (trainer.StepLoop.run / finish): the single-process Trainer and
each world of an elastic run step through it; only what they decide at a boundary differs."""

from __future__ import annotations

import jax
import pytest

from resilient_jax import fingerprinting
from resilient_jax.metrics import MetricsLog
from resilient_jax.trainer import RunTotals, StepLoop, Trainer

from conftest import tiny_config

EVAL = ["eval.every_steps=2", "eval.holdout_shards=2", "eval.batches=1"]


def _loop(tmp_path, *overrides: str) -> tuple[Trainer, StepLoop]:
    cfg = tiny_config(tmp_path, "train.steps=5", "checkpoint.enabled=false", *EVAL, *overrides)
    trainer = Trainer(cfg, devices=jax.devices()[:8])
    log = MetricsLog(trainer.run_dir, cfg.train.steps, progress="quiet", enabled=False)
    return trainer, StepLoop(trainer, log, RunTotals(), None, start_step=0)


def test_the_loop_evaluates_before_each_due_step_hands_over_every_boundary_and_finishes_with_the_last_eval(
        tmp_path, fault_free):
    trainer, loop = _loop(tmp_path)
    calls = []
    loop.on_eval = lambda record: calls.append(("eval", record.step))
    state = trainer.fresh_state()
    loop.compile(state)
    for state, step in loop.run(state, 0, StepLoop.end_of(5, None), before_step=lambda k: calls.append(("before", k))):
        calls.append(("boundary", step))
        assert loop.last_step_seconds > 0 and 0 <= loop.last_data_wait <= loop.last_step_seconds
    loop.finish(state, step, stopped=None)
    loop.close()
    assert calls == [("before", 0), ("boundary", 1), ("before", 1), ("boundary", 2), ("eval", 2), ("before", 2),
                     ("boundary", 3), ("before", 3), ("boundary", 4), ("eval", 4), ("before", 4), ("boundary", 5),
                     ("eval", 5)]
    # The same trajectory as the Trainer's own run, which steps through this loop too.
    assert fingerprinting.params_fingerprint(state.params) == fault_free(
        "train.steps=5", "checkpoint.enabled=false", *EVAL)["params_fingerprint"]


def test_a_step_that_fails_leaves_the_caller_the_last_boundarys_state_and_a_stop_leaves_the_last_eval(tmp_path):
    trainer, loop = _loop(tmp_path)
    evals = []
    loop.on_eval = lambda record: evals.append(record.step)
    state = trainer.fresh_state()
    loop.compile(state)
    compute = trainer.compute_finite

    def peer_dies_in_step_4(params, loader, step, *args):  # inside the step, as a failed collective does
        if step == 3:
            raise RuntimeError("a peer died")
        return compute(params, loader, step, *args)

    trainer.compute_finite = peer_dies_in_step_4
    held = None
    with pytest.raises(RuntimeError, match="a peer died"):
        for state, step in loop.run(state, 0, 5):
            held = (step, fingerprinting.params_fingerprint(state.params))
    loop.close()
    # The caller still holds the state after step 3, untouched by the step that failed.
    assert held[0] == step == 3 and fingerprinting.params_fingerprint(state.params) == held[1]
    assert evals == [2]
    # A new loop from there, stopped by --stop-at 4: step 4 is an eval step, left to the rerun.
    trainer.compute_finite = compute
    loop = StepLoop(trainer, loop.log, RunTotals(), None, start_step=3, position=loop.position_at(3))
    loop.on_eval = lambda record: evals.append(record.step)
    end = StepLoop.end_of(5, 4)
    for state, step in loop.run(state, step, end):
        pass
    stopped = StepLoop.stopped_at_end(step, 5)
    loop.finish(state, step, stopped=stopped)
    loop.close()
    assert (end, step, stopped, evals) == (4, 4, "stop_at", [2])
    assert StepLoop.end_of(5, 9) == 5 and StepLoop.stopped_at_end(5, 5) is None


def test_a_loop_runs_a_program_while_a_step_is_left_or_the_runs_last_evaluation_is_due(tmp_path):
    evaluated = Trainer(tiny_config(tmp_path / "e", "train.steps=5", *EVAL), devices=jax.devices()[:8])
    assert evaluated.runs_a_program(3, 5) and evaluated.runs_a_program(0, 1)
    # At the run's end (a world whose predecessor died as it ended the run): the last evaluation.
    assert evaluated.runs_a_program(5, 5)
    assert not evaluated.runs_a_program(4, 4)  # stopped short of the end (--stop-at 4): left to the rerun
    plain = Trainer(tiny_config(tmp_path / "p", "train.steps=5"), devices=jax.devices()[:8])
    assert plain.runs_a_program(4, 5) and not plain.runs_a_program(5, 5)  # nothing to run: nothing compiled


def test_a_finished_run_rerun_with_an_earlier_stop_at_is_complete_not_stopped(tmp_path):
    cfg = tiny_config(tmp_path, "train.steps=4", *EVAL)
    first = Trainer(cfg, devices=jax.devices()[:8]).run()
    again = Trainer(cfg, devices=jax.devices()[:8], stop_at=2).run()
    assert (first["final_step"], first["stopped"]) == (again["final_step"], again["stopped"]) == (4, None)
    assert again["params_fingerprint"] == first["params_fingerprint"]
    # Its last evaluation (of step 4's state, which it resumed from) ran on a step compiled before it.
    assert [r["step"] for r in again["eval"]["history"]] == [4] and again["compile_seconds"] > 0


def test_a_signal_in_the_last_step_completes_the_run_with_its_last_evaluation(tmp_path):
    import os
    import signal

    cfg = tiny_config(tmp_path, "train.steps=4", *EVAL)
    trainer = Trainer(cfg, devices=jax.devices()[:8])
    compute = trainer.compute_finite

    def preempted_during_the_last_step(params, loader, step, *args):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # what a cluster's preemption sends
        return compute(params, loader, step, *args)

    trainer.compute_finite = preempted_during_the_last_step
    summary = trainer.run()
    assert (summary["final_step"], summary["stopped"]) == (4, None)
    assert [r["step"] for r in summary["eval"]["history"]] == [2, 4]
    assert summary["checkpoint"]["saves"][-1] == 4
