"""resilient_jax: a JAX/Flax multi-host training framework whose runs absorb faults.

The trajectory is a function of (config, dataset version, step), never of how many hosts are alive.

Public API (imported lazily, so `import resilient_jax` sets nothing up):
    run(config, overrides=())     run a training job to its end; returns its summary (not `train`:
                                  that name is the `python -m resilient_jax.train` module)
    Trainer                       the single-world loop (resilient_jax.trainer)
    fingerprint(tree)             sha256 of a params tree (determinism checks)
    ModelFactory, LossFn          the model.factory and task.loss protocols (resilient_jax.models, .losses)
Readers: resilient_jax.checkpoint.reader (framework-free checkpoint reader), resilient_jax.data
(datasets and their loaders).
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "Trainer": ("resilient_jax.trainer", "Trainer"),
    "Config": ("resilient_jax.config", "Config"),
    "load_config": ("resilient_jax.config", "load_config"),
    "ModelFactory": ("resilient_jax.models", "ModelFactory"),
    "LossFn": ("resilient_jax.losses", "LossFn"),
}


def fingerprint(tree) -> str:
    """sha256 over every leaf's bytes in sorted-path order (see resilient_jax.fingerprinting)."""
    from resilient_jax.fingerprinting import params_fingerprint

    return params_fingerprint(tree)


def run(config, overrides: list[str] = (), *, devices=None) -> dict:
    """Run the job `config` describes (a Config, or a YAML path with `section.key=value` overrides)
    to its end, as `python -m resilient_jax.train` does: the same start-up checks, run.dir lock,
    resume from the newest checkpoint, and an elastic controller plus workers when the config has
    topology.regions. Returns the run's summary (summary.json). Bad input raises ValueError
    (ConfigError, DatasetError) with one line naming the key.

    `devices`: a single-process run's devices (default: all). JAX must not have started yet if
    the config sets parallel.devices (CPU emulation)."""
    import resilient_jax.train as cli
    from resilient_jax.config import Config, load_config
    from resilient_jax.preflight import check_run

    cfg = config if isinstance(config, Config) else load_config(config, list(overrides))
    check_run(cfg)
    with cli.hold_run_dir(cfg):
        if cfg.topology.regions:
            from resilient_jax.elastic.run import run_elastic

            return run_elastic(cfg)
        import jax

        from resilient_jax.trainer import Trainer

        if devices is None:
            cli.setup_devices(cfg)
            devices = jax.devices()
        return Trainer(cfg, devices=devices).run()


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'resilient_jax' has no attribute {name!r}")
