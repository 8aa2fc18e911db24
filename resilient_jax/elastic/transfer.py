"""Moving the training state between devices, host memory and peers, bit for bit.

Every replica holds a full copy of the state (DESIGN invariant 3), so `to_host` can always rebuild
each array from this process's own shards, and a re-formed world needs nothing from disk.
`broadcast` sends one member's copy to all as one buffer of bytes, so the underlying psum
(source's bytes + zeros from everyone else) is exact -- a float psum would turn -0.0 into +0.0 and
change the fingerprint.
Cost: one state-sized collective per re-formation; host memory holds two copies of the state
while it runs (the state and its packed bytes).
"""

from __future__ import annotations

import jax
import numpy as np

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

    leaves, treedef = jax.tree.flatten(host_tree)
    # np.asarray, not np.ascontiguousarray: the latter returns at least 1-D, so a 0-d leaf (the
    # optimizer's step count) came back with shape (1,) -- every value intact, yet the next world
    # compiled a different update program whose float bits differed from the fault-free run's.
    arrays = [np.asarray(x) for x in leaves]
    # ONE buffer of bytes, not a list of leaves: a list compiles to one multi-operand collective,
    # which XLA:CPU runs as consecutive gloo operations that go on after one fails -- a member dying
    # mid-adoption then lets survivors drift into different operands, and gloo kills them
    # (resilient_jax/collectives.py says more). Costs one extra host copy of the state.
    # reshape(-1) copies a non-contiguous leaf into a contiguous run of bytes; .view needs that.
    packed = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays]) if arrays else np.zeros(0, np.uint8)
    received = np.asarray(multihost_utils.broadcast_one_to_all(packed, is_source=is_source))
    out, offset = [], 0
    for a in arrays:
        out.append(received[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape))
        offset += a.nbytes
    return jax.tree.unflatten(treedef, out)
