"""Rank 0's background compile of the worlds most likely next, so that a failure's world loads its step.

Without it, a recovery compiles the new world's step from scratch unless a world of that shape was
cached before (39-45 s per survivor on cpu-4host, 2 cores, `kill_host:1@8`). While a world
trains, its rank 0 builds, for each world `next_worlds.likely_next_worlds` names, a `Trainer` over
the devices of that world's ranks (the first n processes of this one: the same device ids the new
world will have) and compiles its step from abstract state -- nothing is allocated, no collective
runs. The programs land in the persistent compile cache (JAX writes entries from process 0 only,
which is why only rank 0 compiles), keyed as the new world will look them up.

The thread stops between worlds when the world is left; `stop()` then waits for the compile in
flight (the backend must not be cleared under a compile): at most one world's programs, compiled
side by side (compile_cache.compile_all), which a recovery without it would spend anyway.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from resilient_jax import exported
from resilient_jax.elastic.next_worlds import likely_next_worlds

log = logging.getLogger("resilient_jax.worker")


def wanted(setting: str, platform: str, cache_on: bool) -> bool:
    """Whether this world's rank 0 compiles ahead (runtime.precompile_next_worlds), given where it runs."""
    if not cache_on or setting == "off":
        return False
    return setting == "on" or platform != "cpu"


class Precompiler(threading.Thread):
    def __init__(self, cfg, *, generation: int, regions_by_rank: Sequence[str], devices: Sequence,
                 verified_dataset, on_done: Callable[[dict], None], verified_eval_dataset=None,
                 exported_dir: Path | None = None):
        """`exported_dir`: where each world's exported programs go (resilient_jax.exported), in a
        folder per world, for its members to call without tracing; None: compile only."""
        super().__init__(name=f"precompile-g{generation}", daemon=True)
        self.cfg, self.generation, self.devices = cfg, generation, list(devices)
        self.exported_dir = exported_dir
        self.verified_dataset, self.on_done = verified_dataset, on_done
        self.verified_eval_dataset = verified_eval_dataset
        self.worlds = likely_next_worlds(regions_by_rank, min_hosts=cfg.runtime.min_hosts,
                                         hosts_per_replica=cfg.parallel.hosts_per_replica,
                                         min_replicas=cfg.runtime.min_replicas if cfg.parallel.hosts_per_replica > 1
                                         else 1)
        self.results: list[dict] = []
        self._stopping = threading.Event()

    def run(self) -> None:
        from resilient_jax.trainer import Trainer

        started = time.perf_counter()
        error = None
        try:
            for regions in self.worlds:
                if self._stopping.is_set():
                    break
                n = len(regions)
                devices = [d for d in self.devices if d.process_index < n]
                trainer = Trainer(self.cfg, devices=devices, regions=dict(enumerate(regions)), hosts=n,
                                  verified_dataset=self.verified_dataset,
                                  verified_eval_dataset=self.verified_eval_dataset)
                t0 = time.perf_counter()
                if self.exported_dir is not None:
                    self._export(trainer, regions, devices)
                trainer.precompile_abstract()
                # Seconds only: the cache counters are per process, and the training thread's own
                # compiles (first-use helpers) would be counted as this one's.
                seconds = time.perf_counter() - t0
                self.results.append({"regions": list(regions), "seconds": round(seconds, 3)})
                log.info("precompiled the step of a %d-host world (%s) in %.2f s", n, ", ".join(regions), seconds)
        except Exception as e:  # a compile ahead is an optimisation: never a reason for the world to fail
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            log.warning("precompiling the next worlds of generation %d stopped: %s", self.generation, error)
        report = {"generation": self.generation, "worlds": self.results, "stopped": self._stopping.is_set(),
                  "seconds": round(time.perf_counter() - started, 3), "error": error}
        try:
            self.on_done(report)
        except Exception as e:
            log.warning("reporting the precompile of generation %d failed: %s", self.generation, e)

    def _export(self, trainer, regions: Sequence[str], devices: Sequence) -> None:
        """Export `trainer`'s programs for the new world's members to call, and switch `trainer` to
        them, so that the compile that follows caches what those members will look up. A program
        that cannot be exported (a custom call jax.export refuses, a full disk) leaves `trainer`
        as it was: that world's step is compiled ahead as traced, the others are still tried."""
        counts = [sum(1 for d in devices if d.process_index == p) for p in range(len(regions))]
        folder = self.exported_dir / exported.world_key(regions, counts)
        try:
            trainer.use_exported(exported.export_and_reload(trainer, folder))
        except Exception as e:
            log.warning("the step of a %d-host world (%s) could not be exported (%s: %s); compiling it as traced",
                        len(regions), ", ".join(regions), type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")

    def stop(self) -> float:
        """Stop between programs; the seconds spent waiting for the one in flight."""
        self._stopping.set()
        t0 = time.perf_counter()
        self.join()
        return time.perf_counter() - t0
