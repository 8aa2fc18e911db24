"""The commit manifest: a crc32c of every file a restore reads, written after orbax's commit.

Orbax commits a step by renaming `<step>.orbax-checkpoint-tmp.../` to `<step>/`. That rename says
"every item was written", not "these bytes are the ones written": a flipped byte in
`optimizer/_METADATA` or in an OCDBT data file still loads (or fails deep inside orbax). So, once
orbax has committed, each process hashes the files IT wrote and records them in
`<step>/commit/process_<i>.json` (written to a temporary name, fsynced, renamed):

    process i     files under `ocdbt.process_<i>/` and `array_metadatas/process_<i>`
    process 0     also every other file (orbax metadata, the merged `manifest.ocdbt`, `d/`, the
                  JSON fields, orbax's markers; `_sharding` in checkpoints written before it was dropped)

A step is COMMITTED when `commit/process_0.json` and one file per process it names exist; only
such steps are listed for resume. A process killed before writing its commit file leaves a step
directory that no reader lists and the next writer removes. Each commit file carries a crc32c of
its own canonical JSON, so a flipped byte in it is named too.

Standard library + google-crc32c only (the framework-free reader imports this).
"""

from __future__ import annotations

import json
import os
import re
import stat
import uuid
from pathlib import Path
from typing import Any

import google_crc32c

COMMIT_DIR = "commit"
COMMIT_VERSION = 1
HASH = "crc32c"
_CHUNK = 8 << 20
# Per-process outputs of orbax: `ocdbt.process_<i>/...` (OCDBT data), `array_metadatas/process_<i>`.
_PROCESS_PART = re.compile(r"^(?:ocdbt\.)?process_(\d+)$")


class CommitError(ValueError):
    """A step directory whose commit manifest is missing, unreadable, or disagrees with a file."""

    def __init__(self, relpath: str, problem: str):
        self.relpath = relpath
        self.problem = problem
        super().__init__(f"{relpath}: {problem}")


def commit_file(step_dir: Path, process: int) -> Path:
    return Path(step_dir) / COMMIT_DIR / f"process_{process}.json"


def file_crc32c(path: Path) -> tuple[int, str]:
    """(size in bytes, crc32c as 8 hex digits) of a file, read in 8 MiB chunks."""
    checksum = google_crc32c.Checksum()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            checksum.update(chunk)
            size += len(chunk)
    return size, checksum.digest().hex()


def owner(relpath: str) -> int:
    """The process that writes (and hashes) a file of the step directory."""
    for part in relpath.split("/"):
        match = _PROCESS_PART.match(part)
        if match:
            return int(match.group(1))
    return 0


def step_files(step_dir: Path) -> list[str]:
    """Every file of a step directory except the commit manifest, as sorted '/'-joined relative paths."""
    step_dir = Path(step_dir)
    out = []
    for dirpath, _, filenames in os.walk(step_dir):
        rel_dir = Path(dirpath).relative_to(step_dir).as_posix()
        if rel_dir == COMMIT_DIR or rel_dir.startswith(COMMIT_DIR + "/"):
            continue
        for name in filenames:
            out.append(name if rel_dir == "." else f"{rel_dir}/{name}")
    return sorted(out)


def _self_crc(doc: dict[str, Any]) -> str:
    body = {k: v for k, v in doc.items() if k != "self_crc32c"}
    return google_crc32c.Checksum(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).digest().hex()


def build(step_dir: Path, step: int, process: int, process_count: int) -> dict[str, Any]:
    """The commit document of `process`: its files' sizes and crc32c."""
    files = {}
    for rel in step_files(step_dir):
        if owner(rel) == process:
            size, crc = file_crc32c(Path(step_dir) / rel)
            files[rel] = {"bytes": size, HASH: crc}
    doc = {"commit_version": COMMIT_VERSION, "step": int(step), "process": process,
           "process_count": process_count, "hash": HASH, "files": files}
    doc["self_crc32c"] = _self_crc(doc)
    return doc


def write(step_dir: Path, step: int, process: int, process_count: int) -> Path:
    """Hashes this process's files and commits them: temporary name, fsync, rename, fsync the dir."""
    return write_built(step_dir, process, build(step_dir, step, process, process_count))


def write_built(step_dir: Path, process: int, doc: dict[str, Any]) -> Path:
    """Commits `doc` (build's) as this process's commit file: temporary name, fsync, rename, fsync the dir."""
    target = commit_file(step_dir, process)
    target.parent.mkdir(exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        json.dump(doc, f, sort_keys=True, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    _fsync_dir(target.parent)
    _fsync_dir(Path(step_dir))
    return target


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_one(step_dir: Path, process: int) -> dict[str, Any]:
    path = commit_file(step_dir, process)
    rel = path.relative_to(step_dir).as_posix()
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CommitError(rel, "is missing (the save never committed on this process)") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CommitError(rel, f"is not readable JSON ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
        raise CommitError(rel, "is not a commit manifest (no 'files' object)")
    if doc.get("self_crc32c") != _self_crc(doc):
        raise CommitError(rel, "does not match its own crc32c (edited or corrupt)")
    if doc.get("commit_version") != COMMIT_VERSION or doc.get("hash") != HASH:
        raise CommitError(rel, f"commit_version {doc.get('commit_version')!r} / hash {doc.get('hash')!r} "
                               f"is not supported (this reader reads {COMMIT_VERSION} / {HASH})")
    if doc.get("process") != process:
        raise CommitError(rel, f"says it is process {doc.get('process')!r}'s")
    # Its self-crc32c is no seal against an edit: a listed "/dev/zero" or "../../etc/shadow" would
    # hang verify, or answer questions about files outside the checkpoint.
    outside = next((name for name in doc["files"] if not _inside(name)), None)
    if outside is not None:
        raise CommitError(rel, f"lists {outside!r}, which is not a file inside the step directory (edited)")
    return doc


def _inside(relpath: str) -> bool:
    """A relative path that names something under the step directory: no "/" first, no "." or "..".
    (Symbolic links on the way are refused when the file is read: `check_files`.)"""
    return isinstance(relpath, str) and all(part not in ("", ".", "..") for part in relpath.split("/"))


def read(step_dir: str | Path) -> dict[str, dict[str, Any]]:
    """{relative path: {bytes, crc32c}} over every process's commit file; CommitError if incomplete."""
    step_dir = Path(step_dir)
    first = _read_one(step_dir, 0)
    count = first.get("process_count")
    if not isinstance(count, int) or count < 1:
        raise CommitError(commit_file(step_dir, 0).relative_to(step_dir).as_posix(),
                          f"has no valid process_count ({count!r})")
    files = dict(first["files"])
    for process in range(1, count):
        doc = _read_one(step_dir, process)
        files.update(doc["files"])
    if step_dir.name.isdigit() and int(step_dir.name) != first.get("step"):
        raise CommitError(commit_file(step_dir, 0).relative_to(step_dir).as_posix(),
                          f"is for step {first['step']}, not {step_dir.name}")
    return files


def is_committed(step_dir: str | Path) -> bool:
    """Cheap: every process's commit file is present (contents are checked by `check_files`)."""
    step_dir = Path(step_dir)
    try:
        count = json.loads(commit_file(step_dir, 0).read_bytes()).get("process_count")
    except (OSError, ValueError, AttributeError):
        # Present but unreadable still counts: verify names the file instead of hiding the step.
        return commit_file(step_dir, 0).is_file()
    if not isinstance(count, int):
        return True
    return all(commit_file(step_dir, p).is_file() for p in range(1, count))


def _resolves_under(path: Path, step_dir: Path) -> bool:
    return os.path.realpath(path).startswith(os.path.realpath(step_dir) + os.sep)


def check_files(step_dir: str | Path, files: dict[str, dict[str, Any]],
                select=lambda rel: True) -> list[CommitError]:
    """Problems (empty = none) of the listed files that `select` keeps: missing, resized, other crc32c;
    plus files a restore would read that no commit file lists."""
    step_dir = Path(step_dir)
    problems = []
    for rel, entry in sorted(files.items()):
        if not select(rel):
            continue
        path = step_dir / rel
        try:
            # Only files the save wrote: a link (to a device, or out of the checkpoint) is refused unread.
            if not stat.S_ISREG(os.lstat(path).st_mode) or not _resolves_under(path, step_dir):
                problems.append(CommitError(rel, "is not a regular file inside the step directory (a link?)"))
                continue
            size, crc = file_crc32c(path)
        except FileNotFoundError:
            problems.append(CommitError(rel, "is missing"))
            continue
        except OSError as e:
            problems.append(CommitError(rel, f"is unreadable ({e.strerror or e})"))
            continue
        if size != entry["bytes"]:
            problems.append(CommitError(rel, f"is {size} bytes, the commit manifest says {entry['bytes']}"))
        elif crc != entry[HASH]:
            problems.append(CommitError(rel, "does not match its crc32c in the commit manifest (corrupt)"))
    for rel in step_files(step_dir):
        if rel not in files and select(rel):
            problems.append(CommitError(rel, "is not in the commit manifest (added after the commit)"))
    return problems
