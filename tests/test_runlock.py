"""RunLock: one run per run.dir; a live holder refuses, a dead one's lock is taken over with a warning."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from resilient_jax.runlock import LOCK_NAME, RunLock, RunLocked


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_lock_records_pid_and_host_and_is_removed_on_release(tmp_path):
    import os

    run_dir = tmp_path / "runs" / "run"
    with RunLock(run_dir) as lock:
        holder = json.loads((run_dir / LOCK_NAME).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        assert lock.took_over is None and lock.warning() is None
    assert not (run_dir / LOCK_NAME).exists()
    assert list(tmp_path.iterdir()) == []  # created by the lock and left empty: removed too


def test_a_held_lock_refuses_a_second_holder_naming_the_first(tmp_path):
    import os

    (tmp_path / "keep.txt").write_text("x")
    with RunLock(tmp_path):
        with pytest.raises(RunLocked, match=f"is in use by another run \\(pid {os.getpid()} on host "):
            RunLock(tmp_path).acquire()
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()  # not disturbed
    assert (tmp_path / "keep.txt").read_text() == "x" and tmp_path.is_dir()


def test_a_dead_pids_lock_on_this_host_is_taken_over_with_a_warning(tmp_path):
    pid = dead_pid()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
    with RunLock(tmp_path) as lock:
        assert lock.took_over["pid"] == pid
        assert f"took over the stale lock of pid {pid} on host {socket.gethostname()}" in lock.warning()


def test_a_lock_from_another_host_is_refused_not_guessed(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1234, "host": "other-host"}))
    with pytest.raises(RunLocked, match="locked by pid 1234 on host other-host .*delete the lock file"):
        RunLock(tmp_path).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == "other-host"


def test_a_killed_holders_flock_is_released_by_the_kernel(tmp_path):
    """SIGKILL leaves the file behind with the dead pid; the next run takes it over."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; from resilient_jax.runlock import RunLock; "
                               f"RunLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLocked, match=f"pid {holder.pid}"):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    with RunLock(tmp_path) as lock:
        assert lock.took_over["pid"] == holder.pid
