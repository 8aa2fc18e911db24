"""A new user's first hour, with real processes: the README's first command on a fresh copy of the
repo, Ctrl-C and rerun, two runs into one run.dir.

The Ctrl-C and lock runs share a persistent JAX compilation cache (test-private), as
tests/test_checkpoint_resume.py does; the reference fingerprint is computed in-process, afresh.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, TINY, read_summary, tiny_config

pytestmark = pytest.mark.slow

STEPS = 20
COMMON = (f"train.steps={STEPS}", "train.log_every=1", "checkpoint.every_steps=10", "run.progress=plain")
INTERRUPTED_LINE = re.compile(r"^stopped \(interrupted\) at step (\d+); rerun the same command to continue$")


SUMMARY_KEYS = {"final_step", "final_loss", "first_loss", "wall_seconds", "tokens_per_second", "config_hash",
                "params_fingerprint", "dataset_version"}


def assert_main_job_outputs(run_dir: Path, summary: dict, stdout: str, dataset_version: str) -> None:
    """What the README's main job (tiny, 200 steps, 8 emulated devices) writes and prints."""
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["final_step"] == 200
    assert summary["final_loss"] <= 0.7 * summary["first_loss"], summary  # loss down >= 30%
    assert summary["mesh"]["data"] == 8  # parallel.devices: 8 emulated CPU devices
    assert summary["dataset_version"] == dataset_version  # the default dataset, built on first use
    config = json.loads((run_dir / "config.json").read_text())
    assert config["config_hash"] == summary["config_hash"] and config["config_hash"] in stdout
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in steps] == [1] + list(range(10, 201, 10))  # step k: k steps completed
    assert {"loss", "loss_last", "lr", "grad_norm", "step_seconds", "tokens_per_s", "time", "mfu"} <= steps[-1].keys()
    assert steps[0]["loss"] == summary["first_loss"] and steps[-1]["loss_last"] == summary["final_loss"]
    assert summary["mfu"] is None and steps[-1]["mfu"] is None  # a CPU: no peak known, none set
    assert any(p.name.startswith("events.out.tfevents") for p in (run_dir / "tensorboard").iterdir())


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax-cache")),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, default_dataset):
    """The uninterrupted reference run, in-process."""
    from resilient_jax.trainer import Trainer

    return Trainer(tiny_config(tmp_path_factory.mktemp("straight") / "run", *COMMON)).run()


def train_cmd(run_dir: Path) -> list[str]:
    sets = [a for o in (*COMMON, f"run.dir={run_dir}") for a in ("--set", o)]
    return [sys.executable, "-m", "resilient_jax.train", "--config", str(TINY), *sets]


def start(run_dir: Path, env) -> subprocess.Popen:
    return subprocess.Popen(train_cmd(run_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env=env)


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    # Only whole lines: the run may be writing the last one while we read (seen in CI).
    text = path.read_text()
    records = [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]
    return [r["step"] for r in records if "loss" in r]


def wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run exited ({proc.returncode}) before {what}:\n{out[-2000:]}\n{err[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


def rerun(run_dir: Path, env) -> subprocess.CompletedProcess:
    return subprocess.run(train_cmd(run_dir), capture_output=True, text=True, cwd=REPO, env=env, timeout=300)


def interrupt_after(run_dir, env, step: int, ctrl_c: int):
    """Starts the run, and once `step` is logged sends `ctrl_c` SIGINTs 10 ms apart: (proc, out, err)."""
    proc = start(run_dir, env)
    try:
        wait_for(lambda: step in logged_steps(run_dir), proc, f"step {step} was logged")
        for i in range(ctrl_c):
            time.sleep(0.01 if i else 0)
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, out, err


def test_ctrl_c_checkpoints_exits_130_and_the_rerun_is_bitwise(tmp_path, straight, env):
    run_dir = tmp_path / "run"
    at = random.Random().randint(2, STEPS - 5)  # a different step boundary each run of the suite
    proc, out, err = interrupt_after(run_dir, env, at, ctrl_c=1)
    assert proc.returncode == 130, f"interrupted at step {at}: exit {proc.returncode}\n{out[-2000:]}\n{err[-2000:]}"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    # One line says where it stopped and what to do (the run's other output is progress lines).
    notices = [line for line in (out + err).splitlines() if line.startswith("stopped")]
    assert len(notices) == 1 and INTERRUPTED_LINE.match(notices[0]), out[-2000:] + err
    stopped_at = int(INTERRUPTED_LINE.match(notices[0]).group(1))
    assert at <= stopped_at < STEPS, (at, stopped_at)  # step `at` was logged, so it had completed
    stopped = read_summary(run_dir)
    assert stopped["stopped"] == "interrupted" and stopped["final_step"] == stopped_at
    assert stopped["checkpoint"]["saves"][-1] == stopped_at  # committed at the step boundary

    resumed = rerun(run_dir, env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["final_step"] == STEPS
    assert summary["params_fingerprint"] == straight["params_fingerprint"]
    assert sorted(logged_steps(run_dir)) == list(range(1, STEPS + 1))  # step k = k completed steps


def test_a_second_ctrl_c_exits_at_once_and_corrupts_nothing(tmp_path, straight, env):
    """Two Ctrl-C 10 ms apart: the second lands while the first one's checkpoint is being written
    (or just after): exit 130 at once; whatever is on disk is either committed or ignored.

    The second Ctrl-C ends the process with os._exit, which leaves the disk as a SIGKILL does;
    tests/test_checkpoint_kill.py kills saves at random moments of every phase and shows a partial
    save is never listed or loaded. Here: the same holds end to end, and the rerun is bitwise."""
    from resilient_jax.checkpoint import reader

    run_dir = tmp_path / "run"
    proc, out, err = interrupt_after(run_dir, env, 12, ctrl_c=2)
    assert proc.returncode == 130, f"exit {proc.returncode}\n{out[-2000:]}\n{err[-2000:]}"
    assert "Traceback" not in err, err
    root = run_dir / "checkpoints"
    for step in reader.list_steps(root):  # every listed checkpoint is whole and loads
        assert reader.missing_field(root / str(step)) is None, step
        reader.read_context(root / str(step), reader.read_manifest(root / str(step)))

    resumed = rerun(run_dir, env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_summary(run_dir)["params_fingerprint"] == straight["params_fingerprint"]


def _lock_holder(run_dir) -> int | None:
    try:
        return json.loads((run_dir / "run.lock").read_text()).get("pid")
    except (OSError, ValueError):
        return None


def test_a_second_run_into_a_busy_run_dir_exits_2_and_the_first_is_undisturbed(tmp_path, straight, env):
    run_dir = tmp_path / "run"
    first = start(run_dir, env)
    try:
        # The lock file exists before it is locked and its holder written: wait for the holder's pid.
        wait_for(lambda: _lock_holder(run_dir) == first.pid, first, "the first run took the lock")
        # Held still while the second one starts: with its program in the compile cache the first
        # run can finish its 20 steps sooner than a second Python process imports JAX (seen on a
        # busy 2-core machine), and a lock no longer held proves nothing. A stopped process is
        # still the lock's live holder; it goes on, undisturbed, once continued.
        os.kill(first.pid, signal.SIGSTOP)
        try:
            second = rerun(run_dir, env)
            first_alive = first.poll() is None
        finally:
            os.kill(first.pid, signal.SIGCONT)
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first_alive, "the first run ended before the second one was refused: the test proved nothing"
    assert second.returncode == 2, second.stderr
    lines = [line for line in second.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and f"is in use by another run (pid {first.pid} on host" in lines[0], second.stderr
    assert first.returncode == 0, err[-3000:]
    summary = read_summary(run_dir)
    assert summary["final_step"] == STEPS and summary["params_fingerprint"] == straight["params_fingerprint"]
    assert sorted(logged_steps(run_dir)) == list(range(1, STEPS + 1))  # step k = k completed steps
    assert not (run_dir / "run.lock").exists()


# -- the README's first command, verbatim, on a fresh copy ----------------------------------------------


def readme_first_command() -> str:
    """The first ```bash block of README.md's "Two commands" section."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Two commands", 1)[1]
    return re.search(r"```bash\n(.+?)\n```", section, re.S).group(1).strip()


def with_this_interpreter(command: str) -> str:
    """The command with its venv + pip install steps dropped and `.venv/bin/python` replaced by this
    interpreter (resilient_jax and its dependencies are installed in it already)."""
    steps = [s.strip() for s in command.split("&&")]
    assert steps[0] == "python3 -m venv .venv" and steps[1].startswith(".venv/bin/pip install -e ."), steps
    rest = " && ".join(steps[2:])
    assert rest.startswith(".venv/bin/python "), rest
    return rest.replace(".venv/bin/python ", f"{sys.executable} ", 1)


def fresh_copy(dest: Path) -> Path:
    """The repo's tracked and unignored files (what a clone plus uncommitted work holds), nothing else."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def test_readme_first_command_on_a_fresh_copy_trains_then_resumes_at_once(tmp_path, request):
    command = with_this_interpreter(readme_first_command())
    assert "--config configs/tiny.yaml" in command  # relative: resolved against the copy
    copy = fresh_copy(tmp_path / "clone")
    assert not (copy / "runs").exists()
    # The copy's own sources come first on sys.path (`python -m` puts the cwd there).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    assert env.get("RESILIENT_JAX_CACHE"), "conftest sets a private dataset cache"

    first = subprocess.run(command, shell=True, cwd=copy, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    run_dir = copy / "runs" / "tiny"
    summary = read_summary(run_dir)
    assert_main_job_outputs(run_dir, summary, first.stdout, request.getfixturevalue("default_dataset").version)
    config = json.loads((run_dir / "config.json").read_text())["config"]
    assert config["run"]["dir"] == str(run_dir)  # the resolved absolute path is what is recorded
    steps_before = sorted(logged_steps(run_dir))
    checkpoints_before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert "200" in checkpoints_before

    second = subprocess.run(command, shell=True, cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    rerun = read_summary(run_dir)
    assert rerun["final_step"] == 200
    # The summary still describes the whole run, not the invocation that ran nothing.
    assert (rerun["first_loss"], rerun["final_loss"]) == (summary["first_loss"], summary["final_loss"])
    assert sorted(logged_steps(run_dir)) == steps_before  # it ran no step
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == checkpoints_before
    assert "Traceback" not in first.stderr + second.stderr
