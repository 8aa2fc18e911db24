"""Topology -> device mesh, and the one table that maps logical axis names to mesh axes.

Mesh axes: `data` (data-parallel replicas; hosts join and leave along it), `fsdp` and `tensor`
(sharding inside a replica). The model names its dims logically; this module alone decides where
they go.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from resilient_jax.config import ParallelConfig

MESH_AXES = ("data", "fsdp", "tensor")
DATA_AXIS = "data"

# logical dim -> mesh axis (or None = replicated). Weights shard over fsdp/tensor inside a replica
# and are replicated across replicas, so every replica holds a full copy (DESIGN invariant 3).
LOGICAL_RULES: dict[str, str | None] = {
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "mlp": "tensor",
    "kv": None,
    "layers": None,  # stacked blocks of model.scan_layers: every device holds all layers' slices
}


def mesh_shape(parallel: ParallelConfig, num_devices: int) -> dict[str, int]:
    """Resolve `parallel.{data,fsdp,tensor}` (-1 = the rest) against the devices available."""
    sizes = {"data": parallel.data, "fsdp": parallel.fsdp, "tensor": parallel.tensor}
    rest = [axis for axis, size in sizes.items() if size == -1]
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ValueError(f"parallel.{axis} must be a positive size or -1 (the rest), got {size}")
    if len(rest) > 1:
        raise ValueError(f"only one of parallel.data/fsdp/tensor may be -1, got -1 for {', '.join(rest)}")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if rest:
        if num_devices % fixed:
            raise ValueError(
                f"parallel.{rest[0]}=-1: {num_devices} devices are not divisible by the other axes' product {fixed}"
            )
        sizes[rest[0]] = num_devices // fixed
    if math.prod(sizes.values()) > num_devices:
        raise ValueError(
            f"parallel.data*fsdp*tensor = {math.prod(sizes.values())} exceeds the {num_devices} devices available; "
            "lower them or set parallel.devices"
        )
    return sizes


def build_mesh(parallel: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over the first data*fsdp*tensor devices, `data` major so each host's devices are contiguous."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_shape(parallel, len(devices))
    count = math.prod(sizes.values())
    grid = np.array(devices[:count], dtype=object).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(grid, MESH_AXES)


def build_abstract_mesh(parallel: ParallelConfig, num_devices: int) -> AbstractMesh:
    """The same mesh without devices, to check a config's shapes and shardings for a cluster we lack."""
    sizes = mesh_shape(parallel, num_devices)
    return AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)


def logical_to_mesh_spec(logical_axes: Sequence[str | None]) -> PartitionSpec:
    unknown = [a for a in logical_axes if a is not None and a not in LOGICAL_RULES]
    if unknown:
        raise KeyError(f"logical axis {unknown[0]!r} has no rule in resilient_jax.mesh.LOGICAL_RULES")
    return PartitionSpec(*(None if a is None else LOGICAL_RULES[a] for a in logical_axes))


def shardings_from_logical(logical_tree, mesh: Mesh | AbstractMesh):
    """Map a tree of logical-axis tuples to NamedShardings on `mesh`."""
    return jax.tree.map(
        lambda axes: NamedSharding(mesh, logical_to_mesh_spec(axes)),
        logical_tree,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def replicated(mesh: Mesh | AbstractMesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh | AbstractMesh) -> NamedSharding:
    """Rows of the global batch are split over replicas (virtual shards stay whole on one replica)."""
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))
