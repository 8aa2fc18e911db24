"""The byte layout of one record, shared by the writer (prepare) and the readers (loader, bench).

A record is fixed-size, headerless, little-endian bytes:

    tokens  : seq_len + 1 integers of `token_dtype` ("<u1", "<u2" or "<i4", the smallest that
              holds the tokenizer's vocab; recorded in the manifest)
    weights : seq_len float32 per-token loss weights (1.0 when prepared)

Fixed size means a whole batch decodes with one `np.frombuffer` over the joined records (no pickle,
no per-record parsing), and a damaged record is caught by its length.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from resilient_jax.data.errors import DatasetError


def token_dtype_for(vocab_size: int) -> str:
    for dtype in ("<u1", "<u2", "<i4"):
        if vocab_size - 1 <= np.iinfo(np.dtype(dtype)).max:
            return dtype
    raise DatasetError(f"vocab_size {vocab_size} does not fit in int32 tokens")


@dataclass(frozen=True)
class RecordLayout:
    seq_len: int
    token_dtype: str

    @property
    def dtype(self) -> np.dtype:
        # A list-of-fields dtype is packed (no alignment padding), so itemsize == record bytes.
        return np.dtype([
            ("tokens", self.token_dtype, (self.seq_len + 1,)),
            ("weights", "<f4", (self.seq_len,)),
        ])

    @property
    def record_bytes(self) -> int:
        return self.dtype.itemsize

    def encode(self, tokens_NxL1: np.ndarray, weights_NxL: np.ndarray) -> Iterator[bytes]:
        rows = np.empty(len(tokens_NxL1), dtype=self.dtype)
        rows["tokens"] = tokens_NxL1
        rows["weights"] = weights_NxL
        for row in rows:
            yield row.tobytes()

    def decode(self, records: Sequence[bytes]) -> np.ndarray:
        """Structured array [len(records)] with fields `tokens` and `weights` (read-only view)."""
        joined = b"".join(records)
        if len(joined) != len(records) * self.record_bytes:
            bad = next(i for i, r in enumerate(records) if len(r) != self.record_bytes)
            raise DatasetError(
                f"record {bad} of a batch has {len(records[bad])} bytes, expected "
                f"{self.record_bytes}; the shard is damaged, run `python -m resilient_jax.data verify`"
            )
        return np.frombuffer(joined, dtype=self.dtype)
