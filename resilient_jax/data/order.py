"""The global sample order: which global sample ids form the global batch of step k.

Definition (depends on seed, dataset, global batch B, quarantine events and k; never on hosts):

- **Epoch permutation.** For epoch e, pi_e is the stable argsort of N raw 64-bit draws of
  `np.random.Philox(key=[seed, e])` over all N global ids. Raw bit-generator output is fixed by the
  Philox4x64-10 algorithm, so pi_e does not move with numpy's shuffling code.
- **Quarantine.** Events are {shard, from_step}; the set active at step k is
  Q_k = {shard : from_step <= k} (per shard the earliest event counts). The eligible stream for Q is
  pi_0, pi_1, ... each with Q's samples filtered out (relative order kept), concatenated; an epoch
  of it has n_Q = N - |samples of Q| entries.
- **Batch.** The global batch of step k is positions [k*B, (k+1)*B) of the eligible stream for Q_k:
  position p is entry p mod n_Q of epoch p // n_Q. A batch that crosses an epoch boundary takes the
  end of one epoch and the start of the next; B may exceed n_Q.
- **Hosts.** Host h of H holds rows [h*B/H, (h+1)*B/H) of that batch (B % H == 0 required).

Why this satisfies the quarantine requirements: (1) every step is a pure function of the inputs;
(2) a shard's samples never appear at or after its from_step (they are not in the stream of any
k >= from_step); (3) steps before from_step see the same Q_k as without the event, so they are
unchanged, and replaying from any saved step with the same event list gives identical batches.
The price: after a quarantine the position stream of the reduced set restarts at k*B, so a few
samples of the current epoch may repeat or be skipped; each epoch still covers every healthy sample.

Scale note: one epoch permutation is materialised (8 bytes x N; a few are cached). Beyond ~10^8
samples this wants a counter-based bijection (Feistel) instead; the definition above would change.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from resilient_jax.data.errors import DatasetError

if TYPE_CHECKING:
    from resilient_jax.data.manifest import Manifest


@dataclass(frozen=True)
class QuarantineEvent:
    shard: int
    from_step: int

    def to_dict(self) -> dict[str, int]:
        return {"shard": self.shard, "from_step": self.from_step}

    @classmethod
    def from_dict(cls, d: Mapping[str, int]) -> QuarantineEvent:
        return cls(shard=int(d["shard"]), from_step=int(d["from_step"]))


def normalize_quarantine(
    events: Iterable[QuarantineEvent | Mapping[str, int]],
) -> tuple[QuarantineEvent, ...]:
    """Per shard the earliest event, sorted by (from_step, shard): one canonical list."""
    earliest: dict[int, int] = {}
    for event in events:
        if not isinstance(event, QuarantineEvent):
            event = QuarantineEvent.from_dict(event)
        earliest[event.shard] = min(event.from_step, earliest.get(event.shard, event.from_step))
    return tuple(sorted((QuarantineEvent(s, k) for s, k in earliest.items()), key=lambda e: (e.from_step, e.shard)))


@dataclass(frozen=True)
class GlobalOrder:
    """Everything the global order depends on. `shard_bounds` is Manifest.shard_bounds as a tuple."""

    shard_bounds: tuple[int, ...]
    seed: int
    global_batch: int
    quarantine: tuple[QuarantineEvent, ...] = ()

    @classmethod
    def for_manifest(
        cls,
        manifest: Manifest,
        seed: int,
        global_batch: int,
        quarantine: Iterable[QuarantineEvent | Mapping[str, int]] = (),
    ) -> GlobalOrder:
        return cls(tuple(int(b) for b in manifest.shard_bounds), seed, global_batch, tuple(quarantine))

    def __post_init__(self) -> None:
        # Canonical forms, so equal orders hash equal (the permutation caches key on them).
        object.__setattr__(self, "shard_bounds", tuple(int(b) for b in self.shard_bounds))
        object.__setattr__(self, "quarantine", normalize_quarantine(self.quarantine))
        if not 0 <= self.seed < 2**64:
            raise DatasetError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.global_batch < 1:
            raise DatasetError(f"global_batch must be >= 1, got {self.global_batch}")
        for event in self.quarantine:
            if not 0 <= event.shard < self.num_shards:
                raise DatasetError(
                    f"quarantine shard {event.shard} does not exist (dataset has {self.num_shards} shards)"
                )
            if event.from_step < 0:
                raise DatasetError(f"quarantine from_step must be >= 0, got {event.from_step} for shard {event.shard}")
        every = frozenset(e.shard for e in self.quarantine)
        if _eligible_count(self.shard_bounds, every) == 0:
            raise DatasetError(
                f"quarantining shards {sorted(every)} leaves no samples; prepare more shards or fix the data"
            )

    @property
    def num_shards(self) -> int:
        return len(self.shard_bounds) - 1

    @property
    def num_records(self) -> int:
        return self.shard_bounds[-1]

    def quarantined_at(self, step: int) -> frozenset[int]:
        return frozenset(e.shard for e in self.quarantine if e.from_step <= step)

    def with_quarantine(self, shard: int, from_step: int) -> GlobalOrder:
        return GlobalOrder(self.shard_bounds, self.seed, self.global_batch,
                           self.quarantine + (QuarantineEvent(shard, from_step),))

    def epoch_at(self, step: int) -> int:
        """The epoch of the first sample of step `step`."""
        return step * self.global_batch // _eligible_count(self.shard_bounds, self.quarantined_at(step))


def global_batch_ids(order: GlobalOrder, step: int) -> np.ndarray:
    """int64 [global_batch]: the global sample ids of step `step` (see the module docstring)."""
    if step < 0:
        raise DatasetError(f"step must be >= 0, got {step}")
    quarantined = order.quarantined_at(step)
    n = _eligible_count(order.shard_bounds, quarantined)
    ids = np.empty(order.global_batch, dtype=np.int64)
    filled, position = 0, step * order.global_batch
    while filled < order.global_batch:
        epoch, index = divmod(position, n)
        stream = _eligible_permutation(order.shard_bounds, order.seed, epoch, quarantined)
        take = min(order.global_batch - filled, n - index)
        ids[filled : filled + take] = stream[index : index + take]
        filled += take
        position += take
    return ids


def host_rows(global_batch: int, hosts: int, host: int) -> tuple[int, int]:
    """Rows [lo, hi) of the global batch held by `host` of `hosts` (contiguous, equal slices)."""
    if hosts < 1 or not 0 <= host < hosts:
        raise DatasetError(f"host must be in [0, hosts), got host={host} hosts={hosts}")
    if global_batch % hosts:
        raise DatasetError(
            f"global_batch {global_batch} is not divisible by hosts {hosts}; "
            "choose a global_batch that every supported host count divides"
        )
    per_host = global_batch // hosts
    return host * per_host, (host + 1) * per_host


def _eligible_count(shard_bounds: tuple[int, ...], quarantined: frozenset[int]) -> int:
    return shard_bounds[-1] - sum(shard_bounds[s + 1] - shard_bounds[s] for s in quarantined)


@functools.lru_cache(maxsize=4)
def _epoch_permutation(num_records: int, seed: int, epoch: int) -> np.ndarray:
    draws = np.random.Philox(key=np.array([seed, epoch], dtype=np.uint64)).random_raw(num_records)
    perm = np.argsort(draws, kind="stable").astype(np.int64)
    perm.flags.writeable = False
    return perm


@functools.lru_cache(maxsize=4)
def _eligible_permutation(
    shard_bounds: tuple[int, ...], seed: int, epoch: int, quarantined: frozenset[int]
) -> np.ndarray:
    perm = _epoch_permutation(shard_bounds[-1], seed, epoch)
    if not quarantined:
        return perm
    bounds = np.asarray(shard_bounds, dtype=np.int64)
    shard = np.searchsorted(bounds, perm, side="right") - 1
    stream = perm[~np.isin(shard, sorted(quarantined))]
    stream.flags.writeable = False
    return stream
