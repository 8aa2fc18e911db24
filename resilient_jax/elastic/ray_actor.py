"""The Ray actor that runs one elastic worker on its node (`runtime.launcher: ray`).

`HostActor` starts the ordinary worker CLI as a subprocess pinned to the actor's node, returns its
exit code from `wait()`, and kills it on `kill()`. The subprocess dies with its actor
(PR_SET_PDEATHSIG) and gets the raylet's CPU priority back. `remote_host_actor()` is the
`ray.remote` class, made on first use so that importing this module does not import Ray.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


def _prepare_child(libc, parent_pid: int, niceness: int) -> None:
    """preexec_fn of the worker: SIGKILL it when the thread that started it (alive as long as the
    child is) or its process dies -- a worker must not outlive its actor or node; and give it back
    the raylet's CPU priority (Ray runs its worker processes, hence this actor, at nice 15, which
    would make the training process lose every contest for the CPU). Best effort: without the
    permission to lower niceness the worker keeps the actor's."""
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
    except OSError:
        pass


def _raylet_niceness() -> int:
    try:
        return os.getpriority(os.PRIO_PROCESS, int(os.environ["RAY_RAYLET_PID"]))
    except (KeyError, ValueError, OSError):
        return 0


# The actor's own environment is the node's plus what Ray sets for its worker processes; the
# training process gets the node's, without Ray's per-task settings.
_RAY_ONLY_ENV = ("OMP_NUM_THREADS", "PYTHONBREAKPOINT")


class HostActor:
    """Runs one worker subprocess on this node; `wait()` returns its exit code. (Threaded actor:
    `kill()` and `info()` run while `wait()` blocks.)"""

    def __init__(self, host: str, argv: list[str], config_json: str, log_dir: str, env: dict, cwd: str):
        import ray

        self.host = host
        self.tmp = tempfile.mkdtemp(prefix=f"resilient-jax-{host}-")
        config_path = Path(self.tmp) / "config.json"
        config_path.write_text(config_json)
        self.log_path = self._log_path(Path(log_dir), host, Path(self.tmp))
        self.node_id = ray.get_runtime_context().get_node_id()
        self.ip = ray.util.get_node_ip_address()
        cmd = [sys.executable, "-m", "resilient_jax.elastic", "worker", *argv, "--config-json", str(config_path)]
        node_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k not in _RAY_ONLY_ENV}
        full_env = {**node_env, **env}
        self.code: int | None = None
        self.proc: subprocess.Popen | None = None
        self._done = threading.Event()
        self._started = threading.Event()
        self._error: str | None = None
        with open(self.log_path, "ab") as f:
            f.write(f"resilient_jax ray: {host} on node {self.node_id} ({self.ip}), actor pid {os.getpid()}\n"
                    .encode())
        # The child's PDEATHSIG follows the thread that forks it, so that thread lives as long as the child.
        threading.Thread(target=self._run, args=(cmd, full_env, cwd), name=f"{host}-worker", daemon=True).start()
        self._started.wait()
        if self._error:
            raise RuntimeError(self._error)

    @staticmethod
    def _log_path(log_dir: Path, host: str, private_dir: Path) -> Path:
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            path = log_dir / f"{host}.log"
            with open(path, "ab"):
                pass
            return path
        except OSError:
            # The actor's own private directory: a fixed name under /tmp could be another account's,
            # with a link at <host>.log pointing where it wants this log appended.
            return private_dir / f"{host}.log"

    def _run(self, cmd: list[str], env: dict, cwd: str) -> None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork: the child only calls it
        pid, nice = os.getpid(), _raylet_niceness()
        try:
            with open(self.log_path, "ab") as log_file:
                self.proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                             cwd=cwd if os.path.isdir(cwd) else self.tmp,
                                             preexec_fn=lambda: _prepare_child(libc, pid, nice))
        except OSError as e:
            self._error = f"could not start the worker for {self.host}: {e}"
            self.code = 127
            self._started.set()
            self._done.set()
            return
        self._started.set()
        self.code = self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._done.set()

    def info(self) -> dict:
        return {"node_id": self.node_id, "ip": self.ip, "pid": self.proc.pid if self.proc else None,
                "log": str(self.log_path)}

    def wait(self) -> int:
        self._done.wait()
        return self.code

    def kill(self) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # SIGKILL, which also ends a SIGSTOPped worker
        return self.code


_REMOTE = None


def remote_host_actor():
    global _REMOTE
    if _REMOTE is None:
        import ray

        _REMOTE = ray.remote(HostActor)
    return _REMOTE
