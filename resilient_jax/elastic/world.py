"""Joining and leaving a JAX world in-process -- the one module that touches private JAX APIs.

JAX's own `jax.distributed.initialize` makes process 0 host the coordination service, so the
death of process 0 aborts every survivor. Here the service lives in the controller
(`CoordinationService`) and every worker joins as a plain client (`join`), so any worker may die.
`leave` tears a world down far enough that `join` can build the next one in the same process
(order from ../shared/notes/jax-facts.md: shutdown, then clear backends).

Private APIs used (pinned jax==0.10.2; tests/test_private_apis.py fails loudly if they move):
  jax._src.lib._jax.get_distributed_runtime_service / get_distributed_runtime_client (missed_heartbeat_callback)
  jax._src.distributed.global_state (.client, .process_id, .num_processes, .coordinator_address)
  DistributedRuntimeClient.key_value_increment / key_value_set / blocking_key_value_get
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def configure_process(cfg, devices: int) -> None:
    """Worker-process settings that must be in place before JAX creates a backend: the XLA flags
    and client variables of `resilient_jax.gpu_env` (collective timeouts, NCCL abort on a peer's
    failure, deterministic GPU kernels in invariant mode), then recoverability."""
    from resilient_jax import gpu_env

    platform = gpu_env.configure_process_environment(cfg, elastic=True)  # ConfigError: invariant mode unavailable
    import jax

    # Without recoverability a peer's death aborts this process from C++ (LOG(FATAL)); with it,
    # the failed collective raises a catchable JaxRuntimeError.
    jax.config.update("jax_enable_recoverability", True)
    # How long a forming world waits for a member's device topology before the join fails (the
    # unit is minutes; 1 is the least): the worst case of a death between connecting and publishing.
    jax.config.update("jax_cpu_get_local_topology_timeout_minutes", 1)
    jax.config.update("jax_cpu_get_global_topology_timeout_minutes", 1)
    if devices > 0 and platform == "cpu":
        jax.config.update("jax_num_cpu_devices", devices)


class CoordinationService:
    """The JAX coordination service of one generation, hosted by the controller (recoverable mode)."""

    def __init__(self, address: str, num_processes: int, *, heartbeat_timeout: int = 30, shutdown_timeout: int = 10):
        from jax._src.lib import _jax

        self.address = address
        self._service = _jax.get_distributed_runtime_service(
            address, num_processes, heartbeat_timeout=heartbeat_timeout, shutdown_timeout=shutdown_timeout,
            recoverable=True,
        )

    def shutdown(self) -> None:
        if self._service is not None:
            self._service.shutdown()
            self._service = None


def join(coordinator: str, num_processes: int, rank: int, *, init_timeout: int = 120, heartbeat_timeout: int = 30) -> None:
    """Connect this process to a world as `rank`, without starting a local coordination service."""
    from jax._src import distributed
    from jax._src.lib import _jax

    state = distributed.global_state
    if state.client is not None:
        raise RuntimeError("join: this process is already in a JAX world; call leave() first")
    state.coordinator_address = coordinator
    state.process_id = rank
    state.num_processes = num_processes
    state.client = _jax.get_distributed_runtime_client(
        coordinator, rank, init_timeout=init_timeout, heartbeat_timeout=heartbeat_timeout, use_compression=True,
        missed_heartbeat_callback=_on_coordination_error,
    )
    try:
        state.client.connect()  # waits for every member
    except RuntimeError as e:
        # Never connected: nothing to shut down; and no later backend may think it is in that world.
        state.client, state.coordinator_address, state.process_id, state.num_processes = None, None, 0, 1
        raise WorldFormationError(f"joining the world at {coordinator} as rank {rank} of {num_processes} failed "
                                  f"(a member never arrived): {str(e).splitlines()[0][:200]}") from None
    # The backend belongs to the world: creating it publishes this member's device topology and
    # waits for every other member's, through the coordination service. A member that dies between
    # connecting and publishing would make the others wait out the topology timeout and then raise
    # from whatever JAX call came first (found by kill_host:H@formation:G); here it fails the join.
    try:
        import jax
        from jax.experimental import multihost_utils

        jax.devices()
        # Connect the world's cross-process collectives now, while it forms. Gloo connects peers
        # lazily, through the coordination service's key-value store: a member that died before
        # connecting leaves the others waiting out gloo's rendezvous (30 s, not configurable);
        # once connected, its death is a closed connection that every peer sees at once.
        multihost_utils.sync_global_devices("resilient_jax.world.join")
    except RuntimeError as e:
        raise WorldFormationError(f"generation at {coordinator}: rank {rank} of {num_processes} could not build "
                                  f"the backend (a member died while the world formed): "
                                  f"{str(e).splitlines()[0][:200]}") from None
    # As jax.distributed.initialize does: checkpoint preemption handling syncs through it.
    state.initialize_preemption_sync_manager()


class WorldFormationError(RuntimeError):
    """`join` could not connect: a member died (or was declared dead) while the world formed."""


def _on_coordination_error(status) -> None:
    """Replaces XLA's default error handler of the coordination client, which terminates the process
    (LOG(QFATAL) "the JAX distributed service detected fatal errors"): with it, a member that died
    while a world formed killed every other member waiting in `connect` (found by scripts/soak.py).
    jaxlib 0.10.2 cannot hand the absl::Status to Python (the call raises std::bad_cast inside
    `connect`), which is what we need: `connect` raises instead of killing, and the worker asks for
    the next world. On a background thread the outcome is what XLA's default does (the process
    ends). tests/test_private_apis.py pins both behaviours."""
    log.warning("coordination service error: %s", status)


class WorldAborted(RuntimeError):
    """A wait inside a world was given up because the controller declared a member dead."""


class BarrierTimeout(RuntimeError):
    """Not every member reached a barrier in time (its own type: a TimeoutError is also an OSError,
    and a timed-out read elsewhere must not pass for a failed world)."""


def barrier(name: str, timeout_seconds: float, *, aborted: Callable[[], bool] = lambda: False,
            poll_seconds: float = 0.5) -> None:
    """Wait until every member reaches `name`, through the coordination service's key-value store
    (not a collective, so the wait is not bounded by the XLA collective timeout -- compile skew
    between hosts can be minutes).

    Not `wait_at_barrier`: nothing can interrupt that wait, and with a member that died after
    joining the survivors sat in it for the whole timeout (the coordination service's heartbeat
    verdict does not fail a recoverable world's barriers). Here each member counts itself in, the
    last one publishes the key the others block on, and they block in slices of `poll_seconds`,
    checking `aborted()` (the controller's verdict) between slices: it raises WorldAborted.
    A timeout raises BarrierTimeout. A name is single-use in a world (each generation has its own
    coordination service, so `compiled-<generation>` is): a second wait on it returns at once."""
    from jax._src import distributed

    state = distributed.global_state
    wait_for_all(state.client, state.num_processes, name, timeout_seconds, aborted=aborted, poll_seconds=poll_seconds)


# How long a member waits for rank 0 to compile a world's programs before compiling them itself.
LEADER_COMPILE_WAIT_SECONDS = 600
# How long a member waits for the others to say where they run (they do so before lowering).
PLACEMENT_WAIT_SECONDS = 300


def compile_world(lower: Callable[[], list], name: str, rank: int, size: int, platform: str, *,
                  aborted: Callable[[], bool] = lambda: False, placement: str | None = None, client=None) -> None:
    """Compile this world's programs (`lower()`: traced and lowered, not compiled).

    Where compile_cache.leader_compiles says so for the members' placements, rank 0 compiles and
    signals, and the others -- having traced and lowered theirs meanwhile -- wait for it and load its
    programs from the persistent cache. Each member publishes its placement before lowering and
    reads the others' after, so the exchange costs no wait. The controller's verdict (`aborted`)
    ends a wait (rank 0 died compiling); a wait that times out (rank 0 slow, or its entries not
    where this member looks) falls back to compiling here. `name`: unique in this world."""
    from resilient_jax import compile_cache

    if size == 1:
        compile_cache.compile_all(lower())
        return
    client = _client(client)
    publish(f"{name}/placement", rank, compile_cache.placement() if placement is None else placement, client=client)
    programs = lower()
    placements = read_all(f"{name}/placement", size, aborted=aborted, client=client)
    compiled = f"resilient_jax/compile/{name}/compiled"
    once = compile_cache.leader_compiles(placements, platform)
    if once and rank != 0:
        if _wait_for_key(client, compiled, "rank 0's compile", LEADER_COMPILE_WAIT_SECONDS, aborted, 0.5) is None:
            log.warning("%s: rank 0 had not compiled its programs after %d s; compiling here", name,
                        LEADER_COMPILE_WAIT_SECONDS)
    compile_cache.compile_all(programs)
    if rank == 0:
        client.key_value_set(compiled, "1")


def publish(name: str, rank: int, value: str, *, client=None) -> None:
    """This member's word on `name` (a placement, a yes or no), for `read_all`. `name`: unique in this world."""
    _client(client).key_value_set(f"resilient_jax/word/{name}/{rank}", value)


def read_all(name: str, size: int, *, aborted: Callable[[], bool] = lambda: False, client=None) -> list[str]:
    """Every member's word on `name`, in rank order, once each has published it: each member reads
    the same list, so decisions made from it are the same on every member."""
    client = _client(client)
    words = []
    for other in range(size):
        value = _wait_for_key(client, f"resilient_jax/word/{name}/{other}", f"rank {other}'s word on {name}",
                              PLACEMENT_WAIT_SECONDS, aborted, 0.5)
        if value is None:
            raise BarrierTimeout(f"rank {other} did not say {name} within {PLACEMENT_WAIT_SECONDS} s")
        words.append(value)
    return words


def read_word(name: str, rank: int, *, timeout_seconds: float, aborted: Callable[[], bool] = lambda: False,
              client=None) -> str | None:
    """Member `rank`'s word on `name` once it has published it, or None once `timeout_seconds` pass
    (math.inf: only `aborted` ends the wait)."""
    return _wait_for_key(_client(client), f"resilient_jax/word/{name}/{rank}", f"rank {rank}'s word on {name}",
                         timeout_seconds, aborted, 0.2)


def exchange(name: str, rank: int, size: int, mine: str, *, aborted: Callable[[], bool] = lambda: False,
             client=None) -> list[str]:
    """`publish` then `read_all`: every member's word on `name`, in rank order."""
    if size == 1:
        return [mine]
    publish(name, rank, mine, client=client)
    return read_all(name, size, aborted=aborted, client=client)


def all_agree(name: str, rank: int, size: int, mine: bool, *, aborted: Callable[[], bool] = lambda: False,
              client=None) -> bool:
    """True only if every member of the world says True: for a choice that must be the same on
    every member, such as which programs they run. `name`: unique in this world."""
    return all(word == "1" for word in exchange(f"agree/{name}", rank, size, "1" if mine else "0",
                                                aborted=aborted, client=client))


def _client(client):
    from jax._src import distributed

    return distributed.global_state.client if client is None else client


def wait_for_all(client, num_processes: int, name: str, timeout_seconds: float, *,
                 aborted: Callable[[], bool], poll_seconds: float) -> None:
    """`barrier` on an explicit coordination-service client of a world of `num_processes`."""
    everyone = f"resilient_jax/barrier/{name}/all"
    if client.key_value_increment(f"resilient_jax/barrier/{name}/arrived", 1) == num_processes:
        client.key_value_set(everyone, "1")
    if _wait_for_key(client, everyone, f"barrier {name}", timeout_seconds, aborted, poll_seconds) is None:
        raise BarrierTimeout(f"barrier {name}: not every member arrived within {timeout_seconds:g} s")


def _wait_for_key(client, key: str, what: str, timeout_seconds: float, aborted: Callable[[], bool],
                  poll_seconds: float) -> str | None:
    """`key`'s value once it is set, or None once `timeout_seconds` pass; blocks in slices of
    `poll_seconds`, raising WorldAborted as soon as `aborted()` says so."""
    import jax

    deadline = time.monotonic() + timeout_seconds
    while True:
        if aborted():
            raise WorldAborted(f"{what}: the controller declared a member of this world dead")
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            return client.blocking_key_value_get(key, max(1, int(min(poll_seconds, left) * 1000)))
        except jax.errors.JaxRuntimeError as e:
            if "DEADLINE_EXCEEDED" not in str(e):
                raise


def abort_collectives(keep_ports: set[int]) -> int:
    """Make this process's in-flight and future collectives of the current world fail now.

    Gloo (the CPU collectives) has no abort call, and a survivor blocked on a peer that is alive but
    has left the world would wait for the full collective timeout. Shutting down this process's
    established TCP connections -- except those to `keep_ports` (the controller, the coordination
    service) -- makes the blocked gloo operation raise at once ("Connection closed by peer"), and the
    peers on the other end of each connection fail the same way, so the abort spreads through the
    world. (On GPUs, NCCL's own abort does this: XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE.)
    Linux only (/proc); returns the number of connections shut down.
    """
    import socket

    fds_by_inode = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            fds_by_inode[target[8:-1]] = int(fd)
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            remote_port, state, inode = int(fields[2].rsplit(":", 1)[1], 16), fields[3], fields[9]
            if state != "01" or inode not in fds_by_inode or remote_port in keep_ports:  # 01 = ESTABLISHED
                continue
            try:  # the fd may have been closed since it was listed
                sock = socket.socket(fileno=fds_by_inode[inode])
            except OSError:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
            except OSError:
                pass
            finally:
                sock.detach()  # the fd still belongs to gloo; only its connection is shut down
    return count


def leave(before_reset=None) -> None:
    """Shut the client down and drop the backend, so the next `join` starts clean.

    `before_reset` runs between the two: the place to close an orbax CheckpointManager (before the
    shutdown its commit barrier waits for dead peers; after the backend is gone it cannot finish).
    Device buffers do not survive this: copy what must be kept to host memory first.
    """
    import jax
    import jax.extend

    try:
        jax.distributed.shutdown()
    except Exception as e:  # a dead peer can make the shutdown barrier fail; the world is gone anyway
        log.warning("leaving the JAX world: shutdown raised %s", e)
        from jax._src import distributed

        distributed.global_state.client = None
    if before_reset is not None:
        try:
            before_reset()
        except Exception as e:
            log.warning("leaving the JAX world: %s", e)
    _clear_orbax_signalling_client()
    jax.extend.backend.clear_backends()
    gc.collect()


def _clear_orbax_signalling_client() -> None:
    # Orbax caches a signalling client bound to the old coordinator; later saves would talk to it.
    try:
        from orbax.checkpoint._src.futures import signaling_client
    except ImportError:  # pragma: no cover - layout of a different orbax version
        return
    signaling_client.get_signaling_client.cache_clear()


# Orbax's count of saves per world: far more than a world ever begins.
ORBAX_OPERATIONS_PER_WORLD = 1_000_000


def number_orbax_operations(generation: int) -> None:
    """Numbers this world's orbax saves from `generation` * ORBAX_OPERATIONS_PER_WORLD, on every member.

    Orbax names the signal keys the members of a save wait on by a per-process count of saves
    begun. A save that a death interrupted has moved that count on some members and not on
    others (measured: rank 0 killed while the final checkpoint committed; in the next world the
    members' keys differed and its save waited out orbax's 300 s timeout). Counting afresh from
    zero is not enough either: the interrupted save's own threads, still waiting, fetch the
    signalling client anew and would take the next world's signal for the same count as theirs
    -- measured, they then wrote their files into that world's save of the same step, after its
    commit. Each world has its own range."""
    from orbax.checkpoint._src.futures import synchronization

    generator = synchronization.OperationIdGenerator
    generator._operation_id_counter = itertools.count(generation * ORBAX_OPERATIONS_PER_WORLD)
    generator._operation_id = next(generator._operation_id_counter)
