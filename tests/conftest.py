"""Test-wide setup: 8 emulated CPU devices (before JAX initialises), a private dataset cache, one
compile cache for the session, the fault-free reference runs, helpers."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"

# Datasets built by the tests live in one cache per test session, never in the user's cache.
os.environ.setdefault("RESILIENT_JAX_CACHE", tempfile.mkdtemp(prefix="rj-test-cache-"))
# One persistent compile cache for the whole session: every run a test starts with
# runtime.compile_cache "auto" (the default) uses it, and so does this process (below), so each
# distinct program (config incl. train.steps, whose lr schedule is compiled into the apply program;
# mesh; world size) compiles once per session instead of once per run, per re-formed world and per
# in-process Trainer. Loading a cached executable does not change the bits: the elastic runs load
# theirs (programs of other device assignments, hence other keys than this process's) and must end
# on the fingerprints of the fault-free references, compiled or loaded in this process.
if not os.environ.get("RESILIENT_JAX_COMPILE_CACHE"):  # a CI job may point it at a kept directory
    _SESSION_COMPILE_CACHE = tempfile.mkdtemp(prefix="rj-test-compile-cache-")
    os.environ["RESILIENT_JAX_COMPILE_CACHE"] = _SESSION_COMPILE_CACHE
else:
    _SESSION_COMPILE_CACHE = None

import jax  # noqa: E402  (after the environment is set)

from resilient_jax import compile_cache  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# In-process Trainers are the bulk of the fast tests, and many share programs (the same tiny model
# and mesh: the step's compute program, whatever train.steps or the checkpoint settings): a 4-step
# run took 13.2 s compiling, 3.1 s loading; the fast tests 833 s -> 623 s (2026-12-06). If JAX moves
# the private function the cache swaps, the session still runs (on JAX's own cache keys here) and
# tests/test_private_apis.py names what moved.
try:
    compile_cache.enable("auto", tempfile.gettempdir())
except AttributeError as e:
    import warnings

    warnings.warn(f"the test session's compile cache is off in this process: {e}")


def pytest_sessionfinish(session, exitstatus):
    if _SESSION_COMPILE_CACHE is not None:  # made for this session: nothing else reads it later
        shutil.rmtree(_SESSION_COMPILE_CACHE, ignore_errors=True)


def tiny_config(run_dir: Path, *overrides: str):
    from resilient_jax.config import load_config

    return load_config(TINY, [f"run.dir={run_dir}", "run.progress=quiet", *overrides])


def run_cli(*args: str, env: dict | None = None, timeout: float = 600, check: bool = False):
    """`python -m resilient_jax.<args>` in a subprocess; returns CompletedProcess with text output."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def read_summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_multiprocess(num_processes: int, devices_per_process: int, run_dir: Path, *overrides: str,
                     timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """One training job as N processes on 127.0.0.1, each with its own emulated CPU devices."""
    port = free_port()
    procs = []
    for pid in range(num_processes):
        env = {
            **os.environ,
            "RESILIENT_JAX_COORDINATOR": f"127.0.0.1:{port}",
            "RESILIENT_JAX_NUM_PROCESSES": str(num_processes),
            "RESILIENT_JAX_PROCESS_ID": str(pid),
        }
        cmd = [sys.executable, "-m", "resilient_jax.train", "--config", str(TINY),
               "--set", f"parallel.devices={devices_per_process}", "--set", f"run.dir={run_dir}",
               "--set", "run.progress=plain", *[a for o in overrides for a in ("--set", o)]]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                      cwd=REPO))
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r in results:
        assert r.returncode == 0, f"a process failed:\n{r.stdout[-3000:]}"
    return results


@pytest.fixture(scope="session")
def default_dataset():
    """The default dataset (stdlib sources), built once per session in the test cache."""
    from resilient_jax.config import DataConfig
    from resilient_jax.trainer import resolve_dataset

    return resolve_dataset(DataConfig())


@pytest.fixture(scope="session")
def fault_free(tmp_path_factory, default_dataset):
    """`fault_free(*overrides)`: the summary of the uninterrupted tiny run with those overrides, in
    this process on 8 devices -- the trajectory every host count and fault must end on (invariant
    reduction). Computed once per session for each distinct list of overrides, as several modules
    compare against the same one."""
    from resilient_jax.trainer import Trainer

    runs: dict[tuple[str, ...], dict] = {}

    def summary(*overrides: str) -> dict:
        if overrides not in runs:
            cfg = tiny_config(tmp_path_factory.mktemp("fault-free"), *overrides)
            runs[overrides] = Trainer(cfg, devices=jax.devices()[:8]).run()
        return runs[overrides]

    return summary
