"""The params fingerprint: the one number determinism claims are checked against.

sha256 over every leaf's raw bytes (C order, native dtype), leaves visited in sorted key-path order.
Paths are rendered with `jax.tree_util.keystr`, so a nested dict `{"a": {"b": x}}` sorts as "['a']['b']".
Leaves that live on several processes are gathered first, so every process computes the same value.
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np


def _host_array(leaf) -> np.ndarray:
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(leaf)


def params_fingerprint(tree) -> str:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    digest = hashlib.sha256()
    for path, leaf in sorted(leaves, key=lambda item: jax.tree_util.keystr(item[0])):
        digest.update(np.ascontiguousarray(_host_array(leaf)).tobytes())
    return digest.hexdigest()
