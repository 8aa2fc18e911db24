"""The held-out evaluation set: which samples every evaluation reads, in which batches.

Two sources (config section `eval`):
- `holdout_shards: N` -- the last N shards of the training dataset. They leave the training order
  from step 0, as quarantine events with from_step 0 (the mechanism `data.quarantine` uses), so no
  training step ever sees them; they show in the data position's quarantine list;
- `dataset: DIR` -- a dataset of its own, prepared with the training data's tokenizer and seq_len.

The samples are taken in global-id order and cut into `batches` batches of data.global_batch: the
same batches at every evaluation, so evaluations are comparable along the run, and a function of
(dataset version, source, global batch) alone, so they do not depend on the host count.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from resilient_jax.config import EvalConfig
from resilient_jax.data.errors import DatasetError
from resilient_jax.data.manifest import MANIFEST_NAME, Manifest, load_manifest, verify_files
from resilient_jax.data.order import QuarantineEvent


@dataclass(frozen=True)
class EvalSet:
    manifest: Manifest  # where the samples are read from
    sample_ids: np.ndarray  # int64 [batches * global_batch], in the order the batches take them
    global_batch: int
    batches: int
    source: str  # "holdout" or "dataset"

    def batch_ids(self, batch: int) -> np.ndarray:
        B = self.global_batch
        return self.sample_ids[batch * B:(batch + 1) * B]

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "dataset": str(self.manifest.root), "dataset_version": self.manifest.version,
                "batches": self.batches, "samples": int(self.sample_ids.size)}


def holdout_shard_ids(num_shards: int, holdout: int) -> list[int]:
    """The shards `eval.holdout_shards` holds out: the last ones of the dataset."""
    if not 0 <= holdout < num_shards:
        raise DatasetError(f"config key eval.holdout_shards: the dataset has {num_shards} shards and training "
                           f"needs at least one, so at most {num_shards - 1} can be held out, got {holdout}")
    return list(range(num_shards - holdout, num_shards))


def holdout_quarantine(num_shards: int, holdout: int) -> tuple[QuarantineEvent, ...]:
    """The held-out shards as quarantine events from step 0: the training order leaves them out."""
    return tuple(QuarantineEvent(s, 0) for s in holdout_shard_ids(num_shards, holdout)) if holdout else ()


def check_held_out(position_quarantine, holdout: tuple[QuarantineEvent, ...]) -> None:
    """A resume must not hold out shards its run has trained on: each shard eval.holdout_shards
    names now must be in the saved position's quarantine from step 0. (Fewer held-out shards than
    before is fine: the others stay out of training, as they were.)"""
    trained_on = sorted(e.shard for e in holdout if e not in set(position_quarantine))
    if trained_on:
        raise DatasetError(
            f"config key eval.holdout_shards: the run being resumed trained on shard(s) "
            f"{', '.join(map(str, trained_on))}, so evaluating on them would measure training data; resume with "
            "the eval.holdout_shards the run started with, or start a new run.dir")


def build_eval_set(cfg: EvalConfig, train: Manifest, global_batch: int, verified: Manifest | None = None, *,
                   verify: bool = True) -> EvalSet | None:
    """The eval set of a run (None when it evaluates nothing). `verified`: an eval dataset this
    process hashed already (an elastic worker's earlier world): then only its identity is checked;
    `verify=False`: no hashing at all (start-up checks, before the run verifies it)."""
    if not cfg.every_steps:
        return None
    if cfg.holdout_shards:
        bounds = train.shard_bounds
        first = holdout_shard_ids(len(train.shards), cfg.holdout_shards)[0]
        ids = np.arange(bounds[first], bounds[-1], dtype=np.int64)
        return _cut(train, ids, global_batch, cfg.batches, "holdout", f"eval.holdout_shards ({cfg.holdout_shards})")
    manifest = open_eval_dataset(cfg.dataset, verified, verify=verify)
    check_compatible(manifest, train)
    ids = np.arange(manifest.num_records, dtype=np.int64)
    return _cut(manifest, ids, global_batch, cfg.batches, "dataset", f"eval.dataset {manifest.root}")


def open_eval_dataset(path: str, verified: Manifest | None = None, *, verify: bool = True) -> Manifest:
    root = Path(path)
    if not (root / MANIFEST_NAME).is_file():
        what = "does not exist" if not root.exists() else f"holds no dataset ({MANIFEST_NAME})"
        raise DatasetError(f"config key eval.dataset: {root} {what}; prepare it with `python -m resilient_jax.data "
                           f"prepare --src TEXT --out {root}` and the training data's --tokenizer and --seq-len")
    manifest = load_manifest(root)
    if verify and (verified is None or verified.root != manifest.root or verified.version != manifest.version):
        verify_files(manifest)
    return manifest


def check_compatible(evalset: Manifest, train: Manifest) -> None:
    """The eval dataset must speak the training data's tokens: same tokenizer, same sequence length."""
    where = f"config key eval.dataset: {evalset.root}"
    same_file = (evalset.tokenizer_sha256 == train.tokenizer_sha256 if evalset.tokenizer_sha256 and
                 train.tokenizer_sha256 else True)
    if evalset.tokenizer != train.tokenizer or not same_file:
        raise DatasetError(
            f"{where} was prepared with tokenizer {evalset.tokenizer} (sha256 {evalset.tokenizer_sha256 or '-'}), "
            f"the training data with {train.tokenizer} (sha256 {train.tokenizer_sha256 or '-'}); prepare it "
            "again with the training data's --tokenizer")
    if evalset.seq_len != train.seq_len:
        raise DatasetError(f"{where} has seq_len {evalset.seq_len}, the training data {train.seq_len}; prepare "
                           f"it again with --seq-len {train.seq_len}")
    trained = {shard.sha256 for shard in train.shards}
    shared = [shard.file for shard in evalset.shards if shard.sha256 in trained]
    if shared:  # the same dataset, or shards of it: "held-out" loss would be measured on training data
        what = "is the training dataset" if len(shared) == len(evalset.shards) else f"shares {', '.join(shared)} with it"
        raise DatasetError(f"{where} {what} (the same shard contents), so its loss would not be held out; "
                           "prepare held-out text into its own dataset, or set eval.holdout_shards instead")


def _cut(manifest: Manifest, ids: np.ndarray, global_batch: int, batches: int, source: str, what: str) -> EvalSet:
    full = ids.size // global_batch
    if full == 0:
        raise DatasetError(f"{what}: holds {ids.size} samples, fewer than one global batch "
                           f"(data.global_batch {global_batch}); hold out more data")
    if batches > full:
        raise DatasetError(f"config key eval.batches: {batches} batches of {global_batch} need "
                           f"{batches * global_batch} samples, {what} holds {ids.size}; set eval.batches <= {full} "
                           "(0 = every full batch)")
    batches = batches or full
    ids = ids[:batches * global_batch].copy()
    ids.flags.writeable = False
    return EvalSet(manifest=manifest, sample_ids=ids, global_batch=global_batch, batches=batches, source=source)
