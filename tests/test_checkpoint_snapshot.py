"""The asynchronous save's copy off the devices (checkpoint/snapshot.py) and the saver thread that
takes orbax's save call off the training thread (checkpoint/store.py)."""

from __future__ import annotations

import collections
import os
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from resilient_jax.checkpoint import reader, snapshot
from resilient_jax.checkpoint import store as store_lib
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


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread priorities are Linux's")
def test_orbax_writes_at_a_lower_priority_than_the_training_thread(tmp_path, monkeypatch):
    """orbax's save call, and every thread it starts (its commit thread; tensorstore's writers
    where the save starts them), run below the training thread's priority, so a background write
    takes a core only when the step leaves one idle: the threads of a real save are checked."""
    if os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) >= 19:
        pytest.skip("the tests already run at the lowest priority")
    store = CheckpointStore(tmp_path / "ckpt", async_save=True)
    priorities = {}
    orbax_save = store._manager.save
    started = threading.Thread.start

    def priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def noting_save(*args, **kwargs):
        priorities["save call"] = priority()
        return orbax_save(*args, **kwargs)

    def noting_start(thread):
        run = thread.run

        def noted_run():
            if not thread.name.startswith("checkpoint-save"):  # the saver itself: its initializer sets it
                priorities.setdefault("threads", []).append(priority())
            run()

        thread.run = noted_run
        return started(thread)

    def tensorstore_threads() -> dict[int, int]:  # its C++ pool threads ("ts_pool_worker"): nice
        found = {}
        for task in Path("/proc/self/task").iterdir():
            try:
                if (task / "comm").read_text().startswith("ts_"):
                    found[int(task.name)] = int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])
            except FileNotFoundError:
                pass  # a thread that ended meanwhile
        return found

    monkeypatch.setattr(store._manager, "save", noting_save)
    monkeypatch.setattr(threading.Thread, "start", noting_start)
    before = tensorstore_threads()
    store.save(1, State({"w": jnp.arange(64.0)}, {"m": jnp.ones((4, 4))}), _context(1))
    store.wait()
    started_by_save = {tid: nice for tid, nice in tensorstore_threads().items() if tid not in before}
    store.close()
    monkeypatch.undo()
    assert reader.list_steps(tmp_path / "ckpt") == [1]
    ours = priority()
    assert priorities["save call"] == min(ours + store_lib.BACKGROUND_NICENESS, 19) > ours, priorities
    assert priorities["threads"] and set(priorities["threads"]) == {priorities["save call"]}, priorities
    assert set(started_by_save.values()) <= {priorities["save call"]}, started_by_save
