"""The chaos drill: the four fault classes, injected into real multi-process runs on this machine.

    python scripts/chaos_drill.py [--quick] [--out runs/chaos-drill]

Runs the fault-free run and one run per scenario with the same config and step count:
  1. hardware fault         kill a host (rank 0, the hardest one) with SIGKILL mid-step
  2. network jitter         a multi-second latency spike on a cross-region host, then a
                            persistent straggler on another host, with runtime.assignment=uniform
                            (no spare: removed if faster)
     heterogeneous cluster  one host persistently 2x slower, another 1.5x, with the default
                            proportional assignment: their virtual shards move to the fast hosts
                            (resilient_jax.assignment), no re-formation, not one bit changed
  3. partial cluster loss   SIGKILL every host of one region at once
  4. data shard skew        a data shard that yields NaN loss weights

and prints one table row per injected fault -- what was injected, the response the run took,
detection / recovery seconds, steps lost, restarts, and whether the final params fingerprint
equals the fault-free run's. Writes drill.json, table.md, loss.png (loss vs step with fault
markers), timeline.png (per-host step times and generations) and lifecycle.png (per-host Gantt
chart: training / detecting / re-forming / adopting / compiling, each fault's recovery seconds
annotated, all runs on one time axis) to --out. Exits 0 only when
every row holds: restarts 0, steps lost 0, fingerprint equal, and the expected response.

A data fault changes the data by design, so its row is compared with the fault-free run that
leaves the same shard out from the same step (data.quarantine) without ever reading a NaN -- run
as one process on the same number of devices (`one_process_sets`): with the invariant reduction
its trajectory is any host count's, and it takes about half an elastic launch's time.

--quick (what CI runs): configs/cpu-4host.yaml, 45 steps. Default: configs/cpu-6host-3region.yaml,
90 steps.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Scenario:
    name: str
    faults: tuple[str, ...]
    sets: tuple[str, ...] = ()


@dataclass
class Row:
    fault_class: str
    injected: str
    response: str
    detection_seconds: float | None
    recovery_seconds: float | None
    steps_lost: int
    restarts: int
    fingerprint_equal: bool
    expected: bool  # the response is the one this fault class calls for
    notes: list[str] = field(default_factory=list)

    @property
    def holds(self) -> bool:
        return self.restarts == 0 and self.steps_lost == 0 and self.fingerprint_equal and self.expected


def plan(quick: bool) -> tuple[str, int, list[Scenario]]:
    if quick:
        config, steps = "configs/cpu-4host.yaml", 45
        # 4 hosts: h0,h1 in us, h2,h3 in eu.
        return config, steps, [
            Scenario("hardware fault", ("kill_host:0@12",)),
            Scenario("network jitter", ("delay_host:2@8-8:6", "slow_host:1@12:8"), ("runtime.assignment=uniform",)),
            Scenario("heterogeneous cluster", ("slow_host:1@8:2", "slow_host:2@8:1.5")),
            Scenario("partial cluster loss", ("kill_region:eu@12",)),
            Scenario("data shard skew", ("nan_shard:3@12",)),
        ]
    config, steps = "configs/cpu-6host-3region.yaml", 90
    # 6 hosts: h0,h1 in us, h2,h3 in eu, h4,h5 in ap.
    return config, steps, [
        Scenario("hardware fault", ("kill_host:0@20",)),
        Scenario("network jitter", ("delay_host:4@15-16:8", "slow_host:3@25:6"), ("runtime.assignment=uniform",)),
        Scenario("heterogeneous cluster", ("slow_host:1@15:2", "slow_host:4@15:1.5")),
        Scenario("partial cluster loss", ("kill_region:eu@20",)),
        Scenario("data shard skew", ("nan_shard:3@20",)),
    ]


def run(config: str, steps: int, run_dir: Path, faults: tuple[str, ...], sets: tuple[str, ...] = ()) -> dict:
    cmd = [sys.executable, "-m", "resilient_jax.train", "--config", config, "--set", f"run.dir={run_dir}",
           "--set", f"train.steps={steps}", "--set", "train.log_every=1", "--set", "checkpoint.enabled=false"]
    for s in sets:
        cmd += ["--set", s]
    for f in faults:
        cmd += ["--fault", f]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"drill: run {' '.join(faults) or 'fault-free'} failed (exit {proc.returncode}); logs in "
                         f"{run_dir}/elastic/logs\n{proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["drill_wall_seconds"] = time.perf_counter() - started
    return summary


def one_process_sets(cfg) -> tuple[str, ...]:
    """Overrides that run `cfg`'s elastic world as ONE process on as many emulated devices, for a
    fault-free reference: with the invariant reduction a trajectory does not depend on the host
    count (tests/test_invariance.py), so this is the run every elastic one must end on, at the cost
    of one process's start-up instead of a controller's and every worker's. () where that does not
    hold or one process cannot stand for the world (native sums; replica groups spanning hosts; a
    world that is not emulated CPU devices on this machine: parallel.devices sets only those)."""
    if (cfg.parallel.reduction != "invariant" or cfg.parallel.hosts_per_replica != 1
            or cfg.runtime.launcher != "local"):
        return ()
    devices = cfg.topology.devices_per_host * sum(region.hosts for region in cfg.topology.regions)
    return ("topology.regions=[]", f"parallel.devices={devices}")


def rows_for(scenario: Scenario, summary: dict, reference: str) -> list[Row]:
    """`reference`: the fault-free run's fingerprint -- for a data fault, the fault-free run with the
    bad shard cleanly excluded from the step it was quarantined at (its data differs by design)."""
    common = dict(steps_lost=summary["steps_lost"], restarts=summary["restarts"],
                  fingerprint_equal=summary["params_fingerprint"] == reference)
    events = summary["events"]
    rows = []
    for spec in scenario.faults:
        kind, target, step = _parse(spec)
        if kind in ("kill_host", "kill_region"):
            failures = [e for e in events if e["reason"] == "failure"]
            event = failures[0] if failures else None
            expected_lost = [f"h{target}"] if kind == "kill_host" else None
            ok = len(failures) == 1 and (expected_lost is None or event["lost"] == expected_lost)
            response = (f"re-formed without {', '.join(event['lost'])}: generation {event['generation']}, "
                        f"resumed at step {event['resume_step']} from a survivor's memory") if event else "none"
            rows.append(Row(scenario.name, spec, response, event and event["detection_seconds"],
                            event and event["recovery_seconds"], expected=ok, **common))
        elif kind == "delay_host":
            stalls = [s for s in summary["stalls"] if s["late_host"] == f"h{target}"]
            # The spike itself changes nothing: the stall is waited out inside generation 0, and the
            # only world change in this scenario is the straggler's reslot.
            bad = [e for e in events if e["reason"] != "reslot"]
            ok = bool(stalls) and stalls[0]["generation"] == 0 and not bad
            stall = stalls[0] if stalls else None
            response = (f"waited out a {stall['waited_seconds']:.1f} s step (stall deadline "
                        f"{stall['deadline_seconds']:.1f} s, all members alive): backpressure, no failure, "
                        f"no generation change" if stall else "no stall recorded")
            if bad:
                response += f"; but {len(bad)} other generation change(s): {[e['reason'] for e in bad]}"
            rows.append(Row(scenario.name, spec, response, stall and stall["deadline_seconds"],
                            stall and stall["late_by_seconds"], expected=ok, **common))
        elif kind == "slow_host" and summary["assignment"]["policy"] == "proportional":
            host = f"h{target}"
            from resilient_jax.assignment import first_move_away

            d = first_move_away(summary["assignment"]["decisions"], host, after_step=step)
            # Within two measurement windows of the slowdown (the first one still holds warm steps).
            ok = d is not None and not events and d["step"] - step <= 2 * (d["window_steps"][1] - d["window_steps"][0] + 1) + 1
            if d:
                i = d["hosts"].index(host)
                response = (f"shards moved at step {d['step']}: {host} {d['old_shards'][i]} -> {d['new_shards'][i]} "
                            f"(all hosts {d['old_shards']} -> {d['new_shards']}; measured s/shard "
                            f"{d['cost_per_shard_seconds']}; predicted step {d['predicted_step_seconds']['old']} -> "
                            f"{d['predicted_step_seconds']['new']} s); no re-formation")
            else:
                response = "no shards moved"
            if events:
                response += f"; but {len(events)} generation change(s): {[e['reason'] for e in events]}"
            rows.append(Row(scenario.name, spec, response, None, None, expected=ok, **common))
        elif kind == "slow_host":
            reslots = [e for e in events if e["reason"] == "reslot" and e["reslotted"] == [f"h{target}"]]
            event = reslots[0] if reslots else None
            window = summary.get("straggler_window") or 10
            ok = event is not None and event["decision"]["window_steps"][1] <= step + window + 2
            if event:
                d = event["decision"]
                response = (f"{'replaced by ' + d['spare'] if d['action'] == 'replace' else 'removed'} "
                            f"h{target} after steps {d['window_steps'][0]}..{d['window_steps'][1]} "
                            f"({d['ratio']:.1f}x the others): {d['reason']}")
            else:
                decisions = summary.get("straggler_decisions") or []
                response = f"not reslotted ({decisions[-1]['reason'] if decisions else 'not detected'})"
            rows.append(Row(scenario.name, spec, response, event and event["detection_seconds"],
                            event and event["recovery_seconds"], expected=ok, **common))
        elif kind == "nan_shard":
            hits = [q for q in summary["quarantine_events"] if q["shard"] == int(target)]
            # The poison starts at `step`; the shard's first sample may land in a later batch.
            ok = bool(hits) and hits[0]["from_step"] >= step  # both the loader's step index
            response = (f"quarantined shard {target} at step {hits[0]['step']} (its first NaN batch), re-read "
                        f"step {hits[0]['step']} without it, continued; equals the fault-free run with the "
                        f"shard excluded from that step" if hits else "not quarantined")
            rows.append(Row(scenario.name, spec, response, 0.0 if hits else None, None, expected=ok,
                            notes=["detected inside the step it appeared in"], **common))
    return rows


def _parse(spec: str) -> tuple[str, str | None, int]:
    from resilient_jax.faults import parse_fault

    fault = parse_fault(spec)
    return fault.kind, fault.target, fault.step


def table(rows: list[Row]) -> str:
    def num(x):
        return "-" if x is None else f"{x:.2f}"

    lines = ["| fault | injected | response | detection s | recovery s | steps lost | restarts | fingerprint = fault-free | holds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.fault_class} | `{r.injected}` | {r.response} | {num(r.detection_seconds)} | "
                     f"{num(r.recovery_seconds)} | {r.steps_lost} | {r.restarts} | "
                     f"{'yes' if r.fingerprint_equal else 'NO'} | {'yes' if r.holds else 'NO'} |")
    return "\n".join(lines)


def plot(out: Path, runs: dict[str, Path], scenarios: list[Scenario]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(scenarios), 1, figsize=(9, 2.6 * len(scenarios)), sharex=True, squeeze=False)
    reference = _losses(runs["fault-free"])
    for ax, scenario in zip(axes[:, 0], scenarios):
        ax.plot(*zip(*reference), color="0.6", lw=2.5, label="fault-free")
        clean = runs.get(f"{scenario.name} (clean exclusion)")
        if clean is not None:
            ax.plot(*zip(*_losses(clean)), color="k", lw=2.5, alpha=0.35, label="fault-free, shard excluded")
        ax.plot(*zip(*_losses(runs[scenario.name])), color="C1", lw=1, label=scenario.name)
        for spec in scenario.faults:
            kind, _, step = _parse(spec)
            ax.axvline(step, color="C3", ls="--", lw=1)
            ax.annotate(spec, (step, ax.get_ylim()[1]), fontsize=7, color="C3", va="top", rotation=90)
        ax.set_ylabel("loss")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle("chaos drill: loss vs step (faults marked; each run lies on its fault-free reference)")
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(len(scenarios) + 1, 1, figsize=(9, 2.6 * (len(scenarios) + 1)), squeeze=False)
    for ax, name in zip(axes[:, 0], ["fault-free"] + [s.name for s in scenarios]):
        timeline = json.loads((runs[name] / "elastic" / "timeline.json").read_text())
        if not timeline:
            continue
        t0 = min(r["wall"] - r["ready_seconds"] - r["step_seconds"] for r in timeline)
        hosts = sorted({r["host"] for r in timeline}, key=lambda h: int(h[1:]))
        for i, host in enumerate(hosts):
            mine = sorted((r for r in timeline if r["host"] == host), key=lambda r: r["wall"])
            for gen in sorted({r["generation"] for r in mine}):
                pts = [r for r in mine if r["generation"] == gen]
                ax.plot([r["wall"] - t0 for r in pts], [r["ready_seconds"] + r["step_seconds"] for r in pts],
                        color=f"C{i}", lw=1, ls=["-", "--", ":", "-."][gen % 4],
                        label=host if gen == mine[0]["generation"] else None)
        for gen in sorted({r["generation"] for r in timeline})[1:]:
            start = min(r["wall"] - r["step_seconds"] for r in timeline if r["generation"] == gen) - t0
            ax.axvline(start, color="k", lw=0.8)
            ax.annotate(f"gen {gen}", (start, 0), fontsize=7, va="bottom")
        ax.set_yscale("log")
        ax.set_ylabel("step s")
        ax.set_title(name, fontsize=9)
        ax.legend(loc="upper right", fontsize=7, ncol=len(hosts))
    axes[-1, 0].set_xlabel("seconds since the first step (lines: hosts; vertical: a new generation)")
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=110)
    plt.close(fig)

    from resilient_jax import gantt

    lifecycles = [t for name in ["fault-free"] + [s.name for s in scenarios]
                  if (t := gantt.read_run(runs[name], name)) is not None]
    if lifecycles:
        gantt.write(lifecycles, out / "lifecycle.png")


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            by_step[record["step"]] = record["loss"]
    return sorted(by_step.items())


OUTPUT_MARKER = ".resilient_jax-output"  # names the script that made the folder: it may replace it


def fresh_output_dir(parser: argparse.ArgumentParser, out: Path, kind: str) -> Path:
    """`out` made absolute (against your directory: the runs are started in the repository) and
    emptied -- only if it is new, empty, or an earlier output of this script; anything else exits 2
    in one line, deleting nothing (a --out of runs, ~ or . must never be wiped)."""
    out = out.expanduser().resolve()
    if out.exists() and not out.is_dir():
        parser.exit(2, f"error: --out {out} is a file; name a new or empty directory\n")
    marker = out / OUTPUT_MARKER
    if out.is_dir() and any(out.iterdir()):
        earlier = (marker.is_file() and marker.read_text().strip() == kind) or (out / f"{kind}.json").is_file()
        if not earlier:  # (drill.json / soak.json: an output from before the marker existed)
            parser.exit(2, f"error: --out {out} is not empty and is not an earlier {kind} output; name a new or "
                           "empty directory\n")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    marker.write_text(kind + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the shortened drill CI runs (4 hosts, 45 steps)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "chaos-drill")
    args = parser.parse_args(argv)
    args.out = fresh_output_dir(parser, args.out, "drill")
    config, steps, scenarios = plan(args.quick)
    from resilient_jax.config import load_config
    runs = {"fault-free": args.out / "fault-free"}
    print(f"drill: {config}, {steps} steps; fault-free run ...", flush=True)
    baseline = run(config, steps, runs["fault-free"], ())
    reference = baseline["params_fingerprint"]
    rows, summaries = [], {"fault-free": baseline}
    for scenario in scenarios:
        runs[scenario.name] = args.out / scenario.name.replace(" ", "-")
        print(f"drill: {scenario.name}: {' '.join(scenario.faults)} ...", flush=True)
        summaries[scenario.name] = summary = run(config, steps, runs[scenario.name], scenario.faults, scenario.sets)
        expected = reference
        if summary["quarantine_events"]:
            # A data fault changes the data by design: compare with the fault-free run that leaves the
            # same shard out from the same step without ever reading a NaN.
            clean = ", ".join(f"{{shard: {q['shard']}, from_step: {q['from_step']}}}" for q in summary["quarantine_events"])
            name = f"{scenario.name} (clean exclusion)"
            runs[name] = args.out / (scenario.name.replace(" ", "-") + "-clean")
            print(f"drill: {name}: fault-free with data.quarantine=[{clean}], in one process ...", flush=True)
            summaries[name] = run(config, steps, runs[name], (), (f"data.quarantine=[{clean}]",
                                                                  *one_process_sets(load_config(config))))
            expected = summaries[name]["params_fingerprint"]
        rows += rows_for(scenario, summary, expected)
    text = table(rows)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "drill.json").write_text(json.dumps({
        "config": config, "steps": steps, "reference_fingerprint": reference,
        "rows": [{**r.__dict__, "holds": r.holds} for r in rows],
        "summaries": summaries,
    }, indent=2, default=str))
    plot(args.out, runs, scenarios)
    print(text)
    held = all(r.holds for r in rows)
    print(f"drill: {'every row holds' if held else 'FAILED: a row does not hold'}; fault-free fingerprint "
          f"{reference[:16]}; plots in {args.out}", flush=True)
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
