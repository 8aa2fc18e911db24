"""The byte layout of one record, shared by the writer (prepare) and the readers (loader, bench).

A record is fixed-size, headerless, little-endian bytes:

    tokens  : seq_len + 1 unsigned integers of `token_dtype`, the smallest that holds the vocab:
              "<u1" (vocab <= 256, the byte tokenizer), "<u2" (<= 65536), else "<u4"
    weights : seq_len float32 per-token loss weights -- present only when `has_weights`

Both `token_dtype` and `has_weights` are recorded in the manifest (so part of the dataset version).
`prepare` gives every token weight 1.0, so it stores no weights (has_weights false) and a record
costs 1-4 bytes per token (a 32k-vocab tokenizer: 2) instead of that plus 4. Format-1 datasets
(written before this layout) stored weights always and "<i4" tokens for big vocabs; they are still
read. The readers always hand the trainer int32 tokens and float32 weights (ones when not stored),
whatever the stored types.

Fixed size means a whole batch decodes with one `np.frombuffer` over the joined records (no pickle,
no per-record parsing), and a damaged record is caught by its length.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from resilient_jax.data.errors import DatasetError


def token_dtype_for(vocab_size: int) -> str:
    for dtype in ("<u1", "<u2", "<u4"):
        if vocab_size - 1 <= np.iinfo(np.dtype(dtype)).max:
            return dtype
    raise DatasetError(f"vocab_size {vocab_size} does not fit in uint32 tokens")


@dataclass(frozen=True)
class RecordLayout:
    seq_len: int
    token_dtype: str
    has_weights: bool = True

    @property
    def dtype(self) -> np.dtype:
        # A list-of-fields dtype is packed (no alignment padding), so itemsize == record bytes.
        fields = [("tokens", self.token_dtype, (self.seq_len + 1,))]
        if self.has_weights:
            fields.append(("weights", "<f4", (self.seq_len,)))
        return np.dtype(fields)

    @property
    def record_bytes(self) -> int:
        return self.dtype.itemsize

    def encode(self, tokens_NxL1: np.ndarray, weights_NxL: np.ndarray | None = None) -> Iterator[bytes]:
        if (weights_NxL is not None) != self.has_weights:
            raise ValueError(f"layout has_weights={self.has_weights} but weights {'given' if weights_NxL is not None else 'missing'}")
        rows = np.empty(len(tokens_NxL1), dtype=self.dtype)
        rows["tokens"] = tokens_NxL1
        if self.has_weights:
            rows["weights"] = weights_NxL
        for row in rows:
            yield row.tobytes()

    def decode(self, records: Sequence[bytes]) -> dict[str, np.ndarray]:
        """{"tokens": [N, seq_len+1] int32, "weights": [N, seq_len] float32}, fresh writable arrays."""
        joined = b"".join(records)
        if len(joined) != len(records) * self.record_bytes:
            bad = next(i for i, r in enumerate(records) if len(r) != self.record_bytes)
            raise DatasetError(
                f"record {bad} of a batch has {len(records[bad])} bytes, expected "
                f"{self.record_bytes}; the shard is damaged, run `python -m resilient_jax.data verify`"
            )
        rows = np.frombuffer(joined, dtype=self.dtype)
        tokens = rows["tokens"].astype(np.int32)
        if self.has_weights:
            weights = rows["weights"].astype(np.float32)
        else:
            weights = np.ones((len(records), self.seq_len), np.float32)
        return {"tokens": tokens, "weights": weights}
