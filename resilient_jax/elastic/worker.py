"""A worker: one host of an elastic run. It trains, and when the world changes it re-forms in-process.

The worker's life is one state machine:

    REGISTER -> WAIT_WORLD -> JOIN -> ADOPT_STATE -> TRAIN --(done)--> FINISHED
                    ^                                  |
                    |      (collective failed, or      |
                    +------ the members agreed to grow)-+  REFORM: copy state to host, leave

TRAIN runs the two-phase step. A failed collective raises inside `compute`, which never touches
the state, so the state of the last completed step is still on this host's devices: it is copied
to host memory, the JAX world is left (shutdown, clear backends) and the controller is asked for
the next world. There every member adopts the state of the member that completed the most steps
(a bit-exact broadcast), and training resumes at the next step: zero steps lost.

Growth is agreed inside the world: after every step each member contributes the controller's
latest join signal to a tiny all-gather; when the maximum is set, every member re-forms at the same
step boundary, and the newcomer receives the state from a peer, never from disk.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("resilient_jax.worker")


@dataclass
class HostState:
    """What survives a re-formation: the training state in host memory, and where training stands."""

    state: object | None = None  # TrainState of numpy arrays
    completed_step: int = -1
    data_position: dict | None = None


class Heartbeat(threading.Thread):
    """Reports liveness and step timings on its own thread; training never waits for it."""

    def __init__(self, client, host: str, interval: float):
        super().__init__(name="heartbeat", daemon=True)
        self.client, self.host, self.interval = client, host, interval
        self.generation, self.step, self.step_seconds = -1, -1, 0.0
        self.join_signal = 0
        self._stop = threading.Event()

    def run(self) -> None:
        from resilient_jax.elastic.channel import ControllerError

        while not self._stop.wait(self.interval):
            try:
                reply = self.client.call("/heartbeat", retry_seconds=0, host=self.host, generation=self.generation,
                                         step=self.step, step_seconds=self.step_seconds)
                self.join_signal = int(reply.get("join_signal", 0))
            except ControllerError as e:
                # Briefly unreachable: keep training; membership has not changed as far as we know.
                log.debug("heartbeat failed: %s", e)

    def stop(self) -> None:
        self._stop.set()


class HostFaults:
    """Fires this host's injected faults at their step, from a timer so they land mid-step."""

    def __init__(self, faults, host_index: int, region: str, client, host: str):
        self.pending = [f for f in faults if (f.kind in ("kill_host", "hang_host") and int(f.target) == host_index)
                        or (f.kind == "kill_region" and f.target == region)]
        self.client, self.host = client, host

    def arm(self, step: int) -> None:
        for fault in [f for f in self.pending if f.step == step]:
            self.pending.remove(fault)
            self.client.call("/fault", retry_seconds=2, host=self.host, kind=fault.kind, step=step)
            sig = signal.SIGSTOP if fault.kind == "hang_host" else signal.SIGKILL
            threading.Timer(0.01, os.kill, args=(os.getpid(), sig)).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m resilient_jax.elastic worker")
    parser.add_argument("--controller", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--region", default="local")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.host} %(levelname)s %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save step at INFO

    from resilient_jax.config import from_dict

    cfg = from_dict(json.loads(Path(args.config_json).read_text()))
    from resilient_jax.elastic import world as world_lib

    world_lib.configure_process(cfg.runtime.collective_timeout_seconds, args.devices)
    from resilient_jax.elastic.channel import ControllerClient, ControllerError

    client = ControllerClient(args.controller, os.environ.get("RESILIENT_JAX_TOKEN", ""))
    try:
        client.call("/register", host=args.host, region=args.region, devices=args.devices, config_hash=cfg.hash)
    except ControllerError as e:
        print(f"error: the controller refused {args.host}: {e}", file=sys.stderr)
        return 3
    heartbeat = Heartbeat(client, args.host, cfg.runtime.heartbeat_seconds)
    heartbeat.start()
    try:
        return Worker(cfg, args.host, args.region, client, heartbeat).run()
    finally:
        heartbeat.stop()


class Worker:
    def __init__(self, cfg, host: str, region: str, client, heartbeat: Heartbeat):
        from resilient_jax import faults as faults_lib

        self.cfg, self.host, self.region = cfg, host, region
        self.client, self.heartbeat = client, heartbeat
        index = int(host[1:]) if host[1:].isdigit() else -1
        self.faults = HostFaults(faults_lib.parse_faults(cfg.faults), index, region, client, host)
        from resilient_jax.trainer import RunTotals

        self.kept = HostState()
        self.generation = -1
        self.totals = RunTotals()
        self.metrics = None
        self.started = time.perf_counter()

    def run(self) -> int:
        while True:
            world = self._wait_world()
            if world is None:
                return 0
            outcome = self._train_in(world)
            if outcome == "finished":
                return 0
            # Out of the old world (left in _train_in); tell the controller where we stand.
            self.client.call("/reform", retry_seconds=60, host=self.host, generation=self.generation,
                             completed_step=self.kept.completed_step, data_position=self.kept.data_position,
                             reason=outcome)

    def _wait_world(self) -> dict | None:
        while True:
            reply = self.client.call("/world", retry_seconds=60, host=self.host, after=self.generation)
            if "world" in reply:
                return reply["world"]
            if reply.get("evicted") or reply.get("finished"):
                log.info("leaving the run: %s", "evicted" if reply.get("evicted") else "finished")
                return None
            if "error" in reply:
                log.error("the run failed: %s", reply["error"])
                return None

    def _train_in(self, world: dict) -> str:
        """Train in one world until the run finishes ("finished") or the world must change
        ("failure" / "join"). Leaves the world before returning."""
        import jax

        from resilient_jax.elastic import transfer
        from resilient_jax.elastic import world as world_lib
        from resilient_jax.trainer import StepLoop, Trainer

        self.generation = world["generation"]
        members = world["members"]
        rank = members.index(self.host)
        world_lib.join(world["coordinator"], len(members), rank)
        self.heartbeat.generation = self.generation
        log.info("generation %d: rank %d of %d, resume at step %d", self.generation, rank, len(members),
                 world["resume_step"])
        trainer = Trainer(self.cfg, devices=jax.devices())
        ckpt = trainer.checkpoints(generation=self.generation,
                                   regions={i: world["regions"][h] for i, h in enumerate(members)})
        loop = None
        try:
            if world["source"] is None:
                # A new run, or one resuming from the persistent checkpoint in run.dir.
                resumed = trainer.restore(ckpt)
                state = resumed.state if resumed else trainer.fresh_state()
                start, position = (resumed.step, resumed.position) if resumed else (0, None)
            else:
                # Everyone adopts the state of the member that completed the most steps: survivors
                # from host memory, newcomers from that peer (not from disk).
                template = self.kept.state if self.kept.state is not None else trainer.host_state_template()
                source_rank = members.index(world["source"])
                state = trainer.state_from_host(transfer.broadcast(template, is_source=rank == source_rank))
                log.info("adopted state from %s after step %d (%s)", world["source"], world["resume_step"] - 1,
                         "own copy" if world["source"] == self.host else "from a peer, over the collective, not from disk")
                start = world["resume_step"]
                position = _position_from_dict(world["data_position"])
            trainer.precompile(state)
            world_lib.barrier(f"compiled-{self.generation}", timeout_seconds=300)
            loop = StepLoop(trainer, self._metrics(trainer, start), self.totals, ckpt, start_step=start,
                            position=position)
            return self._steps(trainer, loop, ckpt, state, start)
        finally:
            if loop is not None:
                loop.close()
            world_lib.leave(before_reset=ckpt.close)

    def _steps(self, trainer, loop, ckpt, state, step: int) -> str:
        import jax
        from jax.experimental import multihost_utils

        from resilient_jax.elastic import transfer

        first = True
        try:
            while step < self.cfg.train.steps:
                self.faults.arm(step)
                t0 = time.perf_counter()
                state = loop.step(state, step)
                self.kept.completed_step = step
                self.heartbeat.step, self.heartbeat.step_seconds = step, time.perf_counter() - t0
                if first:
                    self.client.call("/progress", retry_seconds=5, host=self.host, generation=self.generation,
                                     step=step)
                    first = False
                step += 1
                # Grow only when every member agrees, at the same step boundary.
                agreed = int(multihost_utils.process_allgather(np.int32(self.heartbeat.join_signal)).max())
                if agreed > self.generation and step < self.cfg.train.steps:
                    self._keep(transfer.to_host(state), loop)
                    return "join"
            ckpt.finish(step, state, loop.data_position())
            summary = trainer.summarize(state, self.totals, time.perf_counter() - self.started, loop.data_position())
            summary["final_step"] = step
            if jax.process_index() == 0:
                self.client.call("/done", retry_seconds=30, host=self.host, summary=summary)
            return "finished"
        except jax.errors.JaxRuntimeError as e:
            log.warning("step %d failed in generation %d: %s", step, self.generation, str(e).splitlines()[0][:200])
            # compute() never donates: `state` is still the state after step-1, on our devices.
            self._keep(transfer.to_host(state), loop)
            return "failure"

    def _keep(self, host_state, loop) -> None:
        self.kept.state = host_state
        self.kept.data_position = loop.position_at(self.kept.completed_step + 1).to_dict()

    def _metrics(self, trainer, start: int):
        """Rank 0 of the current world writes the run's metrics; it keeps its log across worlds."""
        import jax

        from resilient_jax.metrics import MetricsLog

        if jax.process_index() != 0:
            return MetricsLog(trainer.run_dir, self.cfg.train.steps, enabled=False)
        if self.metrics is None:
            trainer.write_run_config()
            self.metrics = MetricsLog(trainer.run_dir, self.cfg.train.steps, progress="plain", start_step=start)
        return self.metrics


def _position_from_dict(d: dict | None):
    from resilient_jax.data import DataPosition

    return None if d is None else DataPosition.from_dict(d)


def _topology(world: dict) -> dict:
    return {
        "generation": world["generation"],
        "hosts": [{"host": h, "region": world["regions"][h], "devices": world["devices_per_host"][h]}
                  for h in world["members"]],
    }


if __name__ == "__main__":
    sys.exit(main())
