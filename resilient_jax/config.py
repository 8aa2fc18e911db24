"""Typed run configuration: dataclass defaults, YAML overlays, `--set` overrides, canonical hash.

A config is resolved in three layers -- the dataclass defaults below, one YAML file from
`configs/`, then repeatable `--set section.key=value` overrides -- and every value is type-checked
against its field. Bad input raises `ConfigError` with one line that names the key or path.

The canonical hash (sha256 of the sorted, whitespace-free JSON of the resolved config) identifies
the run's trajectory: checkpoints refuse to resume under a different hash unless the user names
the changed keys.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import inspect
import io
import json
import math
import os
import re
import sys
import tokenize
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config problem the user can fix; the message is one line naming the key or file."""


BUILTIN_MODEL = "resilient_jax.models:transformer"
DEFAULT_LOSS = "resilient_jax.losses:next_token_cross_entropy"


@dataclass(frozen=True)
class ModelConfig:
    """The model: a factory and its arguments. The built-in decoder-only transformer's arguments are
    the other model.* keys (byte-level data needs vocab_size >= 256); a factory of your own gets
    model.args instead (see resilient_jax.models for the protocol)."""

    # "package.module:build", called as build(args: dict, rngs: flax.nnx.Rngs) -> nnx.Module whose
    # __call__(tokens_BxL, *, dropout_key=None) returns logits [B, L, vocab]; imported with
    # task.import_dir first on the Python path.
    factory: str = BUILTIN_MODEL
    # The arguments of a factory of your own (free-form, part of the config hash); must be empty
    # for the built-in transformer, whose arguments are the model.* keys below.
    args: dict[str, Any] = field(default_factory=dict)

    # Token ids are 0..vocab_size-1; at least the dataset's vocabulary.
    vocab_size: int = 256
    # Width of the residual stream (a multiple of n_heads).
    d_model: int = 64
    # Transformer blocks (RMSNorm, rotary causal attention, gated MLP).
    n_layers: int = 2
    # Attention heads per block.
    n_heads: int = 4
    # Hidden width of the gated MLP.
    d_ff: int = 176
    # Dropout rate; keys are fold_in(fold_in(key(seed), step), virtual_shard).
    dropout: float = 0.0
    # Rotary position embedding base.
    rope_base: float = 10000.0
    # Compute dtype of activations; parameters and optimizer state stay float32 (but see
    # optimizer.mu_dtype).
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Rematerialisation around each block: none; block (keep only each block's input, recompute
    # the rest in the backward pass); save_dots (keep the weight-matmul outputs, recompute the
    # elementwise work and the attention scores).
    remat: Literal["none", "block", "save_dots"] = "none"
    # One scanned block over stacked parameters (leading "layers" dim): compile time flat in depth.
    scan_layers: bool = False
    # explicit: exp(scores - logsumexp) in float32, bitwise stable across layouts (see model.py);
    # dot_product: jax.nn.dot_product_attention (cuDNN flash on GPU); no attention-prob dropout.
    # Measured (scripts/bench_attention_bits.py, tiny, 10 invariant steps, CPU): explicit gave one
    # fingerprint on all of 8x1 4x1 2x1 1x1 4x2 2x4 1x8; dot_product one on the multi-device
    # layouts and another on 1 device -- so explicit is the default.
    # chunked: the explicit form's math, one block of `attention_chunk` query rows at a time, each
    # block's scores recomputed in the backward pass: [b, h, chunk, L] live instead of [b, h, L, L]
    # (at the 300B config's widths 1 GB instead of 8 GB per buffer). Not the same bits as explicit
    # (other matmul shapes); like explicit, each shard runs whole on one device with the same
    # shapes on every layout. Measured (bench_attention_bits, chunk 16 of 64, same 10 steps): one
    # fingerprint on all seven layouts; tests/test_invariance.py checks 1x1 against 2x4.
    attention: Literal["explicit", "dot_product", "chunked"] = "explicit"
    # Query rows per block of `attention: chunked`; data.seq_len must be a multiple of it (or
    # not above it: one block).
    attention_chunk: int = 512


@dataclass(frozen=True)
class TaskConfig:
    """What is learned from the model's logits; see resilient_jax.losses for the loss protocol."""

    # "package.module:fn", called as fn(logits_BxLxV, targets_BxL, weights_BxL, *, key) -> [B]
    # per-row sums of weighted token losses; the default is next-token cross-entropy.
    loss: str = DEFAULT_LOSS
    # Put first on the Python path while model.factory and task.loss are imported; "" = the
    # directory of the config file (none for a config built in Python). Made absolute at load.
    import_dir: str = ""


@dataclass(frozen=True)
class ShardQuarantine:
    # A data shard id of the dataset.
    shard: int = 0
    # The first step whose global batch leaves the shard out.
    from_step: int = 0


@dataclass(frozen=True)
class DataConfig:
    """Where samples come from. `dataset: ""` builds the default dataset in the cache on first use."""

    # Dataset directory (relative paths are against the current directory); "" = the default
    # dataset in $RESILIENT_JAX_CACHE (~/.cache/resilient_jax), built on first use.
    dataset: str = ""
    # A directory named by data.dataset that holds no dataset is an error unless this is true
    # (then it is built there from data.src); or build it with `python -m resilient_jax.data prepare`.
    build_if_missing: bool = False
    # Text to build a missing dataset from: a directory of text files, a .jsonl / .parquet file or a
    # directory of them, a Hugging Face save_to_disk directory, or "default" (the stdlib sources).
    src: str = "default"
    # How data.src is read: auto (from the extension / directory contents), text, jsonl, parquet or
    # hf (a datasets save_to_disk directory); see resilient_jax.data.sources.
    format: Literal["auto", "text", "jsonl", "parquet", "hf"] = "auto"
    # The jsonl key / parquet or hf column that holds the text.
    text_field: str = "text"
    # Data shards of a dataset that is built (a NaN shard is quarantined whole).
    shards: int = 16
    # Tokens per training sequence (records hold seq_len + 1 tokens).
    seq_len: int = 64
    # Tokenizer of a dataset that is built: `bytes` (one token per byte), `hf:PATH` (a tokenizers
    # tokenizer.json) or `sp:PATH` (a sentencepiece .model); its sha256 is checked on resume.
    tokenizer: str = "bytes"
    # Sequences per step, the same whatever the host count (a multiple of parallel.virtual_shards).
    global_batch: int = 48
    # Batches loaded ahead of the step; a bounded queue, so a slow step applies backpressure.
    prefetch: int = 2
    # Shards known to be bad, left out of the global order from `from_step` on -- exactly what the
    # automatic NaN quarantine does, declared up front (e.g. [{shard: 3, from_step: 13}]).
    quarantine: list[ShardQuarantine] = field(default_factory=list)


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation (resilient_jax.evaluation): the weighted mean loss over fixed batches and
    its exp (the perplexity), on the training mesh, with the same bits whatever the layout, the
    host count or the faults absorbed."""

    # Evaluate after every N completed steps, and after the last one; 0 = never.
    every_steps: int = 0
    # Held-out data, either the last N shards of the training dataset (left out of training from
    # step 0, changing its sample order; they stay out when eval.every_steps is 0) ...
    holdout_shards: int = 0
    # ... or a dataset directory of its own, prepared with the training data's tokenizer and seq_len
    # (relative paths are against the current directory).
    dataset: str = ""
    # Global batches (data.global_batch sequences each, the held-out samples in id order) per
    # evaluation; 0 = every full batch the held-out data holds.
    batches: int = 10


@dataclass(frozen=True)
class OptimizerConfig:
    """An optax optimizer, a warmup + decay schedule to lr * min_lr_ratio, and global-norm clipping.

    The default (adamw, cosine, decay_steps 0) is AdamW with linear warmup and cosine decay over
    train.steps. See resilient_jax.optimizer for what each name means.
    """

    # The optax optimizer: adamw, lion (wants a ~3-10x smaller lr), adafactor, sgd (with momentum).
    name: Literal["adamw", "lion", "adafactor", "sgd"] = "adamw"
    # Linear warmup, then cosine / linear decay, constant, or wsd (stable, then a linear decay).
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    # Steps over which the schedule decays; 0 = train.steps. Set it so raising train.steps later
    # does not silently stretch the schedule.
    decay_steps: int = 0
    # wsd only: the share of decay_steps spent decaying at the end (the rest is stable at lr).
    decay_fraction: float = 0.1
    # sgd only: heavy-ball momentum (0 = plain SGD).
    momentum: float = 0.9
    # Peak learning rate, reached after warmup_steps.
    lr: float = 3e-3
    # The decay ends at lr * min_lr_ratio after decay_steps (unused by the constant schedule).
    min_lr_ratio: float = 0.1
    # Steps of linear warmup from 0 to lr.
    warmup_steps: int = 20
    # Decoupled weight decay (not applied to norm scales).
    weight_decay: float = 0.1
    # AdamW / Lion first-moment decay.
    b1: float = 0.9
    # AdamW / Lion second-moment decay.
    b2: float = 0.95
    # AdamW denominator epsilon.
    eps: float = 1e-8
    # Global-norm gradient clipping threshold; 0 turns clipping off.
    clip_norm: float = 1.0
    # AdamW / Lion / SGD-momentum first-moment dtype. bfloat16 halves it (2 bytes a parameter; at
    # the 300B config's fsdp 80, 7.5 GB a GPU); DeepSeek-V3 kept both AdamW moments in bf16 without
    # a measurable loss. The second moment and the params stay float32.
    mu_dtype: Literal["float32", "bfloat16"] = "float32"


@dataclass(frozen=True)
class ParallelConfig:
    """Device mesh and gradient reduction.

    `data`, `fsdp`, `tensor` are mesh axis sizes; -1 means "the rest of the devices". Data-parallel
    replicas run along `data`; `fsdp` and `tensor` shard within a replica.
    """

    # CPU emulation: number of host-platform devices, set before JAX initialises; 0 = what is there.
    devices: int = 0
    # Data-parallel replicas (mesh axis `data`); -1 = the devices left over by fsdp and tensor.
    data: int = -1
    # Parameter sharding within a replica (mesh axis `fsdp`).
    fsdp: int = 1
    # Tensor parallelism within a replica (mesh axis `tensor`); fixed for a run's fingerprint.
    tensor: int = 1
    # The global batch is cut into this many fixed shards; the trajectory never depends on how
    # they are spread over devices (in `invariant` mode). Pick a number with many divisors.
    virtual_shards: int = 24
    # `invariant`: exact int64 fixed-point sum, the same bits on every (data, fsdp) layout and process
    # count; `native`: XLA's float reduce-scatter / psum.
    reduction: Literal["invariant", "native"] = "invariant"
    # Across the regions of topology.regions: `hierarchical` sums within each region first and sends
    # only each replica's slice across (the same bits, resilient_jax.hierarchy); `flat`: one sum
    # over every replica.
    cross_region: Literal["hierarchical", "flat"] = "hierarchical"
    # Elastic runs: hosts that together hold one replica (fsdp x tensor spans their devices; with
    # parallel.fsdp left at 1 it becomes k x topology.devices_per_host / tensor). 1: each host holds
    # whole replicas. k > 1 lets a model larger than one node train; the membership unit is then a
    # replica group of k hosts (resilient_jax.elastic.groups).
    hosts_per_replica: int = 1
    # A replica group may span regions (its fsdp collectives then cross the WAN every layer); without
    # it, k must divide each region's hosts.
    allow_cross_region_replica: bool = False


@dataclass(frozen=True)
class TrainConfig:
    # Steps of the whole run (the LR schedule spans them); raise it on resume to continue a run.
    steps: int = 200
    # Seed of every key (params init, dropout) and of the data order.
    seed: int = 0
    # Write metrics every N steps (and on the last step).
    log_every: int = 10


@dataclass(frozen=True)
class RunConfig:
    # Output directory: metrics.jsonl, TensorBoard events, config.json, summary.json (relative
    # paths are against the current directory). One run at a time: it holds run.lock while it runs.
    dir: str = "runs/default"
    # "auto": a live bar on a terminal, plain lines otherwise.
    progress: Literal["auto", "bar", "plain", "quiet"] = "auto"
    # Peak FLOP/s of one device, for MFU; 0 = look the device kind up in resilient_jax.flops
    # (H100/H200/A100), unknown elsewhere (CPU): MFU is then reported as null.
    peak_flops: float = 0.0


@dataclass(frozen=True)
class CheckpointConfig:
    """When and where the seven-field checkpoint is written (see resilient_jax.checkpoint)."""

    # Write checkpoints (and resume from them automatically).
    enabled: bool = True
    # "" = <run.dir>/checkpoints. A run whose checkpoint dir already holds checkpoints resumes.
    dir: str = ""
    # Save after every N completed steps (0 = off); the last step and a preemption (SIGTERM,
    # Ctrl-C) always save.
    every_steps: int = 50
    # Also save when this many seconds passed since the last save (0 = off).
    every_seconds: float = 0.0
    # Retention: keep the newest K checkpoints (0 = all) ...
    keep_last: int = 3
    # ... plus every step that is a multiple of M (0 = none).
    keep_every: int = 0
    # Write in the background (training waits only for the copy off the devices).
    async_save: bool = True
    # The background write's CPU priority. `low` (niceness 19, Linux): it takes only the cores the
    # step leaves idle, so where the step's compute shares the host's cores (CPU devices) the step
    # after a save loses less; but on cores the step keeps busy a save may commit only once training
    # waits for it (at the save after next, or the run's end). `normal`: it commits once written.
    write_priority: Literal["normal", "low"] = "normal"
    # Check the crc32c of every file a restore reads (and the context sha256s) and refuse a mismatch.
    verify_on_load: bool = True


@dataclass(frozen=True)
class RegionConfig:
    # Region name (fault specs like kill_region:NAME@STEP refer to it).
    name: str = "local"
    # Worker hosts of the region in the first world.
    hosts: int = 1
    # Spare hosts: registered and warm, outside the world until one replaces a straggler or a lost host.
    spares: int = 0


@dataclass(frozen=True)
class TopologyConfig:
    """Regions -> hosts -> devices. No regions: one process trains alone, without a controller.

    With regions, `python -m resilient_jax.train` starts a controller and one worker process per
    host (CPU emulation: each with `devices_per_host` devices); see resilient_jax.elastic.
    """

    # [{name, hosts, spares}] per region; empty = a single-process run.
    regions: list[RegionConfig] = field(default_factory=list)
    # Devices per worker host (CPU emulation: host-platform devices of each worker process).
    devices_per_host: int = 2


@dataclass(frozen=True)
class RuntimeConfig:
    """The elastic runtime: launcher, controller address, liveness, stall and straggler policy."""

    # local: one worker subprocess per host on this machine; ray: one worker per node of a Ray cluster.
    launcher: Literal["local", "ray"] = "local"
    # Ray only: "" starts a private Ray instance on this machine; "auto" (or host:port) attaches to a cluster.
    ray_address: str = ""
    # The controller's control channel. Bound to loopback by default; any other address requires
    # a token (here or in $RESILIENT_JAX_TOKEN) and runtime.tls.
    bind: str = "127.0.0.1"
    # The control channel's port; 0 = one the OS picks.
    port: int = 0
    # Shared secret of the control channel (or $RESILIENT_JAX_TOKEN); required off loopback.
    token: str = ""
    # Control-channel TLS (required off loopback). auto: a per-run CA and server certificate under
    # run.dir/elastic/tls/, the CA handed to launched workers; files: tls_cert, tls_key, tls_ca.
    tls: Literal["off", "auto", "files"] = "off"
    # tls=files: the controller's certificate (PEM), valid for runtime.bind.
    tls_cert: str = ""
    # tls=files: the controller's private key (PEM, unencrypted; keep it mode 0600).
    tls_key: str = ""
    # tls=files: the CA certificate (PEM) workers and `drain` verify the controller against.
    tls_ca: str = ""
    # How often each worker sends a heartbeat to the controller.
    heartbeat_seconds: float = 0.5
    # Liveness: a host whose heartbeats stop for this long is declared dead (and fenced); the
    # controller then aborts the world's in-flight collectives. Heartbeats run on their own thread,
    # so a slow step or a network spike does not stop them; time the controller itself did not run
    # (its machine stalled, its process stopped) is not counted as silence.
    dead_after_seconds: float = 6.0
    # The JAX coordination service's own heartbeat timeout (whole seconds): a member silent this long
    # is declared dead by the service itself, which on GPUs is what makes XLA abort the collectives
    # that wait on it (NCCL). The controller's liveness verdict (dead_after_seconds) comes first; this
    # is the backstop that does not need the controller. Must be >= dead_after_seconds, so that a
    # spike the controller waits out is never declared a failure by the service.
    coordination_heartbeat_seconds: int = 30
    # While a world trains, its rank 0 compiles in the background the step of the worlds most likely
    # next (one host fewer, per region; one region fewer) into the persistent compile cache, so a
    # failure's new world loads its program instead of compiling it. "auto": on for GPU workers
    # (compiling runs on host CPUs the GPUs leave idle), off on CPU workers (there it takes cores
    # from the training itself and makes rank 0 a straggler). Needs runtime.compile_cache on, in a
    # directory every host sees.
    precompile_next_worlds: Literal["auto", "on", "off"] = "auto"
    # Backstop only: a collective still blocked after this long raises even if every host is alive.
    # Failures are detected by liveness, so this is the longest spike that is waited out.
    collective_timeout_seconds: int = 120
    # Stall deadline = max(stall_floor_seconds, stall_multiple x p95 of recent step times). A step
    # past it is reported to the controller, which decides: all members alive -> wait (backpressure).
    stall_floor_seconds: float = 2.0
    # See stall_floor_seconds.
    stall_multiple: float = 5.0
    # A host whose own step time is >= straggler_factor x the others' (median over straggler_window
    # steps) is reslotted: replaced by a spare, or removed when the run is predicted faster without it.
    straggler_factor: float = 1.5
    # See straggler_factor.
    straggler_window: int = 10
    # How virtual shards are spread over hosts (resilient_jax.assignment). "proportional": in
    # proportion to each host's measured speed, re-planned at step boundaries every host computes
    # alike (the exact reduction keeps every bit; with reduction=native, or on one host, it acts as
    # uniform). "uniform": the same share for every host.
    assignment: Literal["proportional", "uniform"] = "proportional"
    # Steps of measurements under one assignment before it is re-planned.
    assignment_window: int = 5
    # A new assignment is taken only if its predicted step time is this fraction below the current one's.
    assignment_hysteresis: float = 0.1
    # The most shards a device can hold, as a multiple of its uniform share (its slots; >= 1).
    max_share: float = 2.0
    # Fewer live hosts than this ends the run with an error instead of continuing.
    min_hosts: int = 1
    # With parallel.hosts_per_replica > 1: fewer complete replica groups than this ends the run.
    min_replicas: int = 1
    # JAX's persistent compilation cache, so a re-formed world loads its step instead of compiling
    # it: "auto" = $RESILIENT_JAX_COMPILE_CACHE if set, else <run.dir>/compile_cache; "" or "off" =
    # none; any other value = that directory (may be shared by runs). Not writable, or writable by
    # another account (owned by another user, or by every account: an entry is machine code the run
    # executes): a warning, and the run compiles uncached.
    compile_cache: str = "auto"


@dataclass(frozen=True)
class Config:
    """A whole run: one field per section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    # Fault injections, e.g. ["nan_shard:3@20"]; parsed by resilient_jax.faults.
    faults: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The config as recorded (config.json, the checkpoint's config field, the config hash), with
        the control-channel secret left out: it is an operational credential, not part of what the
        run computes, and those files are readable by others (the token lives in a 0600 file)."""
        out = dataclasses.asdict(self)
        out["runtime"]["token"] = ""
        return out

    @property
    def hash(self) -> str:
        return config_hash(self)


# -- allowed values -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bound:
    """The allowed values of one numeric key: an interval, plus optional special values (e.g. -1)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    special: tuple[int, ...] = ()

    def allows(self, value: float) -> bool:
        if value in self.special:
            return True
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return not (self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi))

    def __str__(self) -> str:
        lo, hi = _number(self.lo), _number(self.hi)
        if self.lo is not None and self.hi is not None:
            text = f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"
        elif self.lo is not None:
            text = f"{'>' if self.lo_open else '>='} {lo}"
        elif self.hi is not None:
            text = f"{'<' if self.hi_open else '<='} {hi}"
        else:
            text = "any number"
        return " or ".join([*map(str, self.special), text])


def _number(x: float | None) -> str:
    return "" if x is None else str(int(x)) if float(x).is_integer() else f"{x:g}"


def _at_least(lo: float) -> Bound:
    return Bound(lo=lo)


def _positive() -> Bound:
    return Bound(lo=0, lo_open=True)


def _unit_open() -> Bound:
    return Bound(lo=0, hi=1, hi_open=True)


# Every int/float key (list items as `section.key[].field`) and what it may be; checked at load, so
# a run never starts with a value it cannot use. tests/test_config.py checks that no numeric field
# is missing here.
RANGES: dict[str, Bound] = {
    "model.vocab_size": _at_least(1),
    "model.d_model": _at_least(1),
    "model.n_layers": _at_least(1),
    "model.n_heads": _at_least(1),
    "model.attention_chunk": _at_least(1),
    "model.d_ff": _at_least(1),
    "model.dropout": _unit_open(),
    "model.rope_base": _positive(),
    "data.shards": _at_least(1),
    "data.seq_len": _at_least(1),
    "data.global_batch": _at_least(1),
    "data.prefetch": _at_least(1),
    "data.quarantine[].shard": _at_least(0),
    "data.quarantine[].from_step": _at_least(0),
    "eval.every_steps": _at_least(0),
    "eval.holdout_shards": _at_least(0),
    "eval.batches": _at_least(0),
    "optimizer.lr": _positive(),
    "optimizer.min_lr_ratio": Bound(lo=0, hi=1),
    "optimizer.warmup_steps": _at_least(0),
    "optimizer.weight_decay": _at_least(0),
    "optimizer.b1": _unit_open(),
    "optimizer.b2": _unit_open(),
    "optimizer.eps": _positive(),
    "optimizer.clip_norm": _at_least(0),
    "optimizer.decay_steps": _at_least(0),
    "optimizer.decay_fraction": Bound(lo=0, hi=1),
    "optimizer.momentum": _unit_open(),
    "parallel.devices": _at_least(0),
    "parallel.data": Bound(lo=1, special=(-1,)),
    "parallel.fsdp": _at_least(1),
    "parallel.tensor": _at_least(1),
    "parallel.virtual_shards": _at_least(1),
    "parallel.hosts_per_replica": _at_least(1),
    "train.steps": _at_least(1),
    "train.seed": Bound(lo=0, hi=2**32 - 1),
    "train.log_every": _at_least(1),
    "run.peak_flops": _at_least(0),
    "checkpoint.every_steps": _at_least(0),
    "checkpoint.every_seconds": _at_least(0),
    "checkpoint.keep_last": _at_least(0),
    "checkpoint.keep_every": _at_least(0),
    "topology.regions[].hosts": _at_least(1),
    "topology.regions[].spares": _at_least(0),
    "topology.devices_per_host": _at_least(1),
    "runtime.port": Bound(lo=0, hi=65535),
    "runtime.heartbeat_seconds": _positive(),
    "runtime.dead_after_seconds": _positive(),
    "runtime.coordination_heartbeat_seconds": _at_least(1),
    "runtime.collective_timeout_seconds": _at_least(1),
    "runtime.stall_floor_seconds": _positive(),
    "runtime.stall_multiple": _at_least(1),
    "runtime.straggler_factor": Bound(lo=1, lo_open=True),
    "runtime.straggler_window": _at_least(1),
    "runtime.assignment_window": _at_least(2),
    "runtime.assignment_hysteresis": _unit_open(),
    "runtime.max_share": _at_least(1),
    "runtime.min_hosts": _at_least(1),
    "runtime.min_replicas": _at_least(1),
}

# Keys that name files or directories: resolved to absolute paths once, at load (orbax refuses
# relative paths, and a run must not change meaning when a later process starts elsewhere).
# Text keys whose value "off" YAML would otherwise turn into false.
OFF_SWITCH_KEYS = ("runtime.compile_cache",)

PATH_KEYS = ("run.dir", "checkpoint.dir", "data.dataset", "data.src", "eval.dataset", "runtime.compile_cache",
             "task.import_dir", "data.tokenizer")
# data.tokenizer kinds whose spec is `KIND:PATH` (resilient_jax.data.tokenizer's file tokenizers).
TOKENIZER_FILE_KINDS = ("hf", "sp")


def config_hash(cfg: Config) -> str:
    """sha256 of the canonical JSON (sorted keys, no whitespace) of the resolved config."""
    canonical = json.dumps(cfg.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Defaults <- YAML file <- `section.key=value` overrides, each value type-checked and
    range-checked; then every path key is made absolute against the current directory."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path))
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(raw, key, value)
    cfg = from_dict(raw)
    if path is not None and not cfg.task.import_dir:
        # A plug-in file next to the config is importable from any current directory (and by
        # elastic workers, which receive this resolved config).
        cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, import_dir=str(Path(path).parent)))
    return resolve_paths(cfg)


def absolute_path(path: str) -> str:
    """`path` made absolute against the current directory ("~" expanded, "." and ".." folded)."""
    return os.path.abspath(os.path.expanduser(path))


def resolve_paths(cfg: Config) -> Config:
    """The config with every path key absolute ("", data.src "default" and runtime.compile_cache
    "auto" / "off" keep their meaning)."""
    # Only the keywords a key gives a meaning keep their text: for any other key "default" is just a
    # relative directory name, and a relative run.dir / checkpoint.dir fails at the first save.
    def fix(value: str, keep: tuple[str, ...] = ("",)) -> str:
        return value if value in keep else absolute_path(value)

    def fix_tokenizer(spec: str) -> str:  # only the PATH of hf:PATH / sp:PATH; `bytes` is a name
        kind, sep, path = spec.partition(":")
        return f"{kind}:{absolute_path(path)}" if sep and kind in TOKENIZER_FILE_KINDS and path else spec

    return dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, dir=fix(cfg.run.dir)),
        checkpoint=dataclasses.replace(cfg.checkpoint, dir=fix(cfg.checkpoint.dir)),
        data=dataclasses.replace(cfg.data, dataset=fix(cfg.data.dataset), src=fix(cfg.data.src, ("", "default")),
                                 tokenizer=fix_tokenizer(cfg.data.tokenizer)),
        eval=dataclasses.replace(cfg.eval, dataset=fix(cfg.eval.dataset)),
        runtime=dataclasses.replace(cfg.runtime, compile_cache=fix(cfg.runtime.compile_cache, ("", "auto", "off"))),
        task=dataclasses.replace(cfg.task, import_dir=fix(cfg.task.import_dir, ("",))),
    )


def from_dict(raw: dict[str, Any]) -> Config:
    if not isinstance(raw, dict):
        raise ConfigError("config: the top level must be a mapping of sections")
    cfg = _build(Config, raw, prefix="")
    if cfg.model.args and cfg.model.factory == BUILTIN_MODEL:
        raise ConfigError(f"config key model.args: the built-in model ({BUILTIN_MODEL}) takes the model.* keys "
                          "(model.d_model, model.n_layers, ...); model.args is for a model.factory of your own")
    if cfg.runtime.coordination_heartbeat_seconds < cfg.runtime.dead_after_seconds:
        raise ConfigError(
            f"config key runtime.coordination_heartbeat_seconds: {cfg.runtime.coordination_heartbeat_seconds} is "
            f"below runtime.dead_after_seconds ({cfg.runtime.dead_after_seconds:g}): the coordination service "
            f"would declare a slow host dead before the controller's liveness verdict; set it to at least "
            f"{math.ceil(cfg.runtime.dead_after_seconds)}")
    if cfg.optimizer.mu_dtype != "float32" and cfg.optimizer.name == "adafactor":
        raise ConfigError("config key optimizer.mu_dtype: adafactor keeps no first moment; leave it at float32 "
                          "or pick optimizer.name adamw, lion or sgd")
    if (cfg.model.attention == "chunked" and cfg.data.seq_len > cfg.model.attention_chunk
            and cfg.data.seq_len % cfg.model.attention_chunk):
        raise ConfigError(f"config key model.attention_chunk: data.seq_len ({cfg.data.seq_len}) must be a multiple "
                          f"of it (got {cfg.model.attention_chunk}); e.g. set it to a power of two that divides "
                          f"the sequence length")
    check_eval_sources(cfg.eval)
    return cfg


def check_eval_sources(ev: EvalConfig) -> None:
    """Evaluation needs exactly one source of held-out data. (Shards held out while nothing is
    evaluated are allowed: a run that stops evaluating keeps them out of training, as they were.)"""
    if ev.holdout_shards and ev.dataset:
        raise ConfigError("config key eval.dataset: set either eval.holdout_shards or eval.dataset, not both")
    if ev.every_steps and not (ev.holdout_shards or ev.dataset):
        raise ConfigError("config key eval.every_steps: evaluation needs held-out data; set eval.holdout_shards "
                          "(the last N shards of the training dataset) or eval.dataset (a prepared dataset)")
    if not ev.every_steps and ev.dataset:
        raise ConfigError("config key eval.dataset: eval.every_steps is 0, so nothing is evaluated; set "
                          "eval.every_steps to evaluate, or leave eval.dataset out")


def diff_keys(a: Config | dict, b: Config | dict) -> list[str]:
    """Dotted keys whose values differ between two configs (used to name what a resume changes)."""
    da = a.to_dict() if isinstance(a, Config) else a
    db = b.to_dict() if isinstance(b, Config) else b
    out: list[str] = []

    def walk(x: Any, y: Any, key: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y)):
                walk(x.get(k), y.get(k), f"{key}.{k}" if key else k)
        elif x != y:
            out.append(key)

    walk(da, db, "")
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; pass a YAML file, e.g. configs/tiny.yaml")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of sections")
    return data


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    try:
        # YAML scalars, so `--set train.steps=50` is an int and `--set faults=[a,b]` a list.
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    if not isinstance(value, str) and _is_text_key(key):
        # A text key takes the text as typed: YAML would read run.dir=010 as the int 8 and
        # text_field=no as false, and str() of those is not what was asked for.
        value = text.strip()
    return key, value


def _is_text_key(key: str) -> bool:
    """Whether the dotted `key` names a str field of the config (False for unknown keys)."""
    node: Any = Config
    for part in key.split("."):
        if not dataclasses.is_dataclass(node) or part not in (hints := typing.get_type_hints(node)):
            return False
        node = hints[part]
    return node is str


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        if node.get(part) is None:  # absent, or a YAML section whose keys are all commented out
            node[part] = {}
        child = node[part]
        if not isinstance(child, dict):
            raise ConfigError(f"config key {key}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def _build(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            known = ", ".join(sorted(names))
            raise ConfigError(f"unknown config key {prefix}{key} (known here: {known})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        value = raw[f.name]
        typ = hints[f.name]
        dotted = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(typ):
            if value is None:  # `model:` with every key under it commented out: the defaults
                value = {}
            if not isinstance(value, dict):
                raise ConfigError(f"config key {dotted}: expected a section (mapping), got {value!r}")
            kwargs[f.name] = _build(typ, value, prefix=f"{dotted}.")
        else:
            kwargs[f.name] = _coerce(value, typ, dotted)
            _check_range(dotted, kwargs[f.name])
    return cls(**kwargs)


def _check_range(key: str, value: Any) -> None:
    bound = RANGES.get(re.sub(r"\[\d+\]", "[]", key))
    if bound is not None and not bound.allows(value):
        raise ConfigError(f"config key {key}: must be {bound}, got {value!r}")


def _coerce(value: Any, typ: Any, key: str) -> Any:
    origin = typing.get_origin(typ)
    if origin is Literal:
        choices = typing.get_args(typ)
        if isinstance(value, bool) and ("on" if value else "off") in choices:
            value = "on" if value else "off"  # YAML 1.1 reads a bare `on` / `off` as true / false
        if value not in choices:
            raise ConfigError(f"config key {key}: expected one of {', '.join(map(str, choices))}, got {value!r}")
        return value
    if origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"config key {key}: expected a mapping with text keys, got {value!r}")
        try:  # the hash and the workers' copy of the config are JSON: the values must survive it
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            raise ConfigError(f"config key {key}: values must be numbers, text, booleans, lists or "
                              f"mappings, got {value!r}") from None
        return value
    if origin in (list, tuple):
        (item_type,) = typing.get_args(typ)[:1]
        if value is None:
            return []
        if not isinstance(value, list):
            raise ConfigError(f"config key {key}: expected a list of {item_type.__name__}, got {value!r}")
        if dataclasses.is_dataclass(item_type):
            bad = [v for v in value if not isinstance(v, dict)]
            if bad:
                raise ConfigError(f"config key {key}: expected a list of mappings, got {bad[0]!r}")
            return [_build(item_type, v, prefix=f"{key}[{i}].") for i, v in enumerate(value)]
        return [_coerce(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(typ):
            try:
                return _coerce(value, option, key)
            except ConfigError:
                continue
        raise ConfigError(f"config key {key}: expected {typ}, got {value!r}")
    if typ is type(None):
        if value is None:
            return None
        raise ConfigError(f"config key {key}: expected null, got {value!r}")
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            # YAML 1.1 reads "1e-3" (no dot) as a string; accept any numeral Python accepts.
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            # NaN compares false to every bound and inf passes a lower one, so the range check
            # cannot catch them; config.json would not be valid JSON either.
            if not math.isfinite(number):
                raise ConfigError(f"config key {key}: must be a finite number, got {number}")
            return number
    elif typ is str:
        if isinstance(value, str):
            return value
        if value is False and key in OFF_SWITCH_KEYS:
            return "off"  # YAML 1.1 reads a bare `off` as false
        if isinstance(value, (bool, int, float, datetime.date)):
            # str() of what YAML made of it would not be the text written: 010 is 8, 1.10 is 1.1,
            # no is false. Only the file knows what was meant.
            raise ConfigError(f"config key {key}: expected text, got {value!r} (YAML reads an unquoted "
                              f"number, yes/no, on/off or date as such); put the value in quotes")
    else:  # pragma: no cover - a field type this module does not know is a programming error
        raise TypeError(f"config field {key} has unsupported type {typ}")
    raise ConfigError(f"config key {key}: expected {typ.__name__}, got {value!r}")


# -- documentation ------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyDoc:
    key: str
    default: Any
    meaning: str
    allowed: str


def field_comments(cls: type) -> dict[str, str]:
    """{field name: the comment block right above it (or after it), joined into one line}."""
    source = inspect.getsource(cls)
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        match = re.match(r"^(\w+)\s*:", stripped)
        if match and line.startswith("    ") and not line.startswith("        "):
            trailing = _trailing_comment(line)
            comments[match.group(1)] = " ".join(pending + ([trailing] if trailing else []))
        pending = []
    return comments


def _trailing_comment(line: str) -> str:
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
    except (tokenize.TokenError, SyntaxError):
        return ""
    return next((t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT), "")


def key_docs(cls: type = None, prefix: str = "") -> list[KeyDoc]:
    """Every key of the config in declaration order, with default, meaning and allowed values."""
    cls = Config if cls is None else cls
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    defaults = cls()
    out: list[KeyDoc] = []
    for f in dataclasses.fields(cls):
        key, typ = f"{prefix}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(typ):
            out.extend(key_docs(typ, f"{key}."))
            continue
        value = getattr(defaults, f.name)
        item = typing.get_args(typ)[0] if typing.get_origin(typ) is list else None
        if item is not None and dataclasses.is_dataclass(item):
            out.append(KeyDoc(key, value, comments.get(f.name, ""), "list of mappings"))
            out.extend(key_docs(item, f"{key}[]."))
            continue
        if typing.get_origin(typ) is Literal:
            allowed = " or ".join(f"`{c}`" for c in typing.get_args(typ))
        elif key in RANGES:
            allowed = str(RANGES[key])
        else:
            allowed = ("mapping" if typing.get_origin(typ) is dict
                       else {bool: "true or false", str: "text"}.get(typ, "list"))
        out.append(KeyDoc(key, value, comments.get(f.name, ""), allowed))
    return out


def markdown_table() -> str:
    """The README's configuration table, generated from the dataclasses."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| key | default | allowed | meaning |", "|---|---|---|---|"]
    for doc in key_docs():
        default = json.dumps(doc.default)
        lines.append(f"| `{doc.key}` | `{default}` | {cell(doc.allowed)} | {cell(doc.meaning)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m resilient_jax.config",
                                     description="Print the configuration reference.")
    parser.add_argument("--markdown-table", action="store_true", help="the README's table of every config key")
    parser.parse_args(argv)
    sys.stdout.write(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
