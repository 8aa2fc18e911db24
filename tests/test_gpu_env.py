"""The worker environment for GPUs and CPU: what is set, what is kept, what is refused -- and that
every XLA flag and client variable it emits is one the pinned jaxlib really knows (no GPU needed)."""

from __future__ import annotations

import importlib.util
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import jaxlib
import pytest
from jaxlib import xla_client

from resilient_jax import gpu_env
from resilient_jax.config import ConfigError, load_config

from conftest import TINY


def _cfg(*overrides: str):
    return load_config(TINY, ["runtime.collective_timeout_seconds=77", *overrides])


INVARIANT = _cfg("parallel.reduction=invariant")
NATIVE = _cfg("parallel.reduction=native")


def _flags(env: dict[str, str]) -> dict[str, str]:
    return gpu_env.parse_xla_flags(env["XLA_FLAGS"])


@pytest.mark.parametrize("platform", ["gpu", "cuda"])
def test_gpu_invariant_mode_turns_on_determinism(platform):
    flags = _flags(gpu_env.worker_environment(INVARIANT, platform, environ={}))
    assert flags["xla_gpu_deterministic_ops"] == "true"
    assert flags["xla_gpu_exclude_nondeterministic_ops"] == "true"


def test_gpu_native_mode_leaves_determinism_alone():
    flags = _flags(gpu_env.worker_environment(NATIVE, "gpu", environ={}))
    assert not set(gpu_env.DETERMINISM_FLAGS) & set(flags)
    assert flags["xla_gpu_nccl_terminate_on_error"] == "false"  # fault handling is the same in both modes


def test_gpu_env_aborts_collectives_on_failure_and_has_a_backstop():
    env = gpu_env.worker_environment(NATIVE, "gpu", environ={})
    assert env["XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE"] == "1"
    assert env["XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT"] == "1"
    assert env["XLA_CLIENT_MEM_FRACTION"] == "0.90"
    flags = _flags(env)
    assert flags["xla_gpu_nccl_blocking_communicators"] == "false"
    assert flags["xla_gpu_nccl_async_execution"] == "true"
    assert flags["xla_gpu_execution_terminate_timeout"] == "77s"  # runtime.collective_timeout_seconds


def test_existing_xla_flags_and_variables_are_kept():
    user_flags = "--xla_dump_to=/tmp/dump  --xla_gpu_nccl_async_execution=false"
    environ = {"XLA_FLAGS": user_flags, "XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE": "0",
               "XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}
    env = gpu_env.worker_environment(INVARIANT, "gpu", environ=environ)
    assert env["XLA_FLAGS"].startswith(user_flags.strip() + " --")
    assert env["XLA_FLAGS"].count("xla_gpu_nccl_async_execution") == 1  # the user's value, not ours
    assert _flags(env)["xla_gpu_nccl_async_execution"] == "false"
    assert _flags(env)["xla_gpu_deterministic_ops"] == "true"
    # Set by the user: not returned, so merging the result cannot override them. The deprecated
    # memory-fraction name counts too: jaxlib refuses both names at once.
    assert "XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE" not in env
    assert "XLA_CLIENT_MEM_FRACTION" not in env


@pytest.mark.parametrize("user_flags, offending", [
    ("--xla_gpu_deterministic_ops=false", "--xla_gpu_deterministic_ops=false"),
    ("--xla_dump_to=/tmp/d --xla_gpu_deterministic_ops=0", "--xla_gpu_deterministic_ops=0"),
    ("--xla_gpu_exclude_nondeterministic_ops=False", "--xla_gpu_exclude_nondeterministic_ops=False"),
    # XLA reads the last occurrence of a flag, and so does the check.
    ("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false", "--xla_gpu_deterministic_ops=false"),
])
def test_invariant_on_a_gpu_without_determinism_is_refused(user_flags, offending):
    with pytest.raises(ConfigError) as err:
        gpu_env.worker_environment(INVARIANT, "cuda", environ={"XLA_FLAGS": user_flags})
    message = str(err.value)
    assert "parallel.reduction" in message and offending in message
    assert "parallel.reduction=native" in message and "remove" in message
    with pytest.raises(ConfigError, match="parallel.reduction"):
        gpu_env.check_invariant_supported(INVARIANT, "gpu", user_flags)


@pytest.mark.parametrize("user_flags", [
    "--xla_gpu_deterministic_ops", "--xla_gpu_deterministic_ops=True",
    "--xla_gpu_deterministic_ops=false --xla_gpu_deterministic_ops=1",
])
def test_invariant_accepts_determinism_the_user_turned_on(user_flags):
    env = gpu_env.worker_environment(INVARIANT, "gpu", environ={"XLA_FLAGS": user_flags})
    assert env["XLA_FLAGS"].count("xla_gpu_deterministic_ops") == user_flags.count("xla_gpu_deterministic_ops")


def test_the_refusal_is_for_invariant_mode_on_gpu_only():
    off = "--xla_gpu_deterministic_ops=false"
    gpu_env.check_invariant_supported(NATIVE, "gpu", off)
    gpu_env.check_invariant_supported(INVARIANT, "cpu", off)
    assert gpu_env.worker_environment(NATIVE, "gpu", environ={"XLA_FLAGS": off})["XLA_FLAGS"].startswith(off)


def test_cpu_env_is_the_collective_timeout_and_no_all_reduce_combining():
    env = gpu_env.worker_environment(INVARIANT, "cpu", environ={"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"})
    assert env == {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false --xla_cpu_collective_timeout_seconds=77 "
                                "--xla_disable_hlo_passes=cpu-all-reduce-combiner"}


def test_an_unknown_platform_is_an_error():
    with pytest.raises(ValueError, match="tpu"):
        gpu_env.worker_environment(INVARIANT, "tpu", environ={})


def test_detect_platform_follows_jax_platforms():
    assert gpu_env.detect_platform({"JAX_PLATFORMS": "cuda"}) == "cuda"
    assert gpu_env.detect_platform({"JAX_PLATFORMS": "cpu,cuda"}) == "cpu"
    assert gpu_env.detect_platform({}) in ("cpu", "cuda")


# --- every name is real for the pinned jaxlib -----------------------------------------------------


def _all_flags_emitted() -> str:
    """Every XLA flag the module can emit (GPU invariant set plus the CPU one), as one XLA_FLAGS."""
    gpu = gpu_env.worker_environment(INVARIANT, "gpu", environ={})["XLA_FLAGS"]
    return gpu_env.worker_environment(INVARIANT, "cpu", environ={"XLA_FLAGS": gpu})["XLA_FLAGS"]


def _parse_flags_in_subprocess(xla_flags: str) -> subprocess.CompletedProcess:
    # XLA parses XLA_FLAGS once per process, when DebugOptions are first built (CompileOptions does
    # it, no backend needed); a flag its registry does not know aborts the process.
    code = "from jax._src.lib import _jax; _jax.CompileOptions(); print('parsed')"
    env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_every_emitted_xla_flag_is_known_to_this_jaxlibs_flag_parser():
    flags = _all_flags_emitted()
    assert len(gpu_env.parse_xla_flags(flags)) == 8
    ok = _parse_flags_in_subprocess(flags)
    assert ok.returncode == 0 and "parsed" in ok.stdout, ok.stderr[-2000:]
    # The control: the same parser does reject a flag it does not know, so the check above has teeth.
    bad = _parse_flags_in_subprocess(flags + " --xla_gpu_resilient_jax_no_such_flag=true")
    assert bad.returncode != 0 and "Unknown flag in XLA_FLAGS: --xla_gpu_resilient_jax_no_such_flag" in bad.stderr


def _binaries_with(needle: bytes) -> list[Path]:
    roots = [Path(jaxlib.__file__).parent]
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None and spec.submodule_search_locations:
        roots += [Path(p) for p in spec.submodule_search_locations]
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.so*")):
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                if data.find(needle) != -1:
                    found.append(path)
    return found


def test_every_emitted_gpu_flag_name_is_in_the_xla_library_jaxlib_ships():
    binaries = _binaries_with(b"xla_gpu_deterministic_ops")
    if not binaries:
        pytest.skip("no installed jaxlib/jax_plugins binary contains XLA's GPU flag names (CUDA plugin not installed)")
    names = gpu_env.parse_xla_flags(gpu_env.worker_environment(INVARIANT, "gpu", environ={})["XLA_FLAGS"])
    with open(binaries[0], "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        missing = [name for name in names if data.find(name.encode() + b"\0") == -1]
    assert not missing, f"not in {binaries[0].name}: {missing}"


def test_jaxlib_gpu_client_reads_the_variables(monkeypatch):
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR",
                 "XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE", "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in gpu_env.worker_environment(INVARIANT, "gpu", environ={}).items():
        monkeypatch.setenv(name, value)
    # What the CUDA plugin passes to its client when it loads; pure Python, no GPU needed.
    options = xla_client.generate_pjrt_gpu_plugin_options()
    assert options["abort_collectives_on_failure"] is True
    assert options["use_tfrt_gpu_client"] is True
    assert options["memory_fraction"] == pytest.approx(0.90)


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_invariant_refuses_fast_min_max_which_would_drop_a_nan_gradient(platform):
    # The exact reduction finds a shard's NaN gradient through its block maxima.
    for name in ("xla_cpu_enable_fast_min_max", "xla_gpu_enable_fast_min_max"):
        with pytest.raises(ConfigError, match=f"--{name}=true"):
            gpu_env.check_invariant_supported(INVARIANT, platform, f"--{name}=true")
        gpu_env.check_invariant_supported(INVARIANT, platform, f"--{name}=false")
        gpu_env.check_invariant_supported(NATIVE, platform, f"--{name}=true")


def test_a_users_disabled_passes_keep_ours_too():
    env = gpu_env.worker_environment(INVARIANT, "cpu", environ={"XLA_FLAGS": "--xla_disable_hlo_passes=foo"})
    assert gpu_env.parse_xla_flags(env["XLA_FLAGS"])["xla_disable_hlo_passes"] == "foo,cpu-all-reduce-combiner"


SETUP_DEVICES = """
import json, os, sys
from resilient_jax import train
from resilient_jax.config import load_config
train.setup_devices(load_config(sys.argv[1], ["run.dir=" + sys.argv[2], "runtime.compile_cache=off"]))
print(json.dumps({k: os.environ.get(k) for k in ("XLA_FLAGS", *sys.argv[3:])}))
"""


@pytest.mark.parametrize("config", ["gpu-8b.yaml", "gpu-1b.yaml"])
def test_a_run_that_is_not_elastic_gets_the_gpu_environment_too(tmp_path, config):
    # gpu-8b and gpu-1b have no topology.regions: they run as one process, or as a fixed world of one
    # process per node, never through an elastic worker. Their processes must still train with the
    # deterministic kernels invariant mode needs (and the fault flags and memory fraction): they did
    # not, with no message, so their bits differed from run to run on a GPU. No GPU is needed to
    # check the environment a process sets up before JAX starts its backend.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", gpu_env.MEM_FRACTION_ENV,
                                                             gpu_env.DEPRECATED_MEM_FRACTION_ENV)}
    env["JAX_PLATFORMS"] = "cuda"
    seen = _setup_devices(config, tmp_path, env)
    flags = gpu_env.parse_xla_flags(seen["XLA_FLAGS"] or "")
    assert flags.get("xla_gpu_deterministic_ops") == "true", seen
    assert flags.get("xla_gpu_exclude_nondeterministic_ops") == "true", seen
    assert seen[gpu_env.MEM_FRACTION_ENV] == gpu_env.GPU_MEM_FRACTION
    # Not the elastic worker's fault handling: a fixed world has no liveness, barriers or recoverability
    # to go with it (its first collective may wait on a peer still compiling past the watchdog).
    assert "xla_gpu_execution_terminate_timeout" not in flags and seen[gpu_env.ABORT_COLLECTIVES_ENV] is None


@pytest.mark.parametrize("platform", ["cpu", "rocm"])
def test_a_run_that_is_not_elastic_leaves_other_platforms_as_they_are(tmp_path, platform):
    # (ROCm, TPU: refused as "not one of cpu, gpu, cuda" for a while -- runs that used to train.)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = platform
    seen = _setup_devices("tiny.yaml", tmp_path, env)
    assert seen["XLA_FLAGS"] is None and seen[gpu_env.MEM_FRACTION_ENV] == os.environ.get(gpu_env.MEM_FRACTION_ENV)


def _setup_devices(config: str, run_dir, env: dict) -> dict:
    """train.setup_devices in a fresh process (before JAX starts): the environment it leaves."""
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", SETUP_DEVICES, str(repo / "configs" / config), str(run_dir),
                           gpu_env.MEM_FRACTION_ENV, gpu_env.ABORT_COLLECTIVES_ENV], capture_output=True, text=True,
                          env=env, cwd=repo, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])
