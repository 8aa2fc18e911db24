"""Bad input: each gives one clear error naming the field or file, and nothing committed is lost.

A truncated array file, a deleted context field, an edited config hash, another dataset version,
an unwritable checkpoint directory, a full disk during a save (a real tiny tmpfs where mounting is
allowed, and a fault injected at the file layer everywhere). The CLI cases check exit code 2, one
`error:` line and no traceback.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
import pytest

from resilient_jax.checkpoint import reader
from resilient_jax.checkpoint.reader import CheckpointError, json_sha256
from resilient_jax.checkpoint.store import CheckpointSaveError, CheckpointStore

from conftest import TINY, run_cli, tiny_config


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, default_dataset):
    """A tiny run with committed checkpoints at steps 2 and 4."""
    from resilient_jax.trainer import Trainer

    run_dir = tmp_path_factory.mktemp("base") / "run"
    Trainer(tiny_config(run_dir, "train.steps=4", "checkpoint.every_steps=2")).run()
    assert reader.list_steps(run_dir / "checkpoints") == [2, 4]
    return run_dir


@pytest.fixture
def run_copy(base_run, tmp_path):
    dest = tmp_path / "run"
    shutil.copytree(base_run, dest)
    return dest


def resume(run_dir: Path, *overrides: str):
    from resilient_jax.trainer import Trainer

    return Trainer(tiny_config(run_dir, "train.steps=4", "checkpoint.every_steps=2", *overrides)).run()


def train_cli(run_dir: Path, *overrides: str):
    sets = [a for o in ("train.steps=4", "checkpoint.every_steps=2", "run.progress=quiet", f"run.dir={run_dir}",
                        *overrides) for a in ("--set", o)]
    return run_cli("resilient_jax.train", "--config", str(TINY), *sets)


def assert_one_error_line(proc, *words: str) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


def assert_intact(root: Path, *steps: int) -> None:
    for step in steps:
        assert reader.verify(root / str(step)) == [], f"committed step {step} was damaged"


def truncate_largest_array_file(step_dir: Path, field: str) -> tuple[Path, int]:
    """Halves the field's largest OCDBT data file; returns it and its size before."""
    files = [p for p in (step_dir / field).rglob("*") if p.is_file() and p.parent.name == "d"]
    victim = max(files, key=lambda p: p.stat().st_size)
    size = victim.stat().st_size
    victim.write_bytes(victim.read_bytes()[: size // 2])
    return victim, size


# -- corrupt checkpoints ---------------------------------------------------------------------------------


def test_truncated_array_file_is_refused_by_verify_and_train(run_copy):
    root = run_copy / "checkpoints"
    victim, size = truncate_largest_array_file(root / "4", "weights")
    verify = run_cli("resilient_jax.checkpoint", "verify", str(root / "4"))
    assert verify.returncode == 2 and "Traceback" not in verify.stderr
    name = victim.relative_to(root / "4").as_posix()
    assert verify.stderr.splitlines() == [
        f"error: checkpoint {root / '4'}: weights: {name}: is {victim.stat().st_size} bytes, the commit manifest "
        f"says {size}; resume from the older step 2 (--resume {root / '2'}) "
        "after verifying it"], verify.stderr
    line = assert_one_error_line(train_cli(run_copy), "checkpoints/4: weights:", f"--resume {root / '2'}")
    assert "newest complete checkpoint before it is step 2" in line
    assert_intact(root, 2)
    assert reader.list_steps(root) == [2, 4]  # nothing deleted, nothing overwritten


def test_deleted_context_field_is_refused_naming_it(run_copy):
    root = run_copy / "checkpoints"
    shutil.rmtree(root / "4" / "rng")
    with pytest.raises(CheckpointError, match=r"checkpoints/4: rng: rng/rng.json is missing; .* step 2"):
        resume(run_copy)
    verify = run_cli("resilient_jax.checkpoint", "verify", str(root / "4"))
    lines = verify.stderr.splitlines()
    assert verify.returncode == 2 and all(line.startswith(f"error: checkpoint {root / '4'}: rng: rng/") for line in lines)
    assert any(": rng: rng/rng.json: is missing" in line for line in lines), lines
    assert lines[-1].endswith(f"resume from the older step 2 (--resume {root / '2'}) after verifying it"), lines
    # Accepting the offer works, and moves the broken newer step aside rather than deleting it.
    from resilient_jax.trainer import Trainer

    summary = Trainer(tiny_config(run_copy, "train.steps=4", "checkpoint.every_steps=2"), resume="2").run()
    assert summary["resumed_from"][-1]["step"] == 2 and summary["final_step"] == 4
    assert [p.name.split(".")[0] for p in (root / "superseded").iterdir()] == ["4"]
    assert_intact(root, 2, 4)


def test_edited_config_hash_is_refused(run_copy):
    path = run_copy / "checkpoints" / "4" / "config" / "config.json"
    config = json.loads(path.read_text())
    config["hash"] = "0" * 64
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="checkpoints/4: config: config/config.json does not match its sha256"):
        resume(run_copy)
    verify = run_cli("resilient_jax.checkpoint", "verify", str(path.parents[1]))
    assert verify.returncode == 2 and ": config: " in verify.stderr
    assert_intact(run_copy / "checkpoints", 2)


def _rewrite_context(step_dir: Path, field: str, edit) -> None:
    """Edits a context field the way a legitimate writer would (manifest checksum and commit manifest
    updated too)."""
    from resilient_jax.checkpoint import commit

    path = reader.context_file(step_dir, field)
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj))
    manifest_path = reader.context_file(step_dir, "manifest")
    manifest = json.loads(manifest_path.read_text())
    manifest["context_sha256"][field] = json_sha256(obj)
    manifest_path.write_text(json.dumps(manifest))
    commit.write(step_dir, int(step_dir.name), 0, 1)


def test_another_dataset_version_is_refused(run_copy):
    step_dir = run_copy / "checkpoints" / "4"
    _rewrite_context(step_dir, "data", lambda d: d.update(dataset_version="f" * 64))
    line = assert_one_error_line(train_cli(run_copy), "checkpoints/4: data: dataset version ffffffffffff differs")
    assert "resume with the dataset the run started on" in line
    assert_intact(run_copy / "checkpoints", 2, 4)


def test_config_change_must_be_named(run_copy):
    with pytest.raises(CheckpointError, match="config: .* in optimizer.lr; .*--allow-config-change optimizer.lr"):
        resume(run_copy, "optimizer.lr=0.001")


# -- unwritable directory, full disk -----------------------------------------------------------------------


def test_unwritable_checkpoint_dir_fails_at_start_by_name(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = assert_one_error_line(train_cli(tmp_path / "run", f"checkpoint.dir={blocker / 'ckpt'}"),
                                 "checkpoint.dir", "is a file, so the directory cannot be created")
    assert str(blocker / "ckpt") in line


def _mount_tmpfs(path: Path, options: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_read_only_checkpoint_dir_is_refused(tmp_path):
    target = tmp_path / "ro"
    if _mount_tmpfs(target, "ro,size=64k"):
        try:
            with pytest.raises(CheckpointError, match="checkpoint.dir: is not writable .*Read-only file system"):
                CheckpointStore(target / "ckpt")
        finally:
            _umount(target)
    elif os.geteuid() != 0:
        target.mkdir()
        target.chmod(0o555)
        with pytest.raises(CheckpointError, match="checkpoint.dir: is not writable"):
            CheckpointStore(target / "ckpt")
    else:
        pytest.skip("root without permission to mount: neither a read-only mount nor chmod can deny writes")


class State(NamedTuple):
    params: dict
    opt_state: dict


def _random_state(step: int) -> State:
    # Random (incompressible) float32: 2 x 256 KiB per checkpoint on disk.
    r = np.random.default_rng(step)
    return State({"w": jax.numpy.asarray(r.standard_normal((256, 256), np.float32))},
                 {"m": jax.numpy.asarray(r.standard_normal((256, 256), np.float32))})


def _context(step: int) -> dict:
    from test_checkpoint_kill import _context as toy_context

    return toy_context(step)


def _assert_failed_save_left_no_trace(root: Path, error: CheckpointSaveError, committed: list[int]) -> None:
    assert "no space left on device" in str(error), error
    assert f"step {committed[-1]}, is intact" in str(error)
    assert reader.list_steps(root) == committed and reader.temporary_dirs(root) == []
    assert_intact(root, *committed)


def test_full_disk_during_save_real_tmpfs(tmp_path):
    mount = tmp_path / "tiny-disk"
    if not _mount_tmpfs(mount, "size=800k"):
        pytest.skip("needs root and mount(8) for a tiny tmpfs; test_full_disk_during_save_injected covers the logic")
    try:
        store = CheckpointStore(mount / "ckpt", async_save=True)
        store.save(1, _random_state(1), _context(1))
        store.wait()
        with pytest.raises(CheckpointSaveError) as failed:
            store.save(2, _random_state(2), _context(2))
            store.wait()
        assert "while writing" in str(failed.value)
        _assert_failed_save_left_no_trace(mount / "ckpt", failed.value, [1])
        store.close()
    finally:
        _umount(mount)


def _fail_json_writes(monkeypatch, fails, *, with_filename: bool) -> None:
    """ENOSPC from etils' write_text (under orbax's and our JSON writes) for each path `fails` picks."""
    from etils import epath

    path_cls = type(epath.Path("/"))
    original = path_cls.write_text

    def write_text(self, *args, **kwargs):
        if fails(self):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), *([str(self)] if with_filename else []))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(path_cls, "write_text", write_text)


def test_full_disk_during_save_injected(tmp_path, monkeypatch):
    """ENOSPC raised by the file layer under the JSON writes (the arrays go through tensorstore's C++)."""
    root = tmp_path / "ckpt"
    store = CheckpointStore(root, async_save=True)
    store.save(1, _random_state(1), _context(1))
    store.wait()
    _fail_json_writes(monkeypatch, lambda path: path.name == "manifest.json", with_filename=True)
    with pytest.raises(CheckpointSaveError) as failed:
        store.save(2, _random_state(2), _context(2))
        store.wait()
    monkeypatch.undo()
    _assert_failed_save_left_no_trace(root, failed.value, [1])
    store.save(3, _random_state(3), _context(3))  # the store keeps working once there is space again
    store.close()
    assert reader.list_steps(root) == [1, 3]


def test_full_disk_names_the_item_even_when_the_os_error_names_no_file(tmp_path, monkeypatch):
    """Python's file layer raises a bare OSError(28) (no filename) under orbax's array-metadata writer."""
    root = tmp_path / "ckpt"
    store = CheckpointStore(root, async_save=True)
    _fail_json_writes(monkeypatch, lambda path: "array_metadatas" in str(path)
                      and "optimizer.orbax-checkpoint-tmp" in str(path), with_filename=False)
    with pytest.raises(CheckpointSaveError) as failed:
        store.save(1, _random_state(1), _context(1))
        store.wait()
    monkeypatch.undo()
    assert "no space left on device while writing optimizer" in str(failed.value), failed.value
    assert reader.list_steps(root) == [] and reader.temporary_dirs(root) == []
    store.close()


@pytest.mark.slow
def test_full_disk_stops_training_with_one_line(tmp_path):
    mount = tmp_path / "tiny-disk"
    # One tiny checkpoint is ~1.6 MiB; 2.5 MiB holds the first, not the second.
    if not _mount_tmpfs(mount, "size=2500k"):
        pytest.skip("needs root and mount(8) for a tiny tmpfs; test_full_disk_during_save_injected covers the logic")
    try:
        proc = train_cli(tmp_path / "run", f"checkpoint.dir={mount / 'ckpt'}", "checkpoint.keep_last=0")
        assert_one_error_line(proc, "checkpoint save of step 4", "no space left on device",
                              "step 2, is intact")
        assert reader.list_steps(mount / "ckpt") == [2] and reader.temporary_dirs(mount / "ckpt") == []
        assert_intact(mount / "ckpt", 2)
    finally:
        _umount(mount)


def test_a_failure_whose_chain_loops_back_is_still_classified():
    """Orbax re-raises a stored failure inside the handler of an error chained from it: the chain
    became a cycle, and the save's cleanup spun in is_disk_full forever (a CI run hung there)."""
    import errno

    from resilient_jax.checkpoint import orbax_errors

    stored = RuntimeError("write failed")
    ours = RuntimeError("checkpoint save failed")
    ours.__cause__, stored.__context__ = stored, ours  # stored -> ours -> stored -> ...
    assert orbax_errors.is_disk_full(stored) is False
    full = OSError(errno.ENOSPC, "No space left on device")
    ours.__context__, full.__cause__ = full, stored
    assert orbax_errors.is_disk_full(full) is True
