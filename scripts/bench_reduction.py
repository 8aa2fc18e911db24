"""Invariant (exact integer) vs native (float) gradient reduction: precision, memory, traffic, FLOPs, time.

precision: real per-shard gradients of the model (tiny config, real data, at init and after a few
    steps) are summed three ways -- float64 (the reference), a float32 left-to-right sum, and the
    exact int64 reduction of resilient_jax.reduce (pass 1, and pass 2 forced) -- and compared
    element by element: error in units of the float32 ulp of the reference, relative norm error.
compiled: for each config and (data x fsdp) mesh, the real compute program of each mode compiled
    for 8 emulated CPU devices: XLA's per-device temp/argument bytes (memory_analysis), FLOPs
    (cost_analysis), and the bytes its collectives move per device per step (from the HLO: ring
    estimates, all-reduce 2(n-1)/n x size, reduce-scatter/all-gather/all-to-all (n-1)/n x the full
    size), plus per-device FLOPs at the mesh vs the single-device program's / 8.
time: compute + apply of both modes, alternating rounds on the same batches; ratio of medians.

    python scripts/bench_reduction.py [--configs tiny small] [--meshes 2x4 8x1] [--steps 5] [--rounds 3]
                                      [--skip precision compiled time]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", default=["tiny", "small"])
    parser.add_argument("--meshes", nargs="+", default=["2x4", "8x1"], help="data x fsdp")
    parser.add_argument("--steps", type=int, default=5, help="steps per timing round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip", nargs="*", default=[], choices=["precision", "compiled", "time"])
    args = parser.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    report = {}
    if "precision" not in args.skip:
        report["precision"] = precision("tiny")
        print(json.dumps({"precision": report["precision"]}, indent=2), file=sys.stderr)
    for name in args.configs:
        for mesh in args.meshes:
            data, fsdp = (int(x) for x in mesh.split("x"))
            entry = {}
            if "compiled" not in args.skip:
                entry["compiled"] = compiled(name, data, fsdp)
            if "time" not in args.skip:
                entry["time"] = timed(name, data, fsdp, args.steps, args.rounds)
            report[f"{name}/{mesh}"] = entry
            print(json.dumps({f"{name}/{mesh}": entry}, indent=2), file=sys.stderr)
    json.dump(report, sys.stdout, indent=2)
    print()


# -- building blocks ------------------------------------------------------------------------------

def _setup(name: str, data: int, fsdp: int, virtual_shards: int | None = None):
    from resilient_jax import mesh as mesh_lib
    from resilient_jax import state as state_lib
    from resilient_jax import step as step_lib
    from resilient_jax.config import ParallelConfig, load_config
    from resilient_jax.optimizer import build_optimizer, lr_schedule

    cfg = load_config(CONFIGS / f"{name}.yaml",
                      [f"parallel.virtual_shards={virtual_shards}"] if virtual_shards else [])
    mesh = mesh_lib.build_mesh(ParallelConfig(data=data, fsdp=fsdp, tensor=1))
    plan = step_lib.make_shard_plan(cfg.data.global_batch, cfg.parallel.virtual_shards, mesh_lib.grid_size(mesh))
    model_def = state_lib.make_model_def(cfg.model)
    tx = build_optimizer(cfg.optimizer, cfg.train.steps)
    shardings = state_lib.state_shardings(model_def, tx, mesh)
    apply = step_lib.make_apply(tx, lr_schedule(cfg.optimizer, cfg.train.steps), shardings, mesh)
    return cfg, mesh, plan, model_def, tx, apply


def _batches(cfg, count: int):
    from resilient_jax.data import HostBatchLoader
    from resilient_jax.trainer import resolve_dataset

    with HostBatchLoader(resolve_dataset(cfg.data), seed=0, global_batch=cfg.data.global_batch) as loader:
        return [next(loader) for _ in range(count)]


_COLLECTIVE = re.compile(
    r"=\s*(\(?[^=]*?\)?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)
_SHAPE = re.compile(r"(pred|s8|u8|s16|u16|f16|bf16|s32|u32|f32|s64|u64|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8}


def collective_bytes(hlo: str) -> dict:
    """Bytes each device sends per collective kind (ring estimates, see the module docstring)."""
    totals: dict[str, float] = {}
    for line in hlo.splitlines():
        line = re.sub(r"/\*.*?\*/", "", line)  # tuple shapes carry /*index=N*/ comments
        m = _COLLECTIVE.search(line)
        if not m or "-done" in line:
            continue
        kind = m.group(2)
        size = 0
        for dtype, dims in _SHAPE.findall(m.group(1)):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            size += n * _BYTES[dtype]
        groups = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
        n = len(groups.group(1).split(",")) if groups else 1
        if n <= 1:
            continue
        if kind == "all-reduce":
            moved = 2 * (n - 1) / n * size
        elif kind == "reduce-scatter":
            moved = (n - 1) * size  # the result is 1/n of the input
        else:  # all-gather's result is the full size; all-to-all and permutes move their size
            moved = (n - 1) / n * size
        totals[kind] = totals.get(kind, 0) + moved
    totals["total"] = sum(totals.values())
    return {k: int(v) for k, v in totals.items()}


def _compile_compute(cfg, mesh, plan, model_def, tx, mode: str):
    import numpy as np

    from resilient_jax import state as state_lib
    from resilient_jax import step as step_lib

    compute = step_lib.make_compute(model_def, mesh, plan, seed=0, mode=mode, use_dropout=cfg.model.dropout > 0)
    params = state_lib.abstract_state(model_def, tx, mesh).params
    tokens = np.zeros((plan.padded_rows, cfg.data.seq_len + 1), np.int32)
    weights = np.ones((plan.padded_rows, cfg.data.seq_len), np.float32)
    t0 = time.perf_counter()
    compiled_ = compute.lower(params, tokens, weights, np.int32(0)).compile()
    return compute, compiled_, time.perf_counter() - t0


# -- sections ---------------------------------------------------------------------------------------

def compiled(name: str, data: int, fsdp: int) -> dict:
    cfg, mesh, plan, model_def, tx, _ = _setup(name, data, fsdp)
    out = {}
    for mode in ("native", "invariant"):
        _, prog, seconds = _compile_compute(cfg, mesh, plan, model_def, tx, mode)
        mem = prog.memory_analysis()
        out[mode] = {
            "temp_bytes_per_device": int(mem.temp_size_in_bytes),
            "argument_bytes_per_device": int(mem.argument_size_in_bytes),
            "collective_bytes_per_device": collective_bytes(prog.as_text()),
            "compile_seconds": seconds,
        }
        if data * fsdp > 1:
            out[mode].update(flops(name, data, fsdp, mode))
    inv, nat = out["invariant"], out["native"]
    out["ratio_temp_invariant_vs_native"] = inv["temp_bytes_per_device"] / max(nat["temp_bytes_per_device"], 1)
    out["ratio_collective_invariant_vs_native"] = (
        inv["collective_bytes_per_device"]["total"] / max(nat["collective_bytes_per_device"]["total"], 1)
    )
    return out


def flops(name: str, data: int, fsdp: int, mode: str) -> dict:
    """Per-device FLOPs on the mesh vs the single-device program's / devices, same global batch.

    XLA's cost analysis counts a loop body once, whatever its trip count, so both programs are
    compiled with one virtual shard per device (V = devices on the mesh, V = 1 alone): no loop
    runs more than once and every FLOP is counted.
    """
    grid = data * fsdp
    _, prog, _ = _compile_compute(*_setup(name, data, fsdp, virtual_shards=grid)[:5], mode)
    _, one, _ = _compile_compute(*_setup(name, 1, 1, virtual_shards=1)[:5], mode)
    per_device = float(prog.cost_analysis().get("flops", 0.0))
    single = float(one.cost_analysis().get("flops", 0.0))
    return {"flops_per_device": per_device, "flops_single_device": single,
            "ratio_flops_vs_single_over_devices": per_device / (single / grid)}


def timed(name: str, data: int, fsdp: int, steps: int, rounds: int) -> dict:
    import jax
    import numpy as np

    from resilient_jax import mesh as mesh_lib
    from resilient_jax import state as state_lib
    from resilient_jax import step as step_lib

    cfg, mesh, plan, model_def, tx, apply = _setup(name, data, fsdp)
    sharding = mesh_lib.batch_sharding(mesh)
    placed = [(jax.device_put(b.tokens, sharding), jax.device_put(b.weights, sharding))
              for b in _batches(cfg, steps)]
    modes = {mode: step_lib.make_compute(model_def, mesh, plan, seed=0, mode=mode,
                                         use_dropout=cfg.model.dropout > 0) for mode in ("native", "invariant")}
    times = {mode: [] for mode in modes}

    def run(mode: str) -> float:
        state = state_lib.init_state(model_def, tx, mesh, 0)
        t0 = time.perf_counter()
        for k, (tokens, weights) in enumerate(placed):
            result = modes[mode](state.params, tokens, weights, np.int32(k))
            state, _ = apply(state, result.grads, np.int32(k))
            float(result.loss)
        return (time.perf_counter() - t0) / len(placed)

    for mode in modes:
        run(mode)  # compile + warm up
    for _ in range(rounds):
        for mode in modes:
            times[mode].append(run(mode))
    med = {mode: statistics.median(t) for mode, t in times.items()}
    return {"native_step_s": med["native"], "invariant_step_s": med["invariant"],
            "ratio_time_invariant_vs_native": med["invariant"] / med["native"], "rounds": rounds, "steps": steps}


def precision(name: str) -> dict:
    """Sums of the model's real per-shard gradients, against a float64 reference."""
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from resilient_jax import reduce
    from resilient_jax import rng
    from resilient_jax import state as state_lib
    from resilient_jax import step as step_lib

    cfg, mesh, plan, model_def, tx, apply = _setup(name, 1, 1)
    V, b = plan.num_shards, plan.rows_per_shard
    batches = _batches(cfg, 20)
    compute = step_lib.make_compute(model_def, mesh, plan, seed=0, mode="invariant", use_dropout=True)
    grad_fn = jax.jit(jax.grad(lambda p, t, w, k: step_lib._shard_loss_fn(model_def)(p, t, w, k)[0]))
    bits = reduce.own_bits(V)

    def exact(g_V, force_pass2: bool):
        def body(g_V):
            first = jax.tree.map(lambda x: x[0], g_V)
            accs = jax.tree.map(reduce.zeros_like_leaf, first)
            plan_ = reduce.own_exponent_plan(accs)
            if force_pass2:  # the global block maxima fix the lsb in advance
                for v in range(V):
                    accs = jax.tree.map(lambda a, x, p: reduce.add_shard(a, x[v], p, bits), accs, g_V, plan_,
                                        is_leaf=reduce.is_acc)
                _, exp = reduce.global_exponents(accs, ("data", "fsdp"))
                plan_ = reduce.fixed_lsb(exp, V)
                accs = jax.tree.map(reduce.zeros_like_leaf, first)
            for v in range(V):
                accs = jax.tree.map(lambda a, x, p: reduce.add_shard(a, x[v], p, bits), accs, g_V, plan_,
                                    is_leaf=reduce.is_acc)
            lsb, exp = reduce.global_exponents(accs, ("data", "fsdp"))
            scatter = jax.tree.map(lambda _: -1, first)
            return reduce.reduce_exact(accs, lsb, scatter_axes=scatter, data_axis="data", fsdp_axis="fsdp"), \
                reduce.fits(lsb, exp, V)

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), axis_names=set(mesh.axis_names),
                                  check_vma=False))
        return f(g_V)

    out = {}
    state = state_lib.init_state(model_def, tx, mesh, 0)
    for k, batch in enumerate(batches):
        if k in (0, len(batches) - 1):
            key = lambda v: rng.dropout_key(0, np.int32(k), np.int32(v))  # noqa: E731
            tok = batch.tokens.reshape(V, b, -1)
            wts = batch.weights.reshape(V, b, -1)
            shards = [jax.tree.map(np.asarray, grad_fn(state.params, tok[v], wts[v], key(v))) for v in range(V)]
            g_V = jax.tree.map(lambda *xs: np.stack(xs), *shards)
            ref = jax.tree.map(lambda x: x.astype(np.float64).sum(axis=0), g_V)
            f32 = jax.tree.map(lambda x: _ordered_f32(x), g_V)
            pass1, fits1 = exact(g_V, False)
            pass2, _ = exact(g_V, True)
            out[f"step{k}"] = {
                "pass1_fits": bool(fits1),
                "fp32_ordered_sum": _errors(f32, ref),
                "exact_pass1": _errors(jax.tree.map(np.asarray, pass1), ref),
                "exact_pass2": _errors(jax.tree.map(np.asarray, pass2), ref),
                "fp32_rounded_reference": _errors(jax.tree.map(lambda r: r.astype(np.float32), ref), ref),
            }
        result = compute(state.params, batch.tokens, batch.weights, np.int32(k))
        state, _ = apply(state, result.grads, np.int32(k))
    return out


def _ordered_f32(x_VxN):
    import numpy as np

    acc = x_VxN[0].astype(np.float32).copy()
    for v in range(1, x_VxN.shape[0]):
        acc = (acc + x_VxN[v]).astype(np.float32)
    return acc


def _errors(tree, ref) -> dict:
    """Error of `tree` against float64 `ref`: in float32 ulps of the reference, and normwise."""
    import jax
    import numpy as np

    got = np.concatenate([np.ravel(x).astype(np.float64) for x in jax.tree.leaves(tree)])
    want = np.concatenate([np.ravel(x) for x in jax.tree.leaves(ref)])
    err = np.abs(got - want)
    ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    in_ulps = err / ulp
    return {
        "max_err_ulps": float(in_ulps.max()),
        "mean_err_ulps": float(in_ulps.mean()),
        "p99_9_err_ulps": float(np.quantile(in_ulps, 0.999)),
        "frac_over_half_ulp": float(np.mean(in_ulps > 0.5)),
        "rel_norm_err": float(np.linalg.norm(got - want) / np.linalg.norm(want)),
        "elements": int(want.size),
    }


if __name__ == "__main__":
    main()
