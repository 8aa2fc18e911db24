"""Does the exact reduction train like the float one? Loss curves of `invariant` and `native` against
native's own run-to-run noise (another train.seed), side by side.

Three runs of --config (default tiny, 300 steps, a loss logged every step), each in its own process:
    invariant, seed S      native, seed S      native, seed S+1
The two reductions share everything but the order and rounding of the gradient sum, so their
curves should differ by far less than two seeds do (another initialisation, data order and dropout).
Reported over the steps, on the per-step losses and on a moving average (--window):
    mean_abs_diff, max_abs_diff        invariant vs native (same seed), and native vs native (seed + 1)
    ratio_mean_abs_diff                the first over the second (< 1: within the noise)
and the final losses; --plot writes the three curves to a PNG (matplotlib).

    python scripts/bench_loss_curves.py [--config configs/tiny.yaml] [--steps 300] [--seed 0] [--window 20]
                                        [--plot loss_curves.png] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_args import at_least, config_file, load_config_or_exit, output_file  # noqa: E402  (a script next to this one)


def run(config: str, overrides: list[str], run_dir: Path) -> np.ndarray:
    """The per-step losses (`loss_last` of each logged step) of one training run."""
    cmd = [sys.executable, "-m", "resilient_jax.train", "--config", config, "--set", f"run.dir={run_dir}",
           "--set", "run.progress=quiet", "--set", "train.log_every=1", *[a for o in overrides for a in ("--set", o)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"error: {' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    losses = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss_last" in record and "event" not in record:
            losses[record["step"]] = record["loss_last"]
    return np.array([losses[k] for k in sorted(losses)])


def moving_average(x: np.ndarray, window: int) -> np.ndarray:
    return np.convolve(x, np.ones(window) / window, mode="valid")


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    diff = np.abs(a - b)
    return {"mean_abs_diff": float(diff.mean()), "max_abs_diff": float(diff.max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=config_file, default=str(REPO / "configs" / "tiny.yaml"))
    parser.add_argument("--steps", type=at_least(1), default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=at_least(1), default=20)
    parser.add_argument("--plot", default="", help="write the curves to this PNG")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    # Checked now, not after the three runs: the config and --set (read by child processes) and
    # where --plot writes, with what.
    load_config_or_exit(parser, args.config, args.overrides)
    if args.plot:
        args.plot = str(output_file(parser, "--plot", args.plot))
        if importlib.util.find_spec("matplotlib") is None:
            parser.error("--plot needs matplotlib, which this Python lacks; pip install matplotlib or leave out --plot")

    runs = {}
    with tempfile.TemporaryDirectory(prefix="bench-loss-curves-") as work:
        for name, reduction, seed in (("invariant", "invariant", args.seed), ("native", "native", args.seed),
                                      ("native_other_seed", "native", args.seed + 1)):
            print(f"{name}: parallel.reduction={reduction} train.seed={seed}", file=sys.stderr, flush=True)
            runs[name] = run(args.config, [*args.overrides, f"train.steps={args.steps}",
                                           f"parallel.reduction={reduction}", f"train.seed={seed}"], Path(work) / name)
    smooth = {name: moving_average(x, args.window) for name, x in runs.items()}
    report = {"config": args.config, "steps": args.steps, "seed": args.seed, "window": args.window,
              "final_loss": {name: float(x[-1]) for name, x in runs.items()}}
    for label, curves in (("per_step", runs), ("moving_average", smooth)):
        reductions = compare(curves["invariant"], curves["native"])
        seeds = compare(curves["native"], curves["native_other_seed"])
        report[label] = {"invariant_vs_native": reductions, "native_vs_native_other_seed": seeds,
                         "ratio_mean_abs_diff": reductions["mean_abs_diff"] / seeds["mean_abs_diff"]}
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for name, x in runs.items():
            ax.plot(np.arange(1, len(x) + 1), x, label=name, linewidth=0.8, alpha=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(f"{Path(args.config).name}: invariant vs native (seed {args.seed}) and native (seed {args.seed + 1})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        report["plot"] = args.plot
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
