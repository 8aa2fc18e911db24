"""The step at scale without a GPU: compile the real compute/apply for emulated CPU meshes and read XLA's figures.

Three sections, one JSON report on stdout (progress on stderr):

  meshes   per reduction mode (native, invariant) and (data x fsdp) mesh of 8 emulated CPU devices, plus
           the one-device baseline: per-device FLOPs, temp/argument/output bytes, collective bytes per
           step, compile seconds, for the compute and the apply programs of --config.
  depth    compile seconds of a --depth-layer model (the --config widths), scan_layers on vs off.
  throughput  (executes; scripts/gpu_check.sh) tokens/s and MFU of gpu-1b-shaped training on the
           local devices (one GPU), --throughput-layers deep: native, native with the deterministic-ops
           XLA flags, invariant (which always has them: resilient_jax.gpu_env refuses it without).
           Each variant runs in its own process with the environment resilient_jax.gpu_env gives a
           worker. --cpu-smoke runs the same path tiny on one CPU device.
  gpu      per-device peak bytes of each GPU config (GPU_CONFIGS): one REPLICA's program -- one node's
           (data=1 x fsdp=8 emulated devices) for gpu-8b and gpu-46node-4region, one replica GROUP's
           for a config with parallel.hosts_per_replica = k > 1 (data=1 x fsdp=k*8 emulated devices,
           e.g. 80 for gpu-300b-46node's groups of 10 nodes) -- with that replica's share of the
           virtual shards, REAL d_model, d_ff, heads, vocab, seq_len and rows per shard, the config's
           remat/scan/attention settings, compiled with 8 and 16 layers, extrapolated linearly in depth:
               peak(L) = peak(16) + (L - 16) * (peak(16) - peak(8))
           Each layer adds the same parameters, optimizer state, gradients and (with remat) what one
           block keeps, so every term is affine in L; the 8- and 16-layer compiles give the slope and
           the embedding/unembedding/logits the intercept. Not 1 layer: XLA removes a scan's loop of
           one trip, which makes another program (gpu-8b native: 2.22 GB more temporaries from 1 to
           2 layers, 0.93 GB from 2 to 3). Not 2 and 3 either: XLA's heap packing moves the peak by
           up to ~1 GB between nearby depths (gpu-300b-46node native: +1.50 GB from 2 to 3 layers,
           +0.56 GB from 3 to 4, then 1.03 GB a layer from 4 to 8 and from 8 to 16 -- measured with
           float32 AdamW moments, before optimizer.mu_dtype), and 93 times a wrong slope is far off. The `data` axis only replicates, so a replica's program
           is every replica's per-device program. Each compile runs in its own subprocess (its max
           RSS is reported) and nothing is executed.

Per-device figures:
  flops_xla        compiled.cost_analysis()["flops"] -- counts each while-loop body ONCE (the loop over
                   a device's shards, scanned layers), so it under-counts looped programs;
  dot_flops        matmul FLOPs from the compiled HLO with loop bodies multiplied by their trip counts
                   (resilient_jax.hlo_stats) -- use this one to compare meshes;
  temp/argument/output/alias_bytes   compiled.memory_analysis();
  collective_bytes bytes one device sends per step, per op kind, ring-algorithm accounting
                   (resilient_jax.hlo_stats docstring), loop-scaled like dot_flops.
  peak_bytes       max over the step's two phases of what is live on a device:
                     compute: optimizer state + compute's arguments (params, batch) + its outputs + temp
                     apply:   apply's arguments + outputs - aliased (donated) + temp

CPU is a proxy for GPU: the CPU backend's buffer assignment, fusion and layout differ from the GPU
backend's (no cuDNN flash attention on CPU, so `attention: dot_product` is XLA's unfused softmax
here), so the peak figures are an estimate of the order of the GPU's, not its exact figure.

    python scripts/bench_scale.py [--config configs/tiny.yaml] [--sections meshes,depth,gpu] [--depth 32]
    python scripts/bench_scale.py --sections throughput [--throughput-layers 4] [--cpu-smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from cli_args import at_least, comma_list, config_file, load_config_or_exit  # noqa: E402  (a script next to this one)

DEVICES = 8
MESHES = ((1, 1), (8, 1), (2, 4), (1, 8))  # (data, fsdp); (1, 1) is the one-device baseline
# config -> devices of its intended cluster (the world: data x fsdp x tensor, spares not counted)
GPU_CONFIGS = {"gpu-8b": 128, "gpu-46node-4region": 368, "gpu-300b-46node": 320}
GPUS_PER_NODE = 8
SECTIONS = ("meshes", "depth", "gpu", "throughput")
GIB = 2**30
DEPTHS = (8, 16)  # layers of the gpu section's two compiles (see the module docstring)


def build_step(cfg, mesh):
    """What the Trainer builds (resilient_jax.trainer.Trainer.__init__): plan, model, optimizer, compute, apply.

    The shard plan spreads the virtual shards over the compute grid: the data x fsdp devices once
    each shard is computed whole on one device (mesh.grid_size), the data replicas before that.
    """
    from resilient_jax import mesh as mesh_lib
    from resilient_jax import state as state_lib
    from resilient_jax import step as step_lib
    from resilient_jax.optimizer import build_optimizer, lr_schedule

    grid = mesh_lib.grid_size(mesh)
    plan = step_lib.make_shard_plan(cfg.data.global_batch, cfg.parallel.virtual_shards, grid)
    model_def = state_lib.make_model_def(cfg.model)
    tx = build_optimizer(cfg.optimizer, cfg.train.steps)
    shardings = state_lib.state_shardings(model_def, tx, mesh)
    compute = step_lib.make_compute(model_def, mesh, plan, seed=cfg.train.seed, mode=cfg.parallel.reduction,
                                    use_dropout=cfg.model.dropout > 0)
    apply = step_lib.make_apply(tx, lr_schedule(cfg.optimizer, cfg.train.steps), shardings, mesh)
    return plan, model_def, tx, compute, apply


def compile_step(cfg, data: int, fsdp: int) -> dict:
    """Compile (never run) the Trainer's compute and apply for cfg on a data x fsdp mesh of CPU devices."""
    import dataclasses

    import jax

    import jax.numpy as jnp

    from resilient_jax import hlo_stats
    from resilient_jax import mesh as mesh_lib
    from resilient_jax import state as state_lib

    parallel = dataclasses.replace(cfg.parallel, data=data, fsdp=fsdp, tensor=1)
    mesh = mesh_lib.build_mesh(parallel, jax.devices()[: data * fsdp])
    plan, model_def, tx, compute, apply = build_step(cfg, mesh)

    abstract = state_lib.abstract_state(model_def, tx, mesh)
    batch = mesh_lib.batch_sharding(mesh)
    tokens = jax.ShapeDtypeStruct((plan.padded_rows, cfg.data.seq_len + 1), jnp.int32, sharding=batch)
    weights = jax.ShapeDtypeStruct((plan.padded_rows, cfg.data.seq_len), jnp.float32, sharding=batch)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=mesh_lib.replicated(mesh))

    report = {"mesh": {"data": data, "fsdp": fsdp}, "rows_per_shard": plan.rows_per_shard,
              "virtual_shards": plan.num_shards, "layers": cfg.model.n_layers}
    programs = {}
    for name, fn, args in (("compute", compute, (abstract.params, tokens, weights, step)),
                           ("apply", apply, (abstract, abstract.params, step))):
        t0 = time.perf_counter()
        compiled = fn.lower(*args).compile()
        seconds = time.perf_counter() - t0
        programs[name] = compiled
        report[name] = _program_figures(compiled, data * fsdp, hlo_stats) | {"compile_s": round(seconds, 3)}
    opt_bytes = sum(_shard_bytes(leaf) for leaf in jax.tree.leaves(abstract.opt_state))
    c, a = report["compute"], report["apply"]
    phases = {
        "compute": opt_bytes + c["argument_bytes"] + c["output_bytes"] + c["temp_bytes"],
        "apply": a["argument_bytes"] + a["output_bytes"] - a["alias_bytes"] + a["temp_bytes"],
    }
    report["opt_state_bytes"] = opt_bytes
    report["phase_bytes"] = phases
    report["peak_bytes"] = max(phases.values())
    return report


def _shard_bytes(leaf) -> int:
    import math

    return math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize


def _program_figures(compiled, num_devices: int, hlo_stats) -> dict:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    memory = compiled.memory_analysis()
    stats = hlo_stats.analyze(compiled.as_text(), num_devices)
    return {
        "flops_xla": float(cost.get("flops", 0.0)),
        "dot_flops": stats.dot_flops,
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "alias_bytes": int(memory.alias_size_in_bytes),
        "collective_bytes": {op: round(b) for op, b in sorted(stats.collective_bytes.items())},
        "collective_bytes_total": round(stats.total_collective_bytes),
        "collective_ops": dict(sorted(stats.collective_count.items())),
        "unknown_trip_counts": stats.unknown_trip_counts,
    }


# -- subprocess plumbing: one compile per process, so each one's memory is its own ---------------


def _child(spec: dict) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", max(DEVICES, spec["data"] * spec["fsdp"]))
    from resilient_jax.config import load_config

    cfg = load_config(spec["config"], spec["overrides"])
    report = compile_step(cfg, spec["data"], spec["fsdp"])
    report["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(report))


def compile_in_subprocess(config: str, overrides: list[str], data: int, fsdp: int, timeout: float) -> dict:
    spec = {"config": config, "overrides": overrides, "data": data, "fsdp": fsdp}
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    if proc.returncode:
        errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error:" in line]
        _log(f"  compile failed: {errors[-1] if errors else proc.stderr[-500:]}")
        raise CompileFailed(errors[-1] if errors else proc.stderr[-500:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


class CompileFailed(RuntimeError):
    """A compile the report names as failed (with XLA's one-line reason) instead of stopping."""


# -- throughput: the step executed on the local devices ---------------------------------------------

# Dense bf16 peak of one H100/H200 SXM GPU (NVIDIA's datasheet, without sparsity).
H100_BF16_PEAK_FLOPS = 989e12
SMOKE = ["model.d_model=64", "model.d_ff=128", "model.n_heads=4", "model.vocab_size=256", "data.seq_len=32",
         "parallel.virtual_shards=2", "data.global_batch=4", "model.dtype=float32"]


def _throughput_child(spec: dict) -> None:
    """Compile and run the Trainer's compute/apply on every local device for spec["steps"] steps."""
    import jax
    import numpy as np

    from resilient_jax import mesh as mesh_lib
    from resilient_jax import state as state_lib
    from resilient_jax.config import load_config

    cfg = load_config(spec["config"], spec["overrides"])
    mesh = mesh_lib.build_mesh(cfg.parallel, jax.local_devices())
    plan, model_def, tx, compute, apply = build_step(cfg, mesh)
    state = state_lib.init_state(model_def, tx, mesh, cfg.train.seed)
    rs = np.random.RandomState(0)
    batch = mesh_lib.batch_sharding(mesh)
    tokens = jax.device_put(rs.randint(0, cfg.model.vocab_size, (plan.padded_rows, cfg.data.seq_len + 1),
                                       dtype=np.int32), batch)
    weights = jax.device_put(np.ones((plan.padded_rows, cfg.data.seq_len), np.float32), batch)
    t0 = time.perf_counter()
    compiled = compute.lower(state.params, tokens, weights, np.int32(0)).compile()
    compile_s = time.perf_counter() - t0
    from resilient_jax import hlo_stats

    flops = hlo_stats.analyze(compiled.as_text(), len(mesh.devices.flat)).dot_flops  # per device, per step

    def one_step(state, k):
        # The first pass, and the second where the first does not fit (Compute.__call__).
        result = compute(state.params, tokens, weights, np.int32(k))
        float(result.loss)  # the Trainer reads the loss (and finiteness) back every step
        return apply(state, result.grads, np.int32(k))[0]

    for k in range(spec["warmup"]):
        state = one_step(state, k)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for k in range(spec["warmup"], spec["warmup"] + spec["steps"]):
        state = one_step(state, k)
    jax.block_until_ready(state)
    step_s = (time.perf_counter() - t0) / spec["steps"]
    tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
    devices = len(mesh.devices.flat)
    print(json.dumps({
        "platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind, "devices": devices,
        "layers": cfg.model.n_layers, "tokens_per_step": tokens_per_step, "step_s": step_s,
        "tokens_per_s": tokens_per_step / step_s, "matmul_flops_per_device_step": flops,
        "mfu": flops / step_s / spec["peak_flops"], "compile_s": round(compile_s, 2),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }))


def section_throughput(layers: int, steps: int, cpu_smoke: bool, peak_flops: float, timeout: float) -> dict:
    from resilient_jax import gpu_env
    from resilient_jax.config import load_config

    config = str(REPO / "configs" / "gpu-1b.yaml")
    overrides = [f"model.n_layers={layers}", "parallel.devices=0", "parallel.data=-1", "parallel.fsdp=1"]
    if cpu_smoke:
        overrides += [*SMOKE, "parallel.devices=1"]
    else:
        # gpu-1b's own rows per shard (8 x 2048 tokens), one shard per local device.
        overrides += ["parallel.virtual_shards=1", "data.global_batch=8"]
    platform = "cpu" if cpu_smoke else gpu_env.detect_platform()
    deterministic = " ".join(f"--{flag}=true" for flag in gpu_env.DETERMINISM_FLAGS)
    out = {"config": config, "overrides": overrides, "peak_flops_per_device": peak_flops}
    for name, mode, user_flags in (("native", "native", ""), ("native_deterministic", "native", deterministic),
                                   ("invariant", "invariant", "")):
        cfg = load_config(config, [*overrides, f"parallel.reduction={mode}"])
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        if user_flags:
            env["XLA_FLAGS"] = user_flags
        env |= gpu_env.worker_environment(cfg, platform, environ=env)
        if cpu_smoke:
            env["JAX_PLATFORMS"] = "cpu"
        spec = {"config": config, "overrides": [*overrides, f"parallel.reduction={mode}"], "steps": steps,
                "warmup": 2, "peak_flops": peak_flops}
        _log(f"throughput: {name}")
        proc = subprocess.run([sys.executable, __file__, "--throughput-child", json.dumps(spec)], capture_output=True,
                              text=True, timeout=timeout, cwd=REPO, env=env)
        if proc.returncode:
            out[name] = {"error": proc.stderr[-2000:]}
            continue
        out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    ok = {k: v for k, v in out.items() if isinstance(v, dict) and "tokens_per_s" in v}
    if {"native", "native_deterministic"} <= ok.keys():
        out["deterministic_flags_cost"] = ok["native"]["tokens_per_s"] / ok["native_deterministic"]["tokens_per_s"]
    if {"native", "invariant"} <= ok.keys():
        out["invariant_vs_native_step_time"] = ok["invariant"]["step_s"] / ok["native"]["step_s"]
    return out


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- sections --------------------------------------------------------------------------------------


def section_meshes(config: str, overrides: list[str], timeout: float) -> dict:
    out: dict = {}
    for mode in ("native", "invariant"):
        out[mode] = {}
        for data, fsdp in MESHES:
            _log(f"meshes: {mode} {data}x{fsdp}")
            try:
                out[mode][f"{data}x{fsdp}"] = compile_in_subprocess(
                    config, [*overrides, f"parallel.reduction={mode}"], data, fsdp, timeout)
            except CompileFailed as e:
                out[mode][f"{data}x{fsdp}"] = {"error": str(e)}
    ok = {mode: {name: r for name, r in out[mode].items() if "error" not in r} for mode in out}
    for mode, results in ok.items():
        if "1x1" in results:
            base = results["1x1"]["compute"]["dot_flops"]
            out[mode]["dot_flops_vs_ideal"] = {name: r["compute"]["dot_flops"] / (base / DEVICES)
                                               for name, r in results.items() if name != "1x1"}
    out["invariant_vs_native"] = {
        name: {key: _ratio(ok["invariant"][name]["compute"][key], ok["native"][name]["compute"][key])
               for key in ("temp_bytes", "collective_bytes_total", "dot_flops")}
        for name in ok["invariant"] if name in ok["native"] and name != "1x1"
    }
    return out


def _ratio(a: float, b: float) -> float | None:
    return None if b == 0 else a / b


def section_depth(config: str, overrides: list[str], depth: int, timeout: float) -> dict:
    out = {}
    for scan in (False, True):
        _log(f"depth: {depth} layers, scan_layers={scan}")
        r = compile_in_subprocess(config, [*overrides, f"model.n_layers={depth}", f"model.scan_layers={scan}",
                                           "parallel.reduction=native"], DEVICES, 1, timeout)
        out["scan" if scan else "unrolled"] = {
            "compute_compile_s": r["compute"]["compile_s"], "apply_compile_s": r["apply"]["compile_s"]}
    out["ratio_scan_vs_unrolled_compute"] = out["scan"]["compute_compile_s"] / out["unrolled"]["compute_compile_s"]
    out["layers"] = depth
    return out


def replica_overrides(name: str) -> tuple[list[str], dict]:
    """One replica of a GPU config as a run of its own: data=1 x fsdp=(its GPUs), that replica's
    shards, real widths. A replica is one node (8 GPUs), or with parallel.hosts_per_replica = k > 1
    a group of k nodes (k x 8 GPUs), emulated as one process with k x 8 CPU devices -- the
    per-device program is the same whatever process owns the devices."""
    from resilient_jax.config import load_config

    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    cluster_devices = GPU_CONFIGS[name]
    k = cfg.parallel.hosts_per_replica
    replica_devices = k * GPUS_PER_NODE
    V, b = cfg.parallel.virtual_shards, cfg.data.global_batch // cfg.parallel.virtual_shards
    replica_shards = -(-V // cluster_devices) * replica_devices  # shards per device x GPUs of the replica
    overrides = ["parallel.devices=0", "parallel.data=1", f"parallel.fsdp={replica_devices}",
                 "parallel.hosts_per_replica=1", f"parallel.virtual_shards={replica_shards}",
                 f"data.global_batch={replica_shards * b}"]
    return overrides, {"cluster_devices": cluster_devices, "hosts_per_replica": k, "replica_devices": replica_devices,
                       "rows_per_shard": b, "shards_per_device": replica_shards // replica_devices,
                       "n_layers": cfg.model.n_layers, "remat": cfg.model.remat,
                       "scan_layers": cfg.model.scan_layers, "attention": cfg.model.attention}


def section_gpu(names: list[str], modes: list[str], timeout: float) -> dict:
    out = {}
    for name in names:
        overrides, shape = replica_overrides(name)
        config = str(REPO / "configs" / f"{name}.yaml")
        out[name] = {"replica_program": shape}
        for mode in modes:
            by_depth = {}
            for layers in DEPTHS:
                _log(f"gpu: {name} {mode} {layers} layer(s)")
                by_depth[layers] = compile_in_subprocess(
                    config, [*overrides, f"model.n_layers={layers}", f"parallel.reduction={mode}"], 1,
                    shape["replica_devices"], timeout)
            L = shape["n_layers"]

            def extrapolate(get):
                low, high = (get(by_depth[d]) for d in DEPTHS)
                return round(high + (L - DEPTHS[1]) * (high - low) / (DEPTHS[1] - DEPTHS[0]))

            phases = {ph: extrapolate(lambda r, ph=ph: r["phase_bytes"][ph]) for ph in ("compute", "apply")}
            out[name][mode] = {
                **{f"peak_bytes_{d}_layers": by_depth[d]["peak_bytes"] for d in DEPTHS},
                "phase_bytes_extrapolated": phases,
                "peak_bytes_extrapolated": max(phases.values()),
                "peak_gib_extrapolated": round(max(phases.values()) / GIB, 2),
                "compute_temp_bytes_extrapolated": extrapolate(lambda r: r["compute"]["temp_bytes"]),
                "opt_state_bytes_extrapolated": extrapolate(lambda r: r["opt_state_bytes"]),
                "compile_max_rss_bytes": max(r["max_rss_bytes"] for r in by_depth.values()),
                "compile_s": {k: r["compute"]["compile_s"] for k, r in by_depth.items()},
            }
    return out


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(json.loads(sys.argv[2]))
        return
    if len(sys.argv) == 3 and sys.argv[1] == "--throughput-child":
        _throughput_child(json.loads(sys.argv[2]))
        return
    from resilient_jax.config import ParallelConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=config_file, default=str(REPO / "configs" / "tiny.yaml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--sections", type=comma_list(SECTIONS), default="meshes,depth,gpu")
    parser.add_argument("--depth", type=at_least(1), default=32, help="layers of the depth section's model")
    parser.add_argument("--gpu-configs", type=comma_list(list(GPU_CONFIGS)), default=",".join(GPU_CONFIGS))
    modes = typing.get_args(typing.get_type_hints(ParallelConfig)["reduction"])  # parallel.reduction's values
    parser.add_argument("--gpu-modes", type=comma_list(modes), default="native,invariant")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per compile subprocess")
    parser.add_argument("--throughput-layers", type=at_least(1), default=4)
    parser.add_argument("--throughput-steps", type=at_least(1), default=10)
    parser.add_argument("--peak-flops", type=float, default=H100_BF16_PEAK_FLOPS, help="per device, for MFU")
    parser.add_argument("--cpu-smoke", action="store_true", help="throughput: tiny widths on one CPU device")
    args = parser.parse_args()
    # The meshes and depth sections apply --set in child processes: a bad key or value there would be
    # one compile failure after another (or a traceback) instead of one line now.
    load_config_or_exit(parser, args.config, args.overrides)
    sections = set(args.sections)
    report: dict = {"config": args.config, "overrides": args.overrides, "devices": DEVICES,
                    "note": "CPU compiles (emulated devices): memory figures are a proxy for GPU"}
    if "meshes" in sections:
        report["meshes"] = section_meshes(args.config, args.overrides, args.timeout)
    if "depth" in sections:
        report["depth"] = section_depth(args.config, args.overrides, args.depth, args.timeout)
    if "gpu" in sections:
        report["gpu"] = section_gpu(args.gpu_configs, args.gpu_modes, args.timeout)
    if "throughput" in sections:
        report["throughput"] = section_throughput(args.throughput_layers, args.throughput_steps, args.cpu_smoke,
                                                  args.peak_flops, args.timeout)
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
