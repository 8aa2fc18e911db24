"""Which code is running: the commit sha, a dirty flag and the package version.

Checkpoints record this (their provenance field) so a resume under other code is noticed. The
answer must be right both in a git checkout and in an installed wheel, where there is no `.git`:

1. git -- when this package's own files are tracked by the enclosing work tree (a source checkout
   or an editable install). A wheel installed into a venv that happens to sit inside some git
   checkout is not mistaken for that checkout: its files are not tracked there.
2. `resilient_jax/_build_info.py` -- written into the wheel by `setup.py`'s build_py hook from the
   git checkout it was built from; it describes exactly the files installed next to it.
3. `direct_url.json` (PEP 610) -- `pip install git+URL@REV` records `vcs_info.commit_id`.
4. Otherwise unknown: commit None, and the caller warns.

Standard library only, so the build hook can import it without JAX installed.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import re
import subprocess
from pathlib import Path
from typing import Any

PACKAGE = "resilient_jax"
BUILD_INFO_MODULE = "_build_info.py"
_SHA = re.compile(r"^[0-9a-f]{40}$")
_PACKAGE_DIR = Path(__file__).resolve().parent


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def git_info(source_dir: Path) -> dict[str, Any] | None:
    """{"commit", "dirty"} of the git work tree holding `source_dir`'s package, or None.

    None unless `source_dir/resilient_jax/__init__.py` is tracked, so an untracked copy inside an
    unrelated checkout does not borrow that checkout's sha. Dirty = tracked files modified or
    untracked, non-ignored files present (either changes the code that runs).
    """
    marker = source_dir / PACKAGE / "__init__.py"
    if _git(["ls-files", "--error-unmatch", str(marker)], source_dir) is None:
        return None
    commit = (_git(["rev-parse", "HEAD"], source_dir) or "").strip()
    if not _SHA.match(commit):
        return None
    status = _git(["status", "--porcelain"], source_dir)
    return {"commit": commit, "dirty": None if status is None else bool(status.strip())}


def build_info_source(info: dict[str, Any]) -> str:
    """The text of `_build_info.py` for a wheel built from a checkout described by `info`."""
    return (
        '"""Written by setup.py at build time: the git commit this package was built from."""\n\n'
        f"COMMIT = {info.get('commit')!r}\n"
        f"DIRTY = {info.get('dirty')!r}\n"
    )


def _from_build_info() -> dict[str, Any] | None:
    path = _PACKAGE_DIR / BUILD_INFO_MODULE
    if not path.is_file():
        return None
    # Parsed, not imported, so a malformed file cannot run code or break the import of the package.
    values = dict(re.findall(r"^(COMMIT|DIRTY) = (.+)$", path.read_text(), flags=re.M))
    commit = values.get("COMMIT", "None").strip("'\"")
    dirty = {"True": True, "False": False}.get(values.get("DIRTY", "None"))
    if not _SHA.match(commit):
        return None
    return {"commit": commit, "dirty": dirty}


def _from_direct_url() -> dict[str, Any] | None:
    try:
        text = importlib.metadata.distribution(PACKAGE).read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return None
    if not text:
        return None
    try:
        commit = json.loads(text).get("vcs_info", {}).get("commit_id", "")
    except (ValueError, AttributeError):
        return None
    if not _SHA.match(commit or ""):
        return None
    return {"commit": commit, "dirty": False}


def package_version() -> str:
    from resilient_jax import __version__

    return __version__


@functools.lru_cache(maxsize=1)
def code_provenance() -> dict[str, Any]:
    """{"commit": 40-hex or None, "dirty": bool or None, "version", "source"} of the running code."""
    for source, find in (
        ("git", lambda: git_info(_PACKAGE_DIR.parent)),
        ("build_info", _from_build_info),
        ("direct_url", _from_direct_url),
    ):
        info = find()
        if info is not None:
            return {**info, "version": package_version(), "source": source}
    return {"commit": None, "dirty": None, "version": package_version(), "source": "unknown"}


def library_versions() -> dict[str, str | None]:
    """Versions of the libraries whose behaviour the bits depend on."""
    return dict(_library_versions())


@functools.lru_cache(maxsize=1)
def _library_versions() -> tuple[tuple[str, str | None], ...]:
    # Read once per process: the libraries loaded cannot change under it, and parsing their
    # metadata is ~3 ms that every checkpoint save would otherwise spend on the training thread.
    out = []
    for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tensorstore", "numpy"):
        try:
            out.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            out.append((name, None))
    return tuple(out)
