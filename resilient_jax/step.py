"""The training step, split in two so that a collective never consumes the state.

    grads = compute(params, batch, step)   all cross-replica collectives; donates nothing
    state = apply(state, grads, step)      local optimizer update; donates the old state

If a peer dies inside `compute`, the step-(k-1) state is untouched on every survivor: a fault
costs zero steps. `compute` also reports per-virtual-shard finiteness, so a NaN shard is caught
before `apply` ever sees it.

Batch layout: the global batch has V_padded * b rows; rows [v*b, (v+1)*b) are virtual shard v.
Shard v is computed on grid device v // S of the data x fsdp grid (data-major), S shards per device.
Rows of padding shards (v >= V, present only when the grid size does not divide V) carry zero
loss weight: their gradients are exactly zero and their losses are left out of the sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from resilient_jax import mesh as mesh_lib
from resilient_jax import collectives, reduce, rng
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


@struct.dataclass
class ApplyMetrics:
    grad_norm: jax.Array
    lr: jax.Array


@dataclass(frozen=True)
class ShardPlan:
    """How V virtual shards land on the G = data x fsdp devices of the compute grid.

    Each virtual shard is computed whole on one grid device (devices along `tensor` share it).
    """

    num_shards: int  # V
    devices: int  # G
    rows_per_shard: int  # b

    @property
    def padded_shards(self) -> int:
        return -(-self.num_shards // self.devices) * self.devices

    @property
    def shards_per_device(self) -> int:
        return self.padded_shards // self.devices

    @property
    def padded_rows(self) -> int:
        return self.padded_shards * self.rows_per_shard


def make_shard_plan(global_batch: int, num_shards: int, devices: int) -> ShardPlan:
    if num_shards <= 0 or global_batch % num_shards:
        raise ValueError(
            f"data.global_batch ({global_batch}) must be a positive multiple of parallel.virtual_shards ({num_shards})"
        )
    return ShardPlan(num_shards=num_shards, devices=devices, rows_per_shard=global_batch // num_shards)


def _shard_loss_fn(model_def: ModelDef, loss_fn: LossFn):
    def loss_sum(params, tokens_BxL1, weights_BxL, key, loss_key):
        logits = model_def.forward(params, tokens_BxL1[:, :-1], dropout_key=key)
        row_loss_B = loss_fn(logits, tokens_BxL1[:, 1:], weights_BxL, key=loss_key)
        return jnp.sum(row_loss_B), (jnp.sum(weights_BxL), row_loss_B)

    return loss_sum


@struct.dataclass
class _ShardStats:
    loss: jax.Array  # [S] summed loss of each local shard
    weight: jax.Array  # [S] its loss weight
    finite: jax.Array  # [S] bool
    row_finite: jax.Array  # [S, b] bool


def _gather_stats(stats: _ShardStats, axes, num_shards: int):
    """Every shard's (loss, weight, finite, row_finite), from all devices, as ONE all-gather: the
    four travel as columns of one float32 array (bools as 0/1, exact; losses' bits unchanged)."""
    S = stats.loss.shape[0]
    columns = jnp.concatenate([
        stats.loss.astype(jnp.float32).reshape(S, 1), stats.weight.astype(jnp.float32).reshape(S, 1),
        stats.finite.astype(jnp.float32).reshape(S, 1), stats.row_finite.astype(jnp.float32),
    ], axis=1)
    rows = lax.all_gather(columns, axes, tiled=True)[:num_shards]
    return rows[:, 0], rows[:, 1], rows[:, 2] > 0.5, (rows[:, 3:] > 0.5).reshape(-1)


def make_compute(
    model_def: ModelDef, mesh: Mesh, plan: ShardPlan, *, seed: int, mode: reduce.Reduction, use_dropout: bool,
    loss_fn: LossFn = next_token_cross_entropy,
) -> Callable[..., GradResult]:
    """grads = compute(params, tokens, weights, step): the step's only collectives.

    A shard_map manual over (data, fsdp): every grid device gathers the fsdp-sharded weights
    (ZeRO-3), runs its S virtual shards one after another (lax.scan, one gradient accumulator),
    and the accumulators are reduce-scattered back to fsdp shards and all-reduced over data --
    in exact integers (`invariant`) or float (`native`). `tensor` stays automatic (GSPMD) when >1.
    `use_dropout`: give the model each shard's dropout key; `loss_fn`: task.loss, given its own key
    unless it is the deterministic default (see resilient_jax.rng and resilient_jax.losses).
    """
    if plan.devices != mesh_lib.grid_size(mesh):
        raise ValueError(f"the shard plan is for {plan.devices} devices, the mesh's data x fsdp grid has "
                         f"{mesh_lib.grid_size(mesh)}")
    mesh_lib.check_model_layout(model_def.cfg, dict(mesh.shape))
    data, fsdp, tensor = mesh_lib.DATA_AXIS, mesh_lib.FSDP_AXIS, mesh_lib.TENSOR_AXIS
    manual = {data, fsdp} | ({tensor} if mesh.shape[tensor] == 1 else set())
    use_loss_key = loss_fn is not next_token_cross_entropy
    grad_fn = jax.value_and_grad(_shard_loss_fn(model_def, loss_fn), has_aux=True)
    S, b, V = plan.shards_per_device, plan.rows_per_shard, plan.num_shards
    fsdp_size = mesh.shape[fsdp]
    param_specs = mesh_lib.specs_from_logical(model_def.logical_axes)
    manual_specs = jax.tree.map(lambda spec: mesh_lib.keep_axes(spec, manual), param_specs)
    fsdp_dims = jax.tree.map(lambda spec: mesh_lib.axis_position(spec, fsdp), param_specs)
    # Headroom from the REAL shard count: padding shards add exact zeros, and a width that followed
    # the padded count (a function of the device grid) would make the bits depend on the layout.
    bits = reduce.own_bits(V)

    def shard_grad(params, step, tok, w, v):
        # The model is traced with 32-bit defaults even where the reduction around it is 64-bit.
        with jax.enable_x64(False):
            key = rng.dropout_key(seed, step, v) if use_dropout else None
            loss_key = rng.loss_key(seed, step, v) if use_loss_key else None
            (loss_sum, (weight_sum, row_loss)), g = grad_fn(params, tok, w, key, loss_key)
            finite = jnp.isfinite(loss_sum) & jnp.all(
                jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(g)])
            )
            return g, (loss_sum, weight_sum, finite, jnp.isfinite(row_loss))

    def per_device(params_local, tokens, weights, step):
        # One all-gather for the whole tree, not one per leaf (resilient_jax.collectives says why).
        params = collectives.gather(params_local, fsdp_dims, axis=fsdp, size=fsdp_size,
                                    pack=mesh.shape[tensor] == 1)
        grid = lax.axis_index(data) * fsdp_size + lax.axis_index(fsdp)
        xs = (tokens.reshape(S, b, -1), weights.reshape(S, b, -1), grid * S + jnp.arange(S, dtype=jnp.int32))

        # lax.scan, not vmap: each shard runs with identical shapes, so its bits do not depend on
        # how many shards this device holds (vmap batched the matmuls and changed the bits).
        if mode == "native":
            def body(acc, x):
                g, stats = shard_grad(params, step, *x)
                return jax.tree.map(jnp.add, acc, g), stats

            acc, stats = lax.scan(body, jax.tree.map(jnp.zeros_like, params), xs)
            grads = reduce.reduce_native(acc, scatter_axes=fsdp_dims, data_axis=data, fsdp_axis=fsdp)
            passes = jnp.int32(1)
        else:
            with jax.enable_x64(True):
                grads, stats, passes = exact_grads(params, step, xs)
        loss_V, weight_V, finite_V, row_finite = _gather_stats(_ShardStats(*stats), (data, fsdp), V)
        total_weight = jnp.maximum(reduce.ordered_sum(weight_V, V), 1.0)
        grads = jax.tree.map(lambda g: g / total_weight, grads)
        return GradResult(
            grads=grads,
            loss=reduce.ordered_sum(loss_V, V) / total_weight,
            shard_loss=loss_V / jnp.maximum(weight_V, 1.0),
            shard_finite=finite_V,
            row_finite=row_finite,
            passes=passes,
        )

    def exact_grads(params, step, xs):
        zeros = jax.tree.map(reduce.zeros_like_leaf, params)

        def attempt(carry):
            lsb_plan, _, _, _, _, tries = carry

            def body(accs, x):
                g, stats = shard_grad(params, step, *x)
                return jax.tree.map(lambda a, gl, p: reduce.add_shard(a, gl, p, bits), accs, g, lsb_plan,
                                    is_leaf=reduce.is_acc), stats

            accs, stats = lax.scan(body, zeros, xs)
            lsb, exp = reduce.global_exponents(accs, (data, fsdp))
            ok = reduce.fits(lsb, exp, V)
            return reduce.fixed_lsb(exp, V), ok, accs, lsb, stats, tries + 1

        # Pass 1 always; pass 2 only when pass 1 could have overflowed (the same decision on
        # every device: `ok` comes from exact all-reduces).
        stats0 = (jnp.zeros(S, jnp.float32), jnp.zeros(S, jnp.float32), jnp.zeros(S, bool), jnp.zeros((S, b), bool))
        init = (reduce.own_exponent_plan(zeros), jnp.bool_(False), zeros,
                jax.tree.map(lambda a: a.lsb, zeros, is_leaf=reduce.is_acc), stats0, jnp.int32(0))
        _, _, accs, lsb, stats, tries = lax.while_loop(lambda c: ~c[1], attempt, init)
        grads = reduce.reduce_exact(accs, lsb, scatter_axes=fsdp_dims, data_axis=data, fsdp_axis=fsdp)
        return grads, stats, tries

    sharded = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(manual_specs, PartitionSpec((data, fsdp)), PartitionSpec((data, fsdp)), PartitionSpec()),
        out_specs=GradResult(
            grads=manual_specs, loss=PartitionSpec(), shard_loss=PartitionSpec(), shard_finite=PartitionSpec(),
            row_finite=PartitionSpec(), passes=PartitionSpec(),
        ),
        axis_names=manual,
        # all_gather's and psum's results are identical on every device, but the public
        # collectives are typed "varying"; the replicated out_specs are correct by construction
        # (tests compare layouts).
        check_vma=False,
    )
    param_shardings = mesh_lib.shardings_from_logical(model_def.logical_axes, mesh)
    rep = mesh_lib.replicated(mesh)
    out_shardings = GradResult(
        grads=param_shardings, loss=rep, shard_loss=rep, shard_finite=rep, row_finite=rep, passes=rep
    )
    batch = mesh_lib.batch_sharding(mesh)
    return jax.jit(
        sharded,
        in_shardings=(param_shardings, batch, batch, rep),
        out_shardings=out_shardings,
    )


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
