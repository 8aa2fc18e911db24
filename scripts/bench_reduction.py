"""Invariant (exact integer) vs native (float) gradient reduction: precision, memory, traffic, FLOPs, time.

precision: real per-shard gradients of the model (tiny config, real data, at init and after a few
    steps) are summed three ways -- float64 (the reference), a float32 left-to-right sum, and the
    exact int64 reduction of resilient_jax.reduce (pass 1, and pass 2 forced) -- and compared
    element by element: error in units of the float32 ulp of the reference, relative norm error.
compiled: for each config and (data x fsdp) mesh, the real compute program of each mode compiled
    for 8 emulated CPU devices: XLA's per-device temp/argument bytes (memory_analysis), FLOPs
    (cost_analysis), and the bytes its collectives move per device per step (from the HLO, ring
    estimates with loops multiplied by their trip counts: resilient_jax.hlo_stats), plus per-device
    FLOPs at the mesh vs the single-device program's / 8.
time: compute + apply of both modes, alternating rounds on the same batches; ratio of medians.

    python scripts/bench_reduction.py [--configs tiny small] [--meshes 2x4 8x1] [--steps 5] [--rounds 3]
                                      [--skip precision compiled time]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEVICES = 8  # emulated CPU devices: every mesh must fit them
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_args import at_least, layouts  # noqa: E402  (a script next to this one)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", default=["tiny", "small"], help="names of configs/NAME.yaml")
    parser.add_argument("--meshes", nargs="+", type=layouts(DEVICES), default=[[(2, 4), (8, 1)]],
                        help="data x fsdp, e.g. 2x4 8x1 (or 2x4,8x1)")
    parser.add_argument("--steps", type=at_least(1), default=5, help="steps per timing round")
    parser.add_argument("--rounds", type=at_least(1), default=3)
    parser.add_argument("--skip", nargs="*", default=[], choices=["precision", "compiled", "time"])
    args = parser.parse_args()
    # A config name without its file would otherwise fail only when its section reaches it, after
    # the precision section and the configs before it have compiled.
    known = sorted(p.stem for p in CONFIGS.glob("*.yaml"))
    for name in args.configs:
        if not (CONFIGS / f"{name}.yaml").is_file():
            parser.error(f"--configs: no config named {name!r} (no {CONFIGS / name}.yaml); choose from "
                         f"{', '.join(known)}")
    meshes = [mesh for group in args.meshes for mesh in group]

    import jax

    jax.config.update("jax_num_cpu_devices", DEVICES)
    report = {}
    if "precision" not in args.skip:
        report["precision"] = precision("tiny")
        print(json.dumps({"precision": report["precision"]}, indent=2), file=sys.stderr)
    for name in args.configs:
        for data, fsdp in meshes:
            mesh = f"{data}x{fsdp}"
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
            "collective_bytes_per_device": _collective_bytes(prog.as_text(), data * fsdp),
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


def _collective_bytes(hlo: str, devices: int) -> dict:
    """Bytes one device sends per step per collective kind (ring estimates, loops multiplied by
    their trip counts: resilient_jax.hlo_stats)."""
    from resilient_jax import hlo_stats

    stats = hlo_stats.analyze(hlo, devices)
    return {**{k: int(v) for k, v in stats.collective_bytes.items()}, "total": int(stats.total_collective_bytes)}


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
            # The first pass, and the second where the first does not fit (Compute.__call__); the
            # loss read back before apply, as the Trainer does, in both modes.
            result = modes[mode](state.params, tokens, weights, np.int32(k))
            float(result.loss)
            state, _ = apply(state, result.grads, np.int32(k))
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

    import jax.numpy as jnp

    from resilient_jax import collectives, fsdp, reduce, rng
    from resilient_jax import mesh as mesh_lib
    from resilient_jax import state as state_lib
    from resilient_jax import step as step_lib
    from resilient_jax.losses import next_token_cross_entropy

    cfg, mesh, plan, model_def, tx, apply = _setup(name, 1, 1)
    V, b = plan.num_shards, plan.rows_per_shard
    batches = _batches(cfg, 20)
    compute = step_lib.make_compute(model_def, mesh, plan, seed=0, mode="invariant", use_dropout=True)

    def shard_loss(p, tokens, weights, key):
        logits = model_def.forward(p, tokens[:, :-1], key)
        return jnp.sum(next_token_cross_entropy(logits, tokens[:, 1:], weights, key=None))

    grad_fn = jax.jit(jax.grad(shard_loss))
    # The whole (unscanned) model as one group: every leaf is one layer's, as the step blocks them.
    group = fsdp.group_of(jax.eval_shape(model_def.init_params, jax.random.key(0)),
                          mesh_lib.specs_from_logical(model_def.logical_axes), mesh)
    reducer = reduce.ExactSum(V)

    def exact(g_V, force_pass2: bool):
        def body(g_V):
            def add_all(state):
                for v in range(V):
                    state = reducer.add(group, state, jax.tree.leaves(jax.tree.map(lambda x: x[v], g_V)))
                return state

            plan_ = None
            if force_pass2:  # the global block maxima fix the lsb in advance
                _, exp = reducer.global_stats(add_all(reducer.init(group)).accs, "data")
                plan_ = reduce.fixed_lsb(exp, V)
            state = add_all(reducer.init(group, plan_))
            lsb, exp = reducer.global_stats(state.accs, "data")
            summed = collectives.tree_data_sum(reducer.aligned(group, state.accs, lsb), "data")
            return jax.tree.unflatten(group.treedef, reducer.to_float(group, summed, lsb)), reduce.fits(lsb, exp, V)

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), axis_names=set(mesh.axis_names),
                                  check_vma=False))
        with jax.enable_x64(True):
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
