"""Start-up checks of a run that need more than one config key: made before any work is done and
before anything is written, so a run that cannot work fails at once with one line (exit 2).

- plug-ins (model.factory, task.loss) that do not import or are not callable (what they build is
  checked abstractly by each trainer: resilient_jax.state.make_model_def);
- faults that can never fire: a step at or past train.steps, a host fault on a single-process run,
  a data shard id the dataset does not have, a region the topology does not have;
- data: a named dataset directory without a dataset (unless data.build_if_missing), quarantined
  shard ids the dataset does not have;
- evaluation: more shards held out than the dataset can spare, a NaN fault on a held-out shard, an
  eval.dataset that is missing or speaks other tokens, eval.batches the held-out data cannot fill;
- outputs: run.dir / checkpoint.dir that is a file, or that cannot be written.

Single-key ranges are checked earlier, when the config loads (config.RANGES).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from resilient_jax import gpu_env

from resilient_jax.config import BUILTIN_MODEL, DEFAULT_LOSS, Config, ConfigError
from resilient_jax.faults import ELASTIC_ONLY, Fault, parse_faults


def check_run(cfg: Config) -> None:
    """Raises ConfigError / DatasetError (both ValueError, one line) for a run that cannot work."""
    # Refuse invariant mode where XLA_FLAGS break it, before any host or device starts.
    gpu_env.check_invariant_supported(cfg, gpu_env.detect_platform(), os.environ.get("XLA_FLAGS", ""))
    if cfg.parallel.hosts_per_replica > 1 and not cfg.topology.regions:
        raise ConfigError(f"parallel.hosts_per_replica = {cfg.parallel.hosts_per_replica}: replica groups span "
                          "hosts, and this config trains in one process (no topology.regions); set it to 1, or "
                          "describe the hosts under topology.regions")
    check_launch_keys(cfg)
    faults = parse_faults(cfg.faults)
    check_faults(cfg, faults)
    check_plugins(cfg)
    shards = dataset_shard_count(cfg)
    for fault in faults:
        if fault.kind == "nan_shard" and int(fault.target) >= shards:
            raise ConfigError(f"fault {fault}: the dataset has {shards} shards (0..{shards - 1}), so shard "
                              f"{fault.target} can never be poisoned")
    for i, q in enumerate(cfg.data.quarantine):
        if q.shard >= shards:
            raise ConfigError(f"config key data.quarantine[{i}].shard: the dataset has {shards} shards "
                              f"(0..{shards - 1}), got {q.shard}")
    check_eval_data(cfg, faults, shards)
    check_output_dir("run.dir", cfg.run.dir)
    if cfg.checkpoint.dir:
        check_output_dir("checkpoint.dir", cfg.checkpoint.dir)


# runtime keys that only an elastic run (topology.regions) reads: they choose where its hosts run
# (runtime.bind: an address off loopback; a loopback one changes nothing of where the run trains).
LAUNCH_KEYS = ("launcher", "ray_address", "bind")


def check_launch_keys(cfg: Config) -> None:
    """A config without topology.regions trains in this process (or a fixed world you start, README:
    Multi-process): a launcher, Ray address or controller address set there would be ignored, and an
    8B model meant for 16 Ray nodes would train on the head node alone, without a word."""
    if cfg.topology.regions:
        return
    from resilient_jax.elastic.channel import is_loopback

    default = type(cfg.runtime)()
    changed = [f"runtime.{k}={getattr(cfg.runtime, k)}" for k in LAUNCH_KEYS
               if getattr(cfg.runtime, k) != getattr(default, k)
               and not (k == "bind" and is_loopback(cfg.runtime.bind.strip("[]")))]
    if changed:
        raise ConfigError(f"{', '.join(changed)}: only an elastic run launches hosts, and this config has no "
                          "topology.regions, so it would train in this one process on this machine's devices; "
                          "describe the hosts under topology.regions (as configs/gpu-46node-4region.yaml does), "
                          "or start one process per node as a fixed world (README: Multi-process) without "
                          f"{' or '.join('runtime.' + k for k in LAUNCH_KEYS)}")


def check_eval_data(cfg: Config, faults: list[Fault], shards: int) -> None:
    from resilient_jax.data.evalset import build_eval_set, holdout_shard_ids
    from resilient_jax.data.location import check_buildable
    from resilient_jax.data.manifest import MANIFEST_NAME, load_manifest

    if cfg.eval.holdout_shards:
        held = holdout_shard_ids(shards, cfg.eval.holdout_shards)
        for fault in faults:
            if fault.kind == "nan_shard" and int(fault.target) in held:
                raise ConfigError(f"fault {fault}: shard {fault.target} is held out for evaluation "
                                  f"(eval.holdout_shards {cfg.eval.holdout_shards}: shards {held[0]}..{held[-1]}), "
                                  "so training never reads it")
    if not cfg.eval.every_steps:
        return
    train = check_buildable(cfg.data)
    if (train / MANIFEST_NAME).is_file():
        build_eval_set(cfg.eval, load_manifest(train), cfg.data.global_batch, verify=False)
    elif cfg.eval.dataset:  # the training data is built at start (the trainer checks the rest then)
        from resilient_jax.data.evalset import open_eval_dataset

        open_eval_dataset(cfg.eval.dataset, verify=False)


def check_plugins(cfg: Config) -> None:
    from resilient_jax.plugins import load_callable

    # The built-in model and loss always load (their tests import them); importing them here would
    # only put a second of JAX and Flax imports on an elastic launch's path before any worker starts.
    for key, spec, builtin in (("model.factory", cfg.model.factory, BUILTIN_MODEL),
                               ("task.loss", cfg.task.loss, DEFAULT_LOSS)):
        if spec != builtin:
            load_callable(spec, key, cfg.task.import_dir)


def check_faults(cfg: Config, faults: list[Fault]) -> None:
    steps = cfg.train.steps
    regions = [r.name for r in cfg.topology.regions]
    for fault in faults:
        if fault.moment == "save":
            check_save_moment(cfg, fault)
        elif fault.moment == "report":
            if fault.step != steps:
                raise ConfigError(f"fault {fault}: the run's end is reported once, after its last step {steps} "
                                  f"(train.steps); use report:{steps}")
        elif fault.moment == "precompiled":
            check_precompiled_moment(cfg, fault)
        elif fault.moment != "step":
            pass  # a generation: how many worlds a run forms is not known up front
        elif fault.step >= steps:
            raise ConfigError(f"fault {fault}: step {fault.step} is past the run's last step {steps - 1} "
                              f"(train.steps {steps}), so it can never fire")
        if fault.kind in ELASTIC_ONLY and not regions:
            raise ConfigError(f"fault {fault}: {fault.kind} needs an elastic run (topology.regions); this "
                              "config trains in one process, so it can never fire")
        if fault.kind == "kill_region" and fault.target not in regions:
            raise ConfigError(f"fault {fault}: no region named {fault.target!r} (topology.regions: "
                              f"{', '.join(regions)})")


def check_precompiled_moment(cfg: Config, fault: Fault) -> None:
    from resilient_jax import compile_cache
    from resilient_jax.elastic.precompile import wanted
    from resilient_jax.gpu_env import detect_platform

    setting = cfg.runtime.precompile_next_worlds
    cache_on = compile_cache.cache_dir(cfg.runtime.compile_cache, cfg.run.dir) is not None
    if not wanted(setting, detect_platform(), cache_on):
        why = ("runtime.compile_cache is off" if not cache_on else
               f"runtime.precompile_next_worlds is {setting!r}" + (" (off on CPU workers)" if setting == "auto" else ""))
        raise ConfigError(f"fault {fault}: waits for the background compile of the next worlds, which this run "
                          f"does not do ({why}), so it can never fire; set runtime.precompile_next_worlds=on")


def check_save_moment(cfg: Config, fault: Fault) -> None:
    """kill_host:H@save:STEP fires only while a checkpoint of STEP is written: checkpoints on, STEP a
    periodic save or the last step's (the final checkpoint, always written)."""
    ck, steps = cfg.checkpoint, cfg.train.steps
    if not ck.enabled:
        raise ConfigError(f"fault {fault}: checkpoint.enabled is false, so no checkpoint is ever written")
    if fault.step > steps:
        raise ConfigError(f"fault {fault}: the run has {steps} steps (train.steps), so no checkpoint of step "
                          f"{fault.step} is ever written; pick a periodic save or the last step")
    if fault.step == steps:
        return
    if not ck.every_seconds and (not ck.every_steps or fault.step % ck.every_steps):
        raise ConfigError(f"fault {fault}: no checkpoint is written at step {fault.step} (checkpoint.every_steps "
                          f"{ck.every_steps}); pick a multiple of it")


def dataset_shard_count(cfg: Config) -> int:
    """The shard count of the dataset the run will read: its manifest's, or the one it will build."""
    from resilient_jax.data.location import check_buildable
    from resilient_jax.data.manifest import MANIFEST_NAME, load_manifest

    path = check_buildable(cfg.data)
    if (path / MANIFEST_NAME).is_file():
        return len(load_manifest(path).shards)
    return cfg.data.shards


def check_output_dir(key: str, path: str) -> None:
    """`path` is a directory this process can write, or can be created as one; writes nothing."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{key} {target} is a file, not a directory; pick another --set {key}=...")
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key} {target}: {existing} is a file, so the directory cannot be created; "
                          f"pick another --set {key}=...")
    try:  # a probe, removed at once: permissions alone do not say (root, read-only mounts)
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".resilient_jax-write-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{key} {target} is not writable ({e.strerror} in {existing}); pick another "
                          f"--set {key}=...") from None
