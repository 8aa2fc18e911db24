"""Moving the training state between devices, host memory and peers, bit for bit.

Every replica holds a full copy of the state (DESIGN invariant 3), so `to_host` can always rebuild
each array from this process's own shards, and a re-formed world needs nothing from disk.
`broadcast` sends one member's copy to all: floats travel bit-cast to unsigned integers so the
underlying psum (source's bits + zeros from everyone else) is exact -- a float psum would turn
-0.0 into +0.0 and change the fingerprint.
Cost: one state-sized collective per re-formation; host memory holds one copy of the state.
"""

from __future__ import annotations

import jax
import numpy as np

_UINT_OF_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _leaf_to_host(leaf) -> np.ndarray:
    if not isinstance(leaf, jax.Array):
        return np.asarray(leaf)
    out = np.empty(leaf.shape, dtype=leaf.dtype)
    covered = np.zeros(leaf.shape, dtype=bool)
    for shard in leaf.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
        covered[shard.index] = True
    if not covered.all():
        raise RuntimeError(
            f"this process does not hold a full copy of an array of shape {leaf.shape}: a replica must live on "
            "one host (parallel.fsdp/tensor must not span hosts)"
        )
    return out


def to_host(tree):
    """A full numpy copy of every array, from this process's own shards (works after a failed collective)."""
    return jax.tree.map(_leaf_to_host, tree)


def broadcast(host_tree, *, is_source: bool):
    """Every process returns the source process's `host_tree` (same structure and shapes everywhere)."""
    from jax.experimental import multihost_utils

    def as_bits(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x)
        return x.view(_UINT_OF_WIDTH[x.dtype.itemsize]) if x.dtype.kind in "fc" or x.dtype.kind == "V" else x

    leaves, treedef = jax.tree.flatten(host_tree)
    bits = [as_bits(np.asarray(x)) for x in leaves]
    received = multihost_utils.broadcast_one_to_all(bits, is_source=is_source)
    out = [np.asarray(r).view(np.asarray(x).dtype).reshape(np.shape(x)) for r, x in zip(received, leaves)]
    return jax.tree.unflatten(treedef, out)
