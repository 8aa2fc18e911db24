"""A heterogeneous cluster: one host persistently 2x slower, proportional vs uniform shard assignment.

    python scripts/bench_assignment.py [--steps 60] [--slow 3@5:2] [--config configs/cpu-4host.yaml]

Three runs of the same config on this machine, one after the other: fault-free, the slow host with
`runtime.assignment=proportional` (the default: its shards move to the fast hosts), and the slow host
with `runtime.assignment=uniform` (today's behaviour: every host keeps its share; the straggler
check may still remove it, and then the figure says so). Reported per run: summary
`tokens_per_second` (the whole run), tokens/s over the steps after the first re-plan (from the
controller's per-host timeline: step wall times of the slowest host), the re-plans with their
numbers, and the fingerprint, which must be the same for all three (exact reduction).

Both throughput figures count training time only (a re-formation, if the uniform run's straggler
check removes the slow host, is left out of both, which favours the uniform run).

Cost of re-planning: the planner is a pure function run on every host at the step boundary
(microseconds); the step after a re-plan re-reads its batch for the new rows (the loader's
read-ahead is dropped). The planning and the loader switch are each decision's `replan_seconds`;
the re-read shows as that step's data wait, part of its `ready_seconds` in the timeline, reported
here as `replan_step_ready_seconds` against the median.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from child_run import run_quietly  # noqa: E402  (a script next to this one)
from cli_args import config_file, load_config_or_exit  # noqa: E402


def train(config: str, steps: int, run_dir: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "resilient_jax.train", "--config", config, "--set", f"run.dir={run_dir}",
           "--set", f"train.steps={steps}", "--set", "checkpoint.enabled=false", *extra]
    run_quietly(cmd, REPO)
    return json.loads((run_dir / "summary.json").read_text())


def step_walls(run_dir: Path) -> dict[int, float]:
    """Per step: the longest host's ready + in-step seconds (the step's wall time)."""
    walls: dict[int, float] = {}
    for r in json.loads((run_dir / "elastic" / "timeline.json").read_text()):
        walls[r["step"]] = max(walls.get(r["step"], 0.0), r["ready_seconds"] + r["step_seconds"])
    return walls


def tokens_per_second(walls: dict[int, float], first: int, tokens_per_step: int) -> float:
    chosen = [w for k, w in walls.items() if k >= first]
    return tokens_per_step * len(chosen) / sum(chosen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--slow", default="3@5:2", help="slow_host's HOST@STEP:FACTOR")
    parser.add_argument("--config", type=config_file, default=str(REPO / "configs" / "cpu-4host.yaml"))
    args = parser.parse_args()
    cfg = load_config_or_exit(parser, args.config)
    tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
    work = Path(tempfile.mkdtemp(prefix="bench-assignment-"))
    slow = ["--fault", f"slow_host:{args.slow}"]
    runs = {"fault_free": [], "proportional": slow, "uniform": [*slow, "--set", "runtime.assignment=uniform"]}
    try:
        summaries = {name: train(args.config, args.steps, work / name, extra) for name, extra in runs.items()}
        decisions = summaries["proportional"]["assignment"]["decisions"]
        # Compare the steady part: from the step after the first re-plan (the same steps in every run).
        first = decisions[0]["step"] + 1 if decisions else args.steps
        report = {}
        for name, summary in summaries.items():
            walls = step_walls(work / name)
            report[name] = {
                "tokens_per_second": round(summary["tokens_per_second"]),
                "tokens_per_second_after_replan": round(tokens_per_second(walls, first, tokens_per_step)),
                "fingerprint": summary["params_fingerprint"][:16],
                "straggler_decisions": [d["action"] for d in summary["straggler_decisions"]],
                "generations": summary["generations"],
            }
        walls = step_walls(work / "proportional")
        ready = {r["step"]: r["ready_seconds"] for r in json.loads(
            (work / "proportional" / "elastic" / "timeline.json").read_text()) if r["host"] == "h0"}
        p, u = report["proportional"], report["uniform"]
        print(json.dumps({
            "config": args.config, "steps": args.steps, "slow_host": args.slow,
            "runs": report,
            "replans": [{k: d.get(k) for k in ("step", "kind", "old_shards", "new_shards", "cost_per_shard_seconds",
                                               "predicted_step_seconds", "replan_seconds")} for d in decisions],
            "replan_step_ready_seconds": {"after_replan": [round(ready.get(d["step"], 0.0), 4) for d in decisions],
                                          "median": round(statistics.median(ready.values()), 4)},
            "throughput_ratio_proportional_vs_uniform": round(p["tokens_per_second"] / u["tokens_per_second"], 3),
            "throughput_ratio_after_replan": round(p["tokens_per_second_after_replan"]
                                                   / u["tokens_per_second_after_replan"], 3),
            "same_fingerprint": len({r["fingerprint"] for r in report.values()}) == 1,
        }, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
