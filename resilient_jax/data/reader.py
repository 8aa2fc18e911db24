"""Reading one host's rows of one step through grain, synchronously.

`BatchReader.read(order, step)` takes rows [lo, hi) of the step's global batch, reads those records
with grain's `ArrayRecordDataSource` (its batched `__getitems__`, which reads each shard's records
in one call, the shards in parallel threads) and decodes them with one `np.frombuffer`.

It also owns the poison hook for the `nan_shard` fault injector: records of a poisoned shard read
for a step >= its from_step get NaN loss weights, which is what a corrupted float feature looks like
to the step's finiteness check.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import grain
import numpy as np

from resilient_jax.data.errors import DatasetError
from resilient_jax.data.manifest import Manifest
from resilient_jax.data.order import GlobalOrder, global_batch_ids


@dataclass(frozen=True)
class Batch:
    """One host's rows of the global batch of `step`."""

    step: int
    tokens: np.ndarray  # int32 [rows, seq_len + 1]
    weights: np.ndarray  # float32 [rows, seq_len]
    sample_ids: np.ndarray  # int64 [rows], global sample ids
    shard_ids: np.ndarray  # int32 [rows]


class BatchReader:
    def __init__(self, manifest: Manifest, rows: tuple[int, int], poison: Mapping[int, int] | None = None):
        self.manifest = manifest
        self.rows = rows
        self.poison = dict(poison or {})
        paths = [str(manifest.shard_path(s)) for s in range(len(manifest.shards))]
        self.source = grain.sources.ArrayRecordDataSource(paths)
        if len(self.source) != manifest.num_records:
            raise DatasetError(
                f"shard files under {manifest.root} hold {len(self.source)} records, the manifest says "
                f"{manifest.num_records}; run `python -m resilient_jax.data verify {manifest.root}`"
            )

    def read(self, order: GlobalOrder, step: int, rows: tuple[int, int] | None = None) -> Batch:
        lo, hi = rows or self.rows
        return self.read_ids(global_batch_ids(order, step)[lo:hi], step)

    def read_ids(self, ids: np.ndarray, step: int) -> Batch:
        """The records of global sample ids `ids`, in that order (the poison hook applies at `step`)."""
        if ids.size == 0:  # a host that holds no virtual shard this step (resilient_jax.assignment) reads nothing
            L = self.manifest.seq_len
            return Batch(step, np.zeros((0, L + 1), np.int32), np.zeros((0, L), np.float32), ids,
                         np.zeros(0, np.int32))
        rows = self.manifest.layout.decode(self.source.__getitems__(ids.tolist()))
        shard_ids = self.manifest.shard_of(ids)
        weights = rows["weights"]  # a fresh float32 array: the poison hook edits it
        self._poison(step, shard_ids, weights)
        return Batch(step, rows["tokens"], weights, ids, shard_ids)

    def _poison(self, step: int, shard_ids: np.ndarray, weights: np.ndarray) -> None:
        for shard, from_step in self.poison.items():
            if step >= from_step:
                weights[shard_ids == shard] = np.nan

    def close(self) -> None:
        self.source.__exit__(None, None, None)
