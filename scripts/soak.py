"""The randomized chaos soak: many faults of every class, drawn from a seed, in ONE elastic run.

    python scripts/soak.py --seed S --faults N --steps T [--config C] [--out runs/soak-S]

Draws N faults at random steps and hosts from the seed (`draw_schedule`, a pure function):
host kills, a region loss, hangs, latency spikes, persistent slow hosts, NaN data shards and
cluster-wide preemptions (SIGTERM to the driver and every worker at once, then the same command
again). Hosts are a budget: a kill, hang, slow host or region loss takes hosts away (a
preemption's rerun brings the plan back), no draw leaves fewer than two of the plan's hosts or
targets a host that is already gone, and one `join_host` (not counted as a fault) exercises growth
at the lowest point. Then it runs the schedule and checks what the product
promises:

  restarts 0        (a preemption is a stop and a resume, not a restart)
  steps lost 0
  fingerprint       equal to the fault-free run with the same shards quarantined from the same
                    steps (a NaN shard changes the data by design), run as one process on as many
                    devices (the invariant reduction: any host count's trajectory)
  checkpoints       every committed step passes `python -m resilient_jax.checkpoint verify`

Prints the schedule, one table row per fault (what the run recorded for it) and the checks;
writes soak.json, table.md and timeline.png (per-host step times, faults and generations on one
time axis) to --out. Exits 0 only when every check holds.

Not drawn (yet): a death while a world forms, adopts state or saves (`kill_host:H@formation:G`,
`@adopt:G`, `@save:STEP`). They name a generation, and which generation a step falls in depends on
how the run absorbed the earlier draws (a slow host may be given fewer shards or be removed), so a
pure schedule cannot aim them; tests/test_elastic.py runs each of them on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos_drill import REPO, fresh_output_dir, one_process_sets  # noqa: E402  (a script next to this one)
from cli_args import config_file  # noqa: E402

FAULT_CLASSES = ("kill_host", "hang_host", "slow_host", "kill_region", "delay_host", "nan_shard", "sigterm_all")
# Relative weights: destructive classes are bounded by the host budget anyway.
WEIGHTS = {"kill_host": 3, "hang_host": 2, "slow_host": 2, "kill_region": 1, "delay_host": 5, "nan_shard": 3,
           "sigterm_all": 2}
MIN_HOSTS = 2
SPACING = 4  # steps between two draws, so one fault's recovery ends before the next fires


@dataclass
class Schedule:
    faults: list[str] = field(default_factory=list)  # --fault specs (join_host included)
    sigterms: list[int] = field(default_factory=list)  # steps after which every process gets SIGTERM
    drawn: list[tuple[int, str]] = field(default_factory=list)  # (step, what) of the N faults, in order

    def lines(self) -> list[str]:
        joins = [f for f in self.faults if f.startswith("join_host")]
        return [f"  step {step:4d}  {what}" for step, what in self.drawn] + (
            [f"  (capacity: {', '.join(joins)})"] if joins else [])


def draw_schedule(seed: int, count: int, steps: int, regions: dict[str, list[int]], shards: int) -> Schedule:
    """`count` faults over steps [SPACING, steps - SPACING) from `seed`. `regions`: region name ->
    the plan's host indices in it. Pure: the same arguments give the same schedule."""
    rng = random.Random(seed)
    first, last = SPACING, steps - 2 * SPACING
    if count < 1 or (last - first) // SPACING + 1 < count:
        raise ValueError(f"--faults {count} does not fit {steps} steps (one fault every {SPACING} steps, "
                         f"none in the first or last {SPACING}): use at most {max(0, (last - first) // SPACING + 1)} "
                         f"or more --steps")
    at = sorted(rng.sample(range(first, last + 1, SPACING), count))
    plan_alive = {h for hosts in regions.values() for h in hosts}
    alive, joined, lost_regions, poisoned, slowed = set(plan_alive), 0, set(), set(), set()
    schedule = Schedule()
    for step in at:
        kinds = [k for k in FAULT_CLASSES if _possible(k, alive, regions, lost_regions, poisoned, shards)]
        kind = rng.choices(kinds, weights=[WEIGHTS[k] for k in kinds])[0]
        if kind == "kill_region":
            name = rng.choice([r for r in regions if r not in lost_regions and set(regions[r]) <= alive])
            spec = f"kill_region:{name}@{step}"
            alive -= set(regions[name])
            lost_regions.add(name)
        elif kind in ("kill_host", "hang_host", "slow_host"):
            host = rng.choice(sorted(alive))
            spec = f"{kind}:{host}@{step}" + (":4" if kind == "slow_host" else "")
            alive.discard(host)
            if kind == "slow_host":
                slowed.add(host)  # slow from `step` on, in every later invocation too: never a target again
        elif kind == "delay_host":
            host = rng.choice(sorted(alive))
            spec = f"delay_host:{host}@{step}-{step}:{rng.choice([3, 5, 8])}"
        elif kind == "nan_shard":
            shard = rng.choice(sorted(set(range(shards)) - poisoned))
            poisoned.add(shard)
            spec = f"nan_shard:{shard}@{step}"
        else:  # sigterm_all: the rerun launches the whole plan again (and the joins already due)
            schedule.sigterms.append(step)
            schedule.drawn.append((step, "SIGTERM to the driver and every worker; then the same command again"))
            alive, lost_regions = set(plan_alive) - slowed, set()
            continue
        schedule.faults.append(spec)
        schedule.drawn.append((step, spec))
        if len(alive) == MIN_HOSTS and not joined and step + 2 < steps:
            schedule.faults.append(f"join_host@{step + 2}")  # growth is exercised once, at the lowest point
            joined += 1
    return schedule


def _possible(kind, alive, regions, lost_regions, poisoned, shards) -> bool:
    destroys = {"kill_host": 1, "hang_host": 1, "slow_host": 1}.get(kind, 0)
    if kind == "kill_region":
        whole = [r for r in regions if r not in lost_regions and set(regions[r]) <= alive]
        if not whole:
            return False
        destroys = max(len(regions[r]) for r in whole)
    # Joined hosts are not counted: a newcomer may still be compiling when the next fault fires.
    if destroys and len(alive) - destroys < MIN_HOSTS:
        return False
    if kind == "nan_shard":
        return len(poisoned) < shards // 4  # most of the data stays
    return bool(alive) or kind == "sigterm_all"


# -- running ------------------------------------------------------------------------------------------


def train_cmd(config: str, run_dir: Path, steps: int, faults: list[str], sets: tuple[str, ...] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "resilient_jax.train", "--config", config, "--set", f"run.dir={run_dir}",
           "--set", f"train.steps={steps}", "--set", "train.log_every=1", "--set", "checkpoint.every_steps=10",
           "--set", "run.progress=plain"]
    for s in sets:
        cmd += ["--set", s]
    for f in faults:
        cmd += ["--fault", f]
    return cmd


def run_with_preemptions(cmd: list[str], run_dir: Path, sigterms: list[int], log) -> list[int]:
    """Runs `cmd`; at each step in `sigterms` sends SIGTERM to its whole process group and runs it
    again. Returns the exit codes of the invocations (143 for each preemption, then 0). Each
    invocation's summary.json is kept beside the run as `<run>.summary-<i>.json`: the next
    invocation rewrites summary.json, and the failures, stalls and quarantines it lists are that
    invocation's."""
    codes = []
    for target in [*sigterms, None]:
        before = _last_step(run_dir)  # the step this invocation resumes after
        with open(run_dir.parent / f"{run_dir.name}.invocation-{len(codes)}.log", "w") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            # A step of THIS invocation first (its signal handlers are in place by then), even when the
            # previous stop overshot the target.
            while target is not None and proc.poll() is None and (
                    _last_step(run_dir) <= before or _last_step(run_dir) < target):
                time.sleep(0.2)
            if target is not None and proc.poll() is None:
                log(f"soak: SIGTERM to every process at step {_last_step(run_dir)}")
                os.killpg(proc.pid, signal.SIGTERM)
            codes.append(proc.wait(timeout=3600))
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        if (run_dir / "summary.json").is_file():
            shutil.copyfile(run_dir / "summary.json", invocation_summary(run_dir, len(codes) - 1))
        if codes[-1] not in (0, 143) or (target is None and codes[-1] != 0):
            raise SystemExit(f"soak: invocation {len(codes)} exited {codes[-1]}; see {out.name} and "
                             f"{run_dir}/elastic/logs")
        if codes[-1] == 0:
            break
    return codes


def invocation_summary(run_dir: Path, i: int) -> Path:
    return run_dir.parent / f"{run_dir.name}.summary-{i}.json"


def _last_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [r["step"] for r in map(_json_or_none, lines) if r and "loss" in r]
    return max(steps, default=0)


def _json_or_none(line: str):
    try:
        return json.loads(line)
    except ValueError:
        return None  # a line being written


def verify_checkpoints(run_dir: Path) -> list[tuple[int, bool, str]]:
    from resilient_jax.checkpoint import reader

    out = []
    for step in reader.list_steps(run_dir / "checkpoints"):
        proc = subprocess.run([sys.executable, "-m", "resilient_jax.checkpoint", "verify",
                               str(run_dir / "checkpoints" / str(step))], cwd=REPO, capture_output=True, text=True)
        out.append((step, proc.returncode == 0, (proc.stdout + proc.stderr).strip().splitlines()[-1:][0]
                    if (proc.stdout + proc.stderr).strip() else ""))
    return out


def row_for(what: str, step: int, summaries: list[dict]) -> str:
    """What the run recorded for one drawn fault, from every invocation's summary (the last one's
    `resumed_from` spans the run)."""
    events = [e for s in summaries for e in s["events"]]
    if what.startswith("SIGTERM"):
        hit = [r for r in summaries[-1]["resumed_from"] if r["reason"] == "preempted"]
        return f"stopped and resumed ({len(hit)} preemption resume(s) recorded)" if hit else "NO preempted resume"
    kind, _, rest = what.partition(":")
    target = rest.split("@")[0]
    if kind in ("kill_host", "hang_host", "kill_region"):
        lost = [e for e in events if e["reason"] == "failure" and abs(e["resume_step"] - step) <= SPACING
                and (kind == "kill_region" or f"h{target}" in e["lost"])]
        return (f"re-formed without {', '.join(lost[0]['lost'])} (generation {lost[0]['generation']}, "
                f"recovery {lost[0]['recovery_seconds']:.1f} s)" if lost else "no failure recorded near this step")
    if kind == "slow_host":
        re_slots = [e for e in events if e["reason"] == "reslot" and e["reslotted"] == [f"h{target}"]]
        if re_slots:
            return f"{re_slots[0]['decision']['action']}d h{target} as a straggler"
        host = f"h{target}"
        from resilient_jax.assignment import first_move_away

        decisions = [d for s in summaries for d in (s.get("assignment") or {}).get("decisions", [])]
        moved = first_move_away(decisions, host, after_step=step)  # not an earlier invocation's move
        if moved:
            i = moved["hosts"].index(host)
            return (f"its shards moved to faster hosts at step {moved['step']} "
                    f"({moved['old_shards'][i]} -> {moved['new_shards'][i]})")
        return "not reslotted, no shards moved (see straggler_decisions, assignment)"
    if kind == "delay_host":
        # The stall of this spike (its steps, or the step after the last: a stall is recorded at the
        # step whose collective waited), not the host's first one of the run.
        from resilient_jax.faults import parse_fault

        until = parse_fault(what).until
        stalls = [s for summary in summaries for s in summary["stalls"]
                  if s["late_host"] == f"h{target}" and step <= s["step"] <= until + 1]
        return f"waited out a {stalls[0]['waited_seconds']:.1f} s stall" if stalls else "no stall recorded (absorbed)"
    if kind == "nan_shard":
        hits = [q for s in summaries for q in s["quarantine_events"] if q["shard"] == int(target)]
        return f"quarantined shard {target} from step {hits[0]['from_step']}" if hits else "NOT quarantined"
    return "?"


def plot_timeline(out: Path, run_dir: Path, schedule: Schedule) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = json.loads((run_dir / "elastic" / "timeline.json").read_text())
    fig, ax = plt.subplots(figsize=(11, 4))
    if timeline:
        hosts = sorted({r["host"] for r in timeline}, key=lambda h: int(h[1:]))
        for i, host in enumerate(hosts):
            mine = sorted((r for r in timeline if r["host"] == host), key=lambda r: r["step"])
            ax.plot([r["step"] for r in mine], [r["ready_seconds"] + r["step_seconds"] for r in mine], ".",
                    ms=3, color=f"C{i % 10}", label=host)
        ax.set_yscale("log")
        ax.legend(loc="upper right", fontsize=7, ncol=min(len(hosts), 8))
    for step, what in schedule.drawn:
        ax.axvline(step, color="C3", ls="--", lw=0.8)
        ax.annotate(what.split(";")[0], (step, 1), xycoords=("data", "axes fraction"), fontsize=6, color="C3",
                    va="top", rotation=90)
    ax.set_xlabel("step")
    ax.set_ylabel("step seconds (per host)")
    ax.set_title("soak: per-host step times with the drawn faults")
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--faults", type=int, required=True, help="how many faults to draw (1..100)")
    parser.add_argument("--steps", type=int, required=True, help="train.steps of the soaked run (>= 20)")
    parser.add_argument("--config", type=config_file, default="configs/cpu-6host-3region.yaml",
                        help="yours (against your directory) if it is there, else the repository's")
    parser.add_argument("--out", type=Path, default=None, help="default runs/soak-SEED")
    args = parser.parse_args(argv)
    if not 1 <= args.faults <= 100:
        parser.exit(2, f"error: --faults {args.faults}: must be in [1, 100]\n")
    if args.steps < 20:
        parser.exit(2, f"error: --steps {args.steps}: must be >= 20\n")
    if args.seed < 0:
        parser.exit(2, f"error: --seed {args.seed}: must be >= 0\n")
    from resilient_jax.config import ConfigError, load_config

    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        parser.exit(2, f"error: {e}\n")
    if not cfg.topology.regions:
        parser.exit(2, f"error: --config {args.config}: has no topology.regions (the soak needs an elastic run)\n")
    regions, index = {}, 0
    for region in cfg.topology.regions:
        regions[region.name] = list(range(index, index + region.hosts))
        index += region.hosts
    try:
        schedule = draw_schedule(args.seed, args.faults, args.steps, regions, cfg.data.shards)
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")

    out = fresh_output_dir(parser, args.out or REPO / "runs" / f"soak-{args.seed}", "soak")
    log = lambda text: print(text, flush=True)  # noqa: E731
    log(f"soak: seed {args.seed}, {args.faults} faults over {args.steps} steps of {args.config}:")
    for line in schedule.lines():
        log(line)
    started = time.perf_counter()
    run_dir = out / "run"
    codes = run_with_preemptions(train_cmd(args.config, run_dir, args.steps, schedule.faults), run_dir,
                                 schedule.sigterms, log)
    summaries = [json.loads(invocation_summary(run_dir, i).read_text()) for i in range(len(codes))]
    summary = summaries[-1]
    soak_seconds = time.perf_counter() - started

    # The run's own record of what it left out: the data position (every invocation's quarantines,
    # in the checkpoints and the final summary), not one invocation's quarantine events.
    quarantine = ", ".join(f"{{shard: {q['shard']}, from_step: {q['from_step']}}}"
                           for q in summary["data_position"]["quarantine"])
    one_process = one_process_sets(cfg)
    log(f"soak: the fault-free reference (data.quarantine=[{quarantine}]){', in one process' if one_process else ''} ...")
    ref_dir = out / "reference"
    ref = subprocess.run(train_cmd(args.config, ref_dir, args.steps, [], ("checkpoint.enabled=false",
                         f"data.quarantine=[{quarantine}]", *one_process)), cwd=REPO, capture_output=True, text=True)
    if ref.returncode != 0:
        raise SystemExit(f"soak: the reference run failed (exit {ref.returncode}):\n{ref.stderr[-2000:]}")
    reference = json.loads((ref_dir / "summary.json").read_text())["params_fingerprint"]
    verified = verify_checkpoints(run_dir)

    rows = [(step, what, row_for(what, step, summaries)) for step, what in schedule.drawn]
    checks = {
        "restarts == 0": summary["restarts"] == 0,
        "steps lost == 0": summary["steps_lost"] == 0,
        "fingerprint == fault-free": summary["params_fingerprint"] == reference,
        "every checkpoint verifies": all(ok for _, ok, _ in verified),
        "every preemption exited 143 and resumed": codes == [143] * len(schedule.sigterms) + [0],
    }
    table = ["| step | fault | what the run recorded |", "|---|---|---|"]
    table += [f"| {step} | `{what}` | {rec} |" for step, what, rec in rows]
    (out / "table.md").write_text("\n".join(table) + "\n")
    (out / "soak.json").write_text(json.dumps({
        "seed": args.seed, "faults": args.faults, "steps": args.steps, "config": args.config,
        "schedule": asdict(schedule), "exit_codes": codes, "checks": checks, "soak_seconds": soak_seconds,
        "reference_fingerprint": reference, "checkpoints": verified, "rows": rows,
        "summary": {k: summary[k] for k in ("restarts", "steps_lost", "params_fingerprint", "resumed_from",
                                           "final_step")},
        "invocations": [{k: s[k] for k in ("generations", "failures_absorbed", "stopped")} for s in summaries],
    }, indent=2, default=str))
    plot_timeline(out, run_dir, schedule)
    log("\n".join(table))
    for name, ok in checks.items():
        log(f"  {'ok ' if ok else 'FAIL'} {name}")
    generations = sum(s["generations"] for s in summaries)
    absorbed = sum(s["failures_absorbed"] for s in summaries)
    log(f"soak: {'every check holds' if all(checks.values()) else 'FAILED'}; {len(summaries)} invocations, "
        f"{generations} generations, {absorbed} failures absorbed, {len(verified)} checkpoints verified, "
        f"{soak_seconds:.0f} s; {out}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
