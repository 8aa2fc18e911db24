"""`python -m resilient_jax.data prepare|verify|batch` as a user runs them (subprocesses)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from resilient_jax.data import GlobalOrder, global_batch_ids, load_manifest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "resilient_jax.data", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    (root / "src").mkdir()
    for i in range(3):
        (root / "src" / f"doc{i}.md").write_text(f"# document {i}\n" + "some words here. " * 300)
    result = run_cli("prepare", "--src", str(root / "src"), "--out", str(root / "ds"),
                     "--shards", "4", "--seq-len", "32")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["version"] == load_manifest(root / "ds").version
    return root / "ds"


def test_verify_ok_then_names_the_damaged_shard(dataset_dir: Path, tmp_path: Path):
    result = run_cli("verify", str(dataset_dir))
    assert result.returncode == 0 and result.stdout.startswith("ok: 4 shards")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in dataset_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    shard = sorted(broken.glob("shard-*"))[2]
    shard.write_bytes(shard.read_bytes()[:-7])
    result = run_cli("verify", str(broken))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("error: truncated shard file") and shard.name in result.stderr


def test_batch_prints_the_hosts_slice_of_the_global_batch(dataset_dir: Path):
    result = run_cli("batch", "--dataset", str(dataset_dir), "--seed", "5", "--step", "3", "--global-batch", "12",
                     "--hosts", "3", "--host", "1", "--quarantine", "2,0@4")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    events = [{"shard": 2, "from_step": 0}, {"shard": 0, "from_step": 4}]
    order = GlobalOrder.for_manifest(load_manifest(dataset_dir), 5, 12, events)
    assert out["rows"] == [4, 8]
    assert out["sample_ids"] == global_batch_ids(order, 3)[4:8].tolist()
    assert 2 not in out["shard_ids"] and len(out["shard_ids"]) == 4
    result = run_cli("batch", "--dataset", str(dataset_dir), "--seed", "5", "--step", "3",
                     "--global-batch", "12", "--hosts", "5")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: global_batch 12 is not divisible by hosts 5;")
    assert len(result.stderr.splitlines()) == 1


def test_prepare_errors_are_one_line_with_exit_status_2(tmp_path: Path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("hello " * 100)
    result = run_cli("prepare", "--src", str(tmp_path / "src"), "--out", str(tmp_path / "ds"),
                     "--tokenizer", "wordpiece")
    assert result.returncode == 2
    assert result.stderr == "error: unknown tokenizer 'wordpiece'; known tokenizers: bytes, hf:PATH, sp:PATH\n"


def test_prepare_bad_sources_and_outs_are_one_line_with_exit_status_2(tmp_path: Path, capsys, monkeypatch):
    """In-process (main returns the exit status): no traceback, one `error:` line naming the file."""
    from resilient_jax.data import cli

    (tmp_path / "bad.jsonl").write_text('{"text": "\\ud83d"}\n')
    (tmp_path / "file").write_text("x")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("hello " * 100)
    cases = [
        (["--src", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "ds")], f"{tmp_path / 'bad.jsonl'}:1: "),
        (["--src", str(tmp_path / "src"), "--out", str(tmp_path / "file" / "ds")], f"{tmp_path / 'file'} is a file"),
    ]
    for args, names in cases:
        assert cli.main(["prepare", *args, "--shards", "1", "--seq-len", "8"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and names in err and err.count("\n") == 1, err
    # An OSError no check foresaw is still one line naming the path (a last resort, not a traceback).
    def unreadable(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "src" / "a.txt"))

    monkeypatch.setattr(cli, "prepare_dataset", unreadable)
    assert cli.main(["prepare", "--src", str(tmp_path / "src"), "--out", str(tmp_path / "ds")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'src' / 'a.txt'}: Permission denied\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "file", "src"]
