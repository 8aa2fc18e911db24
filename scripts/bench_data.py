"""Samples/s of HostBatchLoader vs bare grain reading the same shards, same ids, same batch size.

    python scripts/bench_data.py [--dataset DIR] [--global-batch 256] [--steps 200] [--repeats 3]

Without --dataset it builds (once) the default dataset (Python stdlib text) under
data_cache/bench-default. Bare grain baselines, all given the loader's global ids:
- `getitems`: ArrayRecordDataSource.__getitems__(ids) per batch + the same numpy decode;
- `mapdataset`: MapDataset.source(ids).map(read + decode one record).batch(B), iterated through
  grain's own threaded IterDataset prefetch.
The ratio is loader / best baseline (target >= 0.95). With --tiny-share it also trains
configs/tiny.yaml for a few steps and reports the share of step time spent waiting for the loader
(it must not be the bottleneck). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import grain
import numpy as np

from resilient_jax.data import GlobalOrder, HostBatchLoader, ensure_dataset, global_batch_ids, load_manifest
from resilient_jax.data.manifest import Manifest


def bench_loader(manifest: Manifest, seed: int, global_batch: int, steps: int) -> float:
    with HostBatchLoader(manifest, seed=seed, global_batch=global_batch) as loader:
        next(loader)  # start-up (thread, readers) is not throughput
        start = time.perf_counter()
        for _ in range(steps):
            batch = next(loader)
        elapsed = time.perf_counter() - start
    assert batch.tokens.shape[0] == global_batch
    return steps * global_batch / elapsed


def bench_getitems(manifest: Manifest, ids_SxB: np.ndarray) -> float:
    source = grain.sources.ArrayRecordDataSource([str(manifest.shard_path(s)) for s in range(len(manifest.shards))])
    layout = manifest.layout
    source.__getitems__(ids_SxB[0].tolist())
    start = time.perf_counter()
    for ids in ids_SxB[1:]:
        rows = layout.decode(source.__getitems__(ids.tolist()))
        tokens, weights = rows["tokens"], rows["weights"]
        shard_ids = manifest.shard_of(ids)
    elapsed = time.perf_counter() - start
    assert tokens.shape[0] == weights.shape[0] == shard_ids.shape[0]
    return ids_SxB[1:].size / elapsed


def bench_mapdataset(manifest: Manifest, ids_SxB: np.ndarray) -> float:
    source = grain.sources.ArrayRecordDataSource([str(manifest.shard_path(s)) for s in range(len(manifest.shards))])
    layout = manifest.layout

    def read(gid: int) -> dict[str, np.ndarray]:
        rows = layout.decode([source[int(gid)]])
        return {"tokens": rows["tokens"][0], "weights": rows["weights"][0]}

    global_batch = ids_SxB.shape[1]
    ds = grain.MapDataset.source(ids_SxB.reshape(-1)).map(read).batch(global_batch).to_iter_dataset()
    it = iter(ds)
    next(it)
    start = time.perf_counter()
    for batch in it:
        pass
    elapsed = time.perf_counter() - start
    assert batch["tokens"].shape[0] == global_batch
    return ids_SxB[1:].size / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, default=None)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny-share", type=int, default=0, metavar="STEPS",
                        help="also measure the loader's share of step time over STEPS steps of configs/tiny.yaml")
    args = parser.parse_args()

    manifest = load_manifest(args.dataset) if args.dataset else ensure_dataset(Path("data_cache/bench-default"))
    order = GlobalOrder.for_manifest(manifest, args.seed, args.global_batch)
    # The loader reads steps 0..steps (step 0 is its warm-up); the baselines read the same ids.
    ids_SxB = np.stack([global_batch_ids(order, k) for k in range(args.steps + 1)])

    # Interleave the contenders so drift in machine load hits all of them alike.
    results: dict[str, list[float]] = {"loader": [], "getitems": [], "mapdataset": []}
    for _ in range(args.repeats):
        results["loader"].append(bench_loader(manifest, args.seed, args.global_batch, args.steps))
        results["getitems"].append(bench_getitems(manifest, ids_SxB))
        results["mapdataset"].append(bench_mapdataset(manifest, ids_SxB))
    best = {name: max(v) for name, v in results.items()}
    baseline = max(best["getitems"], best["mapdataset"])
    print(json.dumps({
        "dataset": str(manifest.root),
        "records": manifest.num_records,
        "seq_len": manifest.seq_len,
        "global_batch": args.global_batch,
        "steps": args.steps,
        "repeats": args.repeats,
        "samples_per_s": {name: round(v) for name, v in best.items()},
        "ratio_loader_vs_best_bare_grain": round(best["loader"] / baseline, 3),
        **({"tiny_loader_share_of_step_time": loader_share_on_tiny(args.tiny_share)} if args.tiny_share else {}),
    }, indent=1))


def loader_share_on_tiny(steps: int) -> dict[str, float]:
    """Seconds the training thread waits in next(loader) vs the whole step, on configs/tiny.yaml."""
    import tempfile

    from resilient_jax.config import load_config
    from resilient_jax.train import setup_devices

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml",
                      ["run.progress=quiet", f"run.dir={tempfile.mkdtemp(prefix='bench-data-')}"])
    setup_devices(cfg)
    from resilient_jax.trainer import Trainer

    trainer = Trainer(cfg)
    state = trainer.fresh_state()
    waited = total = 0.0
    with trainer.open_loader(start_step=0) as loader:
        for step in range(steps):
            t0 = time.perf_counter()
            batch = next(loader)
            t1 = time.perf_counter()
            tokens, weights = trainer._place(batch, trainer.local_rows())
            result = trainer.compute(state.params, tokens, weights, np.int32(step))
            state, _ = trainer.apply(state, result.grads, np.int32(step))
            float(result.loss)
            if step >= 2:  # after compilation
                waited += t1 - t0
                total += time.perf_counter() - t0
    return {"steps": steps - 2, "loader_wait_s": round(waited, 4), "step_s": round(total, 3),
            "share": round(waited / total, 4)}


if __name__ == "__main__":
    main()
