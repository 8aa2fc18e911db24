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


class _Program:
    """A lowered program that records when it was compiled, and by whom."""

    def __init__(self, rank: int, log: list, seconds: float):
        self.rank, self.log, self.seconds = rank, log, seconds

    def compile(self):
        start = time.monotonic()
        time.sleep(self.seconds)
        self.log.append((self.rank, start, time.monotonic()))


def _compile_world(clients, name, placements, log, **kwargs):
    errors: list = []

    def member(rank):
        try:
            world.compile_world(lambda: [_Program(rank, log, 0.5 if rank == 0 else 0.0)], name, rank, 2, "cpu",
                                placement=placements[rank], client=clients[rank], **kwargs)
        except Exception as e:  # the test reads which error
            errors.append((rank, e))

    _all_at_once([lambda r=r: member(r) for r in range(2)])
    return errors


def test_on_one_machine_rank_0_compiles_first_and_the_other_compiles_after_it(two_clients):
    log: list = []
    assert _compile_world(two_clients, "g0", ["boot-a /cache", "boot-a /cache"], log) == []
    (rank_0,), (rank_1,) = [[e for e in log if e[0] == r] for r in range(2)]
    assert rank_1[1] >= rank_0[2]  # the follower's compile (a cache load) starts once rank 0's ended


def test_on_two_machines_or_without_a_cache_every_member_compiles_at_once(two_clients):
    for name, placements in [("g1", ["boot-a /cache", "boot-b /cache"]), ("g2", ["boot-a ", "boot-a "])]:
        log: list = []
        assert _compile_world(two_clients, name, placements, log) == []
        (rank_0,), (rank_1,) = [[e for e in log if e[0] == r] for r in range(2)]
        assert rank_1[1] < rank_0[2], name  # side by side: nobody waited for rank 0


def test_a_choice_all_must_share_holds_only_if_every_member_says_yes(two_clients):
    for name, words, verdict in [("x0", (True, True), True), ("x1", (True, False), False),
                                 ("x2", (False, True), False)]:
        said: dict = {}
        _all_at_once([lambda r=r: said.__setitem__(r, world.all_agree(name, r, 2, words[r], client=two_clients[r]))
                      for r in range(2)])
        assert said == {0: verdict, 1: verdict}, name


def test_the_verdict_ends_a_wait_for_rank_0s_compile(two_clients):
    # Rank 0 died before it compiled (here: never publishes anything): the controller's verdict,
    # not the timeouts, ends the follower's wait.
    log: list = []
    t0 = time.monotonic()
    follower = two_clients[1]
    world.publish("g3/placement", 0, "boot-a /cache", client=follower)  # rank 0 said where it runs
    with pytest.raises(world.WorldAborted):
        world.compile_world(lambda: [_Program(1, log, 0.0)], "g3", 1, 2, "cpu", placement="boot-a /cache",
                            client=follower, aborted=lambda: time.monotonic() - t0 > 0.5)
    assert time.monotonic() - t0 < 5 and log == []  # it compiled nothing: the world is left


def test_a_follower_that_waits_too_long_compiles_itself(two_clients, monkeypatch):
    monkeypatch.setattr(world, "LEADER_COMPILE_WAIT_SECONDS", 0.3)
    log: list = []
    follower = two_clients[1]
    world.publish("g4/placement", 0, "boot-a /cache", client=follower)
    world.compile_world(lambda: [_Program(1, log, 0.0)], "g4", 1, 2, "cpu", placement="boot-a /cache",
                        client=follower)
    assert [e[0] for e in log] == [1]
