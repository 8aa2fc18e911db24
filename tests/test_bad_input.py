"""Bad input to `python -m resilient_jax.train`: exit 2, one stderr line naming the key, fault or
path, no traceback, nothing written.

Most cases call `train.main` in this process (validation happens before JAX is touched, so they
take milliseconds); a few go through a real subprocess, where what the user sees matters.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from resilient_jax import train
from resilient_jax.data import prepare_dataset

from conftest import REPO, TINY, run_cli


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` with its bytes (None for directories)."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


@pytest.fixture
def workdir(tmp_path, monkeypatch, default_dataset):
    """An empty current directory (relative paths land here) with a file, an empty dir and a link to
    the training dataset in it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("precious\n")
    (tmp_path / "empty-dir").mkdir()
    (tmp_path / "train-data").symlink_to(default_dataset.root)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("a dataset of your own, prepared with other settings\n" * 200)
    prepare_dataset(tmp_path / "text", tmp_path / "mine", shards=4, seq_len=32)
    return tmp_path


CASES = [
    # (extra argv, text the one line must contain)
    (["--set", "train.steps=0"], "config key train.steps: must be >= 1, got 0"),
    (["--set", "model.dropout=1"], "config key model.dropout: must be in [0, 1)"),
    (["--set", "model.dropout=-0.5"], "config key model.dropout"),
    (["--set", "optimizer.lr=-0.001"], "config key optimizer.lr: must be > 0"),
    (["--set", "optimizer.lr=0"], "config key optimizer.lr"),
    (["--set", "train.log_every=0"], "config key train.log_every"),
    (["--set", "parallel.virtual_shards=0"], "config key parallel.virtual_shards"),
    (["--set", "optimizer.warmup_steps=-3"], "config key optimizer.warmup_steps"),
    (["--set", "checkpoint.every_steps=-1"], "config key checkpoint.every_steps"),
    (["--set", "data.prefetch=0"], "config key data.prefetch"),
    (["--set", "runtime.assignment=fastest"], "config key runtime.assignment: expected one of proportional, uniform"),
    (["--set", "runtime.assignment_hysteresis=-0.1"], "config key runtime.assignment_hysteresis"),
    (["--set", "runtime.max_share=0"], "config key runtime.max_share"),
    (["--set", "parallel.cross_region=ring"], "config key parallel.cross_region: expected one of hierarchical, flat"),
    (["--fault", "nan_shard:16@3"], "fault nan_shard:16@3: the dataset has 16 shards"),
    (["--fault", "nan_shard:3@200"], "fault nan_shard:3@200: step 200 is past the run's last step 199"),
    (["--fault", "kill_host:0@5"], "fault kill_host:0@5: kill_host needs an elastic run"),
    (["--fault", "hang_host:0@5"], "fault hang_host:0@5: hang_host needs an elastic run"),
    (["--fault", "delay_host:0@5-6:1"], "fault delay_host:0@5-6:1: delay_host needs an elastic run"),
    (["--fault", "slow_host:0@5:2"], "fault slow_host:0@5:2: slow_host needs an elastic run"),
    (["--fault", "kill_region:eu@5"], "fault kill_region:eu@5: kill_region needs an elastic run"),
    (["--fault", "join_host@5"], "fault join_host@5: join_host needs an elastic run"),
    (["--set", "data.quarantine=[{shard: 16, from_step: 0}]"], "config key data.quarantine[0].shard"),
    (["--set", "data.dataset=data/typo"], "data.dataset {cwd}/data/typo does not exist"),
    (["--set", "data.dataset=empty-dir"], "data.dataset {cwd}/empty-dir holds no dataset"),
    (["--set", "data.dataset=a-file"], "data.dataset {cwd}/a-file is a file, not a dataset directory"),
    (["--set", "data.dataset=mine"], "data.dataset {cwd}/mine was prepared with other settings: set data.shards=4 "
                                     "(not 16), data.seq_len=32 (not 64), or point data.dataset at another directory"),
    (["--set", "data.dataset=a-file", "--set", "data.build_if_missing=true"],
     "data.dataset {cwd}/a-file is a file, not a dataset directory"),
    (["--set", "optimizer.lr=nan"], "config key optimizer.lr: must be a finite number, got nan"),
    (["--set", "task.loss=resilient_jax.losses:LossFn"], "config key task.loss: resilient_jax.losses:LossFn"),
    (["--set", "run.dir=a-file"], "run.dir {cwd}/a-file is a file"),
    (["--set", "run.dir=a-file/run"], "run.dir {cwd}/a-file/run: {cwd}/a-file is a file"),
    (["--set", "checkpoint.dir=a-file"], "checkpoint.dir {cwd}/a-file is a file"),
    (["--set", "run.dir=/proc/self/rj-run"], "run.dir /proc/self/rj-run is not writable"),
    (["--stop-at", "0"], "--stop-at 0: must be >= 1"),
    (["--stop-at", "201"], "--stop-at 201: past the run's end (train.steps 200); to train longer, raise it "
                           "(--set train.steps=201)"),
    (["--set", "runtime.launcher=ray"], "runtime.launcher=ray: only an elastic run launches hosts, and this config "
                                        "has no topology.regions, so it would train in this one process"),
    (["--set", "runtime.ray_address=10.0.0.5:6379", "--set", "runtime.bind=10.0.0.5"],
     "runtime.ray_address=10.0.0.5:6379, runtime.bind=10.0.0.5: only an elastic run launches hosts"),
    (["--set", "model.factory=no_such_pkg_h13:build"],
     "config key model.factory: cannot import module 'no_such_pkg_h13' (looked in task.import_dir"),
    (["--set", "model.factory=resilient_jax.config:BUILTIN_MODEL"],
     "config key model.factory: resilient_jax.config:BUILTIN_MODEL is a str, not a callable"),
    (["--set", "model.factory=resilient_jax.models"], 'config key model.factory: expected "package.module:name"'),
    (["--set", "task.loss=no_such_pkg_h13:loss"], "config key task.loss: cannot import module 'no_such_pkg_h13'"),
    (["--set", "model.args={width: 3}"], "config key model.args: the built-in model"),
    (["--set", "model.args=[1, 2]"], "config key model.args: expected a mapping with text keys"),
    (["--set", "eval.every_steps=10"], "config key eval.every_steps: evaluation needs held-out data"),
    (["--set", "eval.every_steps=10", "--set", "eval.holdout_shards=16"],
     "config key eval.holdout_shards: the dataset has 16 shards and training needs at least one"),
    (["--set", "eval.every_steps=10", "--set", "eval.holdout_shards=2", "--fault", "nan_shard:15@3"],
     "fault nan_shard:15@3: shard 15 is held out for evaluation (eval.holdout_shards 2: shards 14..15)"),
    (["--set", "eval.every_steps=10", "--set", "eval.dataset=empty-dir"],
     "config key eval.dataset: {cwd}/empty-dir holds no dataset (manifest.json); prepare it"),
    (["--set", "eval.every_steps=10", "--set", "eval.dataset=train-data"],
     "config key eval.dataset: {cwd}/train-data is the training dataset (the same shard contents), so its loss "
     "would not be held out; prepare held-out text into its own dataset, or set eval.holdout_shards instead"),
]


@pytest.mark.parametrize("extra, expected", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_one_line_exit_2_nothing_written(workdir, capsys, extra, expected):
    before = tree(workdir)
    code = train.main(["--config", str(TINY), "--set", "run.dir=runs/tiny", *extra])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert expected.format(cwd=workdir) in lines[0], lines[0]
    assert tree(workdir) == before  # nothing written, the file and the dir untouched


@pytest.mark.parametrize("fault, expected", [
    ("kill_region:mars@5", "fault kill_region:mars@5: no region named 'mars'"),
    ("kill_host:9@5", "fault kill_host:9@5: host 9 does not exist (hosts 0..3)"),
    ("kill_host:9@formation:1", "fault kill_host:9@formation:1: host 9 does not exist (hosts 0..3)"),
    ("kill_host:1@compile:1", "fault 'kill_host:1@compile:1': unknown moment 'compile' (known: formation, adopt, save"),
    ("kill_host:1@save:25", "fault kill_host:1@save:25: no checkpoint is written at step 25 (checkpoint.every_steps 50)"),
    ("kill_host:0@report:30", "fault kill_host:0@report:30: the run's end is reported once, after its last step 60"),
    ("kill_host:1@save:61", "fault kill_host:1@save:61: the run has 60 steps (train.steps), so no checkpoint of step 61"),
    ("kill_host:1@save:50 --set checkpoint.enabled=false",
     "fault kill_host:1@save:50: checkpoint.enabled is false, so no checkpoint is ever written"),
    # Not a fault, the same refusal before any host starts: it trained with 4 hosts to the end.
    ("kill_host:1@5 --set runtime.min_hosts=9", "runtime.min_hosts 9 is more than the 4 hosts this run launches"),
])
def test_an_elastic_fault_aimed_at_nothing_is_one_line_before_any_host_starts(workdir, capsys, fault, expected):
    fault, *extra = fault.split(" ")
    code = train.main(["--config", str(REPO / "configs" / "cpu-4host.yaml"), "--set", "run.dir=runs/e", "--fault", fault,
                       *extra])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {expected}"), err
    assert not (workdir / "runs" / "e" / "elastic").exists()  # no controller, no worker


def test_missing_dataset_line_says_how_to_build_it(workdir, capsys):
    assert train.main(["--config", str(TINY), "--set", "data.dataset=data/stdlib"]) == 2
    line = capsys.readouterr().err.strip()
    assert "python -m resilient_jax.data prepare --src default --out " in line and "data.build_if_missing: true" in line
    assert not (workdir / "data").exists() and not (workdir / "runs").exists()


def _cli(cwd: Path, *args: str, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "resilient_jax.train", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


def _one_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


@pytest.mark.parametrize("extra, expected", [
    (["--config", "."], "config file . is a directory"),
    (["--config", str(TINY), "--set", "run.dir=a-file"], "run.dir {cwd}/a-file is a file"),
    (["--config", str(TINY), "--set", "run.dir=/proc/self/rj-run"], "run.dir /proc/self/rj-run is not writable"),
    (["--config", str(TINY), "--set", "train.steps=-5"], "config key train.steps: must be >= 1, got -5"),
    (["--config", str(TINY), "--fault", "kill_host:1@5"], "fault kill_host:1@5: kill_host needs an elastic run"),
    # Found later, while building the trainer (with run.dir locked): the lock and the directories
    # it created are gone again.
    (["--config", str(TINY), "--set", "data.global_batch=50", "--set", "run.dir=runs/deep/run"],
     "data.global_batch (50) must be a positive multiple of parallel.virtual_shards (24)"),
])
def test_cli_bad_input(workdir, extra, expected):
    before = tree(workdir)
    line = _one_error_line(_cli(workdir, *extra))
    assert expected.format(cwd=workdir) in line, line
    assert tree(workdir) == before


def test_cli_model_with_wrong_logits_shape_is_refused_before_any_step(workdir, tmp_path_factory):
    """A factory that imports but whose module returns [B, L] (no vocab dim): found by the trainer's
    abstract check (with run.dir locked), one line, the lock and its directories gone again."""
    plugin_dir = tmp_path_factory.mktemp("plugin")
    (plugin_dir / "h13_flat_model.py").write_text(
        "import jax.numpy as jnp\nfrom flax import nnx\n\n"
        "class Flat(nnx.Module):\n"
        "    def __init__(self, rngs):\n"
        "        self.w = nnx.Param(jnp.zeros((256, 4)), out_sharding=('vocab', None))\n"
        "    def __call__(self, tokens_BxL, *, dropout_key=None):\n"
        "        return jnp.take(self.w[...], tokens_BxL, axis=0)[..., 0]\n\n"
        "def build(args, rngs):\n    return Flat(rngs)\n")
    before = tree(workdir)
    line = _one_error_line(_cli(workdir, "--config", str(TINY), "--set", f"task.import_dir={plugin_dir}",
                                "--set", "model.factory=h13_flat_model:build", "--set", "run.dir=runs/deep/run"))
    assert "config key model.factory: h13_flat_model:build must return float logits [B, L, vocab]" in line, line
    assert "it returned ShapeDtypeStruct (2, 64) float32" in line, line
    assert tree(workdir) == before


def test_cli_run_dir_in_use_names_the_holder_and_leaves_it_alone(workdir):
    """A live holder (a process holding run.lock) refuses a second run; its lock survives."""
    run_dir = workdir / "runs" / "tiny"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from resilient_jax.runlock import RunLock; "
                               f"RunLock({str(run_dir)!r}).acquire(); print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "held"
        lock_before = (run_dir / "run.lock").read_bytes()
        line = _one_error_line(_cli(workdir, "--config", str(TINY)))  # tiny.yaml: run.dir runs/tiny
        assert f"run.dir {run_dir} is in use by another run (pid {holder.pid} on host" in line, line
        assert (run_dir / "run.lock").read_bytes() == lock_before and sorted(os.listdir(run_dir)) == ["run.lock"]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_an_elastic_replica_split_between_hosts_is_one_line_before_any_host_starts(workdir, capsys):
    # 2 devices per host cannot hold a replica of fsdp 4 whole: a survivor could not rebuild it.
    code = train.main(["--config", str(REPO / "configs" / "cpu-4host.yaml"), "--set", "run.dir=runs/e",
                       "--set", "parallel.fsdp=4"])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: parallel.fsdp x parallel.tensor = 4 devices per replica"), err
    assert "topology.devices_per_host (2)" in lines[0]
    assert not (workdir / "runs" / "e" / "elastic").exists()


def test_the_runbook_rehearsal_refuses_a_workdir_that_holds_anything_and_deletes_nothing(tmp_path):
    # It resolved a relative WORKDIR against the repository (after its cd) and ran rm -rf on it:
    # `bash scripts/runbook_rehearsal.sh configs` from anywhere deleted the repository's configs.
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "mine.yaml").write_text("train: {steps: 1}\n")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "runbook_rehearsal.sh"), "configs"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"error: WORKDIR {tmp_path / 'configs'} is not empty; name a new or empty "
                                   "directory (the rehearsal writes its runs there)")
    assert (tmp_path / "configs" / "mine.yaml").read_text() == "train: {steps: 1}\n"
    assert (REPO / "configs" / "tiny.yaml").is_file()


def test_a_controller_address_it_cannot_listen_on_is_one_line_naming_the_keys(workdir, capsys):
    # It printed "error: [Errno 98] Address already in use" (no key, no address) and left the run's
    # elastic/config.json behind.
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code = train.main(["--config", str(REPO / "configs" / "cpu-4host.yaml"), "--set", "run.dir=runs/e",
                           "--set", f"runtime.port={port}"])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: runtime.bind 127.0.0.1, runtime.port {port}: the controller cannot listen "
                               "there (Address already in use)"), lines[0]
    assert not (workdir / "runs" / "e" / "elastic" / "config.json").exists()


@pytest.mark.parametrize("script", ["chaos_drill.py", "soak.py"])
def test_a_drill_never_deletes_an_out_that_is_not_its_own(tmp_path, script):
    # Both ran shutil.rmtree(--out): `--out runs` or `--out ~` would have wiped it, without a word.
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("precious")
    extra = ["--seed", "1", "--faults", "1", "--steps", "20"] if script == "soak.py" else ["--quick"]
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / script), *extra, "--out", "victim"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    kind = "soak" if script == "soak.py" else "drill"
    assert proc.stderr.strip() == (f"error: --out {victim} is not empty and is not an earlier {kind} output; name a "
                                   "new or empty directory")
    assert (victim / "notes.txt").read_text() == "precious"
