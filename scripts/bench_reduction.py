"""Invariant vs native gradient reduction: step time and per-device memory, side by side.

Both modes run the same two-phase step on the same batches and mesh; only the cross-replica
reduction differs. Time: median over alternating rounds. Memory: XLA's compiled temp-buffer size
per device for the compute program (what the reduction adds), plus argument sizes.
Also reports how far native drifts from invariant after the measured steps.

    python scripts/bench_reduction.py [--configs tiny small] [--steps 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    report = {name: bench(name, args.steps, args.rounds) for name in args.configs}
    json.dump(report, sys.stdout, indent=2)
    print()


def bench(name: str, steps: int, rounds: int) -> dict:
    import jax
    import numpy as np

    from resilient_jax import mesh as mesh_lib
    from resilient_jax import state as state_lib
    from resilient_jax import step as step_lib
    from resilient_jax.config import load_config
    from resilient_jax.data import HostBatchLoader
    from resilient_jax.optimizer import build_optimizer, lr_schedule
    from resilient_jax.trainer import resolve_dataset

    cfg = load_config(CONFIGS / f"{name}.yaml")
    mesh = mesh_lib.build_mesh(cfg.parallel)
    plan = step_lib.make_shard_plan(cfg.data.global_batch, cfg.parallel.virtual_shards, mesh.shape["data"])
    model_def = state_lib.make_model_def(cfg.model)
    tx = build_optimizer(cfg.optimizer, cfg.train.steps)
    shardings = state_lib.state_shardings(model_def, tx, mesh)
    apply = step_lib.make_apply(tx, lr_schedule(cfg.optimizer, cfg.train.steps), shardings, mesh)
    manifest = resolve_dataset(cfg.data)
    with HostBatchLoader(manifest, seed=0, global_batch=cfg.data.global_batch) as loader:
        batches = [next(loader) for _ in range(steps)]
    sharding = mesh_lib.batch_sharding(mesh)
    placed = [(jax.device_put(b.tokens, sharding), jax.device_put(b.weights, sharding)) for b in batches]

    modes = {}
    for mode in ("native", "invariant"):
        compute = step_lib.make_compute(model_def, mesh, plan, seed=0, mode=mode, use_dropout=cfg.model.dropout > 0)
        state = state_lib.init_state(model_def, tx, mesh, 0)
        memory = compute.lower(state.params, *placed[0], np.int32(0)).compile().memory_analysis()
        modes[mode] = {"compute": compute, "state": state, "memory": memory, "times": []}

    def run(mode: str) -> float:
        m = modes[mode]
        state = state_lib.init_state(model_def, tx, mesh, 0)
        t0 = time.perf_counter()
        for k, (tokens, weights) in enumerate(placed):
            result = m["compute"](state.params, tokens, weights, np.int32(k))
            state, _ = apply(state, result.grads, np.int32(k))
            float(result.loss)
        m["state"] = state
        return (time.perf_counter() - t0) / len(placed)

    for mode in modes:
        run(mode)  # compile + warm up
    for _ in range(rounds):
        for mode in modes:
            modes[mode]["times"].append(run(mode))

    inv, nat = modes["invariant"], modes["native"]
    drift = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(inv["state"].params), jax.tree.leaves(nat["state"].params))
    )
    out = {"devices": int(mesh.size), "virtual_shards": plan.num_shards, "steps": steps,
           "num_params": int(sum(x.size for x in jax.tree.leaves(inv["state"].params)))}
    for mode, m in modes.items():
        out[f"{mode}_step_s"] = statistics.median(m["times"])
        out[f"{mode}_temp_bytes_per_device"] = int(m["memory"].temp_size_in_bytes)
    out["time_ratio_invariant_vs_native"] = out["invariant_step_s"] / out["native_step_s"]
    out["temp_memory_ratio_invariant_vs_native"] = (
        out["invariant_temp_bytes_per_device"] / max(out["native_temp_bytes_per_device"], 1)
    )
    out["max_abs_param_diff_native_vs_invariant"] = drift
    return out


if __name__ == "__main__":
    main()
