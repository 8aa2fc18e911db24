"""Bitwise resume through the CLI: 2N steps straight == N steps, a stop, a resume, N more.

Stops: a clean `--stop-at N`; a SIGKILL after the step-N checkpoint committed (steps after it
are redone); a SIGTERM (preemption: checkpoint, exit 143) followed by a resume on 4 instead of 8
devices. Each must end with the straight run's params fingerprint and per-step losses.
metrics.jsonl is rewound on resume, so it holds exactly one record per step.

The subprocesses share a persistent JAX compilation cache (a test-private directory), which cuts
each run from ~14 s to ~5 s; loading a cached executable does not change the bits, and the
reference run compiles afresh in-process, so a cache that did would fail these tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilient_jax.checkpoint.commit import is_committed

from conftest import REPO, TINY, read_summary, run_cli, tiny_config

N = 10
COMMON = ("train.steps=20", "train.log_every=1", f"checkpoint.every_steps={N}", "run.progress=plain")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax-cache")),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def train_args(run_dir: Path, *extra: str) -> list[str]:
    sets = [a for o in (*COMMON, f"run.dir={run_dir}") for a in ("--set", o)]
    return ["resilient_jax.train", "--config", str(TINY), *sets, *extra]


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, default_dataset):
    """The reference: 20 steps without a stop (in-process: same trajectory, no interpreter start)."""
    from resilient_jax.trainer import Trainer

    run_dir = tmp_path_factory.mktemp("straight") / "run"
    summary = Trainer(tiny_config(run_dir, *COMMON)).run()
    return summary, losses(run_dir)


def assert_same_trajectory(run_dir: Path, straight) -> dict:
    summary, straight_losses = straight
    resumed = read_summary(run_dir)
    assert resumed["final_step"] == 20 and resumed["resumed_from"]
    assert resumed["params_fingerprint"] == summary["params_fingerprint"]
    assert losses(run_dir) == straight_losses  # every step 1..20, bitwise
    return resumed


def test_clean_stop_and_resume_is_bitwise(tmp_path, straight, env):
    run_dir = tmp_path / "run"
    stop = run_cli(*train_args(run_dir, "--stop-at", str(N)), env=env, check=True)
    assert "stopped (stop_at): step 10" in stop.stdout
    assert read_summary(run_dir)["stopped"] == "stop_at"
    resume = run_cli(*train_args(run_dir), env=env, check=True)  # no --resume: the checkpoint dir has one
    assert f"resumed at step {N} from" in resume.stdout  # a sentence on the console, JSON in metrics.jsonl
    assert_same_trajectory(run_dir, straight)


def _wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) before {what}:\n{proc.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_sigkill_after_the_step_n_checkpoint_then_resume_is_bitwise(tmp_path, straight, env):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", *train_args(run_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    # The directory appears at orbax's rename; the step is a checkpoint once its commit files are written.
    _wait_for(lambda: is_committed(run_dir / "checkpoints" / str(N)), proc, "the step-10 checkpoint committed")
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert not (run_dir / "summary.json").exists() and not (run_dir / "checkpoints" / "20").exists(), \
        "the run finished before the kill"
    resume = run_cli(*train_args(run_dir), env=env, check=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    event = next(r for r in records if r.get("event") == "resume")
    assert event["step"] == N  # steps after 10 that ran before the kill were dropped and redone
    assert_same_trajectory(run_dir, straight)


def test_sigterm_saves_then_resume_on_four_devices_records_the_topology(tmp_path, straight, env):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", *train_args(run_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    # The directory appears at orbax's rename; the step is a checkpoint once its commit files are written.
    _wait_for(lambda: is_committed(run_dir / "checkpoints" / str(N)), proc, "the step-10 checkpoint committed")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.fail(f"the run finished before SIGTERM arrived:\n{out[-2000:]}")
    assert proc.returncode == 143, out[-3000:]
    stopped = read_summary(run_dir)
    assert stopped["stopped"] == "preempted" and N <= stopped["final_step"] < 20
    assert stopped["checkpoint"]["saves"][-1] == stopped["final_step"]  # the preemption checkpoint

    # A device-count change needs no --allow-config-change: it is resharded and recorded.
    run_cli(*train_args(run_dir, "--set", "parallel.devices=4"), env=env, check=True)
    resumed = assert_same_trajectory(run_dir, straight)  # invariant reduction: 4 devices, same bits
    assert resumed["mesh"]["data"] == 4
    topology = json.loads((run_dir / "checkpoints" / "20" / "topology" / "topology.json").read_text())
    change = topology["history"][-1]
    assert change["step"] == stopped["final_step"]
    assert change["from"]["devices_per_host"] == 8 and change["to"]["devices_per_host"] == 4
    config = json.loads((run_dir / "checkpoints" / "20" / "config" / "config.json").read_text())
    assert config["history"][-1]["keys"] == ["parallel.devices"]


def test_two_processes_save_together_and_one_process_resumes(tmp_path, straight, env):
    """Orbax saves run on every process (process 0 alone writes the JSON fields); a checkpoint
    written by 2 processes x 4 devices resumes in 1 process x 8 devices, bitwise."""
    from conftest import free_port

    run_dir = tmp_path / "run"
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", *train_args(run_dir, "--set", "parallel.devices=4", "--stop-at", str(N))],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
            env={**env, "RESILIENT_JAX_COORDINATOR": f"127.0.0.1:{port}", "RESILIENT_JAX_NUM_PROCESSES": "2",
                 "RESILIENT_JAX_PROCESS_ID": str(pid)},
        )
        for pid in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    topology = json.loads((run_dir / "checkpoints" / str(N) / "topology" / "topology.json").read_text())
    assert topology["process_count"] == 2 and [h["process"] for h in topology["hosts"]] == [0, 1]
    run_cli(*train_args(run_dir, "--allow-config-change", "parallel.devices"), env=env, check=True)
    resumed = assert_same_trajectory(run_dir, straight)
    assert resumed["processes"] == 1
