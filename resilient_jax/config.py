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
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config problem the user can fix; the message is one line naming the key or file."""


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer shape. Byte-level data needs vocab_size >= 256."""

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 176
    dropout: float = 0.0
    rope_base: float = 10000.0
    # Compute dtype of activations; parameters and optimizer state stay float32.
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
    attention: Literal["explicit", "dot_product"] = "explicit"


@dataclass(frozen=True)
class ShardQuarantine:
    shard: int = 0
    from_step: int = 0


@dataclass(frozen=True)
class DataConfig:
    """Where samples come from. `dataset: ""` builds the default dataset in the cache on first use."""

    dataset: str = ""
    src: str = "default"
    shards: int = 16
    seq_len: int = 64
    tokenizer: str = "bytes"
    global_batch: int = 48
    # Batches loaded ahead of the step; a bounded queue, so a slow step applies backpressure.
    prefetch: int = 2
    # Shards known to be bad, left out of the global order from `from_step` on -- exactly what the
    # automatic NaN quarantine does, declared up front (e.g. [{shard: 3, from_step: 13}]).
    quarantine: list[ShardQuarantine] = field(default_factory=list)


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup, cosine decay to lr * min_lr_ratio, and global-norm clipping."""

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    # 0 turns clipping off.
    clip_norm: float = 1.0


@dataclass(frozen=True)
class ParallelConfig:
    """Device mesh and gradient reduction.

    `data`, `fsdp`, `tensor` are mesh axis sizes; -1 means "the rest of the devices". Data-parallel
    replicas run along `data`; `fsdp` and `tensor` shard within a replica.
    """

    # CPU emulation: number of host-platform devices, set before JAX initialises; 0 = what is there.
    devices: int = 0
    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    # The global batch is cut into this many fixed shards; the trajectory never depends on how
    # they are spread over devices (in `invariant` mode). Pick a number with many divisors.
    virtual_shards: int = 24
    reduction: Literal["invariant", "native"] = "invariant"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    seed: int = 0
    log_every: int = 10


@dataclass(frozen=True)
class RunConfig:
    # Output directory: metrics.jsonl, TensorBoard events, config.json, summary.json.
    dir: str = "runs/default"
    # "auto": a live bar on a terminal, plain lines otherwise.
    progress: Literal["auto", "bar", "plain", "quiet"] = "auto"


@dataclass(frozen=True)
class CheckpointConfig:
    """When and where the seven-field checkpoint is written (see resilient_jax.checkpoint)."""

    enabled: bool = True
    # "" = <run.dir>/checkpoints. A run whose checkpoint dir already holds checkpoints resumes.
    dir: str = ""
    # Save after every N completed steps and/or every T seconds (0 = off); the last step and a
    # preemption (SIGTERM) always save.
    every_steps: int = 50
    every_seconds: float = 0.0
    # Retention: the newest K (0 = all), plus every step that is a multiple of M (0 = none).
    keep_last: int = 3
    keep_every: int = 0
    # Write in the background (training stalls only for the device-to-host copy).
    async_save: bool = True
    # Recompute every array's sha256 after a restore and refuse a mismatch.
    verify_on_load: bool = True


@dataclass(frozen=True)
class RegionConfig:
    name: str = "local"
    hosts: int = 1
    # Spare hosts: registered and warm, outside the world until one replaces a straggler or a lost host.
    spares: int = 0


@dataclass(frozen=True)
class TopologyConfig:
    """Regions -> hosts -> devices. No regions: one process trains alone, without a controller.

    With regions, `python -m resilient_jax.train` starts a controller and one worker process per
    host (CPU emulation: each with `devices_per_host` devices); see resilient_jax.elastic.
    """

    regions: list[RegionConfig] = field(default_factory=list)
    devices_per_host: int = 2


@dataclass(frozen=True)
class RuntimeConfig:
    """The elastic runtime: launcher, controller address, liveness, stall and straggler policy."""

    # local: one worker subprocess per host on this machine; ray: one worker per node of a Ray cluster.
    launcher: Literal["local", "ray"] = "local"
    # Ray only: "" starts a private Ray instance on this machine; "auto" (or host:port) attaches to a cluster.
    ray_address: str = ""
    # The controller's control channel. Bound to loopback by default; any other address requires
    # a token (here or in $RESILIENT_JAX_TOKEN).
    bind: str = "127.0.0.1"
    port: int = 0
    token: str = ""
    heartbeat_seconds: float = 0.5
    # Liveness: a host whose heartbeats stop for this long is declared dead (and fenced); the
    # controller then aborts the world's in-flight collectives. Heartbeats run on their own thread,
    # so a slow step or a network spike does not stop them.
    dead_after_seconds: float = 6.0
    # Backstop only: a collective still blocked after this long raises even if every host is alive.
    # Failures are detected by liveness, so this is the longest spike that is waited out.
    collective_timeout_seconds: int = 120
    # Stall deadline = max(stall_floor_seconds, stall_multiple x p95 of recent step times). A step
    # past it is reported to the controller, which decides: all members alive -> wait (backpressure).
    stall_floor_seconds: float = 2.0
    stall_multiple: float = 5.0
    # A host whose own step time is >= straggler_factor x the others' (median over straggler_window
    # steps) is reslotted: replaced by a spare, or removed when the run is predicted faster without it.
    straggler_factor: float = 1.5
    straggler_window: int = 10
    # Fewer live hosts than this ends the run with an error instead of continuing.
    min_hosts: int = 1


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
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
        return dataclasses.asdict(self)

    @property
    def hash(self) -> str:
        return config_hash(self)


def config_hash(cfg: Config) -> str:
    """sha256 of the canonical JSON (sorted keys, no whitespace) of the resolved config."""
    canonical = json.dumps(cfg.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Defaults <- YAML file <- `section.key=value` overrides, each value type-checked."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path))
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(raw, key, value)
    return from_dict(raw)


def from_dict(raw: dict[str, Any]) -> Config:
    if not isinstance(raw, dict):
        raise ConfigError("config: the top level must be a mapping of sections")
    return _build(Config, raw, prefix="")


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
    return key, value


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
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
            if not isinstance(value, dict):
                raise ConfigError(f"config key {dotted}: expected a section (mapping), got {value!r}")
            kwargs[f.name] = _build(typ, value, prefix=f"{dotted}.")
        else:
            kwargs[f.name] = _coerce(value, typ, dotted)
    return cls(**kwargs)


def _coerce(value: Any, typ: Any, key: str) -> Any:
    origin = typing.get_origin(typ)
    if origin is Literal:
        choices = typing.get_args(typ)
        if value not in choices:
            raise ConfigError(f"config key {key}: expected one of {', '.join(map(str, choices))}, got {value!r}")
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
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 reads "1e-3" (no dot) as a string; accept any numeral Python accepts.
            try:
                return float(value)
            except ValueError:
                pass
    elif typ is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    else:  # pragma: no cover - a field type this module does not know is a programming error
        raise TypeError(f"config field {key} has unsupported type {typ}")
    raise ConfigError(f"config key {key}: expected {typ.__name__}, got {value!r}")
