"""The topology field: which hosts (regions, devices) ran the mesh, and its shape, per generation.

A plain dict builder so the elastic runtime can fill what it knows (generation numbers, region of
each host) and a static run can leave the defaults: hosts = JAX processes, region "local",
generation 0. `history` lists the topology changes a run went through across resumes.

Two topologies are "the same" when what a restore depends on is the same: process count, devices
per host, mesh axes and shape, regions and generation. Device ids are recorded but not compared
(they are renumbered freely by the runtime).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

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
    return (f"{hosts} host{'s' if hosts != 1 else ''} x {topology.get('devices_per_host', '?')} "
            f"{topology.get('platform', '')} devices, mesh {axes}, generation {topology.get('generation', '?')}")
