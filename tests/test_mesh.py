"""Mesh: axis resolution from config, logical->mesh rules, a state born sharded."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import PartitionSpec as P

from resilient_jax import mesh as mesh_lib
from resilient_jax.config import ModelConfig, OptimizerConfig, ParallelConfig
from resilient_jax.optimizer import build_optimizer
from resilient_jax.state import init_state, make_model_def, state_shardings


@pytest.mark.parametrize(
    "data, fsdp, tensor, devices, expected",
    [
        (-1, 1, 1, 8, {"data": 8, "fsdp": 1, "tensor": 1}),
        (-1, 2, 2, 8, {"data": 2, "fsdp": 2, "tensor": 2}),
        (2, -1, 1, 8, {"data": 2, "fsdp": 4, "tensor": 1}),
        (3, 1, 1, 8, {"data": 3, "fsdp": 1, "tensor": 1}),  # uses the first 3 devices
    ],
)
def test_mesh_shape_resolves_the_rest(data, fsdp, tensor, devices, expected):
    assert mesh_lib.mesh_shape(ParallelConfig(data=data, fsdp=fsdp, tensor=tensor), devices) == expected


@pytest.mark.parametrize(
    "parallel, key",
    [
        (ParallelConfig(data=-1, fsdp=-1), "parallel.data"),
        (ParallelConfig(data=16), "exceeds"),
        (ParallelConfig(data=-1, fsdp=3), "parallel.data=-1"),
        (ParallelConfig(data=0), "parallel.data"),
    ],
)
def test_bad_mesh_config_names_the_key(parallel, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.").replace("=", "=")):
        mesh_lib.mesh_shape(parallel, 8)


def test_logical_rules_map_to_mesh_axes():
    assert mesh_lib.logical_to_mesh_spec(("vocab", "embed")) == P("tensor", "fsdp")
    assert mesh_lib.logical_to_mesh_spec(("embed", "heads", "kv")) == P("fsdp", "tensor", None)
    with pytest.raises(KeyError, match="nope"):
        mesh_lib.logical_to_mesh_spec(("nope",))


def test_state_is_born_sharded_on_fsdp_and_tensor():
    mesh = mesh_lib.build_mesh(ParallelConfig(data=2, fsdp=2, tensor=2))
    model_def = make_model_def(ModelConfig(d_model=32, n_heads=4, d_ff=64))
    tx = build_optimizer(OptimizerConfig(), 10)
    state = init_state(model_def, tx, mesh, seed=0)
    wq = state.params["blocks"][0]["attn"]["wq"]
    assert wq.sharding.spec == P("fsdp", "tensor", None)
    # Each device holds a quarter of wq (fsdp=2 x tensor=2); replicas along data hold full copies.
    assert wq.addressable_shards[0].data.shape == (16, 2, 8)
    expected = state_shardings(model_def, tx, mesh)
    mu = state.opt_state[1][0].mu["blocks"][0]["attn"]["wq"]
    assert mu.sharding.spec == expected.params["blocks"][0]["attn"]["wq"].spec


def test_batch_rows_split_over_the_data_x_fsdp_grid():
    mesh = mesh_lib.build_mesh(ParallelConfig(data=2, fsdp=2, tensor=2))
    assert mesh_lib.grid_size(mesh) == 4
    sharding = mesh_lib.batch_sharding(mesh)
    assert sharding.spec == P(("data", "fsdp"))
    # Grid device (d, f) holds row block d*fsdp + f; its tensor pair holds the same rows.
    blocks = {d.id: idx[0].start // 2 for d, idx in sharding.devices_indices_map((8, 3)).items()}
    grid = mesh.devices
    for d in range(2):
        for f in range(2):
            assert {blocks[dev.id] for dev in grid[d, f]} == {d * 2 + f}


def test_manual_specs_keep_only_the_named_axes():
    assert mesh_lib.keep_axes(P("fsdp", "tensor", None), {"data", "fsdp"}) == P("fsdp", None, None)
    assert mesh_lib.axis_position(P(None, "fsdp"), "fsdp") == 1
    assert mesh_lib.axis_position(P("tensor"), "fsdp") == -1
