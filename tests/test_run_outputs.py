"""What a run writes survives resumes and says what happened: metrics.jsonl and TensorBoard hold
each step once, summary.json spans every invocation (first loss, seconds, resumes, restarts, steps
lost), the throughput figures are there, the plots are drawn, the console stays readable."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import jax
import pytest

from resilient_jax import flops
from resilient_jax.checkpoint.commit import is_committed
from resilient_jax.config import ModelConfig
from resilient_jax.metrics import MetricsLog, StepWindow, describe, rewind_metrics
from resilient_jax.run_history import RunHistory

from conftest import REPO, TINY, read_summary, run_cli, tiny_config

STEPS, STOP, OLDER = 24, 17, 10
PEAK = 1e9  # run.peak_flops: a CPU has no entry in the peak table
COMMON = (f"train.steps={STEPS}", "train.log_every=1", f"checkpoint.every_steps={OLDER}", f"run.peak_flops={PEAK}")


def metrics_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def logged_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in metrics_records(run_dir) if "loss" in r]


def tensorboard_steps(run_dir: Path, tag: str = "train/loss") -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()
    return [event.step for event in accumulator.Scalars(tag)]


# -- a run stopped at 17, then resumed from the older checkpoint at 10 (in-process, one Trainer) ----------


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, default_dataset):
    """--stop-at 17 (checkpoints 10 and 17), then --resume 10: steps 11..17 run again.

    One Trainer runs both invocations (what the CLI does in two processes), so the step compiles
    once; the second `run()` opens metrics, TensorBoard and the run history afresh from disk.
    """
    from resilient_jax.trainer import Trainer

    run_dir = tmp_path_factory.mktemp("outputs") / "run"
    trainer = Trainer(tiny_config(run_dir, *COMMON), devices=jax.devices()[:4], stop_at=STOP)
    first = trainer.run()
    after_first = {"metrics": logged_steps(run_dir), "tensorboard": tensorboard_steps(run_dir),
                   "summary": first}
    trainer.stop_at, trainer.resume = None, str(OLDER)
    second = trainer.run()
    return run_dir, after_first, second


def test_every_step_once_in_metrics_and_tensorboard_after_resuming_from_an_older_checkpoint(resumed_run):
    run_dir, after_first, _ = resumed_run
    assert after_first["metrics"] == after_first["tensorboard"] == list(range(1, STOP + 1))
    assert logged_steps(run_dir) == list(range(1, STEPS + 1))
    # TensorBoard: the second writer's purge step (11) hides 11..17 of the abandoned branch.
    assert tensorboard_steps(run_dir) == list(range(1, STEPS + 1))
    assert tensorboard_steps(run_dir, "train/tokens_per_s") == list(range(1, STEPS + 1))
    resume = next(r for r in metrics_records(run_dir) if r.get("event") == "resume")
    assert resume["step"] == OLDER and resume["dropped_metrics"] == STOP - OLDER and resume["after"] == "stop_at"
    assert resume["steps_lost"] == STOP - OLDER


def test_summary_describes_the_whole_run(resumed_run):
    run_dir, after_first, summary = resumed_run
    records = {r["step"]: r for r in metrics_records(run_dir) if "loss" in r}
    assert summary["final_step"] == STEPS and summary == read_summary(run_dir)
    assert summary["first_loss"] == records[1]["loss"]  # step 1 ran in the first invocation
    assert summary["final_loss"] == records[STEPS]["loss_last"]
    assert summary["invocations"] == 2
    first_wall = after_first["summary"]["invocation_wall_seconds"]
    assert summary["wall_seconds"] == pytest.approx(first_wall + summary["invocation_wall_seconds"], rel=0.02)
    assert summary["train_seconds"] > after_first["summary"]["train_seconds"] > 0
    # Resuming at 10 after the first invocation reached 17: 7 steps recomputed; a clean stop, no restart.
    (resume,) = summary["resumed_from"]
    assert (resume["step"], resume["reason"], resume["steps_lost"], resume["restart"]) == (OLDER, "stop_at", 7, False)
    assert summary["steps_lost"] == 7 and summary["restarts"] == 0
    # tokens trained: 17 + 14 steps (the 7 recomputed ones included) over the train seconds.
    tokens = (STOP + STEPS - OLDER) * 48 * 64
    assert summary["tokens"] == tokens
    assert summary["tokens_per_second"] == pytest.approx(tokens / summary["train_seconds"])


def test_throughput_fields_per_line_and_in_the_summary(resumed_run):
    run_dir, _, summary = resumed_run
    records = [r for r in metrics_records(run_dir) if "loss" in r]
    expected = flops.flops_per_token(ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=176), 64)
    for r in records:
        assert r["flops_per_token"] == expected
        assert r["flops_per_s"] == pytest.approx(expected * r["tokens_per_s"])
        assert r["mfu"] == pytest.approx(r["flops_per_s"] / (PEAK * 4))  # 4 devices
        assert r["memory_bytes_in_use"] is None  # the CPU backend reports no memory stats
        assert r["time"] > 1.7e9 and r["window_steps"] == 1 and r["data_wait_seconds"] >= 0
    # Compiling is an event of each invocation, not a slow first step.
    compiles = [r for r in metrics_records(run_dir) if r.get("event") == "compile"]
    assert [c["step"] for c in compiles] == [0, OLDER] and all(c["seconds"] > 0 for c in compiles)
    assert summary["compile_seconds"] == pytest.approx(sum(c["seconds"] for c in compiles))
    # The first invocation compiled (the second reused its Trainer's executables): step 1 carries
    # none of that time; compiling (or loading the test session's cached program) takes a second or
    # more, a step of this model a fraction of one.
    assert records[0]["step"] == 1 and records[0]["step_seconds"] < compiles[0]["seconds"]
    assert summary["flops_per_token"] == expected and summary["peak_flops_per_device"] == PEAK
    assert summary["mfu"] == pytest.approx(summary["model_flops_per_second"] / (PEAK * 4))
    assert summary["model_flops_per_second"] == pytest.approx(expected * summary["tokens_per_second"])


def test_plot_writes_readable_pngs_and_refuses_a_dir_without_metrics(resumed_run, tmp_path):
    run_dir, _, _ = resumed_run
    proc = run_cli("resilient_jax.plot", str(run_dir), "--out", str(tmp_path / "plots"), check=True)
    for name in ("loss.png", "lr.png", "throughput.png"):
        png = tmp_path / "plots" / name
        assert str(png) in proc.stdout
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    empty = run_cli("resilient_jax.plot", str(tmp_path / "nothing"))
    assert empty.returncode == 2 and empty.stdout == ""
    assert empty.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'nothing' / 'metrics.jsonl'} not found: RUN_DIR must be a run.dir that training wrote to"]


def test_inspect_into_a_closed_pipe_exits_quietly(resumed_run):
    run_dir, _, _ = resumed_run
    # The reader is gone before the first byte is written: the inspect's first print hits EPIPE.
    read_end, write_end = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "resilient_jax.checkpoint", "inspect", str(run_dir / "checkpoints")],
                            stdout=write_end, stderr=subprocess.PIPE, cwd=REPO)
    os.close(write_end)
    os.close(read_end)
    _, err = proc.communicate(timeout=120)
    assert err == b"" and proc.returncode == 141
    shell = subprocess.run(f"{sys.executable} -m resilient_jax.checkpoint inspect {run_dir / 'checkpoints'} | head -1",
                           shell=True, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert shell.stderr == "" and shell.stdout.startswith(f"checkpoint {run_dir / 'checkpoints' / str(STEPS)}")


# -- a real crash: SIGKILL, then the rerun counts a restart and the steps it lost --------------------------


@pytest.mark.slow
def test_sigkill_counts_a_restart_and_the_steps_lost(tmp_path, default_dataset):
    run_dir = tmp_path / "run"
    sets = [a for o in (*COMMON, f"run.dir={run_dir}", "run.progress=plain") for a in ("--set", o)]
    args = [sys.executable, "-m", "resilient_jax.train", "--config", str(TINY), *sets]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        deadline = time.monotonic() + 300
        # Step 13 logged and the step-10 save committed (under load the async commit can lag steps).
        while (not (run_dir / "metrics.jsonl").is_file() or max(logged_steps(run_dir), default=0) < OLDER + 3
               or not is_committed(run_dir / "checkpoints" / str(OLDER))):
            assert proc.poll() is None, f"the run exited ({proc.returncode}) before step {OLDER + 3}"
            assert time.monotonic() < deadline, "timed out waiting for step 13"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_at = json.loads((run_dir / "run_history.json").read_text())["invocations"][-1]["last_step"]
    assert OLDER + 3 <= killed_at < STEPS and not (run_dir / "summary.json").exists()

    run_cli("resilient_jax.train", "--config", str(TINY), *sets, "--stop-at", "20", check=True)
    again = run_cli("resilient_jax.train", "--config", str(TINY), *sets, check=True)
    summary = read_summary(run_dir)
    assert [(r["step"], r["reason"], r["restart"], r["steps_lost"]) for r in summary["resumed_from"]] == [
        (OLDER, "crash", True, killed_at - OLDER), (20, "stop_at", False, 0)]
    assert summary["restarts"] == 1 and summary["steps_lost"] == killed_at - OLDER
    assert summary["first_loss"] == metrics_records(run_dir)[1]["loss"]  # [0] is the compile event
    assert logged_steps(run_dir) == tensorboard_steps(run_dir) == list(range(1, STEPS + 1))
    assert f"resumed at step 20 from {run_dir / 'checkpoints' / '20'} after a clean stop (stop_at)\n" in again.stdout


# -- the console: messages never share a line with the bar -------------------------------------------------

CONSOLE_SCRIPT = """
import sys, time
from pathlib import Path
from resilient_jax.metrics import MetricsLog
log = MetricsLog(Path(sys.argv[1]), 6, progress="bar", start_step=2)
log.event({"event": "resume", "step": 2, "checkpoint": "ckpt/2", "dropped_metrics": 3})
for step in range(3, 7):
    time.sleep(0.05)
    log.log(step, {"loss": 1.0 / step, "lr": 1e-3, "tokens_per_s": 1e4})
    log.advance()
    log.console(f"message after step {step}")
log.close()
log.console("the closing line")
"""


def _visible_lines(raw: str) -> list[str]:
    """What a terminal shows: each \\r returns to column 0 and overwrites."""
    lines = []
    for line in raw.split("\n"):
        buf, col = [], 0
        for ch in line:
            if ch == "\r":
                col = 0
                continue
            if col < len(buf):
                buf[col] = ch
            else:
                buf.append(ch)
            col += 1
        lines.append("".join(buf).rstrip())
    return lines


def test_progress_bar_and_messages_never_share_a_line(tmp_path):
    controller, terminal = os.openpty()  # a terminal 100 columns wide
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
    proc = subprocess.Popen([sys.executable, "-c", CONSOLE_SCRIPT, str(tmp_path / "run")], stdin=terminal,
                            stdout=terminal, stderr=terminal, cwd=REPO)
    os.close(terminal)
    chunks = []
    while True:
        try:
            data = os.read(controller, 4096)
        except OSError:  # EIO: the child closed its side
            break
        if not data:
            break
        chunks.append(data)
    os.close(controller)
    assert proc.wait(timeout=60) == 0
    lines = [line for line in _visible_lines(b"".join(chunks).decode(errors="replace")) if line]
    messages = [line for line in lines if "message" in line or "resumed" in line or "closing" in line]
    assert messages == ["resumed at step 2 from ckpt/2; dropped 3 metrics records of later steps",
                        *[f"message after step {s}" for s in range(3, 7)], "the closing line"]
    assert any("6/6" in line for line in lines)  # the bar was drawn
    assert lines[-1] == "the closing line"


# -- units ------------------------------------------------------------------------------------------------


def test_rewind_metrics_keeps_records_up_to_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "loss": s} for s in range(1, 7)] + [{"event": "quarantine", "step": 5}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 7, "lo')  # torn by a kill
    assert rewind_metrics(path, 4) == 4  # steps 5, 6, the event of step 5, the torn line
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]


def test_metrics_log_opened_at_a_step_drops_later_records(tmp_path):
    log = MetricsLog(tmp_path, 10, progress="quiet")
    for step in range(1, 6):
        log.log(step, {"loss": float(step)})
    log.close()
    log = MetricsLog(tmp_path, 10, progress="quiet", start_step=3)
    assert log.dropped == 2
    log.log(4, {"loss": 40.0})
    log.close()
    assert [(r["step"], r["loss"]) for r in metrics_records(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    assert tensorboard_steps(tmp_path) == [1, 2, 3, 4]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    assert [e.value for e in accumulator.Scalars("train/loss")] == [1.0, 2.0, 3.0, 40.0]


def test_step_window_averages_the_loss_and_keeps_the_last():
    window = StepWindow()
    for loss, seconds in [(3.0, 0.5), (2.0, 0.25), (1.0, 0.25)]:
        window.add(loss, seconds, 0.01)
    values = window.values(tokens_per_step=100)
    assert values["loss"] == 2.0 and values["loss_last"] == 1.0 and values["window_steps"] == 3
    assert values["tokens_per_s"] == 300.0 and values["step_seconds"] == pytest.approx(1 / 3)
    assert values["data_wait_seconds"] == pytest.approx(0.03)


def test_run_history_counts_crashes_and_recomputed_steps_once(tmp_path):
    history = RunHistory.load(tmp_path)
    history.begin(0)
    for step in range(1, 74):
        history.step_done(step, loss=10.0 - step / 10, seconds=0.1, data_wait=0.0, tokens=5)
    # SIGKILL at step 73 (nothing ends the invocation); the newest checkpoint is step 50.
    history = RunHistory.load(tmp_path)
    history.begin(50, checkpoint="ckpt/50")
    for step in range(51, 61):
        history.step_done(step, loss=1.0, seconds=0.1, data_wait=0.0, tokens=5)
    # Killed again at 60, back to 50 once more: 10 more steps lost, not 23 again.
    history = RunHistory.load(tmp_path)
    history.begin(50, checkpoint="ckpt/50")
    history.step_done(51, loss=1.0, seconds=0.1, data_wait=0.0, tokens=5)
    history.end("stop_at")
    history = RunHistory.load(tmp_path)
    history.begin(51, checkpoint="ckpt/51")
    history.end("done")
    totals = RunHistory.load(tmp_path).totals()
    assert [(r["step"], r["reason"], r["steps_lost"], r["restart"]) for r in totals["resumed_from"]] == [
        (50, "crash", 23, True), (50, "crash", 10, True), (51, "stop_at", 0, False)]
    assert totals["restarts"] == 2 and totals["steps_lost"] == 33
    assert totals["first_loss"] == pytest.approx(9.9) and totals["tokens"] == 5 * (73 + 10 + 1)
    assert totals["train_seconds"] == pytest.approx(0.1 * 84)
    # The last invocation ran no step: the run's final loss is still step 51's, from the one that ran it.
    assert totals["final_loss"] == 1.0
    # A fresh start over a finished run begins a new history.
    history = RunHistory.load(tmp_path)
    history.begin(0)
    assert history.totals()["invocations"] == 1 and history.totals()["first_loss"] is None
    assert not list(tmp_path.glob(".*.tmp"))  # written by rename: no temporary left behind


def test_flops_formula_counts_the_matmul_parameters(resumed_run):
    _, _, summary = resumed_run  # num_params: counted on the real model's parameters
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=176)
    embedding_and_norms = 256 * 64 + 2 * 2 * 64 + 64  # input table; two RMSNorms per layer + the final one
    assert flops.matmul_params(cfg) == summary["num_params"] - embedding_and_norms
    assert flops.flops_per_token(cfg, 64) == 6 * flops.matmul_params(cfg) + 12 * 2 * 64 * 64


def test_peak_table_and_mfu():
    assert flops.peak_flops("NVIDIA H200", "bfloat16") == 989e12
    assert flops.peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert flops.peak_flops("NVIDIA A100-SXM4-80GB", "bfloat16") == 312e12
    assert flops.peak_flops("cpu", "float32") is None
    assert flops.peak_flops("cpu", "float32", override=2e12) == 2e12
    assert flops.mfu(1e12, 2e12, 4) == 0.125 and flops.mfu(1e12, None, 4) is None
    assert flops.device_memory_in_use(jax.devices("cpu")[:2]) is None


def test_events_read_as_sentences():
    text = describe({"event": "config_change", "step": 10, "keys": ["optimizer.lr"], "allowed": ["optimizer.lr"],
                     "from": {"optimizer.lr": 0.003}, "to": {"optimizer.lr": 0.001}})
    assert text == "config changed at step 10: optimizer.lr 0.003 -> 0.001 (allowed by --allow-config-change optimizer.lr)"
    assert describe({"event": "quarantine", "step": 21, "shard": 3, "samples": [1, 2]}) == (
        "step 21: data shard 3 gave non-finite values (2 samples); quarantined, the step is re-read without it")
    assert "{" not in describe({"event": "resume", "step": 10, "checkpoint": "c/10"})
