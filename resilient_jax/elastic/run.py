"""Driving an elastic run on one machine: controller + local launcher + host-fault schedule.

`python -m resilient_jax.train --config configs/cpu-4host.yaml` lands here when the config names
regions. The driver process hosts the controller (never a worker, never touches devices), starts
one worker per host (and, for `join_host@STEP`, one that registers at STEP), and writes the run's one
summary.json: the training summary from the final rank 0 plus what only the controller knows, and
the whole run's figures across invocations (run_history.json, kept by the controller).

The driver's console gets sentences and progress lines only; native output (the coordination
service's absl/XLA logs) and the controller's log go to run.dir/elastic/logs/controller.log, each
worker's output to its own log there. Ctrl-C or SIGTERM asks every worker to checkpoint at one
agreed step boundary and stop (exit 130 / 143 from train.py); a second one kills them at once --
orbax commits atomically, so the newest committed checkpoint is untouched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from resilient_jax.assignment import effective_policy
from resilient_jax import compile_cache, exported
from resilient_jax import faults as faults_lib
from resilient_jax.config import Config, ConfigError
from resilient_jax.elastic.controller import Controller
from resilient_jax.elastic import groups as groups_lib
from resilient_jax.elastic import tls as tls_lib
from resilient_jax.elastic.launcher import LocalLauncher
from resilient_jax.run_history import RunHistory

log = logging.getLogger(__name__)


class Interrupted(RuntimeError):
    """A second Ctrl-C / SIGTERM: the workers were killed at once, without a final checkpoint."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason  # "interrupted" | "preempted"


def host_plan(cfg: Config, *, spares: bool = False) -> list[tuple[str, str]]:
    """(host id, region) for every initial host in topology order: h0, h1, ... With spares=True,
    the spare hosts instead, numbered after the initial ones."""
    for region in cfg.topology.regions:
        if region.hosts < 1 or region.spares < 0:
            raise ConfigError(f"topology.regions: region {region.name!r} needs hosts >= 1 and spares >= 0")
    initial = [r.name for r in cfg.topology.regions for _ in range(r.hosts)]
    if not spares:
        return [(f"h{i}", region) for i, region in enumerate(initial)]
    extra = [r.name for r in cfg.topology.regions for _ in range(r.spares)]
    return [(f"h{len(initial) + i}", region) for i, region in enumerate(extra)]


def validate(cfg: Config) -> Config:
    """Refuse, naming the key, what an elastic run cannot do; the effective config (replica
    groups: fsdp spans the group, resilient_jax.elastic.groups.layout)."""
    # (Invariant mode on XLA_FLAGS that break it is refused by preflight.check_run, before this.)
    names = [r.name for r in cfg.topology.regions]
    if len(set(names)) != len(names):
        raise ConfigError("topology.regions: region names must be unique")
    tls_lib.check_config(cfg.runtime, cfg.runtime.token or os.environ.get("RESILIENT_JAX_TOKEN", ""))
    cfg = groups_lib.layout(cfg)
    # Without replica groups a host holds whole replicas: survivors rebuild the state from their
    # own shards (and a region is summed over its replicas).
    replica = max(cfg.parallel.fsdp, 1) * max(cfg.parallel.tensor, 1)
    per_host = cfg.topology.devices_per_host
    if cfg.parallel.hosts_per_replica == 1 and per_host % replica:
        raise ConfigError(
            f"parallel.fsdp x parallel.tensor = {replica} devices per replica, which topology.devices_per_host "
            f"({per_host}) cannot hold whole; an elastic run keeps each replica on one host: use fsdp x tensor "
            f"dividing {per_host}, or more devices per host, or parallel.hosts_per_replica > 1 (a replica group of "
            "hosts)")
    hosts = len(host_plan(cfg))
    faults = faults_lib.parse_faults(cfg.faults)
    # The local launcher starts exactly these hosts (and the joins injected): more than that can never
    # be alive. (On Ray, nodes beyond the plan may join, and its placement checks the cluster.)
    most = hosts + sum(f.kind == "join_host" for f in faults)
    if cfg.runtime.launcher == "local" and cfg.runtime.min_hosts > most:
        raise ConfigError(f"runtime.min_hosts {cfg.runtime.min_hosts} is more than the {most} hosts this run "
                          "launches (topology.regions): it would stop at its first change of world, the first "
                          f"death or straggler; set it to at most {most}, or describe more hosts")
    for fault in faults:
        # (A kill_region's region name is checked by preflight, which every run passes first.)
        if fault.kind in faults_lib.HOST_TARGETED and int(fault.target) >= hosts:
            raise ConfigError(f"fault {fault}: host {fault.target} does not exist (hosts 0..{hosts - 1})")
    return cfg


def make_launcher(cfg: Config, **kwargs):
    """The launcher named by runtime.launcher; both implement start_host / fence / stop."""
    if cfg.runtime.launcher == "ray":
        from resilient_jax.elastic.ray_launcher import RayLauncher

        return RayLauncher(cfg=cfg, **kwargs)
    return LocalLauncher(**kwargs)


def run_elastic(cfg: Config, *, resume: str | None = None, allow_config_change: list[str] = (),
                stop_at: int | None = None, launched_at: float | None = None) -> dict:
    """Run to the end (or a stop) and return the summary; its `stopped` is None, "interrupted",
    "preempted" or "stop_at". `resume`, `allow_config_change`, `stop_at` as for single-process runs.
    `launched_at`: time.monotonic() at the driver's launch (default: now), for cold_start_seconds."""
    launched_at = time.monotonic() if launched_at is None else launched_at
    cfg = validate(cfg)
    if warning := compile_cache.check(cfg.runtime.compile_cache, cfg.run.dir):
        print(warning, file=sys.stderr, flush=True)  # once, here; each worker notes it in its own log
    run_dir = Path(cfg.run.dir)
    logs = run_dir / "elastic" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    history = RunHistory.load(run_dir)
    # Names this invocation's folder of exported programs (resilient_jax.exported): written and
    # read by its own workers only, removed when it ends.
    invocation = secrets.token_hex(8)
    try:
        with _driver_logs_to(logs / "controller.log"):
            summary = _drive(cfg, run_dir, {"resume": resume, "allow_config_change": list(allow_config_change),
                                            "stop_at": stop_at, "invocation": invocation}, history, launched_at)
    finally:
        shutil.rmtree(exported.folder(run_dir, invocation), ignore_errors=True)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    if summary.get("stopped"):
        print(f"stopped ({summary['stopped']}) at step {summary['final_step']}; rerun the same command"
              f"{' without --stop-at' if summary['stopped'] == 'stop_at' else ''} to continue", flush=True)
    else:
        print(f"done: step {summary['final_step']} | generations {summary['generations']} | failures absorbed "
              f"{summary['failures_absorbed']} | restarts {summary['restarts']} | steps lost {summary['steps_lost']} | "
              f"fingerprint {summary['params_fingerprint'][:16]}{_eval_tail(summary)}", flush=True)
    return summary


def _eval_tail(summary: dict) -> str:
    last = (summary.get("eval") or {}).get("last")
    return "" if last is None else f" | eval loss {last['loss']:.4f} (step {last['step']})"


def _drive(cfg: Config, run_dir: Path, options: dict, history: RunHistory, launched_at: float) -> dict:
    token = cfg.runtime.token or os.environ.get("RESILIENT_JAX_TOKEN") or secrets.token_hex(16)
    plan = host_plan(cfg)
    server_tls = tls_lib.prepare(cfg.runtime, run_dir)
    controller = Controller(
        config_hash=cfg.hash, expected_hosts=len(plan), run_dir=run_dir, bind=cfg.runtime.bind,
        port=cfg.runtime.port, token=token, dead_after_seconds=cfg.runtime.dead_after_seconds,
        min_hosts=cfg.runtime.min_hosts, total_steps=cfg.train.steps,
        straggler_factor=cfg.runtime.straggler_factor, straggler_window=cfg.runtime.straggler_window,
        console=_console, run_options=options, history=history, tls=server_tls,
        assignment=effective_policy(cfg.runtime.assignment, cfg.parallel.reduction, len(plan)),
        coordination_heartbeat_seconds=cfg.runtime.coordination_heartbeat_seconds,
        hosts_per_replica=cfg.parallel.hosts_per_replica, min_replicas=cfg.runtime.min_replicas,
        cross_region_replica=cfg.parallel.allow_cross_region_replica, launched_at=launched_at,
        devices_per_host=cfg.topology.devices_per_host, regions=tuple(r.name for r in cfg.topology.regions),
    )
    # Written once the controller listens: an address it cannot listen on writes no config.
    config_path = run_dir / "elastic" / "config.json"
    config_path.write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True))
    controller_file = run_dir / "elastic" / "controller.json"
    controller_file.write_text(json.dumps({"url": controller.url, "pid": os.getpid(), "host": socket.gethostname(),
                                           "tls_ca": str(server_tls.ca.resolve()) if server_tls else None}))
    # For the operator's commands (`python -m resilient_jax.elastic drain`): readable by this user only.
    token_file = run_dir / "elastic" / "token"
    token_file.touch(mode=0o600)
    token_file.chmod(0o600)
    token_file.write_text(token)
    logs = run_dir / "elastic" / "logs"

    spares = host_plan(cfg, spares=True)
    joiners = join_plan(cfg, first_index=len(plan) + len(spares))
    joining = {host for host, *_ in joiners}

    def on_exit(host: str, code: int) -> None:
        verdict = exit_verdict(host, code, run_over=controller.summary is not None, joining=joining,
                               registered=host in controller.members)
        if verdict == "joiner_gone":
            _console(f"joining host {host} exited with code {code} before it joined; the run goes on "
                     f"without it (see {logs / f'{host}.log'})")
        elif verdict == "worker_exited":
            # A SIGKILL is a fault (injected or a fence), not an error the worker could have logged.
            controller.worker_exited(host, code,
                                     None if code == -signal.SIGKILL else last_error_line(logs / f"{host}.log"))

    try:  # a launcher checks its cluster first (too few nodes, wrong devices): fail before training
        launcher = make_launcher(cfg, controller_url=controller.url, token=token,
                                 tls_ca_pem=server_tls.ca_pem if server_tls else "", config_path=config_path,
                                 log_dir=logs, on_exit=on_exit, devices_per_host=cfg.topology.devices_per_host)
    except BaseException:
        controller.close()
        controller_file.unlink(missing_ok=True)
        raise
    controller.on_dead = launcher.fence  # a host declared dead must stay dead
    _console(f"resilient_jax: controller {controller.url} | {len(plan)} hosts"
             f"{f' + {len(spares)} spares' if spares else ''} in {len(cfg.topology.regions)} regions | "
             f"config {cfg.hash[:16]} | logs {logs}")
    stop = _StopOnSignal(controller, lambda: [launcher.fence(h) for h in
                                              list(controller.members) + [h for h, *_ in plan + spares + joiners]])
    started = time.perf_counter()
    try:
        with stop.installed():
            for host, region in plan:
                launcher.start_host(host, region)
            for host, region in spares:
                launcher.start_host(host, region, spare=True)
            for host, region, step in joiners:
                launcher.start_host(host, region, register_at_step=step)
            try:
                stop.waiting = True
                if stop.killed is not None:  # the signal came while the hosts were starting
                    raise stop.killed
                summary = controller.wait_finished()
                stop.waiting = False
            except _KillNow as e:
                stop.waiting = False  # a further signal while we clean up must not unwind this handler
                how = f"{e.reason} twice" if e.twice else f"{e.reason} before training started"
                controller.fail(f"{how}: workers killed at once")
                from resilient_jax.checkpoint import reader
                from resilient_jax.checkpoint.session import checkpoint_root

                steps = reader.list_steps(checkpoint_root(cfg)) if cfg.checkpoint.enabled else []
                raise Interrupted(e.reason, f"stopped at once ({how}): workers killed; "
                                  + (f"the newest checkpoint is step {steps[-1]}; " if steps else "no checkpoint yet; ")
                                  + "rerun the same command to continue") from None
    finally:
        codes = launcher.stop()
        report = controller.elastic_report()
        controller.close()
        controller_file.unlink(missing_ok=True)  # the run is over: `drain` and `status` say so
    # The whole run's figures (every invocation, see run_history), plus what happened inside this one.
    run = history.totals()
    return {**summary, **report, **run, "invocation_wall_seconds": time.perf_counter() - started,
            "worker_exit_codes": codes, "stopped": summary.get("stopped"),
            "restarts": run["restarts"] + report["restarts"], "steps_lost": run["steps_lost"] + report["steps_lost"]}


def _console(text: str) -> None:
    print(text, flush=True)


class _KillNow(BaseException):
    """Raised by the second signal in the waiting driver (a BaseException: nothing on the way catches it)."""

    def __init__(self, reason: str, twice: bool):
        super().__init__(reason)
        self.reason, self.twice = reason, twice


class _StopOnSignal:
    """SIGINT / SIGTERM in the driver: the first asks for an agreed stop, the second kills the workers."""

    def __init__(self, controller: Controller, kill_workers):
        self.controller, self.kill_workers = controller, kill_workers
        self.signals = 0
        self.waiting = False  # the driver is in wait_finished: the second signal may unwind it
        self.killed: _KillNow | None = None

    def __call__(self, signum, frame) -> None:
        del frame
        reason = "interrupted" if signum == signal.SIGINT else "preempted"
        self.signals += 1
        if self.controller.summary is not None:
            return  # the run is over; the driver is writing its summary
        if self.signals == 1 and self.controller.world is not None:
            self.controller.request_stop(reason)
            _console(f"{'Ctrl-C' if signum == signal.SIGINT else 'SIGTERM'}: every worker checkpoints at the next "
                     "step boundary and stops (Ctrl-C again to stop at once, without that checkpoint)")
            return
        self.kill_workers()
        self.killed = _KillNow(reason, twice=self.signals > 1)
        if self.waiting:
            raise self.killed

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


@contextlib.contextmanager
def _driver_logs_to(path: Path):
    """While the driver runs: the native code in this process (the coordination service writes
    absl warnings to fd 2) and the `resilient_jax` loggers write to `path`; sys.stderr, where
    the driver's own error lines go, stays the terminal."""
    sys.stderr.flush()
    terminal = os.dup(2)
    with open(path, "ab") as log_file:
        os.dup2(log_file.fileno(), 2)
    python_stderr = sys.stderr
    sys.stderr = open(terminal, "w", buffering=1, closefd=False, errors="backslashreplace")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s controller %(levelname)s %(message)s"))
    package_log = logging.getLogger("resilient_jax")
    level = package_log.level
    package_log.addHandler(handler)
    package_log.setLevel(logging.INFO)
    try:
        yield
    finally:
        package_log.removeHandler(handler)
        package_log.setLevel(level)
        handler.close()
        sys.stderr.flush()
        sys.stderr = python_stderr
        os.dup2(terminal, 2)
        os.close(terminal)


_ERROR_LINE = re.compile(r"^(error: |F\d{4} |[\w.]*(Error|Exception|Exit)\b)")


def last_error_line(log_path: Path, tail_bytes: int = 65536) -> str | None:
    """The last line of a worker's log that reads as an error (`error: ...`, a Python exception,
    an absl FATAL), for a worker that exited without reporting one."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    return next((line.strip() for line in reversed(lines) if _ERROR_LINE.match(line)), None)


def exit_verdict(host: str, code: int, *, run_over: bool, joining: set[str], registered: bool) -> str:
    """What a worker process's exit means to the run: "ignore" (exit 0, or the run is over),
    "joiner_gone" (a join_host fault's worker that died while it waited for its step: it belongs
    to no world, so the run goes on without it rather than failing as if a host of the first
    world could never register), or "worker_exited" (the controller decides: a member is dead, or
    the first world can never form)."""
    if code == 0 or run_over:
        return "ignore"
    if host in joining and not registered:
        return "joiner_gone"
    return "worker_exited"


def join_plan(cfg: Config, first_index: int) -> list[tuple[str, str, int]]:
    """join_host@STEP: (host, region, STEP) of each host that joins the run once it reaches STEP.
    Their workers start with the run and register at their step (worker --register-at-step)."""
    steps = sorted(f.step for f in faults_lib.parse_faults(cfg.faults) if f.kind == "join_host")
    regions = cfg.topology.regions
    return [(f"h{first_index + i}", regions[(first_index + i) % len(regions)].name, step)
            for i, step in enumerate(steps)]
