"""Private JAX/orbax APIs this project depends on. If one moves, this fails loudly and names it.

Pinned: jax==0.10.2, orbax-checkpoint==0.12.8 (pyproject.toml). Used by resilient_jax/elastic/world.py
(workers join a world whose coordination service lives in the controller) and by tests.
"""

from __future__ import annotations

import jax
import pytest


def test_distributed_runtime_service_and_client_factories():
    from jax._src.lib import _jax

    doc = _jax.get_distributed_runtime_service.__doc__ or ""
    assert "recoverable" in doc and "heartbeat_timeout" in doc, doc
    doc = _jax.get_distributed_runtime_client.__doc__ or ""
    for method in ("key_value_increment", "key_value_set", "blocking_key_value_get"):  # world.barrier
        assert method in dir(_jax.DistributedRuntimeClient), f"DistributedRuntimeClient lost {method}"
    for name in ("node_id", "init_timeout", "heartbeat_timeout", "use_compression", "missed_heartbeat_callback"):
        assert name in doc, f"get_distributed_runtime_client lost {name}: {doc}"


JOIN_A_WORLD_NOBODY_ELSE_JOINS = """
import sys
import jax
from resilient_jax.elastic import world
from resilient_jax.elastic.channel import free_port

jax.config.update("jax_enable_recoverability", True)
address = f"127.0.0.1:{free_port()}"
service = world.CoordinationService(address, 2)
try:
    world.join(address, 2, 0, init_timeout=2)
except world.WorldFormationError as e:
    print("raised:", e)
world.leave()
service.shutdown()
address = f"127.0.0.1:{free_port()}"
service = world.CoordinationService(address, 1)
world.join(address, 1, 0)  # the next world, in the same process
print("next world:", jax.process_count(), float(jax.jit(lambda x: x.sum())(jax.numpy.ones(4))))
world.leave()
service.shutdown()
"""


def test_a_member_that_never_arrives_makes_join_raise_not_kill_the_process():
    """XLA's default coordination error handler ends the process (LOG(QFATAL)) when `connect` fails;
    world.join's handler turns that into WorldFormationError (see world._on_coordination_error). If
    a jax upgrade changes this, the process dies here (or the error type changes) and this fails."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", JOIN_A_WORLD_NOBODY_ELSE_JOINS], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "raised: joining the world at 127.0.0.1:" in proc.stdout and "next world: 1 4.0" in proc.stdout, proc.stdout


def test_distributed_global_state_fields():
    from jax._src import distributed

    state = distributed.global_state
    for name in ("client", "service", "process_id", "num_processes", "coordinator_address"):
        assert hasattr(state, name), f"jax._src.distributed.global_state has no {name}"


def test_recoverability_flag_and_backend_reset_exist():
    import jax.extend

    jax.config.update("jax_enable_recoverability", False)  # exists (raises if the option moved)
    assert callable(jax.extend.backend.clear_backends)


def test_orbax_signalling_client_cache():
    from orbax.checkpoint._src.futures import signaling_client

    assert hasattr(signaling_client.get_signaling_client, "cache_clear")


def test_orbax_operation_ids_are_numbered_per_world():
    """resilient_jax/elastic/world.py sets orbax's count of saves (it names the signal keys the
    members of a save wait on) when a world forms: the setting must reach what orbax reads."""
    from orbax.checkpoint._src.futures import synchronization

    from resilient_jax.elastic import world

    generator = synchronization.OperationIdGenerator
    before = generator._operation_id_counter, generator._operation_id
    try:
        world.number_orbax_operations(3)
        assert generator.get_current_operation_id() == str(3 * world.ORBAX_OPERATIONS_PER_WORLD)
        assert generator.next_operation_id() == 3 * world.ORBAX_OPERATIONS_PER_WORLD + 1
    finally:
        # Exactly as it was: a count set back to 0 would give later saves in this process the ids
        # of earlier ones, whose signals orbax's in-process client still holds.
        generator._operation_id_counter, generator._operation_id = before


def test_orbax_temporary_path_class_names_each_worlds_directory():
    """resilient_jax/checkpoint/store.py names each world's temporary step directories apart
    (world_temporary_path): orbax must still find the final directory by cutting at its marker."""
    from pathlib import Path

    import orbax.checkpoint as ocp

    from resilient_jax.checkpoint.store import world_temporary_path

    cls = world_temporary_path(7)
    tmp = cls.from_final(Path("/ckpt/60"))
    assert tmp.get().name == "60.orbax-checkpoint-tmp-g7" and tmp.get_final() == Path("/ckpt/60")
    assert ocp.path.atomicity.AtomicRenameTemporaryPath.from_temporary(tmp.get()).get_final() == Path("/ckpt/60")


def test_jit_cache_size_used_by_the_no_recompile_test():
    f = jax.jit(lambda x: x + 1)
    f(1.0)
    assert f._cache_size() == 1


@pytest.mark.parametrize("name", ["all_to_all", "all_gather", "psum", "axis_index"])
def test_public_collectives_used_by_the_reduction(name):
    assert callable(getattr(jax.lax, name))


def test_orbax_manager_finalize_hook_used_by_the_commit_manifest():
    """resilient_jax/checkpoint/store.py writes the commit files in an override of this method:
    it must run after the rename (`_finalize` calls it after waiting for the checkpointers) and
    before retention deletes old steps."""
    import inspect

    import orbax.checkpoint as ocp

    source = inspect.getsource(ocp.CheckpointManager._finalize)
    assert "_finalize_checkpoint(step)" in source and "delete_steps" in source
    assert source.index("_wait_for_checkpointers") < source.index("_finalize_checkpoint(step)") < source.index(
        "delete_steps")


def test_cache_key_accelerator_hash_replaced_by_the_compile_cache():
    """resilient_jax/compile_cache.py swaps this function (CPU devices only) so every rank of a
    world computes rank 0's key: it must still be looked up by name at key time, take
    (hash_obj, accelerators), and hash the per-process topology we replace. (This process may have
    swapped it already -- the test session's compile cache is on -- so JAX's own is read from the
    swap's __wrapped__.)"""
    import inspect

    from jax._src import cache_key

    jax_own = getattr(cache_key._hash_accelerator_config, "__wrapped__", cache_key._hash_accelerator_config)
    assert list(inspect.signature(jax_own).parameters) == ["hash_obj", "accelerators"]
    assert "get_topology_for_devices" in inspect.getsource(jax_own)
    assert "_hash_accelerator_config(hash_obj, devices)" in inspect.getsource(cache_key.get)
    assert callable(cache_key._hash_string)


def test_orbax_distributed_barrier_flag_and_preemption_hook_used_by_the_saver_thread():
    """checkpoint.store runs orbax's save call on its saver thread: it turns on orbax's key-value
    barriers (a private flag) and overrides CheckpointManager.reached_preemption."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.multihost import multihost

    from resilient_jax.checkpoint.store import use_distributed_barriers

    assert "reached_preemption" in vars(ocp.CheckpointManager)
    use_distributed_barriers()
    assert multihost.EXPERIMENTAL_ORBAX_USE_DISTRIBUTED_BARRIER.value is True
