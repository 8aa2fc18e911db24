"""Config: YAML + --set overrides, strict types, unknown keys, canonical hash."""

from __future__ import annotations

import pytest

from resilient_jax.config import Config, ConfigError, config_hash, diff_keys, load_config

from conftest import TINY, run_cli


def test_yaml_and_overrides_resolve_with_types():
    cfg = load_config(TINY, ["train.steps=7", "optimizer.lr=1e-3", "parallel.reduction=native", "model.dropout=0"])
    assert cfg.train.steps == 7
    assert cfg.optimizer.lr == pytest.approx(1e-3) and isinstance(cfg.optimizer.lr, float)
    assert cfg.parallel.reduction == "native"
    assert cfg.model.dropout == 0.0 and isinstance(cfg.model.dropout, float)
    assert cfg.parallel.devices == 8  # from the YAML


@pytest.mark.parametrize(
    "override, names",
    [
        ("optimizer.lr=abc", "optimizer.lr"),
        ("model.nonexistent=1", "model.nonexistent"),
        ("train.steps=1.5", "train.steps"),
        ("parallel.reduction=fastest", "parallel.reduction"),
        ("nosection.key=1", "nosection"),
        ("train=3", "train"),
    ],
)
def test_bad_override_names_the_key(override, names):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    message = str(err.value)
    assert names in message and "\n" not in message


def test_missing_config_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(missing)


def test_hash_ignores_yaml_key_order(tmp_path):
    a = tmp_path / "a.yaml"
    b = tmp_path / "b.yaml"
    a.write_text("train:\n  steps: 5\n  seed: 3\nmodel:\n  d_model: 32\n  n_heads: 2\n")
    b.write_text("model:\n  n_heads: 2\n  d_model: 32\ntrain:\n  seed: 3\n  steps: 5\n")
    assert config_hash(load_config(a)) == config_hash(load_config(b))
    assert config_hash(load_config(a)) != config_hash(load_config(a, ["train.seed=4"]))


def test_hash_is_sha256_of_canonical_json():
    import hashlib
    import json

    cfg = Config()
    expected = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert cfg.hash == expected


def test_diff_keys_names_changed_keys():
    a = load_config(TINY)
    b = load_config(TINY, ["optimizer.lr=0.1", "train.steps=3"])
    assert diff_keys(a, b) == ["optimizer.lr", "train.steps"]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--set", "optimizer.lr=abc"], "optimizer.lr"),
        (["--set", "model.nonexistent=1"], "model.nonexistent"),
    ],
)
def test_cli_rejects_bad_config_in_one_line(args, expected):
    proc = run_cli("resilient_jax.train", "--config", str(TINY), *args, timeout=120)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], proc.stderr


def test_cli_missing_config_file(tmp_path):
    proc = run_cli("resilient_jax.train", "--config", str(tmp_path / "missing.yaml"), timeout=120)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "missing.yaml" in lines[0], proc.stderr
