"""`checkpoint export --format safetensors`: names, shapes, values, and logits through a Llama forward.

A tiny run (2 steps, one checkpoint) is exported; the file is read back with
`safetensors.numpy.load_file`. `llama_forward` below is the Hugging Face LlamaForCausalLM forward
(modeling_llama.py: LlamaRMSNorm, rotate_half rotary over cat(freqs, freqs), causal softmax
attention, down(silu(gate) * up)) written in numpy over the exported tensors; its logits equal our
model's, which proves the layout without torch. scripts/check_hf_export.py runs transformers itself.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import run_cli, tiny_config
from resilient_jax.checkpoint import export as export_lib
from resilient_jax.checkpoint import reader
from resilient_jax.config import ModelConfig


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from resilient_jax.trainer import Trainer

    run_dir = tmp_path_factory.mktemp("export") / "run"
    cfg = tiny_config(run_dir, "train.steps=2", "checkpoint.every_steps=2", "checkpoint.keep_last=0")
    Trainer(cfg).run()
    return run_dir / "checkpoints" / "2", cfg


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    step_dir, _ = trained
    out = tmp_path_factory.mktemp("hf") / "tiny-llama"
    proc = run_cli("resilient_jax.checkpoint", "export", str(step_dir), "--format", "safetensors", "--out", str(out),
                   check=True)
    assert proc.stdout.startswith(f"ok: step 2 -> {out}") and "Hugging Face Llama layout" in proc.stdout
    return out, load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())


def documented_shapes(n_layers: int, d: int, heads: int, head_dim: int, ff: int, vocab: int) -> dict[str, tuple]:
    """The mapping in export.py's docstring (and the README), as names -> [out, in] shapes."""
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,), "lm_head.weight": (vocab, d)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (heads * head_dim, d),
                       p + "self_attn.k_proj.weight": (heads * head_dim, d),
                       p + "self_attn.v_proj.weight": (heads * head_dim, d),
                       p + "self_attn.o_proj.weight": (d, heads * head_dim),
                       p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
                       p + "mlp.down_proj.weight": (d, ff)})
    return shapes


def llama_forward(t: dict[str, np.ndarray], cfg: dict, tokens_BxL: np.ndarray) -> np.ndarray:
    """Hugging Face Llama's forward, in float32 numpy, on Hugging Face names and [out, in] weights."""
    heads, head_dim, eps = cfg["num_attention_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    batch, seq_len = tokens_BxL.shape

    def rms_norm(x, w):
        return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))

    def linear(x, w):
        return x @ w.T

    def rotate_half(x):
        x1, x2 = np.split(x, 2, axis=-1)
        return np.concatenate([-x2, x1], axis=-1)

    inv_freq = 1.0 / cfg["rope_parameters"]["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    freqs = np.arange(seq_len, dtype=np.float32)[:, None] * inv_freq[None, :].astype(np.float32)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    mask = np.triu(np.full((seq_len, seq_len), -np.inf, np.float32), k=1)

    def split_heads(x):  # [B, L, H*K] -> [B, H, L, K]
        return x.reshape(batch, seq_len, heads, head_dim).transpose(0, 2, 1, 3)

    x = t["model.embed_tokens.weight"][tokens_BxL]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, t[p + "input_layernorm.weight"])
        q, k, v = (split_heads(linear(h, t[p + f"self_attn.{n}_proj.weight"])) for n in "qkv")
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        scores = q @ k.transpose(0, 1, 3, 2) * head_dim ** -0.5 + mask
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, seq_len, heads * head_dim)
        x = x + linear(attn, t[p + "self_attn.o_proj.weight"])
        h = rms_norm(x, t[p + "post_attention_layernorm.weight"])
        gate = linear(h, t[p + "mlp.gate_proj.weight"])
        x = x + linear(gate / (1 + np.exp(-gate)) * linear(h, t[p + "mlp.up_proj.weight"]),
                       t[p + "mlp.down_proj.weight"])
    return linear(rms_norm(x, t["model.norm.weight"]), t["lm_head.weight"])


def test_names_shapes_and_config_follow_the_llama_mapping(trained, exported):
    _, cfg = trained
    out, tensors, hf_config = exported
    m = cfg.model
    expected = documented_shapes(m.n_layers, m.d_model, m.n_heads, m.d_model // m.n_heads, m.d_ff, m.vocab_size)
    assert {name: a.shape for name, a in tensors.items()} == expected
    assert all(a.dtype == np.float32 for a in tensors.values())
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert hf_config["architectures"] == ["LlamaForCausalLM"] and hf_config["tie_word_embeddings"] is False
    assert {k: hf_config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                      "num_key_value_heads", "num_hidden_layers", "vocab_size",
                                      "max_position_embeddings")} == {
        "hidden_size": m.d_model, "intermediate_size": m.d_ff, "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_heads, "num_hidden_layers": m.n_layers, "vocab_size": m.vocab_size,
        "max_position_embeddings": cfg.data.seq_len}
    assert hf_config["rope_theta"] == hf_config["rope_parameters"]["rope_theta"] == m.rope_base
    assert hf_config["rms_norm_eps"] == 1e-6


def test_values_are_the_checkpoints_rearranged(trained, exported):
    step_dir, cfg = trained
    _, tensors, _ = exported
    w = reader.load(step_dir).weights
    d, heads = cfg.model.d_model, cfg.model.n_heads
    assert np.array_equal(tensors["model.embed_tokens.weight"], w["embed"])
    assert np.array_equal(tensors["lm_head.weight"], w["unembed"].T)
    assert np.array_equal(tensors["model.norm.weight"], w["final_norm"]["scale"])
    for i in range(cfg.model.n_layers):
        p, b = f"model.layers.{i}.", w["blocks"][str(i)]
        q = tensors[p + "self_attn.q_proj.weight"]
        for h in range(heads):  # head h is the h-th block of K rows: how Llama splits q_proj's output
            rows = q[h * (d // heads):(h + 1) * (d // heads)]
            assert np.array_equal(rows, b["attn"]["wq"][:, h, :].T)
        assert np.array_equal(tensors[p + "self_attn.o_proj.weight"], b["attn"]["wo"].reshape(d, d).T)
        assert np.array_equal(tensors[p + "mlp.down_proj.weight"], b["mlp"]["w_down"].T)
        assert np.array_equal(tensors[p + "input_layernorm.weight"], b["attn_norm"]["scale"])
        assert np.array_equal(tensors[p + "post_attention_layernorm.weight"], b["mlp_norm"]["scale"])


def test_llama_forward_on_the_export_gives_our_models_logits(trained, exported):
    from resilient_jax.state import make_model_def

    step_dir, cfg = trained
    _, tensors, hf_config = exported
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, size=(3, cfg.data.seq_len), dtype=np.int32)
    ours = np.asarray(make_model_def(cfg.model).forward(reader.load(step_dir).weights, tokens))
    theirs = llama_forward(tensors, hf_config, tokens)
    assert ours.shape == theirs.shape == (3, cfg.data.seq_len, cfg.model.vocab_size)
    assert np.abs(ours - theirs).max() < 1e-5, np.abs(ours - theirs).max()
    # Not a vacuous match: a wrongly laid-out q_proj (heads interleaved) changes the logits.
    swapped = dict(tensors)
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    swapped["model.layers.0.self_attn.q_proj.weight"] = q.reshape(-1, cfg.model.n_heads, q.shape[1]).transpose(
        1, 0, 2).reshape(q.shape)
    assert np.abs(ours - llama_forward(swapped, hf_config, tokens)).max() > 1e-3


def test_our_rotary_is_llamas_rotate_half_per_head():
    """Split halves with frequencies base**(-2i/K): Llama's rotate_half, so no q/k permutation."""
    import jax.numpy as jnp

    from resilient_jax.model import rotary

    batch, seq_len, heads, head_dim, base = 2, 9, 3, 8, 10000.0
    x = np.random.default_rng(1).standard_normal((batch, seq_len, heads, head_dim)).astype(np.float32)
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    emb = np.concatenate([np.outer(np.arange(seq_len), inv_freq)] * 2, axis=-1)[None, :, None, :]
    half = head_dim // 2
    llama = x * np.cos(emb) + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * np.sin(emb)
    np.testing.assert_allclose(np.asarray(rotary(jnp.asarray(x), base)), llama, atol=1e-5)


def test_stacked_layers_export_the_same_tensors(trained):
    """A scan_layers checkpoint (blocks.attn.wq: [n_layers, D, H, K]) maps to the same Llama tensors."""
    step_dir, cfg = trained
    ckpt = reader.load(step_dir)
    unrolled = ckpt.weights
    layers = [unrolled["blocks"][str(i)] for i in range(cfg.model.n_layers)]
    stacked = {**unrolled, "blocks": {m: {p: np.stack([layer[m][p] for layer in layers]) for p in params}
                                      for m, params in layers[0].items()}}
    m = cfg.model
    assert stacked["blocks"]["attn"]["wq"].shape == (m.n_layers, m.d_model, m.n_heads, m.d_model // m.n_heads)
    layout_a, a, config_a = export_lib.export_tensors(unrolled, ckpt.config["config"])
    layout_b, b, config_b = export_lib.export_tensors(stacked, ckpt.config["config"])
    assert layout_a == layout_b == "llama" and config_a == config_b
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.skipif("scan_layers" not in {f.name for f in dataclasses.fields(ModelConfig)},
                    reason="model.scan_layers is not in this tree yet (branch h5-scale adds it)")
def test_a_scanned_runs_checkpoint_exports_to_the_same_logits(tmp_path):
    from resilient_jax.state import make_model_def
    from resilient_jax.trainer import Trainer

    cfg = tiny_config(tmp_path / "run", "train.steps=1", "checkpoint.every_steps=1", "model.scan_layers=true")
    Trainer(cfg).run()
    step_dir = tmp_path / "run" / "checkpoints" / "1"
    weights = reader.load(step_dir).weights
    assert weights["blocks"]["attn"]["wq"].shape[0] == cfg.model.n_layers  # stacked on disk
    assert export_lib.export(step_dir, tmp_path / "hf").layout == "llama"
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    tokens = np.random.default_rng(2).integers(0, cfg.model.vocab_size, size=(2, cfg.data.seq_len), dtype=np.int32)
    ours = np.asarray(make_model_def(cfg.model).forward(weights, tokens))
    assert np.abs(ours - llama_forward(tensors, hf_config, tokens)).max() < 1e-5


def test_another_models_weights_keep_their_checkpoint_names():
    weights = {"encoder": {"w": np.ones((2, 3), np.float32)}, "head": np.zeros((3,), np.float32)}
    layout, tensors, config = export_lib.export_tensors(weights, {"model": {"d_model": 3}})
    assert layout == "generic" and sorted(tensors) == ["encoder.w", "head"]
    assert config == {"format": "resilient_jax", "model": {"d_model": 3}}


def test_a_model_of_your_own_with_the_builtins_parameter_names_keeps_its_checkpoint_names(trained):
    # Built from TransformerLM, with settings config.json would take from the built-in's keys.
    step_dir, _ = trained
    ckpt = reader.load(step_dir)
    run_config = {**ckpt.config["config"], "model": {**ckpt.config["config"]["model"], "factory": "my_lm:build"}}
    layout, tensors, config = export_lib.export_tensors(ckpt.weights, run_config)
    assert layout == "generic" and "embed" in tensors and config["model"]["factory"] == "my_lm:build"
    assert export_lib.export_tensors(ckpt.weights, ckpt.config["config"])[0] == "llama"


def test_rms_norm_eps_is_the_models():
    import inspect

    from resilient_jax.model import RMSNorm

    assert inspect.signature(RMSNorm.__init__).parameters["eps"].default == export_lib.RMS_NORM_EPS


def _export_cli(*args):
    proc = run_cli("resilient_jax.checkpoint", "export", *args)
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: "), proc.stderr
    return proc.stderr


def test_bad_input_is_one_line_and_writes_nothing(trained, tmp_path):
    step_dir, _ = trained
    not_a_checkpoint = tmp_path / "notes"
    not_a_checkpoint.mkdir()
    (not_a_checkpoint / "readme.txt").write_text("hello")
    line = _export_cli(str(not_a_checkpoint), "--out", str(tmp_path / "a"))
    assert str(not_a_checkpoint) in line and "no committed checkpoint" in line
    empty_step = tmp_path / "7"
    empty_step.mkdir()
    line = _export_cli(str(empty_step), "--out", str(tmp_path / "b"))
    assert str(empty_step) in line and "is missing" in line  # the reader names the first absent file
    line = _export_cli(str(step_dir), "--format", "gguf", "--out", str(tmp_path / "c"))
    assert "--format 'gguf' is not supported (supported: safetensors)" in line
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "mine.txt").write_text("keep me")
    line = _export_cli(str(step_dir), "--out", str(busy))
    assert f"--out {busy} already exists and is not empty" in line
    assert [p.name for p in busy.iterdir()] == ["mine.txt"] and (busy / "mine.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["7", "busy", "notes"]  # no out dir, no temp dir


def test_an_out_inside_the_checkpoint_or_at_the_current_directory_is_refused(trained, tmp_path, monkeypatch):
    step_dir, _ = trained
    for out, problem in ((step_dir / "hf", "is inside the checkpoint"),
                         (step_dir.parent / "9", "is a step name in its root")):
        line = _export_cli(str(step_dir), "--out", str(out))
        assert f"--out {out} {problem} {step_dir.resolve()}" in line and not out.exists(), line
    assert reader.verify(step_dir) == []
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    with pytest.raises(export_lib.ExportError, match="is the current directory .*e.g. --out"):
        export_lib.export(step_dir, ".")
    assert list(here.iterdir()) == [] and Path.cwd() == here


def test_export_into_an_empty_directory(trained, tmp_path):
    step_dir, _ = trained
    out = tmp_path / "empty"
    out.mkdir()
    result = export_lib.export(step_dir, out)
    assert result.layout == "llama" and result.step == 2
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]
