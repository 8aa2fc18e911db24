"""GPU configs cannot train here; their step must still lower on an abstract mesh of the intended size."""

from __future__ import annotations

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
GPU_CONFIGS = {"gpu-1b": (64, (0.8, 1.2)), "gpu-8b": (128, (7.5, 8.5))}


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
    assert wq.sharding.spec[0] == "fsdp" and mesh.shape["fsdp"] == 8
    assert "tf.aliasing_output" in apply_hlo  # the apply phase donates the old state
