"""The provenance field's commit sha: right in a git checkout and in an installed wheel alike."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from resilient_jax import provenance

from conftest import REPO


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def test_source_checkout_reports_git_head():
    info = provenance.code_provenance()
    assert info["source"] == "git" and info["commit"] == _git("rev-parse", "HEAD", cwd=REPO)
    assert isinstance(info["dirty"], bool) and info["version"] == provenance.package_version()


def test_untracked_copy_inside_a_checkout_is_not_that_checkout(tmp_path):
    # A wheel installed into a venv that sits inside some git work tree: its files are not tracked.
    _git("init", "-q", cwd=tmp_path)
    (tmp_path / "resilient_jax").mkdir()
    (tmp_path / "resilient_jax" / "__init__.py").write_text("")
    assert provenance.git_info(tmp_path) is None


def test_build_info_and_direct_url_fallbacks(tmp_path, monkeypatch):
    sha = "0123456789abcdef0123456789abcdef01234567"
    (tmp_path / provenance.BUILD_INFO_MODULE).write_text(provenance.build_info_source({"commit": sha, "dirty": False}))
    monkeypatch.setattr(provenance, "_PACKAGE_DIR", tmp_path)
    assert provenance._from_build_info() == {"commit": sha, "dirty": False}

    class FakeDist:
        def read_text(self, name):
            assert name == "direct_url.json"
            return json.dumps({"url": "https://example.invalid/r.git", "vcs_info": {"vcs": "git", "commit_id": sha}})

    monkeypatch.setattr(provenance.importlib.metadata, "distribution", lambda name: FakeDist())
    assert provenance._from_direct_url() == {"commit": sha, "dirty": False}


@pytest.mark.slow
def test_installed_wheel_reports_the_commit_it_was_built_from(tmp_path):
    """Builds a wheel from a fresh one-commit copy of the work tree, installs it elsewhere, asks it."""
    src = tmp_path / "src"
    files = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=REPO).split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    _git("init", "-q", cwd=src)
    _git("add", "-A", cwd=src)
    _git("-c", "user.email=t@example.invalid", "-c", "user.name=t", "commit", "-qm", "snapshot", cwd=src)
    sha = _git("rev-parse", "HEAD", cwd=src)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(src), "-w", str(tmp_path / "dist")],
                           capture_output=True, text=True)
    if build.returncode != 0:
        # pip's isolated build fetches setuptools from the package index; without one, say so.
        pytest.skip(f"could not build a wheel here (no package index?): {build.stderr.strip().splitlines()[-1:]}")
    wheel = next((tmp_path / "dist").glob("resilient_jax-*.whl"))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from resilient_jax import provenance as p; "
            "print(json.dumps({'file': p.__file__, **p.code_provenance()}))")
    out = json.loads(subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True,
                                    check=True, cwd=tmp_path).stdout)
    assert out["file"].startswith(str(site))
    assert out["source"] == "build_info" and out["commit"] == sha and out["dirty"] is False
