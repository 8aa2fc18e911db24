"""Model: shapes, logical axes on every parameter, causality, explicit-key dropout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from resilient_jax.config import ModelConfig
from resilient_jax.model import count_params
from resilient_jax.state import make_model_def

CFG = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, d_ff=64, dropout=0.1)


def _params(cfg=CFG):
    model_def = make_model_def(cfg)
    return model_def, model_def.init_params(jax.random.key(0))


def test_logits_shape_and_dtype():
    model_def, params = _params()
    tokens = jnp.zeros((3, 10), jnp.int32)
    logits = model_def.forward(params, tokens)
    assert logits.shape == (3, 10, 256) and logits.dtype == jnp.float32


def test_every_parameter_has_logical_axes_matching_its_rank():
    model_def, params = _params()
    axes = model_def.logical_axes
    flat_params = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    flat_axes = dict(jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda x: isinstance(x, tuple))[0])
    assert flat_params.keys() == flat_axes.keys()
    for path, leaf in flat_params.items():
        assert len(flat_axes[path]) == leaf.ndim, jax.tree_util.keystr(path)
    assert axes["embed"] == ("vocab", "embed")
    assert axes["blocks"][0]["attn"]["wq"] == ("embed", "heads", "kv")
    assert axes["blocks"][1]["mlp"]["w_down"] == ("mlp", "embed")


def test_param_count_matches_the_architecture():
    _, params = _params()
    d, f, v, L = CFG.d_model, CFG.d_ff, CFG.vocab_size, CFG.n_layers
    per_block = 4 * d * d + 3 * d * f + 2 * d
    assert count_params(params) == 2 * v * d + L * per_block + d


def test_attention_is_causal():
    model_def, params = _params()
    rs = np.random.RandomState(0)
    a = rs.randint(0, 256, (1, 12)).astype(np.int32)
    b = a.copy()
    b[0, 8:] = (b[0, 8:] + 1) % 256  # change only the future
    la, lb = model_def.forward(params, a), model_def.forward(params, b)
    np.testing.assert_array_equal(np.asarray(la[0, :8]), np.asarray(lb[0, :8]))
    assert not np.array_equal(np.asarray(la[0, 8:]), np.asarray(lb[0, 8:]))


def test_dropout_only_with_an_explicit_key():
    model_def, params = _params()
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    det1, det2 = model_def.forward(params, tokens), model_def.forward(params, tokens)
    np.testing.assert_array_equal(np.asarray(det1), np.asarray(det2))
    k1 = model_def.forward(params, tokens, jax.random.key(1))
    k1_again = model_def.forward(params, tokens, jax.random.key(1))
    k2 = model_def.forward(params, tokens, jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(k1), np.asarray(k1_again))
    assert not np.array_equal(np.asarray(k1), np.asarray(k2))
    assert not np.array_equal(np.asarray(k1), np.asarray(det1))
