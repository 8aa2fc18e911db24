"""Joining and leaving a JAX world in-process -- the one module that touches private JAX APIs.

JAX's own `jax.distributed.initialize` makes process 0 host the coordination service, so the
death of process 0 aborts every survivor. Here the service lives in the controller
(`CoordinationService`) and every worker joins as a plain client (`join`), so any worker may die.
`leave` tears a world down far enough that `join` can build the next one in the same process
(order from ../shared/notes/jax-facts.md: shutdown, then clear backends).

Private APIs used (pinned jax==0.10.2; tests/test_private_apis.py fails loudly if they move):
  jax._src.lib._jax.get_distributed_runtime_service / get_distributed_runtime_client
  jax._src.distributed.global_state (.client, .process_id, .num_processes, .coordinator_address)
  DistributedRuntimeClient.wait_at_barrier
"""

from __future__ import annotations

import gc
import logging
import os

log = logging.getLogger(__name__)


def configure_process(collective_timeout_seconds: int, devices: int) -> None:
    """Worker-process settings that must be in place before JAX creates a backend."""
    flag = f"--xla_cpu_collective_timeout_seconds={collective_timeout_seconds}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    import jax

    # Without recoverability a peer's death aborts this process from C++ (LOG(FATAL)); with it,
    # the failed collective raises a catchable JaxRuntimeError.
    jax.config.update("jax_enable_recoverability", True)
    if devices > 0:
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
    )
    state.client.connect()
    # As jax.distributed.initialize does: checkpoint preemption handling syncs through it.
    state.initialize_preemption_sync_manager()


def barrier(name: str, timeout_seconds: float) -> None:
    """Wait until every member reaches `name`, through the coordination service (not a collective,
    so the wait is not bounded by the XLA collective timeout)."""
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier(name, int(timeout_seconds * 1000))


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
