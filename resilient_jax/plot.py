"""`python -m resilient_jax.plot RUN_DIR [--out DIR]`: loss, learning-rate and throughput PNGs of a run.

Reads `RUN_DIR/metrics.jsonl` (single-process and elastic runs write the same records) and writes
`loss.png`, `lr.png` and `throughput.png` to `--out` (default `RUN_DIR/plots`); resumes are
marked with a dotted line at the step they continued from. An elastic run also gets `lifecycle.png`,
the per-host Gantt chart of its states with each fault's recovery seconds (resilient_jax.gantt). Needs matplotlib (`pip install -e
".[plot]"`). Exit codes: 0 written, 2 no metrics to plot (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from resilient_jax import gantt
from resilient_jax.metrics import METRICS_FILE


class PlotError(ValueError):
    """The run directory has nothing to plot."""


@dataclass
class Series:
    steps: list[int] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    resumes: list[int] = field(default_factory=list)

    def column(self, name: str) -> tuple[list[int], list[float]]:
        pairs = [(s, r[name]) for s, r in zip(self.steps, self.records) if r.get(name) is not None]
        return [p[0] for p in pairs], [p[1] for p in pairs]


def read_metrics(run_dir: Path) -> Series:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise PlotError(f"{path} not found: RUN_DIR must be a run.dir that training wrote to")
    by_step: dict[int, dict] = {}
    series = Series()
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line torn by a crash
        if record.get("event") == "resume":
            series.resumes.append(int(record["step"]))
        elif "loss" in record and isinstance(record.get("step"), int):
            by_step[record["step"]] = record  # the last record of a step is on the surviving branch
    if not by_step:
        raise PlotError(f"{path} holds no step records yet (the first is written after step 1)")
    series.steps = sorted(by_step)
    series.records = [by_step[s] for s in series.steps]
    return series


def _figure(title: str, ylabel: str, series: Series):
    from matplotlib.figure import Figure  # no pyplot: no global backend state, Agg via savefig

    fig = Figure(figsize=(8, 4.5), dpi=110)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel("step (updates completed)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    for i, step in enumerate(series.resumes):
        ax.axvline(step, color="grey", linestyle=":", linewidth=1, label="resumed" if i == 0 else None)
    return fig, ax


def write_plots(run_dir: Path, out: Path) -> list[Path]:
    series = read_metrics(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = _figure(f"loss: {run_dir.name}", "cross-entropy (nats/token)", series)
    ax.plot(*series.column("loss"), marker=".", label="mean over the logging window")
    if any("loss_last" in r for r in series.records):
        ax.plot(*series.column("loss_last"), linestyle="--", alpha=0.6, label="the logged step's own loss")
    ax.legend()
    written.append(_save(fig, out / "loss.png"))

    fig, ax = _figure(f"learning rate: {run_dir.name}", "learning rate", series)
    ax.plot(*series.column("lr"), marker=".", label="learning rate")
    ax.legend()
    written.append(_save(fig, out / "lr.png"))

    fig, ax = _figure(f"throughput: {run_dir.name}", "tokens/s", series)
    ax.plot(*series.column("tokens_per_s"), marker=".", color="tab:green", label="tokens/s")
    steps, mfu = series.column("mfu")
    if mfu:
        twin = ax.twinx()
        twin.plot(steps, [100 * m for m in mfu], color="tab:red", alpha=0.7, label="MFU")
        twin.set_ylabel("MFU (%)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right")
    written.append(_save(fig, out / "throughput.png"))

    if (timeline := gantt.read_run(run_dir)) is not None:
        written.append(gantt.write([timeline], out / "lifecycle.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m resilient_jax.plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run.dir (single-process or elastic)")
    parser.add_argument("--out", type=Path, default=None, help="where to write the PNGs (default RUN_DIR/plots)")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print('error: python -m resilient_jax.plot needs matplotlib: pip install -e ".[plot]"', file=sys.stderr)
        return 2
    try:
        written = write_plots(args.run_dir, args.out or args.run_dir / "plots")
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
