"""RunHistory: what every invocation of a run did, kept in `<run.dir>/run_history.json`.

summary.json describes the whole run, not only the last invocation, so the figures that span
invocations are kept here: one entry per invocation (the step it started from and why, the
completed steps it reached, its wall, train and compile seconds, how it ended), plus the loss of
step 1. The file is rewritten after every step (a small JSON, written to a temporary file and
renamed over the old one), so a crash -- even SIGKILL -- loses at most the step in flight and
never leaves a torn file. Each invocation owns its own entry, so resuming from an older
checkpoint never counts a second time what an earlier invocation did.

Derived figures (see `totals`):
    restarts    resumes whose previous invocation did not stop cleanly (it crashed, was killed or
                failed). A clean stop is the run finishing, --stop-at, SIGTERM or SIGINT: each
                commits a checkpoint of the step it stopped at, so continuing is not a restart.
    steps_lost  completed steps that had to be recomputed: for every resume, the steps the
                previous invocation completed past the step resumed from (a crash at step 73 with
                a checkpoint at 50 loses 23; resuming at 50 again after reaching only 60 loses 10).
A fresh start (no checkpoint) after a finished run begins a new history; after an unfinished one
it is a resume from step 0 (a crash before the first checkpoint loses every step it ran).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FILENAME = "run_history.json"
FORMAT_VERSION = 1
DONE = "done"  # how a finished invocation ended; clean stops record their reason (stop_at, ...)
CRASH = "crash"  # the reason given for a resume whose previous invocation recorded no end


@dataclass
class Invocation:
    started_at: float  # unix time
    start_step: int  # completed steps of the state it started from
    checkpoint: str | None = None  # the checkpoint it resumed from, if any
    reason: str | None = None  # how the previous invocation ended, if this one continues a run
    last_step: int = 0  # completed steps reached so far
    wall_seconds: float = 0.0
    train_seconds: float = 0.0  # inside training steps (compile excluded)
    compile_seconds: float = 0.0
    data_wait_seconds: float = 0.0
    tokens: int = 0  # tokens trained on, recomputed steps included
    last_loss: float | None = None  # the loss of step `last_step`, if this invocation ran it
    ended: str | None = None  # None while running, or if it died without stopping cleanly


@dataclass
class RunHistory:
    path: Path | None  # None: not the writer (another process of the run writes the file)
    first_loss: float | None = None
    invocations: list[Invocation] = field(default_factory=list)
    _t0: float = field(default_factory=time.perf_counter, repr=False)

    @classmethod
    def load(cls, run_dir: Path, *, enabled: bool = True) -> RunHistory:
        if not enabled:
            return cls(path=None)
        path = Path(run_dir) / FILENAME
        if not path.is_file():
            return cls(path=path)
        try:
            data = json.loads(path.read_text())
            return cls(path=path, first_loss=data.get("first_loss"),
                       invocations=[Invocation(**entry) for entry in data.get("invocations", [])])
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a run history ({e}); move it away to start its history anew") from None

    # -- recording (the writer process only) -------------------------------------------------

    def begin(self, start_step: int, checkpoint: str | Path | None = None,
              started: float | None = None) -> Invocation:
        """A new invocation starts training from `start_step` completed steps; `started`: its
        time.perf_counter() at start-up, so its wall seconds include restoring and compiling."""
        previous = self.invocations[-1] if self.invocations else None
        if previous is not None and start_step == 0 and previous.ended == DONE:
            self.first_loss, self.invocations = None, []  # a new run over a finished one's directory
            previous = None
        reason = None
        if previous is not None:
            reason = previous.ended or CRASH
        elif checkpoint is not None:
            reason = "unknown"  # a checkpoint without a history (copied in, or an older version's run)
        self._t0 = time.perf_counter() if started is None else started
        entry = Invocation(started_at=time.time(), start_step=start_step,
                           checkpoint=None if checkpoint is None else str(checkpoint), reason=reason,
                           last_step=start_step)
        self.invocations.append(entry)
        self.save()
        return entry

    @property
    def current(self) -> Invocation:
        return self.invocations[-1]

    def step_done(self, step: int, loss: float, seconds: float, data_wait: float, tokens: int) -> None:
        """Step `step` (1-based: the run now has `step` completed steps) took `seconds`."""
        entry = self.current
        entry.last_step = step
        entry.train_seconds += seconds
        entry.data_wait_seconds += data_wait
        entry.tokens += tokens
        entry.last_loss = loss
        if step == 1:
            self.first_loss = loss
        self.save()

    def compiled(self, seconds: float) -> None:
        self.current.compile_seconds += seconds
        self.save()

    def end(self, how: str | None) -> None:
        """How this invocation ended: DONE or a clean stop's reason (stop_at, preempted, ...), each of
        which committed a checkpoint first; None for a failure (the next resume is a restart)."""
        self.current.ended = how
        self.save()

    def save(self) -> None:
        if self.path is None or not self.invocations:
            return
        self.current.wall_seconds = time.perf_counter() - self._t0
        data = {"format_version": FORMAT_VERSION, "first_loss": self.first_loss,
                "invocations": [asdict(entry) for entry in self.invocations]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(self.path)

    # -- what summary.json reports ---------------------------------------------------------------

    def resumes(self) -> list[dict[str, Any]]:
        out = []
        for previous, entry in zip(self.invocations, self.invocations[1:]):
            out.append({"step": entry.start_step, "reason": entry.reason, "checkpoint": entry.checkpoint,
                        "steps_lost": max(0, previous.last_step - entry.start_step),
                        "restart": entry.reason == CRASH, "at": entry.started_at})
        first = self.invocations[0] if self.invocations else None
        if first is not None and first.checkpoint is not None:  # resumed from a checkpoint of unknown history
            out.insert(0, {"step": first.start_step, "reason": first.reason, "checkpoint": first.checkpoint,
                           "steps_lost": 0, "restart": False, "at": first.started_at})
        return out

    def final_loss(self) -> float | None:
        """The loss of the run's newest completed step, whichever invocation ran it (a rerun of a
        finished run runs no step, but its summary still names the run's final loss)."""
        if not self.invocations:
            return None
        final_step = self.current.last_step
        for entry in reversed(self.invocations):
            if entry.last_step == final_step and entry.last_loss is not None:
                return entry.last_loss
        return None

    def totals(self) -> dict[str, Any]:
        resumes = self.resumes()
        return {
            "first_loss": self.first_loss,
            "final_loss": self.final_loss(),
            "wall_seconds": sum(e.wall_seconds for e in self.invocations),
            "train_seconds": sum(e.train_seconds for e in self.invocations),
            "compile_seconds": sum(e.compile_seconds for e in self.invocations),
            "data_wait_seconds": sum(e.data_wait_seconds for e in self.invocations),
            "tokens": sum(e.tokens for e in self.invocations),
            "invocations": len(self.invocations),
            "resumed_from": resumes,
            "restarts": sum(1 for r in resumes if r["restart"]),
            "steps_lost": sum(r["steps_lost"] for r in resumes),
        }

