"""The topology field: which hosts (regions, devices) ran the mesh, and its shape, per generation.

A plain dict builder so the elastic runtime can fill what it knows (generation numbers, region of
each host) and a static run can leave the defaults: hosts = JAX processes, region "local",
generation 0. `history` lists the topology changes a run went through across resumes. `replica_groups` lists,
per replica (index along the mesh's `data` axis), the processes that hold it: one each, or groups
of k with parallel.hosts_per_replica = k.

Two topologies are "the same" when what a restore depends on is the same: process count, devices
per host, mesh axes and shape, regions and generation. Device ids are recorded but not compared
(they are renumbered freely by the runtime).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

DEFAULT_REGION = "local"


def build_topology(mesh, *, generation: int = 0, regions: Mapping[int, str] | None = None,
                   history: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The topology dict of `mesh` (a jax.sharding.Mesh): hosts are the processes owning its devices."""
    import jax

    regions = regions or {}
    by_process: dict[int, list[int]] = {}
    for device in mesh.devices.flat:
        by_process.setdefault(int(device.process_index), []).append(int(device.id))
    counts = sorted({len(ids) for ids in by_process.values()})
    first = mesh.devices.flat[0]
    # One replica per index along `data`: the processes whose devices hold it (one host, or a
    # group of k hosts with parallel.hosts_per_replica = k).
    rows = (np.take(mesh.devices, i, axis=list(mesh.axis_names).index("data")) for i in range(mesh.shape["data"])) \
        if "data" in mesh.axis_names else iter([mesh.devices])
    replica_groups = [sorted({int(d.process_index) for d in row.flat}) for row in rows]
    return {
        "generation": int(generation),
        "process_count": int(jax.process_count()),
        "devices_per_host": counts[0] if len(counts) == 1 else counts,
        "platform": str(first.platform),
        "device_kind": str(first.device_kind),
        "hosts": [
            {"process": p, "region": regions.get(p, DEFAULT_REGION), "devices": sorted(ids)}
            for p, ids in sorted(by_process.items())
        ],
        "mesh": {"axis_names": [str(a) for a in mesh.axis_names],
                 "shape": [int(mesh.shape[a]) for a in mesh.axis_names]},
        "replica_groups": replica_groups,
        "history": [dict(h) for h in history],
    }


def comparable(topology: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a topology a restore depends on (see the module docstring)."""
    return {
        "generation": topology.get("generation"),
        "process_count": topology.get("process_count"),
        "devices_per_host": topology.get("devices_per_host"),
        "mesh": topology.get("mesh"),
        "regions": [h.get("region") for h in topology.get("hosts", [])],
    }


def describe(topology: Mapping[str, Any]) -> str:
    """One line, e.g. `1 host x 8 cpu devices, mesh data=8 fsdp=1 tensor=1, generation 0`."""
    mesh = topology.get("mesh", {})
    axes = " ".join(f"{a}={s}" for a, s in zip(mesh.get("axis_names", []), mesh.get("shape", [])))
    hosts = topology.get("process_count", "?")
    groups = topology.get("replica_groups") or []
    span = max((len(g) for g in groups), default=1)
    replicas = f", replicas of {span} hosts" if span > 1 else ""
    return (f"{hosts} host{'s' if hosts != 1 else ''} x {topology.get('devices_per_host', '?')} "
            f"{topology.get('platform', '')} devices, mesh {axes}{replicas}, generation {topology.get('generation', '?')}")
