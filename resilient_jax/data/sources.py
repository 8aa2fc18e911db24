"""Which documents go into a dataset, and in which order -- streamed, never all in memory.

`iter_documents(src, fmt, text_field, max_bytes)` yields `Document`s (a location for error
messages and the UTF-8 bytes) in a deterministic order: files are taken in sorted relative-POSIX-path
order (not the file system's listing order), then in file order. Nothing else -- no timestamps,
absolute paths or source format -- enters the text, so the same documents give the same dataset
version on any machine, and a jsonl file and a parquet file of the same texts give the same one.

Formats (`fmt`, default "auto": from the file extension, or for a directory from its contents):
- `text`     a directory of text files (or one file), one document per file: every non-hidden regular
             file, which must be text (valid UTF-8, no NUL byte: another is an error naming it);
             a symbolic link to a directory is refused by name rather than followed
- `jsonl`    a `.jsonl` file (or a directory of them): one JSON object per line, the document is its
             `text_field` string; blank lines are skipped, anything else bad is an error naming
             file and line
- `parquet`  a `.parquet` file (or a directory of them): the `text_field` column, read one row
             group at a time with pyarrow
- `hf`       a Hugging Face `datasets` directory (`Dataset.save_to_disk`): its `state.json` lists
             the Arrow stream files, read batch by batch with pyarrow (the `datasets` package is
             not needed)
- `default`  (src == "default") the Python standard library's `.py` sources without site-packages
             and test directories, capped at DEFAULT_MAX_BYTES; its content depends on the Python
             build, so its dataset version does too

Auto-detection of a directory: `state.json` + `dataset_info.json` -> hf (a DatasetDict's
`dataset_dict.json`: refused, naming its splits); every data file ends in `.jsonl` -> jsonl; every
one in `.parquet` -> parquet; .jsonl or .parquet files mixed with others: refused (pass --format);
otherwise text.

`max_bytes` keeps the first `max_bytes` bytes of the document stream (the last document is cut).
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from resilient_jax.data.errors import DatasetError, give, option

DEFAULT_SOURCE = "default"
DEFAULT_MAX_BYTES = 8 * 2**20
FORMATS = ("auto", "text", "jsonl", "parquet", "hf")
_EXTENSIONS = {".jsonl": "jsonl", ".parquet": "parquet"}
_STDLIB_SKIP_DIRS = frozenset({
    "site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
})
_PARQUET_BATCH_ROWS = 1024


@dataclass(frozen=True)
class Document:
    where: str  # "rel/path" or "file.jsonl:LINE", for messages
    data: bytes


def iter_documents(
    src: str | os.PathLike, fmt: str = "auto", text_field: str = "text", max_bytes: int | None = None
) -> Iterator[Document]:
    """The source's documents in their deterministic order, cut to `max_bytes` in total."""
    if fmt not in FORMATS:
        raise DatasetError(f"unknown {option('--format')} {fmt!r}; use one of: {', '.join(FORMATS)}")
    if str(src) == DEFAULT_SOURCE:
        root = Path(sysconfig.get_paths()["stdlib"])
        # The interpreter's own sources: a file that is not UTF-8 text is skipped, not an error of yours.
        docs = _text_files(root, _walk(root, skip_dirs=_STDLIB_SKIP_DIRS, suffix=".py", links=True), strict=False)
        max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    else:
        root = Path(src)
        if not root.exists():
            raise DatasetError(f"source {root} does not exist; {give('--src', 'DIR')}, FILE.jsonl, FILE.parquet "
                               "or default")
        fmt = detect_format(root) if fmt == "auto" else fmt
        docs = _READERS[fmt](root, text_field)
    yield from _capped(docs, max_bytes, root)


def detect_format(root: Path) -> str:
    if root.is_file():
        if root.suffix in _EXTENSIONS:
            return _EXTENSIONS[root.suffix]
        raise DatasetError(f"cannot tell the format of {root} from its extension {root.suffix or '(none)'!r}; "
                           f"{give('--format', 'text')} to read it as one text document, or {give('--format', 'jsonl')} / parquet")
    if (root / "state.json").is_file() and (root / "dataset_info.json").is_file():
        return "hf"
    if (root / "dataset_dict.json").is_file():  # DatasetDict.save_to_disk: one save_to_disk folder per split
        splits = sorted(p.name for p in root.iterdir() if (p / "state.json").is_file())
        raise DatasetError(f"{root} is a Hugging Face DatasetDict (splits: {', '.join(splits) or 'none found'}); "
                           f"use one split's folder: {give('--src', str(root / (splits[0] if splits else 'train')))}")
    files = _walk(root, skip_dirs=frozenset(), suffix="")
    suffixes = {Path(p).suffix for p in files}
    if len(suffixes) == 1 and (only := suffixes.pop()) in _EXTENSIONS:
        return _EXTENSIONS[only]
    data_files = [p for p in files if Path(p).suffix in _EXTENSIONS]
    if data_files:  # read as text, the JSON or Parquet bytes themselves would become the training text
        others = [p for p in files if Path(p).suffix not in _EXTENSIONS]
        kinds = sorted({_EXTENSIONS[Path(p).suffix] for p in data_files})
        raise DatasetError(f"{root} holds {', '.join(kinds)} files ({data_files[0]}, ...) and other files "
                           f"({others[0]}{', ...' if len(others) > 1 else ''}); {give('--format', kinds[0])} to read "
                           f"only its .{kinds[0]} files, or {give('--format', 'text')} to read every file as text")
    return "text"


def _files(root: Path, suffix: str) -> list[Path]:
    if root.is_file():
        return [root]
    return [root / rel for rel in _walk(root, skip_dirs=frozenset(), suffix=suffix)]


def _walk(root: Path, skip_dirs: frozenset[str], suffix: str, *, links: bool = False) -> list[str]:
    """Every non-hidden regular file under root ending in `suffix`, as sorted relative POSIX paths.
    A symbolic link to a directory is not followed (it could loop, or reach out of the source):
    with links=False it is refused by name, so its files are never dropped without a word."""
    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        linked = [d for d in dirnames if (Path(dirpath) / d).is_symlink()]
        if linked and not links:
            path = Path(dirpath) / linked[0]
            raise DatasetError(f"{path} is a symbolic link to a directory, which is not followed (a link could "
                               f"loop or leave the source); pass the directory it points to ({os.path.realpath(path)}) "
                               "as its own dataset, or copy its files in")
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:
            if name.startswith(".") or not name.endswith(suffix):
                continue
            if (Path(dirpath) / name).is_file():
                rel_paths.append((rel_dir / name).as_posix())
    # Sorting the POSIX strings fixes the order regardless of os.walk's listing order.
    return sorted(rel_paths)


def _read_text_dir(root: Path, text_field: str) -> Iterator[Document]:
    if root.is_file():  # one text file: one document
        return _text_files(root.parent, [root.name])
    return _text_files(root, _walk(root, skip_dirs=frozenset(), suffix=""))


def _text_files(root: Path, rel_paths: list[str], strict: bool = True) -> Iterator[Document]:
    """One document per file. strict: a file that is not UTF-8 text is an error naming it (a corpus
    with a Latin-1 or binary file lost it from the dataset without a word); empty files add nothing."""
    for rel in rel_paths:
        data = (root / rel).read_bytes()
        if not data:
            continue
        problem = _not_text(data)
        if problem is None:
            yield Document(rel, data)
        elif strict:
            raise DatasetError(f"{root / rel} is not UTF-8 text ({problem}); convert it to UTF-8 (e.g. iconv -f "
                               f"latin1 -t utf-8) or move it out of {option('--src')}")


def _read_jsonl(root: Path, text_field: str) -> Iterator[Document]:
    for path in _files(root, ".jsonl"):
        with open(path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise DatasetError(f"{where}: not valid JSON ({e}); fix or remove the line") from None
                if not isinstance(obj, dict) or text_field not in obj:
                    keys = ", ".join(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
                    raise DatasetError(f"{where}: no text field {text_field!r} (has: {keys}); "
                                       f"{give('--text-field', 'NAME')}")
                yield Document(where, _text_value(obj[text_field], where, text_field))


def _read_parquet(root: Path, text_field: str) -> Iterator[Document]:
    pq = _pyarrow("parquet").parquet
    for path in _files(root, ".parquet"):
        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # pyarrow's ArrowInvalid and friends
            raise DatasetError(f"{path}: not a readable parquet file ({e})") from None
        with pf:  # closed also when the consumer stops early (a size cap, an error downstream)
            batches = (batch for group in range(pf.num_row_groups)  # one row group in memory at a time
                       for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, row_groups=[group],
                                                    columns=[text_field]))
            yield from _arrow_docs(path, pf.schema_arrow.names, batches, text_field)


def _read_hf_dir(root: Path, text_field: str) -> Iterator[Document]:
    ipc = _pyarrow("hf").ipc
    state_path = root / "state.json"
    try:
        files = [root / f["filename"] for f in json.loads(state_path.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DatasetError(f"{state_path}: not a Hugging Face save_to_disk state.json ({e!r}); "
                           f"point {option('--src')} at a directory written by Dataset.save_to_disk") from None
    for path in files:  # in state.json's order: the dataset's row order
        try:
            reader = ipc.open_stream(path)
        except Exception as e:
            raise DatasetError(f"{path}: not a readable Arrow stream file ({e})") from None
        with reader:
            yield from _arrow_docs(path, reader.schema.names, reader, text_field)


def _arrow_docs(path: Path, columns: list[str], batches, text_field: str) -> Iterator[Document]:
    """The `text_field` strings of Arrow record batches, one document per row."""
    if text_field not in columns:
        raise DatasetError(f"{path}: no column {text_field!r} (columns: {', '.join(columns)}); "
                           f"{give('--text-field', 'NAME')}")
    row = 0
    for batch in batches:
        for value in batch.column(text_field).to_pylist():
            where = f"{path}:row {row}"
            yield Document(where, _text_value(value, where, text_field))
            row += 1


def _text_value(value: object, where: str, text_field: str) -> bytes:
    if not isinstance(value, str):
        if value is None:  # the field is right; this row has no text
            raise DatasetError(f"{where}: field {text_field!r} is null; remove the row or give it text")
        raise DatasetError(f"{where}: field {text_field!r} is {type(value).__name__}, not a string; "
                           f"{give('--text-field', 'NAME')} naming a text field")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON's "\ud83d" escape without its pair decodes to a lone surrogate
        raise DatasetError(f"{where}: field {text_field!r} holds invalid Unicode (a lone surrogate "
                           f"{value[e.start]!r} at character {e.start}); fix or remove it") from None


def _pyarrow(fmt: str):
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DatasetError(f"{option('--format')} {fmt} needs the 'pyarrow' package, which is not installed; "
                           "pip install 'resilient_jax[data]' (or pyarrow)") from None
    return pyarrow


def _capped(docs: Iterator[Document], max_bytes: int | None, root: Path) -> Iterator[Document]:
    total = 0
    for doc in docs:
        if max_bytes is not None and total >= max_bytes:
            return
        data = doc.data if max_bytes is None else doc.data[: max_bytes - total]
        if not data:
            continue
        total += len(data)
        yield Document(doc.where, data)
    if total == 0:
        raise DatasetError(f"source {root} has no text (text files: UTF-8, no NUL bytes, not hidden; "
                           f"jsonl/parquet: non-empty text fields); point {option('--src')} at some text")


def _not_text(data: bytes) -> str | None:
    """Why `data` is not text (a NUL byte, invalid UTF-8: where), or None."""
    if (nul := data.find(b"\x00")) >= 0:
        return f"a NUL byte at byte {nul}: binary?"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"invalid UTF-8 at byte {e.start}"
    return None


_READERS = {"text": _read_text_dir, "jsonl": _read_jsonl, "parquet": _read_parquet, "hf": _read_hf_dir}
