"""End to end: the README's main job trains tiny to the end; runs are reproducible by seed."""

from __future__ import annotations

import json

import jax
import numpy as np

from resilient_jax import fingerprint
from resilient_jax.trainer import Trainer

from conftest import TINY, read_summary, run_cli, tiny_config

SUMMARY_KEYS = {"final_step", "final_loss", "first_loss", "wall_seconds", "tokens_per_second", "config_hash",
                "params_fingerprint", "dataset_version"}


def test_main_job_trains_tiny_to_the_end(tmp_path, default_dataset):
    run_dir = tmp_path / "tiny"
    proc = run_cli("resilient_jax.train", "--config", str(TINY), "--set", f"run.dir={run_dir}", check=True)
    summary = read_summary(run_dir)
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["final_step"] == 200
    assert summary["final_loss"] <= 0.7 * summary["first_loss"], summary
    assert summary["mesh"]["data"] == 8  # parallel.devices: 8 emulated CPU devices
    assert summary["dataset_version"] == default_dataset.version
    config = json.loads((run_dir / "config.json").read_text())
    assert config["config_hash"] == summary["config_hash"] and config["config_hash"] in proc.stdout
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in steps] == [1] + list(range(10, 201, 10))  # step k: k steps completed
    assert {"loss", "loss_last", "lr", "grad_norm", "step_seconds", "tokens_per_s", "time", "mfu"} <= steps[-1].keys()
    assert steps[0]["loss"] == summary["first_loss"] and steps[-1]["loss_last"] == summary["final_loss"]
    assert summary["mfu"] is None and steps[-1]["mfu"] is None  # a CPU: no peak known, none set
    assert any(p.name.startswith("events.out.tfevents") for p in (run_dir / "tensorboard").iterdir())


def test_same_config_same_fingerprint_other_seed_other(tmp_path, default_dataset):
    runs = {
        name: Trainer(tiny_config(tmp_path / name, "train.steps=12", *extra), devices=jax.devices()[:4]).run()
        for name, extra in [("a", []), ("b", []), ("seed1", ["train.seed=1"])]
    }
    assert runs["a"]["params_fingerprint"] == runs["b"]["params_fingerprint"]
    assert runs["a"]["params_fingerprint"] != runs["seed1"]["params_fingerprint"]


def test_fingerprint_is_sha256_of_leaf_bytes_in_sorted_path_order():
    import hashlib

    tree = {"b": np.arange(3, dtype=np.float32), "a": {"z": np.ones(2, np.int32), "c": np.zeros(1)}}
    expected = hashlib.sha256()
    for leaf in (tree["a"]["c"], tree["a"]["z"], tree["b"]):  # ['a']['c'] < ['a']['z'] < ['b']
        expected.update(leaf.tobytes())
    assert fingerprint(tree) == expected.hexdigest()
    tree["b"][0] = 1.0
    assert fingerprint(tree) != expected.hexdigest()
