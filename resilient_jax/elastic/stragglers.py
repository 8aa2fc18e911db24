"""Straggler detection and the reslot decision, from per-host step timings. Pure functions.

In a synchronous step every host's wall time is the same: the fast ones wait inside the
collective for the slowest. What differs is when each host is *ready* to enter the step. Each
worker reports, per step, `ready` (host-side seconds from the end of the previous step to entering
this one: input, host work, anything that holds it back) and `step` (seconds inside the step,
including the wait for peers). The host that arrives last waits least, so the step's shortest
`step` is the shared compute + communication time, and a host's own time for the step is

    own[h] = ready[h] + min over hosts of step

A host is a straggler when, over the last `window` steps, own[h] / median(own of the others) is at
least `factor` in four steps out of five (the window's 20th percentile): persistent, so a spike
shorter than most of the window is waited out, not reslotted. (Attribution is host-side: input pipelines, noisy neighbours,
throttled hosts. A device that is slow inside its kernels shows up in every host's `step` alike
and is not attributed here.)

The reslot decision: replace the straggler with a registered spare if there is one; otherwise
remove it only when the measured numbers say the run finishes sooner without it -- the predicted
step time of the smaller world (the others' own time scaled by n / (n - 1), since the global batch
is fixed) times the remaining steps, plus the measured cost of forming a world, against keeping
the current step time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class StepTiming:
    ready: float
    step: float
    shards: int | None = None  # virtual shards the host held in the step (None: not reported)


@dataclass(frozen=True)
class Straggler:
    host: str
    ratio: float  # own / others, exceeded in 4 of 5 steps of the window
    own_seconds: float  # median own time of the straggler
    others_seconds: float  # median own time of the other hosts
    world_step_seconds: float  # median wall time of a step in the window
    steps: tuple[int, int]  # first and last step of the window


@dataclass(frozen=True)
class Decision:
    action: str  # "replace" | "remove" | "keep"
    straggler: Straggler
    spare: str | None
    reason: str

    def to_dict(self) -> dict:
        s = self.straggler
        return {"action": self.action, "host": s.host, "spare": self.spare, "ratio": round(s.ratio, 3),
                "own_seconds": round(s.own_seconds, 4), "others_seconds": round(s.others_seconds, 4),
                "world_step_seconds": round(s.world_step_seconds, 4), "window_steps": list(s.steps),
                "reason": self.reason}


def own_times(timings: dict[str, StepTiming]) -> dict[str, float]:
    shared = min(t.step for t in timings.values())
    return {host: t.ready + shared for host, t in timings.items()}


def complete_steps(window: dict[int, dict[str, StepTiming]], members: list[str], steps: int) -> list[int]:
    """The last `steps` steps that every member reported."""
    return sorted(k for k, per_host in window.items() if all(h in per_host for h in members))[-steps:]


def idle_throughout(window: dict[int, dict[str, StepTiming]], members: list[str], steps: int) -> list[str]:
    """Members that held no virtual shard in any of the last `steps` complete steps."""
    recent = complete_steps(window, members, steps)
    return [h for h in members if recent and all(window[k][h].shards == 0 for k in recent)]


def find_straggler(window: dict[int, dict[str, StepTiming]], members: list[str], *, factor: float,
                   steps: int, candidates: list[str] | None = None) -> Straggler | None:
    """The host persistently slower than the rest over the last `steps` steps that every member
    reported; only `candidates` (default: every member) can be named."""
    complete = complete_steps(window, members, steps)
    if len(members) < 2 or len(complete) < steps:
        return None
    own = {k: own_times({h: window[k][h] for h in members}) for k in complete}
    worst = None
    for host in members if candidates is None else [h for h in members if h in candidates]:
        ratios, others = [], []
        for k in complete:
            rest = statistics.median(own[k][j] for j in members if j != host)
            ratios.append(own[k][host] / max(rest, 1e-9))
            others.append(rest)
        ratio = statistics.quantiles(ratios, n=5, method="inclusive")[0]  # the 20th percentile
        if ratio >= factor and (worst is None or ratio > worst.ratio):
            worst = Straggler(
                host=host, ratio=ratio, own_seconds=statistics.median(own[k][host] for k in complete),
                others_seconds=statistics.median(others),
                world_step_seconds=statistics.median(max(t.ready + t.step for t in window[k].values()) for k in complete),
                steps=(complete[0], complete[-1]))
    return worst


def decide(straggler: Straggler, *, members: list[str], spares: list[str], remaining_steps: int,
           reform_seconds: float, min_hosts: int, idle: bool = False) -> Decision:
    """`idle`: the straggler holds no virtual shard (resilient_jax.assignment), so removing it
    moves no work to the others."""
    if spares:
        return Decision("replace", straggler, spares[0],
                        f"{straggler.host} took {straggler.ratio:.2f}x the others' step time over steps "
                        f"{straggler.steps[0]}..{straggler.steps[1]}; spare {spares[0]} takes its slot")
    n = len(members)
    if n - 1 < min_hosts:
        return Decision("keep", straggler, None, f"removing {straggler.host} would leave {n - 1} hosts "
                                                 f"< runtime.min_hosts {min_hosts}")
    with_it = straggler.own_seconds * remaining_steps
    smaller = straggler.others_seconds * (1.0 if idle else n / (n - 1))
    without_it = smaller * remaining_steps + reform_seconds
    numbers = (f"{remaining_steps} steps left: {straggler.own_seconds:.3f} s/step with {straggler.host} -> "
               f"{with_it:.1f} s; {smaller:.3f} s/step on {n - 1} hosts + "
               f"{reform_seconds:.1f} s to re-form -> {without_it:.1f} s")
    if without_it < with_it:
        return Decision("remove", straggler, None, f"no spare; faster without it ({numbers})")
    return Decision("keep", straggler, None, f"no spare; not faster without it ({numbers})")
