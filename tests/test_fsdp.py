"""FSDP inside the step (resilient_jax.fsdp): weights gathered one group at a time, each shard's
gradient summed over fsdp inside the backward pass, its running sum carried through a channel.

The claims: a channel brings back exactly the bits its backward pass wrote, through the scanned
and rematerialised model; the compiled step never gathers more than one group at a time and its
device memory does not hold a whole-model gradient or accumulator.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

from resilient_jax import fsdp
from resilient_jax import mesh as mesh_lib
from resilient_jax import state as state_lib
from resilient_jax import step as step_lib
from resilient_jax.config import ModelConfig, ParallelConfig
from resilient_jax.model import count_params
from resilient_jax.reduce import GroupSum


class _BitsReducer:
    """A reducer whose backward pass writes fixed bits: acc := pattern XOR acc (int64 and int32),
    whatever the gradient. What comes out of the channel must be exactly that."""

    name = "bits"

    def __init__(self, pattern64: np.ndarray, pattern32: np.ndarray):
        self.pattern64, self.pattern32 = pattern64, pattern32

    def init(self, group, plan=None, stack=()):
        with jax.enable_x64(True):
            accs = [jnp.zeros(stack + group.local_shape(i), jnp.int64) for i in range(len(group.shapes))]
            return GroupSum(accs=accs, plan=[jnp.zeros(stack + (4,), jnp.int32) for _ in group.shapes],
                            nonfinite=jnp.zeros(stack, jnp.int32), live=jnp.ones(stack, jnp.int32))

    def add(self, group, state, grads):
        with jax.enable_x64(True):
            accs = [a ^ jnp.asarray(self.pattern64.reshape(-1)[:a.size].reshape(a.shape)) for a in state.accs]
            plan = [p ^ jnp.asarray(self.pattern32[:4]) for p in state.plan]
            return state._replace(accs=accs, plan=plan, nonfinite=state.nonfinite + 1)


@pytest.mark.parametrize("scan, remat", [(True, "save_dots"), (True, "block"), (False, "none")])
def test_a_channel_returns_exactly_the_bits_its_backward_pass_wrote(scan, remat):
    # Every int32 half a NaN or infinity pattern would have as a float32 (quiet, signalling, with
    # payloads), plus random bits: nothing between the backward pass and the caller may touch them.
    rs = np.random.default_rng(0)
    specials = np.array([0x7FC00000, 0x7F800001, 0xFFC00001, 0x7F800000, 0xFF800000, 0x7FBFFFFF, 0x80000000, 1],
                        np.uint32)
    halves = np.concatenate([specials, rs.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)])
    pattern64 = (halves[:2048].astype(np.uint64) << np.uint64(32) | halves[2048:4096].astype(np.uint64)).view(np.int64)
    pattern32 = halves[:4].view(np.int32)
    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=3, n_heads=2, d_ff=32, dropout=0.0, scan_layers=scan,
                      remat=remat)
    model_def = state_lib.make_model_def(cfg)
    members = min(2, len(jax.devices()))  # 2 on the emulated CPU devices; 1 on a one-GPU machine (gpu_check.sh)
    mesh = mesh_lib.build_mesh(ParallelConfig(data=1, fsdp=members), jax.devices()[:members])
    partition = fsdp.Partition.of(model_def, mesh)
    reducer = _BitsReducer(pattern64, pattern32)
    params = model_def.init_params(jax.random.key(0))
    specs = jax.tree.map(lambda s: mesh_lib.keep_axes(s, {"data", "fsdp"}),
                         mesh_lib.specs_from_logical(model_def.logical_axes))
    tokens = jnp.zeros((1, 8), jnp.int32)

    def per_device(params_local):
        with jax.enable_x64(True):
            sums = partition.init(reducer)
            (_, _), sums = partition.value_and_sums(model_def, reducer, lambda logits: (jnp.sum(logits), None),
                                                    params_local, tokens, None, sums)
            return [jax.lax.bitcast_convert_type(a, jnp.uint32) for gs in sums.flat() for a in gs.accs] + \
                [p for gs in sums.flat() for p in gs.plan] + [jnp.atleast_1d(gs.nonfinite) for gs in sums.flat()]

    run = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(specs,), out_specs=PartitionSpec("fsdp"),
                                check_vma=False))
    with jax.enable_x64(True):
        out = jax.device_get(run(params))
    groups = partition.groups()
    n_leaves = sum(len(g.shapes) for g in groups)
    accs, plans, nonfinite = out[:n_leaves], out[n_leaves:2 * n_leaves], out[2 * n_leaves:]
    leaf = 0
    for g in groups:
        stack = (cfg.n_layers,) if (g is partition.layer and scan) else ()
        for i in range(len(g.shapes)):
            local = stack + g.local_shape(i)
            # Each layer's backward pass wrote the pattern over its own slice.
            one = pattern64.reshape(-1)[:math.prod(g.local_shape(i))].reshape(g.local_shape(i))
            expected = np.broadcast_to(one, local)
            # Each fsdp member returned its own (equal) copy, stacked on dim 0.
            got = accs[leaf].view(np.int64).reshape((members,) + local)
            for copy in got:
                np.testing.assert_array_equal(copy, expected)
            assert (plans[leaf].reshape(members, -1)[:, -4:] == pattern32).all()
            leaf += 1
    assert all((n == 1).all() for n in nonfinite)  # each group's backward pass ran exactly once per layer


def _compiled_step(cfg: ModelConfig, data: int, fsdp_size: int, mode: str, shards_per_device: int = 2):
    model_def = state_lib.make_model_def(cfg)
    mesh = mesh_lib.build_mesh(ParallelConfig(data=data, fsdp=fsdp_size), jax.devices()[:data * fsdp_size])
    devices = data * fsdp_size
    plan = step_lib.make_shard_plan(devices * shards_per_device, devices * shards_per_device, devices)
    compute = step_lib.make_compute(model_def, mesh, plan, seed=0, mode=mode, use_dropout=False)
    params = state_lib.abstract_state(model_def, optax.sgd(0.1), mesh).params
    batch = mesh_lib.batch_sharding(mesh)
    seq = 16
    tokens = jax.ShapeDtypeStruct((plan.padded_rows, seq + 1), jnp.int32, sharding=batch)
    weights = jax.ShapeDtypeStruct((plan.padded_rows, seq), jnp.float32, sharding=batch)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=mesh_lib.replicated(mesh))
    n_params = count_params(params)
    return compute.lower(params, tokens, weights, step).compile(), n_params, model_def


# Parameters dominate activations here (16 tokens a shard), so whole-model buffers would show.
WIDE = ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=4, d_ff=1024, dropout=0.0, scan_layers=True,
                   remat="save_dots")

_GATHER = re.compile(r"= (\w+)\[([\d,]*)\][^=]*? all-gather\(")


@pytest.mark.parametrize("mode, remat", [("invariant", "save_dots"), ("native", "save_dots"), ("invariant", "block")])
def test_the_step_gathers_one_group_at_a_time_and_a_layer_costs_less_than_its_gathered_weights(mode, remat):
    wide = dataclasses.replace(WIDE, remat=remat)
    four, n_params, model_def = _compiled_step(wide, 1, 8, mode)
    hlo = four.as_text()
    # No all-gather brings more than the largest group (a layer, or embedding + unembedding).
    params = jax.eval_shape(model_def.init_params, jax.random.key(0))
    layer = sum(math.prod(x.shape[1:]) for x in jax.tree.leaves(params["blocks"]))
    top = n_params - sum(math.prod(x.shape) for x in jax.tree.leaves(params["blocks"]))
    gathered = [math.prod(int(d) for d in dims.split(",") if d) for dtype, dims in _GATHER.findall(hlo)
                if dtype == "f32"]
    assert gathered and max(gathered) <= max(layer, top), (max(gathered), layer, top)
    # What one more layer adds to the step's temporaries: its fsdp slice of the running sum (int64
    # or float32, 1/8 of the layer) and what remat keeps -- less than a float32 copy of the layer's
    # weights, which the backward pass gathers again (measured, bytes a layer parameter: save_dots
    # 1.33 invariant, 0.70 native). Gathering the whole model up front and summing into whole-model
    # accumulators (the step before resilient_jax.fsdp) added 17.5 and 11.8 with save_dots. (With
    # remat "none" the block keeps everything for its backward pass, its gathered weights too:
    # 5.7 bytes a layer parameter.)
    two = _compiled_step(dataclasses.replace(wide, n_layers=2), 1, 8, mode)[0]
    per_layer = (four.memory_analysis().temp_size_in_bytes - two.memory_analysis().temp_size_in_bytes) / 2
    assert per_layer < 4 * layer, (per_layer, 4 * layer)


def test_device_memory_does_not_grow_with_the_shards_a_device_runs():
    # O(1) gradient buffers per device: 2 or 8 shards per device, the same temporaries (within the
    # per-shard statistics, a few KB; measured 28,146,744 vs 28,147,256 bytes). (With one shard a
    # device, XLA removes the loop and its carried buffers: less.)
    small = dataclasses.replace(WIDE, n_layers=2)
    two = _compiled_step(small, 2, 4, "invariant", shards_per_device=2)[0].memory_analysis().temp_size_in_bytes
    eight = _compiled_step(small, 2, 4, "invariant", shards_per_device=8)[0].memory_analysis().temp_size_in_bytes
    assert eight - two < 64 * 1024, (two, eight)


def test_the_gpu_configs_path_scanned_layers_and_save_dots_has_the_same_bits_on_every_layout():
    # tiny's widths with the GPU configs' block stack: stacked layers (blocks per layer, slices of
    # stacked sums) and remat save_dots, invariant, on three (data, fsdp) layouts.
    from resilient_jax.config import load_config

    from conftest import TINY

    cfg = load_config(TINY)
    model_cfg = dataclasses.replace(cfg.model, scan_layers=True, remat="save_dots")
    model_def = state_lib.make_model_def(model_cfg)
    rs = np.random.default_rng(7)
    tokens = rs.integers(0, 256, (48, 65), dtype=np.int32)
    weights = np.ones((48, 64), np.float32)
    params = model_def.init_params(jax.random.key(0))
    grads = {}
    for data, fsdp_size in ((8, 1), (4, 2), (1, 8)):
        mesh = mesh_lib.build_mesh(ParallelConfig(data=data, fsdp=fsdp_size))
        plan = step_lib.make_shard_plan(48, 24, data * fsdp_size)
        compute = step_lib.make_compute(model_def, mesh, plan, seed=0, mode="invariant", use_dropout=True)
        placed = jax.device_put(params, mesh_lib.shardings_from_logical(model_def.logical_axes, mesh))
        result = compute(placed, tokens, weights, np.int32(0))
        grads[(data, fsdp_size)] = [np.asarray(x) for x in jax.tree.leaves(result.grads)]
    for layout, leaves in grads.items():
        for a, b in zip(grads[(8, 1)], leaves):
            np.testing.assert_array_equal(a, b, err_msg=str(layout))


_BF16_RUNS: dict = {}


def _bf16_grads(mode: str, data: int = 2, fsdp_size: int = 4):
    """The compute step's gradients of a bf16, scanned, rematerialised model on a data x fsdp mesh
    (with the program's compiled and lowered text); runs are shared between tests while the
    settings they patch are the same."""
    from resilient_jax.model import TransformerLM

    key = (mode, data, fsdp_size, fsdp.PACK_MAX_BYTES, TransformerLM.CAST_TO_COMPUTE_DTYPE)
    if key not in _BF16_RUNS:
        _BF16_RUNS[key] = _run_bf16(mode, data, fsdp_size)
    return _BF16_RUNS[key]


def _run_bf16(mode: str, data: int, fsdp_size: int):
    cfg = dataclasses.replace(WIDE, n_layers=2, d_model=64, d_ff=128, dtype="bfloat16", remat="block")
    model_def = state_lib.make_model_def(cfg)
    mesh = mesh_lib.build_mesh(ParallelConfig(data=data, fsdp=fsdp_size), jax.devices()[:data * fsdp_size])
    plan = step_lib.make_shard_plan(16, 16, data * fsdp_size)
    compute = step_lib.make_compute(model_def, mesh, plan, seed=0, mode=mode, use_dropout=False)
    rs = np.random.default_rng(3)
    tokens = rs.integers(0, 512, (16, 17), dtype=np.int32)
    weights = np.ones((16, 16), np.float32)
    params = jax.device_put(model_def.init_params(jax.random.key(1)),
                            mesh_lib.shardings_from_logical(model_def.logical_axes, mesh))
    lowered = compute.lower(params, tokens, weights, np.int32(0))
    compiled = lowered.compile()  # one compile: run it, read its HLO
    result = compiled(params, tokens, weights, np.int32(0), plan.layout())
    return [np.asarray(x) for x in jax.tree.leaves(result.grads)], compiled.as_text(), lowered.as_text()


@pytest.mark.parametrize("mode", ["invariant", "native"])
def test_weights_gathered_in_bf16_give_the_bits_of_the_models_own_cast(mode, monkeypatch):
    # The model uses its matrices only as w.astype(bf16), so gathering the fsdp slices already cast
    # (half the bytes) must change no bit of the gradient, in either reduction.
    from resilient_jax.model import TransformerLM

    cast, _, cast_program = _bf16_grads(mode)
    monkeypatch.setattr(TransformerLM, "CAST_TO_COMPUTE_DTYPE", frozenset())
    own, _, own_program = _bf16_grads(mode)
    for a, b in zip(own, cast):
        np.testing.assert_array_equal(a, b)
    # ... and the program gathers bf16 (not float32 then a cast) when allowed to. (Read before XLA's
    # passes: XLA:CPU widens bf16 collectives to float32; GPUs move bf16.)
    bf16_gathers = lambda text: [line for line in text.splitlines() if "all_gather" in line and "bf16" in line]  # noqa: E731
    assert bf16_gathers(cast_program)
    assert not bf16_gathers(own_program)


def test_a_group_over_the_pack_limit_has_one_collective_per_leaf_and_the_same_exact_sum(monkeypatch):
    # Packing a big group's leaves into one collective costs a packed copy of the whole group
    # (25 GB of int64 at the 300B config's widths); above fsdp.PACK_MAX_BYTES each leaf has its own
    # collectives. Integers sum exactly, so the invariant gradient is the same bits either way.
    packed, packed_hlo, _ = _bf16_grads("invariant")
    monkeypatch.setattr(fsdp, "PACK_MAX_BYTES", 0)
    per_leaf, per_leaf_hlo, _ = _bf16_grads("invariant")
    for a, b in zip(packed, per_leaf):
        np.testing.assert_array_equal(a, b)
    count = lambda hlo, op: len(re.findall(rf"= \S+ {op}\(", hlo))  # noqa: E731
    assert count(per_leaf_hlo, "all-gather") > count(packed_hlo, "all-gather")
    assert count(per_leaf_hlo, "reduce-scatter") > count(packed_hlo, "reduce-scatter")
