"""The data pipeline: versioned datasets, a host-count-independent global order, grain loading.

Modules, one concern each:
- `sources`   which documents, in which order: text dirs, jsonl, parquet, HF dirs (streamed)
- `tokenizer` tokenizers by spec: bytes (default), hf:tokenizer.json, sp:model, registered names
- `records`   the fixed byte layout of one record (compact tokens, optional weights)
- `manifest`  manifest.json, the dataset version, file checks
- `prepare`   building datasets (prepare / ensure / verify)
- `order`     the global sample order of every step, quarantine, host slices
- `position`  DataPosition, the checkpointed data offset
- `reader`    reading one host's rows of a step through grain (+ poison hook)
- `loader`    HostBatchLoader: background prefetch, seek, quarantine
- `cli`       `python -m resilient_jax.data prepare|verify|batch`
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# The names below load their module on first use (PEP 562): a process that needs only the manifest
# or the dataset's location (an elastic run's driver, its preflight) does not import grain, orbax
# and JAX with the loader -- about a second on the launch's path before any worker starts.
_MODULE_OF = {
    "DatasetError": "errors",
    "HostBatchLoader": "loader",
    "Manifest": "manifest", "ShardInfo": "manifest", "load_manifest": "manifest",
    "GlobalOrder": "order", "QuarantineEvent": "order", "global_batch_ids": "order", "host_rows": "order",
    "DataPosition": "position",
    "ensure_dataset": "prepare", "prepare_dataset": "prepare", "verify_dataset": "prepare",
    "Batch": "reader",
    "get_tokenizer": "tokenizer", "known_tokenizers": "tokenizer", "register_tokenizer": "tokenizer",
}

if TYPE_CHECKING:
    from resilient_jax.data.errors import DatasetError
    from resilient_jax.data.loader import HostBatchLoader
    from resilient_jax.data.manifest import Manifest, ShardInfo, load_manifest
    from resilient_jax.data.order import GlobalOrder, QuarantineEvent, global_batch_ids, host_rows
    from resilient_jax.data.position import DataPosition
    from resilient_jax.data.prepare import ensure_dataset, prepare_dataset, verify_dataset
    from resilient_jax.data.reader import Batch
    from resilient_jax.data.tokenizer import get_tokenizer, known_tokenizers, register_tokenizer


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


__all__ = [
    "Batch",
    "DataPosition",
    "DatasetError",
    "GlobalOrder",
    "HostBatchLoader",
    "Manifest",
    "QuarantineEvent",
    "ShardInfo",
    "ensure_dataset",
    "get_tokenizer",
    "global_batch_ids",
    "host_rows",
    "known_tokenizers",
    "load_manifest",
    "prepare_dataset",
    "register_tokenizer",
    "verify_dataset",
]
