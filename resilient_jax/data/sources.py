"""Which text goes into a dataset, and in which order.

The walk is deterministic: every candidate file under the source directory, sorted by its relative
POSIX path (not by the file system's listing order), read as raw bytes, no timestamps or absolute
paths involved. An optional byte cap keeps the first `max_bytes` of that stream (the last file is
cut), so the same directory gives the same text on any machine.

- A user directory: every non-hidden regular file that is text (valid UTF-8, no NUL byte).
- `default`: the Python standard library's `.py` sources (`sysconfig.get_paths()["stdlib"]`)
  without site-packages and test directories, capped at DEFAULT_MAX_BYTES so preparing takes
  seconds. Its content depends on the Python build, so its dataset version does too.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from resilient_jax.data.errors import DatasetError

DEFAULT_SOURCE = "default"
DEFAULT_MAX_BYTES = 8 * 2**20
_STDLIB_SKIP_DIRS = frozenset({
    "site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
})


@dataclass(frozen=True)
class SourceText:
    rel_path: str
    data: bytes


def collect_texts(src: str | os.PathLike, max_bytes: int | None = None) -> list[SourceText]:
    """The source's text files in sorted relative-path order, cut to `max_bytes` in total.

    `src == "default"` means the standard library (and `max_bytes=None` means DEFAULT_MAX_BYTES).
    """
    if str(src) == DEFAULT_SOURCE:
        root = Path(sysconfig.get_paths()["stdlib"])
        candidates = _walk(root, skip_dirs=_STDLIB_SKIP_DIRS, suffix=".py")
        max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    else:
        root = Path(src)
        if not root.is_dir():
            raise DatasetError(f"source directory {root} does not exist; pass --src DIR or --src default")
        candidates = _walk(root, skip_dirs=frozenset(), suffix="")
    texts = _read_capped(root, candidates, max_bytes)
    if not texts:
        raise DatasetError(
            f"source directory {root} has no text files (UTF-8, no NUL bytes, not hidden); "
            "point --src at a directory of text"
        )
    return texts


def _walk(root: Path, skip_dirs: frozenset[str], suffix: str) -> list[str]:
    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:
            if name.startswith(".") or not name.endswith(suffix):
                continue
            if (Path(dirpath) / name).is_file():
                rel_paths.append((rel_dir / name).as_posix())
    # Sorting the POSIX strings fixes the order regardless of os.walk's listing order.
    return sorted(rel_paths)


def _read_capped(root: Path, rel_paths: list[str], max_bytes: int | None) -> list[SourceText]:
    texts: list[SourceText] = []
    total = 0
    for rel in rel_paths:
        if max_bytes is not None and total >= max_bytes:
            break
        data = (root / rel).read_bytes()
        if not data or not _is_text(data):
            continue
        if max_bytes is not None:
            data = data[: max_bytes - total]
        texts.append(SourceText(rel, data))
        total += len(data)
    return texts


def _is_text(data: bytes) -> bool:
    if b"\x00" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
