"""The training step, split in two so that a collective never consumes the state.

    grads = compute(params, batch, step)   all cross-replica collectives; donates nothing
    state = apply(state, grads, step)      local optimizer update; donates the old state

If a peer dies inside `compute`, the step-(k-1) state is untouched on every survivor: a fault
costs zero steps. `compute` also reports per-virtual-shard finiteness, so a NaN shard is caught
before `apply` ever sees it.

Batch layout: the global batch has V_padded * b rows; rows [v*b, (v+1)*b) are virtual shard v.
Rows of padding shards (v >= V, present only when the replica count does not divide V) carry
zero loss weight and are left out of the sum.
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
from resilient_jax import reduce, rng
from resilient_jax.losses import LossFn, next_token_cross_entropy
from resilient_jax.state import ModelDef, TrainState


@struct.dataclass
class GradResult:
    grads: object  # summed over all shards, divided by the total loss weight
    loss: jax.Array  # mean loss over every weighted token of the global batch
    shard_loss: jax.Array  # [V] mean loss of each virtual shard
    shard_finite: jax.Array  # [V] bool: loss and every gradient element of the shard are finite
    row_finite: jax.Array  # [V * b] bool: each sample's loss is finite (names the poisoned rows)


@struct.dataclass
class ApplyMetrics:
    grad_norm: jax.Array
    lr: jax.Array


@dataclass(frozen=True)
class ShardPlan:
    """How V virtual shards land on R replicas."""

    num_shards: int  # V
    replicas: int  # R
    rows_per_shard: int  # b

    @property
    def padded_shards(self) -> int:
        return -(-self.num_shards // self.replicas) * self.replicas

    @property
    def shards_per_replica(self) -> int:
        return self.padded_shards // self.replicas

    @property
    def padded_rows(self) -> int:
        return self.padded_shards * self.rows_per_shard


def make_shard_plan(global_batch: int, num_shards: int, replicas: int) -> ShardPlan:
    if num_shards <= 0 or global_batch % num_shards:
        raise ValueError(
            f"data.global_batch ({global_batch}) must be a positive multiple of parallel.virtual_shards ({num_shards})"
        )
    return ShardPlan(num_shards=num_shards, replicas=replicas, rows_per_shard=global_batch // num_shards)


def _shard_loss_fn(model_def: ModelDef, loss_fn: LossFn):
    def loss_sum(params, tokens_BxL1, weights_BxL, key, loss_key):
        logits = model_def.forward(params, tokens_BxL1[:, :-1], dropout_key=key)
        row_loss_B = loss_fn(logits, tokens_BxL1[:, 1:], weights_BxL, key=loss_key)
        return jnp.sum(row_loss_B), (jnp.sum(weights_BxL), row_loss_B)

    return loss_sum


def make_compute(
    model_def: ModelDef, mesh: Mesh, plan: ShardPlan, *, seed: int, mode: reduce.Reduction, use_dropout: bool,
    loss_fn: LossFn = next_token_cross_entropy,
) -> Callable[..., GradResult]:
    """`use_dropout`: give the model each shard's dropout key; `loss_fn`: task.loss, given its own key
    unless it is the deterministic default (see resilient_jax.rng and resilient_jax.losses)."""
    use_loss_key = loss_fn is not next_token_cross_entropy
    axis = mesh_lib.DATA_AXIS
    grad_fn = jax.value_and_grad(_shard_loss_fn(model_def, loss_fn), has_aux=True)
    S, V = plan.shards_per_replica, plan.num_shards

    def per_replica(params, tokens, weights, step):
        tokens_SxBxL1 = tokens.reshape(S, plan.rows_per_shard, -1)
        weights_SxBxL = weights.reshape(S, plan.rows_per_shard, -1)
        shard_ids = lax.axis_index(axis) * S + jnp.arange(S)

        def one_shard(inputs):
            tok, w, v = inputs
            key = rng.dropout_key(seed, step, v) if use_dropout else None
            loss_key = rng.loss_key(seed, step, v) if use_loss_key else None
            (loss_sum, (weight_sum, row_loss)), g = grad_fn(params, tok, w, key, loss_key)
            finite = jnp.isfinite(loss_sum) & jnp.all(
                jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(g)])
            )
            return g, loss_sum, weight_sum, finite, jnp.isfinite(row_loss)

        # lax.map, not vmap: each shard runs with identical shapes, so its bits do not depend on
        # how many shards this replica holds (vmap batched the matmuls and changed the bits).
        g_S, loss_S, weight_S, finite_S, row_finite_SxB = lax.map(
            one_shard, (tokens_SxBxL1, weights_SxBxL, shard_ids)
        )
        grads = reduce.sum_shard_grads(g_S, mode=mode, axis=axis, replicas=plan.replicas, num_shards=V)
        loss_V = reduce.gather_shard_values(loss_S, axis)[:V]
        weight_V = reduce.gather_shard_values(weight_S, axis)[:V]
        finite_V = reduce.gather_shard_values(finite_S, axis)[:V]
        row_finite = reduce.gather_shard_values(row_finite_SxB, axis)[:V].reshape(-1)
        total_weight = jnp.maximum(reduce.ordered_sum(weight_V, V), 1.0)
        total_loss = reduce.ordered_sum(loss_V, V)
        grads = jax.tree.map(lambda g: g / total_weight, grads)
        return GradResult(
            grads=grads,
            loss=total_loss / total_weight,
            shard_loss=loss_V / jnp.maximum(weight_V, 1.0),
            shard_finite=finite_V,
            row_finite=row_finite,
        )

    sharded = jax.shard_map(
        per_replica,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec(axis), PartitionSpec(axis), PartitionSpec()),
        out_specs=PartitionSpec(),
        axis_names={axis},
        # all_gather's result is identical on every replica, but the public all_gather is typed
        # "varying"; the replicated out_specs are correct by construction (tests compare replicas).
        check_vma=False,
    )
    param_shardings = mesh_lib.shardings_from_logical(model_def.logical_axes, mesh)
    out_shardings = GradResult(
        grads=param_shardings,
        loss=mesh_lib.replicated(mesh),
        shard_loss=mesh_lib.replicated(mesh),
        shard_finite=mesh_lib.replicated(mesh),
        row_finite=mesh_lib.replicated(mesh),
    )
    batch = mesh_lib.batch_sharding(mesh)
    return jax.jit(
        sharded,
        in_shardings=(param_shardings, batch, batch, mesh_lib.replicated(mesh)),
        out_shardings=out_shardings,
    )


def make_apply(
    tx: optax.GradientTransformation, schedule: optax.Schedule, shardings: TrainState, mesh: Mesh
) -> Callable[[TrainState, object, jax.Array], tuple[TrainState, ApplyMetrics]]:
    def apply(state: TrainState, grads, step):
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = ApplyMetrics(grad_norm=optax.tree.norm(grads), lr=schedule(step))
        return TrainState(params=params, opt_state=opt_state), metrics

    rep = mesh_lib.replicated(mesh)
    return jax.jit(
        apply,
        in_shardings=(shardings, shardings.params, rep),
        out_shardings=(shardings, ApplyMetrics(grad_norm=rep, lr=rep)),
        donate_argnums=0,
    )
