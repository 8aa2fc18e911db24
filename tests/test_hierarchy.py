"""Region-aware reduction: the groups it plans, the same gradient bits as the flat sum, and what
crosses a region boundary in the compiled program (resilient_jax.hierarchy, collectives.data_sum)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from resilient_jax import hierarchy, hlo_stats
from resilient_jax import mesh as mesh_lib
from resilient_jax import state as state_lib
from resilient_jax import step as step_lib
from resilient_jax.config import ParallelConfig, load_config

from conftest import TINY


def test_equal_regions_cut_the_buffer_by_their_size():
    groups = hierarchy.plan(["us", "us", "eu", "eu", "ap", "ap"])
    assert groups.in_region == ((0, 1), (2, 3), (4, 5))
    assert groups.cross == ((0, 2, 4), (1, 3, 5))
    assert groups.slices == 2 and groups.uniform


def test_unequal_regions_send_the_extra_members_no_slice():
    # 2 + 1 + 2 replicas (a host of `eu` lost): one slice per member of the smallest region.
    groups = hierarchy.plan(["us", "us", "eu", "ap", "ap"])
    assert groups.slices == 1 and not groups.uniform
    assert groups.cross == ((0, 2, 3), (1,), (4,))
    assert groups.position() == (0, 1, 0, 0, 1)
    # Regions need not be contiguous on the data axis; every index is in exactly one group.
    groups = hierarchy.plan(["a", "b", "a", "b", "a"])
    assert groups.in_region == ((0, 2, 4), (1, 3)) and groups.cross == ((0, 1), (2, 3), (4,))
    assert sorted(d for g in groups.cross for d in g) == list(range(5))


def test_no_regions_or_one_replica_per_region_is_the_flat_order():
    assert hierarchy.plan(["us"] * 4) is None
    assert hierarchy.plan(["us", "eu", "ap"]) is None


def _setup(data: int, fsdp: int):
    cfg = load_config(TINY)
    model_def = state_lib.make_model_def(cfg.model)
    from resilient_jax.optimizer import build_optimizer

    tx = build_optimizer(cfg.optimizer, cfg.train.steps)
    mesh = mesh_lib.build_mesh(ParallelConfig(data=data, fsdp=fsdp))
    plan = step_lib.make_shard_plan(cfg.data.global_batch, cfg.parallel.virtual_shards, data * fsdp)
    params = state_lib.init_state(model_def, tx, mesh, cfg.train.seed).params
    rs = np.random.default_rng(7)
    tokens = rs.integers(0, 256, (plan.padded_rows, cfg.data.seq_len + 1), dtype=np.int32)
    weights = np.ones((plan.padded_rows, cfg.data.seq_len), np.float32)
    return model_def, mesh, plan, params, tokens, weights


def _compiled(model_def, mesh, plan, params, tokens, weights, groups):
    compute = step_lib.make_compute(model_def, mesh, plan, seed=0, mode="invariant", use_dropout=True, regions=groups)
    compiled = compute.lower(params, tokens, weights, np.int32(2)).compile()
    return compiled(params, tokens, weights, np.int32(2), plan.layout()), compiled.as_text()


def _assert_same_bits(expected, got):
    for x, y in zip(jax.tree.leaves(expected.grads), jax.tree.leaves(got.grads)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(expected.loss), np.asarray(got.loss))


def test_equal_regions_give_the_flat_bits_and_send_half_the_buffer_across():
    """3 regions x 2 replicas, from the compiled HLO: the flat order hands every replica's full
    gradient buffer to a region-spanning collective, the region-aware one half of it; same bits."""
    model_def, mesh, plan, params, tokens, weights = _setup(6, 1)
    regions = ["us", "us", "eu", "eu", "ap", "ap"]
    groups = hierarchy.plan(regions)
    flat, flat_text = _compiled(model_def, mesh, plan, params, tokens, weights, None)
    aware, aware_text = _compiled(model_def, mesh, plan, params, tokens, weights, groups)
    _assert_same_bits(flat, aware)
    assert "replica_groups={{0,2,4},{1,3,5}}" in aware_text  # the cross-region phase, as planned
    stats = {name: hlo_stats.analyze(text, 6, regions)  # fsdp = tensor = 1: device id = data index
             for name, text in (("flat", flat_text), ("aware", aware_text))}
    grad_bytes = 8 * sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))  # int64 accumulators
    assert stats["flat"].cross_region_operand_bytes >= 6 * grad_bytes
    # What else crosses (block exponents, shard statistics, the overflow check) is the same small
    # amount in both programs.
    other = stats["flat"].cross_region_operand_bytes - 6 * grad_bytes
    assert stats["aware"].cross_region_operand_bytes <= 6 * grad_bytes / 2 + other + 64
    assert stats["aware"].cross_region_ring_bytes < stats["flat"].cross_region_ring_bytes


def test_unequal_regions_after_an_fsdp_scatter_give_the_flat_bits():
    """2 + 1 + 1 replicas of 2 fsdp devices each (all-reduces within regions, a slice of one)."""
    model_def, mesh, plan, params, tokens, weights = _setup(4, 2)
    groups = hierarchy.plan(["us", "us", "eu", "ap"])
    assert not groups.uniform
    flat, _ = _compiled(model_def, mesh, plan, params, tokens, weights, None)
    aware, _ = _compiled(model_def, mesh, plan, params, tokens, weights, groups)
    _assert_same_bits(flat, aware)


def test_cross_region_bytes_read_explicit_and_iota_replica_groups():
    hlo = """HloModule m
ENTRY %main (p: s64[8]) -> s64[8] {
  %p = s64[8]{0} parameter(0)
  %a = s64[8]{0} all-reduce(%p), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add
  %b = s64[8]{0} all-reduce(%a), channel_id=2, replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%add
  ROOT %c = s64[8]{0} all-reduce(%b), channel_id=3, replica_groups={}, to_apply=%add
}
"""
    stats = hlo_stats.analyze(hlo, 4, ["us", "us", "eu", "eu"])
    # a: inside regions; b: groups {0,2},{1,3} cross (4 members x 64 B); c: all 4 cross (4 x 64 B).
    assert stats.cross_region_operand_bytes == 4 * 64 + 4 * 64
    # Ring: b has 2 crossing hops per group (each 64 B), c has 2 crossing hops of 2*3/4*64 B.
    assert stats.cross_region_ring_bytes == 2 * 2 * 64 + 2 * (64 * 2 * 3 / 4)


def test_a_replica_is_in_its_hosts_region_and_one_spanning_two_regions_keeps_the_flat_order():
    class Device:
        def __init__(self, process_index):
            self.process_index = process_index

    regions = {0: "us", 1: "us", 2: "eu"}
    by_host = np.array([[Device(0)], [Device(1)], [Device(2)]], dtype=object)  # data 3 x fsdp 1
    assert hierarchy.data_regions(by_host, regions) == ["us", "us", "eu"]
    assert hierarchy.device_regions(by_host, regions) == ["us", "us", "eu"]
    spanning = np.array([[Device(0), Device(1)], [Device(1), Device(2)]], dtype=object)  # fsdp over hosts
    assert hierarchy.data_regions(spanning, regions) is None
