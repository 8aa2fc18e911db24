"""Goodput under faults: a run with three injected faults vs the fault-free run, side by side.

    python scripts/bench_goodput.py [--steps 300] [--config configs/cpu-4host.yaml] [--set KEY=VALUE ...]

`--set` applies to both runs, e.g. `--set runtime.precompile_next_worlds=on` (rank 0 compiles the
likely next worlds while it trains; on this CPU machine that takes cores from the training).

Both runs train the same steps of the same config on this machine, one after the other. The useful
work is the fault-free run's training time (first step start -> last step end, from the
controller's per-host timeline; process start-up is the same for both and left out). Goodput of the
faulted run = that useful time / its own training time. Default faults, at 1/4, 1/2 and 3/4 of the
run: a killed host, a 5 s latency spike on a cross-region host, a hung host. Also reported: the
faults' direct cost (recovery seconds + waited-out stalls) and the goodput that cost alone gives,
since on a small CPU machine the shrunken world's faster steps hide part of it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from child_run import run_quietly  # noqa: E402  (a script next to this one)
from cli_args import at_least, config_file, load_config_or_exit  # noqa: E402


def train(config: str, steps: int, run_dir: Path, faults: list[str], sets: list[str]) -> dict:
    cmd = [sys.executable, "-m", "resilient_jax.train", "--config", config, "--set", f"run.dir={run_dir}",
           "--set", f"train.steps={steps}", "--set", "checkpoint.enabled=false"]
    for item in sets:
        cmd += ["--set", item]
    for fault in faults:
        cmd += ["--fault", fault]
    run_quietly(cmd, REPO)
    summary = json.loads((run_dir / "summary.json").read_text())
    timeline = json.loads((run_dir / "elastic" / "timeline.json").read_text())
    start = min(r["wall"] - r["step_seconds"] - r["ready_seconds"] for r in timeline)
    end = max(r["wall"] for r in timeline)
    return {
        "training_seconds": round(end - start, 2),
        "wall_seconds": round(summary["wall_seconds"], 2),
        "generations": summary["generations"],
        "steps_lost": summary["steps_lost"],
        "restarts": summary["restarts"],
        "fingerprint": summary["params_fingerprint"][:16],
        "events": [{k: e[k] for k in ("reason", "lost", "detection_seconds", "recovery_seconds")}
                   for e in summary["events"]],
        "stalls": [{k: s[k] for k in ("step", "late_host", "waited_seconds")} for s in summary["stalls"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=at_least(30), default=300)
    parser.add_argument("--config", type=config_file, default=str(REPO / "configs" / "cpu-4host.yaml"))
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for both runs (repeatable)")
    args = parser.parse_args()
    # The runs read the config in child processes: a typo would surface only as a failed run.
    load_config_or_exit(parser, args.config, args.sets)
    q = args.steps // 4
    faults = [f"kill_host:1@{q}", f"delay_host:3@{2 * q}-{2 * q}:5", f"hang_host:2@{3 * q}"]
    work = Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    try:
        clean = train(args.config, args.steps, work / "fault-free", [], args.sets)
        faulted = train(args.config, args.steps, work / "faulted", faults, args.sets)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # On a machine where fewer processes share the cores, the survivors' steps get faster and hide part
    # of what the faults cost; the direct cost -- recovery after each failure plus each waited-out
    # stall -- is reported next to the end-to-end figure.
    direct = (sum(e["recovery_seconds"] or 0 for e in faulted["events"])
              + sum(st["waited_seconds"] for st in faulted["stalls"] if st["late_host"]))
    report = {
        "config": args.config, "steps": args.steps, "faults": faults, "overrides": args.sets,
        "fault_free": clean, "faulted": faulted,
        "goodput": round(clean["training_seconds"] / faulted["training_seconds"], 3),
        "fault_seconds_direct": round(direct, 2),
        "goodput_direct": round(clean["training_seconds"] / (clean["training_seconds"] + direct), 3),
        "fingerprint_equal": clean["fingerprint"] == faulted["fingerprint"],
        "seconds_lost_to_faults": round(faulted["training_seconds"] - clean["training_seconds"], 2),
    }
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
