"""`python -m resilient_jax.train --config configs/tiny.yaml [--set section.key=value ...] [--fault SPEC ...]`

Checkpoints: a run whose checkpoint dir (checkpoint.dir, default <run.dir>/checkpoints) already
holds checkpoints resumes from the newest; `--resume latest|STEP|PATH` names one explicitly.
Relative paths (run.dir, checkpoint.dir, data.dataset, --resume PATH) are against the current
directory, resolved once at start; the absolute paths are what the run records.
One run at a time per run.dir (`<run.dir>/run.lock`, see resilient_jax.runlock).
Exit codes: 0 done (or stopped by --stop-at), 1 an elastic run failed, 2 bad input (one line on stderr, nothing written),
130 interrupted (Ctrl-C: a checkpoint was committed first; a second Ctrl-C exits without waiting),
143 preempted (SIGTERM: a checkpoint was committed first). After 130 or 143, rerun the same command
to continue.

Thin on purpose: parse, set up devices, build a Trainer, run it. Everything else is importable.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

# The driver's launch, before the package's imports: an elastic run's cold start (launch -> first
# step done) is measured from here (resilient_jax.elastic.controller: cold_start_seconds).
LAUNCHED_AT = time.monotonic()

from resilient_jax import compile_cache  # noqa: E402
from resilient_jax.checkpoint.preemption import INTERRUPTED, INTERRUPTED_EXIT  # noqa: E402
from resilient_jax.config import Config, ConfigError, absolute_path, load_config  # noqa: E402
from resilient_jax.distributed import ENV_PROCESS_ID  # noqa: E402
from resilient_jax.preflight import check_run  # noqa: E402
from resilient_jax.runlock import RunLock  # noqa: E402

PREEMPTED_EXIT = 143  # 128 + SIGTERM, what a scheduler expects of a process it terminated


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m resilient_jax.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML file with config sections (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config key; repeatable")
    parser.add_argument("--fault", dest="faults", action="append", default=[], metavar="SPEC",
                        help="inject a fault, e.g. nan_shard:3@20; repeatable (added to the config's faults)")
    parser.add_argument("--resume", metavar="latest|STEP|PATH", default=None,
                        help="continue from a checkpoint (default: the newest in the checkpoint dir, if any)")
    parser.add_argument("--allow-config-change", metavar="KEY,KEY", default="",
                        help="resume although these config keys differ from the checkpoint's (recorded)")
    parser.add_argument("--stop-at", metavar="STEP", type=int, default=None,
                        help="stop after STEP steps with a checkpoint, as a preemption would")
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    overrides = list(args.overrides)
    cfg = load_config(args.config, overrides)
    if args.faults:
        cfg = load_config(args.config, overrides + [f"faults={list(cfg.faults) + list(args.faults)!r}"])
    if args.resume and args.resume != "latest" and not args.resume.isdigit():
        args.resume = absolute_path(args.resume)  # a PATH: against this directory, like the config's paths
    return cfg


def run_lock(cfg: Config) -> RunLock | None:
    """The run.dir lock, taken by the process that owns run.dir: a single-process run, an elastic
    run's controller, or process 0 of a fixed multi-process world (the others share its run.dir)."""
    if os.environ.get(ENV_PROCESS_ID, "0") != "0":
        return None
    return RunLock(cfg.run.dir)


def setup_devices(cfg: Config) -> None:
    """Must run before anything initialises a JAX backend: XLA reads its flags (the GPU kernels'
    determinism among them, resilient_jax.gpu_env) once, when the first backend starts."""
    from resilient_jax import gpu_env

    gpu_env.configure_process_environment(cfg, elastic=False)
    import jax

    from resilient_jax.distributed import initialize_from_env

    if cfg.parallel.devices > 0:
        jax.config.update("jax_num_cpu_devices", cfg.parallel.devices)
    if warning := compile_cache.enable(cfg.runtime.compile_cache, cfg.run.dir).warning:
        print(warning, file=sys.stderr)
    initialize_from_env()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:
        # Ctrl-C while the training loop does not watch for it (start-up, after the end): what was
        # committed stays committed; the rerun continues from the newest checkpoint.
        print("stopped (interrupted); rerun the same command to continue", file=sys.stderr)
        return INTERRUPTED_EXIT
    except ValueError as e:
        # ConfigError, DatasetError, RunLocked and start-up validation (mesh sizes, batch
        # divisibility, ...) all name the key or path in their one-line message.
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        # What the machine refused (a port in use, a directory without permission): its message
        # names the file or address, which is what the user has to change.
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    if args.stop_at is not None and args.stop_at < 1:
        raise ConfigError(f"--stop-at {args.stop_at}: must be >= 1 (the number of steps after which to stop)")
    if args.stop_at is not None and args.stop_at > cfg.train.steps:
        raise ConfigError(f"--stop-at {args.stop_at}: past the run's end (train.steps {cfg.train.steps}); to train "
                          f"longer, raise it (--set train.steps={args.stop_at})")
    check_run(cfg)
    allow = [k.strip() for k in args.allow_config_change.split(",") if k.strip()]
    if cfg.topology.regions:
        # Several hosts: this process becomes the controller and never touches devices.
        with hold_run_dir(cfg):
            return run_elastic_cli(cfg, args, allow)
    # The lock comes first: a second run into a busy run.dir is refused before it builds anything.
    with hold_run_dir(cfg):
        setup_devices(cfg)
        from resilient_jax.checkpoint.store import CheckpointSaveError
        from resilient_jax.data import DatasetError
        from resilient_jax.trainer import Trainer

        try:
            summary = Trainer(cfg, resume=args.resume, allow_config_change=allow, stop_at=args.stop_at).run()
        except (DatasetError, CheckpointSaveError) as e:
            raise ConfigError(str(e)) from None
    if summary.get("stopped") == INTERRUPTED:  # the trainer's closing line said where it stopped
        return INTERRUPTED_EXIT
    if summary.get("stopped") == "preempted":
        return PREEMPTED_EXIT
    return 0


@contextlib.contextmanager
def hold_run_dir(cfg: Config):
    """Holds run.dir's lock (if this process owns run.dir) for the block; warns on a stale takeover."""
    lock = run_lock(cfg)
    if lock is None:
        yield
        return
    with lock:
        if lock.warning():
            print(lock.warning(), file=sys.stderr)
        yield


def run_elastic_cli(cfg: Config, args: argparse.Namespace, allow: list[str]) -> int:
    from resilient_jax.elastic.controller import RunFailed
    from resilient_jax.elastic.run import Interrupted, run_elastic

    try:
        summary = run_elastic(cfg, resume=args.resume, allow_config_change=allow, stop_at=args.stop_at,
                              launched_at=LAUNCHED_AT)
    except RunFailed as e:
        failure = e.failure
        where = (f" (log: {cfg.run.dir}/elastic/logs/{failure['host']}.log)" if failure
                 else f" (logs: {cfg.run.dir}/elastic/logs)")
        print(f"error: the run failed: {e}{where}", file=sys.stderr)
        return 2 if failure and failure["bad_input"] else 1
    except Interrupted as e:
        print(str(e), file=sys.stderr)
        return INTERRUPTED_EXIT if e.reason == "interrupted" else PREEMPTED_EXIT
    stopped = summary.get("stopped")
    if stopped in ("interrupted", "preempted"):
        return INTERRUPTED_EXIT if stopped == "interrupted" else PREEMPTED_EXIT
    return 0 if summary.get("final_step") == cfg.train.steps or stopped == "stop_at" else 1


if __name__ == "__main__":
    sys.exit(main())
