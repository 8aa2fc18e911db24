"""world.barrier: every member of a world waits for the others, and the controller's verdict ends the
wait at once (a member that died after joining used to hold the survivors for the full timeout).

Two coordination-service clients of one real service, in one process, stand for two members.
"""

from __future__ import annotations

import threading
import time

import pytest

from resilient_jax.elastic import world
from resilient_jax.elastic.channel import free_port


@pytest.fixture
def two_clients():
    from jax._src.lib import _jax

    address = f"127.0.0.1:{free_port()}"
    service = world.CoordinationService(address, 2, heartbeat_timeout=10, shutdown_timeout=1)
    clients = [_jax.get_distributed_runtime_client(address, rank, init_timeout=30, heartbeat_timeout=10,
                                                   use_compression=True) for rank in range(2)]
    _all_at_once([c.connect for c in clients])  # connect returns once every member connected
    yield clients
    # Clients first: a client whose service goes away first ends the process (XLA's error handler).
    _all_at_once([c.shutdown for c in clients])
    service.shutdown()


def _all_at_once(calls) -> None:
    threads = [threading.Thread(target=call) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _wait(client, name, outcome, **kwargs):
    try:
        world.wait_for_all(client, 2, name, kwargs.pop("timeout_seconds", 30), poll_seconds=0.05, **kwargs)
        outcome.append("passed")
    except Exception as e:  # the test reads which error
        outcome.append(e)


def test_the_barrier_returns_once_every_member_arrives(two_clients):
    first: list = []
    waiter = threading.Thread(target=_wait, args=(two_clients[0], "compiled-0", first), kwargs={"aborted": lambda: False})
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive() and not first  # alone at the barrier: still waiting
    second: list = []
    _wait(two_clients[1], "compiled-0", second, aborted=lambda: False)
    waiter.join(10)
    assert first == ["passed"] and second == ["passed"]


def test_the_verdict_ends_a_wait_for_a_member_that_never_comes(two_clients):
    verdict = threading.Event()
    outcome: list = []
    waiter = threading.Thread(target=_wait, args=(two_clients[0], "compiled-1", outcome),
                              kwargs={"aborted": verdict.is_set, "timeout_seconds": 10})
    waiter.start()
    time.sleep(0.3)
    verdict.set()
    started = time.monotonic()
    waiter.join(10)
    assert time.monotonic() - started < 2
    (error,) = outcome
    assert isinstance(error, world.WorldAborted) and "compiled-1" in str(error)


def test_a_member_that_never_comes_times_the_barrier_out(two_clients):
    outcome: list = []
    _wait(two_clients[0], "compiled-2", outcome, aborted=lambda: False, timeout_seconds=0.5)
    (error,) = outcome
    assert isinstance(error, world.BarrierTimeout) and "compiled-2" in str(error) and "0.5 s" in str(error)


def test_a_signal_ends_the_wait_for_it_and_a_verdict_or_the_timeout_ends_it_without(two_clients):
    leader, follower = two_clients
    outcome: list = []
    waiter = threading.Thread(target=lambda: outcome.append(
        world.wait_for_signal("compiled-by-rank-0-0", 30, poll_seconds=0.05, client=follower)))
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive() and not outcome  # rank 0 still compiling: the follower waits
    world.signal("compiled-by-rank-0-0", client=leader)
    waiter.join(10)
    assert outcome == [True]
    # Rank 0 died compiling: the controller's verdict ends the wait at once, not the timeout.
    t0 = time.monotonic()
    with pytest.raises(world.WorldAborted):
        world.wait_for_signal("compiled-by-rank-0-1", 30, poll_seconds=0.05, client=follower,
                              aborted=lambda: time.monotonic() - t0 > 0.3)
    assert time.monotonic() - t0 < 5
    # No signal and no verdict: False after the timeout (the follower then compiles itself).
    assert world.wait_for_signal("compiled-by-rank-0-2", 0.3, poll_seconds=0.05, client=follower) is False


def test_members_on_one_kernel_count_one_machine_and_another_id_counts_two(two_clients, monkeypatch):
    counts: list = []
    _all_at_once([lambda c=c, r=r: counts.append(world.machines("g0", r, 2, client=c)) for r, c in enumerate(two_clients)])
    assert counts == [1, 1]
    ids = iter(["machine-a", "machine-b"])  # what two machines' boot ids would be
    monkeypatch.setattr(world, "machine_id", lambda: next(ids))
    counts.clear()
    _all_at_once([lambda c=c, r=r: counts.append(world.machines("g1", r, 2, client=c)) for r, c in enumerate(two_clients)])
    assert counts == [2, 2]
