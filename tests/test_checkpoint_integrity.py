"""Verify = loadable: every byte a restore reads is covered by the commit manifest.

One toy checkpoint (two array trees, the store's real save path) is written once per module and
copied per case. The seeded byte-flip sweep is the issue's "must show": a random byte of a random
file flipped -> `verify` fails naming that file, or the restore is bit-exact.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
import pytest

from resilient_jax.checkpoint import commit, reader
from resilient_jax.checkpoint.reader import CheckpointError
from resilient_jax.checkpoint.store import CheckpointSaveError, CheckpointStore
from resilient_jax.fingerprinting import params_fingerprint

from conftest import run_cli
from test_checkpoint_kill import _context, _expected_state

FLIP_SEEDS = 40
RESTORED_SEEDS = 6  # of those, also refused by a real restore (the slower path)


class State(NamedTuple):
    params: dict
    opt_state: dict


def _device_state(step: int) -> State:
    return State(*jax.tree.map(jax.numpy.asarray, _expected_state(step)))


def _abstract(step: int) -> State:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), _device_state(step))


def _fingerprint(state: State) -> str:
    return params_fingerprint((state.params, state.opt_state))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A checkpoint root with committed steps 1 and 2 (async save, the trainer's path)."""
    root = tmp_path_factory.mktemp("integrity") / "ckpt"
    store = CheckpointStore(root, async_save=True)
    for step in (1, 2):
        store.save(step, _device_state(step), _context(step))
    store.close()
    assert reader.list_steps(root) == [1, 2]
    return root


@pytest.fixture
def copy(saved, tmp_path) -> Path:
    dest = tmp_path / "ckpt"
    shutil.copytree(saved, dest)
    return dest


def _flip(path: Path, rng: random.Random) -> int:
    data = bytearray(path.read_bytes())
    offset = rng.randrange(len(data))
    data[offset] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return offset


def test_commit_manifest_lists_every_file_of_the_step(saved):
    step_dir = saved / "2"
    files = commit.read(step_dir)
    on_disk = {p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file()}
    assert set(files) == on_disk - {"commit/process_0.json"}
    for must in ("optimizer/_METADATA", "optimizer/array_metadatas/process_0", "weights/manifest.ocdbt",
                 "_CHECKPOINT_METADATA", "manifest/manifest.json", "rng/rng.json"):
        assert must in files, must
    # Not written: only a restore without target shardings reads it, and ours pass them.
    assert not any(rel.endswith("/_sharding") for rel in files)
    assert any(rel.startswith("weights/ocdbt.process_0/d/") for rel in files)
    assert reader.verify(step_dir, deep=True) == []


def test_random_byte_flip_fails_verify_naming_the_file_or_restores_bit_exact(saved, tmp_path):
    expected = _fingerprint(State(*_expected_state(2)))
    rng = random.Random(16)
    named = restored_exact = 0
    for seed in range(FLIP_SEEDS):
        root = tmp_path / f"seed{seed}"
        shutil.copytree(saved, root)
        step_dir = root / "2"
        files = sorted(p for p in step_dir.rglob("*") if p.is_file() and p.stat().st_size)
        victim = rng.choice(files)
        rel = victim.relative_to(step_dir).as_posix()
        offset = _flip(victim, rng)
        problems = reader.verify(step_dir)
        if problems:
            assert any(rel in str(p) for p in problems), (seed, rel, offset, [str(p) for p in problems])
            named += 1
            if seed < RESTORED_SEEDS:
                with pytest.raises(CheckpointError) as refused:
                    if rel.startswith(("weights/", "optimizer/", "manifest/", "commit/")):
                        CheckpointStore.restore_arrays(step_dir, _abstract(2))
                    else:  # the context fields and orbax's top-level files: what resume reads first
                        reader.load(step_dir)
                assert rel in str(refused.value), (seed, rel, str(refused.value))
        else:
            state = CheckpointStore.restore_arrays(step_dir, _abstract(2))
            assert _fingerprint(state) == expected, (seed, rel, offset)
            restored_exact += 1
        shutil.rmtree(root)
    assert named + restored_exact == FLIP_SEEDS and named > 0


def test_flipped_orbax_metadata_byte_is_named_by_the_cli(copy):
    """The reported bug: one byte of optimizer/_METADATA flipped, and verify said ok."""
    step_dir = copy / "2"
    path = step_dir / "optimizer" / "_METADATA"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x80
    path.write_bytes(bytes(data))
    proc = run_cli("resilient_jax.checkpoint", "verify", str(step_dir))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        f"error: checkpoint {step_dir}: optimizer: optimizer/_METADATA: does not match its crc32c in the commit "
        f"manifest (corrupt); resume from the older step 1 (--resume {copy / '1'}) after verifying it"]


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_missing_or_corrupt_commit_manifest_is_one_line_naming_it(copy, damage):
    step_dir = copy / "2"
    path = commit.commit_file(step_dir, 0)
    if damage == "missing":
        path.unlink()
        assert reader.list_steps(copy) == [1]  # an uncommitted step is not offered for resume
        assert reader.uncommitted_dirs(copy) == [step_dir]
    else:
        path.write_text(path.read_text().replace('"bytes": ', '"bytes": 1', 1))
    proc = run_cli("resilient_jax.checkpoint", "verify", str(step_dir))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    [line] = proc.stderr.splitlines()
    problem = "is missing" if damage == "missing" else "does not match its own crc32c"
    assert line.startswith(f"error: checkpoint {step_dir}: commit: commit/process_0.json: {problem}"), line
    assert line.endswith(f"resume from the older step 1 (--resume {copy / '1'}) after verifying it"), line
    inspected = run_cli("resilient_jax.checkpoint", "inspect", str(step_dir), "--brief")
    assert inspected.returncode == 2 and "Traceback" not in inspected.stderr, inspected.stderr
    [line] = inspected.stderr.splitlines()
    assert "commit/process_0.json" in line and problem in line, line


def test_corrupt_orbax_manifest_item_is_one_line_naming_it(copy):
    step_dir = copy / "2"
    (step_dir / "manifest" / "manifest.json").write_text("{not json")
    proc = run_cli("resilient_jax.checkpoint", "verify", str(step_dir))
    [line] = proc.stderr.splitlines()
    assert proc.returncode == 2 and line.startswith(
        f"error: checkpoint {step_dir}: manifest: manifest/manifest.json: is ")
    assert "resume from the older step 1" in line


def test_dry_run_catches_a_consistent_commit_of_wrong_shapes(copy):
    """A writer bug, not a flipped byte: the manifest disagrees with the arrays yet every crc32c
    matches. The structural dry-run (zarr metadata via OCDBT, no array read) names the array."""
    step_dir = copy / "2"
    path = step_dir / "manifest" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["arrays"]["weights"]["w"]["shape"] = [128, 512]
    path.write_text(json.dumps(manifest))
    commit.write(step_dir, 2, 0, 1)
    problems = [str(p) for p in reader.verify(step_dir)]
    assert problems == [f"checkpoint {step_dir}: weights: array w is float32[256, 256], manifest says "
                        "float32[128, 512]"]


def test_deep_decodes_every_array(copy):
    """Zeroed chunk bytes re-committed as if written so: metadata and crc32c pass, decoding does not."""
    step_dir = copy / "2"
    data_files = sorted((step_dir / "weights" / "ocdbt.process_0" / "d").iterdir(), key=lambda p: p.stat().st_size)
    big = data_files[-1]
    raw = bytearray(big.read_bytes())
    raw[len(raw) // 4: len(raw) // 2] = bytes(len(raw) // 2 - len(raw) // 4)
    big.write_bytes(bytes(raw))
    commit.write(step_dir, 2, 0, 1)
    assert reader.verify(step_dir) == []
    deep = reader.verify(step_dir, deep=True)
    assert deep and all(": weights: array " in str(p) and "unreadable" in str(p) for p in deep), [str(p) for p in deep]


def test_failed_commit_write_leaves_no_listed_step(tmp_path, monkeypatch):
    """A real fault in stage 2 (the commit file cannot be written): the step orbax renamed into
    place is removed, the save fails with one line, and the previous step stays committed."""
    import errno
    import os

    root = tmp_path / "ckpt"
    store = CheckpointStore(root, async_save=True)
    store.save(1, _device_state(1), _context(1))
    store.wait()
    original = commit.write_built

    def full_disk(step_dir, process, doc):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(commit.commit_file(step_dir, process)))

    monkeypatch.setattr(commit, "write_built", full_disk)
    with pytest.raises(CheckpointSaveError, match="save of step 2 .* no space left on device; the newest "
                                                  "committed checkpoint, step 1, is intact"):
        store.save(2, _device_state(2), _context(2))
        store.wait()
    monkeypatch.setattr(commit, "write_built", original)
    assert reader.list_steps(root) == [1] and not (root / "2").exists()
    store.save(3, _device_state(3), _context(3))
    store.close()
    assert reader.list_steps(root) == [1, 3] and reader.verify(root / "3") == []


def test_store_removes_a_step_left_uncommitted_and_resumes_the_older(copy):
    shutil.rmtree(copy / "2" / commit.COMMIT_DIR)  # killed between orbax's rename and the commit file
    store = CheckpointStore(copy)
    assert store.removed_temporary == [copy / "2"] and store.steps() == [1]
    state = store.restore_arrays(copy / "1", _abstract(1))
    store.close()
    assert _fingerprint(state) == _fingerprint(State(*_expected_state(1)))


def test_a_step_is_unlisted_before_retention_deletes_any_of_its_files(tmp_path):
    # Orbax's removal of an old step is not atomic. Stop it right after the step was un-committed
    # (what a SIGKILL inside the removal leaves at worst): the step must not be listed, and the
    # next store must remove what is left of it.
    root = tmp_path / "ckpt"
    store = CheckpointStore(root, async_save=True, keep=lambda steps: set(sorted(steps)[-1:]))

    class KilledBeforeRemoving:
        def delete(self, step):
            pass

        def close(self):
            pass

    store._manager._checkpoint_deleter._inner = KilledBeforeRemoving()
    for step in (1, 2):
        store.save(step, _device_state(step), _context(step))
    store.close()
    assert (root / "1").is_dir() and reader.list_steps(root) == [2]
    assert reader.uncommitted_dirs(root) == [root / "1"]
    reopened = CheckpointStore(root)
    assert reopened.removed_temporary == [root / "1"] and reopened.steps() == [2]
    reopened.close()


@pytest.mark.parametrize("odd", ["pc%41", "hash#mark", "what?"])
def test_a_directory_name_with_url_characters_reads_its_own_arrays(saved, tmp_path, odd):
    # '%41' is 'A' in a URL: a decoy step under pcA/ holds step 1's arrays where a URL-built path
    # would look, and '#' or '?' would cut the path short.
    root = tmp_path / odd / "ckpt"
    shutil.copytree(saved, root)
    shutil.copytree(saved / "1", tmp_path / "pcA" / "ckpt" / "2")
    assert reader.verify(root / "2", deep=True) == []
    got, want = reader.flatten(reader.load(root / "2").weights), reader.flatten(reader.load(saved / "2").weights)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def test_a_numbered_directory_no_save_wrote_is_refused_by_name_and_kept(tmp_path):
    # A job's output in a shared scratch directory: orbax would take it for a step, list it and
    # in time delete it. The store refuses the root instead, and removes nothing.
    root = tmp_path / "scratch"
    (root / "12345").mkdir(parents=True)
    (root / "12345" / "results.txt").write_text("a day of work")
    with pytest.raises(CheckpointError, match=r"checkpoint .*scratch: checkpoint.dir: holds 12345/, a numbered "
                                              r"directory that no checkpoint save wrote; .* move it away"):
        CheckpointStore(root)
    assert (root / "12345" / "results.txt").read_text() == "a day of work"
    assert reader.uncommitted_dirs(root) == [] and reader.foreign_dirs(root) == [root / "12345"]


def test_retention_counts_only_committed_steps_and_leaves_format_1_checkpoints_alone(saved, tmp_path):
    root = tmp_path / "ckpt"
    for legacy in ("100", "200"):  # later step numbers than the run's: "keep the newest" must not pick them
        shutil.copytree(saved / "1", root / legacy)
        shutil.rmtree(root / legacy / commit.COMMIT_DIR)
        manifest = reader.context_file(root / legacy, reader.MANIFEST)
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format_version": 1}))
    store = CheckpointStore(root, async_save=True, keep=lambda steps: set(sorted(steps)[-2:]))
    for step in (1, 2, 3):
        store.save(step, _device_state(step), _context(step))
    store.close()
    assert reader.list_steps(root) == [2, 3]
    assert sorted(p.name for p in root.iterdir()) == ["100", "2", "200", "3"]


@pytest.mark.parametrize("listed", ["../../../../../../etc/passwd", "/dev/zero", "weights/../../1/manifest"])
def test_a_commit_manifest_listing_a_path_outside_the_step_is_refused_unread(copy, listed):
    # Its self-crc32c is recomputed: the edit must be caught by what it lists, not by the checksum.
    step_dir = copy / "2"
    path = commit.commit_file(step_dir, 0)
    doc = json.loads(path.read_text())
    doc["files"][listed] = {"bytes": 1, "crc32c": "00000000"}
    doc["self_crc32c"] = commit._self_crc(doc)
    path.write_text(json.dumps(doc))
    [problem] = reader.verify(step_dir)
    assert f"commit/process_0.json: lists {listed!r}, which is not a file inside the step directory" in str(problem)


def test_a_link_in_the_step_directory_is_refused_without_reading_it(copy):
    step_dir = copy / "2"
    target = next(p for p in sorted((step_dir / "weights").rglob("*")) if p.is_file())
    target.unlink()
    target.symlink_to("/dev/zero")  # read to its end, it never ends
    problems = [str(p) for p in reader.verify(step_dir)]
    rel = target.relative_to(step_dir).as_posix()
    assert problems == [f"checkpoint {step_dir}: weights: {rel}: is not a regular file inside the step directory "
                        "(a link?)"]
