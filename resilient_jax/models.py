"""The model plug-in protocol, and the built-in transformer as one factory among others.

A run names its model with `model.factory: "package.module:build"` and `model.args: {...}`:

    def build(args: dict, rngs: flax.nnx.Rngs) -> flax.nnx.Module

The module's `__call__(tokens_BxL, *, dropout_key=None)` returns float logits [B, L, vocab] (vocab at
least the dataset's vocabulary); `dropout_key=None` is the deterministic pass, and a key is the only
randomness it may use. Parameters are drawn from `rngs.params()` and every `nnx.Param` names the
logical axis of each dim (`nnx.Param(value, out_sharding=("embed", "mlp"))`, or
`nnx.with_partitioning` on an initializer; None = replicated) from resilient_jax.mesh.LOGICAL_RULES,
which alone decides where each axis goes on the mesh. resilient_jax.state checks all of this before
any step runs.

The built-in `transformer` receives the model.* config keys as its args.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
from flax import nnx

from resilient_jax.config import BUILTIN_MODEL, ModelConfig
from resilient_jax.model import TransformerLM


class LanguageModel(Protocol):
    def __call__(self, tokens_BxL: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array: ...


class ModelFactory(Protocol):
    def __call__(self, args: dict[str, Any], rngs: nnx.Rngs) -> nnx.Module: ...


def transformer(args: dict[str, Any], rngs: nnx.Rngs) -> TransformerLM:
    """The built-in decoder-only LM (resilient_jax.model); `args` are ModelConfig's shape fields."""
    return TransformerLM(ModelConfig(**args), rngs=rngs)


def factory_args(cfg: ModelConfig) -> dict[str, Any]:
    """What the configured factory is called with: model.args, or for the built-in the model.* keys."""
    if cfg.factory != BUILTIN_MODEL:
        return dict(cfg.args)
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in ("factory", "args")}
