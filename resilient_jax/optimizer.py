"""The optimizer and its learning-rate schedule, built from OptimizerConfig.

Optimizers (`optimizer.name`), all optax's, all with global-norm clipping first when clip_norm > 0
and decoupled weight decay on matrices and embeddings only (1-D norm scales are not decayed):
- adamw      optax.adamw(b1, b2, eps, weight_decay)   (the default)
- lion       optax.lion(b1, b2, weight_decay)         (wants a ~3-10x smaller lr than adamw)
- adafactor  optax.adafactor(weight_decay_rate)       (factored second moments; its own update clipping)
- sgd        optax.sgd(momentum) after optax.add_decayed_weights(weight_decay)

Schedules (`optimizer.schedule`), each a linear warmup from 0 to lr over warmup_steps, then over
the rest of `decay_steps` (0 = the run's train.steps), ending at lr * min_lr_ratio and staying there:
- cosine    cosine decay (the default)
- linear    linear decay
- constant  lr throughout (no decay; min_lr_ratio unused)
- wsd       warmup-stable-decay: lr until the last decay_fraction of decay_steps, then linear decay
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from resilient_jax import reduce
from resilient_jax.config import OptimizerConfig


def lr_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    total = cfg.decay_steps or total_steps
    warmup = min(cfg.warmup_steps, max(total - 1, 0))
    end = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
            decay_steps=max(total, warmup + 1), end_value=end,
        )
    ramp = optax.linear_schedule(0.0, cfg.lr, warmup)
    if cfg.schedule == "constant":
        return optax.join_schedules([ramp, optax.constant_schedule(cfg.lr)], [warmup])
    if cfg.schedule == "linear":
        decay_start, decay_len = warmup, max(total - warmup, 1)
    else:  # wsd
        decay_len = max(min(round(cfg.decay_fraction * total), total - warmup), 1)
        decay_start = max(total - decay_len, warmup)
    return optax.join_schedules(
        [ramp, optax.constant_schedule(cfg.lr), optax.linear_schedule(cfg.lr, end, decay_len)],
        [warmup, decay_start],
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


def _base_optimizer(cfg: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    # None keeps optax's default (the params' dtype, float32) and so the state it always had.
    mu_dtype = None if cfg.mu_dtype == "float32" else jnp.dtype(cfg.mu_dtype)
    if cfg.name == "adamw":
        return optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                           mask=_decay_mask, mu_dtype=mu_dtype)
    if cfg.name == "lion":
        return optax.lion(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=_decay_mask,
                          mu_dtype=mu_dtype)
    if cfg.name == "adafactor":
        return optax.adafactor(schedule, weight_decay_rate=cfg.weight_decay or None,
                               weight_decay_mask=_decay_mask)
    if cfg.name == "sgd":
        return optax.chain(optax.add_decayed_weights(cfg.weight_decay, mask=_decay_mask),
                           optax.sgd(schedule, momentum=cfg.momentum or None, accumulator_dtype=mu_dtype))
    raise ValueError(f"unknown optimizer.name {cfg.name!r}")  # the config's Literal type rejects it first


def build_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    base = _base_optimizer(cfg, lr_schedule(cfg, total_steps))
    if cfg.clip_norm > 0:
        return optax.chain(clip_by_global_norm(cfg.clip_norm), base)
    return base
