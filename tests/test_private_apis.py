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
    assert "wait_at_barrier" in dir(_jax.DistributedRuntimeClient)
    for name in ("node_id", "init_timeout", "heartbeat_timeout", "use_compression"):
        assert name in doc, f"get_distributed_runtime_client lost {name}: {doc}"


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
    (hash_obj, accelerators), and hash the per-process topology we replace."""
    import inspect

    from jax._src import cache_key

    assert list(inspect.signature(cache_key._hash_accelerator_config).parameters) == ["hash_obj", "accelerators"]
    assert "get_topology_for_devices" in inspect.getsource(cache_key._hash_accelerator_config)
    assert "_hash_accelerator_config(hash_obj, devices)" in inspect.getsource(cache_key.get)
    assert callable(cache_key._hash_string)
