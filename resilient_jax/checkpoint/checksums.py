"""The manifest's view of a live state tree: leaf names, shapes, dtypes -- no host copy.

Leaf names are the dotted key paths orbax also uses as tensorstore keys ("blocks.0.attn.wq",
"1.0.mu.embed"), so the manifest, the reader and the files agree on one name per array.

The bytes are not hashed here: each process hashes the files it wrote once orbax has committed
(`commit.py`), so no process copies the whole state to its host just to checksum it.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _key_name(key) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    raise TypeError(f"unsupported pytree key {key!r}")


def named_leaves(tree) -> list[tuple[list[str], Any]]:
    """[(path components, leaf)] in flatten order; empty subtrees (e.g. optax EmptyState) have no leaves."""
    import jax

    return [([_key_name(k) for k in path], leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def manifest_entries(tree) -> dict[str, dict[str, Any]]:
    """{dotted name: {path, shape, dtype, bytes}} -- the manifest's view of one array field, from
    each leaf's metadata only (works on live, donated-soon or abstract arrays alike)."""
    out = {}
    for path, leaf in named_leaves(tree):
        leaf = leaf if hasattr(leaf, "dtype") and hasattr(leaf, "shape") else np.asarray(leaf)
        dtype, shape = np.dtype(leaf.dtype), [int(d) for d in leaf.shape]
        out[".".join(path)] = {"path": path, "shape": shape, "dtype": str(dtype),
                               "bytes": int(np.prod(shape, dtype=np.int64)) * dtype.itemsize}
    return out
