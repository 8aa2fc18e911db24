"""Injected host faults (resilient_jax.faults), fired by the worker process on itself.

Test and drill machinery, kept apart from the worker's logic: the worker calls one hook at each
point where a fault may land -- before a step (`before_step`, which also fires a kill waiting
for the background compile of the next worlds), once it has joined a world (`joined`), as a
world moves state to its members (`adopting`), after a checkpoint save has started (`saving`),
and as rank 0 reports the run's end (`reporting`) -- and this class decides whether a fault of
this host fires there. A fault is announced to the controller first (its timings count from that
moment), then fired: kills and hangs inside a step from a timer so that they land in the step's
collectives; kills at a moment at once, so that the peers meet the death exactly there; delays
as a wait before the step.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np


SAVE_STARTED_SECONDS = 10


class HostFaults:
    def __init__(self, faults, host_index: int, region: str, client, host: str):
        mine = [f for f in faults if (f.kind in ("kill_host", "hang_host") and int(f.target) == host_index)
                or (f.kind == "kill_region" and f.target == region)]
        self.pending = [f for f in mine if f.moment == "step"]
        self.after_precompile = [f for f in mine if f.moment == "precompiled"]
        self.at_moment = [f for f in mine if f.moment not in ("step", "precompiled")]
        self.delays = [f for f in faults if f.kind in ("delay_host", "slow_host") and int(f.target) == host_index]
        self.announced: set = set()
        self.baseline: dict = {}  # slow_host: this host's own step time just before the slowdown
        self.client, self.host = client, host

    def before_step(self, step: int, clock, share: float = 1.0, precompiled: int = -1) -> None:
        """Delays of `step`, then its kills and hangs, armed to land inside the step. `precompiled`:
        the newest generation whose rank 0 has compiled its likely next worlds ahead (-1: none)."""
        self.delay(step, clock, share)
        self.arm(step)
        for fault in [f for f in self.after_precompile if f.step <= precompiled]:
            self.after_precompile.remove(fault)
            self._fire_in_step(fault, step)

    def delay(self, step: int, clock, share: float = 1.0) -> None:
        """Hold this host back before `step` (its heartbeats go on: it is slow, not dead).

        `share`: the shards this host holds in the step / its uniform share. A slow host is slow at
        its work: its extra time scales with the shards it holds (none: no delay).
        """
        for fault in self.delays:
            if fault.kind == "slow_host" and step >= fault.step and fault not in self.baseline:
                self.baseline[fault] = float(np.median(clock.recent)) if clock.recent else 0.0
            seconds = fault.delay_before(step, self.baseline.get(fault, 0.0))
            if fault.kind == "slow_host":
                seconds *= share
            if seconds <= 0:
                continue
            if fault not in self.announced:
                self.announced.add(fault)
                self.client.call("/fault", retry_seconds=2, host=self.host, kind=fault.kind, step=step)
            time.sleep(seconds)

    def arm(self, step: int) -> None:
        for fault in [f for f in self.pending if f.step == step]:
            self.pending.remove(fault)
            self._fire_in_step(fault, step)

    def _fire_in_step(self, fault, step: int) -> None:
        self.client.call("/fault", retry_seconds=2, host=self.host, kind=fault.kind, step=step)
        sig = signal.SIGSTOP if fault.kind == "hang_host" else signal.SIGKILL
        threading.Timer(0.01, os.kill, args=(os.getpid(), sig)).start()

    def joined(self, generation: int, step: int) -> None:
        """This host has joined world `generation`, which has not run a step yet (`step`: steps completed)."""
        self._at("formation", generation, step)

    def adopting(self, generation: int, step: int) -> None:
        """World `generation` is about to move the state of `step` completed steps to its members."""
        self._at("adopt", generation, step)

    def saving(self, step: int, root) -> None:
        """The checkpoint of `step` completed steps is being written (the save has started) into the
        checkpoint directory `root`. A kill waits until the save's temporary directory is there
        (rank 0 makes it once every member has begun the save; at most SAVE_STARTED_SECONDS): the
        death then lands while the members wait on each other in the save's own barriers."""
        if any(f.moment == "save" and f.step == step for f in self.at_moment):
            from resilient_jax.checkpoint import reader

            deadline = time.monotonic() + SAVE_STARTED_SECONDS
            while time.monotonic() < deadline and not any(p.name.startswith(f"{step}.")
                                                          for p in reader.temporary_dirs(root)):
                time.sleep(0.005)
        self._at("save", step, step)

    def reporting(self, step: int) -> None:
        """This host, rank 0 of the final world, is about to report the run's end after `step` steps."""
        self._at("report", step, step)

    def _at(self, moment: str, number: int, step: int) -> None:
        for fault in [f for f in self.at_moment if f.moment == moment and f.step == number]:
            self.at_moment.remove(fault)
            self.client.call("/fault", retry_seconds=2, host=self.host, kind=fault.kind, step=step)
            os.kill(os.getpid(), signal.SIGKILL)
