"""Seven-field checkpoints: policy, validation rules, the framework-free reader, the CLI, resharding.

The in-process run (module fixture) trains tiny for 4 steps with a checkpoint every 2; the reader's
arrays must be bitwise the trainer's live params (same fingerprint), and an orbax restore onto a
4-device mesh must be bitwise too.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from resilient_jax.checkpoint import reader
from resilient_jax.checkpoint.policy import SavePolicy
from resilient_jax.checkpoint.reader import FIELDS, CheckpointError, json_sha256
from resilient_jax.checkpoint.validate import check_resume
from resilient_jax.config import ConfigError
from resilient_jax.fingerprinting import params_fingerprint

from conftest import REPO, run_cli, tiny_config


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- SavePolicy -------------------------------------------------------------------------------------------


def test_policy_every_steps_and_every_seconds():
    clock = FakeClock()
    policy = SavePolicy(every_steps=10, every_seconds=60, clock=clock)
    policy.start()
    assert [s for s in range(1, 31) if policy.due(s)] == [10, 20, 30]
    clock.now += 59
    assert not policy.due(31)
    clock.now += 1
    assert policy.due(31)  # 60 s since the start
    policy.saved(31)
    assert not policy.due(32)
    clock.now += 60
    assert policy.due(33)


def test_policy_time_only_and_never():
    clock = FakeClock()
    timed = SavePolicy(every_seconds=5, clock=clock)
    timed.start()
    assert not timed.due(10)
    clock.now += 5
    assert timed.due(11)
    assert not any(SavePolicy().due(s) for s in range(1, 100))  # only final/preemption saves


def test_policy_retention_keeps_last_k_plus_every_m():
    assert SavePolicy(keep_last=2, keep_every=100).keep([50, 100, 150, 200, 250, 300]) == {100, 200, 250, 300}
    assert SavePolicy(keep_last=0).keep([1, 2, 3]) == {1, 2, 3}
    assert SavePolicy(keep_last=1).keep([]) == set()


def test_policy_rejects_negative_values():
    with pytest.raises(ConfigError, match="checkpoint.every_steps"):
        SavePolicy(every_steps=-1)


# -- validation rules (pure dicts) ---------------------------------------------------------------------------


def _context(**changes):
    from resilient_jax.checkpoint.reader import json_sha256

    config = {"train": {"seed": 0, "steps": 20}, "parallel": {"devices": 8}, "run": {"progress": "auto"},
              "optimizer": {"lr": 0.1}}
    for dotted, value in changes.pop("config", {}).items():
        section, key = dotted.split(".")
        config[section][key] = value
    ctx = {
        "rng": {"seed": 0, "impl": "threefry2x32", "base_key_data": [0, 0], "next_step": 10},
        "data": {"step": 10, "global_offset": 480, "epoch": 0, "dataset_version": "d1", "quarantine": []},
        "config": {"hash": json_sha256(config), "config": config, "history": []},
        "topology": {"generation": 0, "process_count": 1, "devices_per_host": 8, "hosts": [{"region": "local"}],
                     "mesh": {"axis_names": ["data"], "shape": [8]}, "history": []},
        "provenance": {"commit": "a" * 40, "dirty": False, "version": "0.1.0", "history": []},
    }
    for field, value in changes.items():
        ctx[field] = {**ctx[field], **value}
    return ctx


def test_resume_rules_accept_identical_context():
    decision = check_resume("ck", _context(), _context())
    assert decision.step == 10 and not decision.warnings
    assert not (decision.config_changes or decision.topology_changed or decision.commit_changed)


def test_resume_refuses_another_dataset_version():
    with pytest.raises(CheckpointError, match="data: dataset version d1 differs"):
        check_resume("ck", _context(), _context(data={"dataset_version": "d2"}))


def test_resume_refuses_config_change_unless_every_key_is_named():
    saved, current = _context(), _context(config={"train.steps": 40, "optimizer.lr": 0.5})
    with pytest.raises(CheckpointError, match=r"config: .* in optimizer.lr, train.steps; .*"
                                              r"--allow-config-change optimizer.lr,train.steps"):
        check_resume("ck", saved, current)
    with pytest.raises(CheckpointError, match="in train.steps"):
        check_resume("ck", saved, current, ["optimizer.lr"])
    decision = check_resume("ck", saved, current, ["optimizer.lr", "train.steps"])
    assert decision.config_changes == ["optimizer.lr", "train.steps"]
    record = decision.history.config[-1]
    assert record["from"]["train.steps"] == 20 and record["to"]["train.steps"] == 40


def test_operational_config_keys_are_recorded_without_allowance():
    decision = check_resume("ck", _context(), _context(config={"run.progress": "quiet"}))
    assert decision.config_changes == ["run.progress"] and decision.history.config[-1]["allowed"] == []


def test_a_tokenizer_file_found_at_another_path_resumes_without_allowance():
    # A checkpoint of a config that named its tokenizer file relatively; the config now holds the
    # path made absolute. Another tokenizer is refused by the dataset's recorded sha256 instead.
    saved = _context()
    saved["config"]["config"]["data"] = {"tokenizer": "hf:tok.json"}
    current = _context()
    current["config"]["config"]["data"] = {"tokenizer": "hf:/home/me/run/tok.json"}
    for ctx in (saved, current):
        ctx["config"]["hash"] = json_sha256(ctx["config"]["config"])
    decision = check_resume("ck", saved, current)
    assert decision.config_changes == ["data.tokenizer"] and decision.history.config[-1]["allowed"] == []


def test_layout_keys_are_a_topology_change_not_a_config_change():
    decision = check_resume("ck", _context(), _context(config={"parallel.devices": 4}))
    assert decision.config_changes == ["parallel.devices"] and decision.history.config[-1]["allowed"] == []


def test_resume_refuses_another_prng_for_the_same_seed():
    with pytest.raises(CheckpointError, match="rng: impl"):
        check_resume("ck", _context(), _context(rng={"impl": "rbg"}))


def test_topology_change_and_commit_change_are_recorded():
    current = _context(topology={"devices_per_host": 4, "mesh": {"axis_names": ["data"], "shape": [4]}},
                       provenance={"commit": "b" * 40})
    decision = check_resume("ck", _context(), current)
    assert decision.topology_changed and decision.commit_changed
    assert decision.history.topology[-1]["to"]["devices_per_host"] == 4
    assert decision.history.provenance[-1]["from"]["commit"] == "a" * 40
    assert "aaaaaaaaaaaa" in decision.warnings[0] and "bbbbbbbbbbbb" in decision.warnings[0]
    assert [e["event"] for e in decision.events("ck")] == ["resume", "topology_change", "commit_change"]


# -- a real checkpoint --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from resilient_jax.trainer import Trainer

    run_dir = tmp_path_factory.mktemp("ckpt") / "run"
    cfg = tiny_config(run_dir, "train.steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=0")
    summary = Trainer(cfg).run()
    return run_dir, cfg, summary


def _as_live_tree(tree):
    """Reader trees key everything by string; the live params key list indices by int."""
    if isinstance(tree, dict):
        return {int(k) if k.isdigit() else k: _as_live_tree(v) for k, v in tree.items()}
    return tree


def test_trainer_writes_seven_fields_and_reader_matches_live_params_bitwise(trained):
    run_dir, cfg, summary = trained
    root = run_dir / "checkpoints"
    assert reader.list_steps(root) == [2, 4] and summary["checkpoint"]["saves"] == [2, 4]
    ckpt = reader.load(root)  # newest step; verifies every file's crc32c
    assert ckpt.step == 4 and ckpt.manifest["fields"] == list(FIELDS)
    assert params_fingerprint(_as_live_tree(ckpt.weights)) == summary["params_fingerprint"]
    assert ckpt.data == summary["data_position"]
    assert ckpt.rng["seed"] == cfg.train.seed and ckpt.rng["next_step"] == 4
    assert ckpt.config["hash"] == cfg.hash and ckpt.config["config"] == json.loads(json.dumps(cfg.to_dict()))
    assert ckpt.topology["mesh"] == {"axis_names": ["data", "fsdp", "tensor"], "shape": [8, 1, 1]}
    assert ckpt.topology["hosts"] == [{"process": 0, "region": "local", "devices": list(range(8))}]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert ckpt.provenance["commit"] == head and ckpt.provenance["source"] == "git"
    flat = reader.flatten(ckpt.optimizer)
    assert int(flat["1.0.count"]) == 4 and flat["1.0.mu.embed"].shape == ckpt.weights["embed"].shape


def test_restore_onto_a_smaller_mesh_is_bitwise(trained):
    from resilient_jax import mesh as mesh_lib
    from resilient_jax import state as state_lib
    from resilient_jax.checkpoint.store import CheckpointStore
    from resilient_jax.optimizer import build_optimizer

    run_dir, cfg, summary = trained
    mesh = mesh_lib.build_mesh(cfg.parallel, jax.devices()[:4])
    model_def = state_lib.make_model_def(cfg.model)
    abstract = state_lib.abstract_state(model_def, build_optimizer(cfg.optimizer, cfg.train.steps), mesh)
    state = CheckpointStore.restore_arrays(run_dir / "checkpoints" / "4", abstract)
    assert params_fingerprint(state.params) == summary["params_fingerprint"]
    leaf = jax.tree.leaves(state.params)[0]
    assert leaf.sharding.mesh.shape["data"] == 4
    opt = reader.flatten(reader.load(run_dir / "checkpoints" / "4").optimizer)
    assert np.array_equal(np.asarray(state.opt_state[1][0].mu["embed"]), opt["1.0.mu.embed"])


def test_reader_and_cli_import_no_framework():
    code = ("import sys, resilient_jax.checkpoint.reader, resilient_jax.checkpoint.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in {'jax', 'jaxlib', 'flax', 'optax', 'orbax'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


def test_inspect_and_verify_cli(trained):
    run_dir, cfg, summary = trained
    proc = run_cli("resilient_jax.checkpoint", "inspect", str(run_dir / "checkpoints"), check=True)
    for word in (*FIELDS, "step 4", "64x4x16", "float32", "mesh data=8 fsdp=1 tensor=1", "blocks.0.attn.wq",
                 "1.0.nu.embed", summary["dataset_version"][:12], cfg.hash[:12]):
        assert word in proc.stdout, word
    info = json.loads(run_cli("resilient_jax.checkpoint", "inspect", "--json", str(run_dir / "checkpoints" / "2"),
                              check=True).stdout)
    assert info["step"] == 2 and [f["field"] for f in info["fields"]] == list(FIELDS)
    proc = run_cli("resilient_jax.checkpoint", "verify", str(run_dir / "checkpoints" / "2"), check=True)
    assert proc.stdout.startswith("ok:") and "all crc32c match, restore dry-run ok" in proc.stdout
    missing = run_cli("resilient_jax.checkpoint", "verify", str(run_dir / "nowhere"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "does not exist" in missing.stderr


def test_second_run_resumes_and_has_nothing_left_to_do(trained):
    from resilient_jax.trainer import Trainer

    run_dir, cfg, summary = trained
    again = Trainer(cfg).run()
    assert again["resumed_from"][-1]["step"] == 4 and again["final_step"] == 4
    assert again["params_fingerprint"] == summary["params_fingerprint"]
    assert reader.list_steps(run_dir / "checkpoints") == [2, 4]
