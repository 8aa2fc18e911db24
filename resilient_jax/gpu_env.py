"""The environment a worker process needs before JAX starts: XLA flags and client variables, in one place.

`worker_environment(cfg, platform)` returns the variables to merge into the worker's environment;
the worker applies them before it imports JAX (XLA reads XLA_FLAGS once per process, the GPU client
reads its variables when the CUDA plugin loads). Nothing here imports JAX or needs a GPU.

A flag already in XLA_FLAGS, or a variable already in the environment, is the user's explicit choice
and is kept as written -- except a flag that turns GPU determinism off under
`parallel.reduction: invariant`, which is refused (`check_invariant_supported`).

Every name below was checked against the pinned jax/jaxlib 0.10.2 (tests/test_gpu_env.py asks this
jaxlib's own XLA flag parser; the client variables are read in jaxlib/xla_client.py,
generate_pjrt_gpu_plugin_options). The fault-handling set is the recipe of JAX's "Fault Tolerant
Distributed JAX" guide (docs/fault_tolerance.rst, "Cancelling Collectives").
"""

from __future__ import annotations

import importlib.util
import os
import shlex
from typing import Mapping

from resilient_jax.config import Config, ConfigError

GPU_PLATFORMS = ("gpu", "cuda")

# Read by jaxlib's GPU client when the CUDA plugin loads (jaxlib/xla_client.py).
ABORT_COLLECTIVES_ENV = "XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE"
TFRT_GPU_CLIENT_ENV = "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT"
MEM_FRACTION_ENV = "XLA_CLIENT_MEM_FRACTION"
# The deprecated name of MEM_FRACTION_ENV; jaxlib raises if both are set, so either one set means "user's".
DEPRECATED_MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"

# One process per node owns its 8 GPUs; the 8 B configs' measured peak (55.4 GiB native, 66.9
# invariant: configs/gpu-46node-4region.yaml) fits JAX's default 75% of an H200, but not of an
# 80 GB GPU, and leaves less room for longer sequences. The remaining 10% (~14 GiB of 141) is for what lives outside XLA's pool:
# the CUDA context, cuBLAS/cuDNN workspaces and NCCL's buffers.
GPU_MEM_FRACTION = "0.90"

# Switching either off breaks bitwise reproducibility on GPU; see check_invariant_supported.
DETERMINISM_FLAGS = ("xla_gpu_deterministic_ops", "xla_gpu_exclude_nondeterministic_ops")

# Fast min/max drops NaNs from min and max (off by default on both platforms).
NAN_PROPAGATION_FLAGS = ("xla_cpu_enable_fast_min_max", "xla_gpu_enable_fast_min_max")
_TRUE_VALUES = ("", "true", "1")  # how XLA's flag parser reads a bool flag as on ("" = bare --flag)


def detect_platform(environ: Mapping[str, str] | None = None) -> str:
    """'cpu' or 'cuda', without starting JAX: $JAX_PLATFORMS if set, else whether a CUDA plugin is installed."""
    environ = os.environ if environ is None else environ
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip().lower()
    for module in ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"):
        try:
            if importlib.util.find_spec(module) is not None:
                return "cuda"
        except ModuleNotFoundError:  # no jax_plugins package at all
            return "cpu"
    return "cpu"


def configure_process_environment(cfg: Config, *, elastic: bool) -> str:
    """Merges this machine's platform settings into os.environ (before JAX starts) and returns the
    platform. Every training process calls it, so that no way of launching a run trains on GPU
    without the deterministic kernels `invariant` needs:
      elastic=True   an elastic worker: `worker_environment` whole (fault handling included);
      elastic=False  a single-process run or a process of a fixed multi-process world: on a GPU only
                     the determinism flags (invariant) and the memory fraction -- not the fault
                     handling, which assumes the worker's liveness, barriers and recoverability (a
                     fixed world's first collective may wait on a peer still compiling); on any
                     other platform nothing (CPU, and TPU/ROCm, which this module does not know).
    ConfigError where invariant mode cannot be had (a flag of yours turns determinism off)."""
    platform = detect_platform()
    if elastic:
        os.environ.update(worker_environment(cfg, platform))
    elif platform in GPU_PLATFORMS:
        check_invariant_supported(cfg, platform, os.environ.get("XLA_FLAGS", ""))
        flags = {k: v for k, v in _gpu_settings(cfg)[0].items() if k in DETERMINISM_FLAGS}
        if not _variable_is_set(os.environ, MEM_FRACTION_ENV):
            os.environ[MEM_FRACTION_ENV] = GPU_MEM_FRACTION
        if flags:
            os.environ["XLA_FLAGS"] = merge_xla_flags(os.environ.get("XLA_FLAGS", ""), flags)
    return platform


# XLA:CPU's pass that merges independent all-reduces into one variadic all-reduce.
CPU_DISABLED_PASSES = "cpu-all-reduce-combiner"


def worker_environment(cfg: Config, platform: str, *, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables to merge into a worker's environment before JAX starts, XLA_FLAGS included.

    `environ` (default os.environ) is what the worker already has: its XLA_FLAGS are kept and ours
    appended after them, skipping any flag it already sets; variables it already sets are not returned.
    """
    environ = os.environ if environ is None else environ
    existing_flags = environ.get("XLA_FLAGS", "")
    platform = platform.lower()
    if platform == "cpu":
        flags = {
            # The CPU (gloo) collectives' backstop: with jax_enable_recoverability, a collective still
            # blocked after this long raises a catchable JaxRuntimeError instead of hanging for ever.
            "xla_cpu_collective_timeout_seconds": str(cfg.runtime.collective_timeout_seconds),
            # One operand per collective (resilient_jax.collectives says why): the step's per-layer
            # gradient sums are independent of each other, and this pass would merge them into one
            # variadic all-reduce. tests/test_step.py compiles the step with these flags and checks.
            "xla_disable_hlo_passes": CPU_DISABLED_PASSES,
        }
        variables: dict[str, str] = {}
    elif platform in GPU_PLATFORMS:
        check_invariant_supported(cfg, platform, existing_flags)
        flags, variables = _gpu_settings(cfg)
    else:
        raise ValueError(f"worker_environment: platform {platform!r} is not one of cpu, {', '.join(GPU_PLATFORMS)}")
    env = {name: value for name, value in variables.items() if not _variable_is_set(environ, name)}
    env["XLA_FLAGS"] = merge_xla_flags(existing_flags, flags)
    return env


def _gpu_settings(cfg: Config) -> tuple[dict[str, str], dict[str, str]]:
    flags = {
        # A NCCL error (a peer died mid-collective) becomes an error status the step can catch,
        # instead of terminating this process: survivors must live on to form the next generation.
        # (Already the default in jaxlib 0.10.2; pinned so that an upgrade cannot flip it.)
        "xla_gpu_nccl_terminate_on_error": "false",
        # Non-blocking communicators, run asynchronously: a collective waiting for a dead peer can be
        # aborted (ncclCommAbort) while it is in flight, instead of wedging the host thread.
        "xla_gpu_nccl_blocking_communicators": "false",
        "xla_gpu_nccl_async_execution": "true",
        # The GPU backstop, like xla_cpu_collective_timeout_seconds on CPU: XLA's execution watchdog
        # treats an execution (one compute or apply step) not finished after this long as hung and,
        # with ABORT_COLLECTIVES_ENV set, aborts its collectives. Dead hosts are caught by liveness
        # long before; this only bounds a collective that waits on live but stuck peers.
        "xla_gpu_execution_terminate_timeout": f"{cfg.runtime.collective_timeout_seconds}s",
    }
    if cfg.parallel.reduction == "invariant":
        # Run-to-run determinism: deterministic kernels (scatter, cuDNN, GEMM) and autotuning that
        # picks the first valid config rather than the fastest-on-this-run one, so every run (and
        # every replica) computes a virtual shard's gradient with the same kernels and bits.
        flags["xla_gpu_deterministic_ops"] = "true"
        # The ops without a deterministic GPU implementation are excluded (rewritten) rather than
        # emitted; some compiler passes test only this flag, so set it alongside the one above.
        flags["xla_gpu_exclude_nondeterministic_ops"] = "true"
    variables = {
        # When the coordination service reports a peer dead (or restarted), abort the in-flight
        # collectives that include it, so survivors get an error instead of waiting for ever.
        ABORT_COLLECTIVES_ENV: "1",
        # The (TFRT-based) GPU client that the same recipe in JAX's fault-tolerance guide selects.
        TFRT_GPU_CLIENT_ENV: "1",
        # Preallocate 90% of each GPU for XLA instead of 75% (see GPU_MEM_FRACTION).
        MEM_FRACTION_ENV: GPU_MEM_FRACTION,
    }
    return flags, variables


def _variable_is_set(environ: Mapping[str, str], name: str) -> bool:
    if name == MEM_FRACTION_ENV:
        return MEM_FRACTION_ENV in environ or DEPRECATED_MEM_FRACTION_ENV in environ
    return name in environ


def check_invariant_supported(cfg: Config, platform: str, xla_flags: str) -> None:
    """Refuse `parallel.reduction: invariant` where XLA_FLAGS break what it relies on.

    Invariant mode promises the same bits for the same (config, data, step); a GPU running
    nondeterministic kernels (atomics in scatter and reductions, autotuned GEMM choices) breaks that
    silently. And the exact reduction finds a shard's non-finite gradient from its block maxima,
    which fast min/max (on any platform) would let through: a NaN lost in `max`. XLA reads a bool
    flag's last occurrence, so that is the one judged here.
    """
    if cfg.parallel.reduction != "invariant":
        return
    settings = parse_xla_flags(xla_flags)
    for name in NAN_PROPAGATION_FLAGS:
        if name in settings and settings[name].lower() in _TRUE_VALUES:
            raise ConfigError(
                f"parallel.reduction=invariant detects a NaN gradient through max, which XLA_FLAGS "
                f"--{name}={settings[name]} lets drop NaNs: remove that flag, or set parallel.reduction=native"
            )
    if platform.lower() not in GPU_PLATFORMS:
        return
    for name in DETERMINISM_FLAGS:
        if name in settings and settings[name].lower() not in _TRUE_VALUES:
            raise ConfigError(
                f"parallel.reduction=invariant needs deterministic GPU kernels, but XLA_FLAGS sets "
                f"--{name}={settings[name]}: remove that flag from XLA_FLAGS, or set parallel.reduction=native"
            )


def parse_xla_flags(xla_flags: str) -> dict[str, str]:
    """`--name=value` tokens of an XLA_FLAGS string -> {name: value}; the last occurrence wins, as in XLA."""
    try:
        tokens = shlex.split(xla_flags)
    except ValueError as e:
        raise ConfigError(f"XLA_FLAGS cannot be parsed ({e}): {xla_flags!r}") from None
    settings: dict[str, str] = {}
    for token in tokens:
        if token.startswith("--"):
            name, _, value = token[2:].partition("=")
            settings[name] = value
    return settings


def merge_xla_flags(existing: str, flags: Mapping[str, str]) -> str:
    """`existing` unchanged, then each of `flags` that it does not already set -- except the list
    of disabled passes, whose entries are added to the user's (theirs stay, ours are needed)."""
    present = parse_xla_flags(existing)
    added = [f"--{name}={value}" for name, value in flags.items() if name not in present]
    passes = "xla_disable_hlo_passes"
    if passes in flags and passes in present:
        theirs = [p for p in present[passes].split(",") if p]
        missing = [p for p in flags[passes].split(",") if p not in theirs]
        if missing:
            added.append(f"--{passes}={','.join(theirs + missing)}")  # XLA reads the last occurrence
    return " ".join(part for part in (existing.strip(), *added) if part)
