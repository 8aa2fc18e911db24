"""Launchers start worker processes and tell the controller when one dies.

`LocalLauncher` runs every host as a subprocess on this machine (CPU emulation: each worker gets
`topology.devices_per_host` host-platform devices). A Ray launcher implements the same three
methods on a cluster: `start_host`, `fence` (make sure a host declared dead stays dead), `stop`.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from resilient_jax.elastic.tls import CA_ENV as TLS_CA_ENV

log = logging.getLogger(__name__)


class LocalLauncher:
    def __init__(self, *, controller_url: str, token: str, config_path: Path, log_dir: Path,
                 on_exit, devices_per_host: int, tls_ca_pem: str = ""):
        self.controller_url = controller_url
        self.token = token
        self.tls_ca_pem = tls_ca_pem  # the CA workers verify an https controller against
        self.config_path = config_path
        self.log_dir = log_dir
        self.on_exit = on_exit  # (host, returncode) -> None
        self.devices_per_host = devices_per_host
        self.procs: dict[str, subprocess.Popen] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="launcher-watch", daemon=True)
        self._watcher.start()

    def start_host(self, host: str, region: str, spare: bool = False, register_at_step: int | None = None) -> None:
        """`register_at_step`: the worker starts now and registers once the run has completed that
        many steps (a host that becomes available then: join_host)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "resilient_jax.elastic", "worker", "--controller", self.controller_url,
               "--host", host, "--region", region, "--config-json", str(self.config_path),
               "--devices", str(self.devices_per_host)] + (["--spare"] if spare else [])
        if register_at_step is not None:
            cmd += ["--register-at-step", str(register_at_step)]
        env = {**os.environ, "RESILIENT_JAX_TOKEN": self.token, TLS_CA_ENV: self.tls_ca_pem}
        log_file = open(self.log_dir / f"{host}.log", "ab")
        with self._lock:
            self.procs[host] = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        log_file.close()
        log.info("started %s (%s%s), pid %d", host, region, ", spare" if spare else "", self.procs[host].pid)

    def fence(self, host: str) -> None:
        """A host declared dead must not come back into the world: SIGKILL it (also wakes a SIGSTOP)."""
        with self._lock:
            proc = self.procs.get(host)
        if proc is not None and proc.poll() is None:
            proc.kill()

    def pids(self) -> dict[str, int]:
        with self._lock:
            return {h: p.pid for h, p in self.procs.items()}

    def stop(self, timeout: float = 30.0) -> dict[str, int | None]:
        """Wait for workers to exit (they do after the run finishes), then kill stragglers."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        codes = {}
        for host, proc in list(self.procs.items()):
            try:
                codes[host] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                codes[host] = proc.wait()
        return codes

    def _watch(self) -> None:
        reported: set[str] = set()
        while not self._stopping.is_set():
            with self._lock:
                items = list(self.procs.items())
            for host, proc in items:
                code = proc.poll()
                if code is not None and host not in reported:
                    reported.add(host)
                    self.on_exit(host, code)
            time.sleep(0.05)
