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


def _copy_plan(leaf, index: int):
    """(target sharding, [(source shard array, target single-device sharding)]) for one array."""
    if isinstance(leaf.sharding, NamedSharding) and jax.process_count() == 1:
        target = writer_sharding(leaf.sharding, index)
    else:
        # Several processes: orbax refuses an array that one process holds alone ("host local"),
        # and fails on one that a process holds no shard of; every replica is copied, each
        # device its own (in parallel on GPUs, one DMA per device).
        target = leaf.sharding.with_memory_kind(host_memory_kind(next(iter(leaf.sharding.device_set))))
    by_device = {shard.device: shard.data for shard in leaf.addressable_shards}
    kind = target.memory_kind
    sources = [(by_device[d], jax.sharding.SingleDeviceSharding(d, memory_kind=kind))
               for d in target.addressable_devices]
    return target, sources


class Snapshot:
    """Copies made off the devices (`take`); `arrays()` wraps them as the global arrays the save
    writes. Only `take` must run before the state is donated: `arrays()` may run on another
    thread, later."""

    def __init__(self, treedef, leaves, plans, copies, targets, on_host: bool):
        self._treedef, self._leaves, self._plans, self._copies = treedef, leaves, plans, copies
        self._targets, self._on_host = targets, on_host

    def arrays(self):
        copies = self._copies
        if self._on_host and copies:  # numpy copies: placed now, off the training thread
            copies = jax.device_put(copies, self._targets)
        copies = iter(copies)
        out = []
        for leaf, plan in zip(self._leaves, self._plans):
            if plan is None:
                out.append(leaf)  # already a host copy
                continue
            target, shard_plan = plan
            shards = [next(copies) for _ in shard_plan]
            out.append(jax.make_array_from_single_device_arrays(leaf.shape, target, shards, dtype=leaf.dtype))
        return jax.tree.unflatten(self._treedef, out)


def copies_with_numpy(tree) -> bool:
    """CPU devices keep their buffers in host memory: one numpy memcpy per shard is the copy, and
    it costs less than a device_put into pinned_host (~70 us per array here). Elsewhere the copy
    is a device_put into host memory: an asynchronous DMA that the training thread does not wait
    for."""
    leaves = [leaf for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array)]
    return bool(leaves) and next(iter(leaves[0].sharding.device_set)).platform == "cpu"


def take(tree, *, with_numpy: bool | None = None) -> Snapshot:
    """Copies `tree`'s arrays for the save (see the module docstring; `with_numpy`: see
    `copies_with_numpy`, the default); leaves that are not jax.Arrays are copied on the host."""
    if with_numpy is None:
        with_numpy = copies_with_numpy(tree)
    leaves, treedef = jax.tree.flatten(tree)
    plans = [(_copy_plan(leaf, i) if isinstance(leaf, jax.Array) else None) for i, leaf in enumerate(leaves)]
    sources = [src for plan in plans if plan is not None for src, _ in plan[1]]
    targets = [dst for plan in plans if plan is not None for _, dst in plan[1]]
    if with_numpy:
        copies = [np.array(src, copy=True) for src in sources]
    else:
        # One batched device_put for every shard of every array: one dispatch, not one per shard.
        copies = jax.device_put(sources, targets) if sources else []
    # Only the leaves' shapes are kept: the state may be donated once this returns.
    shapes = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) if plan is not None else np.array(leaf, copy=True)
              for leaf, plan in zip(leaves, plans)]
    return Snapshot(treedef, shapes, plans, copies, targets, on_host=with_numpy)
