"""PreemptionWatch: notices SIGTERM and names the step at which every process stops and saves.

One process: a SIGTERM handler sets a flag; the step after it is the stop step.
Several processes: JAX's preemption sync manager (started by jax.distributed.initialize) hears
the notice on any host, agrees on a step with all the others, and `reached_preemption_sync_point`
turns True on every process at that same step -- so all of them join the same orbax save.
"""

from __future__ import annotations

import signal
import threading


class PreemptionWatch:
    def __init__(self):
        import jax

        self._multi = jax.process_count() > 1
        self._flag = threading.Event()
        self._previous = None
        if not self._multi and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        del signum, frame
        self._flag.set()

    def reached(self, step: int) -> bool:
        """Call once per step on every process; True when this step is the one to save and stop at."""
        if self._multi:
            from jax.experimental import multihost_utils

            return bool(multihost_utils.reached_preemption_sync_point(step))
        return self._flag.is_set()

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
