"""DataPosition: where the data stream stands, as a small JSON-able record for checkpoints.

It is identical on every host (nothing in it depends on the host count), so one copy goes into the
checkpoint's data-offset field and any host count can resume from it. It replaces grain's
per-process iterator state, which cannot be restored with a different process count.

`step` is the next step the loader will yield; `global_offset` (= step * global_batch, the position
in the eligible stream) and `epoch` are derived, stored so a reader can check them and so a resume
with a changed global batch is caught. `tokenizer_sha256` (the manifest's; "" in positions saved
before it existed) lets a resume with another tokenizer be refused naming both hashes, before the
dataset-version check would refuse it less helpfully.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from resilient_jax.data.errors import DatasetError
from resilient_jax.data.order import GlobalOrder, QuarantineEvent, normalize_quarantine


@dataclass(frozen=True)
class DataPosition:
    step: int
    global_offset: int
    epoch: int
    dataset_version: str
    quarantine: tuple[QuarantineEvent, ...] = ()
    tokenizer_sha256: str = ""

    @classmethod
    def at(cls, order: GlobalOrder, dataset_version: str, step: int, tokenizer_sha256: str = "") -> DataPosition:
        return cls(step, step * order.global_batch, order.epoch_at(step), dataset_version, order.quarantine,
                   tokenizer_sha256)

    def with_quarantine(self, configured: tuple[QuarantineEvent, ...]) -> DataPosition:
        """This position with the quarantine events of the config (data.quarantine) it lacks: a
        shard you quarantine when resuming is left out from its from_step on, exactly as in a run
        that had the event from the start -- when from_step is not before this position's step.
        An earlier from_step cannot be had (the steps before it trained on the shard): DatasetError."""
        since: dict[int, int] = {}  # shard -> the first step this position leaves it out
        for e in self.quarantine:
            since[e.shard] = min(since.get(e.shard, e.from_step), e.from_step)
        added = tuple(e for e in configured if since.get(e.shard, e.from_step + 1) > e.from_step)
        late = [e for e in added if e.from_step < self.step]
        if late:
            e = late[0]
            raise DatasetError(f"config key data.quarantine: shard {e.shard} from step {e.from_step} is before "
                               f"this checkpoint's step {self.step}, whose steps trained on that shard; quarantine it "
                               f"from step {self.step} or later, or start a new run (another run.dir) to leave it out "
                               "from the start")
        return replace(self, quarantine=self.quarantine + added) if added else self

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "global_offset": self.global_offset,
            "epoch": self.epoch,
            "dataset_version": self.dataset_version,
            "quarantine": [e.to_dict() for e in self.quarantine],
            "tokenizer_sha256": self.tokenizer_sha256,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DataPosition:
        try:
            return cls(
                step=int(d["step"]),
                global_offset=int(d["global_offset"]),
                epoch=int(d["epoch"]),
                dataset_version=str(d["dataset_version"]),
                quarantine=normalize_quarantine(d["quarantine"]),
                tokenizer_sha256=str(d.get("tokenizer_sha256", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise DatasetError(f"data position is malformed ({e!r}); expected keys step, global_offset, "
                               "epoch, dataset_version, quarantine") from None

    def check_against(self, order: GlobalOrder, dataset_version: str, tokenizer_sha256: str = "") -> None:
        """Refuses to resume with another tokenizer, on another dataset or with another global batch."""
        check_same_tokenizer(self.tokenizer_sha256, tokenizer_sha256)
        if self.dataset_version != dataset_version:
            raise DatasetError(
                f"data position has dataset_version {self.dataset_version[:12]}..., the dataset is "
                f"{dataset_version[:12]}...; resume with the dataset the run was started on"
            )
        if self.global_offset != self.step * order.global_batch:
            raise DatasetError(
                f"data position global_offset {self.global_offset} != step {self.step} x global_batch "
                f"{order.global_batch}; the global_batch changed since it was saved"
            )


def check_same_tokenizer(saved_sha256: str, current_sha256: str) -> None:
    """Refuses a resume whose tokenizer differs from the saved one (either unknown: nothing to check)."""
    if saved_sha256 and current_sha256 and saved_sha256 != current_sha256:
        raise DatasetError(
            f"the run was saved with tokenizer sha256 {saved_sha256}, the dataset's tokenizer is sha256 "
            f"{current_sha256}; resume with the tokenizer (and dataset) the run started on"
        )
