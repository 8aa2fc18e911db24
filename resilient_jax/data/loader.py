"""HostBatchLoader: one host's rows of every step's global batch, prefetched in the background.

A background thread reads steps start_step, start_step+1, ... (see `reader.BatchReader`) into a
queue of depth `prefetch`; when training is slower than loading, the thread blocks on the full
queue, so memory stays flat at `prefetch` batches (+ the one being read).

Control from the training thread:
- `quarantine(shard, from_step)` adds an event (see `order`), drops every prefetched batch and
  continues from min(next step, from_step): the step that hit the bad shard is re-read with its
  samples resampled from healthy shards. (Dropping batches before from_step too is simpler than
  picking them out, and re-reading them gives identical batches.)
- `seek(step)` drops the prefetched batches and continues at `step`.
- `position()` is the DataPosition of the next batch `__next__` will return (identical on every
  host); `from_position` resumes from one with any host count.

Each reset bumps a generation number; batches of an older generation still in flight are dropped
by the consumer, so no stale batch is ever returned.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from resilient_jax.data.errors import DatasetError
from resilient_jax.data.manifest import Manifest, check_files, load_manifest, verify_files
from resilient_jax.data.order import GlobalOrder, QuarantineEvent
from resilient_jax.data.position import DataPosition
from resilient_jax.data.reader import Batch, BatchReader

_POLL_S = 0.05  # how often a blocked thread re-checks for close/reset


class HostBatchLoader:
    def __init__(
        self,
        dataset: Manifest | str | os.PathLike,
        *,
        seed: int,
        global_batch: int,
        rows: tuple[int, int] | None = None,
        start_step: int = 0,
        quarantine: Iterable[QuarantineEvent | Mapping[str, int]] = (),
        prefetch: int = 2,
        poison: Mapping[int, int] | None = None,
        verify: bool = False,
    ):
        """`rows` = [lo, hi) of the global batch this host holds (`order.host_rows`); default all.

        Opening fast-checks the shard files (sizes); `verify=True` re-hashes them as well.
        """
        self.manifest = _open(dataset, verify)
        self.rows = _check_rows(rows or (0, global_batch), global_batch)
        if prefetch < 1:
            raise DatasetError(f"prefetch must be >= 1, got {prefetch}")
        if start_step < 0:
            raise DatasetError(f"start_step must be >= 0, got {start_step}")
        self._order = GlobalOrder.for_manifest(self.manifest, seed, global_batch, quarantine)
        self._reader = BatchReader(self.manifest, self.rows, poison)
        self._queue: queue.Queue[tuple[int, Batch | Exception]] = queue.Queue(maxsize=prefetch)
        self._lock = threading.Condition()
        self._generation = 0
        self._next_step = start_step  # what __next__ returns next
        self._read_step = start_step  # what the thread reads next
        self._error: Exception | None = None  # a failed read, re-raised by __next__ until a reset
        self._closed = False
        self.batches_read = 0
        self.wait_seconds = 0.0  # time __next__ spent blocked waiting for the reader (data wait)
        self._thread = threading.Thread(target=self._produce, name="HostBatchLoader", daemon=True)
        self._thread.start()

    @classmethod
    def from_position(
        cls,
        dataset: Manifest | str | os.PathLike,
        position: DataPosition | Mapping[str, Any],
        *,
        seed: int,
        global_batch: int,
        rows: tuple[int, int] | None = None,
        prefetch: int = 2,
        poison: Mapping[int, int] | None = None,
        verify: bool = False,
    ) -> HostBatchLoader:
        """Resumes at a saved position; refuses another dataset version or global batch."""
        manifest = _open(dataset, verify)
        if not isinstance(position, DataPosition):
            position = DataPosition.from_dict(position)
        order = GlobalOrder.for_manifest(manifest, seed, global_batch, position.quarantine)
        position.check_against(order, manifest.version, manifest.tokenizer_sha256)
        return cls(manifest, seed=seed, global_batch=global_batch, rows=rows, start_step=position.step,
                   quarantine=position.quarantine, prefetch=prefetch, poison=poison)

    # -- consumer side (the training thread) ------------------------------------------------

    def __iter__(self) -> HostBatchLoader:
        return self

    def __next__(self) -> Batch:
        started = time.perf_counter()
        try:
            return self._next()
        finally:
            self.wait_seconds += time.perf_counter() - started

    def _next(self) -> Batch:
        while True:
            with self._lock:
                if self._closed:
                    raise StopIteration
                if self._error is not None:
                    raise self._error
            try:
                generation, item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and not self._closed:
                    raise RuntimeError("HostBatchLoader's reader thread stopped unexpectedly")
                continue
            with self._lock:
                if generation != self._generation:
                    continue  # read before the last seek/quarantine
                if isinstance(item, Exception):
                    self._error = item
                    raise item
                assert item.step == self._next_step, (item.step, self._next_step)
                self._next_step = item.step + 1
                return item

    def position(self) -> DataPosition:
        with self._lock:
            return DataPosition.at(self._order, self.manifest.version, self._next_step,
                                   self.manifest.tokenizer_sha256)

    @property
    def order(self) -> GlobalOrder:
        with self._lock:
            return self._order

    def seek(self, step: int) -> None:
        if step < 0:
            raise DatasetError(f"seek step must be >= 0, got {step}")
        with self._lock:
            self._reset(step, self._order)

    def reassign(self, rows: tuple[int, int], from_step: int) -> None:
        """Read rows `rows` (empty: none) of every step from `from_step` on (an uneven shard
        assignment moved this host's shards)."""
        rows = _check_rows(rows, self._order.global_batch)
        with self._lock:
            self.rows = rows
            self._reset(from_step, self._order)

    def quarantine(self, shard: int, from_step: int) -> None:
        with self._lock:
            order = self._order.with_quarantine(shard, from_step)  # validates before any change
            self._reset(min(self._next_step, from_step), order)

    def buffered(self) -> int:
        """Batches read ahead and waiting in the queue (never more than `prefetch`)."""
        return self._queue.qsize()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._drain()
        self._thread.join(timeout=10 * _POLL_S + 5)
        self._reader.close()

    def __enter__(self) -> HostBatchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _reset(self, step: int, order: GlobalOrder) -> None:
        """Caller holds the lock."""
        self._generation += 1
        self._order = order
        self._next_step = self._read_step = step
        self._error = None
        self._drain()
        self._lock.notify_all()

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    # -- producer side (the background thread) ----------------------------------------------

    def _produce(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                generation, step, order, rows = self._generation, self._read_step, self._order, self.rows
                self._read_step += 1
            try:
                item: Batch | Exception = self._reader.read(order, step, rows)
                self.batches_read += 1
            except Exception as e:  # handed to the training thread, raised by __next__
                item = e
            self._offer(generation, item)
            if isinstance(item, Exception):
                self._park(generation)

    def _offer(self, generation: int, item: Batch | Exception) -> None:
        while True:
            try:
                self._queue.put((generation, item), timeout=_POLL_S)
                return
            except queue.Full:
                with self._lock:
                    if self._closed or generation != self._generation:
                        return

    def _park(self, generation: int) -> None:
        """After a failed read, wait for a reset (or close) instead of reading on past the error."""
        with self._lock:
            while generation == self._generation and not self._closed:
                self._lock.wait(timeout=_POLL_S)


def _open(dataset: Manifest | str | os.PathLike, verify: bool) -> Manifest:
    manifest = dataset if isinstance(dataset, Manifest) else load_manifest(dataset)
    (verify_files if verify else check_files)(manifest)
    return manifest


def _check_rows(rows: tuple[int, int], global_batch: int) -> tuple[int, int]:
    lo, hi = rows
    # lo == hi: a host that holds no virtual shard (it reads nothing)
    if not 0 <= lo <= hi <= global_batch:
        raise DatasetError(f"rows must satisfy 0 <= lo <= hi <= global_batch {global_batch}, got [{lo}, {hi})")
    return int(lo), int(hi)
