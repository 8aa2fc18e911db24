"""A worker's life as one explicit state machine: its states, the events that move it, one table.

    WAITING --world--> JOINING --from_disk--> RESTORING --state_ready--> COMPILING --compiled--> TRAINING
       ^  \\                  \\--from_peer--> ADOPTING  --state_ready--/                            |
       |   \\--run_over--> DONE <------------------------- finished / stopped ----------------------+
       |                                                                                             |
       +--left-- LEAVING <-- join_failed / failed (from JOINING, RESTORING, ADOPTING, COMPILING) ----+
                                   step_failed / world_change (from TRAINING)

Whatever happens inside a world -- a peer dies while it forms, while it moves state, while it
compiles or while it trains; the members agree to grow, reslot or drain -- the worker leaves it
with the state of its last completed step and waits for the next one: that is how a death at any
moment costs no step. `Lifecycle.fire` refuses a transition the table does not have, logs every
one with its reason, and keeps the seconds spent in each state (the recovery breakdown:
detecting = TRAINING's failed step, re-forming = LEAVING + WAITING + JOINING, ADOPTING, COMPILING).

With a `journal` path, every transition is also appended there as one JSON line (the state entered,
its wall-clock time, the event and reason): `python -m resilient_jax.plot` draws the per-host Gantt
chart of a run from these files, and a host killed mid-state still leaves every earlier one.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

log = logging.getLogger("resilient_jax.worker")


class State(enum.Enum):
    WAITING = "waiting"  # for the controller to announce a world this host is in
    JOINING = "joining"  # connecting to the world's coordination service
    RESTORING = "restoring"  # state from a checkpoint, or fresh
    ADOPTING = "adopting"  # state from the member that completed the most steps (survivors: their own)
    COMPILING = "compiling"  # this world's step, then a barrier with every member (none if no step is left)
    TRAINING = "training"
    LEAVING = "leaving"  # state to host memory, JAX world torn down
    DONE = "done"


class Event(enum.Enum):
    WORLD = "world"  # the controller announced a world with this host in it
    RUN_OVER = "run_over"  # the run finished or failed, or this host was evicted
    FROM_DISK = "from_disk"
    FROM_PEER = "from_peer"
    JOIN_FAILED = "join_failed"  # a member never connected
    STATE_READY = "state_ready"
    COMPILED = "compiled"
    FAILED = "failed"  # a collective of the forming world failed (a member died)
    STEP_FAILED = "step_failed"  # a collective of a step failed (a member died)
    WORLD_CHANGE = "world_change"  # the members agreed to re-form (a join, a reslot, a drain)
    FINISHED = "finished"  # the last step, checkpointed
    STOPPED = "stopped"  # an agreed stop (Ctrl-C, SIGTERM, --stop-at), checkpointed
    LEFT = "left"


def lifecycle_journal(run_dir: str | Path, host: str) -> Path:
    """Where a host appends its transitions: RUN_DIR/elastic/lifecycle/HOST.jsonl (on that host's disk)."""
    return Path(run_dir) / "elastic" / "lifecycle" / f"{host}.jsonl"


S, E = State, Event
TRANSITIONS: dict[tuple[State, Event], State] = {
    (S.WAITING, E.WORLD): S.JOINING,
    (S.WAITING, E.RUN_OVER): S.DONE,
    (S.JOINING, E.FROM_DISK): S.RESTORING,
    (S.JOINING, E.FROM_PEER): S.ADOPTING,
    (S.JOINING, E.JOIN_FAILED): S.LEAVING,
    (S.RESTORING, E.STATE_READY): S.COMPILING,
    (S.RESTORING, E.FAILED): S.LEAVING,
    (S.ADOPTING, E.STATE_READY): S.COMPILING,
    (S.ADOPTING, E.FAILED): S.LEAVING,
    (S.COMPILING, E.COMPILED): S.TRAINING,
    (S.COMPILING, E.FAILED): S.LEAVING,
    (S.TRAINING, E.STEP_FAILED): S.LEAVING,
    (S.TRAINING, E.WORLD_CHANGE): S.LEAVING,
    (S.TRAINING, E.FINISHED): S.DONE,
    (S.TRAINING, E.STOPPED): S.DONE,
    (S.LEAVING, E.LEFT): S.WAITING,
}

# Why a world was left, as the controller's /reform request names it.
LEAVE_REASONS = {E.JOIN_FAILED: "failure", E.FAILED: "failure", E.STEP_FAILED: "failure", E.WORLD_CHANGE: "change"}


def next_state(state: State, event: Event) -> State:
    """The table, as a function: the state after `event` in `state`; ValueError if it has no such edge."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise ValueError(f"worker state machine: no transition from {state.name} on {event.name}") from None


class Lifecycle:
    """The current state, moved only through the table; every move logged with its reason."""

    def __init__(self, host: str, clock: Callable[[], float] = time.perf_counter, *, journal: Path | None = None,
                 wall: Callable[[], float] = time.time):
        self.host, self.clock, self.wall = host, clock, wall
        self.journal = journal
        self.state = State.WAITING
        self.entered = clock()
        self._record(self.state, None, "started")
        self.seconds: dict[State, float] = defaultdict(float)  # time spent in each state, whole run
        self.left_because: Event | None = None  # the event that last moved the worker into LEAVING
        self.history: list[tuple[State, Event, State, str]] = []

    def fire(self, event: Event, reason: str = "") -> State:
        new = next_state(self.state, event)
        now = self.clock()
        spent = now - self.entered
        self.seconds[self.state] += spent
        log.info("state %s -> %s on %s after %.2f s%s", self.state.name, new.name, event.name, spent,
                 f": {reason}" if reason else "")
        self.history.append((self.state, event, new, reason))
        if new is State.LEAVING:
            self.left_because = event
        self.state, self.entered = new, now
        self._record(new, event, reason)
        return new

    def _record(self, entered: State, event: Event | None, reason: str) -> None:
        if self.journal is None:
            return
        line = {"host": self.host, "state": entered.value, "wall": round(self.wall(), 4),
                "event": event.value if event else None, "reason": reason}
        try:
            self.journal.parent.mkdir(parents=True, exist_ok=True)
            with self.journal.open("a") as f:  # a line per transition: a few per world
                f.write(json.dumps(line) + "\n")
        except OSError as e:  # the timeline is for plots; training must not stop for it
            log.warning("could not append to the lifecycle journal %s: %s", self.journal, e)
            self.journal = None

    def totals(self) -> dict[str, float]:
        """Seconds spent in each state so far, the current one included, by state name."""
        seconds = dict(self.seconds)
        seconds[self.state] = seconds.get(self.state, 0.0) + self.clock() - self.entered
        return {state.value: round(seconds[state], 3) for state in State if state in seconds}

    @property
    def leave_reason(self) -> str:
        """The /reform reason of the world just left ("failure" or "change")."""
        return LEAVE_REASONS[self.left_because]
