"""Reference reader of resilient_jax checkpoints: the standard library, numpy, tensorstore and
google-crc32c only (with `commit.py`, which it imports).

It defines the on-disk format (version 2, specified in runbooks/checkpoint-format.md) from the
reading side: where each of the seven fields lives, how arrays are named, which files the commit
manifest covers, and what makes a step directory committed. No jax, flax, optax or orbax here, so
these two files can be copied into another framework to read a checkpoint; the writer (`store.py`)
imports its constants from here.

    problems = verify("runs/x/checkpoints/40")    # every file's crc32c + a structural dry-run
    ckpt = load("runs/x/checkpoints/40")          # verifies the files first by default
    ckpt.weights["blocks"]["0"]["attn"]["wq"]      # numpy array
    ckpt.data["step"], ckpt.topology["mesh"], ckpt.provenance["commit"]
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

from resilient_jax.checkpoint import commit
from resilient_jax.checkpoint.commit import COMMIT_DIR, CommitError

FORMAT_VERSION = 2
ARRAY_FIELDS = ("weights", "optimizer")
CONTEXT_FIELDS = ("rng", "data", "config", "topology", "provenance")
FIELDS = ARRAY_FIELDS + CONTEXT_FIELDS
# The index written in orbax's commit: format version, array shapes and dtypes, per-context sha256.
MANIFEST = "manifest"
# Orbax writes a step into `<step>.orbax-checkpoint-tmp...` and renames it when complete.
TMP_MARKER = ".orbax-checkpoint-tmp"

# Keys each context field must carry (more are allowed).
REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "rng": ("seed", "impl", "base_key_data", "next_step"),
    "data": ("step", "global_offset", "epoch", "dataset_version", "quarantine"),
    "config": ("hash", "config", "history"),
    "topology": ("generation", "process_count", "devices_per_host", "hosts", "mesh", "history"),
    "provenance": ("commit", "dirty", "version", "history"),
    MANIFEST: ("format_version", "step", "fields", "process_count", "arrays", "context_sha256"),
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is one line naming the checkpoint and field."""

    def __init__(self, path: str | Path, field_name: str, problem: str):
        self.path = str(path)
        self.field = field_name
        self.problem = problem
        super().__init__(f"checkpoint {path}: {field_name}: {problem}")


# -- names and checksums ---------------------------------------------------------------------------


def context_file(step_dir: Path, name: str) -> Path:
    """`<step>/<name>/<name>.json` for the five context fields and the manifest."""
    return Path(step_dir) / name / f"{name}.json"


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace, ASCII: the bytes that context checksums and the config hash cover."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def json_sha256(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj)).hexdigest()


def field_of(relpath: str) -> str:
    """The field a file of a step directory belongs to ("step" for orbax's top-level files)."""
    head = relpath.split("/", 1)[0]
    return head if head in (*FIELDS, MANIFEST, COMMIT_DIR) else "step"


def commit_problem(step_dir: Path, error: CommitError) -> CheckpointError:
    return CheckpointError(step_dir, field_of(error.relpath), str(error))


# -- finding step directories ----------------------------------------------------------------------


def is_step_dir(path: Path) -> bool:
    return path.is_dir() and path.name.isdigit()


def list_steps(root: str | Path) -> list[int]:
    """Committed step directories under a checkpoint root, ascending: orbax renamed them into place
    AND every process wrote its commit file (temporary and uncommitted ones excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if is_step_dir(p) and commit.is_committed(p))


# What a step directory of ours holds: orbax's metadata and commit marker, the commit manifest, one
# item per field. A numbered directory holding anything else was not written here.
STEP_ENTRIES = frozenset({"_CHECKPOINT_METADATA", "commit_success.txt", commit.COMMIT_DIR, MANIFEST,
                          *ARRAY_FIELDS, *CONTEXT_FIELDS})


def written_here(step_dir: Path) -> bool:
    """Every entry of the numbered directory is one a save of ours writes (an empty one too: what a
    removal killed at its end leaves)."""
    return all(e.name in STEP_ENTRIES or TMP_MARKER in e.name for e in step_dir.iterdir())


def foreign_dirs(root: str | Path) -> list[Path]:
    """Numbered directories under a checkpoint root that no save of ours wrote (a job's output, a
    scratch folder): never listed, never removed -- the store refuses a root that holds one."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if is_step_dir(p) and not written_here(p))


def uncommitted_dirs(root: str | Path) -> list[Path]:
    """Step directories orbax renamed into place whose commit manifest was never completed (the
    writer was killed between the two). Checkpoints of format 1 (no commit manifest) and numbered
    directories no save of ours wrote are not listed here: they are not ours to remove."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.iterdir()):
        if is_step_dir(p) and not commit.is_committed(p) and written_here(p):
            try:
                legacy = json.loads(context_file(p, MANIFEST).read_text()).get("format_version") == 1
            except (OSError, ValueError, AttributeError):
                legacy = False
            if not legacy:
                out.append(p)
    return out


def temporary_dirs(root: str | Path) -> list[Path]:
    """Leftovers of saves that never committed (the writer was killed or failed mid-save)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if TMP_MARKER in p.name)


def missing_field(step_dir: Path) -> tuple[str, str] | None:
    """(field, problem) for the first field of a step directory that is absent; None if all are there.

    Cheap (no array is read): the check made before offering a checkpoint for resume.
    """
    step_dir = Path(step_dir)
    if not commit.commit_file(step_dir, 0).is_file():
        return COMMIT_DIR, f"{COMMIT_DIR}/process_0.json is missing (the save never committed)"
    for name in ARRAY_FIELDS:
        for part in ("_METADATA", "manifest.ocdbt"):
            if not (step_dir / name / part).is_file():
                return name, f"{name}/{part} is missing"
    for name in (*CONTEXT_FIELDS, MANIFEST):
        if not context_file(step_dir, name).is_file():
            return name, f"{name}/{name}.json is missing"
    return None


def newest_complete(root: str | Path, below: int | None = None) -> int | None:
    """The newest step (optionally < `below`) whose fields are all present."""
    for step in reversed(list_steps(root)):
        if below is not None and step >= below:
            continue
        if missing_field(Path(root) / str(step)) is None:
            return step
    return None


def resolve(path: str | Path) -> Path:
    """A step directory, or a checkpoint root (-> its newest committed step)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(path, "path", "does not exist")
    if is_step_dir(path) or (path / MANIFEST).exists():
        return path
    steps = list_steps(path)
    if not steps:
        inner = path / "checkpoints"  # a run.dir: its checkpoints are one level down (checkpoint.dir's default)
        hint = f"; a run directory? its checkpoints are in {inner}" if inner.is_dir() and list_steps(inner) else ""
        raise CheckpointError(path, "path", f"holds no committed checkpoint step directories{hint}")
    return path / str(steps[-1])


# -- reading -----------------------------------------------------------------------------------------


def read_json(step_dir: Path, name: str) -> dict[str, Any]:
    path = context_file(step_dir, name)
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(step_dir, name, f"{name}/{name}.json is missing") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(step_dir, name, f"{name}/{name}.json is not readable JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(step_dir, name, f"{name}/{name}.json is not a JSON object")
    missing = [k for k in REQUIRED_KEYS[name] if k not in obj]
    if missing:
        raise CheckpointError(step_dir, name, f"{name}/{name}.json lacks key(s) {', '.join(missing)}")
    return obj


def read_manifest(step_dir: str | Path) -> dict[str, Any]:
    step_dir = Path(step_dir)
    manifest = read_json(step_dir, MANIFEST)
    if manifest["format_version"] != FORMAT_VERSION:
        raise CheckpointError(step_dir, MANIFEST, f"format_version {manifest['format_version']!r} is not "
                                                  f"supported (this reader reads {FORMAT_VERSION})")
    if sorted(manifest["fields"]) != sorted(FIELDS):
        raise CheckpointError(step_dir, MANIFEST, f"lists fields {manifest['fields']}, expected {list(FIELDS)}")
    return manifest


def read_context(step_dir: str | Path, manifest: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """The five context fields, each checked against its sha256 in the manifest."""
    step_dir = Path(step_dir)
    manifest = manifest if manifest is not None else read_manifest(step_dir)
    out = {}
    for name in CONTEXT_FIELDS:
        obj = read_json(step_dir, name)
        expected = manifest["context_sha256"].get(name)
        if json_sha256(obj) != expected:
            raise CheckpointError(step_dir, name, f"{name}/{name}.json does not match its sha256 in the "
                                                  "manifest (edited or corrupt)")
        out[name] = obj
    _check_consistent(step_dir, manifest, out)
    return out


def _check_consistent(step_dir: Path, manifest: dict[str, Any], context: dict[str, dict[str, Any]]) -> None:
    """Cross-field facts a writer always makes true; an edit that kept the checksums still fails here."""
    config = context["config"]
    if hashlib.sha256(canonical_json(config["config"])).hexdigest() != config["hash"]:
        raise CheckpointError(step_dir, "config", "the recorded hash is not the sha256 of the recorded config")
    if context["data"]["step"] != manifest["step"]:
        raise CheckpointError(step_dir, "data", f"step {context['data']['step']} != manifest step {manifest['step']}")
    if is_step_dir(step_dir) and int(step_dir.name) != manifest["step"]:
        raise CheckpointError(step_dir, MANIFEST, f"step {manifest['step']} != directory name {step_dir.name}")


def _open_array(item_dir: Path, name: str) -> ts.TensorStore:
    spec = {
        "driver": "zarr",
        # A spec, not a "file://" URL: a URL would read '%41' in a directory name as 'A' (another
        # directory's arrays) and cut the path at '#' or '?'.
        "kvstore": {"driver": "ocdbt", "base": {"driver": "file", "path": f"{item_dir.resolve()}/"}},
        "path": name,
    }
    return ts.open(spec, open=True, read=True).result()


def read_array(step_dir: str | Path, field_name: str, name: str, entry: dict[str, Any] | None = None) -> np.ndarray:
    """One array of an array field by its dotted name (every chunk decoded); shape and dtype checked
    against its manifest entry if given. The bytes were checked by `verify_files`."""
    step_dir = Path(step_dir)
    try:
        array = np.asarray(_open_array(step_dir / field_name, name).read().result())
    except Exception as e:  # tensorstore raises ValueError/OSError variants; all mean "unreadable"
        problem = str(e).splitlines()[0]
        problem = problem if len(problem) <= 300 else problem[:297] + "..."
        raise CheckpointError(step_dir, field_name, f"array {name} is unreadable ({problem})") from None
    if entry is not None:
        if list(array.shape) != list(entry["shape"]) or str(array.dtype) != entry["dtype"]:
            raise CheckpointError(step_dir, field_name, f"array {name} is {array.dtype}{list(array.shape)}, "
                                                        f"manifest says {entry['dtype']}{entry['shape']}")
    return array


def check_array_structure(step_dir: Path, field_name: str, manifest: dict[str, Any]) -> list[CheckpointError]:
    """A restore's dry run for one array field, allocating no array: orbax's `_METADATA` names
    exactly the manifest's arrays, and each array's zarr metadata (read through OCDBT) has the
    manifest's shape and dtype."""
    step_dir = Path(step_dir)
    entries = manifest["arrays"][field_name]
    meta_path = step_dir / field_name / "_METADATA"
    try:
        tree = json.loads(meta_path.read_bytes())["tree_metadata"]
        # Empty subtrees (optax's EmptyState) are recorded as skipped values; they hold no array.
        names = {".".join(str(k["key"]) for k in value["key_metadata"]) for value in tree.values()
                 if not value["value_metadata"].get("skip_deserialize")}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        return [CheckpointError(step_dir, field_name, f"{field_name}/_METADATA is not orbax tree metadata ({e!r})")]
    if names != set(entries):
        extra, lacking = sorted(names - set(entries)), sorted(set(entries) - names)
        return [CheckpointError(step_dir, field_name, f"{field_name}/_METADATA disagrees with the manifest "
                                                      f"(only in _METADATA: {extra[:3]}, only in the manifest: {lacking[:3]})")]
    problems = []
    for name, entry in entries.items():
        try:
            store = _open_array(step_dir / field_name, name)
        except Exception as e:  # tensorstore raises ValueError/OSError variants; all mean "unreadable"
            problems.append(CheckpointError(step_dir, field_name, f"array {name} metadata is unreadable "
                                                                  f"({str(e).splitlines()[0][:300]})"))
            continue
        shape, dtype = list(store.shape), str(np.dtype(store.dtype.numpy_dtype))
        if shape != list(entry["shape"]) or dtype != entry["dtype"]:
            problems.append(CheckpointError(step_dir, field_name, f"array {name} is {dtype}{shape}, manifest "
                                                                  f"says {entry['dtype']}{entry['shape']}"))
    return problems


def verify_files(step_dir: str | Path, select=lambda rel: True) -> list[CheckpointError]:
    """crc32c of every file the commit manifest lists (that `select` keeps); [] = all as written."""
    step_dir = Path(step_dir)
    try:
        files = commit.read(step_dir)
    except CommitError as e:
        return [commit_problem(step_dir, e)]
    return [commit_problem(step_dir, e) for e in commit.check_files(step_dir, files, select)]


def read_arrays(step_dir: str | Path, field_name: str, manifest: dict[str, Any] | None = None, *,
                verify: bool = True) -> dict[str, Any]:
    """Every array of `weights` or `optimizer` as nested dicts keyed by path components (strings)."""
    step_dir = Path(step_dir)
    manifest = manifest if manifest is not None else read_manifest(step_dir)
    tree: dict[str, Any] = {}
    for name, entry in manifest["arrays"][field_name].items():
        array = read_array(step_dir, field_name, name, entry if verify else None)
        node = tree
        for key in entry["path"][:-1]:
            node = node.setdefault(key, {})
        node[entry["path"][-1]] = array
    return tree


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {"a.b.c": leaf} (the dotted names the manifest and tensorstore use)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


@dataclass
class Checkpoint:
    path: Path
    step: int
    manifest: dict[str, Any]
    weights: dict[str, Any]
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    data: dict[str, Any]
    config: dict[str, Any]
    topology: dict[str, Any]
    provenance: dict[str, Any]


def load(path: str | Path, *, verify: bool = True) -> Checkpoint:
    """All seven fields of a step directory (or of a checkpoint root's newest step); `verify`
    checks every file's crc32c first."""
    step_dir = resolve(path)
    missing = missing_field(step_dir)
    if missing:
        raise CheckpointError(step_dir, *missing)
    if verify:
        problems = verify_files(step_dir)
        if problems:
            raise problems[0]
    manifest = read_manifest(step_dir)
    context = read_context(step_dir, manifest)
    arrays = {name: read_arrays(step_dir, name, manifest, verify=verify) for name in ARRAY_FIELDS}
    return Checkpoint(path=step_dir, step=manifest["step"], manifest=manifest, **arrays, **context)


def verify(path: str | Path, *, deep: bool = False) -> list[CheckpointError]:
    """Every problem found in a step directory (empty = it restores, and restores these bytes).

    The crc32c of every file the commit manifest lists (and no unlisted file), the manifest and
    context fields, then a structural dry-run of each array field. `deep` also reads every array
    (every chunk decompressed and decoded to the manifest's shape and dtype).
    """
    try:
        step_dir = resolve(path)
    except CheckpointError as e:
        return [e]
    problems = verify_files(step_dir)
    if problems:
        return problems  # the files are not the ones written: the checks below would only echo that
    try:
        missing = missing_field(step_dir)
        if missing:
            return [CheckpointError(step_dir, *missing)]
        manifest = read_manifest(step_dir)
        read_context(step_dir, manifest)
    except CheckpointError as e:
        return [e]
    for name in ARRAY_FIELDS:
        problems.extend(check_array_structure(step_dir, name, manifest))
    if deep and not problems:
        for name in ARRAY_FIELDS:
            for array_name, entry in manifest["arrays"][name].items():
                try:
                    read_array(step_dir, name, array_name, entry)
                except CheckpointError as e:
                    problems.append(e)
    return problems

