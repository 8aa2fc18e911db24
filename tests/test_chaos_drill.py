"""The shortened chaos drill (what the README shows, on 4 hosts): every fault class absorbed."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import pytest

from resilient_jax.trainer import Trainer

from conftest import REPO, tiny_config

pytestmark = pytest.mark.slow


def test_quick_drill_absorbs_all_four_fault_classes(tmp_path, default_dataset):
    out = tmp_path / "drill"
    proc = subprocess.run([sys.executable, "scripts/chaos_drill.py", "--quick", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    drill = json.loads((out / "drill.json").read_text())
    rows = {r["injected"].split(":")[0].split("@")[0]: r for r in drill["rows"]}
    assert sorted(rows) == ["delay_host", "kill_host", "kill_region", "nan_shard", "slow_host"]
    for row in drill["rows"]:
        assert row["restarts"] == 0 and row["steps_lost"] == 0 and row["fingerprint_equal"] and row["holds"], row
    # The spike was waited out in generation 0 (no failure, no re-formation because of it) ...
    jitter = drill["summaries"]["network jitter"]
    (stall,) = [s for s in jitter["stalls"] if s["late_host"] == "h2"]
    assert stall["generation"] == 0 and stall["late_by_seconds"] >= 5.5
    assert [e["reason"] for e in jitter["events"]] == ["reslot"]
    # ... and the straggler, with no spare, was removed within its window because that is faster.
    (reslot,) = jitter["events"]
    assert reslot["reslotted"] == ["h1"] and reslot["decision"]["action"] == "remove"
    assert reslot["decision"]["window_steps"][1] <= 12 + jitter["straggler_window"] + 2
    # A heterogeneous cluster (h1 2x slower, h2 1.5x): shards moved, the world never changed.
    mixed = drill["summaries"]["heterogeneous cluster"]
    assert mixed["events"] == [] and mixed["params_fingerprint"] == drill["reference_fingerprint"]
    first = mixed["assignment"]["decisions"][0]
    old, new = first["old_shards"], first["new_shards"]
    assert new[1] <= new[2] < old[2] == old[1] and new[0] > old[0] and new[3] > old[3]
    for png in ("loss.png", "timeline.png", "lifecycle.png"):
        assert (out / png).stat().st_size > 10_000, png
    assert "| partial cluster loss | `kill_region:eu@12` |" in (out / "table.md").read_text()
    # The fault-free elastic run is the one-process trajectory (invariant reduction).
    cfg = tiny_config(tmp_path / "ref", f"train.steps={drill['steps']}", "checkpoint.enabled=false")
    assert Trainer(cfg, devices=jax.devices()[:8]).run()["params_fingerprint"] == drill["reference_fingerprint"]
