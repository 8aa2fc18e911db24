"""PreemptionWatch: notices SIGTERM (and Ctrl-C) and names the step at which every process stops and saves.

One process: a SIGTERM handler sets a flag; the step after it is the stop step. With
`interruptible=True` (a single-process run on a terminal) SIGINT is a preemption too, not a
crash: the first Ctrl-C stops at the next step boundary with a committed checkpoint (`reason`
"interrupted" instead of "preempted"); a second Ctrl-C exits at once with status 130 without
waiting for anything. That cannot corrupt a checkpoint: orbax writes `<step>.orbax-checkpoint-tmp`
and renames it only once complete, so a save cut short is never listed or loaded, and the next
run removes it.
Several processes: JAX's preemption sync manager (started by jax.distributed.initialize) hears
the notice on any host, agrees on a step with all the others, and `reached_preemption_sync_point`
turns True on every process at that same step -- so all of them join the same orbax save.
"""

from __future__ import annotations

import os
import signal
import threading

INTERRUPTED_EXIT = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C
PREEMPTED = "preempted"
INTERRUPTED = "interrupted"


class PreemptionWatch:
    def __init__(self, *, interruptible: bool = False):
        import jax

        self._multi = jax.process_count() > 1
        self._flag = threading.Event()
        self.reason: str | None = None
        self._previous: dict[int, object] = {}
        if not self._multi and threading.current_thread() is threading.main_thread():
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_sigterm)
            if interruptible:
                self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigterm(self, signum, frame) -> None:
        del signum, frame
        self.reason = self.reason or PREEMPTED
        self._flag.set()

    def _on_sigint(self, signum, frame) -> None:
        del signum, frame
        if self._flag.is_set() and self.reason == INTERRUPTED:
            # The second Ctrl-C: the user does not want to wait for the checkpoint. Committed
            # checkpoints are complete on disk; one in flight is an orbax tmp dir, never loaded.
            os.write(2, b"\ninterrupted again: exiting now; the last committed checkpoint is kept\n")
            os._exit(INTERRUPTED_EXIT)
        self.reason = self.reason or INTERRUPTED
        self._flag.set()

    def reached(self, step: int) -> bool:
        """Call once per step on every process; True when this step is the one to save and stop at."""
        if self._multi:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                self.reason = PREEMPTED
                return True
            return False
        return self._flag.is_set()

    def close(self) -> None:
        for signum, previous in self._previous.items():
            if signum == signal.SIGINT and self.reason == INTERRUPTED:
                continue  # interrupted: until the process exits, another Ctrl-C exits at once
            signal.signal(signum, previous)
        self._previous = {}
