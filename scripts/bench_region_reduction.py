"""What crosses a region boundary per step: the flat gradient sum vs the region-aware one, from the
compiled programs (resilient_jax.hierarchy, resilient_jax.hlo_stats), and that both give the same bits.

    python scripts/bench_region_reduction.py [--config configs/cpu-6host-3region.yaml] [--out DIR]

Part 1, the config's real step on one process with emulated CPU devices, one mesh row per device
as the elastic run lays it out (data-major, `topology.devices_per_host` devices per host, hosts in
`topology.regions` order), for the full cluster, after one host of the middle region is lost, and
after the last region is lost. Each case compiles the step flat and region-aware, runs both on one
batch, compares every gradient bit, and reads from each program's HLO:
  - operand bytes: what the members of region-spanning collectives hand to them, summed over the
    cluster (the flat sum hands over every replica's full buffer);
  - ring bytes: what ring algorithms would send over links between regions.
Part 2, the mission's shape (46 nodes as 12+12+12+10 in 4 regions): the data sum alone, compiled on
46 emulated devices (one per node: every fsdp index of a node runs the same groups), for an 8 MiB
int64 buffer; ratios do not depend on the buffer's size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from cli_args import config_file, load_config_or_exit, output_dir  # noqa: E402  (a script next to this one)

os.environ.setdefault("JAX_PLATFORMS", "cpu")
MISSION_REGIONS = [("us-east", 12), ("us-west", 12), ("eu-west", 12), ("ap-northeast", 10)]


def _cluster_regions(cfg, lose: str | None) -> list[str]:
    """The region of each device (= data index: fsdp 1) of the world that is left after `lose`."""
    hosts = [r.name for r in cfg.topology.regions for _ in range(r.hosts)]
    if lose == "host":
        middle = cfg.topology.regions[len(cfg.topology.regions) // 2].name
        hosts.remove(middle)
    elif lose == "region":
        hosts = [h for h in hosts if h != cfg.topology.regions[-1].name]
    return [h for h in hosts for _ in range(cfg.topology.devices_per_host)]


def _step_case(cfg, regions: list[str]) -> dict:
    import jax
    import numpy as np

    from resilient_jax import hierarchy, hlo_stats
    from resilient_jax import mesh as mesh_lib
    from resilient_jax import state as state_lib
    from resilient_jax import step as step_lib
    from resilient_jax.config import ParallelConfig
    from resilient_jax.optimizer import build_optimizer

    n = len(regions)
    model_def = state_lib.make_model_def(cfg.model)
    mesh = mesh_lib.build_mesh(ParallelConfig(data=n), jax.devices()[:n])
    plan = step_lib.make_shard_plan(cfg.data.global_batch, cfg.parallel.virtual_shards, n)
    params = state_lib.init_state(model_def, build_optimizer(cfg.optimizer, cfg.train.steps), mesh,
                                  cfg.train.seed).params
    rs = np.random.default_rng(0)
    tokens = rs.integers(0, cfg.model.vocab_size, (plan.padded_rows, cfg.data.seq_len + 1), dtype=np.int32)
    weights = np.ones((plan.padded_rows, cfg.data.seq_len), np.float32)
    groups = hierarchy.plan(regions)
    out = {"replicas": n, "regions": "+".join(str(regions.count(r)) for r in dict.fromkeys(regions)),
           "order": groups.describe() if groups else "flat"}
    grads = {}
    for name, g in (("flat", None), ("region_aware", groups)):
        compute = step_lib.make_compute(model_def, mesh, plan, seed=cfg.train.seed, mode=cfg.parallel.reduction,
                                        use_dropout=cfg.model.dropout > 0, regions=g)
        compiled = compute.lower(params, tokens, weights, np.int32(0)).compile()
        result = compiled(params, tokens, weights, np.int32(0), plan.layout())
        assert bool(result.fits), "random tokens, equal weights: the exact sum's first pass fits"
        grads[name] = [np.asarray(x) for x in jax.tree.leaves(result.grads)]
        stats = hlo_stats.analyze(compiled.as_text(), n, regions)
        out[name] = {"operand_bytes": stats.cross_region_operand_bytes, "ring_bytes": stats.cross_region_ring_bytes}
    out["same_bits"] = all(np.array_equal(a, b) for a, b in zip(grads["flat"], grads["region_aware"]))
    for key in ("operand_bytes", "ring_bytes"):
        out[f"{key}_ratio"] = out["flat"][key] / max(out["region_aware"][key], 1.0)
    return out


def _mission_case() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec

    from resilient_jax import collectives, hierarchy, hlo_stats

    regions = [name for name, hosts in MISSION_REGIONS for _ in range(hosts)]
    n, elements = len(regions), 1 << 20
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    groups = hierarchy.plan(regions)
    out = {"replicas": n, "regions": "+".join(str(h) for _, h in MISSION_REGIONS), "order": groups.describe(),
           "buffer_bytes_per_replica": 8 * elements}
    sums = {}
    for name, g in (("flat", None), ("region_aware", groups)):
        with jax.enable_x64(True):
            fn = jax.jit(jax.shard_map(lambda x, g=g: collectives.data_sum(x.reshape(-1), "data", g)[None],
                                       mesh=mesh, in_specs=PartitionSpec("data"), out_specs=PartitionSpec("data"),
                                       check_vma=False))
            x = jnp.asarray(np.random.default_rng(1).integers(-2**40, 2**40, (n, elements)), jnp.int64)
            compiled = fn.lower(x).compile()
            sums[name] = np.asarray(compiled(x))
        stats = hlo_stats.analyze(compiled.as_text(), n, regions)
        out[name] = {"operand_bytes": stats.cross_region_operand_bytes, "ring_bytes": stats.cross_region_ring_bytes}
    out["same_bits"] = bool(np.array_equal(sums["flat"], sums["region_aware"]))
    for key in ("operand_bytes", "ring_bytes"):
        out[f"{key}_ratio"] = out["flat"][key] / max(out["region_aware"][key], 1.0)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=config_file, default=str(REPO / "configs" / "cpu-6host-3region.yaml"))
    parser.add_argument("--out", default=str(REPO / "runs" / "bench_region_reduction"),
                        help="directory for region_reduction.json (made if new)")
    parser.add_argument("--skip-mission", action="store_true", help="part 1 only")
    args = parser.parse_args(argv)
    # Checked before the compiles: --out is first written at the very end.
    out = output_dir(parser, "--out", args.out)

    cfg = load_config_or_exit(parser, args.config)
    if not cfg.topology.regions:
        parser.error(f"--config {args.config}: no topology.regions; pick a config with regions, "
                     "e.g. configs/cpu-6host-3region.yaml")
    cases = [("all hosts", None), ("one host lost", "host"), ("one region lost", "region")]
    import jax

    jax.config.update("jax_num_cpu_devices", max(len(_cluster_regions(cfg, None)), len(
        [r for r, h in MISSION_REGIONS for _ in range(h)])))
    results = {"config": args.config, "cases": {}}
    print(f"{'case':<18} {'regions':<12} {'operand bytes flat -> aware':<32} {'ratio':>6} "
          f"{'ring bytes flat -> aware':<30} {'ratio':>6}  same bits")
    rows = [(label, _step_case(cfg, _cluster_regions(cfg, lose))) for label, lose in cases]
    if not args.skip_mission:
        rows.append(("mission (reduce)", _mission_case()))
    for label, r in rows:
        results["cases"][label] = r
        print(f"{label:<18} {r['regions']:<12} "
              f"{r['flat']['operand_bytes']:>13,.0f} -> {r['region_aware']['operand_bytes']:>13,.0f} "
              f"{r['operand_bytes_ratio']:>6.2f} {r['flat']['ring_bytes']:>12,.0f} -> "
              f"{r['region_aware']['ring_bytes']:>12,.0f} {r['ring_bytes_ratio']:>6.2f}  {r['same_bits']}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "region_reduction.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out / 'region_reduction.json'}")
    return 0 if all(r["same_bits"] for _, r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
