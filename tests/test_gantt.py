"""The per-host Gantt chart (resilient_jax.gantt): journals -> phase spans, pure; then the PNG."""

from __future__ import annotations

import json

from resilient_jax import gantt
from resilient_jax.plot import main as plot_main


def _journal(run_dir, host, lines):
    path = run_dir / "elastic" / "lifecycle" / f"{host}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"host": host, "state": s, "wall": w, "event": e, "reason": ""}) + "\n"
                            for s, w, e in lines) + '{"torn by a kil')


def _run_with_a_death(run_dir):
    """h0 survives a fault at wall 110 (h1 killed while training), leaves at 112, re-forms, compiles, trains on."""
    _journal(run_dir, "h0", [("waiting", 100, None), ("joining", 101, "world"), ("restoring", 102, "from_disk"),
                             ("compiling", 103, "state_ready"), ("training", 105, "compiled"),
                             ("leaving", 112, "step_failed"), ("waiting", 113, "left"), ("joining", 114, "world"),
                             ("adopting", 115, "from_peer"), ("compiling", 116, "state_ready"),
                             ("training", 120, "compiled"), ("done", 130, "finished")])
    _journal(run_dir, "h1", [("waiting", 100, None), ("joining", 101, "world"), ("restoring", 102, "from_disk"),
                             ("compiling", 103, "state_ready"), ("training", 105, "compiled")])
    (run_dir / "elastic" / "timeline.json").write_text(json.dumps(
        [{"host": "h1", "wall": 109.5, "generation": 0, "step": 3}, {"host": "h0", "wall": 129.0, "generation": 1,
                                                                     "step": 9}]))
    (run_dir / "summary.json").write_text(json.dumps({"events": [
        {"reason": "failure", "lost": ["h1"], "origin_wall": 110.0, "recovery_seconds": 10.5}]}))


def test_spans_split_the_failed_step_at_the_fault_and_end_a_killed_host_at_its_last_step(tmp_path):
    _run_with_a_death(tmp_path)
    run = gantt.read_run(tmp_path)
    by_host = {h: [(s.phase, s.start, s.end) for s in run.spans if s.host == h] for h in ("h0", "h1")}
    assert by_host["h0"] == [
        ("starting", 100, 101), ("starting", 101, 102), ("starting", 102, 103), ("compiling", 103, 105),
        ("training", 105, 110.0), ("detecting", 110.0, 112), ("re-forming", 112, 113), ("re-forming", 113, 114),
        ("re-forming", 114, 115), ("adopting", 115, 116), ("compiling", 116, 120), ("training", 120, 130)]
    # h1 was killed while training: no line says so; its span ends at its last completed step.
    assert by_host["h1"][-1] == ("training", 105, 109.5)
    assert run.start == 100 and run.recoveries[0]["recovery_seconds"] == 10.5


def test_a_single_process_run_has_no_lifecycle(tmp_path):
    assert gantt.read_run(tmp_path) is None


def test_plot_cli_draws_the_lifecycle_png_of_an_elastic_run(tmp_path):
    _run_with_a_death(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": k, "loss": 5.0 - 0.1 * k, "lr": 1e-3, "tokens_per_s": 1000.0}) + "\n" for k in range(1, 10)))
    assert plot_main([str(tmp_path), "--out", str(tmp_path / "plots")]) == 0
    png = tmp_path / "plots" / "lifecycle.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_a_survivor_of_a_broken_group_is_idle_while_the_other_group_trains_and_rows_name_their_group(tmp_path):
    # Replica groups (us: h0+h1, eu: h2+h3): h1 dies at 110; h0 leaves and waits, idle, while h2
    # and h3 train on; h4 takes h1's slot at 140 and the us group rejoins.
    tail = [("joining", 140, "world"), ("adopting", 141, "from_peer"), ("compiling", 142, "state_ready"),
            ("training", 145, "compiled"), ("done", 150, "finished")]
    start = [("waiting", 100, None), ("joining", 101, "world"), ("restoring", 102, "from_disk"),
             ("compiling", 103, "state_ready"), ("training", 105, "compiled")]
    _journal(tmp_path, "h0", start + [("leaving", 112, "step_failed"), ("waiting", 113, "left")] + tail)
    _journal(tmp_path, "h1", start)
    for host in ("h2", "h3"):
        _journal(tmp_path, host, start + [("leaving", 112, "step_failed"), ("waiting", 113, "left"),
                                          ("joining", 114, "world"), ("adopting", 115, "from_peer"),
                                          ("compiling", 116, "state_ready"), ("training", 120, "compiled"),
                                          ("leaving", 138, "world_change"), ("waiting", 139, "left")] + tail)
    steps = [{"host": h, "wall": w, "generation": 1, "step": 9} for h in ("h2", "h3") for w in (125.0, 130.0)]
    # h0's and h2's own generation-0 steps; h3's last generation-0 step recorded late, at 113.2,
    # inside h2's wait: a step of the old world, so h2's wait stays re-forming.
    steps += [{"host": h, "wall": 108.0, "generation": 0, "step": 3} for h in ("h0", "h2")]
    steps += [{"host": "h3", "wall": 113.2, "generation": 0, "step": 3}]
    (tmp_path / "elastic" / "timeline.json").write_text(json.dumps(steps + [{"host": "h1", "wall": 109.5}]))
    groups = [{"region": "us", "slots": ["h0", "h4"]}, {"region": "eu", "slots": ["h2", "h3"]}]
    (tmp_path / "summary.json").write_text(json.dumps({"replica_groups": groups, "events": [
        {"reason": "failure", "lost": ["h1"], "origin_wall": 110.0, "recovery_seconds": 10.0}]}))
    run = gantt.read_run(tmp_path)
    phase_at = lambda host, t: [s.phase for s in run.spans if s.host == host and s.start <= t < s.end]  # noqa: E731
    assert phase_at("h0", 130) == ["idle"]  # h0 waited through the eu group's steps
    assert phase_at("h2", 113.5) == ["re-forming"]  # a wait in which nobody trained is re-forming
    assert phase_at("h2", 139.5) == ["re-forming"]
    assert run.labels["h0"] == "h0 · group 0 (us)" and run.labels["h3"] == "h3 · group 1 (eu)"
    assert "h1" not in run.labels  # h1's slot went to h4
