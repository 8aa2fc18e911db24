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

    python scripts/bench_data.py --prepare [--prepare-scale 10] [--prepare-tokenizer hf:tokenizer.json]

measures `python -m resilient_jax.data prepare` instead: the default corpus (the 8 MiB stdlib
slice) written as a .jsonl file, and the same documents repeated --prepare-scale times, each
prepared in its own subprocess; reports each one's peak RSS (the child's ru_maxrss), wall time and
on-disk bytes per token, and the ratios large / default (flat memory: RSS ratio ~1 while the
corpus ratio is the scale).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grain
import numpy as np

from resilient_jax.data import GlobalOrder, HostBatchLoader, ensure_dataset, global_batch_ids, load_manifest
from resilient_jax.data.manifest import Manifest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_args import at_least  # noqa: E402  (a script next to this one)


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
    parser.add_argument("--steps", type=at_least(1), default=200)
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny-share", type=int, default=0, metavar="STEPS",
                        help="also measure the loader's share of step time over STEPS steps of configs/tiny.yaml")
    parser.add_argument("--prepare", action="store_true", help="measure dataset preparation (see above)")
    parser.add_argument("--prepare-scale", type=int, default=10)
    parser.add_argument("--prepare-tokenizer", default="bytes")
    parser.add_argument("--prepare-seq-len", type=int, default=1024)
    args = parser.parse_args()
    if args.prepare:
        print(json.dumps(bench_prepare(args.prepare_scale, args.prepare_tokenizer, args.prepare_seq_len), indent=1))
        return

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


def write_default_corpus(path: Path, repeat: int) -> Path:
    """The default corpus (the stdlib sources) as jsonl, `repeat` times over: a corpus `repeat`x
    the default one, for measuring what grows with the data (also scripts/bench_formation.py)."""
    from resilient_jax.data.sources import iter_documents

    docs = [json.dumps({"text": d.data.decode("utf-8", errors="ignore")}) + "\n"
            for d in iter_documents("default")]
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(repeat):
            f.writelines(docs)
    return path


def bench_prepare(scale: int, tokenizer: str, seq_len: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    runs = {}
    for name, repeat in (("default", 1), (f"x{scale}", scale)):
        src = write_default_corpus(work / f"{name}.jsonl", repeat)
        out = work / f"ds-{name}"
        cmd = [sys.executable, "-m", "resilient_jax.data", "prepare", "--src", str(src), "--out", str(out),
               "--tokenizer", tokenizer, "--seq-len", str(seq_len), "--shards", "8"]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)  # the child's own peak RSS
        wall = time.perf_counter() - start
        stdout, stderr = proc.stdout.read().decode(), proc.stderr.read().decode()
        if status != 0:
            raise SystemExit(f"prepare failed: {stderr.strip()}")
        manifest = load_manifest(out)
        tokens = manifest.num_records * (manifest.seq_len + 1)
        runs[name] = {
            "corpus_mib": round(src.stat().st_size / 2**20, 1),
            "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "wall_s": round(wall, 2),
            "tokens": tokens,
            "disk_bytes_per_token": round(sum(s.bytes for s in manifest.shards) / tokens, 3),
            "record_bytes_per_token": round(manifest.layout.record_bytes / (manifest.seq_len + 1), 3),
            "version": json.loads(stdout)["version"][:12],
        }
        src.unlink()
        subprocess.run(["rm", "-rf", str(out)], check=True)
    small, large = runs["default"], runs[f"x{scale}"]
    return {"tokenizer": tokenizer, "seq_len": seq_len, "runs": runs,
            "ratio_corpus": round(large["corpus_mib"] / small["corpus_mib"], 2),
            "ratio_peak_rss": round(large["peak_rss_mib"] / small["peak_rss_mib"], 3),
            "ratio_wall": round(large["wall_s"] / small["wall_s"], 2)}


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
