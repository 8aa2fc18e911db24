"""AdamW with linear warmup + cosine decay and global-norm clipping, built from OptimizerConfig."""

from __future__ import annotations

import jax
import optax

from resilient_jax import reduce
from resilient_jax.config import OptimizerConfig


def lr_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def _decay_mask(params):
    # Norm scales (1-D) are not decayed; matrices and embeddings are.
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """optax.clip_by_global_norm (same formula, same empty state), with the norm taken by
    reduce.global_norm so that its bits do not depend on how the gradients are sharded."""

    def update(updates, state, params=None):
        del params
        g_norm = reduce.global_norm(updates)
        trigger = g_norm < max_norm
        return jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm),
                            updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def build_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    schedule = lr_schedule(cfg, total_steps)
    adamw = optax.adamw(
        schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=_decay_mask
    )
    if cfg.clip_norm > 0:
        return optax.chain(clip_by_global_norm(cfg.clip_norm), adamw)
    return adamw
