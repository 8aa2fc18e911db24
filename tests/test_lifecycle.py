"""The worker's state machine (resilient_jax.elastic.lifecycle): the table, tested without threads,
processes or JAX -- every edge, the paths a run takes, and refusals of edges the table lacks."""

from __future__ import annotations

import itertools
import json
import logging

import pytest

from resilient_jax.elastic.lifecycle import TRANSITIONS, Event, Lifecycle, State, next_state

S, E = State, Event


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def walk(events, clock=None, advance=1.0) -> Lifecycle:
    clock = clock or FakeClock()
    life = Lifecycle("h0", clock)
    for event in events:
        clock.now += advance
        life.fire(event, "test")
    return life


def test_every_state_is_reachable_from_waiting_and_done_is_final():
    reached, frontier = {S.WAITING}, [S.WAITING]
    while frontier:
        state = frontier.pop()
        for (src, _), dst in TRANSITIONS.items():
            if src is state and dst not in reached:
                reached.add(dst)
                frontier.append(dst)
    assert reached == set(State)
    assert not [edge for edge in TRANSITIONS if edge[0] is S.DONE]


def test_every_state_but_done_and_waiting_can_be_left_for_the_next_world():
    # A death at any moment of a world's life (forming, moving state, compiling, training) must lead
    # back to WAITING with the state kept, never to a crash or a restart.
    for state in (S.JOINING, S.RESTORING, S.ADOPTING, S.COMPILING, S.TRAINING):
        targets = {dst for (src, _), dst in TRANSITIONS.items() if src is state}
        assert S.LEAVING in targets, state
    assert next_state(S.LEAVING, E.LEFT) is S.WAITING


def test_edges_the_table_lacks_are_refused_naming_state_and_event():
    missing = [(s, e) for s, e in itertools.product(State, Event) if (s, e) not in TRANSITIONS]
    assert missing  # the table is not total: e.g. TRAINING cannot be entered from WAITING directly
    for state, event in missing:
        with pytest.raises(ValueError, match=f"from {state.name} on {event.name}"):
            next_state(state, event)


def test_a_survivor_of_a_death_while_adopting_goes_round_and_trains_in_the_next_world():
    life = walk([E.WORLD, E.FROM_DISK, E.STATE_READY, E.COMPILED,  # generation 0
                 E.STEP_FAILED, E.LEFT,  # a peer died in a step
                 E.WORLD, E.FROM_PEER, E.FAILED, E.LEFT,  # another died while generation 1 moved state
                 E.WORLD, E.FROM_PEER, E.STATE_READY, E.COMPILED, E.FINISHED])
    assert life.state is S.DONE
    assert [h[2] for h in life.history].count(S.LEAVING) == 2
    assert life.seconds[S.TRAINING] == 2.0 and life.seconds[S.ADOPTING] == 2.0 and life.seconds[S.LEAVING] == 2.0
    totals = life.totals()
    assert totals["training"] == 2.0 and totals["done"] == 0.0 and "restoring" in totals


def test_leave_reason_is_failure_for_deaths_and_change_for_an_agreed_change():
    life = walk([E.WORLD, E.FROM_DISK, E.STATE_READY, E.COMPILED, E.WORLD_CHANGE])
    assert life.leave_reason == "change"
    life.fire(E.LEFT)
    for ending in ([E.WORLD, E.JOIN_FAILED], [E.WORLD, E.FROM_DISK, E.FAILED],
                   [E.WORLD, E.FROM_PEER, E.STATE_READY, E.COMPILED, E.STEP_FAILED]):
        for event in ending:
            life.fire(event)
        assert life.state is S.LEAVING and life.leave_reason == "failure"
        life.fire(E.LEFT)


def test_an_illegal_event_leaves_the_state_unchanged():
    life = walk([E.WORLD])
    with pytest.raises(ValueError):
        life.fire(E.COMPILED)
    assert life.state is S.JOINING


def test_every_transition_is_logged_with_its_reason(caplog):
    with caplog.at_level(logging.INFO, logger="resilient_jax.worker"):
        life = Lifecycle("h3", FakeClock())
        life.fire(E.WORLD, "generation 2 of 3 hosts")
    assert "state WAITING -> JOINING on WORLD after 0.00 s: generation 2 of 3 hosts" in caplog.text


def test_every_transition_is_appended_to_the_journal_with_its_wall_time(tmp_path):
    from resilient_jax.elastic.lifecycle import lifecycle_journal

    journal = lifecycle_journal(tmp_path, "h2")
    walls = iter(range(100, 200))
    life = Lifecycle("h2", FakeClock(), journal=journal, wall=lambda: float(next(walls)))
    for event in (E.WORLD, E.FROM_PEER, E.STATE_READY, E.COMPILED, E.STEP_FAILED):
        life.fire(event, "test")
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    assert journal == tmp_path / "elastic" / "lifecycle" / "h2.jsonl"
    assert [line["state"] for line in lines] == ["waiting", "joining", "adopting", "compiling", "training", "leaving"]
    assert [line["wall"] for line in lines] == [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]
    assert lines[0]["event"] is None and lines[-1]["event"] == "step_failed" and lines[-1]["host"] == "h2"


def test_an_unwritable_journal_warns_once_and_the_worker_goes_on(tmp_path, caplog):
    blocker = tmp_path / "elastic"
    blocker.write_text("a file where the journal's directory should be")
    with caplog.at_level(logging.WARNING, logger="resilient_jax.worker"):
        life = Lifecycle("h0", FakeClock(), journal=blocker / "lifecycle" / "h0.jsonl")
        life.fire(E.WORLD)
        life.fire(E.FROM_DISK)
    assert life.state is S.RESTORING and life.journal is None
    assert caplog.text.count("could not append to the lifecycle journal") == 1


def test_a_planned_world_change_lets_the_save_in_flight_commit_unless_a_member_dies(caplog):
    # Leaving shuts the coordination service down, which the save's commit barriers go through: a
    # join or drain during a save lost that checkpoint. Now the worker waits for it -- until a
    # verdict that a member died (`abort` clears coordinator_port), which ends the wait.
    import threading
    import time
    from types import SimpleNamespace

    from resilient_jax.elastic.worker import Worker

    class SlowCommit:
        def __init__(self, seconds):
            self.seconds, self.closed_at = seconds, None

        def wait(self):
            time.sleep(self.seconds)
            self.closed_at = time.perf_counter()

    worker, ckpt = SimpleNamespace(coordinator_port=4242, _unstuck=None), SlowCommit(0.5)
    worker._unless_aborted = lambda work, name: Worker._unless_aborted(worker, work, name)
    Worker._commit_before_leaving(worker, ckpt)
    assert ckpt.closed_at is not None and worker._unstuck is None  # returned only once the save committed

    ckpt = SlowCommit(30)
    threading.Timer(0.3, lambda: setattr(worker, "coordinator_port", None)).start()  # the verdict
    started = time.perf_counter()
    Worker._commit_before_leaving(worker, ckpt)
    assert time.perf_counter() - started < 5 and ckpt.closed_at is None
    assert "a member died while the checkpoint in flight committed" in caplog.text
    assert worker._unstuck.is_alive()  # left to _close_checkpoints, once the world is shut down


@pytest.mark.parametrize("reason", ["failure", "change"])
def test_leaving_closes_the_checkpoints_and_abandons_a_save_only_a_dead_member_could_finish(caplog, reason):
    """A failed world's save whose orbax threads wait on a dead member (rank 0's signals) would hold
    the survivor for orbax's 300 s timeout: after a short grace it is abandoned, and the next world's
    store removes what it wrote. A save that fails at once is closed as usual (its error is one
    warning); a planned change waits for its save to commit."""
    import time
    from types import SimpleNamespace

    from resilient_jax.checkpoint.store import CheckpointSaveError
    from resilient_jax.elastic import worker as worker_lib

    class Checkpoints:
        def __init__(self, wait):
            self._wait, self.abandoned, self.committed, self.closed = wait, False, False, False

        def wait(self):
            self._wait()
            self.committed = True

        def close(self):  # after the wait, or an abandon: at once
            self.closed = True

        def abandon(self):
            self.abandoned = True

    def failing():
        raise CheckpointSaveError("checkpoint save of step 20 to /ckpt failed: CANCELLED")

    worker = SimpleNamespace(_unstuck=None, generation=3,
                             life=SimpleNamespace(state=State.LEAVING, leave_reason=reason))
    stuck = Checkpoints(lambda: time.sleep(30))
    started = time.perf_counter()
    if reason == "failure":
        worker_lib.Worker._close_checkpoints(worker, stuck)
        assert stuck.abandoned and not stuck.committed and stuck.closed
        assert time.perf_counter() - started < worker_lib.FAILED_SAVE_GRACE_SECONDS + 3
        assert "left generation 3 with its checkpoint save unfinished: abandoned" in caplog.text
        failed = Checkpoints(failing)
        worker_lib.Worker._close_checkpoints(worker, failed)
        assert not failed.abandoned and failed.closed and "leaving the world: checkpoint save of step 20" in caplog.text
    else:
        slow = Checkpoints(lambda: time.sleep(worker_lib.FAILED_SAVE_GRACE_SECONDS + 0.5))
        slow.close = lambda: (slow.wait(), setattr(slow, "closed", True))  # a close waits for the commit
        worker_lib.Worker._close_checkpoints(worker, slow)
        assert slow.committed and slow.closed and not slow.abandoned  # every member alive: it commits


def test_a_later_world_restores_from_the_invocations_resume_when_the_run_writes_no_checkpoints():
    from resilient_jax.elastic.worker import resume_for_world

    assert resume_for_world("latest", 0, checkpoints=True) == "latest"
    assert resume_for_world("40", 2, checkpoints=True) is None  # the newest, which this run wrote
    assert resume_for_world("latest", 2, checkpoints=False) == "latest"  # it writes none: where it began
    assert resume_for_world(None, 2, checkpoints=False) is None
