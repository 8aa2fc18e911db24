"""FSDP (ZeRO-3) inside the compute shard_map: weights are all-gathered one parameter group at a
time where the model uses them, and each virtual shard's gradient of that group is summed over
`fsdp` inside the backward pass -- so no device holds a whole-model gradient or accumulator, nor
(with the model's remat `block` or `save_dots`, which re-gather each block in the backward pass)
the whole model's weights.

A *group* is a set of parameters gathered together. The built-in transformer has two kinds: one
block (its `prepare_layer` hook gathers it inside the layer scan and inside the remat, so the
backward pass gathers it again instead of keeping it) and the parameters outside the blocks
(embedding, final norm, unembedding; gathered at the start of the forward pass). A model of your
own, which has no such hook, is one group.

How a group's gradient leaves the backward pass: the gather is a `jax.custom_vjp` of (the
group's fsdp-local weights, a *channel*). Its backward pass takes the group's full gradient of
the one shard this device computes, sums it over fsdp with the step's reduction
(resilient_jax.reduce: exact integers or floats), adds it to the device's running sum -- which
the channel carries in -- and returns the new sum as the channel's cotangent; the weights get a
zero cotangent. Cotangents must be floats, so a channel holds the sum's bits as float32
(`to_channel`: int64 -> two int32 -> float32, int32 -> float32, bitcasts). Between the backward
pass and the caller nothing computes on them: each channel is used once (no cotangent is added
to another), and the layer scan stacks the cotangents of its scanned inputs. tests/test_fsdp.py
sends every bit pattern (NaN and infinity ones too) through the scanned, rematerialised model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from resilient_jax import activations, collectives
from resilient_jax import mesh as mesh_lib
from resilient_jax.reduce import GroupSum, Reducer, block_dims


# Packing a group's leaves into one collective (collectives.gather / scatter_sum) saves a collective
# per leaf, which matters on XLA:CPU (no combiner), but costs a packed copy of the whole group next
# to its leaves -- at the 300B config's widths a 25 GB int64 row for one block's exact gradient
# sum (scripts/bench_scale.py). Above this size (the group's full weights, in their dtypes) each
# leaf has its own collectives, whose buffers XLA can free one by one; on GPU its combiners
# merge small collectives anyway. The exact sum has the same bits either way (integers).
PACK_MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class Group:
    """One parameter group as a device of the data x fsdp grid sees it (static, hashable)."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]  # each leaf's full shape, as the model uses it (one layer's)
    dtypes: tuple[Any, ...]
    dims: tuple[int, ...]  # the dim sharded over fsdp; -1: not sharded (whole on every member)
    axis: str  # the fsdp mesh axis
    size: int  # its size
    # One collective per kind for the whole group -- False with tensor > 1 (see collectives.gather)
    # and for a group over PACK_MAX_BYTES (see there).
    pack: bool
    # Per leaf, its sharding over the mesh axes GSPMD partitions inside the step (`tensor` when > 1;
    # None when there are none): gathered weights and their gradients are pinned to it.
    auto_specs: tuple[PartitionSpec, ...] | None = None
    # Per leaf, the dtype it is gathered in (None: its own). The model only ever uses such a leaf
    # cast to that dtype, so casting the fsdp slice before the gather gives the same bits with half
    # the gathered bytes (bf16), and its gradient comes back in that dtype, as the model's cast
    # would have made it, before it is widened again for the sum.
    gather_dtypes: tuple[Any, ...] | None = None

    def local_shape(self, i: int) -> tuple[int, ...]:
        shape, dim = list(self.shapes[i]), self.dims[i]
        if dim >= 0:
            shape[dim] //= self.size
        return tuple(shape)

    def local_blocks(self, blocks: jax.Array, i: int) -> jax.Array:
        """This member's rows of leaf i's per-block array (leading stack dims allowed): the blocks
        of its fsdp slice when fsdp splits the leaf along a block-index dim, else all of them
        (a block split by fsdp has one lsb, kept whole by every member)."""
        k = block_dims(self.shapes[i])
        dim = self.dims[i]
        if self.size == 1 or not 0 <= dim < k:
            return blocks
        dim += blocks.ndim - k  # past the stack dims
        rows = blocks.shape[dim] // self.size
        return lax.dynamic_slice_in_dim(blocks, lax.axis_index(self.axis) * rows, rows, dim)

    def gather(self, local_tree):
        """The group's full weights from every member's slice (all-gathers over fsdp)."""
        if self.gather_dtypes is not None:
            local_tree = jax.tree.unflatten(self.treedef, [
                x.astype(d) for x, d in zip(self.treedef.flatten_up_to(local_tree), self.gather_dtypes)])
        return self.pin(collectives.gather(local_tree, jax.tree.unflatten(self.treedef, list(self.dims)),
                                           axis=self.axis, size=self.size, pack=self.pack))

    def pin(self, full_tree):
        """Full-shape leaves (weights, or their gradients) constrained to their tensor sharding, so
        that GSPMD splits the matmuls that make them the same way in every program."""
        if self.auto_specs is None:
            return full_tree
        leaves = self.treedef.flatten_up_to(full_tree)
        return jax.tree.unflatten(self.treedef, [jax.lax.with_sharding_constraint(x, spec)
                                                 for x, spec in zip(leaves, self.auto_specs)])

    def zeros(self):
        return jax.tree.unflatten(self.treedef, [jnp.zeros(self.local_shape(i), d) for i, d in enumerate(self.dtypes)])


def group_of(shapes_tree, specs_tree, mesh: Mesh, drop_leading: bool = False, gather_dtypes_tree=None) -> Group:
    """The Group of params with these (full) shapes and PartitionSpecs on `mesh`; `drop_leading`:
    one layer of stacked params; `gather_dtypes_tree`: per leaf, the dtype to gather it in (None
    leaves: its own; see Group.gather_dtypes)."""
    leaves, treedef = jax.tree.flatten(shapes_tree)
    specs = treedef.flatten_up_to(specs_tree)
    fsdp, tensor = mesh_lib.FSDP_AXIS, mesh_lib.TENSOR_AXIS
    dims = [mesh_lib.axis_position(spec, fsdp) for spec in specs]
    shapes = [tuple(x.shape) for x in leaves]
    if drop_leading:  # a stacked layer: the leading "layers" dim is never sharded
        assert all(d != 0 for d in dims), dims
        shapes, dims = [s[1:] for s in shapes], [d - 1 if d > 0 else -1 for d in dims]
        specs = [PartitionSpec(*tuple(spec)[1:]) for spec in specs]
    auto_specs = None
    if mesh.shape[tensor] > 1:  # tensor is the only axis GSPMD partitions inside the step
        auto_specs = tuple(PartitionSpec(*(a if a == tensor else None for a in tuple(spec) + (None,) * (len(shape)
                                           - len(spec)))) for spec, shape in zip(specs, shapes))
    dtypes = tuple(jnp.dtype(x.dtype) for x in leaves)
    gather_dtypes = None
    if gather_dtypes_tree is not None:
        wanted = treedef.flatten_up_to(gather_dtypes_tree)
        gather_dtypes = tuple(own if d is None else jnp.dtype(d) for own, d in zip(dtypes, wanted))
        gather_dtypes = None if gather_dtypes == dtypes else gather_dtypes
    full_bytes = sum(math.prod(shape) * d.itemsize for shape, d in zip(shapes, dtypes))
    return Group(treedef=treedef, shapes=tuple(shapes), dtypes=dtypes, dims=tuple(dims), axis=fsdp,
                 size=mesh.shape[fsdp], pack=mesh.shape[tensor] == 1 and full_bytes <= PACK_MAX_BYTES,
                 auto_specs=auto_specs, gather_dtypes=gather_dtypes)


# -- channels: a group's running sum as float32 bits --------------------------------------------------


def to_channel(tree):
    def encode(x):
        if x.dtype == jnp.float32:
            return x
        if x.dtype == jnp.int64:
            x = lax.bitcast_convert_type(x, jnp.int32)  # [..., 2]
        return lax.bitcast_convert_type(x.astype(jnp.int32), jnp.float32)

    with jax.enable_x64(True):
        return jax.tree.map(encode, tree)


def from_channel(channel, like):
    """The inverse of `to_channel`; `like`: the encoded tree's shapes and dtypes."""

    def decode(c, ref):
        if ref.dtype == jnp.float32:
            return c
        x = lax.bitcast_convert_type(c, jnp.int32)
        return lax.bitcast_convert_type(x, jnp.int64) if ref.dtype == jnp.int64 else x.astype(ref.dtype)

    with jax.enable_x64(True):
        return jax.tree.map(decode, channel, like)


def _shapes_of(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def summing_gather(group: Group, reducer: Reducer) -> Callable:
    """gather(local, channel) -> the group's full weights; in the backward pass the group's
    gradient is added, summed over fsdp, to the sum the channel carries (module docstring)."""
    with jax.enable_x64(True):
        like = jax.eval_shape(lambda: reducer.init(group))

    @jax.custom_vjp
    def gather(local, channel):
        return group.gather(local)

    def forward(local, channel):
        return group.gather(local), channel

    def backward(channel, grads_full):
        # Widened back to the params' dtype (exact) before anything sums them.
        grads = [g.astype(d) for g, d in zip(jax.tree.leaves(group.pin(grads_full)), group.dtypes)]
        total = reducer.add(group, from_channel(channel, like), grads)
        return group.zeros(), to_channel(total)

    gather.defvjp(forward, backward)
    return gather


# -- the model's params as groups -------------------------------------------------------------------


@dataclass(frozen=True)
class Sums:
    """A device's running gradient sums: one GroupSum for the top group, and the layers' (one
    GroupSum whose arrays are stacked [n_layers, ...] for scanned layers, else a list)."""

    top: GroupSum
    layers: Any

    def flat(self) -> list[GroupSum]:
        if self.layers is None:
            return [self.top]
        return [self.top, *(self.layers if isinstance(self.layers, list) else [self.layers])]

    def for_shard(self, live: jax.Array) -> Sums:
        """These sums, about to add a real shard (`live` true) or a padding slot (nothing)."""
        def set_live(gs: GroupSum) -> GroupSum:
            return gs._replace(live=jnp.broadcast_to(live.astype(jnp.int32), gs.live.shape))

        layers = self.layers
        if layers is not None:
            layers = [set_live(gs) for gs in layers] if isinstance(layers, list) else set_live(layers)
        return Sums(top=set_live(self.top), layers=layers)


jax.tree_util.register_dataclass(Sums, data_fields=["top", "layers"], meta_fields=[])


@dataclass(frozen=True)
class Partition:
    """How the model's parameters divide into groups: `top` (gathered at the start of the forward
    pass) and, for a model with the layer hook, `layer` (one block, gathered where it runs)."""

    top: Group
    layer: Group | None
    n_layers: int
    stacked: bool  # scanned layers: the blocks' leaves carry a leading [n_layers] dim
    activation_rule: activations.Rule | None = None  # the model's activations pinned so (see there)

    @classmethod
    def of(cls, model_def, mesh: Mesh, activation_rule: activations.Rule | None = None) -> Partition:
        shapes = model_def.abstract_params
        specs = mesh_lib.specs_from_logical(model_def.logical_axes)
        if not model_def.builtin:
            return cls(top=group_of(shapes, specs, mesh), layer=None, n_layers=0, stacked=False,
                       activation_rule=activation_rule)
        top = {k: v for k, v in shapes.items() if k != "blocks"}
        top_specs = {k: v for k, v in specs.items() if k != "blocks"}
        blocks, block_specs = shapes["blocks"], specs["blocks"]
        stacked = model_def.cfg.scan_layers
        cast = model_def.compute_cast_dtypes()
        top_cast = {k: v for k, v in cast.items() if k != "blocks"}
        layer = (group_of(blocks, block_specs, mesh, drop_leading=True, gather_dtypes_tree=cast["blocks"]) if stacked
                 else group_of(blocks[0], block_specs[0], mesh, gather_dtypes_tree=cast["blocks"][0]))
        return cls(top=group_of(top, top_specs, mesh, gather_dtypes_tree=top_cast), layer=layer,
                   n_layers=model_def.cfg.n_layers, stacked=stacked, activation_rule=activation_rule)

    def groups(self) -> list[Group]:
        """The group of each GroupSum of `Sums.flat()`."""
        if self.layer is None:
            return [self.top]
        return [self.top, *([self.layer] * (1 if self.stacked else self.n_layers))]

    def split(self, params) -> tuple[Any, Any]:
        """params -> (top, blocks): blocks stacked (scan) or a list of per-layer trees."""
        if self.layer is None:
            return params, None
        top = {k: v for k, v in params.items() if k != "blocks"}
        blocks = params["blocks"]
        return top, blocks if self.stacked else [blocks[i] for i in range(self.n_layers)]

    def join(self, top, blocks):
        if self.layer is None:
            return top
        return {**top, "blocks": blocks if self.stacked else dict(enumerate(blocks))}

    def per_group(self, leaves: list) -> list[list]:
        """A flat list over every GroupSum's leaves (in `Sums.flat()` order) -> one list per GroupSum."""
        out, start = [], 0
        for group in self.groups():
            out.append(list(leaves[start:start + len(group.shapes)]))
            start += len(group.shapes)
        assert start == len(leaves), (start, len(leaves))
        return out

    def params_from(self, per_group: list[list]):
        """One list of leaves per GroupSum (`Sums.flat()` order) -> the params tree."""
        top = jax.tree.unflatten(self.top.treedef, per_group[0])
        if self.layer is None:
            return top
        layers = [jax.tree.unflatten(self.layer.treedef, leaves) for leaves in per_group[1:]]
        return self.join(top, layers[0] if self.stacked else layers)

    def init(self, reducer: Reducer, plans: list | None = None) -> Sums:
        """Nothing added yet; `plans`: pass 2's fixed lsb per GroupSum of `flat()` (exact only)."""
        plans = plans if plans is not None else [None] * len(self.groups())
        top = reducer.init(self.top, plans[0])
        if self.layer is None:
            return Sums(top=top, layers=None)
        if self.stacked:
            return Sums(top=top, layers=reducer.init(self.layer, plans[1], stack=(self.n_layers,)))
        return Sums(top=top, layers=[reducer.init(self.layer, p) for p in plans[1:]])

    def forward(self, model_def, params_local, tokens_BxL, dropout_key=None):
        """Logits from fsdp-local params, each group gathered where it is used (no gradient sums)."""
        top, blocks = self.split(params_local)
        params = self.join(self.top.gather(top), blocks)
        with activations.rule(self.activation_rule):
            if self.layer is None:
                return model_def.forward(params, tokens_BxL, dropout_key)
            return model_def.forward(params, tokens_BxL, dropout_key,
                                     prepare_layer=lambda layer, _: self.layer.gather(layer))

    def value_and_sums(self, model_def, reducer: Reducer, loss_of_logits, params_local, tokens_BxL, dropout_key,
                       sums: Sums):
        """((loss, aux), sums + this shard's gradient summed over fsdp): `loss_of_logits(logits)`
        -> (scalar loss, aux) is differentiated; the gradient never exists whole outside the
        backward pass of each group."""
        top, blocks = self.split(params_local)
        gather_top = summing_gather(self.top, reducer)
        gather_layer = None if self.layer is None else summing_gather(self.layer, reducer)

        def loss(channels: Sums):
            params = self.join(gather_top(top, channels.top), blocks)
            with activations.rule(self.activation_rule):
                if gather_layer is None:
                    logits = model_def.forward(params, tokens_BxL, dropout_key)
                else:
                    logits = model_def.forward(params, tokens_BxL, dropout_key, prepare_layer=gather_layer,
                                               layer_inputs=channels.layers)
            return loss_of_logits(logits)

        like = _shapes_of(sums)
        value, channels = jax.value_and_grad(loss, has_aux=True)(to_channel(sums))
        return value, from_channel(channels, like)
