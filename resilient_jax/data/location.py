"""Where a run's dataset lives, and whether a run may build it there.

`data.dataset: ""` is the default dataset in the cache ($RESILIENT_JAX_CACHE, else
~/.cache/resilient_jax), built on first use. A directory the user names is their dataset: if it
holds none, that is an error naming it (most likely a typo or a dataset not prepared yet) unless
`data.build_if_missing: true` asks for it to be built there.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from resilient_jax.config import TOKENIZER_FILE_KINDS, DataConfig
from resilient_jax.data.errors import DatasetError
from resilient_jax.data.manifest import MANIFEST_NAME, load_manifest
from resilient_jax.data.sources import DEFAULT_SOURCE


def cache_dir() -> Path:
    return Path(os.environ.get("RESILIENT_JAX_CACHE", Path.home() / ".cache" / "resilient_jax"))


def dataset_dir(cfg: DataConfig) -> Path:
    """The dataset directory of `cfg` (the configured one, or the default dataset's in the cache)."""
    if cfg.dataset:
        return Path(cfg.dataset)
    if cfg.src != DEFAULT_SOURCE:
        raise DatasetError("data.dataset is required when data.src is not 'default' (the directory to build it in)")
    # "hf:/a/tok.json" -> "hf__a_tok.json": one directory name (the tokenizer's sha256 is checked anyway).
    tokenizer = re.sub(r"[^A-Za-z0-9._-]", "_", cfg.tokenizer)
    return cache_dir() / "datasets" / f"{cfg.src}-{tokenizer}-s{cfg.shards}-L{cfg.seq_len}"


def check_buildable(cfg: DataConfig) -> Path:
    """The dataset directory, refusing a named directory without a dataset unless it may be built."""
    path = dataset_dir(cfg)
    if path.exists() and not path.is_dir():
        raise DatasetError(f"data.dataset {path} is a file, not a dataset directory; set data.dataset to the "
                           "directory `python -m resilient_jax.data prepare --out` made")
    if cfg.dataset and not cfg.build_if_missing and not (path / MANIFEST_NAME).is_file():
        what = "does not exist" if not path.exists() else f"holds no dataset ({MANIFEST_NAME})"
        raise DatasetError(
            f"data.dataset {path} {what}; build it with `python -m resilient_jax.data prepare --src {cfg.src} "
            f"--out {path} --shards {cfg.shards} --seq-len {cfg.seq_len}{_build_flags(cfg)}`, "
            "or set data.build_if_missing: true to build it there on first run"
        )
    return path


def _build_flags(cfg: DataConfig) -> str:
    """The prepare flags for the config's non-default source format, text field and tokenizer."""
    flags = [("--format", cfg.format, "auto"), ("--text-field", cfg.text_field, "text"),
             ("--tokenizer", cfg.tokenizer, "bytes")]
    return "".join(f" {flag} {value}" for flag, value, default in flags if value != default)


def check_prepared_as_configured(cfg: DataConfig, path: Path, model_vocab_size: int | None = None) -> None:
    """A dataset already prepared at `path` has the config's data.shards, data.seq_len and
    data.tokenizer (and, given the built-in model's `model_vocab_size`, fits its vocabulary), or one
    line names every key that differs with the dataset's value (to set it to), so a dataset of your
    own trains at the first correction, not the third."""
    if not (path / MANIFEST_NAME).is_file():
        return
    from resilient_jax.data.tokenizer import get_tokenizer

    manifest, tokenizer = load_manifest(path), get_tokenizer(cfg.tokenizer)
    differ = []
    if len(manifest.shards) != cfg.shards:
        differ.append(f"data.shards={len(manifest.shards)} (not {cfg.shards})")
    if manifest.seq_len != cfg.seq_len:
        differ.append(f"data.seq_len={manifest.seq_len} (not {cfg.seq_len})")
    if (manifest.tokenizer, manifest.tokenizer_sha256 or tokenizer.sha256) != (tokenizer.name, tokenizer.sha256):
        # A file tokenizer is named by its kind only in the manifest; its file is known by its hash.
        prepared = (f"{manifest.tokenizer}:<the file it was prepared with, sha256 {manifest.tokenizer_sha256[:12]}>"
                    if manifest.tokenizer in TOKENIZER_FILE_KINDS and manifest.tokenizer_sha256 else manifest.tokenizer)
        differ.append(f"data.tokenizer={prepared} (not {cfg.tokenizer})")
    # Named with the data keys only when one of them differs (alone, the data is fine: the Trainer
    # names model.vocab_size by itself, as for a dataset built on the first run).
    if differ and model_vocab_size is not None and manifest.vocab_size > model_vocab_size:
        differ.append(f"model.vocab_size={manifest.vocab_size} or more (not {model_vocab_size})")
    if differ:
        raise DatasetError(f"data.dataset {path} was prepared with other settings: set {', '.join(differ)}, or "
                           "point data.dataset at another directory")
