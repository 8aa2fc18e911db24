"""Every random number in a run derives from `train.seed` through fold_in, never from mutable state.

    base            = key(seed)
    init            = fold_in(base, INIT)
    dropout(step,v) = fold_in(fold_in(fold_in(base, DROPOUT), step), v)    v = virtual shard
    loss(step,v)    = fold_in(fold_in(fold_in(base, LOSS), step), v)       (task.loss's key)
    eval(batch,v)   = fold_in(fold_in(fold_in(base, EVAL), batch), v)      (task.loss's key in evaluation)

So a step's randomness depends on (seed, step, virtual shard) only -- not on which device or host
computes that shard, and not on how many there are.
"""

from __future__ import annotations

import jax

INIT = 0
DROPOUT = 1
LOSS = 2
EVAL = 3


def base_key(seed: int) -> jax.Array:
    return jax.random.key(seed)


def init_key(seed: int) -> jax.Array:
    return jax.random.fold_in(base_key(seed), INIT)


def dropout_key(seed: int, step: jax.Array, virtual_shard: jax.Array) -> jax.Array:
    step_key = jax.random.fold_in(jax.random.fold_in(base_key(seed), DROPOUT), step)
    return jax.random.fold_in(step_key, virtual_shard)


def loss_key(seed: int, step: jax.Array, virtual_shard: jax.Array) -> jax.Array:
    step_key = jax.random.fold_in(jax.random.fold_in(base_key(seed), LOSS), step)
    return jax.random.fold_in(step_key, virtual_shard)


def eval_loss_key(seed: int, batch: jax.Array, virtual_shard: jax.Array) -> jax.Array:
    """A task.loss's key for eval batch `batch`: the same at every evaluation, so evaluations of
    different steps compare the params alone."""
    batch_key = jax.random.fold_in(jax.random.fold_in(base_key(seed), EVAL), batch)
    return jax.random.fold_in(batch_key, virtual_shard)


def describe(seed: int) -> dict:
    """The RNG context a checkpoint records: enough to re-derive every key of the run."""
    return {
        "seed": seed,
        "impl": str(jax.random.key_impl(base_key(seed))),
        "base_key_data": [int(x) for x in jax.random.key_data(base_key(seed)).ravel()],
        "purposes": {"init": INIT, "dropout": DROPOUT, "loss": LOSS, "eval": EVAL},
        "derivation": "dropout(step, v) = fold_in(fold_in(fold_in(key(seed), 1), step), v); "
                      "loss(step, v) = fold_in(fold_in(fold_in(key(seed), 2), step), v); "
                      "eval(batch, v) = fold_in(fold_in(fold_in(key(seed), 3), batch), v)",
    }
