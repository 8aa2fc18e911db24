"""Held-out evaluation: which samples, when, and an eval loss that does not depend on the layout.

The elastic half of the claim -- the same eval losses after an absorbed kill -- is in
tests/test_examples.py, on the user model trained there.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import numpy as np
import pytest

from resilient_jax import evaluation, train
from resilient_jax.config import ConfigError, EvalConfig
from resilient_jax.data import DatasetError, GlobalOrder, global_batch_ids, prepare_dataset
from resilient_jax.data.evalset import (build_eval_set, check_compatible, check_held_out, holdout_quarantine,
                                        holdout_shard_ids)
from resilient_jax.data.order import QuarantineEvent
from resilient_jax.metrics import MetricsLog
from resilient_jax.trainer import Trainer

from conftest import TINY, read_summary, run_cli, tiny_config

EVAL = ["eval.every_steps=2", "eval.holdout_shards=2", "eval.batches=2"]


# -- when, and how the loss is added up ---------------------------------------------------------


def test_evaluation_is_due_every_n_steps_and_after_the_last_never_before_the_first():
    assert [k for k in range(0, 12) if evaluation.due(k, 4, 10)] == [4, 8, 10]
    assert [k for k in range(0, 12) if evaluation.due(k, 5, 10)] == [5, 10]
    assert not any(evaluation.due(k, 0, 10) for k in range(12))


def test_the_loss_is_the_weighted_mean_added_in_batch_then_shard_order():
    sums = [(np.float32([2.0, 4.0]), np.float32([1.0, 1.0])), (np.float32([3.0, 0.0]), np.float32([2.0, 0.0]))]
    record = evaluation.combine(7, sums, seconds=0.5)
    assert (record.step, record.batches, record.tokens) == (7, 2, 4.0)
    assert record.loss == 9.0 / 4.0 and record.perplexity == math.exp(9.0 / 4.0)
    empty = evaluation.combine(1, [(np.float32([0.0]), np.float32([0.0]))], 0.0)
    assert math.isnan(empty.loss) and math.isnan(empty.perplexity)


def test_a_step_evaluated_again_is_recorded_once_and_a_differing_value_is_a_warning(tmp_path, capsys):
    def record(step, loss):
        return {"event": "eval", "step": step, "loss": loss, "perplexity": math.exp(loss), "tokens": 1.0,
                "batches": 1, "seconds": 0.1}

    log = MetricsLog(tmp_path, 10, progress="quiet")
    log.eval(record(5, 2.5))
    log.close()
    reopened = MetricsLog(tmp_path, 10, progress="quiet", start_step=5)  # a resume at the eval step
    reopened.eval(record(5, 2.5))
    reopened.eval(record(5, 2.75))
    reopened.close()
    out = capsys.readouterr().out
    assert "eval at step 5 again (resumed at an eval step): the same loss, bit for bit" in out
    assert "warning: eval at step 5 gave loss 2.75 this time, 2.5 before" in out
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in lines if r.get("event") == "eval"] == [(5, 2.5)]


# -- which samples -------------------------------------------------------------------------------


def test_held_out_shards_are_the_last_ones_and_training_never_reads_them(default_dataset):
    manifest = default_dataset
    shards = len(manifest.shards)
    assert holdout_shard_ids(shards, 2) == [shards - 2, shards - 1]
    order = GlobalOrder.for_manifest(manifest, seed=0, global_batch=48, quarantine=holdout_quarantine(shards, 2))
    held_from = manifest.shard_bounds[shards - 2]
    seen = np.concatenate([global_batch_ids(order, k) for k in range(0, 2000, 7)])
    assert seen.max() < held_from  # steps across several epochs
    evalset = build_eval_set(EvalConfig(every_steps=5, holdout_shards=2, batches=3), manifest, 48)
    assert evalset.batches == 3 and evalset.sample_ids.size == 3 * 48
    assert evalset.sample_ids[0] == held_from and np.all(np.diff(evalset.sample_ids) == 1)
    assert set(manifest.shard_of(evalset.sample_ids)) <= {shards - 2, shards - 1}
    every = build_eval_set(EvalConfig(every_steps=5, holdout_shards=2, batches=0), manifest, 48)
    assert every.batches == (manifest.num_records - held_from) // 48


def test_a_resume_may_not_hold_out_shards_its_run_trained_on():
    saved = (QuarantineEvent(3, 7), QuarantineEvent(14, 0), QuarantineEvent(15, 0))  # held out 2, a NaN shard
    check_held_out(saved, holdout_quarantine(16, 2))  # the same
    check_held_out(saved, holdout_quarantine(16, 1))  # fewer: shard 14 simply stays out of training
    check_held_out(saved, ())  # evaluation turned off: both stay out
    with pytest.raises(DatasetError, match=r"eval.holdout_shards: the run being resumed trained on shard\(s\) 13,"):
        check_held_out(saved, holdout_quarantine(16, 3))
    with pytest.raises(DatasetError, match="trained on shard"):
        check_held_out((QuarantineEvent(15, 4),), holdout_quarantine(16, 1))  # out only from step 4


def test_bad_eval_settings_get_one_line_naming_the_key(default_dataset):
    manifest, shards = default_dataset, len(default_dataset.shards)
    with pytest.raises(DatasetError, match=f"eval.holdout_shards: the dataset has {shards} shards"):
        build_eval_set(EvalConfig(every_steps=1, holdout_shards=shards), manifest, 48)
    with pytest.raises(DatasetError, match="eval.batches: 100000 batches of 48 need"):
        build_eval_set(EvalConfig(every_steps=1, holdout_shards=1, batches=100000), manifest, 48)
    with pytest.raises(DatasetError, match="fewer than one global batch"):
        build_eval_set(EvalConfig(every_steps=1, holdout_shards=1), manifest, manifest.num_records)
    other_tokens = dataclasses.replace(manifest, tokenizer="hf", tokenizer_sha256="ab" * 32)
    with pytest.raises(DatasetError, match="eval.dataset: .* tokenizer hf .* the training data with bytes"):
        check_compatible(other_tokens, manifest)
    with pytest.raises(DatasetError, match="eval.dataset: .* seq_len 32, the training data 64; .*--seq-len 64"):
        check_compatible(dataclasses.replace(manifest, seq_len=32), manifest)
    with pytest.raises(DatasetError, match="eval.dataset: .*nowhere does not exist"):
        build_eval_set(EvalConfig(every_steps=1, dataset="/nowhere"), manifest, 48)


def test_an_eval_dataset_of_its_own_is_read_whole_and_must_speak_the_training_tokens(tmp_path, default_dataset,
                                                                                     capsys):
    text = tmp_path / "text"
    text.mkdir()
    (text / "held-out.txt").write_text("Held-out prose, never trained on. " * 1000)
    good = prepare_dataset(text, tmp_path / "eval-64", shards=2, seq_len=64)
    evalset = build_eval_set(EvalConfig(every_steps=1, dataset=str(good.root), batches=0), default_dataset, 48)
    assert (evalset.source, evalset.manifest.version) == ("dataset", good.version)
    assert evalset.batches == good.num_records // 48 and evalset.sample_ids.tolist() == list(range(evalset.batches * 48))

    other = prepare_dataset(text, tmp_path / "eval-32", shards=1, seq_len=32)
    run_dir = tmp_path / "run"
    code = train.main(["--config", str(TINY), "--set", f"run.dir={run_dir}", "--set", "eval.every_steps=5",
                       "--set", f"eval.dataset={other.root}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert f"error: config key eval.dataset: {other.root} has seq_len 32, the training data 64" in lines[0]
    assert not run_dir.exists()


@pytest.mark.parametrize("overrides, key", [
    (["eval.every_steps=5"], "eval.every_steps: evaluation needs held-out data"),
    (["eval.every_steps=5", "eval.holdout_shards=1", "eval.dataset=/x"], "eval.dataset: set either"),
    (["eval.dataset=/x"], "eval.dataset: eval.every_steps is 0"),
    (["eval.batches=-1"], "eval.batches: must be >= 0"),
])
def test_inconsistent_eval_keys_are_refused_at_load(tmp_path, overrides, key):
    with pytest.raises(ConfigError, match=key):
        tiny_config(tmp_path, *overrides)


# -- the same loss on every layout ----------------------------------------------------------------


def test_the_eval_loss_has_the_same_bits_on_every_layout_and_shard_assignment(tmp_path, default_dataset):
    """Fresh params (the same on every mesh), evaluated on 8 devices (the uneven-assignment program
    of a 2-host world: uniform, then moved shards), 8 devices as one host (the counted loop), 4
    devices as data 2 x fsdp 2, 5 devices (24 shards padded to 25) and 1 device."""
    layouts = [(8, [], 2), (8, [], 1), (4, ["parallel.data=2", "parallel.fsdp=2"], 1), (5, [], 1), (1, [], 1)]
    losses = []
    for devices, overrides, hosts in layouts:
        trainer = Trainer(tiny_config(tmp_path / str(devices), *EVAL, *overrides), devices=jax.devices()[:devices],
                          hosts=hosts)
        evaluator = evaluation.Evaluator(trainer)
        params = trainer.fresh_state().params
        losses.append(evaluator.run(params, 0).loss)
        if hosts == 2:  # shards moved between devices, as the proportional assignment does
            trainer.set_layout([5, 5, 4, 2, 2, 2, 2, 2])
            losses.append(evaluator.run(params, 0).loss)
            assert trainer.evaluate._cache_size() == 1  # a new layout is an input, not a new program
        evaluator.close()
    assert len(set(losses)) == 1, losses
    assert 4.0 < losses[0] < 7.0  # ~log(256): an untrained byte model


# -- a run that evaluates -------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_evaluates_every_n_steps_once_per_step_across_resumes_with_the_reference_bits(tmp_path):
    """The CLI on 8 devices, run twice (the second resumes at the last step and evaluates it again:
    metrics.jsonl keeps one record, the same value), against 2 x fsdp 2 devices in one process."""
    run_dir = tmp_path / "run"
    argv = ["resilient_jax.train", "--config", str(TINY), "--set", f"run.dir={run_dir}", "--set", "run.progress=plain",
            "--set", "train.steps=4", "--set", "checkpoint.every_steps=2",
            *[a for o in EVAL for a in ("--set", o)]]
    first = run_cli(*argv)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "eval at step 2: loss" in first.stdout and "eval at step 4: loss" in first.stdout
    again = run_cli(*argv)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "eval at step 4 again (resumed at an eval step): the same loss, bit for bit" in again.stdout
    assert "warning" not in again.stdout + again.stderr

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in records if r.get("event") == "eval"}
    assert sorted(evals) == [2, 4] and len([r for r in records if r.get("event") == "eval"]) == 2
    assert all(r["batches"] == 2 and r["tokens"] == 2 * 48 * 64 for r in evals.values())
    summary = read_summary(run_dir)
    assert summary["eval"]["last"]["step"] == 4 and summary["eval"]["source"] == "holdout"
    assert summary["eval"]["last"]["loss"] == evals[4]["loss"]
    assert {"shard": 14, "from_step": 0} in summary["data_position"]["quarantine"]  # never trained on
    assert {"shard": 15, "from_step": 0} in summary["data_position"]["quarantine"]
    assert f"eval loss {evals[4]['loss']:.4f} (step 4)" in again.stdout

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(run_dir / "tensorboard"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("eval/loss")] == [2, 4]
    assert [e.step for e in tb.Scalars("eval/perplexity")] == [2, 4]

    # Holding out a shard the run trained on is refused on resume, in one line, nothing written.
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    more = run_cli(*argv, "--set", "eval.holdout_shards=3", "--set", "train.steps=6",
                   "--allow-config-change", "eval.holdout_shards,train.steps")
    assert more.returncode == 2, more.stdout[-2000:] + more.stderr[-2000:]
    assert "error: config key eval.holdout_shards: the run being resumed trained on shard(s) 13" in more.stderr
    assert len(more.stderr.strip().splitlines()) == 1 and "Traceback" not in more.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before

    reference = Trainer(tiny_config(tmp_path / "ref", *EVAL, "train.steps=4", "checkpoint.enabled=false",
                                    "parallel.data=2", "parallel.fsdp=2"), devices=jax.devices()[:4]).run()
    assert [(r["step"], r["loss"]) for r in reference["eval"]["history"]] == [(2, evals[2]["loss"]),
                                                                               (4, evals[4]["loss"])]
    assert reference["params_fingerprint"] == summary["params_fingerprint"]
