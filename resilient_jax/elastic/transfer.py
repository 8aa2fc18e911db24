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

import functools
import math

import jax
import numpy as np

def _leaf_to_host(leaf) -> np.ndarray:
    if not isinstance(leaf, jax.Array):
        return np.asarray(leaf)
    # One copy per distinct slice: a leaf replicated over this host's devices (data > 1 within a
    # host) has the same slice on each, and copying every one of them made the copy to host memory
    # -- paid on the recovery path by every survivor -- grow with the local device count.
    distinct = _distinct_shards(leaf)
    out = np.empty(leaf.shape, dtype=leaf.dtype)
    for shard in distinct.values():
        out[shard.index] = np.asarray(shard.data)
    # A sharding's distinct slices never partly overlap, so they cover the array exactly when
    # their sizes add up to it.
    held = sum(math.prod(stop - start for start, stop in bounds) for bounds in distinct)
    if held != leaf.size:
        raise RuntimeError(
            f"this process does not hold a full copy of an array of shape {leaf.shape}: a replica must live on "
            "one host (parallel.fsdp/tensor must not span hosts)"
        )
    return out


def _distinct_shards(leaf: jax.Array) -> dict:
    """This process's shards of `leaf`, one per distinct index (bounds -> shard)."""
    distinct = {}
    for shard in leaf.addressable_shards:
        distinct.setdefault(_key(shard.index, leaf.shape), shard)
    return distinct


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


# -- replica groups (parallel.hosts_per_replica > 1): a host holds only its slices -----------------


def _key(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A shard's index (a tuple of slices) as hashable bounds, whatever form the slices take."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


class LocalSlices:
    """This process's own slices of one array, by index: what a host of a multi-host replica holds."""

    def __init__(self, shape: tuple[int, ...], dtype, slices: dict):
        self.shape, self.dtype, self.slices = tuple(shape), np.dtype(dtype), slices

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.slices.values())

    def get(self, index: tuple) -> np.ndarray | None:
        return self.slices.get(_key(index, self.shape))


def local_slices(tree):
    """This process's slices of every array (each distinct index once), in host memory."""
    def one(leaf) -> LocalSlices:
        slices = {key: np.asarray(shard.data) for key, shard in _distinct_shards(leaf).items()}
        return LocalSlices(leaf.shape, leaf.dtype, slices)

    return jax.tree.map(one, tree)


def place_slices(kept, abstract):
    """Every array of `abstract` (shapes and shardings) from this process's kept slices: a member that
    keeps its slot in the replica holds exactly the slices its devices need, so nothing is sent."""
    def one(path, slices: LocalSlices, want):
        def fetch(index):
            got = slices.get(index)
            if got is None:
                raise RuntimeError(f"state leaf {jax.tree_util.keystr(path)}: this host holds no slice "
                                   f"{_key(index, want.shape)} (its slot in the replica group moved)")
            return got
        return jax.make_array_from_callback(want.shape, want.sharding, fetch)

    return jax.tree_util.tree_map_with_path(one, kept, abstract)


def heal(kept, abstract, mesh, source_row: int, *, holds_source: bool, on_leaf=None):
    """The state of the replica on `data` row `source_row`, on every replica: leaf by leaf, each
    device of another row receives the slice its peer at the same (fsdp, tensor) position holds.

    Per leaf, the source row's slices and zeros from every other row form one array stacked along
    `data`; a psum over `data` of the source row's bits (as unsigned integers: exact, and -0.0 and
    NaN payloads survive) lands on every row. Leaf by leaf so a host never holds more than its
    shard of the state plus one leaf's stacked slice and sum. `on_leaf(i)` runs after each leaf
    (the worker samples its memory there)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from resilient_jax.mesh import DATA_AXIS

    leaves, treedef = jax.tree.flatten(abstract)
    kept_leaves = jax.tree.leaves(kept, is_leaf=lambda x: isinstance(x, LocalSlices)) if holds_source else None
    rows = mesh.shape[DATA_AXIS]
    out = []
    for i, want in enumerate(leaves):
        spec = tuple(want.sharding.spec) + (None,) * (len(want.shape) - len(want.sharding.spec))
        stacked = NamedSharding(mesh, PartitionSpec(DATA_AXIS, *spec))

        def offer(index, i=i, want=want):
            shape = tuple(len(range(*s.indices(n))) for s, n in zip(index[1:], want.shape))
            if holds_source:
                got = kept_leaves[i].get(index[1:])
                if got is None:
                    raise RuntimeError(f"heal: the source replica's host lacks slice {_key(index[1:], want.shape)}")
                return got[None]
            return np.zeros((1, *shape), want.dtype)

        x = jax.make_array_from_callback((rows, *want.shape), stacked, offer)
        out.append(_pick_row(mesh, PartitionSpec(*spec), np.dtype(want.dtype), source_row)(x))
        del x
        if on_leaf is not None:
            on_leaf(i)
    return jax.tree.unflatten(treedef, out)


@functools.lru_cache(maxsize=64)
def _pick_row(mesh, spec, dtype, row: int):
    """The compiled row selection for one (spec, dtype): leaves of the same kind share it."""
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec

    from resilient_jax.mesh import DATA_AXIS

    dtype = np.dtype(dtype)
    as_bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[dtype.itemsize]

    def pick(x):
        bits = lax.bitcast_convert_type(x[0], as_bits) if dtype != np.bool_ else x[0].astype(jnp.uint8)
        mine = lax.axis_index(DATA_AXIS) == row
        total = lax.psum(jnp.where(mine, bits, jnp.zeros_like(bits)), DATA_AXIS)
        return lax.bitcast_convert_type(total, dtype) if dtype != np.bool_ else total.astype(jnp.bool_)

    return jax.jit(jax.shard_map(pick, mesh=mesh, in_specs=PartitionSpec(DATA_AXIS, *spec), out_specs=spec))
