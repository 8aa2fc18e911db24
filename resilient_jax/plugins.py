"""Resolve a config's `"package.module:name"` plug-in (model.factory, task.loss) to the callable it names.

The module is imported from the Python path with `task.import_dir` (by default the directory of the
config file, made absolute at load) put first for the duration of the import, so a `my_model.py`
next to the config works, in every process of a run: elastic workers receive the resolved config,
import_dir included. Every failure is one `ConfigError` line naming the key and what to fix.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Callable

from resilient_jax.config import ConfigError


def load_callable(spec: str, key: str, import_dir: str = "") -> Callable:
    """The callable named by `spec` ("package.module:name", dots allowed in name for attributes)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"config key {key}: expected \"package.module:name\", got {spec!r}")
    try:
        # The framework's own modules never need the user's directory: importing them with it first
        # on sys.path would let a stray file there shadow one of their dependencies.
        with _on_path("" if module_name.split(".")[0] == "resilient_jax" else import_dir):
            module = importlib.import_module(module_name)
    except ImportError as e:
        where = f"task.import_dir {import_dir} and the Python path" if import_dir else "the Python path"
        raise ConfigError(f"config key {key}: cannot import module {module_name!r} (looked in {where}): {e}") from None
    except Exception as e:  # the user's module failed while importing (a SyntaxError names file and line)
        raise ConfigError(f"config key {key}: importing module {module_name!r} raised {type(e).__name__}: {e}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"config key {key}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"config key {key}: {spec} is a {type(obj).__name__}, not a callable")
    return obj


@contextlib.contextmanager
def _on_path(directory: str):
    """`directory` first on sys.path while the block runs (then sys.path is as it was)."""
    if not directory:
        yield
        return
    sys.path.insert(0, directory)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(directory)
