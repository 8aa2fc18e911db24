"""The controller's re-formation decision, as a pure function: who is in the next world, and from what.

`plan_reform` takes what the controller knows at one instant -- the current world's members, every
host's status, the members that asked to re-form (with the step each completed), a planned change
(a reslot or a drain) -- and returns one of:

    None          nothing to do yet: nobody asked and nobody died, or a live member is still in
                  the old world (it will fail its collective, or reach the agreed boundary, and ask)
    TooFewHosts   the live members are fewer than runtime.min_hosts: the run fails, saying so
    ReformPlan    the next world: why, the step it resumes from, which member's state it adopts
                  (and which members already hold it), who is lost, who leaves, which spares join

No threads, locks, clocks or HTTP: the controller calls it under its lock and applies the plan;
tests/test_membership.py covers every outcome.

`silent_hosts` is the liveness verdict the controller's monitor takes each tick, also pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PlannedChange:
    """What the controller planned for the next step boundary (its `Change`, without the record)."""

    kind: str  # "reslot" | "drain"
    host: str
    spare: str | None


@dataclass(frozen=True)
class TooFewHosts:
    live: tuple[str, ...]


@dataclass(frozen=True)
class ReformPlan:
    reason: str  # "failure" | "reslot" | "drain" | "join" | "collective-timeout"
    resume_step: int  # steps completed by the state the next world starts from
    source: str | None  # the member whose state it adopts; None: restore from the newest checkpoint
    holders: tuple[str, ...]  # live members that already hold that state (nothing is sent to them)
    lost: tuple[str, ...]  # dead members of the old world
    evicted: tuple[str, ...]  # live members that leave by the planned change
    evicted_status: str | None  # what they become: "reslotted" | "drained"
    promoted: tuple[str, ...]  # spares that take slots in the next world


def plan_reform(members: Sequence[str], status: Mapping[str, str], completed: Mapping[str, int],
                change: PlannedChange | None, *, min_hosts: int, spares: Sequence[str],
                registered: int) -> ReformPlan | TooFewHosts | None:
    """`members`: the current world's, in rank order; `status`: every known host's ("active",
    "dead", "spare", "registered", ...); `completed`: the members that asked to re-form, with the
    steps each had completed (-1: none in memory); `spares` in the order they are preferred;
    `registered`: newcomers waiting to join."""
    live = [h for h in members if status[h] == "active"]
    lost = [h for h in members if status[h] == "dead"]
    if not completed and not lost:
        return None
    if any(h not in completed for h in live):
        return None  # a live member is still in the old world; it will ask
    if len(live) < min_hosts:
        return TooFewHosts(tuple(live))
    evicted = [change.host] if change is not None and change.host in live else []
    best = max((completed[h] for h in live), default=-1)
    # No live member holds state in memory (-1: the first world failed while forming): the next
    # world restores from the newest checkpoint instead of adopting anyone's.
    source = None if best < 0 else min((h for h in live if completed[h] == best and h not in evicted),
                                       key=list(members).index)
    if lost:
        reason = "failure"
    elif evicted:
        reason = change.kind
    elif registered:
        reason = "join"
    else:  # every member alive and asking: a collective hit the backstop timeout
        reason = "collective-timeout"
    # Spares take the slots of lost hosts, and of a reslotted or drained host when the change names one.
    named = change.spare if change is not None and change.spare and status.get(change.spare) == "spare" else None
    wanted = len(lost) + (1 if change is not None and change.spare else 0)
    promoted = ([named] if named else []) + [h for h in spares if h != named and status.get(h) == "spare"]
    return ReformPlan(
        reason=reason, resume_step=max(best, 0), source=source,
        holders=() if source is None else tuple(h for h in live if completed[h] == best),
        lost=tuple(lost), evicted=tuple(evicted),
        evicted_status=("reslotted" if change.kind == "reslot" else "drained") if evicted else None,
        promoted=tuple(promoted[:wanted]),
    )


# The controller's clock thread ticks every 0.05 s and takes no lock; a gap this long between two
# of its ticks means the controller's process did not run (stopped, its machine thrashing, a VM
# paused) -- not a lock held by a slow request, during which the other threads still run.
PAUSE_SECONDS = 1.0


def silent_hosts(last_seen: Mapping[str, float], now: float, pauses: Sequence[tuple[float, float]],
                 dead_after: float) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """The liveness verdict at `now`: (every host's last_seen, the hosts silent for longer than
    `dead_after`, with their silence), given `last_seen` (when each watched host was last heard from)
    and `pauses`, the (start, end) spans the controller's process did not run, not yet applied.

    Time the controller did not run is nobody's silence: a heartbeat sent while it was stopped waits
    in its socket, unread. Each host's last_seen moves forward by the part of each pause after it was
    last heard (never past `now`): each has a whole `dead_after` from the controller's return to be
    heard, and keeps the silence it had before. A host heard after a pause gets nothing for it. (A
    run once declared all four of its hosts dead at once, "silent for 160 s", when its machine
    stalled for that long.) A dead process is not waited for: the launcher reports its exit."""
    moved = {}
    for host, seen in last_seen.items():
        credit = sum(end - max(start, seen) for start, end in pauses if end > seen)
        moved[host] = min(seen + credit, now)
    silent = [(host, now - seen) for host, seen in moved.items() if now - seen > dead_after]
    return moved, silent
