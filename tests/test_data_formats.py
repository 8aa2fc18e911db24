"""Sources in the formats users have (jsonl, parquet, HF datasets directories), tokenizer files
(tokenizers' tokenizer.json, sentencepiece), the compact record layout, and their bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from resilient_jax.data import DatasetError, HostBatchLoader, ensure_dataset, load_manifest, prepare_dataset
from resilient_jax.data.records import RecordLayout

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

WORDS = ["alpha", "beta", "gamma", "delta", "jax", "grain", "shard", "step", "é", "naïve", "\n"]


def make_texts(n: int = 120, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(20, 80)))) for _ in range(n)]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": i, field: t}) + "\n")
    return path


def write_parquet(path: Path, texts: list[str], field: str = "text", row_group_size: int = 32) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": list(range(len(texts))), field: texts}), path, row_group_size=row_group_size)
    return path


def write_hf_dir(root: Path, texts: list[str], files: int = 2) -> Path:
    """The layout `datasets.Dataset.save_to_disk` writes: Arrow stream files listed in state.json."""
    root.mkdir(parents=True)
    names, per = [], -(-len(texts) // files)
    for k in range(files):
        name = f"data-{k:05d}-of-{files:05d}.arrow"
        table = pa.table({"text": texts[k * per:(k + 1) * per]})
        with pa.OSFile(str(root / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=16):
                writer.write_batch(batch)
        names.append({"filename": name})
    (root / "state.json").write_text(json.dumps({"_data_files": names, "_fingerprint": "x", "_split": None}))
    (root / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    return root


def test_jsonl_parquet_hf_and_text_files_of_the_same_texts_give_the_same_version(tmp_path: Path):
    texts = make_texts()
    jsonl_dir = tmp_path / "jsonl"
    write_jsonl(jsonl_dir / "a.jsonl", texts[:50])
    write_jsonl(jsonl_dir / "b.jsonl", texts[50:])
    text_dir = tmp_path / "txt"
    text_dir.mkdir()
    for i, t in enumerate(texts):
        (text_dir / f"doc{i:04d}.txt").write_text(t, encoding="utf-8")
    sources = {
        "jsonl file": write_jsonl(tmp_path / "one.jsonl", texts),
        "jsonl dir": jsonl_dir,
        "parquet file": write_parquet(tmp_path / "one.parquet", texts),
        "parquet dir": write_parquet(tmp_path / "pq" / "part-0.parquet", texts, row_group_size=7).parent,
        "hf dir": write_hf_dir(tmp_path / "hf", texts),
        "text dir": text_dir,
    }
    versions = {kind: prepare_dataset(src, tmp_path / f"ds-{i}", shards=3, seq_len=16).version
                for i, (kind, src) in enumerate(sources.items())}
    assert len(set(versions.values())) == 1, versions
    # ... and the dataset holds exactly those texts' bytes, in order.
    manifest = load_manifest(tmp_path / "ds-0")
    with HostBatchLoader(manifest, seed=0, global_batch=manifest.num_records) as loader:
        batch = next(loader)
    stream = "".join(texts).encode()
    rows = batch.tokens[np.argsort(batch.sample_ids)]
    assert rows.tobytes() == np.frombuffer(stream[: rows.size], np.uint8).astype(np.int32).tobytes()
    # Another text (one changed character in the first document) is another version.
    write_jsonl(tmp_path / "changed.jsonl", ["Z" + texts[0][1:]] + texts[1:])
    assert prepare_dataset(tmp_path / "changed.jsonl", tmp_path / "ds-x", shards=3, seq_len=16).version \
        != versions["jsonl file"]


def test_text_field_and_format_flags(tmp_path: Path):
    texts = make_texts(40)
    src = write_jsonl(tmp_path / "data.txt", texts, field="body")  # wrong extension: --format says
    a = prepare_dataset(src, tmp_path / "a", shards=2, seq_len=16, fmt="jsonl", text_field="body")
    b = prepare_dataset(write_parquet(tmp_path / "p.parquet", texts, field="body"), tmp_path / "b",
                        shards=2, seq_len=16, text_field="body")
    assert a.version == b.version


@pytest.fixture
def cli_error(capsys: pytest.CaptureFixture):
    """`prepare ARGS` run in this process (the CLI's own main; test_data_cli runs it as a subprocess)."""
    from resilient_jax.data.cli import main

    def run(*args: str) -> str:
        assert main(["prepare", *args]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.splitlines()) == 1, err
        return err

    return run


def test_bad_inputs_are_one_line_naming_file_and_line(tmp_path: Path, cli_error):
    _cli_error = cli_error
    good = json.dumps({"text": "fine"})
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(f"{good}\n\n{good}\n{{not json\n")
    out = str(tmp_path / "out")
    assert _cli_error("--src", str(bad_json), "--out", out).startswith(f"error: {bad_json}:4: not valid JSON")
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text(f"{good}\n" + json.dumps({"body": "x"}) + "\n")
    err = _cli_error("--src", str(no_field), "--out", out)
    assert err.startswith(f"error: {no_field}:2: no text field 'text' (has: body); pass --text-field")
    parquet = write_parquet(tmp_path / "t.parquet", ["a b c"], field="body")
    err = _cli_error("--src", str(parquet), "--out", out)
    assert err.startswith(f"error: {parquet}: no column 'text' (columns: id, body); pass --text-field")
    csv = tmp_path / "t.csv"
    csv.write_text("a,b\n")
    assert "cannot tell the format of" in _cli_error("--src", str(csv), "--out", out)
    assert _cli_error("--src", str(csv), "--out", out, "--format", "xml").startswith("error: unknown --format 'xml'")
    broken = tmp_path / "tokenizer.json"
    broken.write_text('{"version": "1.0", "model": {"type": "NoSuchModel"}}')
    err = _cli_error("--src", str(parquet), "--out", out, "--text-field", "body", "--tokenizer", f"hf:{broken}")
    assert err.startswith(f"error: tokenizer file {broken} does not parse as a Hugging Face tokenizer.json")
    err = _cli_error("--src", str(parquet), "--out", out, "--tokenizer", f"sp:{broken}")
    assert err.startswith(f"error: tokenizer file {broken} does not parse as a sentencepiece .model")
    assert not Path(out).exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_a_source_whose_files_would_be_dropped_or_misread_is_refused_by_name(tmp_path: Path, cli_error):
    # Each of these prepared with exit 0: the files were skipped (their text lost from the dataset
    # without a word) or read as raw text (JSON metadata, JSON syntax as training tokens).
    out = str(tmp_path / "out")
    latin = tmp_path / "latin"
    latin.mkdir()
    (latin / "a.txt").write_text("plain text\n")
    (latin / "b.txt").write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1"))
    err = cli_error("--src", str(latin), "--out", out)
    assert err.strip() == (f"error: {latin / 'b.txt'} is not UTF-8 text (invalid UTF-8 at byte 3); convert it to "
                           "UTF-8 (e.g. iconv -f latin1 -t utf-8) or move it out of --src")
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "a.txt").write_bytes(b"text\x00more")
    assert "is not UTF-8 text (a NUL byte at byte 4: binary?)" in cli_error("--src", str(binary), "--out", out)
    mixed = tmp_path / "mixed"
    write_jsonl(mixed / "a.jsonl", ["one", "two"])
    (mixed / "README.md").write_text("# my corpus\n")
    err = cli_error("--src", str(mixed), "--out", out)
    assert err.strip() == (f"error: {mixed} holds jsonl files (a.jsonl, ...) and other files (README.md); pass "
                           "--format jsonl to read only its .jsonl files, or pass --format text to read every file as text")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "a.txt").write_text("plain text\n")
    (linked / "more").symlink_to(latin)
    assert f"{linked / 'more'} is a symbolic link to a directory, which is not followed" in cli_error(
        "--src", str(linked), "--out", out)
    splits = tmp_path / "dict"
    write_hf_dir(splits / "train", ["a b c"] * 4)
    write_hf_dir(splits / "test", ["d e f"] * 4)
    (splits / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    err = cli_error("--src", str(splits), "--out", out)
    assert err.strip() == (f"error: {splits} is a Hugging Face DatasetDict (splits: test, train); use one "
                           f"split's folder: pass --src {splits / 'test'}")
    nulls = write_parquet(tmp_path / "nulls.parquet", ["a b c", None])
    assert cli_error("--src", str(nulls), "--out", out).strip() == (
        f"error: {nulls}:row 1: field 'text' is null; remove the row or give it text")
    assert not Path(out).exists()


def test_a_run_that_builds_its_dataset_is_told_its_config_keys_and_prepare_its_flags(tmp_path: Path, cli_error):
    """The same source check speaks to whoever set the source: a training run that builds its
    dataset from its config was told to `pass --format jsonl`, a flag of a command it never ran."""
    from resilient_jax.config import DataConfig
    from resilient_jax.trainer import resolve_dataset

    src = tmp_path / "src"
    write_jsonl(src / "a.jsonl", ["one", "two"], field="body")
    (src / "README.md").write_text("# my corpus\n")
    run = DataConfig(src=str(src), dataset=str(tmp_path / "ds"), build_if_missing=True)
    with pytest.raises(DatasetError) as refused:
        resolve_dataset(run)
    assert str(refused.value).endswith("; set data.format=jsonl to read only its .jsonl files, or set "
                                       "data.format=text to read every file as text")
    assert "pass --format jsonl" in cli_error("--src", str(src), "--out", str(tmp_path / "out"))
    (src / "README.md").unlink()
    with pytest.raises(DatasetError, match=r"a.jsonl:1: no text field 'text' \(has: id, body\); set data.text_field=NAME$"):
        resolve_dataset(run)
    assert cli_error("--src", str(src), "--out", str(tmp_path / "out")).strip().endswith("; pass --text-field NAME")
    assert not (tmp_path / "ds").exists() and not (tmp_path / "out").exists()


def test_one_text_file_is_one_document_with_format_text(tmp_path: Path):
    # The advice for a lone corpus.txt was --format text, which then said it needs a directory.
    (tmp_path / "corpus.txt").write_text("alpha beta gamma\n" * 50)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "corpus.txt").write_text("alpha beta gamma\n" * 50)
    one = prepare_dataset(tmp_path / "corpus.txt", tmp_path / "one", shards=1, seq_len=16, fmt="text")
    same = prepare_dataset(tmp_path / "dir", tmp_path / "same", shards=1, seq_len=16, fmt="text")
    assert one.version == same.version


def _train_hf_tokenizer(path: Path, texts: list[str], vocab_size: int) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def stdlib_slice() -> list[str]:
    from resilient_jax.data.sources import iter_documents

    return [d.data.decode() for d in iter_documents("default", max_bytes=300_000)]


def test_a_trained_tokenizer_json_round_trips_and_its_hash_is_in_manifest_and_position(
        tmp_path: Path, stdlib_slice: list[str]):
    import hashlib

    from resilient_jax.data.tokenizer import get_tokenizer

    path = _train_hf_tokenizer(tmp_path / "tokenizer.json", stdlib_slice, vocab_size=1000)
    spec = f"hf:{path}"
    tok = get_tokenizer(spec)
    sample = stdlib_slice[3][:2000]
    ids = tok.encode_batch([sample.encode()])[0]
    assert tok.decode(ids) == sample and len(ids) < len(sample.encode()) / 2  # it compresses, losslessly
    src = write_jsonl(tmp_path / "c.jsonl", stdlib_slice)
    manifest = prepare_dataset(src, tmp_path / "ds", shards=2, seq_len=32, tokenizer=spec)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert (manifest.tokenizer, manifest.tokenizer_sha256, manifest.vocab_size) == ("hf", sha, 1000)
    assert json.loads((tmp_path / "ds" / "manifest.json").read_text())["tokenizer_sha256"] == sha
    # ~2 bytes per token on disk (uint16 tokens, no weights), and the records decode to the ids.
    assert manifest.token_dtype == "<u2" and not manifest.has_weights
    # (The ArrayRecord container adds ~80 bytes per record and pads files to 64 KiB; that is
    # amortised at real seq_lens, see scripts/bench_data.py --prepare.)
    assert manifest.layout.record_bytes == 2 * 33
    with HostBatchLoader(manifest, seed=0, global_batch=2) as loader:
        batch = next(loader)
        position = loader.position()
    assert batch.tokens.dtype == np.int32 and batch.weights.dtype == np.float32
    assert np.all(batch.weights == 1.0)
    stream = np.concatenate(tok.encode_batch([t.encode() for t in stdlib_slice]))
    first = int(batch.sample_ids[0])
    np.testing.assert_array_equal(batch.tokens[0], stream[first * 33:(first + 1) * 33])
    assert position.to_dict()["tokenizer_sha256"] == sha

    # A changed tokenizer: refused by the dataset cache, by a resume, naming both hashes.
    other = _train_hf_tokenizer(tmp_path / "other.json", stdlib_slice[:20], vocab_size=600)
    other_sha = hashlib.sha256(other.read_bytes()).hexdigest()
    with pytest.raises(DatasetError, match=rf"tokenizer 'hf' sha256 {sha}, the requested one is 'hf' sha256 {other_sha}"):
        ensure_dataset(tmp_path / "ds", src, shards=2, seq_len=32, tokenizer=f"hf:{other}")
    # A run's config naming the dataset: every key that differs, with the value to set it to.
    from resilient_jax.config import DataConfig
    from resilient_jax.data.location import check_prepared_as_configured

    asked = DataConfig(dataset=str(tmp_path / "ds"), shards=4, seq_len=32, tokenizer="bytes")
    with pytest.raises(DatasetError, match=rf"^data.dataset {tmp_path / 'ds'} was prepared with other settings: set "
                                           rf"data.shards=2 \(not 4\), data.tokenizer=hf:<the file it was prepared "
                                           rf"with, sha256 {sha[:12]}> \(not bytes\), or point data.dataset at"):
        check_prepared_as_configured(asked, tmp_path / "ds")
    # ... the built-in model's vocabulary too, in the same line (it took a third run to learn it).
    with pytest.raises(DatasetError, match=rf"\(not bytes\), model.vocab_size={manifest.vocab_size} or more \(not "
                                           rf"256\), or point data.dataset at"):
        check_prepared_as_configured(asked, tmp_path / "ds", model_vocab_size=256)
    retokenized = prepare_dataset(src, tmp_path / "ds2", shards=2, seq_len=32, tokenizer=f"hf:{other}")
    with pytest.raises(DatasetError, match=rf"saved with tokenizer sha256 {sha}, the dataset's tokenizer is sha256 {other_sha}"):
        HostBatchLoader.from_position(retokenized, position, seed=0, global_batch=2)


def test_resume_check_names_both_tokenizer_hashes():
    from resilient_jax.checkpoint.reader import CheckpointError
    from resilient_jax.checkpoint.validate import check_resume

    histories = {f: {"history": []} for f in ("config", "topology", "provenance")}
    saved = {"data": {"step": 3, "dataset_version": "v1", "tokenizer_sha256": "a" * 64}, **histories}
    with pytest.raises(CheckpointError, match=rf"tokenizer sha256 {'a' * 64} differs from .* sha256 {'b' * 64}"):
        check_resume("ck", saved, {"data": {"dataset_version": "v2", "tokenizer_sha256": "b" * 64}})


def test_sentencepiece_model_if_installed(tmp_path: Path, stdlib_slice: list[str]):
    spm = pytest.importorskip("sentencepiece")
    import io

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(stdlib_slice[:40]), model_writer=model,
                                   vocab_size=300, model_type="bpe", minloglevel=2)
    path = tmp_path / "sp.model"
    path.write_bytes(model.getvalue())
    manifest = prepare_dataset(write_jsonl(tmp_path / "c.jsonl", stdlib_slice[:40]), tmp_path / "ds",
                               shards=2, seq_len=16, tokenizer=f"sp:{path}")
    assert (manifest.tokenizer, manifest.vocab_size, manifest.token_dtype) == ("sp", 300, "<u2")


def test_records_with_and_without_weights_decode_to_the_same_int32_and_float32():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 70_000, (5, 9))
    ones = np.ones((5, 8), np.float32)
    compact = RecordLayout(8, "<u4", has_weights=False)
    full = RecordLayout(8, "<i4", has_weights=True)  # the format-1 layout
    a = compact.decode(list(compact.encode(tokens)))
    b = full.decode(list(full.encode(tokens, ones)))
    assert compact.record_bytes == 9 * 4 and full.record_bytes == 9 * 4 + 8 * 4
    for rows in (a, b):
        assert rows["tokens"].dtype == np.int32 and rows["weights"].dtype == np.float32
    np.testing.assert_array_equal(a["tokens"], tokens)
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    np.testing.assert_array_equal(a["weights"], b["weights"])


@pytest.mark.slow  # two subprocesses that import the data package
def test_hf_tokenized_dataset_does_not_depend_on_the_thread_count(tmp_path: Path, stdlib_slice: list[str]):
    """The tokenizers library encodes a batch on a Rayon pool; 1 thread and 4 give the same dataset."""
    import os
    import subprocess
    import sys

    tok = _train_hf_tokenizer(tmp_path / "tokenizer.json", stdlib_slice, vocab_size=800)
    src = write_jsonl(tmp_path / "c.jsonl", stdlib_slice)
    versions = set()
    for threads in ("1", "4"):
        code = ("import sys; from resilient_jax.data.prepare import prepare_dataset; "
                "print(prepare_dataset(sys.argv[1], sys.argv[2], shards=2, seq_len=32, tokenizer=sys.argv[3]).version)")
        out = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / f"ds{threads}"), f"hf:{tok}"],
                             env={**os.environ, "RAYON_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "true"},
                             capture_output=True, text=True, check=True)
        versions.add(out.stdout.strip())
    assert len(versions) == 1 and len(versions.pop()) == 64
    assert prepare_dataset(src, tmp_path / "here", shards=2, seq_len=32, tokenizer=f"hf:{tok}").version \
        == load_manifest(tmp_path / "ds1").version


def test_a_format_1_dataset_still_loads_with_the_same_values(tmp_path: Path):
    """Datasets prepared before format 2 (weights stored, no tokenizer hash) read unchanged."""
    from dataclasses import asdict

    from resilient_jax.data.manifest import ShardInfo, file_sha256, manifest_from_content, write_manifest
    from resilient_jax.data.prepare import WRITER_OPTIONS, _write_shard

    texts = make_texts(60)
    new = prepare_dataset(write_jsonl(tmp_path / "c.jsonl", texts), tmp_path / "new", shards=2, seq_len=16)
    old_root = tmp_path / "old"
    old_root.mkdir()
    layout = RecordLayout(16, "<u1", has_weights=True)
    tokens = np.frombuffer("".join(texts).encode(), np.uint8)[: new.num_records * 17].reshape(-1, 17)
    infos = []
    for shard, (lo, hi) in enumerate([(0, new.shards[0].records), (new.shards[0].records, new.num_records)]):
        path = old_root / new.shards[shard].file
        _write_shard(path, layout.encode(tokens[lo:hi], np.ones((hi - lo, 16), np.float32)))
        infos.append(asdict(ShardInfo(path.name, hi - lo, path.stat().st_size, file_sha256(path))))
    write_manifest(manifest_from_content(old_root, {
        "format_version": 1, "tokenizer": "bytes", "vocab_size": 256, "seq_len": 16, "token_dtype": "<u1",
        "writer_options": WRITER_OPTIONS, "shards": infos}))
    old = load_manifest(old_root)
    assert old.has_weights and old.tokenizer_sha256 == "" and old.version != new.version
    ensure_dataset(old_root, shards=2, seq_len=16)  # the byte tokenizer is accepted without a hash
    batches = []
    for manifest in (old, new):
        with HostBatchLoader(manifest, seed=3, global_batch=8) as loader:
            batches.append([next(loader) for _ in range(3)])
    for a, b in zip(*batches, strict=True):
        assert a.tokens.dtype == b.tokens.dtype == np.int32 and a.weights.dtype == b.weights.dtype == np.float32
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.weights, b.weights)


def test_a_failed_prepare_leaves_no_directory_it_made(tmp_path: Path, cli_error):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    cli_error("--src", str(bad), "--out", str(tmp_path / "new" / "deeper" / "ds"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no new/deeper left behind
