"""Recovery from a killed host: the elastic runtime vs a whole-job restart from the last checkpoint.

Elastic (what resilient_jax does): 4 hosts x 2 CPU devices, SIGKILL host 1 during step K; the
summary's event gives detection, re-formation and recovery seconds (kill -> next completed step).

Baseline (what a plain framework does): the same 4 hosts as a fixed JAX world checkpointing every
E steps. After the kill the whole job is relaunched, restores the last checkpoint (step E*floor(K/E))
and redoes the lost steps; we time relaunch -> step K completed again (detection not counted, in the
baseline's favour).

With --precompile the elastic run compiles its likely next worlds in the background
(runtime.precompile_next_worlds=on) and host 1 dies in the first step after that compile is done
(`kill_host:1@precompiled:0`); the baseline is then killed at the same step. Use enough --steps for
the background compile to finish first (it competes for this machine's cores).

    python scripts/bench_recovery.py [--kill-step 45] [--every 20] [--steps 60]
    python scripts/bench_recovery.py --precompile --steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from child_run import run_quietly  # noqa: E402  (a script next to this one)
from cli_args import at_least  # noqa: E402
CPU4 = REPO / "configs" / "cpu-4host.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill-step", type=int, default=45)
    parser.add_argument("--every", type=at_least(1), default=20, help="baseline checkpoint interval (steps)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--precompile", action="store_true",
                        help="compile the likely next worlds in the background; kill once that is done")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    try:  # the runs' directories go whatever happens (a failed run left them in /tmp)
        elastic = run_elastic(work / "elastic", args)
        if args.precompile:
            args.kill_step = elastic["killed_in_step"]
        baseline = run_baseline(work / "baseline", args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "kill_step": args.kill_step,
        "precompile": args.precompile,
        "elastic": elastic,
        "baseline": baseline,
        "ratio_recovery_elastic_vs_baseline": elastic["recovery_seconds"] / baseline["recovery_seconds"],
    }
    json.dump(report, sys.stdout, indent=2)
    print()


def run_elastic(run_dir: Path, args) -> dict:
    cmd = [sys.executable, "-m", "resilient_jax.train", "--config", str(CPU4), "--set", f"run.dir={run_dir}",
           "--set", f"train.steps={args.steps}", "--set", "checkpoint.enabled=false"]
    if args.precompile:
        cmd += ["--set", "runtime.precompile_next_worlds=on", "--fault", "kill_host:1@precompiled:0"]
    else:
        cmd += ["--fault", f"kill_host:1@{args.kill_step}"]
    run_quietly(cmd, REPO)
    summary = json.loads((run_dir / "summary.json").read_text())
    events = [e for e in summary["events"] if e["reason"] == "failure"]
    if not events:
        raise SystemExit("the elastic run ended before its fault fired (with --precompile: raise --steps so the "
                         "background compile finishes first)")
    (event,) = events
    compiles = [json.loads(line) for line in (run_dir / "metrics.jsonl").open() if '"compile"' in line]
    after = [c for c in compiles if c.get("event") == "compile" and c.get("generation") == event["generation"]]
    return {"detection_seconds": event["detection_seconds"], "reformation_seconds": event["reformation_seconds"],
            "recovery_seconds": event["recovery_seconds"],
            # The same run's launch -> first step done, and the recovery over it (target <= 0.35).
            "cold_start_seconds": summary.get("cold_start_seconds"),
            "recovery_vs_cold_start": event.get("recovery_vs_cold_start"), "steps_lost": summary["steps_lost"],
            "restarts": summary["restarts"], "fingerprint": summary["params_fingerprint"][:16],
            "killed_in_step": event["resume_step"] + 1,
            "new_world_compile": {k: after[0][k] for k in ("seconds", "cache_hit")} if after else None,
            "precompiled": summary.get("precompiled")}


def _static_job(run_dir: Path, stop_at: int, every: int, steps: int) -> float:
    """A fixed 4-process world (no controller) running to `stop_at`; returns its wall seconds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    procs = []
    for pid in range(4):
        env = {**os.environ, "RESILIENT_JAX_COORDINATOR": f"127.0.0.1:{port}", "RESILIENT_JAX_NUM_PROCESSES": "4",
               "RESILIENT_JAX_PROCESS_ID": str(pid)}
        cmd = [sys.executable, "-m", "resilient_jax.train", "--config", str(CPU4), "--set", "topology.regions=[]",
               "--set", "parallel.devices=2", "--set", f"run.dir={run_dir}", "--set", f"train.steps={steps}",
               "--set", f"checkpoint.every_steps={every}", "--set", "run.progress=quiet", "--stop-at", str(stop_at)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError("baseline job failed")
    return time.perf_counter() - t0


def run_baseline(run_dir: Path, args) -> dict:
    kill, every = args.kill_step, args.every
    _static_job(run_dir, kill, every, args.steps)  # the job up to the crash
    last = (kill // every) * every
    for step_dir in (run_dir / "checkpoints").iterdir():  # the crash loses what came after `last`
        if step_dir.name.isdigit() and int(step_dir.name) > last:
            shutil.rmtree(step_dir)
    relaunch = _static_job(run_dir, min(kill + 1, args.steps), every, args.steps)
    return {"recovery_seconds": relaunch, "restored_step": last, "steps_redone": kill - last, "restarts": 1}


if __name__ == "__main__":
    main()
