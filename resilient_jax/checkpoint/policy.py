"""SavePolicy: when to save and which checkpoints to keep, with an injected clock.

Pure bookkeeping, no I/O, so tests drive it with a fake clock. Steps here count completed steps:
a checkpoint "at step s" holds the state after s updates and resumes by computing step s next.

- save when s is a multiple of `every_steps`, or `every_seconds` have passed since the last save
  (or since the run started); either rule alone, or both, or neither (then only the final step
  and a preemption save);
- keep the newest `keep_last` checkpoints (0 = all) plus every multiple of `keep_every`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from resilient_jax.config import CheckpointConfig, ConfigError


@dataclass
class SavePolicy:
    every_steps: int = 0
    every_seconds: float = 0.0
    keep_last: int = 0
    keep_every: int = 0
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    _last_save: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for key in ("every_steps", "keep_last", "keep_every"):
            if getattr(self, key) < 0:
                raise ConfigError(f"checkpoint.{key} must be >= 0 (0 = off), got {getattr(self, key)}")
        if self.every_seconds < 0:
            raise ConfigError(f"checkpoint.every_seconds must be >= 0 (0 = off), got {self.every_seconds}")

    @classmethod
    def from_config(cls, cfg: CheckpointConfig, clock: Callable[[], float] = time.monotonic) -> SavePolicy:
        return cls(every_steps=cfg.every_steps, every_seconds=cfg.every_seconds, keep_last=cfg.keep_last,
                   keep_every=cfg.keep_every, clock=clock)

    def start(self) -> None:
        """The timer for `every_seconds` starts at the beginning (or resumption) of a run."""
        self._last_save = self.clock()

    def due(self, step: int) -> bool:
        """Whether the checkpoint at `step` (completed steps) is due under the step or time rule."""
        if self.every_steps and step % self.every_steps == 0:
            return True
        if self.every_seconds:
            if self._last_save is None:
                self.start()
            return self.clock() - self._last_save >= self.every_seconds
        return False

    def saved(self, step: int) -> None:
        del step
        self._last_save = self.clock()

    def keep(self, steps: Iterable[int]) -> set[int]:
        """The steps to keep out of the committed ones; the newest is always kept."""
        ordered = sorted(set(steps))
        if not ordered:
            return set()
        kept = set(ordered if self.keep_last == 0 else ordered[-self.keep_last:])
        if self.keep_every:
            kept |= {s for s in ordered if s % self.keep_every == 0}
        kept.add(ordered[-1])
        return kept
