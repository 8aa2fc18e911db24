"""`python -m resilient_jax.train --config configs/tiny.yaml [--set section.key=value ...] [--fault SPEC ...]`

Thin on purpose: parse, set up devices, build a Trainer, run it. Everything else is importable.
"""

from __future__ import annotations

import argparse
import sys

from resilient_jax.config import Config, ConfigError, load_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m resilient_jax.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML file with config sections (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config key; repeatable")
    parser.add_argument("--fault", dest="faults", action="append", default=[], metavar="SPEC",
                        help="inject a fault, e.g. nan_shard:3@20; repeatable (added to the config's faults)")
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    overrides = list(args.overrides)
    cfg = load_config(args.config, overrides)
    if args.faults:
        cfg = load_config(args.config, overrides + [f"faults={list(cfg.faults) + list(args.faults)!r}"])
    return cfg


def setup_devices(cfg: Config) -> None:
    """Must run before anything initialises a JAX backend."""
    import jax

    from resilient_jax.distributed import initialize_from_env

    if cfg.parallel.devices > 0:
        jax.config.update("jax_num_cpu_devices", cfg.parallel.devices)
    initialize_from_env()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = build_config(args)
        setup_devices(cfg)
        from resilient_jax.data import DatasetError
        from resilient_jax.trainer import Trainer

        try:
            Trainer(cfg).run()
        except DatasetError as e:
            raise ConfigError(str(e)) from None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        # Start-up validation (mesh sizes, batch divisibility, ...) names the key in its message.
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
