"""An elastic run as a new user meets it: the console, Ctrl-C and rerun, a changed config on
resume, a worker that fails. Real driver and worker processes on 127.0.0.1, real signals.

One run carries most assertions (each invocation of cpu-4host costs a minute or more on 2 cores):
Ctrl-C -> rerun with a changed key (refused) -> rerun, Ctrl-C twice (workers killed) -> rerun,
SIGTERM to every process (a cluster-wide preemption) -> rerun with the change allowed, which must
end on the fault-free fingerprint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from resilient_jax.checkpoint import reader

from conftest import REPO, read_summary, run_cli

pytestmark = pytest.mark.slow

STEPS = 40
CPU4 = str(REPO / "configs" / "cpu-4host.yaml")
# absl / XLA / gloo lines (e.g. "W1201 08:32:10.167040 ... coordination_service.cc:185] ...").
NATIVE = re.compile(r"^[IWEF]\d{4} |coordination_service|gloo", re.M)
PROGRESS = re.compile(r"^step (\d+)/%d \| loss [\d.]+ \| [\d,]+ tokens/s \| 4 hosts \| generation 0$" % STEPS, re.M)
# A fault that cannot move the trajectory (a 0.2 s wait on one host), to change the config hash.
HARMLESS_CHANGE = ("--fault", "delay_host:1@25-25:0.2")


@pytest.fixture(scope="module")
def reference(fault_free):
    """The fault-free trajectory in one process on 8 devices (invariance makes it the elastic one)."""
    return fault_free(f"train.steps={STEPS}", "checkpoint.enabled=false")["params_fingerprint"]


def train_args(run_dir, *extra: str) -> list[str]:
    return ["resilient_jax.train", "--config", CPU4, "--set", f"run.dir={run_dir}", "--set", f"train.steps={STEPS}",
            "--set", "train.log_every=5", "--set", "checkpoint.every_steps=5", *extra]


def interrupt(tmp_path, name: str, args: list[str], *, after_step: int, times: int,
              signum: int = signal.SIGINT) -> tuple[int, str, str]:
    """Start the driver in its own process group, wait for the progress line of `after_step` or
    later, then send `signum` `times` times to the whole group (driver and workers): SIGINT is a
    terminal's Ctrl-C, SIGTERM a scheduler preempting every process of the job."""
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, stdout=o, stderr=e, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while not any(int(s) >= after_step for s in PROGRESS.findall(out.read_text())):
            assert proc.poll() is None, f"the run ended before step {after_step}:\n{out.read_text()}\n{err.read_text()}"
            assert time.monotonic() < deadline, f"no progress line of step {after_step}:\n{out.read_text()}"
            time.sleep(0.2)
        for _ in range(times):
            os.killpg(proc.pid, signum)
            time.sleep(0.1)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return code, out.read_text(), err.read_text()


def metric_steps(run_dir) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "loss" in r]


def tensorboard_steps(run_dir) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()
    return [event.step for event in accumulator.Scalars("train/loss")]


def test_ctrl_c_stops_at_an_agreed_step_and_reruns_continue_to_the_fault_free_fingerprint(tmp_path, reference):
    run_dir = tmp_path / "run"

    # 1. Ctrl-C: every worker checkpoints at one step boundary; one line; exit 130.
    code, out, err = interrupt(tmp_path, "first", train_args(run_dir), after_step=10, times=1)
    assert code == 130, out + err
    assert "generation 0 formed: 4 hosts (h0, h1, h2, h3)" in out
    (stop,) = re.findall(r"^stopped \(interrupted\) at step (\d+); rerun the same command to continue$", out, re.M)
    stop = int(stop)
    assert 10 <= stop < STEPS
    assert "Traceback" not in out + err and not NATIVE.search(out + err), out + err
    assert reader.list_steps(run_dir / "checkpoints")[-1] == stop
    assert read_summary(run_dir)["stopped"] == "interrupted" and read_summary(run_dir)["final_step"] == stop
    drain = run_cli("resilient_jax.elastic", "drain", "--run", str(run_dir), "--host", "h1")
    assert drain.returncode == 2 and drain.stderr.count("\n") == 1
    assert f"the run is over: stopped (interrupted) at step {stop}" in drain.stderr

    # 2. A changed config key is refused, naming the key, the flag and the failing worker's log.
    refused = run_cli(*train_args(run_dir, *HARMLESS_CHANGE), timeout=300)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    (line,) = refused.stderr.splitlines()
    assert line.startswith("error: the run failed: worker h") and "faults" in line
    assert "--allow-config-change faults" in line and re.search(r"\(log: .*/elastic/logs/h\d\.log\)$", line)
    assert reader.list_steps(run_dir / "checkpoints")[-1] == stop

    # 3. The same command continues from the stop, until Ctrl-C twice kills the workers at once.
    code, out, err = interrupt(tmp_path, "third", train_args(run_dir), after_step=stop + 5, times=2)
    assert code == 130, out + err
    assert f"generation 0 resumes from the checkpoint of step {stop}" in out
    assert re.search(r"stopped at once \(interrupted twice\): workers killed; the newest checkpoint is step \d+", err)
    assert "Traceback" not in out + err and not NATIVE.search(out + err), out + err
    killed_at = max(int(s) for s in PROGRESS.findall(out))
    newest = reader.list_steps(run_dir / "checkpoints")[-1]

    # 4. A cluster-wide preemption: SIGTERM to the driver and every worker at once. One checkpoint,
    #    at one agreed step, committed by all four hosts; exit 143.
    code, out, err = interrupt(tmp_path, "fourth", train_args(run_dir), after_step=newest + 3, times=1,
                               signum=signal.SIGTERM)
    assert code == 143, out + err
    assert f"generation 0 resumes from the checkpoint of step {newest}" in out
    (preempted,) = re.findall(r"^stopped \(preempted\) at step (\d+); rerun the same command to continue$", out, re.M)
    preempted = int(preempted)
    assert newest < preempted < STEPS
    assert "Traceback" not in out + err and not NATIVE.search(out + err), out + err
    assert reader.list_steps(run_dir / "checkpoints")[-1] == preempted
    assert sorted(p.name for p in (run_dir / "checkpoints" / str(preempted) / "commit").iterdir()) == [
        f"process_{i}.json" for i in range(4)]
    assert read_summary(run_dir)["stopped"] == "preempted"

    # 5. With the change allowed, the run continues from the newest committed checkpoint to the end.
    final = run_cli(*train_args(run_dir, *HARMLESS_CHANGE, "--allow-config-change", "faults"), timeout=600)
    assert final.returncode == 0, final.stdout + final.stderr
    assert f"resumes from the checkpoint of step {preempted}" in final.stdout
    assert "config changed (allowed): faults" in final.stdout
    assert not NATIVE.search(final.stdout + final.stderr)
    summary = read_summary(run_dir)
    assert summary["final_step"] == STEPS and summary["params_fingerprint"] == reference
    config = json.loads((run_dir / "checkpoints" / str(STEPS) / "config" / "config.json").read_text())
    assert config["history"][-1]["keys"] == ["faults"]
    # Each step once in metrics.jsonl and TensorBoard, although steps after `newest` ran twice.
    assert metric_steps(run_dir) == sorted(set(metric_steps(run_dir))) and metric_steps(run_dir)[-1] == STEPS
    assert tensorboard_steps(run_dir) == sorted(set(tensorboard_steps(run_dir)))
    # What happened, counted: the clean stop is no restart, the kill is one; its lost steps counted.
    resumes = summary["resumed_from"]
    assert [(r["step"], r["reason"]) for r in resumes] == [
        (stop, "interrupted"), (newest, "crash"), (preempted, "preempted")]
    # The kill came at least at the last progress line (steps are logged every 5).
    assert summary["restarts"] == 1 and summary["steps_lost"] == resumes[1]["steps_lost"]
    assert killed_at - newest <= resumes[1]["steps_lost"] <= killed_at + 5 - newest
    (start,) = summary["events"]
    assert start["generation"] == 0 and start["resume_step"] == preempted and start["from_checkpoint"]
    status = run_cli("resilient_jax.elastic", "status", "--run", str(run_dir), check=True).stdout
    assert status.startswith(f"the run is over: finished at step {STEPS}")


def test_a_failing_worker_is_named_with_its_error_and_log(tmp_path, default_dataset):
    """Every worker fails on a shard whose bytes changed (a real dataset problem): the driver's
    stderr says the first failure -- the worker, its error, its log -- not a host count."""
    from resilient_jax.data.manifest import load_manifest

    shutil.copytree(default_dataset.root, tmp_path / "data")  # a private copy to damage
    shard = load_manifest(tmp_path / "data").shard_path(3)
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    run_dir = tmp_path / "run"
    proc = run_cli("resilient_jax.train", "--config", CPU4, "--set", f"run.dir={run_dir}",
                   "--set", f"data.dataset={tmp_path / 'data'}", timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.splitlines()
    host = re.match(r"error: the run failed: worker (h\d) failed: modified shard file (\S+): its sha256", line)
    assert host and host.group(2) == str(shard), line
    log = run_dir / "elastic" / "logs" / f"{host.group(1)}.log"
    assert line.endswith(f"(log: {log})") and f"modified shard file {shard}" in log.read_text()
    assert "hosts left" not in proc.stdout + proc.stderr and not NATIVE.search(proc.stdout + proc.stderr)
