"""Building a dataset: text -> tokens -> fixed windows -> ArrayRecord shards + manifest.

Layout decisions (all part of the dataset version through the manifest):
- Documents are tokenized in their deterministic order (see `sources`) and their tokens
  concatenated with no separator (the byte vocab has no spare id); the stream is cut into
  non-overlapping windows of seq_len + 1 tokens and the incomplete tail is dropped. Loss weights
  are all 1.0, so none are stored (see `records`).
- Streaming: documents are read and encoded a batch at a time and their tokens appended to a
  temporary file in the build directory; the shards are then written from that file a block of
  records at a time. Memory stays flat in the corpus size; disk holds the stream once more.
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

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from resilient_jax.data.errors import DatasetError, option
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
from resilient_jax.data.sources import DEFAULT_SOURCE, Document, iter_documents
from resilient_jax.data.tokenizer import Tokenizer, get_tokenizer

WRITER_OPTIONS = "group_size:1,uncompressed"
_TOKEN_STREAM = "tokens.tmp"  # the whole token stream, on disk, while a dataset is built
_ENCODE_BATCH_BYTES = 4 * 2**20
_READ_RECORDS = 8192
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
    fmt: str = "auto",
    text_field: str = "text",
) -> Manifest:
    """Builds a dataset at `out`, which must not exist or be empty. `fmt`/`text_field`: see `sources`."""
    # Absolute, so `--out .` has a name and a parent to build the temporary sibling in.
    out = Path(os.path.abspath(os.path.expanduser(out)))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DatasetError(f"output directory {out} already exists and is not empty; choose a new --out")
    if out == Path.cwd():  # publishing renames the dataset over it: the shell would sit in a removed directory
        raise DatasetError(f"output directory {out} is the current directory, which the finished dataset would "
                           f"replace; choose a new --out, e.g. {out / 'dataset'}")
    return _build_atomically(src, out, shards, seq_len, tokenizer, max_bytes, fmt, text_field)


def ensure_dataset(
    path: str | os.PathLike,
    src: str | os.PathLike = DEFAULT_SOURCE,
    shards: int = DEFAULT_SHARDS,
    seq_len: int = DEFAULT_SEQ_LEN,
    tokenizer: str = "bytes",
    max_bytes: int | None = None,
    fmt: str = "auto",
    text_field: str = "text",
) -> Manifest:
    """The dataset at `path`: loaded and fast-checked if it exists, else prepared from `src`."""
    path = Path(path)
    if (path / MANIFEST_NAME).exists():
        manifest = load_manifest(path)
        _check_request(manifest, shards=shards, seq_len=seq_len)
        check_tokenizer(manifest, get_tokenizer(tokenizer))
        check_files(manifest)
        return manifest
    if path.exists() and any(path.iterdir()):
        raise DatasetError(f"{path} exists but has no {MANIFEST_NAME}; remove it or choose another dataset path")
    return _build_atomically(src, path, shards, seq_len, tokenizer, max_bytes, fmt, text_field)


def verify_dataset(path: str | os.PathLike) -> Manifest:
    """Loads the manifest at `path` and re-hashes every shard against it."""
    manifest = load_manifest(path)
    verify_files(manifest)
    return manifest


def check_tokenizer(manifest: Manifest, tokenizer: Tokenizer) -> None:
    """Refuses a dataset prepared with another tokenizer, naming both hashes."""
    have = (manifest.tokenizer, manifest.tokenizer_sha256 or tokenizer.sha256)  # format 1 had no hash
    if have != (tokenizer.name, tokenizer.sha256):
        raise DatasetError(
            f"dataset {manifest.root} was prepared with tokenizer {manifest.tokenizer!r} sha256 "
            f"{manifest.tokenizer_sha256 or '(not recorded)'}, the requested one is {tokenizer.name!r} sha256 "
            f"{tokenizer.sha256}; use the dataset's tokenizer or prepare a new dataset"
        )


def _check_request(manifest: Manifest, **requested: object) -> None:
    for key, want in requested.items():
        have = len(manifest.shards) if key == "shards" else getattr(manifest, key)
        if have != want:
            raise DatasetError(
                f"dataset {manifest.root} has {key}={have!r} but {key}={want!r} was requested; "
                "use another dataset path or request the existing value"
            )


def _build_atomically(
    src: str | os.PathLike, out: Path, shards: int, seq_len: int, tokenizer_name: str, max_bytes: int | None,
    fmt: str = "auto", text_field: str = "text",
) -> Manifest:
    if shards < 1 or seq_len < 1:
        raise DatasetError(f"shards ({shards}) and seq_len ({seq_len}) must both be >= 1")
    tokenizer = get_tokenizer(tokenizer_name)  # unknown names and unparsable files fail before any work
    layout = RecordLayout(seq_len=seq_len, token_dtype=token_dtype_for(tokenizer.vocab_size), has_weights=False)
    made = _make_parent(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    published = False
    try:
        stream = tmp / _TOKEN_STREAM
        docs = iter_documents(src, fmt, text_field, max_bytes)
        num_tokens = _tokenize_to_file(docs, tokenizer, stream, np.dtype(layout.token_dtype))
        manifest = _write_dataset(tmp, stream, num_tokens, layout, shards, tokenizer, src)
        stream.unlink()
        manifest = _publish(tmp, out, manifest)
        published = True
        return manifest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not published:  # a failed build leaves no trace: not even the directories made for it
            for directory in made:
                with contextlib.suppress(OSError):  # not empty (another build's), or already gone
                    directory.rmdir()


def _make_parent(out: Path) -> list[Path]:
    """The directories above `out`, or one line naming what is in the way (a file, no permission).
    Returns the ones made here, innermost first."""
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return made
    except OSError as e:
        blocker = next((p for p in (out.parent, *out.parent.parents) if p.exists() and not p.is_dir()), None)
        why = f"{blocker} is a file, not a directory" if blocker else f"{e.filename}: {e.strerror}"
        raise DatasetError(f"cannot create dataset directory {out} ({why}); choose another dataset path") from None


def _tokenize_to_file(docs: Iterator[Document], tokenizer: Tokenizer, path: Path, dtype: np.dtype) -> int:
    """Appends every document's tokens to `path` (raw `dtype`); returns the token count.

    Documents are encoded in batches of ~_ENCODE_BATCH_BYTES (the hf/sp tokenizers spread a batch
    over all cores); only one batch is in memory at a time."""
    count = 0
    with open(path, "wb") as f:
        for batch in _batches(docs, _ENCODE_BATCH_BYTES):
            for doc, ids in zip(batch, tokenizer.encode_batch([d.data for d in batch]), strict=True):
                ids = np.asarray(ids)
                if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
                    raise DatasetError(f"tokenizer {tokenizer.name!r} produced ids outside "
                                       f"[0, {tokenizer.vocab_size}) for {doc.where}")
                f.write(ids.astype(dtype).tobytes())
                count += ids.size
    return count


def _batches(docs: Iterator[Document], max_bytes: int) -> Iterator[list[Document]]:
    batch: list[Document] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc.data)
        if size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _write_dataset(root: Path, stream: Path, num_tokens: int, layout: RecordLayout, num_shards: int,
                   tokenizer: Tokenizer, src: str | os.PathLike) -> Manifest:
    window = layout.seq_len + 1
    num_records = num_tokens // window
    if num_records == 0:
        raise DatasetError(
            f"source {src} has {num_tokens} tokens, fewer than one record of seq_len+1={window}; "
            f"add text or lower {option('--seq-len')}"
        )
    if num_records < num_shards:
        raise DatasetError(
            f"the source gives {num_records} records, fewer than {option('--shards')} {num_shards}; "
            f"lower {option('--shards')} or {option('--seq-len')}, or add text"
        )
    infos = []
    for shard in range(num_shards):
        lo, hi = shard * num_records // num_shards, (shard + 1) * num_records // num_shards
        name = f"shard-{shard:05d}-of-{num_shards:05d}.array_record"
        _write_shard(root / name, _records(stream, layout, lo, hi))
        infos.append(ShardInfo(name, hi - lo, (root / name).stat().st_size, file_sha256(root / name)))
    content = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer.name,
        "tokenizer_sha256": tokenizer.sha256,
        "vocab_size": tokenizer.vocab_size,
        "seq_len": layout.seq_len,
        "token_dtype": layout.token_dtype,
        "has_weights": layout.has_weights,
        "writer_options": WRITER_OPTIONS,
        "shards": [asdict(i) for i in infos],
    }
    manifest = manifest_from_content(root, content)
    write_manifest(manifest)
    return manifest


def _records(stream: Path, layout: RecordLayout, lo: int, hi: int) -> Iterator[bytes]:
    """Records [lo, hi) of the token stream, read _READ_RECORDS at a time (memory stays flat)."""
    window = layout.seq_len + 1
    dtype = np.dtype(layout.token_dtype)
    for start in range(lo, hi, _READ_RECORDS):
        stop = min(start + _READ_RECORDS, hi)
        tokens = np.fromfile(stream, dtype=dtype, count=(stop - start) * window,
                             offset=start * window * dtype.itemsize)
        yield from layout.encode(tokens.reshape(stop - start, window))


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
