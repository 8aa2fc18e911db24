"""HostBatchLoader: host-count-independent batches, resume, quarantine, poison, bounded prefetch."""

import json
import time
from pathlib import Path

import numpy as np
import pytest

from resilient_jax.data import (
    DataPosition,
    DatasetError,
    GlobalOrder,
    HostBatchLoader,
    Manifest,
    global_batch_ids,
    host_rows,
    prepare_dataset,
)

SEED, GLOBAL_BATCH, SEQ_LEN = 17, 24, 16


def write_texts(root: Path, files: int = 6, words: int = 2000) -> Path:
    rng = np.random.default_rng(1)
    for i in range(files):
        (root / f"f{i}.txt").parent.mkdir(parents=True, exist_ok=True)
        (root / f"f{i}.txt").write_text(" ".join(rng.choice(["lorem", "ipsum", "dolor", "sit", "amet\n"], words)))
    return root


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Manifest:
    root = tmp_path_factory.mktemp("data")
    return prepare_dataset(write_texts(root / "src"), root / "ds", shards=4, seq_len=SEQ_LEN)


def read_steps(loader: HostBatchLoader, steps: int) -> list:
    with loader:
        return [next(loader) for _ in range(steps)]


def global_batches(dataset: Manifest, hosts: int, steps: int, **kwargs) -> list[dict[str, np.ndarray]]:
    """Runs one loader per host and concatenates their rows step by step."""
    per_host = [
        read_steps(HostBatchLoader(dataset, seed=SEED, global_batch=GLOBAL_BATCH,
                                   rows=host_rows(GLOBAL_BATCH, hosts, h), **kwargs), steps)
        for h in range(hosts)
    ]
    return [
        {field: np.concatenate([getattr(host[k], field) for host in per_host])
         for field in ("tokens", "weights", "sample_ids", "shard_ids")}
        for k in range(steps)
    ]


def assert_same_batches(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for field in x:
            np.testing.assert_array_equal(x[field], y[field], err_msg=field)


def test_batch_contents_are_the_source_windows(dataset: Manifest):
    text = b"".join((dataset.root.parent / "src" / f"f{i}.txt").read_bytes() for i in range(6))
    (batch,) = read_steps(HostBatchLoader(dataset, seed=SEED, global_batch=GLOBAL_BATCH), 1)
    assert batch.step == 0 and batch.tokens.dtype == np.int32 and batch.weights.dtype == np.float32
    assert batch.tokens.shape == (GLOBAL_BATCH, SEQ_LEN + 1) and batch.weights.shape == (GLOBAL_BATCH, SEQ_LEN)
    order = GlobalOrder.for_manifest(dataset, SEED, GLOBAL_BATCH)
    np.testing.assert_array_equal(batch.sample_ids, global_batch_ids(order, 0))
    for row, gid in enumerate(batch.sample_ids):
        window = text[gid * (SEQ_LEN + 1) : (gid + 1) * (SEQ_LEN + 1)]
        assert bytes(batch.tokens[row].astype(np.uint8)) == window
    np.testing.assert_array_equal(batch.shard_ids, dataset.shard_of(batch.sample_ids))
    assert np.all(batch.weights == 1.0)


def test_global_batch_is_identical_for_every_host_count(dataset: Manifest):
    reference = global_batches(dataset, 1, steps=4)
    for hosts in (2, 3, 4, 6, 8):
        assert_same_batches(global_batches(dataset, hosts, steps=4), reference)


def test_reassigned_rows_take_effect_from_the_given_step_and_drop_the_read_ahead(dataset: Manifest):
    """An uneven shard assignment moves a host's rows at a step boundary (resilient_jax.assignment):
    from that step on the loader returns the new rows of the same global batches."""
    reference = global_batches(dataset, 1, steps=6)
    with HostBatchLoader(dataset, seed=SEED, global_batch=GLOBAL_BATCH, rows=(0, 4), prefetch=3) as loader:
        first = [next(loader) for _ in range(2)]
        loader.reassign((2, GLOBAL_BATCH), from_step=2)
        later = [next(loader) for _ in range(3)]
        loader.reassign((4, 4), from_step=5)  # a host at 0 shards reads nothing
        last = next(loader)
    assert [b.step for b in first + later + [last]] == [0, 1, 2, 3, 4, 5]
    assert last.tokens.shape == (0, dataset.seq_len + 1) and last.weights.shape == (0, dataset.seq_len)
    for b in first:
        np.testing.assert_array_equal(b.sample_ids, reference[b.step]["sample_ids"][0:4])
    for b in later:
        np.testing.assert_array_equal(b.sample_ids, reference[b.step]["sample_ids"][2:])
        np.testing.assert_array_equal(b.tokens, reference[b.step]["tokens"][2:])


def test_resume_from_a_saved_position_with_another_host_count(dataset: Manifest):
    reference = global_batches(dataset, 1, steps=6)
    loaders = [HostBatchLoader(dataset, seed=SEED, global_batch=GLOBAL_BATCH, rows=host_rows(GLOBAL_BATCH, 2, h))
               for h in range(2)]
    for loader in loaders:
        read = [next(loader) for _ in range(3)]
        assert [b.step for b in read] == [0, 1, 2]
    saved = [json.dumps(loader.position().to_dict()) for loader in loaders]
    for loader in loaders:
        loader.close()
    assert saved[0] == saved[1]  # the position is the same on every host
    position = DataPosition.from_dict(json.loads(saved[0]))
    assert position.step == 3
    resumed = [read_steps(HostBatchLoader.from_position(dataset, position, seed=SEED, global_batch=GLOBAL_BATCH,
                                                        rows=host_rows(GLOBAL_BATCH, 3, h)), 3) for h in range(3)]
    assert [b.step for b in resumed[0]] == [3, 4, 5]
    for k in range(3):
        for field in ("tokens", "weights", "sample_ids", "shard_ids"):
            resumed_rows = np.concatenate([getattr(r[k], field) for r in resumed])
            np.testing.assert_array_equal(resumed_rows, reference[3 + k][field], err_msg=field)
    with pytest.raises(DatasetError, match="global_batch changed"):
        HostBatchLoader.from_position(dataset, position, seed=SEED, global_batch=2 * GLOBAL_BATCH)


def test_quarantine_resamples_from_from_step_and_is_recorded(dataset: Manifest):
    with HostBatchLoader(dataset, seed=SEED, global_batch=GLOBAL_BATCH) as loader:
        before = [next(loader) for _ in range(3)]
        bad = int(before[2].shard_ids[0])
        loader.quarantine(bad, from_step=2)  # step 2 hit a bad shard: re-read it without that shard
        again = next(loader)
        assert again.step == 2 and bad not in again.shard_ids
        expected = GlobalOrder.for_manifest(dataset, SEED, GLOBAL_BATCH, [{"shard": bad, "from_step": 2}])
        np.testing.assert_array_equal(again.sample_ids, global_batch_ids(expected, 2))
        assert loader.position().to_dict()["quarantine"] == [{"shard": bad, "from_step": 2}]
        later = [next(loader) for _ in range(5)]
        assert all(bad not in b.shard_ids for b in later)
        loader.seek(0)  # steps before from_step replay unchanged
        for old in before[:2]:
            np.testing.assert_array_equal(next(loader).sample_ids, old.sample_ids)
        with pytest.raises(DatasetError, match="leaves no samples"):
            for shard in range(4):
                loader.quarantine(shard, from_step=9)
        assert next(loader).step == 2


def test_poison_gives_nan_weights_exactly_for_the_shard_from_its_step(dataset: Manifest):
    poisoned_shard, from_step = 1, 2
    with HostBatchLoader(dataset, seed=SEED, global_batch=GLOBAL_BATCH, poison={poisoned_shard: from_step}) as loader:
        batches = [next(loader) for _ in range(5)]
    assert any(poisoned_shard in b.shard_ids for b in batches[from_step:])
    for batch in batches:
        nan_rows = np.isnan(batch.weights).any(axis=1)
        expected = (batch.shard_ids == poisoned_shard) & (batch.step >= from_step)
        np.testing.assert_array_equal(nan_rows, expected)
        assert np.all(np.isnan(batch.weights[expected])) and np.all(batch.weights[~expected] == 1.0)


def test_prefetch_is_bounded_with_a_slow_consumer(dataset: Manifest):
    prefetch = 2
    with HostBatchLoader(dataset, seed=SEED, global_batch=GLOBAL_BATCH, prefetch=prefetch) as loader:
        peak = 0
        for consumed in range(1, 6):
            next(loader)
            for _ in range(10):
                time.sleep(0.01)
                peak = max(peak, loader.buffered())
                # one batch may be in the thread's hands, blocked on the full queue
                assert loader.batches_read - consumed <= prefetch + 1
        assert peak == prefetch


def test_loader_refuses_files_that_do_not_match_the_manifest(dataset: Manifest, tmp_path: Path):
    copy = prepare_dataset(dataset.root.parent / "src", tmp_path / "ds", shards=4, seq_len=SEQ_LEN)
    path = copy.shard_path(3)
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=rf"modified shard file .*{path.name}"):
        HostBatchLoader(tmp_path / "ds", seed=SEED, global_batch=GLOBAL_BATCH, verify=True)
    path.write_bytes(bytes(data[:-100]))
    with pytest.raises(DatasetError, match=rf"truncated shard file .*{path.name}"):
        HostBatchLoader(tmp_path / "ds", seed=SEED, global_batch=GLOBAL_BATCH)
    with pytest.raises(DatasetError, match=r"rows must satisfy"):
        HostBatchLoader(dataset, seed=SEED, global_batch=GLOBAL_BATCH, rows=(0, GLOBAL_BATCH + 1))


def test_a_failed_read_is_raised_in_the_training_thread_until_a_seek(dataset: Manifest, monkeypatch):
    from resilient_jax.data.reader import BatchReader

    real_read, failures = BatchReader.read, []

    def flaky_read(self, order, step, rows=None):
        if step == 2 and not failures:
            failures.append(step)
            raise DatasetError("disk hiccup at step 2")
        return real_read(self, order, step, rows)

    monkeypatch.setattr(BatchReader, "read", flaky_read)
    with HostBatchLoader(dataset, seed=SEED, global_batch=GLOBAL_BATCH) as loader:
        assert [next(loader).step for _ in range(2)] == [0, 1]
        for _ in range(2):  # sticky: no step is skipped past the error
            with pytest.raises(DatasetError, match="disk hiccup"):
                next(loader)
        loader.seek(2)
        assert [next(loader).step for _ in range(2)] == [2, 3]
