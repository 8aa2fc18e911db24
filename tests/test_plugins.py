"""model.factory / task.loss plug-ins: resolution, the abstract checks made before any step, and
the built-in transformer as one factory among others. Fast: nothing here trains."""

from __future__ import annotations

import dataclasses
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resilient_jax import losses, plugins
from resilient_jax.config import BUILTIN_MODEL, ConfigError, ModelConfig, load_config
from resilient_jax.fingerprinting import params_fingerprint
from resilient_jax.model import TransformerLM
from resilient_jax.state import make_model_def

from conftest import REPO

USER_MODELS = '''
import jax.numpy as jnp
from flax import nnx


class Bigram(nnx.Module):
    def __init__(self, vocab, axes, out_vocab=None, rngs=None):
        self.table = nnx.Param(jnp.zeros((vocab, out_vocab or vocab)), out_sharding=axes)

    def __call__(self, tokens_BxL, *, dropout_key=None):
        return jnp.take(self.table[...], tokens_BxL, axis=0)


def good(args, rngs):
    return Bigram(args["vocab"], ("vocab", None), rngs=rngs)


def small_vocab(args, rngs):
    return Bigram(args["vocab"], ("vocab", None), out_vocab=8, rngs=rngs)


def no_axes(args, rngs):
    return Bigram(args["vocab"], (), rngs=rngs)


def unknown_axis(args, rngs):
    return Bigram(args["vocab"], ("vocab", "experts"), rngs=rngs)


def same_mesh_axis_twice(args, rngs):
    return Bigram(args["vocab"], ("vocab", "mlp"), rngs=rngs)


def doubled_loss(logits_BxLxV, targets_BxL, weights_BxL, *, key):
    from resilient_jax.losses import next_token_cross_entropy

    assert key is not None  # a loss of your own gets its key
    return 2.0 * next_token_cross_entropy(logits_BxLxV, targets_BxL, weights_BxL, key=None)


def not_a_module(args, rngs):
    return "a string"


def needs_an_arg(args, rngs):
    return Bigram(args["width"], ("vocab", None), rngs=rngs)


def attribute_error(args, rngs):
    return Bigram(args.vocab, ("vocab", None), rngs=rngs)  # line: attribute_error


def name_error_when_called(args, rngs):
    class Broken(Bigram):
        def __call__(self, tokens_BxL, *, dropout_key=None):
            return undefined_name  # line: name_error_when_called  # noqa: F821
    return Broken(args["vocab"], ("vocab", None), rngs=rngs)


def shapes_do_not_multiply(args, rngs):
    class Mismatch(Bigram):
        def __call__(self, tokens_BxL, *, dropout_key=None):
            x = jnp.take(self.table[...], tokens_BxL, axis=0)
            return x @ jnp.ones((3, 5))  # line: shapes_do_not_multiply
    return Mismatch(args["vocab"], ("vocab", None), rngs=rngs)


def flat(args, rngs):
    class Flat(Bigram):
        def __call__(self, tokens_BxL, *, dropout_key=None):
            return jnp.zeros(tokens_BxL.shape)
    return Flat(args["vocab"], ("vocab", None), rngs=rngs)
'''


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    """A directory with a config and a module of factories next to it (as a user would have)."""
    root = tmp_path_factory.mktemp("user")
    (root / "h13_user_models.py").write_text(textwrap.dedent(USER_MODELS))
    (root / "run.yaml").write_text('model:\n  factory: "h13_user_models:good"\n  args: {vocab: 256}\n')
    return root


def model_cfg(factory: str, **args) -> ModelConfig:
    return ModelConfig(factory=f"h13_user_models:{factory}", args=args)


def test_a_factory_next_to_the_config_is_imported_from_any_directory(user_dir, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # not the config's directory
    cfg = load_config(user_dir / "run.yaml")
    assert cfg.task.import_dir == str(user_dir)
    model_def = make_model_def(cfg.model, cfg.task.import_dir)
    model_def.check_output(seq_len=16, vocab_size=256)
    params = model_def.init_params(jax.random.key(0))
    assert model_def.logical_axes == {"table": ("vocab", None)}
    logits = model_def.forward(params, jnp.zeros((2, 16), jnp.int32))
    assert logits.shape == (2, 16, 256)
    assert str(user_dir) not in __import__("sys").path  # the path was put back


def test_the_builtin_factory_is_the_transformer_with_the_model_keys_as_args():
    cfg = ModelConfig(d_model=32, n_heads=4, d_ff=64, n_layers=1)
    assert cfg.factory == BUILTIN_MODEL
    model_def = make_model_def(cfg)
    assert model_def.builtin
    from flax import nnx

    with nnx.use_eager_sharding(False):
        direct = TransformerLM(cfg, rngs=nnx.Rngs(params=jax.random.key(3)))
    direct_params = nnx.to_pure_dict(nnx.state(direct, nnx.Param))
    assert params_fingerprint(model_def.init_params(jax.random.key(3))) == params_fingerprint(direct_params)


def test_model_args_are_refused_for_the_builtin_model(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  args: {width: 3}\n")
    with pytest.raises(ConfigError, match="model.args: the built-in model"):
        load_config(path)


def test_model_args_are_hashed(user_dir):
    a = load_config(user_dir / "run.yaml")
    b = load_config(user_dir / "run.yaml", ["model.args={vocab: 300}"])
    assert a.hash != b.hash


@pytest.mark.parametrize("factory, args, expected", [
    ("no_axes", {"vocab": 256}, "param table (256, 256) has logical axes (), one name per dim needed"),
    ("unknown_axis", {"vocab": 256}, "param table has logical axis 'experts', which no rule maps"),
    ("same_mesh_axis_twice", {"vocab": 256}, "put one mesh axis on two dims"),
    ("not_a_module", {"vocab": 256}, "must return a flax.nnx.Module, got str"),
    ("needs_an_arg", {"vocab": 256}, "raised KeyError: 'width'"),
])
def test_a_module_that_cannot_be_sharded_is_refused_with_one_line(user_dir, factory, args, expected):
    with pytest.raises(ConfigError) as e:
        make_model_def(model_cfg(factory, **args), str(user_dir))
    assert expected in str(e.value) and "\n" not in str(e.value)
    if "axis" in expected or "axes" in expected:
        assert "vocab -> tensor" in str(e.value)  # the rules are listed


@pytest.mark.parametrize("factory, expected", [
    ("small_vocab", "for tokens [2, 16] it returned ShapeDtypeStruct (2, 16, 8) float32"),
    ("flat", "it returned ShapeDtypeStruct (2, 16) float32"),
])
def test_logits_of_the_wrong_shape_are_refused(user_dir, factory, expected):
    model_def = make_model_def(model_cfg(factory, vocab=256), str(user_dir))
    with pytest.raises(ConfigError, match="vocab >= the dataset's 256") as e:
        model_def.check_output(seq_len=16, vocab_size=256)
    assert expected in str(e.value)


def user_line(marker: str) -> int:
    return next(i for i, line in enumerate(USER_MODELS.splitlines(), 1) if f"# line: {marker}" in line)


def test_a_factory_that_raises_is_one_line_naming_the_key_the_error_and_the_users_line(user_dir):
    with pytest.raises(ConfigError) as e:
        make_model_def(model_cfg("attribute_error", vocab=256), str(user_dir))
    message = str(e.value)
    assert message.startswith("config key model.factory: h13_user_models:attribute_error(model.args={'vocab': 256}, "
                              "rngs) raised AttributeError: 'dict' object has no attribute 'vocab' (at "), message
    assert f"h13_user_models.py:{user_line('attribute_error')});" in message and "\n" not in message


@pytest.mark.parametrize("factory, error", [
    ("name_error_when_called", "NameError: name 'undefined_name' is not defined"),
    ("shapes_do_not_multiply", "TypeError: dot_general requires contracting dimensions to have the same shape"),
])
def test_a_model_that_raises_when_called_is_one_line_naming_the_key_the_error_and_the_users_line(
        user_dir, factory, error):
    model_def = make_model_def(model_cfg(factory, vocab=256), str(user_dir))
    with pytest.raises(ConfigError) as e:
        model_def.check_output(seq_len=16, vocab_size=256)
    message = str(e.value)
    assert message.startswith(f"config key model.factory: the model of h13_user_models:{factory}, called on "
                              f"tokens [2, 16], raised {error}"), message
    assert f"h13_user_models.py:{user_line(factory)});" in message and "\n" not in message


@pytest.mark.parametrize("spec, expected", [
    ("no_such_pkg_h13.mod:build", "cannot import module 'no_such_pkg_h13.mod' (looked in the Python path): No module named"),
    ("resilient_jax.models:nope", "module 'resilient_jax.models' has no attribute 'nope'"),
    ("resilient_jax.config:BUILTIN_MODEL", "is a str, not a callable"),
    ("resilient_jax.models", 'expected "package.module:name"'),
])
def test_a_plugin_path_that_does_not_resolve_is_one_line(spec, expected):
    with pytest.raises(ConfigError, match="config key task.loss") as e:
        plugins.load_callable(spec, "task.loss")
    assert expected in str(e.value)


def test_the_default_loss_is_weighted_next_token_cross_entropy():
    rs = np.random.default_rng(0)
    logits = jnp.asarray(rs.normal(size=(2, 5, 7)), jnp.float32)
    targets = jnp.asarray(rs.integers(0, 7, (2, 5)), jnp.int32)
    weights = jnp.asarray([[1, 1, 0, 1, 1], [0, 0, 0, 0, 0]], jnp.float32)
    rows = losses.next_token_cross_entropy(logits, targets, weights, key=None)
    logp = jax.nn.log_softmax(logits)
    nll = -np.take_along_axis(np.asarray(logp), np.asarray(targets)[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(rows, (nll * np.asarray(weights)).sum(axis=1), rtol=1e-6)
    assert rows[1] == 0.0


def test_the_example_gru_passes_the_checks():
    cfg = load_config(REPO / "examples" / "gru_lm.yaml")
    model_def = make_model_def(cfg.model, cfg.task.import_dir)
    model_def.check_output(seq_len=8, vocab_size=256)
    assert not model_def.builtin
    assert dataclasses.asdict(cfg.model)["args"]["d_hidden"] == 64
    # The shapes the trainer reads off the template are what the user's init makes.
    params = model_def.init_params(jax.random.key(0))
    assert jax.tree.structure(model_def.abstract_params) == jax.tree.structure(params)
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(model_def.abstract_params)] == \
        [(p.shape, p.dtype) for p in jax.tree.leaves(params)]


def test_the_public_api_trains_a_user_model_and_loss_whose_checkpoint_reads_back(user_dir, tmp_path,
                                                                               default_dataset):
    import resilient_jax
    from resilient_jax.checkpoint import reader

    from conftest import TINY

    common = [f"task.import_dir={user_dir}", "model.factory=h13_user_models:good", "model.args={vocab: 256}",
              "train.steps=2", "run.progress=quiet"]
    plain = resilient_jax.run(TINY, [*common, f"run.dir={tmp_path / 'plain'}"], devices=jax.devices()[:8])
    doubled = resilient_jax.run(TINY, [*common, f"run.dir={tmp_path / 'doubled'}",
                                         "task.loss=h13_user_models:doubled_loss"], devices=jax.devices()[:8])
    assert doubled["first_loss"] == pytest.approx(2 * plain["first_loss"], rel=1e-6)
    weights = reader.load(tmp_path / "plain" / "checkpoints" / "2").weights
    assert resilient_jax.fingerprint(weights) == plain["params_fingerprint"]


def mean_loss(logits, targets, weights, *, key):  # the easy mistake: one number, not one per row
    return losses.next_token_cross_entropy(logits, targets, weights).mean()


def loss_with_a_typo(logits, targets, weights, *, key):
    return losses.next_token_cross_entropy(logits, targets, weigths)  # noqa: F821


def test_a_loss_that_returns_no_per_row_losses_or_raises_is_one_line_naming_task_loss(tmp_path):
    from resilient_jax.state import check_loss
    from resilient_jax.trainer import Trainer

    from conftest import tiny_config

    check_loss(losses.next_token_cross_entropy, "default", 16, 256)  # the protocol's own example passes
    with pytest.raises(ConfigError, match=r"^config key task.loss: t:mean_loss must return one float loss per row, "
                                          r"shape \[B\]; for 2 rows it returned \(\) float32 "):
        check_loss(mean_loss, "t:mean_loss", 16, 256)
    with pytest.raises(ConfigError) as e:
        check_loss(loss_with_a_typo, "t:typo", 16, 256)
    assert str(e.value).startswith("config key task.loss: t:typo, called on logits [2, 16, 256], raised NameError: "
                                   "name 'weigths' is not defined (at ") and "test_plugins.py:" in str(e.value)
    # The Trainer checks a loss of your own before anything compiles.
    with pytest.raises(ConfigError, match="config key task.loss: test_plugins:mean_loss must return one float loss"):
        Trainer(tiny_config(tmp_path, "task.loss=test_plugins:mean_loss", f"task.import_dir={REPO / 'tests'}"),
                devices=jax.devices()[:8])


def test_a_mesh_that_cannot_split_a_user_models_param_is_refused_naming_the_axis_and_param(user_dir):
    """The built-in model's check names model.* keys; a model of your own is checked on its params'
    shapes: here a vocab dim of 250 that parallel.tensor 4 cannot split (and the default model
    fields, which do not describe this model, are not what refuses it)."""
    model_def = make_model_def(model_cfg("good", vocab=250), str(user_dir))
    model_def.check_layout({"data": 1, "fsdp": 1, "tensor": 2})
    model_def.check_layout({"data": 1, "fsdp": 3, "tensor": 1})  # no dim of it is on fsdp
    with pytest.raises(ValueError) as e:
        model_def.check_layout({"data": 1, "fsdp": 1, "tensor": 4})
    assert str(e.value) == ("parallel.tensor (4) must divide dim 'vocab' (250) of param table (250, 250) of "
                            "model.factory h13_user_models:good; use a tensor size in [1, 2, 5, 10, 25, 50]")


def test_the_preflight_of_an_elastic_launch_imports_no_jax_and_still_imports_your_plugin(user_dir, tmp_path):
    # The elastic driver runs the preflight before it starts any worker: JAX, Flax and grain there
    # would delay every launch by their imports. A factory of your own is still imported and checked.
    import subprocess
    import sys

    script = textwrap.dedent(f"""
        import sys
        from resilient_jax.config import ConfigError, load_config
        from resilient_jax.preflight import check_run
        cfg = load_config({str(REPO / "configs" / "cpu-4host.yaml")!r}, ["run.dir={tmp_path / 'run'}"])
        check_run(cfg)
        print(sorted(m for m in ("jax", "flax", "grain", "orbax") if m in sys.modules))
        try:
            check_run(load_config({str(REPO / "configs" / "cpu-4host.yaml")!r},
                                  ["run.dir={tmp_path / 'run'}", "model.factory=h13_user_models:nope",
                                   "task.import_dir={user_dir}"]))
        except ConfigError as e:
            print(e)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True).stdout
    imported, error = out.splitlines()
    assert imported == "[]"
    assert error.startswith("config key model.factory: module 'h13_user_models' has no attribute 'nope'"), error
