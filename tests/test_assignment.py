"""The shard-assignment planner (resilient_jax.assignment): pure decisions from per-step timings."""

import pytest

from resilient_jax import assignment as A

POLICY = A.Policy(window=5, hysteresis=0.1, max_share=2.0)


def _step(planner, step, per_shard, device=0.01):
    """One step's sample of hosts whose host-side cost per shard is `per_shard` (s); the device
    cost per shard is `device`. The host that enters last spends its own compute inside the step."""
    ready = tuple(n * e for n, e in zip(planner.counts, per_shard))
    last = max(range(len(ready)), key=lambda h: ready[h])
    wall = max(r + n * device for r, n in zip(ready, planner.counts))
    in_step = tuple(wall - r if h != last else planner.counts[h] * device for h, r in enumerate(ready))
    return A.Sample(step=step, shards=planner.counts, ready=ready, in_step=in_step)


def _run(planner, steps, per_shard, first=1, device=0.01):
    decisions = []
    for k in range(first, first + steps):
        planner, decision = A.observe(planner, _step(planner, k, per_shard(k), device), POLICY)
        decisions += [decision] if decision else []
    return planner, decisions


def _start(hosts=4, shards=24, capacity=12):
    return A.Planner.start([shards // hosts] * hosts, [capacity] * hosts, step=1)


def test_a_host_twice_as_slow_gets_half_the_shards_of_the_others():
    planner, (decision,) = _run(_start(), 30, lambda k: (0.0, 0.0, 0.0, 0.01))
    # cost per shard: 0.01 for the fast hosts, 0.02 for host 3 -> shares 2:2:2:1 of 24 -> 7, 7, 7, 3
    assert decision.new == (7, 7, 7, 3) and decision.kind == "rebalance" and decision.step == 6
    assert decision.predicted_new < 0.9 * decision.predicted_old
    assert planner.counts == (7, 7, 7, 3)
    event = decision.to_event(["h0", "h1", "h2", "h3"])
    assert event["old_shards"] == [6, 6, 6, 6] and event["new_shards"] == [7, 7, 7, 3]
    assert event["cost_per_shard_seconds"] == pytest.approx([0.01, 0.01, 0.01, 0.02], rel=1e-6)


def test_equal_hosts_and_noise_below_the_hysteresis_never_move_a_shard():
    noise = [0.0, 0.0004, 0.0, 0.0008, 0.0002]  # up to 8% of the device cost per shard
    planner, decisions = _run(_start(), 60, lambda k: tuple(noise[(k + h) % 5] for h in range(4)))
    assert decisions == [] and planner.counts == (6, 6, 6, 6)


def test_a_host_too_slow_to_help_is_idled_probed_and_gets_its_shards_back_when_it_speeds_up():
    slow_until = 20
    planner, decisions = _run(_start(), 60, lambda k: (0.0, 0.0, 0.0, 0.5 if k <= slow_until else 0.0))
    assert [(d.step, d.kind, d.new) for d in decisions] == [
        (6, "rebalance", (8, 8, 8, 0)),  # 51x slower over steps 1..5: 0 shards, the others share 24
        (26, "probe", (7, 8, 8, 1)),  # idle for 4 windows (fast again since step 21): one shard
        (31, "rebalance", (6, 6, 6, 6)),  # measured fast with it: its share back
    ]
    assert planner.counts == (6, 6, 6, 6)


def test_a_probe_of_a_host_still_slow_sends_it_back_to_idle():
    planner, decisions = _run(_start(), 60, lambda k: (0.0, 0.0, 0.0, 0.5))
    assert [(d.step, d.kind, d.new[3]) for d in decisions] == [
        (6, "rebalance", 0), (26, "probe", 1), (31, "rebalance", 0), (51, "probe", 1), (56, "rebalance", 0)]
    assert planner.counts == (8, 8, 8, 0)


def test_shares_respect_each_hosts_capacity():
    # Host 3 is 10x slower: uncapped it would get 0 shards (8, 8, 8, 0), but the others hold at
    # most 7 each (their devices x slots).
    planner = A.Planner.start([6, 6, 6, 6], [7, 7, 7, 12], step=1)
    planner, (decision, *_) = _run(planner, 10, lambda k: (0.0, 0.0, 0.0, 0.09))
    assert decision.new == (7, 7, 7, 3)


def test_proportional_shares_are_deterministic_integers():
    assert A.proportional(24, [1.0, 1.0, 1.0, 2.0], [12] * 4) == [7, 7, 7, 3]
    assert A.proportional(24, [1.0] * 5, [12] * 5) == [5, 5, 5, 5, 4]  # ties: the lower host first
    assert A.proportional(10, [1.0, 1.0], [4, 12]) == [4, 6]


def test_host_shares_split_over_its_devices_in_grid_order():
    assert A.device_counts([7, 3], [0, 0, 1, 1], slots=6) == [4, 3, 2, 1]
    assert A.host_counts_from_devices([4, 3, 2, 1], [0, 0, 1, 1], 2) == [7, 3]
    with pytest.raises(ValueError, match="do not fit 3 slots per device"):
        A.device_counts([8, 2], [0, 0, 1, 1], slots=3)


def test_a_sample_from_another_assignment_is_refused():
    planner = _start()
    with pytest.raises(A.DisagreementError, match="hosts disagree"):
        A.observe(planner, A.Sample(step=1, shards=(7, 7, 7, 3), ready=(0,) * 4, in_step=(0.1,) * 4), POLICY)
