"""Building a dataset: text -> tokens -> fixed windows -> ArrayRecord shards + manifest.

Layout decisions (all part of the dataset version through the manifest):
- Files are tokenized one by one in sorted order (see `sources`) and their tokens concatenated with
  no separator (the byte vocab has no spare id); the stream is cut into non-overlapping windows of
  seq_len + 1 tokens and the incomplete tail is dropped. Loss weights are all 1.0.
- Records go to shards **contiguously**: shard s holds records [s*R//N, (s+1)*R//N), so global
  sample id == position in the concatenated shards, and quarantining a shard removes one contiguous
  stretch of the source text.
- Shards are ArrayRecord files written with `group_size:1` (what grain needs for fast random
  access) and **uncompressed**, so the file bytes depend only on the container format, not on the
  compressor's version: same input, same version, on any machine.

Datasets are built in a temporary sibling directory and renamed into place, so a half-built
dataset is never visible; if several processes race to build the same dataset, the first rename
wins and the others use its result (preparation is deterministic, so they are identical).
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from resilient_jax.data.errors import DatasetError
from resilient_jax.data.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    check_files,
    file_sha256,
    load_manifest,
    manifest_from_content,
    verify_files,
    write_manifest,
)
from resilient_jax.data.records import RecordLayout, token_dtype_for
from resilient_jax.data.sources import DEFAULT_SOURCE, collect_texts
from resilient_jax.data.tokenizer import Tokenizer, get_tokenizer

WRITER_OPTIONS = "group_size:1,uncompressed"
DEFAULT_SHARDS = 8
DEFAULT_SEQ_LEN = 128


def prepare_dataset(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    shards: int = DEFAULT_SHARDS,
    seq_len: int = DEFAULT_SEQ_LEN,
    tokenizer: str = "bytes",
    max_bytes: int | None = None,
) -> Manifest:
    """Builds a dataset at `out`, which must not exist or be empty."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DatasetError(f"output directory {out} already exists and is not empty; choose a new --out")
    return _build_atomically(src, out, shards, seq_len, tokenizer, max_bytes)


def ensure_dataset(
    path: str | os.PathLike,
    src: str | os.PathLike = DEFAULT_SOURCE,
    shards: int = DEFAULT_SHARDS,
    seq_len: int = DEFAULT_SEQ_LEN,
    tokenizer: str = "bytes",
    max_bytes: int | None = None,
) -> Manifest:
    """The dataset at `path`: loaded and fast-checked if it exists, else prepared from `src`."""
    path = Path(path)
    if (path / MANIFEST_NAME).exists():
        manifest = load_manifest(path)
        _check_request(manifest, shards=shards, seq_len=seq_len, tokenizer=tokenizer)
        check_files(manifest)
        return manifest
    if path.exists() and any(path.iterdir()):
        raise DatasetError(f"{path} exists but has no {MANIFEST_NAME}; remove it or choose another dataset path")
    return _build_atomically(src, path, shards, seq_len, tokenizer, max_bytes)


def verify_dataset(path: str | os.PathLike) -> Manifest:
    """Loads the manifest at `path` and re-hashes every shard against it."""
    manifest = load_manifest(path)
    verify_files(manifest)
    return manifest


def _check_request(manifest: Manifest, **requested: object) -> None:
    for key, want in requested.items():
        have = len(manifest.shards) if key == "shards" else getattr(manifest, key)
        if have != want:
            raise DatasetError(
                f"dataset {manifest.root} has {key}={have!r} but {key}={want!r} was requested; "
                "use another dataset path or request the existing value"
            )


def _build_atomically(
    src: str | os.PathLike, out: Path, shards: int, seq_len: int, tokenizer_name: str, max_bytes: int | None
) -> Manifest:
    if shards < 1 or seq_len < 1:
        raise DatasetError(f"shards ({shards}) and seq_len ({seq_len}) must both be >= 1")
    tokenizer = get_tokenizer(tokenizer_name)  # unknown names fail before any work
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        windows = _token_windows(src, tokenizer, seq_len, max_bytes)
        manifest = _write_dataset(tmp, windows, shards, tokenizer)
        return _publish(tmp, out, manifest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _token_windows(
    src: str | os.PathLike, tokenizer: Tokenizer, seq_len: int, max_bytes: int | None
) -> np.ndarray:
    texts = collect_texts(src, max_bytes)
    tokens = np.concatenate([np.asarray(tokenizer.encode(t.data)) for t in texts])
    if tokens.size and (tokens.min() < 0 or tokens.max() >= tokenizer.vocab_size):
        raise DatasetError(f"tokenizer {tokenizer.name!r} produced ids outside [0, {tokenizer.vocab_size})")
    window = seq_len + 1
    num_records = tokens.size // window
    if num_records == 0:
        raise DatasetError(
            f"source {src} has {tokens.size} tokens, fewer than one record of seq_len+1={window}; "
            "add text or lower --seq-len"
        )
    return tokens[: num_records * window].reshape(num_records, window)


def _write_dataset(root: Path, windows: np.ndarray, num_shards: int, tokenizer: Tokenizer) -> Manifest:
    num_records, window = windows.shape
    if num_records < num_shards:
        raise DatasetError(
            f"the source gives {num_records} records, fewer than --shards {num_shards}; "
            "lower --shards or --seq-len, or add text"
        )
    layout = RecordLayout(seq_len=window - 1, token_dtype=token_dtype_for(tokenizer.vocab_size))
    weights = np.ones((num_records, window - 1), np.float32)
    infos = []
    for shard in range(num_shards):
        lo, hi = shard * num_records // num_shards, (shard + 1) * num_records // num_shards
        name = f"shard-{shard:05d}-of-{num_shards:05d}.array_record"
        _write_shard(root / name, layout.encode(windows[lo:hi], weights[lo:hi]))
        infos.append(ShardInfo(name, hi - lo, (root / name).stat().st_size, file_sha256(root / name)))
    content = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "seq_len": layout.seq_len,
        "token_dtype": layout.token_dtype,
        "writer_options": WRITER_OPTIONS,
        "shards": [asdict(i) for i in infos],
    }
    manifest = manifest_from_content(root, content)
    write_manifest(manifest)
    return manifest


def _write_shard(path: Path, records) -> None:
    writer = ArrayRecordWriter(str(path), WRITER_OPTIONS)
    try:
        for record in records:
            writer.write(record)
    finally:
        writer.close()


def _publish(tmp: Path, out: Path, manifest: Manifest) -> Manifest:
    try:
        os.rename(tmp, out)  # atomic; also replaces an empty directory at `out`
    except OSError:
        if not (out / MANIFEST_NAME).exists():
            raise
        # Another process published first; preparation is deterministic, so check and use its copy.
        winner = load_manifest(out)
        if winner.version != manifest.version:
            raise DatasetError(
                f"{out} was prepared concurrently with different content (version {winner.version[:12]} "
                f"vs {manifest.version[:12]}); remove it and prepare again"
            ) from None
        check_files(winner)
        return winner
    return load_manifest(out)
