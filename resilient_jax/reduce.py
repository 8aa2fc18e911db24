"""Summing per-virtual-shard gradients over every device of the (data x fsdp) grid.

Both modes sum one parameter group's gradient over fsdp inside the backward pass (a reduce-scatter
per layer and shard, resilient_jax.fsdp), accumulate a device's shards in its fsdp slice, and
sum over data at the end.

`native`: float sums. XLA picks the order, which depends on the layout, so bits drift when it changes.

`invariant`: an exact, order-free sum in integer fixed point (DESIGN.md, "Exact reduction").
Every shard gradient is quantised to int64 on its own, as a function of that shard's values only;
integer addition is exact and associative, so the sum is the same for any device order, any
collective tree, any (data x fsdp) layout and any process count, and XLA may schedule it freely.

Fixed point, per block of elements (a block is a trailing run of a leaf's axes, 128-1024
elements where the shape allows, or one row; see `block_dims`; a leaf is one layer's parameter):
  - pass 1 (every step): shard v quantises block b to `lsb_vb = e_vb - OWN_BITS`, where
    2^e_vb > max|g_vb| (its own block maximum): q = rint(g * 2^-lsb) -- a function of that shard
    alone. The gradient of one parameter group (a layer) is summed over `fsdp` inside the backward
    pass (resilient_jax.fsdp): the group's devices agree on each block's finest lsb (an exact
    pmax), shift to it (exact while nothing overflows) and reduce-scatter int64; each device adds
    the result to its int64 accumulator of its fsdp slice, shifting the coarser of the two. At the
    end the devices agree on the finest lsb over `data` too, shift, reduce-scatter over `data`,
    convert their slice to float32 and all-gather it (`ExactSum.floats_over_data`).
    No overflow is possible while (max_v e_vb - min_v lsb_vb) + ceil(log2 V) <= 62 for every block,
    i.e. while shards' block maxima lie within SPREAD_BITS of each other; that is checked exactly
    (pmax of integers) on the global exponents, so every device decides alike.
  - pass 2 (only when pass 1 could overflow; the caller recomputes the shard gradients): every
    shard quantises to the global `lsb_b = max_v e_vb - (62 - ceil(log2 V))`, fixed in advance
    from pass 1's exact global maxima: the sum of V such integers cannot overflow.
Both passes are deterministic functions of the shard gradients, hence of the data and the state;
the integer sum is the same whichever device added which shard in which order, so the value is
too. Precision: each shard keeps OWN_BITS (pass 1) or 62 - ceil(log2 V) bits (pass 2) below its
block maximum, against fp32's 24 bits below each element; scripts/bench_reduction.py measures it
against a float64 reference on the model's real gradients.

int64 needs `jax.enable_x64(True)`; it is scoped to the functions below, which keep every dtype
explicit, so the model's own code is never traced with 64-bit defaults.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from resilient_jax import collectives

if TYPE_CHECKING:
    from resilient_jax.fsdp import Group
    from resilient_jax.hierarchy import RegionGroups

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
    """One leaf's exact sum of quantised shard gradients: value = acc * 2^lsb, per block."""

    acc: jax.Array  # int64, this device's fsdp slice of the leaf
    lsb: jax.Array  # int32, every block of the leaf (the same on each fsdp member): finest lsb added
    exp: jax.Array  # int32, likewise: the largest block exponent added


class GroupSum(NamedTuple):
    """A device's running gradient sum of one parameter group (resilient_jax.fsdp.Group), over the
    shards it has computed, already summed over fsdp: what the backward pass carries in and out."""

    accs: list  # per leaf: an IntAccumulator (exact) or a float32 array (native), fsdp-local
    plan: list | None  # exact: per leaf and block, the fixed lsb of pass 2 or LSB_NONE (pass 1)
    nonfinite: jax.Array  # int32: the LAST shard's gradient of this group had a non-finite element
    live: jax.Array  # int32, set before each shard: 0 for a padding slot, whose gradient adds nothing


def _expand(block_x: jax.Array, ndim: int) -> jax.Array:
    return block_x.reshape(block_x.shape + (1,) * (ndim - block_x.ndim))


def _shift_left(x: jax.Array, bits: jax.Array) -> jax.Array:
    # Shifts by >= 64 only ever apply to zeros (an empty accumulator or block) or to a pass that
    # `fits` rejects; clamp them.
    return lax.shift_left(x, jnp.clip(bits, 0, 63).astype(jnp.int64))


def block_shape(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(shape[:block_dims(shape)])


def block_max(g: jax.Array) -> jax.Array:
    """max |g| per block (NaN where the block holds a NaN, inf where it holds an infinity)."""
    k = block_dims(g.shape)
    return jnp.max(jnp.abs(g), axis=tuple(range(k, g.ndim))) if g.ndim > k else jnp.abs(g)


def block_exponent(amax: jax.Array) -> jax.Array:
    """e per block with 2^(e-1) <= amax < 2^e, or EXP_NONE for an all-zero block (int32)."""
    _, e = jnp.frexp(amax)
    return jnp.where(amax > 0, e.astype(jnp.int32), jnp.int32(EXP_NONE))


def _pow2(k: jax.Array) -> jax.Array:
    """2^k as float32, exactly, for integer k in [-126, 127] (built from its exponent bits)."""
    return lax.bitcast_convert_type(lax.shift_left(k.astype(jnp.int32) + 127, jnp.int32(23)), jnp.float32)


class Quantised(NamedTuple):
    q: jax.Array  # int64, the leaf's shape: g ~= q * 2^lsb
    lsb: jax.Array  # int32 per block
    exp: jax.Array  # int32 per block: the block maximum's exponent
    finite: jax.Array  # bool: every element of the leaf is finite


def quantize(g: jax.Array, plan: jax.Array, bits: int, live: jax.Array) -> Quantised:
    """One shard's gradient leaf, quantised: to the plan's fixed lsb per block (pass 2) or, where
    the plan says LSB_NONE, to the block's own exponent - `bits` (pass 1). A function of this
    shard's values alone; all zeros where `live` is 0 (a padding slot: zero loss weight, but a
    loss of your own may still give it a NaN gradient).

    A non-finite element makes its block's maximum non-finite, which `finite` reports; that block's
    integers are then meaningless, and the step never uses them: a shard with a non-finite
    gradient is quarantined and the step recomputed without it."""
    with jax.enable_x64(True):
        live = live > 0
        amax = jnp.where(live, block_max(g), jnp.float32(0))
        e = block_exponent(amax)
        lsb = jnp.where(plan == LSB_NONE, e - jnp.int32(bits), plan)
        lsb = jnp.where(e == EXP_NONE, jnp.int32(LSB_NONE), lsb)
        # g * 2^-lsb in float32, as two exact power-of-two multiplies (no float64, no ldexp: 1.62x ->
        # 1.27x native's compute time on tiny): every real block's scale lies in [-99, 210], so each
        # half is a normal float32 and every product is exact; |g * 2^-lsb| < 2^62, an integer past
        # 2^24 already, so rint rounds only where float64 would round alike, and the conversion to
        # int64 is exact. An empty block (or one every shard left empty) has g == 0 there: its
        # clipped scale gives q = 0.
        scale = jnp.clip(-lsb, -252, 252)
        half = scale // 2
        y = g * _expand(_pow2(half), g.ndim) * _expand(_pow2(scale - half), g.ndim)
        q = jnp.where(live, jnp.rint(y).astype(jnp.int64), jnp.int64(0))
        return Quantised(q=q, lsb=lsb, exp=e, finite=jnp.all(jnp.isfinite(amax)))


def _any_nonfinite(grads) -> jax.Array:
    return jnp.any(jnp.stack([~jnp.all(jnp.isfinite(g)) for g in grads])).astype(jnp.int32)


def _int_to_float32(x: jax.Array, lsb: jax.Array) -> jax.Array:
    """x * 2^lsb as float32 (int64 -> float64 -> float32: rounded from the exact sum, the same way
    whoever summed it); 0 where lsb is LSB_NONE. `lsb` broadcasts against x. Call under x64."""
    scaled = jnp.ldexp(x.astype(jnp.float64), jnp.clip(lsb, -1100, 1100))
    return jnp.where(lsb == LSB_NONE, jnp.float32(0), scaled.astype(jnp.float32))


class ExactSum:
    """`invariant`: integer fixed point (the module docstring)."""

    def __init__(self, num_shards: int):
        # Headroom from the REAL shard count: padding shards add exact zeros, and a width that followed
        # the padded count (a function of the device grid) would make the bits depend on the layout.
        self.num_shards = num_shards
        self.bits = own_bits(num_shards)

    def init(self, group: Group, plan: list | None = None, stack: tuple[int, ...] = ()) -> GroupSum:
        """Nothing added yet; `stack`: leading dims (a stack of layers). `plan`: pass 2's lsb."""
        with jax.enable_x64(True):
            accs = [IntAccumulator(acc=jnp.zeros(stack + group.local_shape(i), jnp.int64),
                                   lsb=jnp.full(stack + block_shape(shape), LSB_NONE, jnp.int32),
                                   exp=jnp.full(stack + block_shape(shape), EXP_NONE, jnp.int32))
                    for i, shape in enumerate(group.shapes)]
            if plan is None:
                plan = [jnp.full(stack + block_shape(shape), LSB_NONE, jnp.int32) for shape in group.shapes]
            return GroupSum(accs=accs, plan=list(plan), nonfinite=jnp.zeros(stack, jnp.int32),
                            live=jnp.ones(stack, jnp.int32))

    def add(self, group: Group, state: GroupSum, grads: list) -> GroupSum:
        """state + one shard's full gradient of the group (`grads`, per leaf), summed over fsdp with
        the other members' shards: inside the backward pass, once per layer and shard."""
        with jax.enable_x64(True):
            quantised = [quantize(g, p, self.bits, state.live) for g, p in zip(grads, state.plan)]
            if group.size > 1:
                # The group's members agree on each block's finest lsb and largest exponent (exact),
                # shift to it and sum over fsdp.
                stats = collectives.pmax([jnp.stack([-x.lsb, x.exp]) for x in quantised], group.axis, pack=group.pack)
                group_lsb, group_exp = [-s[0] for s in stats], [s[1] for s in stats]
                aligned = [_shift_left(x.q, _expand(x.lsb - m, x.q.ndim)) for x, m in zip(quantised, group_lsb)]
                summed = collectives.scatter_sum(aligned, list(group.dims), axis=group.axis, size=group.size,
                                                 pack=group.pack)
            else:  # a group of one: the shard's own quantisation is the group's
                summed, group_lsb, group_exp = [x.q for x in quantised], [x.lsb for x in quantised], \
                    [x.exp for x in quantised]
            accs = []
            for i, (acc, s, m, e) in enumerate(zip(state.accs, summed, group_lsb, group_exp)):
                new_lsb = jnp.minimum(acc.lsb, m)
                total = (_shift_left(acc.acc, _expand(group.local_blocks(acc.lsb - new_lsb, i), s.ndim))
                         + _shift_left(s, _expand(group.local_blocks(m - new_lsb, i), s.ndim)))
                accs.append(IntAccumulator(acc=total, lsb=new_lsb, exp=jnp.maximum(acc.exp, e)))
            finite = jnp.all(jnp.stack([x.finite for x in quantised]))
            return state._replace(accs=accs, nonfinite=(~finite).astype(jnp.int32))

    @staticmethod
    def global_stats(accs: list, data_axis: str) -> tuple[list, list]:
        """(finest lsb, largest exponent) per block over every device: one exact all-reduce over
        `data` (the fsdp members already agree)."""
        with jax.enable_x64(True):
            packed = collectives.pmax([jnp.stack([-a.lsb, a.exp]) for a in accs], data_axis)
            return [-p[0] for p in packed], [p[1] for p in packed]

    def fits(self, lsb: list, exp: list) -> jax.Array:
        """True if no sum of the shards quantised so can overflow int64 (bool scalar)."""
        return fits(lsb, exp, self.num_shards)

    def fixed_lsb(self, exp: list) -> list:
        """Pass 2's lsb per block (see `fixed_lsb`)."""
        return fixed_lsb(exp, self.num_shards)

    @staticmethod
    def aligned(group: Group, accs: list, lsb: list) -> list:
        """Each accumulator shifted to the global lsb, ready to be summed over `data`."""
        with jax.enable_x64(True):
            return [_shift_left(a.acc, _expand(group.local_blocks(a.lsb - m, i), a.acc.ndim))
                    for i, (a, m) in enumerate(zip(accs, lsb))]

    @staticmethod
    def to_float(group: Group, summed: list, lsb: list) -> list:
        """The summed integers back to float32 (int64 -> float64 -> float32: rounded from the exact
        sum, the same way whoever summed it)."""
        with jax.enable_x64(True):
            out = []
            for i, (x, m) in enumerate(zip(summed, lsb)):
                out.append(_int_to_float32(x, _expand(group.local_blocks(m, i), x.ndim)))
            return out

    @staticmethod
    def floats_over_data(groups: list[Group], accs: list, lsb: list, data_axis: str, data_size: int,
                         regions: RegionGroups | None = None) -> list:
        """Per group, its accumulators summed over `data` and converted to float32: the bits of
        `aligned`, an all-reduce over data and `to_float`, but as an int64 reduce-scatter of every
        leaf (flattened, padded to a multiple of the data size), a conversion of this device's
        slice (each element with its block's lsb), and one float32 all-gather of every leaf's
        slices: 12 bytes a parameter on the wire instead of 16, and no device holds the int64 sum
        whole. Each of the two collectives carries every leaf at once. `accs`, `lsb`: per group,
        as `aligned` takes them."""
        if regions is not None and not regions.uniform:  # no reduce-scatter over unequal regions
            summed = collectives.tree_data_sum([ExactSum.aligned(g, a, m) for g, a, m in zip(groups, accs, lsb)],
                                               data_axis, regions)
            return [ExactSum.to_float(g, x, m) for g, x, m in zip(groups, summed, lsb)]
        with jax.enable_x64(True):
            mine = collectives.data_slice_index(data_axis, regions)
            # Every leaf flattened, padded to a multiple of the data size and viewed as (data, n):
            # row r is the slice device r keeps. Side by side, the rows of all leaves make ONE
            # reduce-scatter (an integer sum per element, exact: the same bits as one per leaf) --
            # a collective per leaf costs a launch and a round trip each, which across processes
            # (gloo, NCCL) outweighs the bytes of a small model.
            rows, layouts = [], []
            for group, group_accs, group_lsb in zip(groups, accs, lsb):
                for i, (a, m) in enumerate(zip(group_accs, group_lsb)):
                    x = _shift_left(a.acc, _expand(group.local_blocks(a.lsb - m, i), a.acc.ndim)).reshape(-1)
                    n = -(-x.shape[0] // data_size)  # this device's slice of the flattened leaf
                    rows.append(jnp.pad(x, (0, n * data_size - x.shape[0])).reshape(data_size, n))
                    layouts.append((n, group.local_blocks(m, i).reshape(-1), a.acc.shape))
            mine_of_all = collectives.data_scatter_sum(jnp.concatenate(rows, axis=1), data_axis, regions).reshape(-1)
            pieces, shapes, start = [], [], 0
            for n, block_lsb, shape in layouts:
                part = lax.slice_in_dim(mine_of_all, start, start + n)
                start += n
                width = math.prod(shape) // block_lsb.shape[0]  # elements a block (trailing axes: contiguous)
                block = jnp.minimum((mine * n + jnp.arange(n, dtype=jnp.int32)) // width,
                                    block_lsb.shape[0] - 1)  # padding: the last block's (its value is 0)
                pieces.append(_int_to_float32(part, block_lsb[block]))
                shapes.append(shape)
            rows = collectives.data_gather(jnp.concatenate(pieces), data_axis, regions)  # [data, sum of slices]
            out, start = [], 0
            for piece, shape in zip(pieces, shapes):
                n = piece.shape[0]
                leaf = lax.slice_in_dim(rows, start, start + n, axis=1).reshape(-1)[:math.prod(shape)]
                out.append(leaf.reshape(shape))
                start += n
            per_group, start = [], 0
            for group_accs in accs:
                per_group.append(out[start:start + len(group_accs)])
                start += len(group_accs)
            return per_group


class FloatSum:
    """`native`: float reduce-scatter over fsdp and all-reduce over data; XLA picks the order, which
    depends on the layout, so bits drift when it changes."""

    def init(self, group: Group, plan=None, stack: tuple[int, ...] = ()) -> GroupSum:
        return GroupSum(accs=[jnp.zeros(stack + group.local_shape(i), jnp.float32) for i in range(len(group.shapes))],
                        plan=None, nonfinite=jnp.zeros(stack, jnp.int32), live=jnp.ones(stack, jnp.int32))

    def add(self, group: Group, state: GroupSum, grads: list) -> GroupSum:
        nonfinite = _any_nonfinite(grads)
        grads = [jnp.where(state.live > 0, g.astype(jnp.float32), jnp.float32(0)) for g in grads]
        summed = collectives.scatter_sum(grads, list(group.dims), axis=group.axis, size=group.size, pack=group.pack)
        return state._replace(accs=[a + s for a, s in zip(state.accs, summed)], nonfinite=nonfinite)


Reducer = ExactSum | FloatSum


def fits(lsb, exp, num_shards: int) -> jax.Array:
    """True if no sum of `num_shards` shards quantised so can overflow int64 (bool scalar)."""
    limit = 62 - headroom_bits(num_shards)
    checks = jax.tree.leaves(jax.tree.map(lambda l, e: jnp.all((e - l) <= limit), lsb, exp))
    return jnp.all(jnp.stack(checks))


def fixed_lsb(exp, num_shards: int):
    """Pass 2's lsb per block: the global maximum's exponent less the int64 bits the sum may use."""
    return jax.tree.map(lambda e: e - jnp.int32(62 - headroom_bits(num_shards)), exp)


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
