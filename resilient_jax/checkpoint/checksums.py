"""Per-array sha256 of a state tree: leaf names, full host copies, manifest entries.

Leaf names are the dotted key paths orbax also uses as tensorstore keys ("blocks.0.attn.wq",
"1.0.mu.embed"), so the manifest, the reader and the files agree on one name per array.

Hashing needs the whole value of each array on the host. Under DESIGN invariant 3 every host
already holds a full replica; only a leaf sharded across processes (fsdp/tensor spanning hosts)
needs a gather, a collective that every process must join -- the decision depends only on the
sharding, so all processes make it alike.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from resilient_jax.checkpoint.reader import array_sha256


def _key_name(key) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    raise TypeError(f"unsupported pytree key {key!r}")


def named_leaves(tree) -> list[tuple[list[str], Any]]:
    """[(path components, leaf)] in flatten order; empty subtrees (e.g. optax EmptyState) have no leaves."""
    return [([_key_name(k) for k in path], leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def held_by_every_process(leaf: jax.Array) -> bool:
    """Whether each process's devices hold every element of `leaf` (so no gather is needed)."""
    if leaf.is_fully_addressable:
        return True
    size = int(np.prod(leaf.shape))
    covered: dict[int, set] = {}
    for device, index in leaf.sharding.devices_indices_map(leaf.shape).items():
        covered.setdefault(device.process_index, set()).add(
            tuple((s.start, s.stop) for s in index) if index else ()
        )
    for indices in covered.values():
        volume = sum(int(np.prod([(stop or dim) - (start or 0) for (start, stop), dim in zip(idx, leaf.shape)]))
                     for idx in indices) if leaf.shape else 1
        if volume < size:
            return False
    return True


def host_copy(leaf) -> np.ndarray:
    """A host-owned numpy copy of the whole array (safe to keep after the device buffer is donated)."""
    if not isinstance(leaf, jax.Array):
        return np.array(leaf, copy=True)
    if held_by_every_process(leaf):
        if leaf.is_fully_addressable:
            return np.array(leaf, copy=True)
        out = np.empty(leaf.shape, leaf.dtype)
        for shard in leaf.addressable_shards:
            out[shard.index] = np.asarray(shard.data)
        return out
    from jax.experimental import multihost_utils

    return np.array(multihost_utils.process_allgather(leaf, tiled=True), copy=True)


def host_copies(tree) -> list[tuple[list[str], np.ndarray]]:
    return [(path, host_copy(leaf)) for path, leaf in named_leaves(tree)]


def manifest_entries(copies: list[tuple[list[str], np.ndarray]]) -> dict[str, dict[str, Any]]:
    """{dotted name: {path, shape, dtype, bytes, sha256}} -- the manifest's view of one array field."""
    return {
        ".".join(path): {
            "path": path,
            "shape": list(a.shape),
            "dtype": str(a.dtype),
            "bytes": int(a.nbytes),
            "sha256": array_sha256(a),
        }
        for path, a in copies
    }


def mismatches(tree, entries: dict[str, dict[str, Any]]) -> list[str]:
    """Names of arrays in `tree` whose sha256 differs from (or is missing in) the manifest entries."""
    names = set()
    bad = []
    for path, leaf in named_leaves(tree):
        name = ".".join(path)
        names.add(name)
        entry = entries.get(name)
        if entry is None or array_sha256(host_copy(leaf)) != entry["sha256"]:
            bad.append(name)
    bad.extend(sorted(set(entries) - names))
    return bad
