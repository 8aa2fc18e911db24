"""The asynchronous save's copy off the devices (checkpoint/snapshot.py) and the saver thread that
takes orbax's save call off the training thread (checkpoint/store.py)."""

from __future__ import annotations

import collections
import os
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from resilient_jax.checkpoint import reader, snapshot
from resilient_jax.checkpoint.store import CheckpointStore

from test_checkpoint_errors import State, _context


def _mesh(data: int, fsdp: int):
    return jax.make_mesh((data, fsdp, 8 // (data * fsdp)), ("data", "fsdp", "tensor"))


@pytest.mark.parametrize("data,fsdp,spec", [(8, 1, P()), (4, 2, P("fsdp")), (2, 2, P("fsdp", "tensor")),
                                            (2, 4, P(None, "fsdp"))])
def test_the_writer_sharding_keeps_one_device_for_each_shard(data, fsdp, spec):
    sharding = NamedSharding(_mesh(data, fsdp), spec)
    shape = (8, 8)
    shards = {tuple((s.start, s.stop) for s in idx) for idx in sharding.devices_indices_map(shape).values()}
    writer = snapshot.writer_sharding(sharding)
    written = [tuple((s.start, s.stop) for s in idx) for idx in writer.devices_indices_map(shape).values()]
    assert sorted(written) == sorted(shards)  # each shard exactly once
    for device, idx in writer.devices_indices_map(shape).items():  # and from a device that holds it
        assert sharding.devices_indices_map(shape)[device] == idx


def test_the_writes_of_replicated_arrays_spread_over_replicas():
    sharding = NamedSharding(_mesh(4, 2), P("fsdp"))
    used = collections.Counter(d for offset in range(8)
                               for d in snapshot.writer_sharding(sharding, offset).device_set)
    assert len(used) == 8 and set(used.values()) == {2}, used


@pytest.mark.parametrize("with_numpy", [True, False], ids=["numpy-memcpy", "device_put-pinned_host"])
def test_the_snapshot_survives_the_donation_of_the_state_bit_for_bit(with_numpy):
    """Both ways of copying (CPU's default, and the device_put into pinned host memory that GPUs
    use), on CPU devices."""
    mesh = _mesh(4, 2)
    r = np.random.default_rng(0)
    host = {"w": r.standard_normal((16, 8), np.float32), "b": r.standard_normal((8,), np.float32),
            "count": np.int32(7)}
    specs = {"w": P("fsdp"), "b": P(), "count": P()}
    tree = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}
    taken = snapshot.take(tree, with_numpy=with_numpy)
    donate = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)
    jax.block_until_ready(donate(tree))
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(tree))  # the state really was donated
    arrays = taken.arrays()
    for key, value in host.items():
        assert arrays[key].shape == np.shape(value) and arrays[key].sharding.memory_kind == "pinned_host"
        assert np.asarray(arrays[key]).tobytes() == np.asarray(value).tobytes(), key


def test_save_returns_while_orbax_is_still_inside_its_save_call(tmp_path, monkeypatch):
    """The training thread pays for the copies only: orbax's save call (barriers, directories,
    writer threads) runs on the store's saver thread; the checkpoint still commits."""
    store = CheckpointStore(tmp_path / "ckpt", async_save=True)
    entered, release = threading.Event(), threading.Event()
    orbax_save = store._manager.save

    def held_save(*args, **kwargs):
        entered.set()
        assert threading.current_thread() is not threading.main_thread()
        release.wait(60)
        return orbax_save(*args, **kwargs)

    monkeypatch.setattr(store._manager, "save", held_save)
    state = State({"w": jnp.arange(64.0)}, {"m": jnp.ones((4, 4))})
    store.save(1, state, _context(1))  # returns although orbax's call cannot finish yet
    assert entered.wait(60) and reader.list_steps(tmp_path / "ckpt") == []
    release.set()
    store.close()
    assert reader.list_steps(tmp_path / "ckpt") == [1]
    restored = CheckpointStore.restore_arrays(tmp_path / "ckpt" / "1", jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state))
    assert np.asarray(restored.params["w"]).tobytes() == np.arange(64.0, dtype=np.float32).tobytes()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own niceness is Linux's")
@pytest.mark.parametrize("priority", ["low", "normal"])
def test_a_low_priority_write_runs_at_niceness_19_and_the_training_thread_keeps_its_own(tmp_path, monkeypatch,
                                                                                       priority):
    """checkpoint.write_priority=low: orbax's save call runs on a thread at niceness 19, and so does
    a thread it starts (Linux threads inherit it), so the write takes what the step leaves; the
    default leaves every thread at the training thread's priority (saves commit once written)."""
    store = CheckpointStore(tmp_path / "ckpt", async_save=True, write_priority=priority)
    orbax_save, seen = store._manager.save, {}

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def observed_save(*args, **kwargs):
        seen["saver"] = niceness()
        child = threading.Thread(target=lambda: seen.setdefault("started by it", niceness()))
        child.start()
        child.join()
        return orbax_save(*args, **kwargs)

    monkeypatch.setattr(store._manager, "save", observed_save)
    training = niceness()
    store.save(1, State({"w": jnp.arange(8.0)}, {"m": jnp.ones(2)}), _context(1))
    store.close()
    expected = 19 if priority == "low" else training
    assert seen == {"saver": expected, "started by it": expected} and niceness() == training < 19
    assert reader.list_steps(tmp_path / "ckpt") == [1]
