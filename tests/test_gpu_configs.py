"""GPU configs cannot train here; their step must still lower on an abstract mesh of the intended size."""

from __future__ import annotations

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

# config -> (intended device count, expected parameter count range in billions)
GPU_CONFIGS = {
    "gpu-1b": (64, (0.8, 1.2)),
    "gpu-8b": (128, (7.5, 8.5)),
    "gpu-46node-4region": (368, (7.5, 8.5)),
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
    plan = step_lib.make_shard_plan(cfg.data.global_batch, cfg.parallel.virtual_shards, mesh.shape["data"])
    compute = step_lib.make_compute(model_def, mesh, plan, seed=0, mode=cfg.parallel.reduction, use_dropout=False)
    apply = step_lib.make_apply(tx, lr_schedule(cfg.optimizer, cfg.train.steps),
                                state_lib.state_shardings(model_def, tx, mesh), mesh)
    batch = mesh_lib.batch_sharding(mesh)
    tokens = jax.ShapeDtypeStruct((plan.padded_rows, cfg.data.seq_len + 1), jnp.int32, sharding=batch)
    weights = jax.ShapeDtypeStruct((plan.padded_rows, cfg.data.seq_len), jnp.float32, sharding=batch)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=mesh_lib.replicated(mesh))
    compute_hlo = compute.trace(abstract.params, tokens, weights, step).lower(lowering_platforms=("cuda",)).as_text()
    apply_hlo = apply.trace(abstract, abstract.params, step).lower(lowering_platforms=("cuda",)).as_text()
    # The cross-replica reduction is the invariant one (all_to_all + all_gather), and weights are
    # sharded over fsdp inside a replica.
    assert "all_to_all" in compute_hlo and "all_gather" in compute_hlo
    assert f"num_partitions = {devices}" in compute_hlo
    wq = abstract.params["blocks"][0]["attn"]["wq"]
    # One replica per node: fsdp spans the GPUs of a node, data spans the nodes.
    assert wq.sharding.spec[0] == "fsdp" and mesh.shape["fsdp"] == GPUS_PER_NODE
    assert mesh.shape["data"] == devices // GPUS_PER_NODE
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
    # Losing nodes or whole regions never changes the global batch, and the survivors stay within
    # the memory the config's header budgets for (<= 4 stacked shard gradients per GPU).
    regions = {r.name: r.hosts for r in topo.regions}
    for lost in ([], ["ap-northeast"], ["us-east"], ["us-east", "ap-northeast"]):
        replicas = hosts - sum(regions[name] for name in lost)
        assert replicas >= cfg.runtime.min_hosts
        plan = step_lib.make_shard_plan(cfg.data.global_batch, cfg.parallel.virtual_shards, replicas)
        assert plan.rows_per_shard * plan.num_shards == cfg.data.global_batch
        assert plan.rows_per_shard % cfg.parallel.fsdp == 0  # a shard's rows can split over a node's GPUs
        assert plan.shards_per_replica <= 4
    assert cfg.runtime.launcher == "ray" and cfg.runtime.token == ""
