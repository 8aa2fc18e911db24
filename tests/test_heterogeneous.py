"""Heterogeneous hosts (resilient_jax.assignment): a slow host's virtual shards move to the fast
ones at agreed step boundaries, without a re-formation and without changing one bit.

Real worker processes; the slow host is slowed by the worker itself (`slow_host`: its work takes
FACTOR x as long, so its extra time scales with the shards it holds). The throughput figure (a
host 2x slower, proportional vs uniform, side by side) is a benchmark: scripts/bench_assignment.py.
"""

from __future__ import annotations

import pytest

from conftest import REPO
from test_elastic import STEPS, elastic_run

pytestmark = pytest.mark.slow

CPU4 = str(REPO / "configs" / "cpu-4host.yaml")
WINDOW = 5  # runtime.assignment_window's default


@pytest.fixture(scope="module")
def reference(fault_free):
    return fault_free(f"train.steps={STEPS}", "checkpoint.enabled=false")["params_fingerprint"]


def test_a_host_too_slow_to_help_is_idled_stays_a_member_and_gets_its_shards_back(tmp_path, reference):
    # h3 is 12x slower over steps 5..24, then as fast as the others.
    summary = elastic_run(tmp_path, CPU4, "--fault", "slow_host:3@5-24:12")
    assert summary["final_step"] == STEPS and summary["restarts"] == 0 and summary["steps_lost"] == 0
    assert summary["params_fingerprint"] == reference  # whoever computed which shard
    assert summary["events"] == []  # no re-formation: the world never changed
    assert summary["straggler_decisions"] == []  # a slow host with shards is absorbed, not judged
    decisions = summary["assignment"]["decisions"]
    assert summary["assignment"]["policy"] == "proportional"
    first = decisions[0]
    assert first["kind"] == "rebalance" and first["hosts"] == ["h0", "h1", "h2", "h3"]
    assert first["new_shards"] == [8, 8, 8, 0] and 5 < first["step"] <= 5 + 2 * WINDOW
    assert first["cost_per_shard_seconds"][3] > 5 * max(first["cost_per_shard_seconds"][:3])
    # Idle, h3 stays a member: it heartbeats and reports every step with 0 shards.
    idle = [t for t in _timeline(tmp_path) if t["host"] == "h3" and first["step"] < t["step"] <= first["step"] + 10]
    assert len(idle) == 10 and all(t["shards"] == 0 for t in idle)
    assert {m["status"] for m in summary["members"].values()} == {"done"}  # h3 finished with the world
    # Probed after 4 windows (fast again by then) and given its shards back.
    probe = next(d for d in decisions if d["kind"] == "probe")
    assert probe["new_shards"][3] == 1
    assert decisions[-1]["new_shards"][3] >= 5 and decisions[-1]["step"] > probe["step"]
    assert sum(decisions[-1]["new_shards"]) == 24


def _timeline(run_dir):
    import json

    return json.loads((run_dir / "elastic" / "timeline.json").read_text())
