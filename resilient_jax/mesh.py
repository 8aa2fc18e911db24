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

from resilient_jax.config import ConfigError, ParallelConfig

MESH_AXES = ("data", "fsdp", "tensor")
DATA_AXIS, FSDP_AXIS, TENSOR_AXIS = MESH_AXES

# logical dim -> mesh axis (or None = replicated). Weights shard over fsdp/tensor inside a replica
# and are replicated across replicas, so every replica holds a full copy (DESIGN invariant 3).
LOGICAL_RULES: dict[str, str | None] = {
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "mlp": "tensor",
    "kv": None,
    "layers": None,  # stacked blocks of model.scan_layers: every device holds all layers' slices
    # activations only (resilient_jax.activations): each virtual shard's rows stay on one device
    "batch": None,
    "length": None,
    "kv_length": None,
}


def mesh_shape(parallel: ParallelConfig, num_devices: int) -> dict[str, int]:
    """Resolve `parallel.{data,fsdp,tensor}` (-1 = the rest) against the devices available."""
    sizes = {"data": parallel.data, "fsdp": parallel.fsdp, "tensor": parallel.tensor}
    rest = [axis for axis, size in sizes.items() if size == -1]
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"parallel.{axis} must be a positive size or -1 (the rest), got {size}")
    if len(rest) > 1:
        raise ConfigError(f"only one of parallel.data/fsdp/tensor may be -1, got -1 for {', '.join(rest)}")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if rest:
        if num_devices % fixed:
            raise ConfigError(
                f"parallel.{rest[0]}=-1: {num_devices} devices are not divisible by the other axes' product {fixed}"
            )
        sizes[rest[0]] = num_devices // fixed
    if math.prod(sizes.values()) > num_devices:
        raise ConfigError(
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


def specs_from_logical(logical_tree):
    """Map a tree of logical-axis tuples to mesh PartitionSpecs."""
    return jax.tree.map(logical_to_mesh_spec, logical_tree, is_leaf=lambda x: isinstance(x, tuple))


def shardings_from_logical(logical_tree, mesh: Mesh | AbstractMesh):
    """Map a tree of logical-axis tuples to NamedShardings on `mesh`."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), specs_from_logical(logical_tree),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def activation_rule(mesh: Mesh | AbstractMesh, manual: frozenset):
    """The activation rule (resilient_jax.activations) inside a shard_map manual over `manual`: each
    dim's logical name -> its mesh axis if GSPMD partitions that axis there (an automatic axis of
    size > 1), else whole. None when no such axis exists (nothing to pin)."""
    auto = {axis for axis in MESH_AXES if axis not in manual and mesh.shape[axis] > 1}
    if not auto:
        return None

    def rule(x, names):
        axes = [LOGICAL_RULES.get(name) if name is not None else None for name in names]
        return jax.lax.with_sharding_constraint(x, PartitionSpec(*(a if a in auto else None for a in axes)))

    return rule


def keep_axes(spec: PartitionSpec, axes) -> PartitionSpec:
    """`spec` with every mesh axis outside `axes` replaced by None (for a partially manual shard_map)."""
    return PartitionSpec(*(a if a in axes else None for a in spec))


def axis_position(spec: PartitionSpec, axis: str) -> int:
    """Which array dimension `spec` shards over mesh axis `axis`; -1 if none."""
    return next((i for i, a in enumerate(spec) if a == axis), -1)


def grid_size(mesh: Mesh | AbstractMesh) -> int:
    """Devices of the data x fsdp grid: each computes whole virtual shards (tensor devices share them)."""
    return mesh.shape[DATA_AXIS] * mesh.shape[FSDP_AXIS]


def check_model_layout(model, sizes: dict[str, int]) -> None:
    """Refuse, before any compile, a tensor/fsdp size that cannot split the model's dims."""
    tensor, fsdp = sizes[TENSOR_AXIS], sizes[FSDP_AXIS]
    for key, dim in (("model.n_heads", model.n_heads), ("model.vocab_size", model.vocab_size),
                     ("model.d_ff", model.d_ff)):
        if dim % tensor:
            raise ValueError(
                f"parallel.tensor ({tensor}) must divide {key} ({dim}); use a tensor size in {_divisors(dim)}"
            )
    if model.d_model % fsdp:
        raise ValueError(
            f"parallel.fsdp ({fsdp}) must divide model.d_model ({model.d_model}); "
            f"use an fsdp size in {_divisors(model.d_model)}"
        )


def check_param_layout(factory: str, shapes: dict[str, tuple[int, ...]], logical: dict[str, tuple],
                       sizes: dict[str, int]) -> None:
    """Refuse, before any compile, a mesh whose fsdp / tensor size does not divide a param dim its
    logical axis puts on that mesh axis (`shapes`, `logical`: by param path). For a model of your
    own, whose dims no model.* key names."""
    for where, shape in shapes.items():
        for dim, name in zip(shape, logical[where]):
            axis = LOGICAL_RULES.get(name) if name is not None else None
            if axis is not None and dim % sizes[axis]:
                raise ValueError(
                    f"parallel.{axis} ({sizes[axis]}) must divide dim {name!r} ({dim}) of param {where} "
                    f"{tuple(shape)} of model.factory {factory}; use a {axis} size in {_divisors(dim)}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 64) + 1) if n % d == 0]


def replicated(mesh: Mesh | AbstractMesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh | AbstractMesh) -> NamedSharding:
    """Rows of the global batch are split over the data x fsdp grid, data-major (a virtual shard
    stays whole on one grid device); devices along `tensor` hold the same rows."""
    return NamedSharding(mesh, PartitionSpec((DATA_AXIS, FSDP_AXIS)))
