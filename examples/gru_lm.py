"""A GRU language model: a model of your own, trained by resilient_jax through `model.factory`.

Nothing here knows about meshes, hosts or faults. The framework needs three things of it:
- `build(args, rngs)` returns an nnx.Module (args = the config's model.args);
- its `__call__(tokens_BxL, *, dropout_key=None)` returns logits [B, L, vocab];
- every parameter names its dims' logical axes (resilient_jax.mesh.LOGICAL_RULES maps them to the
  mesh: "vocab" and "mlp" shard over `tensor`, "embed" over `fsdp`, None is replicated).

Train it (elastic, 2 regions x 2 hosts, one host killed at step 20, absorbed):
    python -m resilient_jax.train --config examples/gru_lm.yaml --fault kill_host:1@20
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

_init = nnx.initializers.normal(stddev=0.1)


def build(args: dict, rngs: nnx.Rngs) -> "GRULM":
    return GRULM(vocab_size=args.get("vocab_size", 256), d_embed=args.get("d_embed", 32),
                 d_hidden=args.get("d_hidden", 64), dropout=args.get("dropout", 0.0), rngs=rngs)


class GRULM(nnx.Module):
    def __init__(self, *, vocab_size: int, d_embed: int, d_hidden: int, dropout: float, rngs: nnx.Rngs):
        def param(shape, axes, init=_init):
            return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=axes)

        self.embed = param((vocab_size, d_embed), ("vocab", "embed"))
        # Gates (reset, update, candidate) stacked on a middle dim of 3.
        self.w_x = param((d_embed, 3, d_hidden), ("embed", None, "mlp"))
        self.w_h = param((d_hidden, 3, d_hidden), ("mlp", None, None))
        self.bias = param((3, d_hidden), (None, "mlp"), nnx.initializers.zeros)
        # Not ("mlp", "vocab"): both map to `tensor`, and a mesh axis can shard one dim only.
        self.unembed = param((d_hidden, vocab_size), (None, "vocab"))
        self.dropout = dropout

    def __call__(self, tokens_BxL: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
        x_BxLxD = jnp.take(self.embed[...], tokens_BxL, axis=0)
        xg_LxBx3xH = jnp.einsum("bld,dgh->lbgh", x_BxLxD, self.w_x[...]) + self.bias[...]
        w_h = self.w_h[...]

        def cell(h_BxH, xg_Bx3xH):
            hg_Bx3xH = jnp.einsum("bk,kgh->bgh", h_BxH, w_h)
            reset = jax.nn.sigmoid(xg_Bx3xH[:, 0] + hg_Bx3xH[:, 0])
            update = jax.nn.sigmoid(xg_Bx3xH[:, 1] + hg_Bx3xH[:, 1])
            candidate = jnp.tanh(xg_Bx3xH[:, 2] + reset * hg_Bx3xH[:, 2])
            h_BxH = (1.0 - update) * candidate + update * h_BxH
            return h_BxH, h_BxH

        h0_BxH = jnp.zeros((tokens_BxL.shape[0], w_h.shape[0]), jnp.float32)
        _, h_LxBxH = jax.lax.scan(cell, h0_BxH, xg_LxBx3xH)
        h_BxLxH = jnp.swapaxes(h_LxBxH, 0, 1)
        if dropout_key is not None and self.dropout > 0:
            keep = jax.random.bernoulli(dropout_key, 1.0 - self.dropout, h_BxLxH.shape)
            h_BxLxH = jnp.where(keep, h_BxLxH / (1.0 - self.dropout), 0.0)
        return h_BxLxH @ self.unembed[...]
