"""GPU configs cannot train here; their step must still lower on an abstract mesh of the intended size,
and compile (really partitioned, buffers assigned) as a reduced copy on emulated CPU devices.

The per-device peak of the full-size configs is measured by `scripts/bench_scale.py --sections gpu`
(one replica's program -- a node's, or a replica group's with parallel.hosts_per_replica > 1 --
real widths, 8 and 16 layers, extrapolated to the configs' depth).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import pytest

from resilient_jax import mesh as mesh_lib
from resilient_jax import state as state_lib
from resilient_jax import step as step_lib
from resilient_jax.config import load_config
from resilient_jax.model import count_params
from resilient_jax.optimizer import build_optimizer, lr_schedule

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import bench_scale  # noqa: E402  (scripts/ is not a package)

# config -> (intended device count, expected parameter count range in billions)
GPU_CONFIGS = {
    "gpu-1b": (64, (0.8, 1.2)),
    "gpu-8b": (128, (7.5, 8.5)),
    "gpu-46node-4region": (368, (7.5, 8.5)),
    # Replica groups of 10 nodes: the world is 4 groups x 80 GPUs (its 6 spare nodes are outside it).
    "gpu-300b-46node": (320, (280, 320)),
}
GPUS_PER_NODE = 8


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_config_step_lowers_on_its_abstract_mesh(name):
    devices, (lo, hi) = GPU_CONFIGS[name]
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    mesh = mesh_lib.build_abstract_mesh(cfg.parallel, devices)
    model_def = state_lib.make_model_def(cfg.model)
    tx = build_optimizer(cfg.optimizer, cfg.train.steps)
    abstract = state_lib.abstract_state(model_def, tx, mesh)
    assert lo <= count_params(abstract.params) / 1e9 <= hi
    plan = step_lib.make_shard_plan(cfg.data.global_batch, cfg.parallel.virtual_shards, _plan_devices(mesh))
    compute = step_lib.make_compute(model_def, mesh, plan, seed=0, mode=cfg.parallel.reduction, use_dropout=False)
    apply = step_lib.make_apply(tx, lr_schedule(cfg.optimizer, cfg.train.steps),
                                state_lib.state_shardings(model_def, tx, mesh), mesh)
    batch = mesh_lib.batch_sharding(mesh)
    tokens = jax.ShapeDtypeStruct((plan.padded_rows, cfg.data.seq_len + 1), jnp.int32, sharding=batch)
    weights = jax.ShapeDtypeStruct((plan.padded_rows, cfg.data.seq_len), jnp.float32, sharding=batch)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=mesh_lib.replicated(mesh))
    compute_hlo = compute.trace(abstract.params, tokens, weights, step).lower(lowering_platforms=("cuda",)).as_text()
    apply_hlo = apply.trace(abstract, abstract.params, step).lower(lowering_platforms=("cuda",)).as_text()
    # Weights are gathered over fsdp and gradients reduced across the devices.
    assert "all_gather" in compute_hlo
    assert any(op in compute_hlo for op in ("all_to_all", "reduce_scatter", "all_reduce"))
    assert f"num_partitions = {devices}" in compute_hlo
    # Scanned layers: one stacked wq, its "layers" dim replicated, d_model over fsdp.
    assert cfg.model.scan_layers
    wq = abstract.params["blocks"]["attn"]["wq"]
    assert wq.shape[0] == cfg.model.n_layers
    # One replica per node (or per group of k = parallel.hosts_per_replica nodes): fsdp spans the
    # replica's GPUs, data spans the replicas.
    replica_gpus = cfg.parallel.hosts_per_replica * GPUS_PER_NODE
    assert wq.sharding.spec[:2] == (None, "fsdp") and mesh.shape["fsdp"] == replica_gpus
    assert mesh.shape["data"] == devices // replica_gpus
    assert "tf.aliasing_output" in apply_hlo  # the apply phase donates the old state


@dataclass(frozen=True)
class _FakeGpu:
    """Just what build_mesh reads: the GPU client numbers devices process by process (node by node)."""

    id: int
    process_index: int
    platform: str = "gpu"


def test_46node_config_topology_is_its_mesh_and_an_fsdp_group_is_one_node():
    cfg = load_config(REPO / "configs" / "gpu-46node-4region.yaml")
    topo = cfg.topology
    hosts = sum(r.hosts for r in topo.regions)
    assert [r.name for r in topo.regions] == ["us-east", "us-west", "eu-west", "ap-northeast"]
    assert (hosts, topo.devices_per_host) == (46, GPUS_PER_NODE)
    assert hosts * topo.devices_per_host == GPU_CONFIGS["gpu-46node-4region"][0]
    assert (cfg.parallel.data, cfg.parallel.fsdp, cfg.parallel.tensor) == (46, 8, 1)
    devices = [_FakeGpu(node * GPUS_PER_NODE + local, node) for node in range(hosts) for local in range(GPUS_PER_NODE)]
    mesh = mesh_lib.build_mesh(cfg.parallel, devices)
    assert dict(mesh.shape) == {"data": 46, "fsdp": 8, "tensor": 1}
    for replica in range(hosts):
        assert {d.process_index for d in mesh.devices[replica].flat} == {replica}
    # Losing nodes or whole regions never changes the global batch, and no survivor runs more than
    # the 4 shards per GPU the config's header budgets for.
    regions = {r.name: r.hosts for r in topo.regions}
    for lost in ([], ["ap-northeast"], ["us-east"], ["us-east", "ap-northeast"]):
        nodes = hosts - sum(regions[name] for name in lost)
        assert nodes >= cfg.runtime.min_hosts
        gpus = nodes * GPUS_PER_NODE
        plan = step_lib.make_shard_plan(cfg.data.global_batch, cfg.parallel.virtual_shards, gpus)
        assert plan.rows_per_shard * plan.num_shards == cfg.data.global_batch
        assert -(-plan.num_shards // gpus) <= 4
    assert cfg.runtime.launcher == "ray" and cfg.runtime.token == ""


def test_300b_config_a_replica_is_a_group_of_10_nodes_in_one_region():
    cfg = load_config(REPO / "configs" / "gpu-300b-46node.yaml")
    topo, k = cfg.topology, cfg.parallel.hosts_per_replica
    workers = sum(r.hosts for r in topo.regions)
    assert [r.name for r in topo.regions] == ["us-east", "us-west", "eu-west", "ap-northeast"]
    assert (workers + sum(r.spares for r in topo.regions), topo.devices_per_host) == (46, GPUS_PER_NODE)
    # The rules of replica groups: fsdp x tensor spans a group's GPUs, k divides every region's
    # worker hosts (no group crosses a region), data = the number of groups.
    assert k == 10 and not cfg.parallel.allow_cross_region_replica
    assert cfg.parallel.fsdp * cfg.parallel.tensor == k * topo.devices_per_host
    assert all(r.hosts % k == 0 for r in topo.regions)
    assert cfg.parallel.data == workers // k == 4
    assert workers * topo.devices_per_host == GPU_CONFIGS["gpu-300b-46node"][0]
    assert cfg.model.d_model % cfg.parallel.fsdp == 0
    # Mesh row r = the 80 GPUs of group r: hosts 10r..10r+9, all in one region.
    devices = [_FakeGpu(host * GPUS_PER_NODE + local, host) for host in range(workers) for local in range(GPUS_PER_NODE)]
    mesh = mesh_lib.build_mesh(cfg.parallel, devices)
    assert dict(mesh.shape) == {"data": 4, "fsdp": 80, "tensor": 1}
    region_of = [r.name for r in topo.regions for _ in range(r.hosts)]
    for group in range(cfg.parallel.data):
        hosts = {d.process_index for d in mesh.devices[group].flat}
        assert hosts == set(range(group * k, (group + 1) * k))
        assert len({region_of[h] for h in hosts}) == 1
    # Losing groups keeps the global batch; down to runtime.min_replicas no GPU runs more than 6 shards.
    for groups in range(cfg.parallel.data, cfg.runtime.min_replicas - 1, -1):
        gpus = groups * k * GPUS_PER_NODE
        plan = step_lib.make_shard_plan(cfg.data.global_batch, cfg.parallel.virtual_shards, gpus)
        assert plan.rows_per_shard * plan.num_shards == cfg.data.global_batch
        assert -(-plan.num_shards // gpus) <= 6
    assert cfg.runtime.launcher == "ray" and cfg.runtime.token == ""


def _plan_devices(mesh) -> int:
    """How many devices the shard plan spreads shards over, as the Trainer counts them."""
    return mesh_lib.grid_size(mesh)


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_config_shards_are_a_multiple_of_the_data_x_fsdp_devices(name):
    """Each virtual shard is computed whole on one device of the data x fsdp grid: no device idles."""
    devices, _ = GPU_CONFIGS[name]
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    sizes = mesh_lib.mesh_shape(cfg.parallel, devices)
    assert cfg.parallel.virtual_shards % (sizes["data"] * sizes["fsdp"]) == 0
    assert cfg.data.global_batch % cfg.parallel.virtual_shards == 0


# Widths small enough to compile on 2 CPU cores in seconds; depth, rows per shard, dtype and the
# remat/scan/attention settings are the config's own.
REDUCED = ["model.d_model=128", "model.d_ff=256", "model.n_heads=4", "model.vocab_size=512", "model.n_layers=2",
           "data.seq_len=64"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_config_compiles_as_a_reduced_copy_on_emulated_devices(name):
    """Compiled, not just lowered: XLA partitions the program and assigns every buffer."""
    devices, _ = GPU_CONFIGS[name]
    full = load_config(REPO / "configs" / f"{name}.yaml")
    rows = full.data.global_batch // full.parallel.virtual_shards
    shards_per_device = full.parallel.virtual_shards // devices
    data, fsdp = 2, 4  # both axes > 1, like the cluster's (nodes, GPUs per node)
    shards = shards_per_device * data * fsdp
    cfg = load_config(REPO / "configs" / f"{name}.yaml",
                      [*REDUCED, f"parallel.virtual_shards={shards}", f"data.global_batch={shards * rows}"])
    report = bench_scale.compile_step(cfg, data, fsdp)
    assert report["rows_per_shard"] == rows and report["virtual_shards"] == shards
    compute = report["compute"]
    assert compute["temp_bytes"] > 0 and compute["dot_flops"] > 0
    # Every loop's trip count is known (the exact reduction's rare second pass is a program of its
    # own, not a loop around the first): dot_flops counts every loop as many times as it runs.
    assert compute["unknown_trip_counts"] == 0
    assert compute["collective_bytes_total"] > 0
    # The whole state on one device would be 16 B/param; sharded over fsdp each device holds 1/fsdp
    # of the optimizer state.
    n_params = count_params(jax.eval_shape(state_lib.make_model_def(cfg.model).init_params, jax.random.key(0)))
    assert report["opt_state_bytes"] <= math.ceil(8 * n_params / fsdp) + 1024
