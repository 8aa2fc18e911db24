"""Per-host Gantt chart of an elastic run: which state each host was in, when, and what recovery cost.

Reads the lifecycle journals the workers append (RUN_DIR/elastic/lifecycle/HOST.jsonl, one line per
transition of `resilient_jax.elastic.lifecycle`) and the run's summary.json (its fault events, with
their wall-clock origin and recovery seconds). The phases drawn are the issue's vocabulary:

    training    TRAINING, up to the fault's origin when a fault ended it
    detecting   from the fault's origin to the host leaving the failed step
    starting    WAITING + JOINING + RESTORING before the host's first world trained
    re-forming  LEAVING + WAITING + JOINING (+ RESTORING) after it
    adopting    ADOPTING
    compiling   COMPILING
    idle        WAITING after training while other hosts trained on: live but in no world -- a
                survivor of a broken replica group (parallel.hosts_per_replica > 1), or a spare

With replica groups, each host's row is labelled with its group (summary.json's replica_groups).

A host killed mid-state leaves no line for its death: its last span ends at its last step in the
controller's timeline.json (else its last transition). `spans` is pure (lines -> spans), so it is
tested without matplotlib; `draw` needs it (the `plot` extra).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from resilient_jax.elastic.lifecycle import State

PHASE_OF = {
    State.TRAINING.value: "training",
    State.LEAVING.value: "re-forming", State.WAITING.value: "re-forming", State.JOINING.value: "re-forming",
    State.RESTORING.value: "re-forming",
    State.ADOPTING.value: "adopting",
    State.COMPILING.value: "compiling",
}
COLORS = {"starting": "tab:gray", "training": "tab:green", "detecting": "tab:red", "re-forming": "tab:orange", "adopting": "tab:purple",
          "compiling": "tab:blue", "idle": "tab:olive"}


@dataclass(frozen=True)
class Span:
    host: str
    phase: str
    start: float  # wall clock, seconds
    end: float


@dataclass
class RunTimeline:
    name: str
    spans: list[Span]
    recoveries: list[dict]  # summary events with a fault: origin_wall, recovery_seconds, lost
    start: float  # the earliest journal line
    labels: dict[str, str] | None = None  # host -> row label (its replica group); None: the host name


def read_journals(run_dir: Path) -> dict[str, list[dict]]:
    """Every host's journal lines, in order; torn last lines (a kill mid-write) skipped."""
    journals: dict[str, list[dict]] = {}
    for path in sorted((run_dir / "elastic" / "lifecycle").glob("*.jsonl")):
        lines = []
        for text in path.read_text().splitlines():
            try:
                lines.append(json.loads(text))
            except ValueError:
                continue
        if lines:
            journals[path.stem] = lines
    return journals


def step_walls(run_dir: Path) -> dict[str, list[tuple[float, int]]]:
    """Each host's completed steps as (wall clock, generation), from the controller's timeline.json."""
    path = run_dir / "elastic" / "timeline.json"
    try:
        timeline = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    walls: dict[str, list[tuple[float, int]]] = {}
    for record in timeline:
        walls.setdefault(record["host"], []).append((float(record["wall"]), int(record.get("generation", 0))))
    return walls


def group_labels(replica_groups: list[dict] | None) -> dict[str, str]:
    """host -> "h0 · group 0 (us)" from summary.json's replica_groups ({region, slots}); empty without groups."""
    labels: dict[str, str] = {}
    for index, group in enumerate(replica_groups or []):
        for host in group.get("slots") or []:
            if host is not None:
                labels[host] = f"{host} · group {index} ({group.get('region', '?')})"
    return labels


def spans(journals: dict[str, list[dict]], fault_origins: list[float],
          steps: dict[str, list[tuple[float, int]]] | None = None) -> list[Span]:
    """Phase spans per host. A TRAINING span that a failure ended (its next line says step_failed) is
    split at the latest fault origin inside it: the rest was spent detecting. A WAITING span after
    the host had trained, during which another host completed a step of a LATER generation than
    this host's last (`steps`: host -> (wall, generation) of each step), is idle: the run went on
    in a world without it. (The generation, not the clock alone, decides: a step of the old world
    recorded late, or another node's clock running ahead, does not make a re-formation idle.)"""
    steps = steps or {}
    host_ends = {host: max(t for t, _ in walls) for host, walls in steps.items()}  # each host's last step

    def others_stepped(host: str, start: float, end: float) -> bool:
        own = max((g for t, g in steps.get(host, []) if t <= start), default=-1)
        return any(start < t < end and g > own for other, walls in steps.items() if other != host for t, g in walls)

    out: list[Span] = []
    for host, lines in journals.items():
        trained = False
        for line, following in zip(lines, lines[1:] + [None]):
            phase = PHASE_OF.get(line["state"])
            if phase is None:
                continue
            trained = trained or phase == "training"
            if phase == "re-forming" and not trained:
                phase = "starting"
            start = float(line["wall"])
            end = float(following["wall"]) if following else max(host_ends.get(host, start), start)
            if line["state"] == State.WAITING.value and trained and others_stepped(host, start, end):
                phase = "idle"
            if phase == "training" and following and following.get("event") == "step_failed":
                origin = max((t for t in fault_origins if start <= t <= end), default=None)
                if origin is not None:
                    out.append(Span(host, "training", start, origin))
                    start, phase = origin, "detecting"
            if end > start:
                out.append(Span(host, phase, start, end))
    return out


def read_run(run_dir: Path, name: str | None = None) -> RunTimeline | None:
    """The run's timeline, or None when it has no lifecycle journals (a single-process run)."""
    journals = read_journals(run_dir)
    if not journals:
        return None
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    recoveries = [e for e in summary.get("events", []) if e.get("reason") == "failure" and e.get("origin_wall")]
    origins = [float(e["origin_wall"]) for e in recoveries]
    return RunTimeline(name or run_dir.name, spans(journals, origins, step_walls(run_dir)), recoveries,
                       min(float(lines[0]["wall"]) for lines in journals.values()),
                       group_labels(summary.get("replica_groups")) or None)


def draw(ax, run: RunTimeline, t0: float | None = None) -> None:
    """One row per host; seconds since `t0` (default: the run's own start) on the x axis."""
    t0 = run.start if t0 is None else t0
    hosts = sorted({s.host for s in run.spans}, key=lambda h: (len(h), h))
    labelled: set[str] = set()
    for i, host in enumerate(hosts):
        for phase, color in COLORS.items():
            bars = [(s.start - t0, s.end - s.start) for s in run.spans if s.host == host and s.phase == phase]
            if bars:
                ax.broken_barh(bars, (i - 0.4, 0.8), color=color, label=None if phase in labelled else phase)
                labelled.add(phase)
    for event in run.recoveries:
        x = float(event["origin_wall"]) - t0
        ax.axvline(x, color="k", lw=0.8, ls="--")
        lost = ",".join(event.get("lost") or []) or "?"
        ax.annotate(f"{lost} lost: recovered in {event['recovery_seconds']:.1f} s"
                    if event.get("recovery_seconds") is not None else f"{lost} lost",
                    (x, len(hosts) - 0.4), fontsize=7, rotation=0, va="bottom")
    labels = run.labels or {}
    ax.set_yticks(range(len(hosts)), [labels.get(h, h) for h in hosts])
    ax.set_ylim(-0.6, len(hosts) + 0.4)
    ax.set_title(run.name, fontsize=9)
    ax.grid(axis="x", alpha=0.3)


def write(runs: list[RunTimeline], path: Path, *, shared_axis: bool = True) -> Path:
    """One panel per run, stacked; with `shared_axis` every panel's x axis is seconds since its own start,
    on one common scale, so recoveries compare at a glance."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 0.5 + sum(0.45 * len({s.host for s in r.spans}) + 0.8 for r in runs)), dpi=110)
    axes = fig.subplots(len(runs), 1, sharex=shared_axis, squeeze=False)[:, 0]
    for ax, run in zip(axes, runs):
        draw(ax, run)
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="upper right", fontsize=7, ncol=len(handles))
    axes[-1].set_xlabel("seconds since the run's first host started (dashed: a fault; label: its recovery)")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
