"""A config changed between a checkpoint and its resume: what takes effect, what is refused, and that a
refusal leaves the run as it was. In-process runs of tiny on 4 devices, 6 steps, checkpoints at 3 and 6."""

from __future__ import annotations

import json
import shutil

import jax
import pytest

from resilient_jax.checkpoint.reader import CheckpointError
from resilient_jax.trainer import Trainer

from conftest import tiny_config

COMMON = ("train.steps=6", "checkpoint.every_steps=3", "checkpoint.keep_last=0")
QUARANTINE = "data.quarantine=[{shard: 1, from_step: 4}]"


def run(run_dir, *overrides, **kw) -> dict:
    return Trainer(tiny_config(run_dir, *COMMON, *overrides), devices=jax.devices()[:4], **kw).run()


@pytest.fixture(scope="module")
def base(tmp_path_factory, default_dataset):
    run_dir = tmp_path_factory.mktemp("base") / "run"
    run(run_dir)
    return run_dir


def copy_of(base, tmp_path):
    shutil.copytree(base, tmp_path / "run")
    return tmp_path / "run"


def test_a_quarantine_added_on_resume_leaves_the_shard_out_as_a_run_that_had_it_from_the_start(base, tmp_path):
    # It was accepted with --allow-config-change and then ignored: the resumed run trained on the
    # shard the user had just marked bad, and ended on the fingerprint of the run without it.
    from_start = run(tmp_path / "from-start", QUARANTINE)
    resumed = run(copy_of(base, tmp_path), QUARANTINE, resume="3", allow_config_change=["data.quarantine"])
    assert resumed["params_fingerprint"] == from_start["params_fingerprint"]
    assert resumed["params_fingerprint"] != json.loads((base / "summary.json").read_text())["params_fingerprint"]
    assert [q["shard"] for q in resumed["data_position"]["quarantine"]] == [1]


def run_files(run_dir) -> dict:
    """What a refused resume must leave as it was."""
    return {name: (run_dir / name).read_bytes() for name in ("config.json", "metrics.jsonl", "run_history.json")} | {
        "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").iterdir())}


def test_a_quarantine_from_before_the_checkpoint_is_refused_before_anything_changes(base, tmp_path):
    # Refused only once the data loader opened, it had already superseded checkpoint 6, rewound
    # metrics.jsonl and recorded a resume: the next plain rerun resumed from 3.
    run_dir = copy_of(base, tmp_path)
    before = run_files(run_dir)
    with pytest.raises(CheckpointError) as err:
        run(run_dir, "data.quarantine=[{shard: 1, from_step: 2}]", resume="3")  # no allowance asked first
    message = str(err.value)
    assert "\n" not in message and "data.quarantine: shard 1 from step 2 is before this checkpoint's step 3" in message
    assert run_files(run_dir) == before


@pytest.mark.parametrize("override, key", [
    ("data.global_batch=96", "data.global_batch is 48 in the checkpoint and 96 now, and cannot change on resume"),
    ("model.d_model=32", "model.d_model is 64 in the checkpoint and 32 now, and cannot change on resume"),
    ("model.scan_layers=true", "model.scan_layers is False in the checkpoint and True now, and cannot change"),
])
def test_a_change_no_checkpoint_can_continue_is_refused_up_front_even_when_allowed(base, tmp_path, override, key):
    # global_batch: the refusal told you to pass --allow-config-change, which then failed in the data
    # loader after recording a config change; d_model: orbax's "strict=False" advice, then an offer of
    # older checkpoints, which have the same shapes.
    run_dir = copy_of(base, tmp_path)
    config_before = (run_dir / "config.json").read_text()
    with pytest.raises(CheckpointError) as err:
        run(run_dir, override, allow_config_change=[override.split("=")[0]])
    message = str(err.value)
    assert key in message and "start a new run" in message and "--resume" not in message, message
    assert (run_dir / "config.json").read_text() == config_before  # the refused config was not recorded


def test_another_tensor_size_needs_an_allowance(base, tmp_path):
    # The bits are the same across (data, fsdp) layouts at one tensor size only; a tensor change
    # resumed silently onto another trajectory.
    with pytest.raises(CheckpointError, match=r"in parallel\.tensor; to continue anyway, pass --allow-config-change "
                                              r"parallel\.tensor"):
        run(copy_of(base, tmp_path), "parallel.tensor=2", resume="3")


def test_checkpoints_off_over_a_run_with_checkpoints_is_refused(base, tmp_path):
    # It retrained from step 0 and rewrote the run's history and metrics.
    run_dir = copy_of(base, tmp_path)
    history = (run_dir / "run_history.json").read_text()
    with pytest.raises(CheckpointError, match="checkpoint.enabled is false, but this directory holds the run's "
                                              "checkpoints \\(newest step 6\\)"):
        run(run_dir, "checkpoint.enabled=false")
    assert (run_dir / "run_history.json").read_text() == history


def test_weights_of_another_shape_are_named_before_orbax_is_asked():
    from resilient_jax.checkpoint.validate import check_shapes

    saved = {"arrays": {"weights": {"embed": {"shape": [256, 64]}, "blocks.0.wq": {"shape": [64, 4, 16]}}}}
    model = {"embed": {"shape": [256, 32]}, "blocks.0.wq": {"shape": [32, 4, 8]}}
    with pytest.raises(CheckpointError, match=r"2 of its weights have other shapes than this run's model \(e\.g\. "
                                              r"blocks\.0\.wq: \(64, 4, 16\) in the checkpoint, \(32, 4, 8\) now\)"):
        check_shapes("ckpt/3", saved, model)
    with pytest.raises(CheckpointError, match=r"another model's \(the model's head not in the checkpoint; the "
                                              r"checkpoint's blocks\.0\.wq not in the model\)"):
        check_shapes("ckpt/3", saved, {"embed": {"shape": [256, 64]}, "head": {"shape": [64, 256]}})
    check_shapes("ckpt/3", saved, {k: {"shape": v["shape"]} for k, v in saved["arrays"]["weights"].items()})


def test_fewer_steps_than_the_checkpoint_has_trained_is_refused(base, tmp_path):
    # It ended "done: step 6" with final_step 6, past the train.steps it was given. Refused before the
    # allowance is asked for (which would only lead to this refusal).
    for allow in ([], ["train.steps"]):
        with pytest.raises(CheckpointError, match=r"train.steps 4 is before this checkpoint's step 6, which trained "
                                                  r"past it; resume a checkpoint at or before step 4 \(--resume STEP\)"):
            run(copy_of(base, tmp_path / str(len(allow))), "train.steps=4", allow_config_change=allow)


def test_inspecting_a_run_directory_points_at_its_checkpoints(base):
    from resilient_jax.checkpoint import reader

    with pytest.raises(CheckpointError, match=rf"a run directory\? its checkpoints are in {base / 'checkpoints'}"):
        reader.resolve(base)
