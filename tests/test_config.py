"""Config: YAML + --set overrides, strict types, unknown keys, canonical hash."""

from __future__ import annotations

import json

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


def test_the_control_channel_token_is_never_recorded():
    with_token = load_config(None, ["runtime.token=s3cret-value"])
    assert with_token.runtime.token == "s3cret-value"  # the controller still gets it
    assert "s3cret-value" not in json.dumps(with_token.to_dict())
    assert with_token.hash == load_config(None, []).hash


def test_a_token_recorded_by_an_older_checkpoint_is_not_carried_into_the_history():
    from resilient_jax.checkpoint.validate import ResumeDecision, _check_config

    now = load_config(None, [])
    older = now.to_dict()
    older["runtime"]["token"] = "old-s3cret"  # as configs recorded it before the token was left out
    decision = ResumeDecision(step=10)
    _check_config("ckpt", {"hash": "0" * 64, "config": older}, {"hash": now.hash, "config": now.to_dict()}, (),
                  decision)
    assert "old-s3cret" not in json.dumps(decision.history.config) and decision.config_changes == []


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


# -- ranges, paths, the generated reference -------------------------------------------------------


def _numeric_keys(cls=None, prefix=""):
    import dataclasses
    import typing

    cls = Config if cls is None else cls
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        args = typing.get_args(typ)
        if dataclasses.is_dataclass(typ):
            yield from _numeric_keys(typ, f"{prefix}{f.name}.")
        elif typing.get_origin(typ) is list and args and dataclasses.is_dataclass(args[0]):
            yield from _numeric_keys(args[0], f"{prefix}{f.name}[].")
        elif typ in (int, float):
            yield f"{prefix}{f.name}"


def test_every_numeric_key_has_a_range_and_the_defaults_are_in_it():
    from resilient_jax.config import RANGES, key_docs

    numeric = set(_numeric_keys())
    assert numeric - RANGES.keys() == set(), "numeric keys without a range"
    assert RANGES.keys() - numeric == set(), "ranges for keys that do not exist"
    defaults = {d.key: d.default for d in key_docs()}
    for key, bound in RANGES.items():
        assert bound.allows(defaults[key]), (key, defaults[key], str(bound))


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.steps=0", "train.steps"),
        ("train.log_every=0", "train.log_every"),
        ("train.seed=-1", "train.seed"),
        ("model.dropout=1", "model.dropout"),
        ("model.dropout=-0.1", "model.dropout"),
        ("model.d_model=0", "model.d_model"),
        ("optimizer.lr=0", "optimizer.lr"),
        ("optimizer.lr=-1e-3", "optimizer.lr"),
        ("optimizer.warmup_steps=-1", "optimizer.warmup_steps"),
        ("optimizer.b2=1", "optimizer.b2"),
        ("optimizer.min_lr_ratio=1.5", "optimizer.min_lr_ratio"),
        ("optimizer.clip_norm=-1", "optimizer.clip_norm"),
        ("parallel.virtual_shards=0", "parallel.virtual_shards"),
        ("parallel.data=0", "parallel.data"),
        ("parallel.data=-2", "parallel.data"),
        ("parallel.devices=-1", "parallel.devices"),
        ("data.prefetch=0", "data.prefetch"),
        ("data.global_batch=0", "data.global_batch"),
        ("data.quarantine=[{shard: -1, from_step: 0}]", "data.quarantine[0].shard"),
        ("checkpoint.every_steps=-1", "checkpoint.every_steps"),
        ("checkpoint.every_seconds=-5", "checkpoint.every_seconds"),
        ("checkpoint.keep_last=-1", "checkpoint.keep_last"),
        ("topology.regions=[{name: a, hosts: 0}]", "topology.regions[0].hosts"),
        ("runtime.port=70000", "runtime.port"),
        ("runtime.straggler_factor=1", "runtime.straggler_factor"),
        ("runtime.heartbeat_seconds=0", "runtime.heartbeat_seconds"),
        ("runtime.min_hosts=0", "runtime.min_hosts"),
        ("runtime.assignment_hysteresis=1", "runtime.assignment_hysteresis"),
        ("runtime.assignment_window=1", "runtime.assignment_window"),
        ("runtime.max_share=0.5", "runtime.max_share"),
    ],
)
def test_out_of_range_value_names_the_key_and_the_range(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    message = str(err.value)
    assert message.startswith(f"config key {key}: must be ") and "\n" not in message, message


@pytest.mark.parametrize("override", ["optimizer.lr=nan", "optimizer.lr=.nan", "optimizer.lr=inf",
                                      "optimizer.clip_norm=.inf", "checkpoint.every_seconds=1e999",
                                      "model.dropout=-.inf", "runtime.max_share=NaN"])
def test_a_non_finite_float_names_the_key(override):
    """NaN compares false to every bound and inf passes a lower one: refused before any range."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    message = str(err.value)
    assert message.startswith(f"config key {key}: must be a finite number, got ") and "\n" not in message, message


def test_a_non_finite_float_in_the_yaml_file_names_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer:\n  lr: .nan\n")
    with pytest.raises(ConfigError, match=r"^config key optimizer.lr: must be a finite number, got nan$"):
        load_config(path)


def test_a_text_key_set_on_the_command_line_keeps_the_text_as_typed(tmp_path, monkeypatch):
    """YAML reads 010 as 8, 1.10 as 1.1, 1_000 as 1000 and no as false; a text key takes what was typed."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(TINY, ["run.dir=010", "checkpoint.dir=1.10", "data.dataset=1_000", "data.text_field=no",
                             "runtime.token=0x1F", "runtime.compile_cache=off", 'runtime.bind="127.0.0.2"'])
    paths = (cfg.run.dir, cfg.checkpoint.dir, cfg.data.dataset)
    assert paths == tuple(str(tmp_path / n) for n in ("010", "1.10", "1_000"))
    assert (cfg.data.text_field, cfg.runtime.token, cfg.runtime.compile_cache) == ("no", "0x1F", "off")
    assert cfg.runtime.bind == "127.0.0.2"  # YAML quoting still works
    assert load_config(TINY, ["train.steps=010"]).train.steps == 8  # numeric keys are YAML as before


@pytest.mark.parametrize("section, line, key", [
    ("run", "dir: 010", "run.dir"),
    ("data", "text_field: no", "data.text_field"),
    ("runtime", "token: 1.10", "runtime.token"),
    ("topology", "regions: [{name: 1, hosts: 2}]", "topology.regions[0].name"),
])
def test_a_yaml_file_value_that_is_not_text_for_a_text_key_says_to_quote_it(tmp_path, section, line, key):
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {line}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(f"config key {key}: expected text, got ") and "in quotes" in message, message
    assert "\n" not in message


def test_a_section_with_every_key_commented_out_is_the_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  # d_model: 64\ntrain:\n  steps: 3\n")
    without = tmp_path / "without.yaml"
    without.write_text("train:\n  steps: 3\n")
    assert load_config(path).model == load_config(without).model
    cfg = load_config(path, ["model.d_model=32"])
    assert cfg.model.d_model == 32 and cfg.train.steps == 3


def test_boundary_values_are_accepted():
    cfg = load_config(TINY, ["train.steps=1", "model.dropout=0", "optimizer.warmup_steps=0", "parallel.data=-1",
                             "checkpoint.every_steps=0", "optimizer.min_lr_ratio=1"])
    assert cfg.train.steps == 1 and cfg.model.dropout == 0.0


def test_relative_paths_resolve_against_the_current_directory_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(TINY, ["checkpoint.dir=ck", "data.dataset=data/ds", "data.src=texts"])
    assert cfg.run.dir == str(tmp_path / "runs" / "tiny")  # tiny.yaml's relative run.dir
    assert cfg.checkpoint.dir == str(tmp_path / "ck")
    assert cfg.data.dataset == str(tmp_path / "data" / "ds") and cfg.data.src == str(tmp_path / "texts")
    # Empty and the named default keep their meaning; an absolute path stays as it is.
    default = load_config(TINY, ["run.dir=/abs/run"])
    assert default.checkpoint.dir == "" and default.data.dataset == "" and default.data.src == "default"
    assert default.run.dir == "/abs/run"
    assert load_config(TINY, ["run.dir=a/../b/./c"]).run.dir == str(tmp_path / "b" / "c")


def test_a_path_named_default_is_a_relative_path_except_for_data_src(tmp_path, monkeypatch):
    """"default" means the stdlib sources only for data.src; anywhere else it is a directory name,
    and a relative run.dir / checkpoint.dir would fail at the first checkpoint save."""
    monkeypatch.chdir(tmp_path)
    keys = ("run.dir", "checkpoint.dir", "data.dataset", "eval.dataset")
    cfg = load_config(TINY, [f"{k}=default" for k in keys] + ["data.src=default", "eval.every_steps=5"])
    assert [cfg.run.dir, cfg.checkpoint.dir, cfg.data.dataset, cfg.eval.dataset] == [str(tmp_path / "default")] * 4
    assert cfg.data.src == "default"


def test_a_tokenizer_files_path_resolves_against_the_current_directory_once(tmp_path, monkeypatch):
    """So a resume from another directory reads the same tokenizer file; names stay names."""
    monkeypatch.chdir(tmp_path)
    assert load_config(TINY, ["data.tokenizer=hf:tok/t.json"]).data.tokenizer == f"hf:{tmp_path / 'tok' / 't.json'}"
    assert load_config(TINY, ["data.tokenizer=sp:/abs/m.model"]).data.tokenizer == "sp:/abs/m.model"
    for name in ("bytes", "hf:", "mine:tok.json"):  # a name, an empty path (refused by the loader), a registered name
        assert load_config(TINY, [f"data.tokenizer={name}"]).data.tokenizer == name


def test_config_dir_instead_of_a_file_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a directory"):
        load_config(tmp_path)


def test_resume_from_another_directory_is_not_refused_for_its_paths(tmp_path, monkeypatch):
    """The same relative config loaded in two directories differs only in path keys: operational,
    recorded as a change, never refused (the dataset version is checked on its own)."""
    from resilient_jax.checkpoint.validate import _check_config, ResumeDecision

    monkeypatch.chdir(tmp_path)
    here = load_config(TINY, ["data.dataset=data/ds", "checkpoint.dir=ck"])
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    there = load_config(TINY, ["data.dataset=data/ds", "checkpoint.dir=ck", "data.build_if_missing=true"])
    assert here.hash != there.hash
    decision = ResumeDecision(step=10)
    saved = {"hash": here.hash, "config": here.to_dict()}
    _check_config("ckpt", saved, {"hash": there.hash, "config": there.to_dict()}, (), decision)
    assert decision.config_changes == ["checkpoint.dir", "data.build_if_missing", "data.dataset", "run.dir"]
    assert decision.history.config[-1]["allowed"] == []  # none of them needed an allowance
    # ... while a trajectory key is still refused.
    from resilient_jax.checkpoint.reader import CheckpointError

    lr = load_config(TINY, ["optimizer.lr=1e-3"])
    with pytest.raises(CheckpointError, match="optimizer.lr"):
        _check_config("ckpt", saved, {"hash": lr.hash, "config": lr.to_dict()}, (), ResumeDecision(step=10))


def test_readme_config_table_is_the_generated_one():
    """README.md holds `python -m resilient_jax.config --markdown-table` verbatim: every key, its
    default, allowed values and meaning, so README and code cannot drift."""
    from resilient_jax.config import key_docs, markdown_table

    from conftest import REPO

    readme = (REPO / "README.md").read_text()
    table = markdown_table()
    assert table in readme, "README's config table is stale: paste `python -m resilient_jax.config --markdown-table`"
    keys = [d.key for d in key_docs()]
    assert all(f"| `{k}` |" in table for k in keys) and len(table.splitlines()) == len(keys) + 2
    assert all(d.meaning for d in key_docs()), [d.key for d in key_docs() if not d.meaning]


def test_resume_path_resolves_against_the_current_directory(tmp_path, monkeypatch):
    from resilient_jax.train import build_config, parse_args

    monkeypatch.chdir(tmp_path)
    for given, expected in [("runs/x/checkpoints/10", str(tmp_path / "runs/x/checkpoints/10")),
                            ("latest", "latest"), ("10", "10")]:
        args = parse_args(["--config", str(TINY), "--resume", given])
        build_config(args)
        assert args.resume == expected


def test_the_readmes_data_commands_write_where_git_ignores():
    import re
    import subprocess

    from conftest import REPO

    readme = (REPO / "README.md").read_text()
    outs = re.findall(r"python -m resilient_jax\.data prepare .*--out (\S+)", readme)
    assert outs, "the README's prepare command moved"
    for out in outs:
        probe = f"{out}/manifest.json"
        assert subprocess.run(["git", "check-ignore", "-q", probe], cwd=REPO).returncode == 0, probe


def test_a_coordination_heartbeat_below_the_liveness_verdict_is_refused_naming_both_keys():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["runtime.dead_after_seconds=6.5", "runtime.coordination_heartbeat_seconds=5"])
    message = str(err.value)
    assert "runtime.coordination_heartbeat_seconds" in message and "runtime.dead_after_seconds (6.5)" in message
    assert "at least 7" in message and "\n" not in message
    cfg = load_config(TINY, ["runtime.dead_after_seconds=6.5", "runtime.coordination_heartbeat_seconds=7"])
    assert cfg.runtime.coordination_heartbeat_seconds == 7


@pytest.mark.parametrize("override, key, expected", [
    ("runtime.precompile_next_worlds=on", "precompile_next_worlds", "on"),
    ("runtime.precompile_next_worlds=off", "precompile_next_worlds", "off"),
    ("runtime.tls=off", "tls", "off"),
])
def test_a_bare_on_or_off_is_the_choice_not_a_yaml_boolean(override, key, expected):
    assert getattr(load_config(TINY, [override]).runtime, key) == expected
