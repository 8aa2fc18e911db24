"""Combining per-virtual-shard gradients across replicas, inside shard_map over the `data` axis.

`native`: sum local shards, then psum -- XLA picks the reduction order, which depends on the
replica count, so bits drift when the topology changes.

`invariant`: every element of the result is the left-to-right float sum g_0 + g_1 + ... + g_{V-1}
over the V virtual shards, whoever computed them. Per leaf:
  1. local shard grads [S, n] (S = V_padded / R shards on this replica) are padded to [S, n_pad]
     and exchanged with one all_to_all, so each replica holds all V shards of its n_pad / R slice
     of elements: [V_padded, n_pad / R];
  2. the first V rows are summed in index order (a fori_loop of elementwise adds: the order is
     fixed, and elementwise adds do not depend on how the elements are partitioned);
  3. an all_gather rebuilds the full, replicated sum on every replica.
Peak extra memory per device: S*n (own shard grads) + V*n/R (the exchanged slice) = 2*V*n/R, i.e.
it grows with V/R, not with V: with V a small multiple of the replica count it is ~2x the
gradient size, the same order as a ring all-reduce's buffers.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

Reduction = Literal["invariant", "native"]


def ordered_sum(rows_VxN: jax.Array, count: int) -> jax.Array:
    """rows[0] + rows[1] + ... + rows[count-1], in exactly that order."""
    return lax.fori_loop(1, count, lambda i, acc: acc + rows_VxN[i], rows_VxN[0])


def _invariant_leaf(local_SxShape: jax.Array, axis: str, replicas: int, num_shards: int) -> jax.Array:
    local_shards = local_SxShape.shape[0]
    shape = local_SxShape.shape[1:]
    flat = local_SxShape.reshape(local_shards, -1)
    n = flat.shape[1]
    n_pad = -(-n // replicas) * replicas
    if n_pad != n:
        flat = jnp.pad(flat, ((0, 0), (0, n_pad - n)))
    # [S, n_pad] -> [S * R, n_pad / R]: rows arrive in replica order, i.e. global shard order.
    exchanged = lax.all_to_all(flat, axis, split_axis=1, concat_axis=0, tiled=True)
    slice_sum = ordered_sum(exchanged, num_shards)
    full = lax.all_gather(slice_sum, axis, tiled=True)
    return full[:n].reshape(shape)


def sum_shard_grads(grads, *, mode: Reduction, axis: str, replicas: int, num_shards: int):
    """Sum a tree of per-shard gradients (leading dim = local shards) over all shards of all replicas."""
    if mode == "native":
        return jax.tree.map(lambda g: lax.psum(jnp.sum(g, axis=0), axis), grads)
    return jax.tree.map(lambda g: _invariant_leaf(g, axis, replicas, num_shards), grads)


def gather_shard_values(local_S: jax.Array, axis: str) -> jax.Array:
    """Per-shard scalars from every replica, in global shard order: [V_padded]."""
    return lax.all_gather(local_S, axis, tiled=True)
