"""Model: shapes, logical axes on every parameter, causality, explicit-key dropout, and the
block-stack options (remat, scanned layers, fused attention)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resilient_jax.config import ConfigError, ModelConfig, load_config
from resilient_jax.model import count_params
from resilient_jax.state import make_model_def

CFG = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, d_ff=64, dropout=0.1)


_BUILT: dict[str, tuple] = {}  # repr(config) -> (model_def, params); ModelConfig is not hashable


def _params(cfg=CFG):
    # One (eager, op-by-op compiled) init per config: five tests read CFG's params, none changes them.
    if repr(cfg) not in _BUILT:
        model_def = make_model_def(cfg)
        _BUILT[repr(cfg)] = model_def, model_def.init_params(jax.random.key(0))
    return _BUILT[repr(cfg)]


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


def test_abstract_params_read_off_the_template_are_what_init_makes():
    # The trainer, state adoption and the fsdp partition read shapes from model_def.abstract_params
    # instead of tracing init again; they must be exactly the initialised params' shapes and dtypes.
    for cfg in (CFG, dataclasses.replace(CFG, scan_layers=True)):
        model_def, params = _params(cfg)
        abstract = model_def.abstract_params
        assert jax.tree.structure(abstract) == jax.tree.structure(params)
        for want, got in zip(jax.tree.leaves(params), jax.tree.leaves(abstract)):
            assert (got.shape, got.dtype) == (want.shape, want.dtype)


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


def _stack_layers(params, n_layers):
    """The unrolled params in the scan_layers layout: blocks.<i>.<leaf> -> blocks.<leaf>[i]."""
    stacked = dict(params)
    stacked["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs), *[params["blocks"][i] for i in range(n_layers)])
    return stacked


def _loss_and_grads(model_def, params, tokens, key):
    def loss(p):
        return jnp.mean(model_def.forward(p, tokens, key) ** 2)

    return jax.jit(jax.value_and_grad(loss))(params)


def test_scanned_layers_and_remat_compute_the_same_function_and_remat_the_same_bits():
    """Four compiles: unrolled with/without remat, scanned with/without remat, same weights."""
    # Two layers, not more: the unrolled programs' compile time grows with the depth, and the claims
    # need only a scan that iterates (per-layer weights and dropout keys that must line up with the
    # unrolled blocks in order) and a remat count that tells one per block from one around the scan.
    n = 2
    scan_cfg = dataclasses.replace(CFG, n_layers=n, scan_layers=True)
    unrolled_cfg = dataclasses.replace(scan_cfg, scan_layers=False)
    unrolled_def, unrolled = _params(unrolled_cfg)
    scan_def = make_model_def(scan_cfg)
    assert scan_def.logical_axes["blocks"]["attn"]["wq"] == ("layers", "embed", "heads", "kv")
    assert scan_def.logical_axes["blocks"]["mlp_norm"]["scale"] == ("layers", "embed")
    scanned = _stack_layers(unrolled, n)
    abstract = jax.eval_shape(scan_def.init_params, jax.random.key(0))
    assert jax.tree.map(lambda x: x.shape, abstract) == jax.tree.map(lambda x: x.shape, scanned)
    assert abstract["blocks"]["mlp"]["w_up"].shape == (n, CFG.d_model, CFG.d_ff)
    tokens = jnp.arange(24, dtype=jnp.int32).reshape(2, 12)
    key = jax.random.key(3)  # dropout on: the per-layer keys must match too
    loss_u, grads_u = _loss_and_grads(unrolled_def, unrolled, tokens, key)
    loss_s, grads_s = _loss_and_grads(scan_def, scanned, tokens, key)
    np.testing.assert_allclose(float(loss_s), float(loss_u), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(_stack_layers(grads_u, n)), jax.tree.leaves(grads_s)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-7)
    for cfg, params, remat, (ref_loss, ref_grads), wrapped in (
        (unrolled_cfg, unrolled, "block", (loss_u, grads_u), n),  # one checkpoint per block call
        (scan_cfg, scanned, "save_dots", (loss_s, grads_s), 1),  # one around the scanned body
    ):
        remat_def = make_model_def(dataclasses.replace(cfg, remat=remat))
        jaxpr = str(jax.make_jaxpr(lambda p: remat_def.forward(p, tokens))(params))
        assert jaxpr.count("remat2[") == wrapped, remat  # the framework really wrapped the blocks
        loss, grads = _loss_and_grads(remat_def, params, tokens, key)
        assert float(loss) == float(ref_loss), remat
        for x, y in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_dot_product_attention_matches_the_explicit_form_and_stays_causal():
    cfg = dataclasses.replace(CFG, dropout=0.0)
    explicit_def, params = _params(cfg)
    fused_def = make_model_def(dataclasses.replace(cfg, attention="dot_product"))
    rs = np.random.RandomState(0)
    a = rs.randint(0, 256, (2, 12)).astype(np.int32)
    np.testing.assert_allclose(np.asarray(fused_def.forward(params, a)), np.asarray(explicit_def.forward(params, a)),
                               rtol=1e-5, atol=1e-5)
    b = a.copy()
    b[:, 8:] = (b[:, 8:] + 1) % 256
    np.testing.assert_array_equal(np.asarray(fused_def.forward(params, a)[:, :8]),
                                  np.asarray(fused_def.forward(params, b)[:, :8]))


def test_dot_product_attention_with_dropout_is_refused_naming_both_keys():
    with pytest.raises(ValueError, match="model.attention=dot_product.*model.dropout"):
        make_model_def(dataclasses.replace(CFG, attention="dot_product"))


@pytest.mark.parametrize("key,value", [("model.remat", "full"), ("model.attention", "flash"),
                                       ("model.scan_layers", "maybe")])
def test_an_unknown_block_stack_option_is_one_line_naming_the_key(key, value):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}={value}"])
    message = str(err.value)
    assert "\n" not in message and key in message and repr(value) in message


def test_importing_the_model_leaves_nnx_eager_sharding_as_the_user_set_it():
    # A fresh interpreter: this one has imported the model already.
    code = (
        "from flax import nnx\n"
        "nnx.use_eager_sharding(True)\n"
        "import resilient_jax.model, resilient_jax.state\n"
        "from resilient_jax.config import ModelConfig\n"
        "resilient_jax.state.make_model_def(ModelConfig())\n"
        "print(nnx.using_eager_sharding())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "True"


@pytest.mark.slow
def test_a_scanned_run_checkpoints_stacked_layers_the_reference_reader_reads(tmp_path, default_dataset):
    """runbooks/checkpoint-format.md, "Stacked layers": blocks.<leaf> with a leading [n_layers] dim."""
    from resilient_jax.checkpoint import reader
    from resilient_jax.trainer import Trainer

    from conftest import tiny_config

    cfg = tiny_config(tmp_path / "run", "model.scan_layers=true", "model.remat=save_dots", "train.steps=2",
                      "checkpoint.every_steps=2", "parallel.data=2")
    summary = Trainer(cfg, devices=jax.devices()[:2]).run()
    ckpt = reader.load(tmp_path / "run" / "checkpoints")  # verifies every checksum
    m = cfg.model
    assert ckpt.weights["blocks"]["attn"]["wq"].shape == (m.n_layers, m.d_model, m.n_heads, m.d_model // m.n_heads)
    assert ckpt.weights["blocks"]["mlp_norm"]["scale"].shape == (m.n_layers, m.d_model)
    assert "0" not in ckpt.weights["blocks"]
    assert ckpt.config["config"]["model"]["scan_layers"] is True
    assert ckpt.step == 2 and summary["final_step"] == 2


def test_prepare_layer_gathers_one_fsdp_sharded_layer_at_a_time_inside_the_scan():
    """The hook a ZeRO-3 step uses: blocks stay fsdp-sharded, each is all-gathered where it runs."""
    from jax.sharding import Mesh, PartitionSpec

    from resilient_jax import hlo_stats

    cfg = dataclasses.replace(CFG, n_layers=3, dropout=0.0, scan_layers=True, remat="save_dots")
    model_def, params = _params(cfg)
    mesh = Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
    # Shard every block parameter's "embed" dim over fsdp; the rest of the model stays replicated.
    embed_dim = jax.tree.map(lambda axes: axes.index("embed"), model_def.logical_axes["blocks"], is_leaf=is_axes)
    block_specs = jax.tree.map(lambda d: PartitionSpec(*([None] * d), "fsdp"), embed_dim)
    specs = {k: (block_specs if k == "blocks" else jax.tree.map(lambda _: PartitionSpec(), v)) for k, v in params.items()}
    layer_embed_dim = jax.tree.map(lambda axes: axes.index("embed"), model_def.layer_axes, is_leaf=is_axes)
    tokens = jnp.arange(24, dtype=jnp.int32).reshape(2, 12)

    def gather_layer(layer_params, _layer_input):
        return jax.tree.map(lambda w, d: jax.lax.all_gather(w, "fsdp", axis=d, tiled=True), layer_params,
                            layer_embed_dim)

    def loss(p):
        return jnp.mean(model_def.forward(p, tokens, prepare_layer=gather_layer) ** 2)

    sharded = jax.jit(jax.shard_map(jax.value_and_grad(loss), mesh=mesh, in_specs=(specs,),
                                    out_specs=(PartitionSpec(), specs), check_vma=False))
    value, grads = sharded(params)
    ref_value, ref_grads = _loss_and_grads(model_def, params, tokens, None)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-5)
    # The blocks' gradients come back fsdp-sharded: the gather's transpose is a reduce-scatter,
    # which sums every device's gradient -- here all 4 ran the same rows, so 4x the unsharded one.
    for a, b in zip(jax.tree.leaves(ref_grads["blocks"]), jax.tree.leaves(grads["blocks"])):
        np.testing.assert_allclose(np.asarray(b), 4 * np.asarray(a), rtol=1e-4, atol=1e-7)
    stats = hlo_stats.analyze(sharded.lower(params).compile().as_text(), num_devices=4)
    leaves = len(jax.tree.leaves(params["blocks"]))
    # Gathered per layer and per pass: at least one all-gather per block leaf per layer.
    assert stats.collective_count.get("all-gather", 0) >= leaves * cfg.n_layers


def test_every_activation_the_model_constrains_names_one_known_logical_axis_per_dim():
    """The model names its activations' dims (resilient_jax.activations) so the step can pin them to
    the mesh (tensor parallelism); outside a rule the call changes nothing."""
    from resilient_jax import activations
    from resilient_jax.mesh import LOGICAL_RULES

    model_def, params = _params()
    tokens = jnp.zeros((2, 6), jnp.int32)
    seen = []

    def record(x, names):
        seen.append((x.shape, tuple(names)))
        return x

    with activations.rule(record):
        logits = model_def.forward(params, tokens)
    assert len(seen) >= 4 * CFG.n_layers  # q, k, v, attention out, scores, mlp hidden... per block
    for shape, names in seen:
        assert len(names) == len(shape) and all(n in LOGICAL_RULES for n in names), (shape, names)
    assert ((2, 6, CFG.vocab_size), ("batch", "length", "vocab")) in seen
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(model_def.forward(params, tokens)))


def test_chunked_attention_is_the_explicit_math_block_by_block_and_stays_causal():
    cfg = dataclasses.replace(CFG, dropout=0.0)
    explicit_def, params = _params(cfg)
    # 12 rows in blocks of 4: three blocks, each attending over all 12 keys under the causal mask.
    chunked_def = make_model_def(dataclasses.replace(cfg, attention="chunked", attention_chunk=4))
    rs = np.random.RandomState(0)
    a = rs.randint(0, 256, (2, 12)).astype(np.int32)
    np.testing.assert_allclose(np.asarray(chunked_def.forward(params, a)), np.asarray(explicit_def.forward(params, a)),
                               rtol=1e-5, atol=1e-5)
    b = a.copy()
    b[:, 6:] = (b[:, 6:] + 1) % 256  # a change inside the second block must not reach rows before it
    np.testing.assert_array_equal(np.asarray(chunked_def.forward(params, a)[:, :6]),
                                  np.asarray(chunked_def.forward(params, b)[:, :6]))
    # Gradients agree with the explicit form's too (each block is recomputed in the backward pass).
    def loss(model_def, p):
        return jnp.sum(model_def.forward(p, a) ** 2)

    for x, y in zip(jax.tree.leaves(jax.jit(jax.grad(lambda p: loss(explicit_def, p)))(params)),
                    jax.tree.leaves(jax.jit(jax.grad(lambda p: loss(chunked_def, p)))(params))):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=2e-4, atol=2e-4)


def test_chunked_attention_holds_one_blocks_scores_not_the_whole_square():
    # Compiled memory, forward + backward of one 1024-token sequence: the explicit form keeps
    # [h, L, L] float32 scores (4 heads x 1024^2 x 4 B = 16 MiB per buffer, several live); the
    # chunked form one [h, 128, L] block at a time (2 MiB). XLA's own memory analysis, no timing.
    cfg = dataclasses.replace(CFG, dropout=0.0, remat="block")
    temps = {}
    for attention in ("explicit", "chunked"):
        model_def = make_model_def(dataclasses.replace(cfg, attention=attention, attention_chunk=128))
        params = jax.eval_shape(model_def.init_params, jax.random.key(0))
        tokens = jax.ShapeDtypeStruct((1, 1024), jnp.int32)
        grad = jax.jit(jax.grad(lambda p, t: jnp.sum(model_def.forward(p, t))))
        temps[attention] = grad.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes
    square = 4 * 1024 * 1024 * 4
    assert temps["explicit"] > 2 * square, temps
    assert temps["chunked"] < temps["explicit"] - 2 * square, temps


def test_an_attention_chunk_that_does_not_divide_the_sequence_is_one_line_naming_the_key():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.attention=chunked", "data.seq_len=96", "model.attention_chunk=64"])
    message = str(err.value)
    assert "\n" not in message and "model.attention_chunk" in message and "data.seq_len (96)" in message
    # A multiple, or a chunk at least the sequence (one block), is fine.
    load_config(None, ["model.attention=chunked", "data.seq_len=128", "model.attention_chunk=64"])
    load_config(None, ["model.attention=chunked", "data.seq_len=96", "model.attention_chunk=128"])
