"""Build hook: record the git commit a wheel is built from (resilient_jax/_build_info.py).

Everything else about the package is declared in pyproject.toml. An installed wheel has no .git,
so checkpoints written by it learn their commit sha from this generated module
(see resilient_jax/provenance.py).
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _provenance():
    # Loaded from its file: importing the package here would need its runtime dependencies.
    spec = importlib.util.spec_from_file_location("_rj_provenance", ROOT / "resilient_jax" / "provenance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithCommit(build_py):
    def run(self):
        super().run()
        provenance = _provenance()
        info = provenance.git_info(ROOT) or {"commit": None, "dirty": None}
        target = Path(self.build_lib) / "resilient_jax" / provenance.BUILD_INFO_MODULE
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(provenance.build_info_source(info))


setup(cmdclass={"build_py": BuildPyWithCommit})
