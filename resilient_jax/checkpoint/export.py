"""`python -m resilient_jax.checkpoint export STEP_DIR --format safetensors --out DIR`.

Writes a checkpoint's weights as `DIR/model.safetensors` and a `DIR/config.json`, read with the
framework-free reader (numpy + tensorstore; no JAX, no model build). The built-in TransformerLM
is written in the Hugging Face Llama layout, so `transformers.LlamaForCausalLM.from_pretrained(DIR)`
loads it and computes the same logits (scripts/check_hf_export.py measures that):

    ours (checkpoint weights)                 Hugging Face Llama               layout change
    embed            [V, D]                   model.embed_tokens.weight         -
    blocks.i.attn_norm.scale [D]              model.layers.i.input_layernorm.weight
    blocks.i.attn.wq|wk|wv [D, H, K]          ...self_attn.{q,k,v}_proj.weight  reshape [D, H*K], transpose
    blocks.i.attn.wo [H, K, D]                ...self_attn.o_proj.weight        reshape [H*K, D], transpose
    blocks.i.mlp_norm.scale [D]               ...post_attention_layernorm.weight
    blocks.i.mlp.w_gate|w_up [D, F]           ...mlp.{gate,up}_proj.weight      transpose
    blocks.i.mlp.w_down [F, D]                ...mlp.down_proj.weight           transpose
    final_norm.scale [D]                      model.norm.weight
    unembed [D, V]                            lm_head.weight                    transpose

A torch Linear stores [out, in] and computes x @ W.T, hence the transposes; flattening (H, K) in
C order puts head h at rows h*K..h*K+K-1, which is how Llama's attention splits q_proj's output
into heads. No permutation of q/k rows is needed: our rotary is the split-halves convention
(the first half of each head's dims paired with the second half, frequencies base**(-2i/K)),
which is exactly Llama's `rotate_half` over `cat(freqs, freqs)`; the permutation in Hugging
Face's Meta-Llama converter exists only to turn Meta's interleaved pairs into split halves.

Both block layouts are read from the checkpoint's own tree: unrolled (`blocks.<i>.attn.wq`) and
stacked by `model.scan_layers` (`blocks.attn.wq` with a leading [n_layers] dim). Weights of any
other model are written under their dotted checkpoint names, with the checkpoint's model config.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from resilient_jax.checkpoint import reader
from resilient_jax.config import BUILTIN_MODEL

FORMATS = ("safetensors",)
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# resilient_jax.model.RMSNorm's eps (not a config key); tests/test_export.py checks they agree.
RMS_NORM_EPS = 1e-6

_BLOCK_PARAMS = {"attn": {"wq", "wk", "wv", "wo"}, "attn_norm": {"scale"}, "mlp": {"w_gate", "w_up", "w_down"},
                 "mlp_norm": {"scale"}}
_LM_TOP = {"embed", "blocks", "final_norm", "unembed"}


class ExportError(ValueError):
    """Bad export input; the message is one line saying what to fix."""


@dataclass(frozen=True)
class Export:
    out_dir: Path
    step: int
    layout: str  # "llama" or "generic"
    tensors: int
    bytes: int


# -- the mapping (pure functions of the weights tree) -------------------------------------------------


def _block_keys(tree: Any) -> dict[str, set[str]] | None:
    if not isinstance(tree, dict) or not all(isinstance(v, dict) for v in tree.values()):
        return None
    return {k: set(v) for k, v in tree.items()}


def block_layers(blocks: dict[str, Any]) -> list[dict[str, dict[str, np.ndarray]]] | None:
    """Per-layer parameter dicts of the built-in LM's blocks, unrolled or stacked; None if not its blocks."""
    if _block_keys(blocks) == _BLOCK_PARAMS:  # stacked: layer i is index i of every array's leading dim
        n_layers = blocks["attn"]["wq"].shape[0]
        return [{m: {p: a[i] for p, a in params.items()} for m, params in blocks.items()} for i in range(n_layers)]
    if blocks and set(blocks) == {str(i) for i in range(len(blocks))}:
        layers = [blocks[str(i)] for i in range(len(blocks))]
        if all(_block_keys(layer) == _BLOCK_PARAMS for layer in layers):
            return layers
    return None


def is_builtin_lm(weights: dict[str, Any]) -> bool:
    return set(weights) == _LM_TOP and block_layers(weights["blocks"]) is not None


def _linear(w_in_out: np.ndarray) -> np.ndarray:
    """[in..., out...] as ours stores it -> torch Linear's [out, in] (in = the first dim)."""
    return np.ascontiguousarray(w_in_out.reshape(w_in_out.shape[0], -1).T)


def llama_tensors(weights: dict[str, Any]) -> dict[str, np.ndarray]:
    """The built-in LM's weights under Hugging Face Llama names and layouts (see the module docstring)."""
    out = {"model.embed_tokens.weight": np.ascontiguousarray(weights["embed"])}
    for i, layer in enumerate(block_layers(weights["blocks"])):
        p = f"model.layers.{i}."
        attn, mlp = layer["attn"], layer["mlp"]
        out[p + "input_layernorm.weight"] = np.ascontiguousarray(layer["attn_norm"]["scale"])
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj")):
            out[p + f"self_attn.{theirs}.weight"] = _linear(attn[ours])  # [D, H, K] -> [H*K, D]
        wo = attn["wo"]  # [H, K, D] -> [D, H*K]
        out[p + "self_attn.o_proj.weight"] = _linear(wo.reshape(-1, wo.shape[-1]))
        out[p + "post_attention_layernorm.weight"] = np.ascontiguousarray(layer["mlp_norm"]["scale"])
        out[p + "mlp.gate_proj.weight"] = _linear(mlp["w_gate"])
        out[p + "mlp.up_proj.weight"] = _linear(mlp["w_up"])
        out[p + "mlp.down_proj.weight"] = _linear(mlp["w_down"])
    out["model.norm.weight"] = np.ascontiguousarray(weights["final_norm"]["scale"])
    out["lm_head.weight"] = _linear(weights["unembed"])
    return out


def llama_config(weights: dict[str, Any], run_config: dict[str, Any]) -> dict[str, Any]:
    """A LlamaConfig for the built-in LM: sizes from the weights' shapes, rotary base from the run's config."""
    layers = block_layers(weights["blocks"])
    d_model, n_heads, head_dim = layers[0]["attn"]["wq"].shape
    rope_theta = float(run_config["model"]["rope_base"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(weights["embed"].shape[0]),
        "hidden_size": int(d_model),
        "intermediate_size": int(layers[0]["mlp"]["w_gate"].shape[1]),
        "num_hidden_layers": len(layers),
        "num_attention_heads": int(n_heads),
        "num_key_value_heads": int(n_heads),
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "rms_norm_eps": RMS_NORM_EPS,
        # transformers >= 5 reads rope_parameters; earlier releases read rope_theta.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        # Rotary positions have no table, so any length runs; this is the length the run trained on.
        "max_position_embeddings": int(run_config["data"]["seq_len"]),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        # The byte tokenizer has no special tokens (Llama's defaults, 1 and 2, would name two bytes).
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": str(weights["embed"].dtype),
    }


def export_tensors(weights: dict[str, Any], run_config: dict[str, Any]) -> tuple[str, dict[str, np.ndarray], dict]:
    """(layout, tensors, config.json contents) for a checkpoint's weights tree and run config. Llama
    only for the built-in model: a model of your own may share its parameter names (one built from
    TransformerLM does) but not its settings, which config.json would take from the built-in's keys."""
    if run_config.get("model", {}).get("factory", BUILTIN_MODEL) == BUILTIN_MODEL and is_builtin_lm(weights):
        return "llama", llama_tensors(weights), llama_config(weights, run_config)
    tensors = {name: np.ascontiguousarray(a) for name, a in reader.flatten(weights).items()}
    return "generic", tensors, {"format": "resilient_jax", "model": run_config.get("model", {})}


# -- writing -------------------------------------------------------------------------------------------------


def _check_out(out_dir: Path) -> None:
    here = Path.cwd().resolve()
    if out_dir.resolve() in (here, *here.parents):  # the export is renamed over it: the shell would sit nowhere
        raise ExportError(f"--out {out_dir} is the current directory (or holds it), which the export would "
                          f"replace: name a new directory, e.g. --out {out_dir / 'export'}")
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"--out {out_dir} is a file: name a new or empty directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise ExportError(f"--out {out_dir} already exists and is not empty: name a new or empty directory "
                          "(nothing was written)")


def _check_outside(out_dir: Path, step_dir: Path) -> None:
    """`out_dir` adds nothing to the checkpoint it exports: not inside its step directory, not a step name in its root."""
    out, step_dir = out_dir.resolve(), step_dir.resolve()
    inside = step_dir in out.parents
    if inside or (out.parent == step_dir.parent and out.name.isdigit()):
        raise ExportError(f"--out {out_dir} is {'inside the checkpoint' if inside else 'a step name in its root'} "
                          f"{step_dir}, which must hold only what its save wrote: export next to it instead")


def export(path: str | Path, out_dir: str | Path, fmt: str = "safetensors") -> Export:
    """Export a step directory (or a checkpoint root's newest step) into `out_dir`, all or nothing."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r} is not supported (supported: {', '.join(FORMATS)})")
    out_dir = Path(out_dir).absolute()
    _check_out(out_dir)
    ckpt = reader.load(path)  # every checksum verified; raises CheckpointError naming the field
    _check_outside(out_dir, ckpt.path)
    layout, tensors, config = export_tensors(ckpt.weights, ckpt.config["config"])
    metadata = {"format": "pt", "resilient_jax_step": str(ckpt.step),
                "resilient_jax_config_hash": ckpt.config["hash"],
                "resilient_jax_commit": str(ckpt.provenance["commit"]), "resilient_jax_layout": layout}
    # Written beside the target and renamed into place, so a failed export leaves no half directory.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.export-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata=metadata)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        shutil.copymode(tmp / CONFIG_FILE, tmp / WEIGHTS_FILE)  # save_file creates it 0600; use the umask's mode
        if out_dir.is_dir():
            out_dir.rmdir()  # empty (checked above)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Export(out_dir=out_dir, step=ckpt.step, layout=layout, tensors=len(tensors),
                  bytes=sum(int(a.nbytes) for a in tensors.values()))


def cmd_export(path: str, fmt: str, out: str) -> int:
    result = export(path, out, fmt)
    what = "Hugging Face Llama layout" if result.layout == "llama" else "checkpoint names"
    print(f"ok: step {result.step} -> {result.out_dir}: {WEIGHTS_FILE} ({result.tensors} tensors, "
          f"{result.bytes} bytes, {what}) and {CONFIG_FILE}")
    return 0
