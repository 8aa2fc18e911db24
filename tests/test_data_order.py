"""The global order: host-count independence, epochs, quarantine semantics, DataPosition."""

import json

import numpy as np
import pytest

from resilient_jax.data import DataPosition, DatasetError, GlobalOrder, QuarantineEvent, global_batch_ids, host_rows
from resilient_jax.data import order as order_module

BOUNDS = (0, 40, 95, 130, 200, 233)  # 5 uneven shards, 233 samples


def shard_of(ids: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.asarray(BOUNDS), ids, side="right") - 1


def concat_hosts(order: GlobalOrder, step: int, hosts: int) -> np.ndarray:
    ids = global_batch_ids(order, step)
    return np.concatenate([ids[slice(*host_rows(order.global_batch, hosts, h))] for h in range(hosts)])


def test_global_batch_is_the_same_for_every_host_count():
    order = GlobalOrder(BOUNDS, seed=7, global_batch=48)
    for step in (0, 1, 4, 5, 11):  # step 4 crosses the first epoch boundary (233 samples)
        reference = global_batch_ids(order, step)
        for hosts in (1, 2, 3, 4, 6, 8):
            np.testing.assert_array_equal(concat_hosts(order, step, hosts), reference)


def test_each_epoch_is_a_permutation_and_batches_cross_epoch_boundaries():
    order = GlobalOrder(BOUNDS, seed=3, global_batch=10)
    stream = np.concatenate([global_batch_ids(order, k) for k in range(47)])  # 470 = 2 epochs + 4
    assert sorted(stream[:233]) == list(range(233))
    assert sorted(stream[233:466]) == list(range(233))
    assert not np.array_equal(stream[:233], stream[233:466])  # epochs are reshuffled
    # Step 23 covers positions [230, 240): the last 3 of epoch 0 and the first 7 of epoch 1.
    np.testing.assert_array_equal(global_batch_ids(order, 23), stream[230:240])
    assert order.epoch_at(23) == 0 and order.epoch_at(24) == 1


def test_batch_larger_than_the_dataset_spans_several_epochs():
    order = GlobalOrder((0, 3, 5), seed=0, global_batch=12)
    ids = global_batch_ids(order, 0)
    assert sorted(ids[:5]) == sorted(ids[5:10]) == list(range(5))


def test_order_is_deterministic_across_independent_computations():
    first = [global_batch_ids(GlobalOrder(BOUNDS, 11, 16, ({"shard": 2, "from_step": 3},)), k) for k in range(30)]
    order_module._epoch_permutation.cache_clear()
    order_module._eligible_permutation.cache_clear()
    second = [global_batch_ids(GlobalOrder(BOUNDS, 11, 16, [QuarantineEvent(2, 3)]), k) for k in range(30)]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    other_seed = global_batch_ids(GlobalOrder(BOUNDS, 12, 16), 0)
    assert not np.array_equal(other_seed, global_batch_ids(GlobalOrder(BOUNDS, 11, 16), 0))


def test_quarantine_removes_exactly_the_shard_from_its_from_step_on():
    plain = GlobalOrder(BOUNDS, seed=5, global_batch=12)
    quarantined = plain.with_quarantine(shard=1, from_step=4)
    for step in range(4):  # before from_step: unchanged
        np.testing.assert_array_equal(global_batch_ids(quarantined, step), global_batch_ids(plain, step))
    for step in range(4, 40):
        assert 1 not in shard_of(global_batch_ids(quarantined, step))
    # From step 0 on, one epoch (178 samples) is every healthy sample once, in the plain order.
    from_start = plain.with_quarantine(shard=1, from_step=0)
    healthy = 233 - 55
    stream = np.concatenate([global_batch_ids(from_start, k) for k in range(15)])[:healthy]
    assert sorted(stream) == [i for i in range(233) if not 40 <= i < 95]
    full_epoch0 = np.concatenate([global_batch_ids(plain, k) for k in range(20)])[:233]
    np.testing.assert_array_equal(stream, full_epoch0[shard_of(full_epoch0) != 1])


def test_quarantine_events_are_canonical():
    events = [{"shard": 3, "from_step": 9}, {"shard": 1, "from_step": 2}, {"shard": 3, "from_step": 4}]
    order = GlobalOrder(BOUNDS, 0, 8, events)
    assert order.quarantine == (QuarantineEvent(1, 2), QuarantineEvent(3, 4))
    assert order.quarantined_at(3) == {1} and order.quarantined_at(4) == {1, 3}


def test_bad_requests_name_the_key():
    with pytest.raises(DatasetError, match=r"global_batch 10 is not divisible by hosts 4"):
        host_rows(10, 4, 0)
    with pytest.raises(DatasetError, match=r"leaves no samples"):
        GlobalOrder(BOUNDS, 0, 8, [QuarantineEvent(s, 3 * s) for s in range(5)])
    with pytest.raises(DatasetError, match=r"quarantine shard 9 does not exist"):
        GlobalOrder(BOUNDS, 0, 8).with_quarantine(9, 0)
    with pytest.raises(DatasetError, match=r"step must be >= 0"):
        global_batch_ids(GlobalOrder(BOUNDS, 0, 8), -1)


def test_data_position_round_trips_through_json_and_checks_what_it_resumes_on():
    order = GlobalOrder(BOUNDS, 1, 48, [QuarantineEvent(2, 3)])
    position = DataPosition.at(order, "v1", step=6)
    assert (position.global_offset, position.epoch) == (288, 288 // (233 - 35))
    restored = DataPosition.from_dict(json.loads(json.dumps(position.to_dict())))
    assert restored == position
    assert position.to_dict()["quarantine"] == [{"shard": 2, "from_step": 3}]
    restored.check_against(order, "v1")
    with pytest.raises(DatasetError, match="dataset_version"):
        restored.check_against(order, "v2")
    with pytest.raises(DatasetError, match="global_batch changed"):
        restored.check_against(GlobalOrder(BOUNDS, 1, 24), "v1")
    with pytest.raises(DatasetError, match="malformed"):
        DataPosition.from_dict({"step": 1})
