"""The loss plug-in protocol (`task.loss: "package.module:fn"`) and the default, next-token cross-entropy.

    def fn(logits_BxLxV, targets_BxL, weights_BxL, *, key) -> row_loss_B

`logits_BxLxV` is the model's output for tokens[:, :-1], `targets_BxL` is tokens[:, 1:] (int32),
`weights_BxL` the per-token loss weights of the data (0 on padding and on the rows of padding
shards). It returns, per row, the SUM of weighted token losses; the framework adds the rows of the
whole global batch in a fixed order and divides by the total weight, so the loss and gradients
are the weighted mean over every token whatever the host count. It must be a pure function: its
only randomness is `key` (derived from (train.seed, step, virtual shard); None when the run uses
no randomness: the built-in model without dropout and this default loss).
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
import optax


class LossFn(Protocol):
    def __call__(self, logits_BxLxV: jax.Array, targets_BxL: jax.Array, weights_BxL: jax.Array, *,
                 key: jax.Array | None) -> jax.Array: ...


def next_token_cross_entropy(logits_BxLxV: jax.Array, targets_BxL: jax.Array, weights_BxL: jax.Array, *,
                             key: jax.Array | None = None) -> jax.Array:
    del key  # deterministic
    ce_BxL = optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, targets_BxL)
    return jnp.sum(ce_BxL * weights_BxL, axis=1)
