"""The training step, split in two so that a collective never consumes the state.

    grads = compute(params, batch, step)   all cross-replica collectives; donates nothing
    state = apply(state, grads, step)      local optimizer update; donates the old state

If a peer dies inside `compute`, the step-(k-1) state is untouched on every survivor: a fault
costs zero steps. `compute` also reports per-virtual-shard finiteness, so a NaN shard is caught
before `apply` ever sees it.

Batch layout: every device of the data x fsdp grid (data-major) has C slots of b rows each; the
global batch has G * C * b rows. A `ShardLayout` says which virtual shards each device computes:
device g holds the `counts[g]` consecutive shards from `starts[g]` in its first slots, and runs
that many (a loop with a per-device trip count: a device with fewer shards finishes sooner, a
device with none only joins the collectives) -- with fsdp > 1, as many as the most of its fsdp
group holds, since the group's members sum each shard's gradient together; the extra slots hold
zero weights and add nothing. The uniform layout fills devices in
order with S = ceil(V / G) shards each (C = S); an uneven one (resilient_jax.assignment: faster
hosts hold more shards) needs C > S slots, from `runtime.max_share`. With the exact reduction
the sum over shards is the same integer whoever computed which shard, so the layout changes no bit.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from resilient_jax import mesh as mesh_lib
from resilient_jax import collectives, fsdp, hierarchy, reduce, rng
from resilient_jax.losses import LossFn, next_token_cross_entropy
from resilient_jax.state import ModelDef, TrainState


@struct.dataclass
class GradResult:
    grads: object  # summed over all shards, divided by the total loss weight
    loss: jax.Array  # mean loss over every weighted token of the global batch
    shard_loss: jax.Array  # [V] mean loss of each virtual shard
    shard_finite: jax.Array  # [V] bool: loss and every gradient element of the shard are finite
    row_finite: jax.Array  # [V * b] bool: each sample's loss is finite (names the poisoned rows)
    passes: jax.Array  # int32: 1, or 2 when the exact reduction had to requantise (see reduce.py)
    # bool: no sum of the shards quantised so can have overflowed (always true in `native`). A
    # first pass that is not `fits` is thrown away: Compute.second_pass recomputes the step.
    fits: jax.Array


@struct.dataclass
class ShardLayout:
    """Which virtual shards each grid device computes this step (replicated; identical on every host)."""

    counts: jax.Array  # int32 [G]: shards device g computes
    starts: jax.Array  # int32 [G]: its first shard; its shards are starts[g] .. starts[g] + counts[g] - 1
    slots: jax.Array  # int32 [V]: the slot (g * C + i) that holds shard v


@struct.dataclass
class ApplyMetrics:
    grad_norm: jax.Array
    lr: jax.Array


@dataclass(frozen=True)
class ShardPlan:
    """How V virtual shards land on the G = data x fsdp devices of the compute grid.

    Each virtual shard is computed whole on one grid device (devices along `tensor` share it).
    `max_share`: a device may hold up to max_share x its uniform share (the slots C per device).
    """

    num_shards: int  # V
    devices: int  # G
    rows_per_shard: int  # b
    max_share: float = 1.0

    @property
    def padded_shards(self) -> int:
        return -(-self.num_shards // self.devices) * self.devices

    @property
    def shards_per_device(self) -> int:
        """S: the uniform share."""
        return self.padded_shards // self.devices

    @property
    def slots_per_device(self) -> int:
        """C: the most shards one device can hold (>= S)."""
        share = math.ceil(self.max_share * self.num_shards / self.devices - 1e-9)
        return max(self.shards_per_device, min(self.num_shards, share))

    @property
    def padded_rows(self) -> int:
        return self.devices * self.slots_per_device * self.rows_per_shard

    def uniform_counts(self) -> list[int]:
        S, V = self.shards_per_device, self.num_shards
        return [max(0, min(S, V - g * S)) for g in range(self.devices)]

    def layout(self, counts=None) -> ShardLayout:
        """The layout of per-device shard counts (grid order); default the uniform one."""
        counts = self.uniform_counts() if counts is None else [int(c) for c in counts]
        C = self.slots_per_device
        if len(counts) != self.devices or sum(counts) != self.num_shards or not all(0 <= c <= C for c in counts):
            raise ValueError(f"a shard layout needs {self.devices} counts in 0..{C} summing to "
                             f"{self.num_shards}, got {counts}")
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
        slots = np.concatenate([g * C + np.arange(c) for g, c in enumerate(counts)]).astype(np.int32)
        return ShardLayout(counts=np.asarray(counts, np.int32), starts=starts, slots=slots)


def make_shard_plan(global_batch: int, num_shards: int, devices: int, max_share: float = 1.0) -> ShardPlan:
    if num_shards <= 0 or global_batch % num_shards:
        raise ValueError(
            f"data.global_batch ({global_batch}) must be a positive multiple of parallel.virtual_shards ({num_shards})"
        )
    return ShardPlan(num_shards=num_shards, devices=devices, rows_per_shard=global_batch // num_shards,
                     max_share=max_share)


def _loss_of_logits(loss_fn: LossFn, tokens_BxL1, weights_BxL, loss_key):
    """logits -> (summed loss, (loss weight, per-row loss)) of one virtual shard's rows."""

    def loss_sum(logits):
        row_loss_B = loss_fn(logits, tokens_BxL1[:, 1:], weights_BxL, key=loss_key)
        return jnp.sum(row_loss_B), (jnp.sum(weights_BxL), row_loss_B)

    return loss_sum


@struct.dataclass
class _ShardStats:
    loss: jax.Array  # [S] summed loss of each local shard
    weight: jax.Array  # [S] its loss weight
    finite: jax.Array  # [S] bool
    row_finite: jax.Array  # [S, b] bool


def _gather_stats(stats: _ShardStats, axes, slots: jax.Array):
    """Every shard's (loss, weight, finite, row_finite), from all devices' slots, in shard order, as
    ONE all-gather: the four travel as columns of one float32 array (bools as 0/1, exact; losses'
    bits unchanged)."""
    S = stats.loss.shape[0]
    columns = jnp.concatenate([
        stats.loss.astype(jnp.float32).reshape(S, 1), stats.weight.astype(jnp.float32).reshape(S, 1),
        stats.finite.astype(jnp.float32).reshape(S, 1), stats.row_finite.astype(jnp.float32),
    ], axis=1)
    rows = lax.all_gather(columns, axes, tiled=True)[slots]
    return rows[:, 0], rows[:, 1], rows[:, 2] > 0.5, (rows[:, 3:] > 0.5).reshape(-1)


def make_compute(
    model_def: ModelDef, mesh: Mesh, plan: ShardPlan, *, seed: int, mode: reduce.Reduction, use_dropout: bool,
    loss_fn: LossFn = next_token_cross_entropy, regions: hierarchy.RegionGroups | None = None,
) -> "Compute":
    """grads = compute(params, tokens, weights, step): the step's only collectives.

    A shard_map manual over (data, fsdp): every grid device runs the virtual shards its layout
    gives it one after another, gathering the fsdp-sharded weights one parameter group (a layer)
    at a time where the model uses them (ZeRO-3); each shard's gradient of a group is summed over
    fsdp inside the backward pass and added to the device's fsdp slice of the sum
    (resilient_jax.fsdp), in exact integers (`invariant`) or float (`native`); at the end the
    slices are summed over data (native: one all-reduce; invariant: an int64 reduce-scatter, then
    a float32 all-gather of the converted slices). `tensor` stays automatic (GSPMD) when >1.
    `use_dropout`: give the model each shard's dropout key; `loss_fn`: task.loss, given its own key
    unless it is the deterministic default (see resilient_jax.rng and resilient_jax.losses).
    `regions`: sum over data in that region-aware order (resilient_jax.hierarchy) instead of flat.
    """
    grid = _GridSpecs.of(model_def, mesh, plan)
    if regions is not None and len(regions.regions) != mesh.shape[mesh_lib.DATA_AXIS]:
        raise ValueError(f"the region groups are for {len(regions.regions)} data indices, the mesh has "
                         f"{mesh.shape[mesh_lib.DATA_AXIS]}")
    data = mesh_lib.DATA_AXIS
    partition = grid.partition
    use_loss_key = loss_fn is not next_token_cross_entropy
    C, b, V = plan.slots_per_device, plan.rows_per_shard, plan.num_shards
    reducer = reduce.ExactSum(V) if mode == "invariant" else reduce.FloatSum()

    def shard_grad(params, sums: fsdp.Sums, step, tok, w, v):
        # The model is traced with 32-bit defaults even where the reduction around it is 64-bit.
        with jax.enable_x64(False):
            key = rng.dropout_key(seed, step, v) if use_dropout else None
            loss_key = rng.loss_key(seed, step, v) if use_loss_key else None
            (loss_sum, (weight_sum, row_loss)), sums = partition.value_and_sums(
                model_def, reducer, _loss_of_logits(loss_fn, tok, w, loss_key), params, tok[:, :-1], key, sums)
            finite = jnp.isfinite(loss_sum) & jnp.all(jnp.stack([jnp.all(s.nonfinite == 0) for s in sums.flat()]))
            return sums, (loss_sum, weight_sum, finite, jnp.isfinite(row_loss))

    def shard_loop(params, step, tokens, weights, first, count, trip, sums):
        """Run this device's `count` shards (first, first+1, ...) in its slots, one after another.

        A loop, not vmap: each shard runs with identical shapes, so its bits do not depend on how
        many shards this device holds (vmap batched the matmuls and changed the bits). The trip
        count is this device's own (a traced value; the most of its fsdp group's when fsdp > 1,
        since every shard's backward pass sums over the group): slots past its count hold zero
        weights, and their gradients add nothing (`Sums.for_shard`).
        """
        tok, w = tokens.reshape(C, b, -1), weights.reshape(C, b, -1)

        def body(i, carry):
            sums, stats = carry
            sums, one = shard_grad(params, sums.for_shard(i < count), step, tok[i], w[i], first + i)
            return sums, tuple(s.at[i].set(x) for s, x in zip(stats, one))

        # A plan without spare slots (uniform only) runs all C slots, padding ones with zero weight
        # (exact zeros): a counted loop, whose trip count XLA's analyses know (resilient_jax.hlo_stats).
        return lax.fori_loop(0, trip if grid.uneven else C, body, (sums, no_stats()))

    def no_stats():
        return jnp.zeros(C, jnp.float32), jnp.zeros(C, jnp.float32), jnp.zeros(C, bool), jnp.zeros((C, b), bool)

    def per_device(params_local, tokens, weights, step, layout, requantise: bool):
        first, count, trip = grid.my_shards(layout)
        if mode == "native":
            sums, stats = shard_loop(params_local, step, tokens, weights, first, count, trip, partition.init(reducer))
            grads = partition.params_from(collectives.tree_data_sum([gs.accs for gs in sums.flat()], data, regions))
            passes, fits = jnp.int32(1), jnp.bool_(True)
        else:
            with jax.enable_x64(True):
                grads, stats, passes, fits = exact_grads(params_local, step, tokens, weights, first, count, trip,
                                                         requantise)
        loss_V, weight_V, finite_V, row_finite = _gather_stats(_ShardStats(*stats), grid.grid_axes, layout.slots)
        total_weight = jnp.maximum(reduce.ordered_sum(weight_V, V), 1.0)
        grads = jax.tree.map(lambda g: g / total_weight, grads)
        return GradResult(
            grads=grads,
            loss=reduce.ordered_sum(loss_V, V) / total_weight,
            shard_loss=loss_V / jnp.maximum(weight_V, 1.0),
            shard_finite=finite_V,
            row_finite=row_finite,
            passes=passes,
            fits=fits,
        )

    def exact_grads(params, step, tokens, weights, first, count, trip, requantise: bool):
        def attempt(plans):
            sums, stats = shard_loop(params, step, tokens, weights, first, count, trip, partition.init(reducer, plans))
            lsb, exp = reducer.global_stats([a for gs in sums.flat() for a in gs.accs], data)
            return sums, stats, lsb, exp

        # Pass 1, and `fits`: the same verdict on every device (from exact all-reduces). Pass 2 is
        # another program (`requantise`), run only after a pass 1 that does not fit, so that the
        # step every other pass runs holds the shard loop once and no loop around it: that loop
        # made the compute program 17% slower to compile (tiny, 6 devices).
        sums, stats, lsb, exp = attempt(None)
        passes = 1
        if requantise:  # every shard quantised to the lsb per block fixed by pass 1's exact maxima
            sums, stats, lsb, exp = attempt(partition.per_group(reducer.fixed_lsb(exp)))
            passes = 2
        fits = reducer.fits(lsb, exp)
        groups, lsb = partition.groups(), partition.per_group(lsb)
        floats = reducer.floats_over_data(groups, [gs.accs for gs in sums.flat()], lsb, data,
                                          mesh.shape[data], regions)
        return partition.params_from(floats), stats, jnp.int32(passes), fits

    rep = PartitionSpec()
    out_specs = GradResult(grads=grid.manual_specs, loss=rep, shard_loss=rep, shard_finite=rep, row_finite=rep,
                           passes=rep, fits=rep)

    def jitted(requantise: bool):
        return grid.jit(functools.partial(per_device, requantise=requantise), out_specs, lambda params: GradResult(
            grads=params, loss=None, shard_loss=None, shard_finite=None, row_finite=None, passes=None, fits=None))

    return Compute(jitted(False), plan, second_pass=(lambda: jitted(True)) if mode == "invariant" else None)


@struct.dataclass
class EvalResult:
    shard_loss: jax.Array  # [V] float32: the summed loss of each virtual shard's rows
    shard_weight: jax.Array  # [V] float32: their loss weight


def make_evaluate(model_def: ModelDef, mesh: Mesh, plan: ShardPlan, *, seed: int,
                  loss_fn: LossFn = next_token_cross_entropy) -> "Compute":
    """result = evaluate(params, tokens, weights, batch): held-out loss sums, forward only.

    Each virtual shard of the eval batch is computed whole on one grid device, as in `compute`
    (weights gathered over fsdp one group at a time, the layout's shards one after another, no
    dropout), so a shard's sum has the same bits whoever computes it; the sums come back
    replicated in shard order, for the host to add up in a fixed order (resilient_jax.evaluation).
    `batch` (the eval batch's index) only keys a task.loss of your own: rng.eval_loss_key.
    """
    grid = _GridSpecs.of(model_def, mesh, plan)
    use_loss_key = loss_fn is not next_token_cross_entropy
    C, b = plan.slots_per_device, plan.rows_per_shard

    def per_device(params_local, tokens, weights, batch, layout):
        first, _, trip = grid.my_shards(layout)
        tok, w = tokens.reshape(C, b, -1), weights.reshape(C, b, -1)

        def body(i, sums):
            key = rng.eval_loss_key(seed, batch, first + i) if use_loss_key else None
            logits = grid.partition.forward(model_def, params_local, tok[i][:, :-1])
            loss_sum, (weight_sum, _) = _loss_of_logits(loss_fn, tok[i], w[i], key)(logits)
            return sums.at[i].set(jnp.stack([loss_sum.astype(jnp.float32), weight_sum.astype(jnp.float32)]))

        sums = lax.fori_loop(0, trip if grid.uneven else C, body, jnp.zeros((C, 2), jnp.float32))
        rows = lax.all_gather(sums, grid.grid_axes, tiled=True)[layout.slots]
        return EvalResult(shard_loss=rows[:, 0], shard_weight=rows[:, 1])

    rep = PartitionSpec()
    return Compute(grid.jit(per_device, EvalResult(shard_loss=rep, shard_weight=rep),
                            lambda params: EvalResult(shard_loss=None, shard_weight=None)), plan)


@dataclass(frozen=True)
class _GridSpecs:
    """What compute and evaluate share: a shard_map manual over (data, fsdp) -- and tensor when it
    is 1 -- in which each grid device runs its layout's shards, gathering the fsdp-sharded weights
    one group at a time (resilient_jax.fsdp)."""

    mesh: Mesh
    model_def: ModelDef
    manual: frozenset
    manual_specs: object  # params' PartitionSpecs restricted to the manual axes
    partition: fsdp.Partition
    uneven: bool  # slots for an uneven assignment: a per-device trip count

    @classmethod
    def of(cls, model_def: ModelDef, mesh: Mesh, plan: ShardPlan) -> _GridSpecs:
        if plan.devices != mesh_lib.grid_size(mesh):
            raise ValueError(f"the shard plan is for {plan.devices} devices, the mesh's data x fsdp grid has "
                             f"{mesh_lib.grid_size(mesh)}")
        model_def.check_layout(dict(mesh.shape))
        data, fsdp_axis, tensor = mesh_lib.DATA_AXIS, mesh_lib.FSDP_AXIS, mesh_lib.TENSOR_AXIS
        manual = frozenset({data, fsdp_axis} | ({tensor} if mesh.shape[tensor] == 1 else set()))
        param_specs = mesh_lib.specs_from_logical(model_def.logical_axes)
        return cls(mesh=mesh, model_def=model_def, manual=manual,
                   manual_specs=jax.tree.map(lambda spec: mesh_lib.keep_axes(spec, manual), param_specs),
                   partition=fsdp.Partition.of(model_def, mesh, mesh_lib.activation_rule(mesh, manual)),
                   uneven=plan.slots_per_device > plan.shards_per_device)

    @property
    def grid_axes(self) -> tuple[str, str]:
        return (mesh_lib.DATA_AXIS, mesh_lib.FSDP_AXIS)

    def my_shards(self, layout: ShardLayout) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(first shard, shard count, trip count) of this grid device under `layout`: the trip
        count is its shard count, or with fsdp > 1 the most of its fsdp group's (the group's members
        take part in each other's gathers and gradient sums, shard by shard)."""
        fsdp_size = self.mesh.shape[mesh_lib.FSDP_AXIS]
        row = lax.axis_index(mesh_lib.DATA_AXIS) * fsdp_size
        g = row + lax.axis_index(mesh_lib.FSDP_AXIS)
        trip = layout.counts[g] if fsdp_size == 1 else jnp.max(lax.dynamic_slice_in_dim(layout.counts, row, fsdp_size))
        return layout.starts[g], layout.counts[g], trip

    def jit(self, per_device, out_specs, out_shardings_of):
        """per_device(params, tokens, weights, scalar, layout), shard-mapped and jitted: params
        sharded by their logical axes, the batch over the grid, the rest replicated. `out_specs`
        mark params-shaped outputs with the manual specs; `out_shardings_of(param_shardings)` gives
        the output shardings, None for a replicated leaf."""
        grid_spec = PartitionSpec(self.grid_axes)
        rep_spec = PartitionSpec()
        sharded = jax.shard_map(
            per_device, mesh=self.mesh,
            in_specs=(self.manual_specs, grid_spec, grid_spec, rep_spec,
                      ShardLayout(counts=rep_spec, starts=rep_spec, slots=rep_spec)),
            out_specs=out_specs, axis_names=set(self.manual),
            # all_gather's and psum's results are identical on every device, but the public
            # collectives are typed "varying"; the replicated out_specs are correct by construction
            # (tests compare layouts).
            check_vma=False,
        )
        param_shardings = mesh_lib.shardings_from_logical(self.model_def.logical_axes, self.mesh)
        rep = mesh_lib.replicated(self.mesh)
        out_shardings = jax.tree.map(lambda x: rep if x is None else x, out_shardings_of(param_shardings),
                                     is_leaf=lambda x: x is None)
        batch = mesh_lib.batch_sharding(self.mesh)
        return jax.jit(sharded, in_shardings=(param_shardings, batch, batch, rep,
                                              ShardLayout(counts=rep, starts=rep, slots=rep)),
                       out_shardings=out_shardings)


class Compute:
    """fn(params, tokens, weights, index, layout=None): a jitted half of the step (compute: index =
    the step; evaluate: the eval batch); the layout defaults to the plan's uniform one (a
    ShardLayout from `plan.layout(counts)` otherwise).

    The exact reduction's compute runs in one pass, or in two when the first one's quantisation
    could have overflowed (result.fits false: shards whose block maxima lie too far apart, see
    resilient_jax.reduce). Calling it does both as needed, reading `fits` back; the Trainer calls
    `first_pass` and reads `fits` back with the step's finiteness and loss, in one readback, then
    `second_pass` in the rare step that needs it -- a program of its own, compiled the first time
    a step needs it."""

    def __init__(self, jitted, plan: ShardPlan, second_pass: Callable[[], Any] | None = None):
        self.jitted, self.plan = jitted, plan
        self._uniform = plan.layout()
        self._make_second_pass, self._second_pass = second_pass, None

    def __call__(self, params, tokens, weights, step, layout: ShardLayout | None = None):
        result = self.first_pass(params, tokens, weights, step, layout)
        if self._make_second_pass is not None and not bool(result.fits):
            return self.second_pass(params, tokens, weights, step, layout)
        return result

    def first_pass(self, params, tokens, weights, step, layout: ShardLayout | None = None):
        return self.jitted(params, tokens, weights, step, self._layout(layout))

    def second_pass(self, params, tokens, weights, step, layout: ShardLayout | None = None):
        """The step again as the first pass and then the second: every shard quantised to the lsb
        per block that the first pass's exact maxima fix, so no sum can overflow (result.passes ==
        2). It runs the shard loop twice (the first pass's exponents are not carried over: they
        would be an output of every step, per block of every leaf), so a step that needs it costs
        three shard loops in all."""
        return self._second()(params, tokens, weights, step, self._layout(layout))

    def lower_second_pass(self, params, tokens, weights, step, layout: ShardLayout | None = None):
        return self._second().lower(params, tokens, weights, step, self._layout(layout))

    def _second(self):
        if self._make_second_pass is None:
            raise ValueError("only the exact (invariant) reduction has a second pass")
        if self._second_pass is None:
            self._second_pass = self._make_second_pass()
        return self._second_pass

    def _layout(self, layout: ShardLayout | None) -> ShardLayout:
        return self._uniform if layout is None else layout

    def lower(self, params, tokens, weights, step, layout: ShardLayout | None = None):
        return self.jitted.lower(params, tokens, weights, step, self._layout(layout))

    def trace(self, params, tokens, weights, step, layout: ShardLayout | None = None):
        return self.jitted.trace(params, tokens, weights, step, self._layout(layout))

    def _cache_size(self) -> int:  # tests: one compilation serves every step and every layout
        return self.jitted._cache_size()


def make_apply(
    tx: optax.GradientTransformation, schedule: optax.Schedule, shardings: TrainState, mesh: Mesh
) -> Callable[[TrainState, object, jax.Array], tuple[TrainState, ApplyMetrics]]:
    def apply(state: TrainState, grads, step):
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = ApplyMetrics(grad_norm=reduce.global_norm(grads), lr=schedule(step))
        return TrainState(params=params, opt_state=opt_state), metrics

    rep = mesh_lib.replicated(mesh)
    return jax.jit(
        apply,
        in_shardings=(shardings, shardings.params, rep),
        out_shardings=(shardings, ApplyMetrics(grad_norm=rep, lr=rep)),
        donate_argnums=0,
    )
