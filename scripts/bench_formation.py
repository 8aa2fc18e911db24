"""Formation time after a killed host, for a 10x larger dataset and a ~14 M-param model vs tiny.

A re-formed world's cost must not grow with the dataset (each host verifies the dataset once per
run, later worlds check its identity) nor with the model (survivors keep their own copy of the
state; nothing state-sized is sent). Three elastic runs of configs/cpu-4host.yaml, one after the
other, each with host 1 SIGKILLed during step --kill-step:

    tiny      the config as it is (default dataset: the 8 MiB stdlib corpus)
    data x10  the same model on a dataset prepared from that corpus repeated 10 times
    small     the model of configs/small.yaml (d_model 384, 8 layers, seq_len 256; ~14 M params)

Formation = from the kill to the moment the slowest survivor has the next world's state in place
and starts compiling (lifecycle journals: entering COMPILING in the new generation). It covers
detection, the controller's decision, joining the world (backend, collectives) and adopting the
state; compiling is left out (the compile cache and the background precompile handle that, see
bench_recovery.py). It includes the rest of the step in flight when the host died: a survivor
finds the death at that step's first collective, and an XLA program on CPU cannot be interrupted
before it -- one step of the larger model is seconds on this machine. So the survivors' own part
is also reported: from the last survivor's failed step ending (entering LEAVING) to the last
survivor compiling in the new world.
Printed as JSON with the ratios to tiny.

    python scripts/bench_formation.py [--kill-step 6] [--steps 10] [--repeat 1] [--no-small]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_args import at_least  # noqa: E402  (a script next to this one)
CPU4 = REPO / "configs" / "cpu-4host.yaml"
SMALL_MODEL = ["model.d_model=384", "model.n_layers=8", "model.n_heads=6", "model.d_ff=1024",
               "data.seq_len=256", "data.global_batch=24"]


def prepare_scaled_dataset(work: Path, scale: int) -> Path:
    """The default corpus repeated `scale` times, prepared as the default dataset is (bytes, seq 64)."""
    from bench_data import write_default_corpus  # scripts/ is on sys.path when this script runs

    src = write_default_corpus(work / f"corpus-x{scale}.jsonl", scale)
    out = work / f"dataset-x{scale}"
    subprocess.run([sys.executable, "-m", "resilient_jax.data", "prepare", "--src", str(src), "--out", str(out),
                    "--shards", "16", "--seq-len", "64", "--tokenizer", "bytes"],
                   check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    src.unlink()
    return out


def run(run_dir: Path, kill_step: int, steps: int, sets: list[str]) -> dict:
    cmd = [sys.executable, "-m", "resilient_jax.train", "--config", str(CPU4), "--set", f"run.dir={run_dir}",
           "--set", f"train.steps={steps}", "--set", "checkpoint.enabled=false",
           "--fault", f"kill_host:1@{kill_step}"]
    for item in sets:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run in {run_dir} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    (event,) = [e for e in summary["events"] if e["reason"] == "failure"]
    ready, left = [], []  # per survivor
    for journal in sorted((run_dir / "elastic" / "lifecycle").glob("*.jsonl")):
        entries = [json.loads(line) for line in journal.read_text().splitlines()]
        worlds = [i for i, e in enumerate(entries) if e["event"] == "world"]
        if len(worlds) < 2:
            continue  # the killed host
        ready.append(next(e["wall"] for e in entries[worlds[1]:] if e["state"] == "compiling"))
        left.append(next(e["wall"] for e in entries[:worlds[1]] if e["state"] == "leaving"))
    return {
        "params": summary["num_params"],
        "dataset_version": summary["dataset_version"][:12],
        "formation_seconds": round(max(ready) - event["origin_wall"], 3),
        "formation_after_failed_step_seconds": round(max(ready) - max(left), 3),
        "detection_seconds": event["detection_seconds"],
        "recovery_seconds": event["recovery_seconds"],
        "steps_lost": summary["steps_lost"],
        "restarts": summary["restarts"],
    }


def _median(results: list[dict]) -> dict:
    """The first round's record, its timings replaced by the medians over rounds."""
    out = dict(results[0], rounds=len(results))
    for key in ("formation_seconds", "formation_after_failed_step_seconds", "detection_seconds", "recovery_seconds"):
        out[key] = round(statistics.median(r[key] for r in results), 3)
    out["steps_lost"] = max(r["steps_lost"] for r in results)
    out["restarts"] = max(r["restarts"] for r in results)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill-step", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--scale", type=int, default=10, help="how many times larger the big dataset is")
    parser.add_argument("--repeat", type=at_least(1), default=1,
                        help="rounds of the three runs (interleaved, so machine noise hits all alike); "
                             "each figure is the median over rounds")
    parser.add_argument("--no-small", action="store_true", help="leave out the small model (its runs take minutes)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-formation-"))
    variants = {"tiny": [], f"data_x{args.scale}": None, **({} if args.no_small else {"small": SMALL_MODEL})}
    rounds: dict[str, list[dict]] = {name: [] for name in variants}
    try:
        variants[f"data_x{args.scale}"] = [f"data.dataset={prepare_scaled_dataset(work, args.scale)}"]
        for i in range(args.repeat):
            for name, sets in variants.items():
                rounds[name].append(run(work / f"{name}-{i}", args.kill_step, args.steps, sets))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    runs = {name: _median(results) for name, results in rounds.items()}
    base = runs["tiny"]["formation_seconds"]
    report = {"kill_step": args.kill_step, "runs": runs,
              **{f"ratio_formation_{name}_vs_tiny": round(r["formation_seconds"] / base, 2)
                 for name, r in runs.items() if name != "tiny"},
              **{f"ratio_formation_after_failed_step_{name}_vs_tiny":
                 round(r["formation_after_failed_step_seconds"] / runs["tiny"]["formation_after_failed_step_seconds"], 2)
                 for name, r in runs.items() if name != "tiny"}}
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
