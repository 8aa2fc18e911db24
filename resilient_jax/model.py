"""Decoder-only transformer LM in Flax NNX: RMSNorm, rotary positions, causal attention, gated MLP.

Parameters carry logical axis names ("vocab", "embed", "heads", "kv", "mlp", and "layers" for the
stacked blocks of `scan_layers`) as metadata, and activations name theirs the same way
(`constrain`, with "batch", "length" and "kv_length" too); how those map to mesh axes is decided in
resilient_jax.mesh, never here. Dropout takes an explicit key, so a forward pass is a pure function
of (params, tokens, key).

How the block stack runs is configuration, not model math: `remat` wraps each block call in
jax.checkpoint (nnx.remat) with the chosen policy, and `scan_layers` builds the blocks once with
stacked parameters (nnx.vmap) and runs them with one nnx.scan, so compile time does not grow with
depth. Variables are created with their logical names as metadata, never sharded at creation:
the caller builds modules under `nnx.use_eager_sharding(False)` (resilient_jax.state does), and the
state is born sharded by `jit(init, out_shardings=...)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from resilient_jax.activations import constrain
from resilient_jax.config import ModelConfig

# remat name -> jax.checkpoint policy (None = save nothing but the block's inputs).
# dots_with_no_batch_dims_saveable keeps the weight matmuls (x @ W has no batch dims) and drops
# the attention einsums (batched over b, h), so the [b, h, L, L] scores are recomputed, not stored.
REMAT_POLICIES = {
    "block": None,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
LAYERS_AXIS = "layers"

_init_dense = nnx.initializers.normal(stddev=0.02)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], init=_init_dense) -> nnx.Param:
    return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=axes)


def _dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x * (1.0 / (1.0 - rate)), 0.0).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs, eps: float = 1e-6):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), out_sharding=("embed",))
        self.eps = eps

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        x32 = x_BxLxD.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...]).astype(x_BxLxD.dtype)


def rotary(x_BxLxHxK: jax.Array, base: float) -> jax.Array:
    """Rotary position embedding over the last dim (split-halves convention)."""
    seq_len, head_dim = x_BxLxHxK.shape[1], x_BxLxHxK.shape[-1]
    half = head_dim // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles_LxK = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * freqs[None, :]
    sin = jnp.sin(angles_LxK)[None, :, None, :]
    cos = jnp.cos(angles_LxK)[None, :, None, :]
    x1, x2 = x_BxLxHxK[..., :half].astype(jnp.float32), x_BxLxHxK[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxK.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        head_dim = cfg.d_model // cfg.n_heads
        self.wq = _param(rngs, (cfg.d_model, cfg.n_heads, head_dim), ("embed", "heads", "kv"))
        self.wk = _param(rngs, (cfg.d_model, cfg.n_heads, head_dim), ("embed", "heads", "kv"))
        self.wv = _param(rngs, (cfg.d_model, cfg.n_heads, head_dim), ("embed", "heads", "kv"))
        self.wo = _param(rngs, (cfg.n_heads, head_dim, cfg.d_model), ("heads", "kv", "embed"))
        self.rope_base = cfg.rope_base
        self.dropout = cfg.dropout
        self.attention = cfg.attention
        self.attention_chunk = cfg.attention_chunk

    def __call__(self, x_BxLxD: jax.Array, key: jax.Array | None) -> jax.Array:
        dtype, heads = x_BxLxD.dtype, ("batch", "length", "heads", "kv")
        q = constrain(rotary(jnp.einsum("bld,dhk->blhk", x_BxLxD, self.wq[...].astype(dtype)), self.rope_base), heads)
        k = constrain(rotary(jnp.einsum("bld,dhk->blhk", x_BxLxD, self.wk[...].astype(dtype)), self.rope_base), heads)
        v = constrain(jnp.einsum("bld,dhk->blhk", x_BxLxD, self.wv[...].astype(dtype)), heads)
        if self.attention == "dot_product":
            # XLA's softmax attention on CPU, cuDNN's fused flash attention on GPU where it applies.
            out_BxLxHxK = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        elif self.attention == "chunked":
            out_BxLxHxK = self._chunked_attention(q, k, v, key)
        else:
            out_BxLxHxK = self._explicit_attention(q, k, v, key)
        out_BxLxHxK = constrain(out_BxLxHxK, heads)
        return constrain(jnp.einsum("blhk,hkd->bld", out_BxLxHxK, self.wo[...].astype(dtype)), ("batch", "length", "embed"))

    def _explicit_attention(self, q, k, v, key, first_row=0):
        """Causal softmax attention of the query rows q (rows first_row.. of the sequence) over all
        of k, v."""
        dtype, rows, seq_len = q.dtype, q.shape[1], k.shape[1]
        scores_BxHxQxL = jnp.einsum("bqhk,bshk->bhqs", q, k).astype(jnp.float32) * (q.shape[-1] ** -0.5)
        scores_BxHxQxL = constrain(scores_BxHxQxL, ("batch", "heads", "length", "kv_length"))
        causal = (first_row + jnp.arange(rows))[:, None] >= jnp.arange(seq_len)[None, :]
        scores_BxHxQxL = jnp.where(causal, scores_BxHxQxL, jnp.finfo(jnp.float32).min)
        # exp(x - logsumexp) rather than jax.nn.softmax's exp / sum: XLA rewrites the backward
        # division differently in single- and multi-device programs, which changed the bits.
        lse = jax.nn.logsumexp(scores_BxHxQxL, axis=-1, keepdims=True)
        probs = jnp.exp(scores_BxHxQxL - lse).astype(dtype)
        probs = _dropout(probs, self.dropout, key)
        return jnp.einsum("bhqs,bshk->bqhk", probs, v)

    def _chunked_attention(self, q, k, v, key):
        """The explicit form over blocks of `attention_chunk` query rows, one after another (a
        lax.map), each block under jax.checkpoint: only one block's [b, h, chunk, L] scores are ever
        live, in the forward and the backward pass. Block i's dropout key is fold_in(key, i)."""
        B, L, H, K = q.shape
        chunk = min(self.attention_chunk, L)
        if L % chunk:
            raise ValueError(f"model.attention_chunk ({chunk}) must divide the sequence length ({L})")
        n = L // chunk
        q_NxBxCxHxK = jnp.moveaxis(q.reshape(B, n, chunk, H, K), 1, 0)
        # Every block reads all of k and v, so their gradients are summed over the blocks in the
        # backward pass, in the dtype the loop closes over: float32 (exact round trip for bf16
        # values), so that sum is not rounded to bf16 block by block.
        k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)

        @jax.checkpoint
        def block(args):
            i, q_BxCxHxK = args
            block_key = None if key is None else jax.random.fold_in(key, i)
            return self._explicit_attention(q_BxCxHxK, k32.astype(k.dtype), v32.astype(v.dtype), block_key,
                                            first_row=i * chunk)

        out_NxBxCxHxK = jax.lax.map(block, (jnp.arange(n, dtype=jnp.int32), q_NxBxCxHxK))
        return jnp.moveaxis(out_NxBxCxHxK, 0, 1).reshape(B, L, H, K)


class GatedMLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.w_gate = _param(rngs, (cfg.d_model, cfg.d_ff), ("embed", "mlp"))
        self.w_up = _param(rngs, (cfg.d_model, cfg.d_ff), ("embed", "mlp"))
        self.w_down = _param(rngs, (cfg.d_ff, cfg.d_model), ("mlp", "embed"))

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        dtype, hidden = x_BxLxD.dtype, ("batch", "length", "mlp")
        gate = jax.nn.silu(constrain(x_BxLxD @ self.w_gate[...].astype(dtype), hidden))
        up = constrain(x_BxLxD @ self.w_up[...].astype(dtype), hidden)
        return constrain((gate * up) @ self.w_down[...].astype(dtype), ("batch", "length", "embed"))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, rngs=rngs)
        self.mlp = GatedMLP(cfg, rngs=rngs)
        self.dropout = cfg.dropout

    def __call__(self, x_BxLxD: jax.Array, key: jax.Array | None) -> jax.Array:
        attn_key = resid_key = mlp_key = None
        if key is not None:
            attn_key, resid_key, mlp_key = (jax.random.fold_in(key, i) for i in range(3))
        x_BxLxD = x_BxLxD + _dropout(self.attn(self.attn_norm(x_BxLxD), attn_key), self.dropout, resid_key)
        return x_BxLxD + _dropout(self.mlp(self.mlp_norm(x_BxLxD)), self.dropout, mlp_key)


def _with_params(block: Block, prepare_layer, layer_input) -> Block:
    """The block with `prepare_layer(params, layer_input)` applied to its parameters (a pure dict of
    one layer's arrays)."""
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)
    pure = prepare_layer(nnx.to_pure_dict(params), layer_input)
    nnx.replace_by_pure_dict(params, pure)
    return nnx.merge(graphdef, params, rest)


class TransformerLM(nnx.Module):
    # Params the model only ever uses as `w.astype(self.dtype)` (in matmuls): a caller may pass them
    # already cast (resilient_jax.state.ModelDef.compute_cast_dtypes) without changing a bit. Not
    # the embedding: its gradient is a scatter-add over repeated tokens, which is done in float32.
    CAST_TO_COMPUTE_DTYPE = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "unembed"})

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.d_model % cfg.n_heads or (cfg.d_model // cfg.n_heads) % 2:
            raise ValueError(
                f"model.d_model ({cfg.d_model}) must be divisible by model.n_heads ({cfg.n_heads}) "
                "into an even head size (rotary positions rotate pairs)"
            )
        if cfg.attention == "dot_product" and cfg.dropout:
            raise ValueError(
                f"model.attention=dot_product has no attention-probability dropout: set model.dropout=0 "
                f"(got {cfg.dropout}) or model.attention=explicit"
            )
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))
        if cfg.scan_layers:
            # One Block whose every parameter has a leading [n_layers] dim named "layers".
            @nnx.split_rngs(splits=cfg.n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS_AXIS})
            def stacked(layer_rngs: nnx.Rngs) -> Block:
                return Block(cfg, rngs=layer_rngs)

            self.blocks = stacked(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, rngs=rngs)
        self.unembed = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))
        self.dtype = jnp.dtype(cfg.dtype)
        self.n_layers = cfg.n_layers
        self.scan_layers = cfg.scan_layers
        self.remat = cfg.remat

    def __call__(self, tokens_BxL: jax.Array, *, dropout_key: jax.Array | None = None,
                 prepare_layer=None, layer_inputs=None) -> jax.Array:
        """Logits [B, L, vocab] in float32. `dropout_key=None` is the deterministic (eval) pass.

        `prepare_layer(params, layer_input)`: a framework hook, returning params of the full shapes,
        applied to each block's parameters right where that block runs (inside the layer scan,
        inside the remat): e.g. an all-gather of fsdp shards, so only one layer is ever gathered at
        a time (ZeRO-3). `layer_inputs`: what the hook gets for each layer, opaque to the model
        (stacked on a leading [n_layers] dim with scan_layers, else a sequence; None: None each).
        """
        stream = ("batch", "length", "embed")
        x = constrain(jnp.take(self.embed[...], tokens_BxL, axis=0).astype(self.dtype), stream)
        x = constrain(self._run_blocks(x, dropout_key, prepare_layer, layer_inputs), stream)
        x = self.final_norm(x)
        return constrain((x @ self.unembed[...].astype(self.dtype)).astype(jnp.float32), ("batch", "length", "vocab"))

    def _run_blocks(self, x_BxLxD: jax.Array, dropout_key: jax.Array | None, prepare_layer, layer_inputs) -> jax.Array:
        def call_block(block: Block, x: jax.Array, key: jax.Array | None, layer_input) -> jax.Array:
            return (block if prepare_layer is None else _with_params(block, prepare_layer, layer_input))(x, key)

        call = call_block
        if self.remat != "none":
            call = nnx.remat(call_block, policy=REMAT_POLICIES[self.remat], prevent_cse=not self.scan_layers)

        def layer_key(layer):
            return None if dropout_key is None else jax.random.fold_in(dropout_key, layer)

        if not self.scan_layers:
            for layer, block in enumerate(self.blocks):
                layer_input = None if layer_inputs is None else layer_inputs[layer]
                x_BxLxD = call(block, x_BxLxD, layer_key(layer), layer_input)
            return x_BxLxD

        @nnx.scan(in_axes=(nnx.Carry, 0, 0, 0), out_axes=nnx.Carry,
                  transform_metadata={nnx.PARTITION_NAME: LAYERS_AXIS})
        def scan_body(x, block, layer, layer_input):
            return call(block, x, layer_key(layer), layer_input)

        return scan_body(x_BxLxD, self.blocks, jnp.arange(self.n_layers, dtype=jnp.uint32), layer_inputs)


def count_params(params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
