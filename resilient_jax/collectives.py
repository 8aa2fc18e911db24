"""Tree collectives as ONE single-operand collective each, for use inside shard_map.

Why: a collective over a tree (`lax.psum(tree)`, or per-leaf collectives that XLA's combiners
merge) compiles to one variadic all-reduce / all-gather. XLA:CPU runs the operands of such an op
as consecutive gloo operations and, when one fails, still starts the next ones
(AllReduceThunk issues every operand and only counts errors down). On a survivor of a dead peer that
means: operand i failed, yet operand i+1's chunks go out on the healthy connections, where a peer
still inside operand i has posted receives of operand i's size. A larger chunk on a smaller posted
receive aborts the peer inside gloo ("op.preamble.length <= op.nbytes ... collective mismatch"),
killing a second host for one fault. With one operand per collective, the failed operation is the
last one the program starts: the thunk fails, the rest of the program is skipped.

Packing is exact (concatenate and split; no arithmetic), and each element's reduction is the same
as in a per-leaf collective, so integer sums are bit-identical either way.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax

if TYPE_CHECKING:
    from resilient_jax.hierarchy import RegionGroups


def _flat_concat(leaves) -> jax.Array:
    return jnp.concatenate([x.reshape(-1) for x in leaves]) if leaves else None


def _split(flat: jax.Array, shapes) -> list[jax.Array]:
    out, start = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(lax.slice_in_dim(flat, start, start + size).reshape(shape))
        start += size
    return out


def pmax(tree, axes, pack: bool = True):
    """`lax.pmax(tree, axes)` as one all-reduce (every leaf of one dtype), or one per leaf with
    `pack=False` (see `gather`)."""
    if not pack:
        return jax.tree.map(lambda x: lax.pmax(x, axes), tree)
    leaves, treedef = jax.tree.flatten(tree)
    flat = lax.pmax(_flat_concat(leaves), axes)
    return jax.tree.unflatten(treedef, _split(flat, [x.shape for x in leaves]))


def data_sum(flat: jax.Array, data_axis: str, groups: "RegionGroups | None" = None) -> jax.Array:
    """`lax.psum(flat, data_axis)` of a 1-D buffer: flat, or in the region-aware order of `groups`
    (resilient_jax.hierarchy) -- three single-operand collectives, of which only the middle one
    crosses a region boundary, carrying 1/k of the buffer. The same sum for integers (exact);
    a different rounding order for floats."""
    if groups is None:
        return lax.psum(flat, data_axis)
    k, n = groups.slices, flat.shape[0]
    x = jnp.pad(flat, (0, -n % k)).reshape(k, -1)
    in_region, cross = [list(g) for g in groups.in_region], [list(g) for g in groups.cross]
    if groups.uniform:
        part = lax.psum_scatter(x, data_axis, scatter_dimension=0, tiled=True, axis_index_groups=in_region)
        part = lax.psum(part, data_axis, axis_index_groups=cross)
        full = lax.all_gather(part, data_axis, axis=0, tiled=True, axis_index_groups=in_region)
    else:
        j = jnp.asarray(groups.position(), jnp.int32)[lax.axis_index(data_axis)]
        regional = lax.psum(x, data_axis, axis_index_groups=in_region)
        slot = jnp.minimum(j, k - 1)  # members j >= k hold no slice: a group of one, then zeros
        part = lax.psum(lax.dynamic_index_in_dim(regional, slot, keepdims=True), data_axis, axis_index_groups=cross)
        mine = jnp.where(j < k, part, jnp.zeros_like(part))
        full = lax.psum(lax.dynamic_update_slice_in_dim(jnp.zeros_like(x), mine, slot, axis=0), data_axis,
                        axis_index_groups=in_region)
    return full.reshape(-1)[:n]


def data_slice_index(data_axis: str, groups: "RegionGroups | None" = None) -> jax.Array:
    """Which of the `data`-size slices `data_scatter_sum` leaves this device with (traced int32):
    its data index (flat), or j * regions + r for member j of the r-th region (equal regions)."""
    if groups is None:
        return lax.axis_index(data_axis)
    region_count = len(groups.in_region)
    index = [0] * len(groups.regions)
    for r, members in enumerate(groups.in_region):
        for j, d in enumerate(members):
            index[d] = j * region_count + r
    return jnp.asarray(index, jnp.int32)[lax.axis_index(data_axis)]


def data_scatter_sum(x: jax.Array, data_axis: str, groups: "RegionGroups | None" = None) -> jax.Array:
    """This device's slice (along dim 0, tiled, one of `data` many: `data_slice_index`) of
    `lax.psum(x, data_axis)`: one reduce-scatter over data, or, region-aware (equal regions only),
    a reduce-scatter within each region and then one of each slice across regions (the step that
    crosses regions carries 1/k of the buffer, k members per region). x.shape[0] must be a
    multiple of the data size."""
    if groups is None:
        return lax.psum_scatter(x, data_axis, scatter_dimension=0, tiled=True)
    assert groups.uniform, "unequal regions have no reduce-scatter (data_sum)"
    part = lax.psum_scatter(x, data_axis, scatter_dimension=0, tiled=True,
                            axis_index_groups=[list(g) for g in groups.in_region])
    return lax.psum_scatter(part, data_axis, scatter_dimension=0, tiled=True,
                            axis_index_groups=[list(g) for g in groups.cross])


def data_gather(x: jax.Array, data_axis: str, groups: "RegionGroups | None" = None) -> jax.Array:
    """Every device's slice of `data_scatter_sum` (x: this device's), stacked [data, *x.shape] in
    slice order: one all-gather, or one across regions and one within each region."""
    if groups is None:
        return lax.all_gather(x, data_axis, axis=0)
    across = lax.all_gather(x, data_axis, axis=0, axis_index_groups=[list(g) for g in groups.cross])
    within = lax.all_gather(across, data_axis, axis=0, axis_index_groups=[list(g) for g in groups.in_region])
    return within.reshape((-1,) + x.shape)


def scatter_sum(tree, scatter_dims, *, axis: str, size: int, pack: bool = True):
    """Per leaf: sum over `axis` (of `size` devices), scattered (tiled) along its `scatter_dims` entry
    (-1: kept whole): one reduce-scatter for the scattered leaves and one all-reduce for the whole
    ones (leaves share one dtype) -- or, with `pack=False`, one collective per leaf (see `gather`:
    packing drops the automatic sharding of a leaf's other dims)."""
    leaves, treedef = jax.tree.flatten(tree)
    dims = treedef.flatten_up_to(scatter_dims)
    if size == 1:
        return tree
    if not pack:
        return jax.tree.unflatten(treedef, [
            lax.psum_scatter(x, axis, scatter_dimension=d, tiled=True) if d >= 0 else lax.psum(x, axis)
            for x, d in zip(leaves, dims)])
    scattered = [i for i, d in enumerate(dims) if d >= 0]
    whole = [i for i, d in enumerate(dims) if d < 0]
    out = [None] * len(leaves)
    if scattered:
        # Row r of each leaf's (size, -1) view is the block device r keeps (tiled scatter order).
        moved = [jnp.moveaxis(leaves[i], dims[i], 0) for i in scattered]
        rows = jnp.concatenate([m.reshape(size, -1) for m in moved], axis=1)
        rows = lax.psum_scatter(rows, axis, scatter_dimension=0, tiled=True).reshape(-1)
        local = [(m.shape[0] // size,) + m.shape[1:] for m in moved]
        for i, x in zip(scattered, _split(rows, local)):
            out[i] = jnp.moveaxis(x, 0, dims[i])
    if whole:
        flat = lax.psum(_flat_concat([leaves[i] for i in whole]), axis)
        for i, x in zip(whole, _split(flat, [leaves[i].shape for i in whole])):
            out[i] = x
    return jax.tree.unflatten(treedef, out)


def tree_data_sum(tree, data_axis: str, groups: "RegionGroups | None" = None):
    """`lax.psum(tree, data_axis)` as one buffer (leaves share one dtype): flat, or region-aware
    (see `data_sum`)."""
    leaves, treedef = jax.tree.flatten(tree)
    summed = data_sum(_flat_concat(leaves), data_axis, groups)
    return jax.tree.unflatten(treedef, _split(summed, [x.shape for x in leaves]))


def gather(tree, gather_dims, *, axis: str, size: int, pack: bool = True):
    """Per leaf: `lax.all_gather(x, axis, axis=dim, tiled=True)` (dim -1: left as is), as one
    all-gather per dtype -- or, with `pack=False`, one per leaf. Packing flattens each leaf, which
    drops the automatic (GSPMD) sharding of its other dims: with `tensor` > 1 every tensor device
    would gather (and, in `scatter_sum`, sum) the whole leaf instead of its tensor slice. So
    tensor-parallel runs use one collective per leaf -- each single-operand too, as long as XLA
    does not combine them: XLA:CPU has no all-gather or reduce-scatter combiner, and CPU workers
    run without its all-reduce one (resilient_jax.gpu_env)."""
    leaves, treedef = jax.tree.flatten(tree)
    dims = treedef.flatten_up_to(gather_dims)
    out = list(leaves)
    if size > 1 and not pack:
        for i, d in enumerate(dims):
            if d >= 0:
                out[i] = lax.all_gather(leaves[i], axis, axis=d, tiled=True)
    elif size > 1:
        by_dtype: dict = {}
        for i, d in enumerate(dims):
            if d >= 0:
                by_dtype.setdefault(jnp.dtype(leaves[i].dtype), []).append(i)
        for indices in by_dtype.values():
            moved = [jnp.moveaxis(leaves[i], dims[i], 0) for i in indices]
            row = jnp.concatenate([m.reshape(1, -1) for m in moved], axis=1)
            rows = lax.all_gather(row, axis, axis=0, tiled=True)  # (size, M): row r from device r
            start = 0
            for i, m in zip(indices, moved):
                width = math.prod(m.shape)
                block = lax.slice_in_dim(rows, start, start + width, axis=1)
                start += width
                full = block.reshape((size * m.shape[0],) + m.shape[1:])
                out[i] = jnp.moveaxis(full, 0, dims[i])
    return jax.tree.unflatten(treedef, out)
