"""Preparing datasets: determinism, the version, file checks, ensure_dataset, source walking."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from resilient_jax.data import (
    DatasetError,
    ensure_dataset,
    load_manifest,
    prepare_dataset,
    register_tokenizer,
    verify_dataset,
)
from resilient_jax.data import tokenizer as tokenizer_module
from resilient_jax.data.manifest import MANIFEST_NAME, manifest_from_content
from resilient_jax.data.sources import iter_documents

WORDS = ["alpha", "beta", "gamma", "delta", "jax", "grain", "shard", "step", "\n", "é"]


def write_texts(root: Path, files: int = 5, words: int = 1500, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    for i in range(files):
        path = root / f"dir{i % 2}" / f"file{i}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(" ".join(rng.choice(WORDS, words)), encoding="utf-8")
    (root / ".hidden.txt").write_text("never read")
    return root


def source_bytes(root: Path) -> bytes:
    """The text the dataset should hold: text files in sorted relative-path order."""
    paths = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.txt") if not p.name.startswith("."))
    return b"".join((root / p).read_bytes() for p in paths)


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return write_texts(tmp_path / "src")


def test_prepare_twice_gives_the_same_version_and_bytes(src: Path, tmp_path: Path):
    a = prepare_dataset(src, tmp_path / "a", shards=3, seq_len=16)
    b = prepare_dataset(src, tmp_path / "b", shards=3, seq_len=16)
    assert a.version == b.version
    for shard in range(3):
        assert a.shard_path(shard).read_bytes() == b.shard_path(shard).read_bytes()


def test_one_changed_byte_changes_the_version(src: Path, tmp_path: Path):
    before = prepare_dataset(src, tmp_path / "a", shards=3, seq_len=16).version
    target = src / "dir1" / "file3.txt"
    data = bytearray(target.read_bytes())
    data[100] = ord("Z") if data[100] != ord("Z") else ord("Y")
    target.write_bytes(bytes(data))
    assert prepare_dataset(src, tmp_path / "b", shards=3, seq_len=16).version != before


def test_manifest_records_the_layout_and_its_version_is_the_canonical_hash(src: Path, tmp_path: Path):
    manifest = prepare_dataset(src, tmp_path / "ds", shards=4, seq_len=16)
    doc = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    version = doc.pop("version")
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    assert version == manifest.version == hashlib.sha256(canonical).hexdigest()
    assert (doc["format_version"], doc["tokenizer"], doc["seq_len"]) == (2, "bytes", 16)
    assert (doc["token_dtype"], doc["has_weights"]) == ("<u1", False)
    for shard in doc["shards"]:
        path = tmp_path / "ds" / shard["file"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == shard["sha256"]
    text = source_bytes(src)
    assert manifest.num_records == len(text) // 17
    assert [s["records"] for s in doc["shards"]] == [
        (k + 1) * manifest.num_records // 4 - k * manifest.num_records // 4 for k in range(4)
    ]
    assert not list(tmp_path.glob(".ds.tmp-*"))  # the temporary build directory is gone


def test_verify_names_a_modified_a_truncated_and_a_missing_shard(src: Path, tmp_path: Path):
    manifest = prepare_dataset(src, tmp_path / "ds", shards=3, seq_len=16)
    verify_dataset(tmp_path / "ds")
    path = manifest.shard_path(1)
    original = path.read_bytes()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0xFF
    path.write_bytes(bytes(flipped))
    with pytest.raises(DatasetError, match=rf"modified shard file .*{path.name}"):
        verify_dataset(tmp_path / "ds")
    path.write_bytes(original[:-10])
    with pytest.raises(DatasetError, match=rf"truncated shard file .*{path.name}"):
        verify_dataset(tmp_path / "ds")
    path.unlink()
    with pytest.raises(DatasetError, match=rf"missing shard file .*{path.name}"):
        verify_dataset(tmp_path / "ds")


def test_ensure_dataset_builds_once_then_checks(src: Path, tmp_path: Path):
    built = ensure_dataset(tmp_path / "ds", src, shards=3, seq_len=16)
    again = ensure_dataset(tmp_path / "ds", src, shards=3, seq_len=16)
    assert again.version == built.version
    with pytest.raises(DatasetError, match=r"seq_len=16 but seq_len=32 was requested"):
        ensure_dataset(tmp_path / "ds", src, shards=3, seq_len=32)
    with pytest.raises(DatasetError, match=r"shards=3 but shards=4 was requested"):
        ensure_dataset(tmp_path / "ds", src, shards=4, seq_len=16)
    path = built.shard_path(2)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(DatasetError, match=rf"truncated shard file .*{path.name}"):
        ensure_dataset(tmp_path / "ds", src, shards=3, seq_len=16)


def test_bad_inputs_get_one_clear_error(src: Path, tmp_path: Path):
    with pytest.raises(DatasetError, match=r"missing manifest .*nowhere.*manifest.json"):
        load_manifest(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.txt").write_bytes(b"")
    with pytest.raises(DatasetError, match=r"source .*empty has no text"):
        prepare_dataset(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(DatasetError, match=r"unknown tokenizer 'sentencepiece'; known tokenizers: bytes"):
        prepare_dataset(src, tmp_path / "out", tokenizer="sentencepiece")
    with pytest.raises(DatasetError, match=r"fewer than one record"):
        prepare_dataset(src, tmp_path / "out", seq_len=10**7)
    with pytest.raises(DatasetError, match=r"fewer than --shards"):
        prepare_dataset(src, tmp_path / "out", seq_len=10_000, shards=8)
    manifest_path = prepare_dataset(src, tmp_path / "ds", shards=2, seq_len=16).root / "manifest.json"
    with pytest.raises(DatasetError, match=r"already exists and is not empty"):
        prepare_dataset(src, tmp_path / "ds")
    manifest_path.write_text(manifest_path.read_text().replace('"seq_len": 16', '"seq_len": 15'))
    with pytest.raises(DatasetError, match=r"manifest .* was edited"):
        load_manifest(tmp_path / "ds")
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_tokenizers_are_pluggable_by_name(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    class ShiftedBytes:
        name, vocab_size = "shifted", 300

        def encode(self, data: bytes) -> np.ndarray:
            return np.frombuffer(data, np.uint8).astype(np.int32) + 44

    monkeypatch.setattr(tokenizer_module, "_REGISTRY", dict(tokenizer_module._REGISTRY))
    register_tokenizer("shifted", ShiftedBytes)
    manifest = prepare_dataset(src, tmp_path / "ds", shards=2, seq_len=16, tokenizer="shifted")
    assert (manifest.tokenizer, manifest.vocab_size, manifest.token_dtype) == ("shifted", 300, "<u2")


def test_default_source_is_stdlib_py_without_tests_in_sorted_order():
    texts = list(iter_documents("default", max_bytes=200_000))
    paths = [t.where for t in texts]
    assert paths == sorted(paths) and all(p.endswith(".py") for p in paths)
    assert not any(part in {"test", "tests", "site-packages"} for p in paths for part in p.split("/"))
    assert sum(len(t.data) for t in texts) == 200_000


def test_a_concurrent_build_of_the_same_dataset_uses_the_winners_copy(src: Path, tmp_path: Path):
    from resilient_jax.data.prepare import _build_atomically

    winner = prepare_dataset(src, tmp_path / "ds", shards=3, seq_len=16)
    # A second process that started building before the first published: its rename fails.
    loser = _build_atomically(src, tmp_path / "ds", 3, 16, "bytes", None)
    assert loser.version == winner.version
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "src"]


def test_a_lone_surrogate_in_a_jsonl_text_names_the_file_and_line(tmp_path: Path):
    """JSON's "\\ud83d" escape without its low half decodes to a str that has no UTF-8 form."""
    src = tmp_path / "docs.jsonl"
    src.write_text('{"text": "fine"}\n{"text": "half an emoji \\ud83d here"}\n')
    with pytest.raises(DatasetError) as err:
        prepare_dataset(src, tmp_path / "out", shards=1, seq_len=4)
    assert str(err.value) == (f"{src}:2: field 'text' holds invalid Unicode (a lone surrogate '\\ud83d' at "
                              "character 14); fix or remove it")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]  # nothing half-built left behind


def test_out_under_an_existing_file_names_the_file_in_the_way(src: Path, tmp_path: Path):
    (tmp_path / "notes.txt").write_text("mine")
    for out in (tmp_path / "notes.txt" / "ds", tmp_path / "notes.txt" / "a" / "ds"):
        with pytest.raises(DatasetError) as err:
            prepare_dataset(src, out, shards=1, seq_len=16)
        assert str(err.value) == (f"cannot create dataset directory {out} ({tmp_path / 'notes.txt'} is a file, "
                                  "not a directory); choose another dataset path")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_out_dot_is_refused_naming_a_directory_that_would_work(src: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch):
    """The finished dataset is renamed over --out: the shell would be left in a removed directory."""
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    with pytest.raises(DatasetError, match=f"output directory {tmp_path / 'here'} is the current directory, .*; "
                                           f"choose a new --out, e.g. {tmp_path / 'here' / 'dataset'}$"):
        prepare_dataset(src, ".", shards=1, seq_len=16)
    assert list((tmp_path / "here").iterdir()) == [] and not list(tmp_path.glob(".*tmp*"))
    manifest = prepare_dataset(src, "dataset", shards=1, seq_len=16)  # relative: under the current directory
    assert manifest.root == tmp_path / "here" / "dataset"
    monkeypatch.chdir(src)  # not empty: refused, naming the resolved directory
    with pytest.raises(DatasetError, match=f"output directory {src} already exists and is not empty"):
        prepare_dataset(src, ".", shards=1, seq_len=16)


@pytest.mark.parametrize("name", ["../outside.bin", "/dev/zero", "..", ""])
def test_a_manifest_naming_a_shard_file_outside_its_directory_is_refused(src: Path, tmp_path: Path, name: str):
    # The version is a hash anyone can recompute: it seals the content, not where it points.
    root = tmp_path / "ds"
    prepare_dataset(src, root, shards=2, seq_len=16)
    doc = json.loads((root / MANIFEST_NAME).read_text())
    doc.pop("version")
    doc["shards"][1]["file"] = name
    doc["version"] = manifest_from_content(root, doc).version
    (root / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(DatasetError, match=f"manifest {root / MANIFEST_NAME} names shard file {name!r}, which is "
                                           "not a file of the dataset directory"):
        load_manifest(root)
