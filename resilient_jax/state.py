"""The training state as a plain pytree, and how it is born sharded.

The NNX module is split once into a graph definition and a pure nested dict of parameters; the
step functions only ever see the dict, which keeps them pure and keeps checkpoints framework-free.
Initialisation follows eval_shape -> shardings -> jit(init, out_shardings=...), so no full copy of
the state ever exists on one device unless the mesh says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import optax
from flax import nnx, struct
from jax.sharding import Mesh

from resilient_jax import mesh as mesh_lib
from resilient_jax import rng
from resilient_jax.config import ModelConfig
from resilient_jax.model import TransformerLM


@struct.dataclass
class TrainState:
    params: Any
    opt_state: Any


@dataclass(frozen=True)
class ModelDef:
    """Everything needed to run the model functionally on a params dict."""

    cfg: ModelConfig
    graphdef: Any
    template: Any  # nnx.State with abstract values, filled by `forward`
    logical_axes: Any  # pure dict of logical-axis tuples, same structure as params

    def forward(self, params, tokens_BxL: jax.Array, dropout_key: jax.Array | None = None, *,
                prepare_layer=None) -> jax.Array:
        """`prepare_layer`: see TransformerLM.__call__ (a per-block params hook, e.g. a per-layer gather)."""
        state = jax.tree.map(lambda x: x, self.template)
        nnx.replace_by_pure_dict(state, params)
        model = nnx.merge(self.graphdef, state)
        return model(tokens_BxL, dropout_key=dropout_key, prepare_layer=prepare_layer)

    @property
    def layer_axes(self):
        """Logical axes of ONE block's params, as `prepare_layer` sees them (no "layers" dim)."""
        blocks = self.logical_axes["blocks"]
        if self.cfg.scan_layers:
            return jax.tree.map(lambda axes: axes[1:], blocks, is_leaf=lambda x: isinstance(x, tuple))
        return blocks[0]

    def init_params(self, key: jax.Array):
        return nnx.to_pure_dict(nnx.state(_build_model(self.cfg, key), nnx.Param))


def _build_model(cfg: ModelConfig, key) -> TransformerLM:
    # Variables keep their logical names as metadata instead of being sharded at creation (the
    # state is born sharded by jit(init, out_shardings=...) below). Scoped to this call, so the
    # user's own NNX setting is left as it was.
    with nnx.use_eager_sharding(False):
        return TransformerLM(cfg, rngs=nnx.Rngs(params=key))


def make_model_def(cfg: ModelConfig) -> ModelDef:
    abstract = nnx.eval_shape(lambda: _build_model(cfg, 0))
    graphdef, state = nnx.split(abstract, nnx.Param)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    logical = jax.tree.map(tuple, specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    return ModelDef(cfg=cfg, graphdef=graphdef, template=state, logical_axes=logical)


def state_shardings(model_def: ModelDef, tx: optax.GradientTransformation, mesh) -> TrainState:
    """Shardings of every leaf of the TrainState, from abstract shapes only."""
    param_shardings = mesh_lib.shardings_from_logical(model_def.logical_axes, mesh)
    abstract_params = jax.eval_shape(model_def.init_params, jax.random.key(0))
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    # A param-shaped leaf (Adam's moments) is sharded like its param; one of another shape
    # (Adafactor's factored row/column moments) is replicated.
    opt_shardings = optax.tree_map_params(
        tx,
        lambda leaf, sharding, param: sharding if leaf.shape == param.shape else mesh_lib.replicated(mesh),
        abstract_opt,
        param_shardings,
        abstract_params,
        transform_non_params=lambda _: mesh_lib.replicated(mesh),
    )
    return TrainState(params=param_shardings, opt_state=opt_shardings)


def abstract_state(model_def: ModelDef, tx: optax.GradientTransformation, mesh) -> TrainState:
    """ShapeDtypeStructs carrying the target shardings (for AOT lowering and checkpoint restore)."""
    shardings = state_shardings(model_def, tx, mesh)
    shapes = jax.eval_shape(lambda k: _init(model_def, tx, k), jax.random.key(0))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def _init(model_def: ModelDef, tx: optax.GradientTransformation, key: jax.Array) -> TrainState:
    params = model_def.init_params(key)
    return TrainState(params=params, opt_state=tx.init(params))


def init_state(model_def: ModelDef, tx: optax.GradientTransformation, mesh: Mesh, seed: int) -> TrainState:
    shardings = state_shardings(model_def, tx, mesh)
    init = jax.jit(lambda: _init(model_def, tx, rng.init_key(seed)), out_shardings=shardings)
    return init()
