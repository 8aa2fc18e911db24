"""The dataset manifest: what a prepared dataset contains, and its version.

`manifest.json` lists the format, tokenizer (kind + sha256), record layout (seq_len, token_dtype,
has_weights; see `records`) and, per shard, its file name, record
count, byte size and sha256. The **dataset version** is the sha256 of the canonical manifest JSON
(sorted keys, no whitespace, the `version` field excluded), so it changes exactly when a shard's
bytes or the way they are to be read changes, and it is the same on every machine.

Global sample ids are contiguous across shards in manifest order: shard s holds ids
[bounds[s], bounds[s+1]). This is also the record key of grain's `ArrayRecordDataSource` over the
shard files in that order, so a global id is read without any translation.

Two checks of the files against the manifest: `check_files` (exists + byte size; cheap, run whenever
a dataset is opened) and `verify_files` (full sha256; run by the trainer before training and by
`python -m resilient_jax.data verify`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from resilient_jax.data.errors import DatasetError
from resilient_jax.data.records import RecordLayout

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 2
# Format 1 (no tokenizer_sha256, weights always stored) is still read; new datasets are format 2.
_READABLE_FORMATS = (1, 2)
_PREPARE_HINT = "re-run `python -m resilient_jax.data prepare` into a fresh directory"


@dataclass(frozen=True)
class ShardInfo:
    file: str
    records: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    root: Path
    version: str
    format_version: int
    tokenizer: str
    vocab_size: int
    seq_len: int
    token_dtype: str
    writer_options: str
    shards: tuple[ShardInfo, ...]
    tokenizer_sha256: str = ""  # "" in format 1
    has_weights: bool = True  # format 1 always stored weights

    @property
    def num_records(self) -> int:
        return int(self.shard_bounds[-1])

    @functools.cached_property
    def shard_bounds(self) -> np.ndarray:
        """int64 [num_shards + 1]: shard s holds global ids [bounds[s], bounds[s+1])."""
        return np.concatenate([[0], np.cumsum([s.records for s in self.shards])]).astype(np.int64)

    @property
    def layout(self) -> RecordLayout:
        return RecordLayout(self.seq_len, self.token_dtype, self.has_weights)

    def shard_path(self, shard: int) -> Path:
        return self.root / self.shards[shard].file

    def shard_of(self, global_ids: np.ndarray) -> np.ndarray:
        """Shard index (int32) of each global sample id."""
        ids = np.asarray(global_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_records):
            raise DatasetError(f"global sample ids must lie in [0, {self.num_records})")
        return (np.searchsorted(self.shard_bounds, ids, side="right") - 1).astype(np.int32)

    def content(self) -> dict[str, Any]:
        """The hashed fields: everything in manifest.json except `version`."""
        content = {
            "format_version": self.format_version,
            "tokenizer": self.tokenizer,
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
            "token_dtype": self.token_dtype,
            "writer_options": self.writer_options,
            "shards": [asdict(s) for s in self.shards],
        }
        if self.format_version >= 2:
            content.update(tokenizer_sha256=self.tokenizer_sha256, has_weights=self.has_weights)
        return content


def canonical_json(content: dict[str, Any]) -> bytes:
    return json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def content_version(content: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(content)).hexdigest()


def manifest_from_content(root: Path, content: dict[str, Any]) -> Manifest:
    return Manifest(
        root=Path(root),
        version=content_version(content),
        format_version=int(content["format_version"]),
        tokenizer=str(content["tokenizer"]),
        vocab_size=int(content["vocab_size"]),
        seq_len=int(content["seq_len"]),
        token_dtype=str(content["token_dtype"]),
        writer_options=str(content["writer_options"]),
        shards=tuple(ShardInfo(**s) for s in content["shards"]),
        tokenizer_sha256=str(content.get("tokenizer_sha256", "")),
        has_weights=bool(content.get("has_weights", True)),
    )


def write_manifest(manifest: Manifest) -> None:
    doc = dict(manifest.content(), version=manifest.version)
    (manifest.root / MANIFEST_NAME).write_text(json.dumps(doc, sort_keys=True, indent=1) + "\n")


def load_manifest(root: str | Path) -> Manifest:
    """Reads `root/manifest.json` and checks its version field against its content."""
    path = Path(root) / MANIFEST_NAME
    if not path.is_file():
        raise DatasetError(f"missing manifest {path}: not a prepared dataset; {_PREPARE_HINT}")
    try:
        doc = json.loads(path.read_text())
        stored = doc.pop("version")
        manifest = manifest_from_content(Path(root), doc)
    except (ValueError, KeyError, TypeError) as e:
        raise DatasetError(f"unreadable manifest {path} ({e!r}); {_PREPARE_HINT}") from None
    if manifest.format_version not in _READABLE_FORMATS:
        raise DatasetError(
            f"manifest {path} has format_version {manifest.format_version}, this code reads "
            f"{', '.join(map(str, _READABLE_FORMATS))}; {_PREPARE_HINT}"
        )
    for info in manifest.shards:  # the version covers the names, but anyone can recompute it
        if not isinstance(info.file, str) or info.file in ("", ".", "..") or "/" in info.file or "\\" in info.file:
            raise DatasetError(f"manifest {path} names shard file {info.file!r}, which is not a file of the dataset "
                               f"directory; {_PREPARE_HINT}")
    if stored != manifest.version:
        raise DatasetError(
            f"manifest {path} was edited: its version field does not match its content; {_PREPARE_HINT}"
        )
    return manifest


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check_files(manifest: Manifest) -> None:
    """Fast check: every shard file exists with the byte size the manifest records."""
    for shard in range(len(manifest.shards)):
        _check_size(manifest, shard)


def verify_files(manifest: Manifest) -> None:
    """Full check: sizes, then the sha256 of every shard file."""
    for shard, info in enumerate(manifest.shards):
        path = _check_size(manifest, shard)
        if file_sha256(path) != info.sha256:
            raise DatasetError(
                f"modified shard file {path}: its sha256 does not match {MANIFEST_NAME}; {_PREPARE_HINT}"
            )


def _check_size(manifest: Manifest, shard: int) -> Path:
    path = manifest.shard_path(shard)
    if not path.is_file():
        raise DatasetError(f"missing shard file {path}; {_PREPARE_HINT}")
    size = path.stat().st_size
    expected = manifest.shards[shard].bytes
    if size != expected:
        kind = "truncated" if size < expected else "modified (grown)"
        raise DatasetError(
            f"{kind} shard file {path}: {size} bytes, {MANIFEST_NAME} says {expected}; {_PREPARE_HINT}"
        )
    return path
