"""The copy an asynchronous save writes from: every unique shard of the state copied once off the
devices, so that the training thread may donate the state at the next step while orbax writes.

    snapshot = take(state)      # dispatches the copies and returns; nothing waits for them
    arrays = snapshot.arrays()  # the global arrays (on the saver thread): what orbax is given

What is copied, and where to:
- One replica of each shard. An array replicated over some mesh axes (`data`, and any axis its
  PartitionSpec does not name) is held in full on every replica; a save writes one of them. The
  snapshot of a NamedSharding array lives on a sub-mesh that keeps, for each shard, one of the
  devices that hold it. Which one rotates with the shard's position and the array's place in the
  tree, so the writes spread over replicas (and hosts) instead of all landing on replica 0.
  In one process only. With several, orbax refuses an array that one process holds alone and
  fails on one that a process holds no shard of, so each array keeps its own sharding and every
  device copies what it holds (on GPUs in parallel, one DMA per device).
- Into host memory. On GPU (and any device with `pinned_host` memory) a device_put into pinned
  host memory: one DMA per shard, dispatched without waiting (a donating step that follows waits
  for them itself: the runtime holds a read on every buffer being copied), and the state's second
  copy costs no HBM. On CPU, whose device buffers already are host memory, one numpy memcpy per
  shard (`copies_with_numpy`).

Orbax restores any checkpoint into the sharding its caller asks for, so writing from the sub-mesh
changes nothing that a restore or the reference reader sees (the files hold the global arrays).
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def _named_axes(spec: PartitionSpec) -> set[str]:
    axes: set[str] = set()
    for entry in spec:
        if entry is None:
            continue
        axes.update(entry if isinstance(entry, tuple) else (entry,))
    return axes


def host_memory_kind(device) -> str | None:
    """The memory kind a snapshot lives in on `device`: pinned host memory if it has some."""
    kinds = {m.kind for m in device.addressable_memories()}
    return "pinned_host" if "pinned_host" in kinds else None


@functools.lru_cache(maxsize=256)
def writer_sharding(sharding: NamedSharding, offset: int = 0) -> NamedSharding:
    """`sharding` restricted to one device per shard: size 1 along every mesh axis its spec does not
    name. The device kept for a shard at position p (over the named axes) is replica
    (p + offset) mod (number of replicas), counted over the unnamed axes."""
    mesh = sharding.mesh
    named = _named_axes(sharding.spec)
    replicated = [i for i, name in enumerate(mesh.axis_names) if name not in named]
    shape = tuple(1 if i in replicated else n for i, n in enumerate(mesh.devices.shape))
    replica_shape = tuple(mesh.devices.shape[i] for i in replicated)
    replicas = int(np.prod(replica_shape, dtype=np.int64))
    devices = np.empty(shape, dtype=object)
    for flat, position in enumerate(itertools.product(*(range(n) for n in shape))):
        source = list(position)
        for axis, coord in zip(replicated, np.unravel_index((flat + offset) % replicas, replica_shape)):
            source[axis] = int(coord)
        devices[position] = mesh.devices[tuple(source)]
    memory_kind = host_memory_kind(mesh.devices.flat[0])
    return NamedSharding(Mesh(devices, mesh.axis_names), sharding.spec, memory_kind=memory_kind)


class _LeafPlan(NamedTuple):
    """How one array is copied: which of its addressable shards, onto which host shardings, and
    the global array they make up (`target`, `shape`)."""

    shard_indices: tuple[int, ...]  # into leaf.addressable_shards
    shard_targets: tuple[jax.sharding.SingleDeviceSharding, ...]
    target: jax.sharding.Sharding
    shape: jax.ShapeDtypeStruct


def _leaf_plan(leaf, index: int) -> _LeafPlan:
    if isinstance(leaf.sharding, NamedSharding) and jax.process_count() == 1:
        target = writer_sharding(leaf.sharding, index)
    else:
        # Several processes: orbax refuses an array that one process holds alone ("host local"),
        # and fails on one that a process holds no shard of; every replica is copied, each
        # device its own (in parallel on GPUs, one DMA per device).
        target = leaf.sharding.with_memory_kind(host_memory_kind(next(iter(leaf.sharding.device_set))))
    position = {shard.device: i for i, shard in enumerate(leaf.addressable_shards)}
    devices = list(target.addressable_devices)
    return _LeafPlan(tuple(position[d] for d in devices),
                     tuple(jax.sharding.SingleDeviceSharding(d, memory_kind=target.memory_kind) for d in devices),
                     target, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))


_plan_cache: dict[tuple, tuple[_LeafPlan | None, ...]] = {}


def _plans(leaves, treedef) -> tuple[_LeafPlan | None, ...]:
    """Every leaf's plan (None for a leaf that is not a jax.Array), made once per tree layout: a
    save then costs the copies and little else (making the plans costs ~5 us per array)."""
    key = (treedef, tuple((leaf.shape, leaf.dtype, leaf.sharding) if isinstance(leaf, jax.Array) else None
                          for leaf in leaves))
    plans = _plan_cache.get(key)
    if plans is None:
        if len(_plan_cache) >= 64:  # a run has a few layouts (one per world); keep memory bounded
            _plan_cache.clear()
        plans = _plan_cache[key] = tuple(_leaf_plan(leaf, i) if isinstance(leaf, jax.Array) else None
                                         for i, leaf in enumerate(leaves))
    return plans


class Snapshot:
    """Copies made off the devices (`take`); `arrays()` wraps them as the global arrays the save
    writes. Only `take` must run before the state is donated: `arrays()` may run on another
    thread, later."""

    def __init__(self, treedef, plans, copies, host_leaves, on_host: bool):
        self._treedef, self._plans, self._copies = treedef, plans, copies
        self._host_leaves, self._on_host = host_leaves, on_host

    def arrays(self):
        copies = self._copies
        if self._on_host and copies:  # numpy copies: placed now, off the training thread
            copies = jax.device_put(copies, [t for plan in self._plans if plan for t in plan.shard_targets])
        copies, host_leaves = iter(copies), iter(self._host_leaves)
        out = []
        for plan in self._plans:
            if plan is None:
                out.append(next(host_leaves))
                continue
            shards = [next(copies) for _ in plan.shard_indices]
            out.append(jax.make_array_from_single_device_arrays(plan.shape.shape, plan.target, shards,
                                                                dtype=plan.shape.dtype))
        return jax.tree.unflatten(self._treedef, out)


def take(tree, *, with_numpy: bool | None = None) -> Snapshot:
    """Copies `tree`'s arrays for the save (see the module docstring); leaves that are not
    jax.Arrays are copied on the host.

    `with_numpy` (default: on CPU devices): CPU devices keep their buffers in host memory, so one
    numpy memcpy per shard is the copy, and it costs less than a device_put into pinned_host (~70
    us per array here). Elsewhere the copy is a device_put into host memory: an asynchronous DMA
    that the training thread does not wait for."""
    leaves, treedef = jax.tree.flatten(tree)
    plans = _plans(leaves, treedef)
    targets = [t for plan in plans if plan is not None for t in plan.shard_targets]
    if with_numpy is None:
        with_numpy = bool(targets) and next(iter(targets[0].device_set)).platform == "cpu"
    arrays = [(leaf, plan) for leaf, plan in zip(leaves, plans) if plan is not None]
    if with_numpy:
        # addressable_data, not addressable_shards: a new array builds its Shard objects on first
        # use (~70 us each here). Of a fully replicated array it gives one replica, whichever the
        # plan named: the bytes are the same, all in host memory.
        copies = [np.array(leaf.addressable_data(i), copy=True) for leaf, plan in arrays for i in plan.shard_indices]
    elif arrays:
        # One batched device_put for every shard of every array: one dispatch, not one per shard;
        # each from the replica the plan chose (its DMA runs from that device).
        copies = jax.device_put([leaf.addressable_shards[i].data for leaf, plan in arrays for i in plan.shard_indices],
                                targets)
    else:
        copies = []
    host_leaves = [np.array(leaf, copy=True) for leaf, plan in zip(leaves, plans) if plan is None]
    return Snapshot(treedef, plans, copies, host_leaves, on_host=with_numpy)
