"""The benchmark scripts refuse a bad argument before any work: argparse's one `error:` line naming
the value, exit 2, no traceback -- not minutes later, after the compiles or the runs. A bad value
is given to each script the way a typo would be; `jax` is made unimportable (nothing heavy starts
without it) and TMPDIR is watched (no run directory is made)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ALL_SECTIONS = ["--skip", "precision", "compiled", "time"]  # bench_reduction with nothing to run


@pytest.fixture
def run_script(tmp_path):
    """Runs scripts/NAME with `args` (from the repository unless `cwd`); returns the process."""
    poison = tmp_path / "poison" / "jax"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text('raise ImportError("jax imported: the script started work before '
                                        'refusing its arguments")\n')
    temp = tmp_path / "tmp"
    temp.mkdir()

    def run(name: str, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
        env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": str(poison.parent)}
        script = f"scripts/{name}" if cwd == REPO else str(REPO / "scripts" / name)
        # The timeout only keeps a regression from hanging the suite; nothing here measures time.
        proc = subprocess.run([sys.executable, script, *args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=300)
        assert not any(temp.iterdir()), f"{name} made a run directory before refusing: {list(temp.iterdir())}"
        return proc

    return run


def assert_refused(proc: subprocess.CompletedProcess, name: str, *named: str) -> None:
    """Exit 2 with argparse's usage and one error line, the last, that names each of `named`."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if "error" in line.lower()]
    assert errors == [lines[-1]] and lines[-1].startswith(f"{name}: error: "), proc.stderr
    for text in named:
        assert text in lines[-1], (text, lines[-1])
    assert proc.stdout == ""


@pytest.mark.parametrize("args, named", [
    (["--configs", "tinyy", *ALL_SECTIONS], ["--configs", "'tinyy'", "small, tiny"]),
    (["--meshes", "2by4", *ALL_SECTIONS], ["--meshes", "'2by4'"]),
    (["--meshes", "2x4", "0x8", *ALL_SECTIONS], ["--meshes", "'0x8'"]),
    (["--meshes", "4x4", *ALL_SECTIONS], ["--meshes", "4x4", "16 devices"]),
    (["--steps", "0", *ALL_SECTIONS], ["--steps", "got 0"]),
    (["--rounds", "0", *ALL_SECTIONS], ["--rounds", "got 0"]),
])
def test_bench_reduction_refuses_a_bad_argument_up_front(run_script, args, named):
    assert_refused(run_script("bench_reduction.py", *args), "bench_reduction.py", *named)


@pytest.mark.parametrize("args, named", [
    (["--sections", "depth", "--set", "model.d_modle=8"], ["model.d_modle"]),
    (["--sections", "depth", "--set", "model.d_model=wide"], ["model.d_model", "'wide'"]),
    (["--sections", "depth", "--set", "model.d_model"], ["--set", "model.d_model"]),
    (["--sections", "meshes,dpeth"], ["--sections", "dpeth", "throughput"]),
    (["--sections", "gpu", "--gpu-configs", "gpu-8bb"], ["--gpu-configs", "gpu-8bb", "gpu-300b-46node"]),
    (["--sections", "gpu", "--gpu-configs", "gpu-8b", "--gpu-modes", "natve"], ["--gpu-modes", "natve", "native"]),
    (["--sections", "depth", "--config", "nothere.yaml"], ["--config", "nothere.yaml"]),
    (["--sections", "throughput", "--throughput-steps", "0"], ["--throughput-steps", "got 0"]),
])
def test_bench_scale_refuses_a_bad_argument_up_front(run_script, args, named):
    assert_refused(run_script("bench_scale.py", *args), "bench_scale.py", *named)


@pytest.mark.parametrize("args, named", [
    (["--forms", "flash,explicit"], ["--forms", "flash", "explicit, dot_product, chunked"]),
    (["--layouts", "2by4,8x1"], ["--layouts", "'2by4'"]),
    (["--layouts", "16x1"], ["--layouts", "16x1"]),
    (["--steps", "0", "--forms", "explicit", "--layouts", "1x1"], ["--steps", "got 0"]),
    (["--chunk", "0", "--forms", "chunked"], ["--chunk", "got 0"]),
    # tiny's seq_len 64 is no multiple of 5: the chunked form would fail after the others trained.
    (["--chunk", "5", "--layouts", "1x1"], ["model.attention_chunk", "got 5"]),
    (["--set", "model.d_modle=8", "--forms", "explicit", "--layouts", "1x1"], ["model.d_modle"]),
])
def test_bench_attention_bits_refuses_a_bad_argument_up_front(run_script, args, named):
    assert_refused(run_script("bench_attention_bits.py", *args), "bench_attention_bits.py", *named)


def test_an_output_path_that_cannot_be_written_is_refused_before_the_runs(run_script, tmp_path):
    missing = tmp_path / "missing" / "curves.png"
    assert_refused(run_script("bench_loss_curves.py", "--steps", "1", "--plot", str(missing)),
                   "bench_loss_curves.py", "--plot", str(missing.parent), "does not exist")
    assert_refused(run_script("bench_loss_curves.py", "--steps", "1", "--plot", str(tmp_path)),
                   "bench_loss_curves.py", "--plot", "is a directory")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert_refused(run_script("bench_region_reduction.py", "--skip-mission", "--out", str(a_file / "out")),
                   "bench_region_reduction.py", "--out", f"{a_file} is a file")
    assert_refused(run_script("bench_region_reduction.py", "--skip-mission", "--out", str(a_file)),
                   "bench_region_reduction.py", "--out", f"{a_file} is a file")


# The config's own key is named: the file read is the one in the caller's directory (the scripts
# that run children in the repository read the repository's path, where there is none).
RELATIVE = [
    ("bench_scale.py", ["--sections", "depth"]),
    ("bench_goodput.py", ["--steps", "30"]),
    ("bench_loss_curves.py", ["--steps", "1"]),
    ("bench_step.py", ["--steps", "1", "--rounds", "1"]),
    ("bench_assignment.py", ["--steps", "10"]),
    ("bench_region_reduction.py", ["--skip-mission"]),
    ("bench_checkpoint.py", ["--saves", "1", "--steps", "1"]),
]


@pytest.mark.parametrize("name, args", RELATIVE)
def test_a_relative_config_is_read_from_the_callers_directory(run_script, tmp_path, name, args):
    (tmp_path / "mine.yaml").write_text("model:\n  d_modle: 8\n")
    assert_refused(run_script(name, "--config", "mine.yaml", *args, cwd=tmp_path), name, "model.d_modle")


@pytest.mark.parametrize("name, args", RELATIVE)
def test_a_missing_config_is_named(run_script, tmp_path, name, args):
    proc = run_script(name, "--config", "nothere.yaml", *args, cwd=tmp_path)
    assert_refused(proc, name, "--config", str(tmp_path / "nothere.yaml"))


def test_the_soak_reads_its_config_by_the_same_rule(run_script, tmp_path):
    """scripts/soak.py resolves --config as the benchmarks do (cli_args.config_file): a missing file
    is named by both paths it tried, a directory is not taken for a config."""
    (tmp_path / "configs").mkdir()  # a directory of the caller's named like the repository's file
    proc = run_script("soak.py", "--seed", "1", "--faults", "2", "--steps", "20", "--config", "nothere.yaml",
                      cwd=tmp_path)
    assert_refused(proc, "soak.py", "--config", str(tmp_path / "nothere.yaml"), str(REPO / "nothere.yaml"))
    proc = run_script("soak.py", "--seed", "1", "--faults", "2", "--steps", "20", "--config", "configs", cwd=tmp_path)
    assert_refused(proc, "soak.py", "--config", str(tmp_path / "configs"))


def test_a_repository_config_is_found_from_any_directory(run_script, tmp_path):
    """configs/NAME.yaml, as the usage lines write it, still names the repository's file from
    elsewhere (scripts/soak.py's rule): the --set typo is what is refused, not the file."""
    proc = run_script("bench_goodput.py", "--config", "configs/cpu-4host.yaml", "--set", "runtime.asignment=uniform",
                      cwd=tmp_path)
    assert_refused(proc, "bench_goodput.py", "runtime.asignment")


@pytest.mark.parametrize("name, args", [
    ("bench_checkpoint.py", ["--config", "configs/tiny.yaml", "--saves", "1", "--steps", "1"]),
    ("bench_step.py", ["--config", "configs/tiny.yaml", "--steps", "1", "--rounds", "1"]),
])
def test_a_mesh_larger_than_the_devices_is_one_line(tmp_path, name, args):
    """What only the devices can refuse (parallel.data above the emulated devices) is found when the
    trainer is built, after the imports: still the script's one error line, not a traceback."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, f"scripts/{name}", *args, "--set", "parallel.data=16"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert_refused(proc, name, "parallel.data*fsdp*tensor = 16", "8 devices")
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())  # its temporary run directory went with it
