"""Training stall per checkpoint save: asynchronous vs synchronous, against one device-to-host copy.

For each config, on the trainer's real step (data loader, compute, apply) and real CheckpointStore:

    normal_step_s      median step time without a save
    d2h_copy_s         one device-to-host copy of the whole state (params + optimizer), median
    async.stall_s      (save call + the step run right after it) - normal step: what the training
                       thread loses to an asynchronous save (median over saves). On a 2-core
                       machine the step right after the call shares the cores (and the GIL) with
                       orbax's writer threads starting up, so this includes that contention
    async.save_call_s  the save call alone: one copy of each unique shard off the devices
                       (checkpoint/snapshot.py: a numpy memcpy on CPU, a DMA into pinned host
                       memory on GPU); orbax's own save call runs on the store's saver thread
    async.background_overhead_s   extra step time while the background write was running
    async.commit_s     save call -> committed step (background write, rename, crc32c of the files,
                       commit files)
    async_stall_vs_d2h async.stall_s / d2h_copy_s (target <= 1.5)
    async_low_priority the same with checkpoint.write_priority=low (the write at niceness 19), on the
                       same trainer right after; async_low_priority_stall_vs_d2h likewise
    sync.stall_s       a synchronous save (returns when committed): its whole duration is lost

    python scripts/bench_checkpoint.py [--config configs/tiny.yaml --config configs/small.yaml]
                                       [--saves 3] [--steps 4] [--write-priority normal|low ...]
                                       [--set k=v ...]

Prints one JSON object. Not a test: numbers depend on the machine (2 CPU cores here, so background
writes compete with the step for the same cores).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_args import at_least, config_file, load_config_or_exit, refused_in_one_line  # noqa: E402  (a script next to this one)


class CommitWatcher:
    """Notes when a step is committed (its commit file appears), polling every millisecond on a thread."""

    def __init__(self, path: Path):
        from resilient_jax.checkpoint import commit

        path = commit.commit_file(path, 0)
        import threading

        self._path, self._seen = path, None
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._path.is_file():
            time.sleep(0.001)
        self._seen = time.perf_counter()

    def seen_at(self) -> float:
        self._thread.join()
        return self._seen


def bench(config: str, overrides: list[str], saves: int, steps: int, priorities: list[str]) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    try:
        return _measure(work, config, overrides, saves, steps, priorities)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # several checkpoints of the bigger model: ~1 GB


def _measure(work: Path, config: str, overrides: list[str], saves: int, steps: int, priorities: list[str]) -> dict:
    import jax
    import numpy as np

    from resilient_jax import state as state_lib
    from resilient_jax.checkpoint import commit
    from resilient_jax.checkpoint.context import build_context
    from resilient_jax.checkpoint.store import CheckpointStore
    from resilient_jax.config import load_config
    from resilient_jax.metrics import MetricsLog
    from resilient_jax.model import count_params
    from resilient_jax.trainer import RunTotals, Trainer

    cfg = load_config(config, [*overrides, f"run.dir={work / 'run'}", "run.progress=quiet"])
    trainer = Trainer(cfg)
    state = state_lib.init_state(trainer.model_def, trainer.tx, trainer.mesh, cfg.train.seed)
    loader = trainer.open_loader(start_step=0)
    totals, log = RunTotals(), MetricsLog(work, cfg.train.steps, enabled=False)
    step = 0

    def one_step() -> float:
        nonlocal state, step
        t0 = time.perf_counter()
        result = trainer.compute_finite(state.params, loader, step, totals, log)
        state, _ = trainer.apply(state, result.grads, np.int32(step))
        float(result.loss)
        jax.block_until_ready(state)
        step += 1
        return time.perf_counter() - t0

    def context():
        # As the trainer's session does: the position now, the dicts built on the saver thread.
        return functools.partial(build_context, cfg, trainer.mesh, loader.position())

    for _ in range(2):  # compile
        one_step()
    normal = statistics.median(one_step() for _ in range(steps))

    d2h = []
    for _ in range(3):
        one_step()  # fresh arrays: a jax.Array keeps its first host copy, so a second one costs nothing
        t0 = time.perf_counter()
        [np.array(leaf, copy=True) for leaf in jax.tree.leaves(state)]
        d2h.append(time.perf_counter() - t0)

    def async_saves(priority: str) -> list[dict]:
        """Asynchronous saves: the training thread pays the save call, then steps run beside the write."""
        store = CheckpointStore(work / f"async-{priority}", async_save=True, write_priority=priority)
        store.save(step, state, context())  # the first save sets orbax up; not measured
        store.wait()
        rows = [one_async_save(store) for _ in range(saves)]
        store.close()
        return rows

    def one_async_save(store) -> dict:
        # The normal step right before this save (median of a few): the machine's pace drifts over
        # a run, and a stall of a millisecond is read against the steps beside it, not the first ones.
        local_normal = statistics.median(one_step() for _ in range(3))
        save_step = step
        committed = store.step_dir(save_step)
        watcher = CommitWatcher(committed)  # started first: its thread start is not the save's
        t0 = time.perf_counter()
        store.save(save_step, state, context())
        call = time.perf_counter() - t0
        first = one_step()
        overhead = 0.0
        while not commit.commit_file(committed, 0).is_file():
            overhead += max(one_step() - normal, 0.0)
            if step > 10_000:
                raise RuntimeError("the save never committed")
        commit_s = watcher.seen_at() - t0
        store.wait()
        return {"save_call_s": call, "stall_s": call + first - local_normal,
                "background_overhead_s": overhead, "commit_s": commit_s}

    async_rows = {priority: async_saves(priority) for priority in priorities}

    sync_store = CheckpointStore(work / "sync", async_save=False)
    sync_store.save(step, state, context())
    sync_rows = []
    for _ in range(saves):
        one_step()
        t0 = time.perf_counter()
        sync_store.save(step, state, context())
        sync_rows.append(time.perf_counter() - t0)
    sync_store.close()
    loader.close()

    def med(rows, key):
        return statistics.median(r[key] for r in rows)

    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    return {
        "config": config,
        "overrides": overrides,
        "params": count_params(state.params),
        "state_bytes": state_bytes,
        "devices": len(trainer.mesh.devices.flat),
        "normal_step_s": normal,
        "d2h_copy_s": statistics.median(d2h),
        **{_async_key(p): {k: med(rows, k) for k in ("save_call_s", "stall_s", "background_overhead_s", "commit_s")}
           for p, rows in async_rows.items()},
        "sync": {"stall_s": statistics.median(sync_rows)},
        **{f"{_async_key(p)}_stall_vs_d2h": med(rows, "stall_s") / statistics.median(d2h)
           for p, rows in async_rows.items()},
        **{f"sync_stall_vs_{_async_key(p)}_stall": statistics.median(sync_rows) / max(med(rows, "stall_s"), 1e-9)
           for p, rows in async_rows.items()},
    }


def _async_key(priority: str) -> str:
    """The output's name for the async saves at `priority`: "async" at the default."""
    return "async" if priority == "normal" else f"async_{priority}_priority"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=config_file, action="append", default=None,
                        help="repeatable; default configs/tiny.yaml and configs/small.yaml")
    parser.add_argument("--saves", type=at_least(1), default=9)
    parser.add_argument("--steps", type=at_least(1), default=4, help="steps measured for the normal step time")
    parser.add_argument("--write-priority", dest="priorities", action="append", choices=["normal", "low"],
                        default=None, help="repeatable: the asynchronous saves' checkpoint.write_priority, each "
                        "measured in turn on the same trainer (default: normal, then low)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    priorities = args.priorities or ["normal", "low"]
    configs = args.config or [str(REPO / "configs" / "tiny.yaml"), str(REPO / "configs" / "small.yaml")]

    # One process, one device count: every config must agree on parallel.devices. (Each is loaded
    # with --set here, so a typo is one line before the first save, not a traceback.)
    devices = {load_config_or_exit(parser, c, args.overrides).parallel.devices for c in configs}
    if len(devices) != 1:
        parser.error(f"--config: the configs disagree on parallel.devices ({sorted(devices)}); benchmark them one "
                     "at a time")
    count = devices.pop()

    import jax

    if count > 0:
        jax.config.update("jax_num_cpu_devices", count)
    with refused_in_one_line(parser):
        results = [bench(c, args.overrides, args.saves, args.steps, priorities) for c in configs]
    json.dump({"machine": {"platform": jax.devices()[0].platform, "devices": len(jax.devices())},
               "results": results}, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
