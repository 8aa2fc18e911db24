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

from resilient_jax.data.errors import DatasetError
from resilient_jax.data.loader import HostBatchLoader
from resilient_jax.data.manifest import Manifest, ShardInfo, load_manifest
from resilient_jax.data.order import GlobalOrder, QuarantineEvent, global_batch_ids, host_rows
from resilient_jax.data.position import DataPosition
from resilient_jax.data.prepare import ensure_dataset, prepare_dataset, verify_dataset
from resilient_jax.data.reader import Batch
from resilient_jax.data.tokenizer import get_tokenizer, known_tokenizers, register_tokenizer

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
