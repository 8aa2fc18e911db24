"""optimizer.name and optimizer.schedule: every optimizer trains, every schedule has its shape,
decay_steps pins the schedule, unknown names are refused naming the key."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resilient_jax import mesh as mesh_lib
from resilient_jax import state as state_lib
from resilient_jax import step as step_lib
from resilient_jax.config import ConfigError, OptimizerConfig, ParallelConfig, load_config
from resilient_jax.optimizer import build_optimizer, lr_schedule

from conftest import TINY

# A learning rate that suits each optimizer on the tiny model (lion's updates are sign-sized).
LR = {"adamw": 3e-3, "lion": 3e-4, "adafactor": 1e-2, "sgd": 0.5}


# A one-layer model on one device and short rows: a few seconds per optimizer.
MODEL_OVERRIDES = ["model.dropout=0", "model.n_layers=1", "data.seq_len=16", "data.global_batch=8",
                   "parallel.virtual_shards=2"]


@functools.cache
def _model_and_compute():
    """The model, mesh and gradient half of the step, shared by every optimizer: `make_compute`
    takes no optimizer (the optimizer only enters `init_state` and `make_apply`, built per name
    below), so all four run the very same compute program -- compiling it once instead of four
    times is most of this module's time saved, and each optimizer still trains from its own state."""
    cfg = load_config(TINY, MODEL_OVERRIDES)
    devices = 1
    model_def = state_lib.make_model_def(cfg.model)
    mesh = mesh_lib.build_mesh(ParallelConfig(data=devices))
    plan = step_lib.make_shard_plan(cfg.data.global_batch, cfg.parallel.virtual_shards, devices)
    compute = step_lib.make_compute(model_def, mesh, plan, seed=0, mode="invariant", use_dropout=False)
    return model_def, mesh, compute


def _losses(name: str, steps: int = 6) -> list[float]:
    cfg = load_config(TINY, [*MODEL_OVERRIDES, f"optimizer.name={name}", f"optimizer.lr={LR[name]}",
                             "optimizer.warmup_steps=1", "optimizer.schedule=constant"])
    model_def, mesh, compute = _model_and_compute()
    tx = build_optimizer(cfg.optimizer, steps)
    state = state_lib.init_state(model_def, tx, mesh, cfg.train.seed)
    apply = step_lib.make_apply(tx, lr_schedule(cfg.optimizer, steps),
                                state_lib.state_shardings(model_def, tx, mesh), mesh)
    # One fixed batch, seen every step: a working optimizer must fit it.
    rs = np.random.default_rng(7)
    tokens = rs.integers(0, 256, (cfg.data.global_batch, cfg.data.seq_len + 1), dtype=np.int32)
    weights = np.ones((cfg.data.global_batch, cfg.data.seq_len), np.float32)
    losses = []
    for k in range(steps):
        result = compute(state.params, tokens, weights, np.int32(k))
        state, _ = apply(state, result.grads, np.int32(k))
        losses.append(float(result.loss))
    return losses


@pytest.mark.parametrize("name", ["adamw", "lion", "adafactor", "sgd"])
def test_each_optimizer_trains_with_finite_decreasing_loss(name):
    losses = _losses(name)
    assert np.all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0] - 1e-3, losses
    assert losses[-1] == min(losses), losses


def _lrs(steps: int, **kw) -> np.ndarray:
    cfg = dataclasses.replace(OptimizerConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=10), **kw)
    schedule = lr_schedule(cfg, steps)
    return np.array([float(schedule(k)) for k in range(steps + 20)])


def test_schedule_shapes():
    cosine, linear, constant = _lrs(100), _lrs(100, schedule="linear"), _lrs(100, schedule="constant")
    wsd = _lrs(100, schedule="wsd", decay_fraction=0.2)
    for lrs in (cosine, linear, constant, wsd):  # the same warmup ramp
        np.testing.assert_allclose(lrs[:11], np.arange(11) / 10, atol=1e-6)
    np.testing.assert_allclose(constant[10:], 1.0)
    np.testing.assert_allclose(wsd[10:81], 1.0)  # stable until the last 20% ...
    np.testing.assert_allclose(wsd[90], 0.55, atol=1e-6)  # ... then a linear decay
    np.testing.assert_allclose(linear[55], 0.55, atol=1e-6)
    np.testing.assert_allclose(cosine[55], 0.1 + 0.9 * 0.5, atol=1e-6)
    for lrs in (cosine, linear, wsd):
        np.testing.assert_allclose(lrs[100:], 0.1, atol=1e-6)  # ends at lr * min_lr_ratio and stays


def test_decay_steps_pins_the_schedule_when_train_steps_grows():
    short = _lrs(100, decay_steps=100)
    longer = _lrs(300, decay_steps=100)
    np.testing.assert_array_equal(short, longer[: len(short)])
    assert not np.array_equal(_lrs(100)[:100], _lrs(300)[:100])  # 0 = train.steps: it stretches


def test_default_is_the_old_adamw_cosine():
    import optax

    cfg = OptimizerConfig()
    old = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup_steps, 200, cfg.lr * cfg.min_lr_ratio)
    new = lr_schedule(cfg, 200)
    assert [float(new(k)) for k in range(220)] == [float(old(k)) for k in range(220)]


@pytest.mark.parametrize("key,value", [("optimizer.name", "adam2"), ("optimizer.schedule", "cyclic")])
def test_unknown_optimizer_or_schedule_is_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=rf"config key {key}: expected one of .*got '{value}'"):
        load_config(TINY, [f"{key}={value}"])


def test_a_bf16_first_moment_is_stored_in_bf16_and_adafactor_refuses_it():
    params = {"w": jnp.ones((4, 4), jnp.float32)}
    state = build_optimizer(OptimizerConfig(mu_dtype="bfloat16"), 10).init(params)
    dtypes = {str(x.dtype) for x in jax.tree.leaves(state) if getattr(x, "ndim", 0) == 2}
    assert dtypes == {"bfloat16", "float32"}, dtypes  # mu bf16, nu float32
    with pytest.raises(ConfigError) as err:
        load_config(None, ["optimizer.name=adafactor", "optimizer.mu_dtype=bfloat16"])
    assert "optimizer.mu_dtype" in str(err.value) and "\n" not in str(err.value)
