"""hlo_stats: matmul FLOPs with loop bodies counted per trip, and per-device collective bytes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from resilient_jax import hlo_stats


def test_dot_flops_count_a_loop_body_once_per_trip_where_xla_counts_it_once():
    def f(x_SxMxK, w_KxN):
        return lax.map(lambda x: jnp.tanh(x @ w_KxN), x_SxMxK)

    for shards in (1, 4):
        compiled = jax.jit(f).lower(jnp.ones((shards, 64, 32)), jnp.ones((32, 16))).compile()
        stats = hlo_stats.analyze(compiled.as_text(), num_devices=1)
        assert stats.dot_flops == 2 * shards * 64 * 32 * 16
        assert stats.unknown_trip_counts == 0


def test_collective_bytes_are_ring_bytes_per_device_over_each_ops_group():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))

    def body(x):  # per device: [4, 16] float32 = 256 bytes
        return lax.psum(x, "b"), lax.all_gather(x, "a", tiled=True)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("a", "b"),
                               out_specs=(PartitionSpec("a"), PartitionSpec(None, "b")), check_vma=False))
    stats = hlo_stats.analyze(fn.lower(jnp.ones((8, 64), jnp.float32)).compile().as_text(), num_devices=8)
    assert stats.collective_count == {"all-reduce": 1, "all-gather": 1}
    # all-reduce of 256 B over groups of 4: 2 * 3/4 * 256; all-gather to 512 B over groups of 2: 1/2 * 512.
    assert stats.collective_bytes == {"all-reduce": 384.0, "all-gather": 256.0}
    assert stats.total_collective_bytes == 640.0
