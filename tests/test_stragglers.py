"""The straggler rule and the reslot decision, on synthetic step timings."""

from __future__ import annotations

from resilient_jax.elastic.stragglers import StepTiming, decide, find_straggler

HOSTS = ["h0", "h1", "h2", "h3"]


def window(steps, slow: dict[int, float] | None = None, *, host="h1"):
    """Each step: every host ready after 10 ms, shared step 100 ms; `slow` adds ready seconds to `host`."""
    slow = slow or {}
    return {k: {h: StepTiming(0.01 + (slow.get(k, 0.0) if h == host else 0.0), 0.1) for h in HOSTS} for k in steps}


def test_a_persistently_slow_host_is_found_with_its_numbers():
    found = find_straggler(window(range(10), {k: 0.3 for k in range(10)}), HOSTS, factor=1.5, steps=10)
    assert found.host == "h1" and found.steps == (0, 9)
    assert abs(found.ratio - 0.41 / 0.11) < 1e-6 and abs(found.own_seconds - 0.41) < 1e-9


def test_a_spike_shorter_than_most_of_the_window_is_not_a_straggler():
    assert find_straggler(window(range(10), {4: 8.0, 5: 8.0}), HOSTS, factor=1.5, steps=10) is None
    assert find_straggler(window(range(10)), HOSTS, factor=1.5, steps=10) is None


def test_too_few_complete_steps_means_no_verdict():
    partial = window(range(10), {k: 0.3 for k in range(10)})
    del partial[9]["h3"]  # h3 has not reported step 9 yet
    assert find_straggler(partial, HOSTS, factor=1.5, steps=10) is None


def test_replace_with_a_spare_else_remove_only_when_faster():
    found = find_straggler(window(range(10), {k: 0.3 for k in range(10)}), HOSTS, factor=1.5, steps=10)
    assert decide(found, members=HOSTS, spares=["h9"], remaining_steps=5, reform_seconds=99, min_hosts=1).spare == "h9"
    # 0.41 s/step with h1 vs 0.11 * 4/3 on three hosts: removal pays after enough steps ...
    assert decide(found, members=HOSTS, spares=[], remaining_steps=200, reform_seconds=20, min_hosts=1).action == "remove"
    # ... and not when re-forming costs more than the remaining steps save, or min_hosts forbids it.
    keep = decide(found, members=HOSTS, spares=[], remaining_steps=20, reform_seconds=20, min_hosts=1)
    assert keep.action == "keep" and "20.0 s to re-form" in keep.reason
    assert decide(found, members=HOSTS, spares=[], remaining_steps=200, reform_seconds=0, min_hosts=4).action == "keep"
