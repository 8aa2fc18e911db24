"""The training state as a plain pytree, and how it is born sharded.

The NNX module is split once into a graph definition and a pure nested dict of parameters; the
step functions only ever see the dict, which keeps them pure and keeps checkpoints framework-free.
Initialisation follows eval_shape -> shardings -> jit(init, out_shardings=...), so no full copy of
the state ever exists on one device unless the mesh says so.
"""

from __future__ import annotations

import functools
import os
import sysconfig
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh

from resilient_jax import mesh as mesh_lib
from resilient_jax import models, plugins, rng
from resilient_jax.config import BUILTIN_MODEL, ConfigError, ModelConfig


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
    build: Callable[[nnx.Rngs], nnx.Module]  # the configured factory with its args bound

    @property
    def builtin(self) -> bool:
        return self.cfg.factory == BUILTIN_MODEL

    @functools.cached_property
    def abstract_params(self):
        """ShapeDtypeStructs of the params dict, read off the template (built abstractly once, in
        make_model_def). Tracing init_params again builds every block, which grows with depth
        (~0.17 s for the 8-layer small model), and a new world's trainer and its state adoption
        asked for these shapes five times: 0.7 s of the small model's re-formation."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(self.template))

    def forward(self, params, tokens_BxL: jax.Array, dropout_key: jax.Array | None = None, *,
                prepare_layer=None, layer_inputs=None) -> jax.Array:
        """`prepare_layer`, `layer_inputs`: see TransformerLM.__call__ (a per-block params hook,
        e.g. a per-layer gather); the built-in model's only (`builtin`)."""
        state = jax.tree.map(lambda x: x, self.template)
        nnx.replace_by_pure_dict(state, params)
        model = nnx.merge(self.graphdef, state)
        if prepare_layer is None:
            return model(tokens_BxL, dropout_key=dropout_key)
        return model(tokens_BxL, dropout_key=dropout_key, prepare_layer=prepare_layer, layer_inputs=layer_inputs)

    def check_output(self, seq_len: int, vocab_size: int) -> None:
        """Refuse (one ConfigError line) a model whose logits are not float [B, seq_len, >= vocab_size]."""
        abstract_params = self.abstract_params
        tokens = jax.ShapeDtypeStruct((2, seq_len), jnp.int32)
        try:
            out = jax.eval_shape(self.forward, abstract_params, tokens)
        except ConfigError:
            raise
        except Exception as e:
            if self.builtin:
                raise  # the framework's own model: a bug to see whole, not a config to fix
            raise _plugin_error(f"the model of {self.cfg.factory}, called on tokens [2, {seq_len}],", e) from None
        shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
        if (shape is None or len(shape) != 3 or tuple(shape[:2]) != (2, seq_len) or shape[2] < vocab_size
                or not jnp.issubdtype(dtype, jnp.floating)):
            got = f"{type(out).__name__} {tuple(shape)} {dtype}" if shape is not None else type(out).__name__
            raise ConfigError(
                f"config key model.factory: {self.cfg.factory} must return float logits [B, L, vocab] with "
                f"vocab >= the dataset's {vocab_size}; for tokens [2, {seq_len}] it returned {got}")

    def check_layout(self, sizes: dict[str, int]) -> None:
        """Refuse (one line naming the key) an fsdp / tensor size that cannot split the params."""
        if self.builtin:
            mesh_lib.check_model_layout(self.cfg, sizes)  # names the model.* key
            return
        shapes = self.abstract_params
        flat = {"/".join(str(getattr(k, "key", k)) for k in path): tuple(leaf.shape)
                for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]}
        axes = jax.tree.leaves(self.logical_axes, is_leaf=lambda x: isinstance(x, tuple))
        mesh_lib.check_param_layout(self.cfg.factory, flat, dict(zip(flat, axes)), sizes)

    @property
    def layer_axes(self):
        """Logical axes of ONE block's params, as `prepare_layer` sees them (no "layers" dim)."""
        if not self.builtin:
            raise ValueError(f"layer_axes is the built-in transformer's; model.factory is {self.cfg.factory}")
        blocks = self.logical_axes["blocks"]
        if self.cfg.scan_layers:
            return jax.tree.map(lambda axes: axes[1:], blocks, is_leaf=lambda x: isinstance(x, tuple))
        return blocks[0]

    def compute_cast_dtypes(self):
        """Per param (the params dict's structure), the dtype the model only ever uses it cast to,
        or None: the built-in transformer's weight matrices under a narrower model.dtype
        (TransformerLM.CAST_TO_COMPUTE_DTYPE). The framework may hand those over already cast, e.g.
        gather them over fsdp in bf16: the same bits at half the bytes."""
        from resilient_jax.model import TransformerLM

        dtype = jnp.dtype(self.cfg.dtype)
        narrower = self.builtin and dtype.itemsize < 4

        def cast(path, leaf):
            name = str(getattr(path[-1], "key", path[-1]))
            return dtype if narrower and name in TransformerLM.CAST_TO_COMPUTE_DTYPE else None

        return jax.tree_util.tree_map_with_path(cast, self.abstract_params)

    def init_params(self, key: jax.Array):
        return nnx.to_pure_dict(nnx.state(_build_model(self.build, key), nnx.Param))


def _build_model(build: Callable[[nnx.Rngs], nnx.Module], key) -> nnx.Module:
    # Variables keep their logical names as metadata instead of being sharded at creation (the
    # state is born sharded by jit(init, out_shardings=...) below). Scoped to this call, so the
    # user's own NNX setting is left as it was.
    with nnx.use_eager_sharding(False):
        return build(nnx.Rngs(params=key))


def make_model_def(cfg: ModelConfig, import_dir: str = "") -> ModelDef:
    """The configured model (model.factory called with its args), checked abstractly: it must be an
    nnx.Module whose every parameter names a known logical axis per dim. `import_dir`: task.import_dir."""
    factory = plugins.load_callable(cfg.factory, "model.factory", import_dir)
    args = models.factory_args(cfg)

    def build(rngs: nnx.Rngs) -> nnx.Module:
        module = factory(dict(args), rngs)
        if not isinstance(module, nnx.Module):
            raise ConfigError(f"config key model.factory: {cfg.factory} must return a flax.nnx.Module, "
                              f"got {type(module).__name__}")
        return module

    try:
        abstract = nnx.eval_shape(lambda: _build_model(build, 0))
    except ConfigError:
        raise
    except Exception as e:
        if cfg.factory == BUILTIN_MODEL:
            raise  # the framework's own model: a bug to see whole, not a config to fix
        raise _plugin_error(f"{cfg.factory}(model.args={args}, rngs)", e) from None
    graphdef, state = nnx.split(abstract, nnx.Param)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    logical = jax.tree.map(tuple, specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    _check_logical_axes(cfg.factory, nnx.to_pure_dict(state), logical)
    return ModelDef(cfg=cfg, graphdef=graphdef, template=state, logical_axes=logical, build=build)


# Frames in these directories are the framework's, JAX's or Python's; the innermost frame outside
# them is where the user's code failed.
_LIBRARY_DIRS = tuple({os.path.dirname(os.path.abspath(module.__file__)) + os.sep for module in (models, jax, flax)}
                      | {os.path.abspath(sysconfig.get_path(name)) + os.sep
                         for name in ("stdlib", "platstdlib", "purelib", "platlib")})


def _plugin_error(what: str, e: BaseException, key: str = "model.factory",
                   fix: str = "fix your model code or model.args") -> ConfigError:
    """One line for an exception raised by a plug-in of the user's: the key, the exception and the
    user's file:line (the whole traceback is mostly JAX's and flax's tracing machinery)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not os.path.abspath(f.filename).startswith(_LIBRARY_DIRS) and not f.filename.startswith("<")]
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    message = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return ConfigError(f"config key {key}: {what} raised {type(e).__name__}"
                       f"{': ' + message if message else ''}{where}; {fix}")


def check_loss(loss_fn: Callable, spec: str, seq_len: int, vocab_size: int) -> None:
    """Refuse (one ConfigError line) a task.loss that fails on, or does not return one float loss per
    row for, a batch of 2 rows: a scalar would be summed as one row's loss and train on nonsense."""
    logits = jax.ShapeDtypeStruct((2, seq_len, vocab_size), jnp.float32)
    targets = jax.ShapeDtypeStruct((2, seq_len), jnp.int32)
    weights = jax.ShapeDtypeStruct((2, seq_len), jnp.float32)
    try:
        out = jax.eval_shape(lambda lg, t, w: loss_fn(lg, t, w, key=jax.random.key(0)), logits, targets, weights)
    except Exception as e:
        raise _plugin_error(f"{spec}, called on logits [2, {seq_len}, {vocab_size}],", e, key="task.loss",
                             fix="fix your loss (resilient_jax.losses describes what it is given)") from None
    shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
    if shape != (2,) or not jnp.issubdtype(dtype, jnp.floating):
        got = f"{tuple(shape)} {dtype}" if shape is not None else type(out).__name__
        raise ConfigError(f"config key task.loss: {spec} must return one float loss per row, shape [B]; for 2 rows "
                          f"it returned {got} (resilient_jax.losses describes the protocol)")


def _check_logical_axes(factory: str, abstract_params, logical) -> None:
    """Every param dim has a logical name (None = replicated) that mesh.LOGICAL_RULES maps."""
    shapes = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    if not shapes:
        raise ConfigError(f"config key model.factory: {factory} built a module without any nnx.Param")
    axes = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, tuple))
    rules = ", ".join(f"{name} -> {axis}" for name, axis in mesh_lib.LOGICAL_RULES.items())
    for (path, leaf), names in zip(shapes, axes):
        where = "/".join(str(getattr(k, "key", k)) for k in path)
        if len(names) != len(leaf.shape):
            raise ConfigError(
                f"config key model.factory: param {where} {tuple(leaf.shape)} has logical axes {names or '()'}, "
                f"one name per dim needed: nnx.Param(value, out_sharding=(...)) with names from "
                f"resilient_jax.mesh.LOGICAL_RULES ({rules}) or None")
        unknown = [n for n in names if n is not None and n not in mesh_lib.LOGICAL_RULES]
        if unknown:
            raise ConfigError(
                f"config key model.factory: param {where} has logical axis {unknown[0]!r}, which no rule maps; "
                f"use one of resilient_jax.mesh.LOGICAL_RULES ({rules}) or None")
        mesh_axes = [mesh_lib.LOGICAL_RULES[n] for n in names if n is not None and mesh_lib.LOGICAL_RULES[n]]
        if len(set(mesh_axes)) != len(mesh_axes):
            raise ConfigError(
                f"config key model.factory: param {where} has logical axes {names}, which put one mesh axis on "
                f"two dims (rules: {rules}); name one of those dims None")


def state_shardings(model_def: ModelDef, tx: optax.GradientTransformation, mesh) -> TrainState:
    """Shardings of every leaf of the TrainState, from abstract shapes only."""
    param_shardings = mesh_lib.shardings_from_logical(model_def.logical_axes, mesh)
    abstract_params = model_def.abstract_params
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
    params = model_def.abstract_params  # what _init makes, without tracing the model again
    shapes = TrainState(params=params, opt_state=jax.eval_shape(tx.init, params))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def _init(model_def: ModelDef, tx: optax.GradientTransformation, key: jax.Array) -> TrainState:
    params = model_def.init_params(key)
    return TrainState(params=params, opt_state=tx.init(params))


def init_program(model_def: ModelDef, tx: optax.GradientTransformation, mesh: Mesh, seed: int):
    """The jitted program (no arguments) that makes the fresh state, born with its shardings."""
    shardings = state_shardings(model_def, tx, mesh)
    return jax.jit(lambda: _init(model_def, tx, rng.init_key(seed)), out_shardings=shardings)


def init_state(model_def: ModelDef, tx: optax.GradientTransformation, mesh: Mesh, seed: int) -> TrainState:
    return init_program(model_def, tx, mesh, seed)()
