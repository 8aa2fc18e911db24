"""Summing per-virtual-shard gradients over every device of the (data x fsdp) grid.

`native`: float sums -- a device adds its shards, then a reduce-scatter over fsdp and an
all-reduce over data. XLA picks the order, which depends on the layout, so bits drift when it changes.

`invariant`: an exact, order-free sum in integer fixed point (DESIGN.md, "Exact reduction").
Every shard gradient is quantised to int64 on its own, as a function of that shard's values only;
integer addition is exact and associative, so the sum is the same for any device order, any
collective tree, any (data x fsdp) layout and any process count, and XLA may schedule it freely.

Fixed point, per block of elements (a block is a trailing run of a leaf's axes, 128-1024
elements where the shape allows, or one row; see `block_dims`):
  - pass 1 (every step): shard v quantises block b to `lsb_vb = e_vb - OWN_BITS`, where
    2^e_vb > max|g_vb| (its own block maximum): q = rint(g * 2^-lsb). A device keeps ONE int64
    accumulator per leaf and the finest lsb seen per block; adding a shard shifts the coarser of the
    two left, which is exact while nothing overflows. The grid agrees on the finest lsb (pmin, exact),
    every device shifts to it and the int64 accumulators are reduce-scattered and all-reduced.
    No overflow is possible while (max_v e_vb - min_v lsb_vb) + ceil(log2 V) <= 62 for every block,
    i.e. while shards' block maxima lie within SPREAD_BITS of each other; that is checked
    exactly (pmax/pmin of integers) on the global exponents, so every device decides alike.
  - pass 2 (only when pass 1 could overflow; the caller recomputes the shard gradients): every
    shard quantises to the global `lsb_b = max_v e_vb - (62 - ceil(log2 V))`, fixed in advance
    from pass 1's exact global maxima: the sum of V such integers cannot overflow.
Both passes are deterministic functions of the shard gradients, hence of the data and the state.
Precision: each shard keeps OWN_BITS (pass 1) or 62 - ceil(log2 V) bits (pass 2) below its block
maximum, against fp32's 24 bits below each element; scripts/bench_reduction.py measures it
against a float64 reference on the model's real gradients.

int64 needs `jax.enable_x64(True)`; it is scoped to the functions below, which keep every dtype
explicit, so the model's own code is never traced with 64-bit defaults.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from resilient_jax import collectives

Reduction = Literal["invariant", "native"]

BLOCK_MIN, BLOCK_MAX = 128, 1024
SPREAD_BITS = 16  # how far apart shards' block maxima may lie before pass 2 is needed
LSB_NONE = 1 << 20  # lsb of a block with no nonzero element (coarser than anything real)
EXP_NONE = -(1 << 20)  # its exponent


def ordered_sum(rows_VxN: jax.Array, count: int) -> jax.Array:
    """rows[0] + rows[1] + ... + rows[count-1], in exactly that order."""
    return lax.fori_loop(1, count, lambda i, acc: acc + rows_VxN[i], rows_VxN[0])


def headroom_bits(num_shards: int) -> int:
    """Bits the sum of `num_shards` integers may grow by."""
    return max(1, math.ceil(math.log2(num_shards)))


def own_bits(num_shards: int) -> int:
    """Pass 1's mantissa width: what is left of int64 after the headroom and the allowed spread."""
    return 62 - headroom_bits(num_shards) - SPREAD_BITS


def block_dims(shape: Sequence[int]) -> int:
    """How many leading axes index blocks; the trailing ones form a block.

    The last axis alone, merged with the axes before it while the block is under BLOCK_MIN
    elements and would stay within BLOCK_MAX.
    """
    if not shape:
        return 0
    k, size = len(shape) - 1, shape[-1]
    while k > 0 and size < BLOCK_MIN and size * shape[k - 1] <= BLOCK_MAX:
        k -= 1
        size *= shape[k]
    return k


class IntAccumulator(NamedTuple):
    """An exact sum of quantised shard gradients: value = acc * 2^lsb, per block."""

    acc: jax.Array  # int64, the leaf's shape
    lsb: jax.Array  # int32, shape[:block_dims]: the finest lsb added so far
    exp: jax.Array  # int32, shape[:block_dims]: the largest block exponent added so far


def _expand(block_x: jax.Array, ndim: int) -> jax.Array:
    return block_x.reshape(block_x.shape + (1,) * (ndim - block_x.ndim))


def _shift_left(x: jax.Array, bits: jax.Array) -> jax.Array:
    # Shifts by >= 64 only ever apply to zeros (an empty accumulator or block); clamp them.
    return lax.shift_left(x, jnp.clip(bits, 0, 63).astype(jnp.int64))


def zeros_like_leaf(g: jax.ShapeDtypeStruct) -> IntAccumulator:
    with jax.enable_x64(True):
        k = block_dims(g.shape)
        return IntAccumulator(
            acc=jnp.zeros(g.shape, jnp.int64),
            lsb=jnp.full(g.shape[:k], LSB_NONE, jnp.int32),
            exp=jnp.full(g.shape[:k], EXP_NONE, jnp.int32),
        )


def block_exponent(g: jax.Array) -> jax.Array:
    """e per block with 2^(e-1) <= max|g| < 2^e, or EXP_NONE for an all-zero block (int32)."""
    k = block_dims(g.shape)
    amax = jnp.max(jnp.abs(g), axis=tuple(range(k, g.ndim))) if g.ndim > k else jnp.abs(g)
    _, e = jnp.frexp(amax)
    return jnp.where(amax > 0, e.astype(jnp.int32), jnp.int32(EXP_NONE))


def own_exponent_plan(accs):
    """Pass 1's plan: every block quantised to its own exponent (LSB_NONE = no fixed lsb)."""
    return jax.tree.map(lambda a: jnp.full_like(a.lsb, LSB_NONE), accs, is_leaf=is_acc)


def add_shard(acc: IntAccumulator, g: jax.Array, plan: jax.Array, bits: int) -> IntAccumulator:
    """acc + quantise(g): to the plan's fixed lsb per block (pass 2) or, where the plan says
    LSB_NONE, to the block's own exponent - `bits` (pass 1).

    Non-finite elements count as zero here (the step reports the shard as non-finite anyway).
    """
    with jax.enable_x64(True):
        g = jnp.where(jnp.isfinite(g), g, jnp.float32(0))
        e = block_exponent(g)
        lsb = jnp.where(plan == LSB_NONE, e - jnp.int32(bits), plan)
        lsb = jnp.where(e == EXP_NONE, jnp.int32(LSB_NONE), lsb)
        scale = jnp.clip(-lsb, -1100, 1100)  # an empty block's q is 0 whatever the scale
        q = jnp.rint(jnp.ldexp(g.astype(jnp.float64), _expand(scale, g.ndim))).astype(jnp.int64)
        new_lsb = jnp.minimum(acc.lsb, lsb)
        total = _shift_left(acc.acc, _expand(acc.lsb - new_lsb, g.ndim)) + _shift_left(
            q, _expand(lsb - new_lsb, g.ndim)
        )
        return IntAccumulator(acc=total, lsb=new_lsb, exp=jnp.maximum(acc.exp, e))


def global_exponents(accs, axes) -> tuple[object, object]:
    """(finest lsb, largest exponent) per block over every device on `axes`: one exact all-reduce."""
    with jax.enable_x64(True):
        packed = jax.tree.map(lambda a: jnp.stack([-a.lsb, a.exp]), accs, is_leaf=is_acc)
        packed = collectives.pmax(packed, axes)
        lsb = jax.tree.map(lambda p: -p[0], packed)
        exp = jax.tree.map(lambda p: p[1], packed)
        return lsb, exp


def fits(lsb, exp, num_shards: int) -> jax.Array:
    """True if no sum of `num_shards` shards quantised so can overflow int64 (bool scalar)."""
    limit = 62 - headroom_bits(num_shards)
    checks = jax.tree.leaves(jax.tree.map(lambda l, e: jnp.all((e - l) <= limit), lsb, exp))
    return jnp.all(jnp.stack(checks))


def fixed_lsb(exp, num_shards: int):
    """Pass 2's lsb per block: the global maximum's exponent less the int64 bits the sum may use."""
    return jax.tree.map(lambda e: e - jnp.int32(62 - headroom_bits(num_shards)), exp)


def reduce_exact(accs, lsb, *, scatter_axes, data_axis: str, fsdp_axis: str, groups=None):
    """Shift every device's accumulator to the global lsb, reduce-scatter over fsdp (to each leaf's
    `scatter_axes` entry; -1: all-reduce) and all-reduce over data (flat, or region-aware with
    `groups`: resilient_jax.hierarchy; integers, so the same bits); back to float32.

    The whole tree travels as one int64 buffer per collective (resilient_jax.collectives says why)."""
    with jax.enable_x64(True):
        fsdp_size = lax.axis_size(fsdp_axis)
        shifted = jax.tree.map(lambda a, lsb_g: _shift_left(a.acc, _expand(a.lsb - lsb_g, a.acc.ndim)),
                               accs, lsb, is_leaf=is_acc)
        summed = collectives.sum_scatter(shifted, scatter_axes, fsdp_axis=fsdp_axis, fsdp_size=fsdp_size,
                                         data_axis=data_axis, groups=groups)

        def leaf(x: jax.Array, lsb_g: jax.Array, axis: int) -> jax.Array:
            if 0 <= axis < lsb_g.ndim:  # this device's rows of the per-block lsb
                size = x.shape[axis]
                lsb_g = lax.dynamic_slice_in_dim(lsb_g, lax.axis_index(fsdp_axis) * size, size, axis)
            scale = _expand(jnp.clip(lsb_g, -1100, 1100), x.ndim)
            out = jnp.ldexp(x.astype(jnp.float64), scale).astype(jnp.float32)
            return jnp.where(_expand(lsb_g, x.ndim) == LSB_NONE, jnp.float32(0), out)

        return jax.tree.map(leaf, summed, lsb, scatter_axes)


def reduce_native(grads, *, scatter_axes, data_axis: str, fsdp_axis: str, groups=None):
    """Plain float reduce-scatter over fsdp and all-reduce over data (one buffer per collective;
    region-aware with `groups`, which changes the float rounding order)."""
    return collectives.sum_scatter(grads, scatter_axes, fsdp_axis=fsdp_axis, fsdp_size=lax.axis_size(fsdp_axis),
                                   data_axis=data_axis, groups=groups)


def is_acc(x) -> bool:
    return isinstance(x, IntAccumulator)


def global_norm(tree) -> jax.Array:
    """The L2 norm of a tree, with the same bits however its leaves are sharded (float32).

    A float sum over a sharded array depends on the partitioning; this one is an integer sum:
    every square (exact in float64) is quantised to the lsb fixed by the largest square (an exact
    max) with int64 room for every element, so XLA may partition and order the sum as it likes.
    """
    leaves = [x for x in jax.tree.leaves(tree)]
    count = sum(int(x.size) for x in leaves)
    with jax.enable_x64(True):
        squares = [jnp.square(x.astype(jnp.float64)) for x in leaves]
        largest = jnp.max(jnp.stack([jnp.max(s) for s in squares]))
        _, e = jnp.frexp(largest)
        lsb = jnp.clip(e.astype(jnp.int32) - jnp.int32(62 - headroom_bits(count)), -1100, 1100)
        total = sum(jnp.sum(jnp.rint(jnp.ldexp(s, -lsb)).astype(jnp.int64), dtype=jnp.int64) for s in squares)
        return jnp.sqrt(jnp.ldexp(total.astype(jnp.float64), lsb)).astype(jnp.float32)
