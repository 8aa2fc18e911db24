"""Driving an elastic run on one machine: controller + local launcher + host-fault schedule.

`python -m resilient_jax.train --config configs/cpu-4host.yaml` lands here when the config names
regions. The driver process hosts the controller (never a worker, never touches devices), starts
one worker per host, starts extra hosts for `join_host@STEP`, and writes the run's one
summary.json: the training summary from the final rank 0 plus what only the controller knows.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from pathlib import Path

from resilient_jax import faults as faults_lib
from resilient_jax import gpu_env
from resilient_jax.config import Config, ConfigError
from resilient_jax.elastic.controller import Controller
from resilient_jax.elastic.launcher import LocalLauncher

log = logging.getLogger(__name__)

HOST_FAULTS = ("kill_host", "hang_host", "delay_host", "slow_host")


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


def validate(cfg: Config) -> None:
    # Refuse invariant mode on a GPU setup that cannot give it before any host starts.
    gpu_env.check_invariant_supported(cfg, gpu_env.detect_platform(), os.environ.get("XLA_FLAGS", ""))
    names = [r.name for r in cfg.topology.regions]
    if len(set(names)) != len(names):
        raise ConfigError("topology.regions: region names must be unique")
    hosts = len(host_plan(cfg))
    for fault in faults_lib.parse_faults(cfg.faults):
        if fault.kind in HOST_FAULTS and int(fault.target) >= hosts:
            raise ConfigError(f"fault {fault}: host {fault.target} does not exist (hosts 0..{hosts - 1})")
        if fault.kind == "kill_region" and fault.target not in names:
            raise ConfigError(f"fault {fault}: region {fault.target!r} is not in topology.regions ({', '.join(names)})")


def make_launcher(cfg: Config, **kwargs):
    """The launcher named by runtime.launcher; both implement start_host / fence / stop."""
    if cfg.runtime.launcher == "ray":
        from resilient_jax.elastic.ray_launcher import RayLauncher

        return RayLauncher(cfg=cfg, **kwargs)
    return LocalLauncher(**kwargs)


def run_elastic(cfg: Config) -> dict:
    validate(cfg)
    run_dir = Path(cfg.run.dir)
    (run_dir / "elastic").mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "elastic" / "config.json"
    config_path.write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True))
    token = cfg.runtime.token or os.environ.get("RESILIENT_JAX_TOKEN") or secrets.token_hex(16)
    plan = host_plan(cfg)
    controller = Controller(
        config_hash=cfg.hash, expected_hosts=len(plan), run_dir=run_dir, bind=cfg.runtime.bind,
        port=cfg.runtime.port, token=token, dead_after_seconds=cfg.runtime.dead_after_seconds,
        min_hosts=cfg.runtime.min_hosts, total_steps=cfg.train.steps,
        straggler_factor=cfg.runtime.straggler_factor, straggler_window=cfg.runtime.straggler_window,
    )
    (run_dir / "elastic" / "controller.json").write_text(json.dumps({"url": controller.url, "pid": os.getpid()}))
    # For the operator's commands (`python -m resilient_jax.elastic drain`): readable by this user only.
    token_file = run_dir / "elastic" / "token"
    token_file.touch(mode=0o600)
    token_file.chmod(0o600)
    token_file.write_text(token)

    def on_exit(host: str, code: int) -> None:
        if code != 0 and controller.summary is None:
            controller.mark_dead(host, f"process exited with code {code}")

    try:  # a launcher checks its cluster first (too few nodes, wrong devices): fail before training
        launcher = make_launcher(cfg, controller_url=controller.url, token=token, config_path=config_path,
                                 log_dir=run_dir / "elastic" / "logs", on_exit=on_exit,
                                 devices_per_host=cfg.topology.devices_per_host)
    except BaseException:
        controller.close()
        raise
    controller.on_dead = launcher.fence  # a host declared dead must stay dead
    print(f"resilient_jax: controller {controller.url} | {len(plan)} hosts"
          f"{f' + {sum(r.spares for r in cfg.topology.regions)} spares' if any(r.spares for r in cfg.topology.regions) else ''} in "
          f"{len(cfg.topology.regions)} regions | config {cfg.hash}", flush=True)
    for host, region in plan:
        launcher.start_host(host, region)
    spares = host_plan(cfg, spares=True)
    for host, region in spares:
        launcher.start_host(host, region, spare=True)
    joins = threading.Thread(target=_schedule_joins, args=(cfg, controller, launcher, len(plan) + len(spares)),
                             daemon=True)
    joins.start()
    started = time.perf_counter()
    try:
        summary = controller.wait_finished()
    finally:
        codes = launcher.stop()
        report = controller.elastic_report()
        controller.close()
    summary = {**summary, **report, "wall_seconds": time.perf_counter() - started,
               "worker_exit_codes": codes}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    print(f"done: step {summary['final_step']} | generations {summary['generations']} | failures absorbed "
          f"{summary['failures_absorbed']} | restarts {summary['restarts']} | steps lost {summary['steps_lost']} | "
          f"fingerprint {summary['params_fingerprint'][:16]}", flush=True)
    return summary


def _schedule_joins(cfg: Config, controller: Controller, launcher: LocalLauncher, first_index: int) -> None:
    """join_host@STEP: start one more host once the run has reached STEP."""
    pending = sorted(f.step for f in faults_lib.parse_faults(cfg.faults) if f.kind == "join_host")
    index = first_index
    while pending and controller.summary is None and controller.error is None:
        if controller.status()["step"] >= pending[0]:
            pending.pop(0)
            region = cfg.topology.regions[index % len(cfg.topology.regions)].name
            launcher.start_host(f"h{index}", region)
            index += 1
        time.sleep(0.1)
