"""Uneven virtual-shard assignment: faster hosts hold more shards. Pure functions.

With the exact reduction the sum of the V shard gradients is the same integer whoever computed
which shard, so shards can move between hosts at any step boundary without changing one bit of
the trajectory (resilient_jax.step: a ShardLayout per step). This module decides how many shards
each host holds.

Inputs, per step and per host (the worker all-gathers them at the step boundary, so every host
holds the same numbers and, running the same pure functions, takes the same decision for the
same next step -- no controller round trip, no race):
    shards   n[h]       the shards host h held in the step
    ready    r[h]       host-side seconds from the end of the previous step to entering this one
    in_step  s[h]       seconds inside the step, including the wait for peers

Model: a host's time for a step is n[h] * (e[h] + t), where e[h] = r[h] / n[h] is its host-side
cost per shard (input, a throttled host, an emulated slow host) and t the device cost per shard,
estimated from the host that entered last (its in-step time is its own compute:
t = s[last] / n[last]). Costs are medians over the last `window` steps under the same assignment.
The proposal gives each host shards in proportion to 1 / (e[h] + t), at most max_share x its
uniform share, rounded by largest remainder; it is taken when its predicted step time
max_h n[h] (e[h] + t) beats the current one's by the `hysteresis` fraction, so noise does not move
shards back and forth. A host can hold 0 shards: it stays a member (it heartbeats and joins the
collectives) and is probed with one shard after `4 x window` idle steps, so a host that speeds up
gets its shards back.

Attribution is host-side, as in resilient_jax.elastic.stragglers: a device that is slow inside
its kernels delays every host's in-step time alike and is not told apart here.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

def shards_can_move(reduction: str, hosts: int) -> bool:
    """Only the exact reduction keeps every bit when shards change hands, and only between hosts."""
    return hosts > 1 and reduction == "invariant"


def effective_policy(requested: str, reduction: str, hosts: int) -> str:
    """`runtime.assignment` as it acts: "proportional" only where shards can move."""
    return "proportional" if requested == "proportional" and shards_can_move(reduction, hosts) else "uniform"


def first_move_away(decisions: list[dict], host: str, after_step: int = 0) -> dict | None:
    """The first rebalance event (to_event's dict) after `after_step` that took shards from `host`."""
    for d in decisions:
        if d["kind"] == "rebalance" and d["step"] > after_step and host in d["hosts"]:
            i = d["hosts"].index(host)
            if d["new_shards"][i] < d["old_shards"][i]:
                return d
    return None


class DisagreementError(RuntimeError):
    """The hosts of a world ran different assignments: the step's result cannot be trusted."""


@dataclass(frozen=True)
class Sample:
    """One step's numbers for every host of the world (host order)."""

    step: int
    shards: tuple[int, ...]
    ready: tuple[float, ...]
    in_step: tuple[float, ...]


@dataclass(frozen=True)
class Policy:
    window: int = 5
    hysteresis: float = 0.1
    max_share: float = 2.0

    @property
    def probe_after(self) -> int:
        return 4 * self.window


@dataclass(frozen=True)
class Planner:
    """The assignment state every host holds identically (a new world starts a fresh one)."""

    counts: tuple[int, ...]  # shards per host, the assignment in force
    capacity: tuple[int, ...]  # most shards each host can hold (its devices x slots per device)
    uniform: tuple[int, ...]  # the uniform assignment (what `runtime.assignment=uniform` keeps)
    window: tuple[Sample, ...] = ()  # samples under the current counts
    per_shard: tuple[float | None, ...] = ()  # last measured host-side seconds per shard, per host
    idle_from: tuple[int | None, ...] = ()  # step a host went to 0 shards

    @classmethod
    def start(cls, uniform: list[int], capacity: list[int], step: int) -> Planner:
        n = len(uniform)
        return cls(counts=tuple(uniform), capacity=tuple(capacity), uniform=tuple(uniform),
                   per_shard=(None,) * n, idle_from=tuple(step if c == 0 else None for c in uniform))


@dataclass(frozen=True)
class Decision:
    step: int  # the first step of the new assignment
    old: tuple[int, ...]
    new: tuple[int, ...]
    kind: str  # "rebalance" | "probe"
    cost_per_shard: tuple[float, ...] = ()  # e[h] + t, seconds
    predicted_old: float | None = None  # predicted step seconds under old / new
    predicted_new: float | None = None
    reason: str = ""
    extra: dict = field(default_factory=dict)

    def to_event(self, hosts: list[str]) -> dict:
        return {"event": "reassign", "step": self.step, "kind": self.kind, "hosts": list(hosts),
                "old_shards": list(self.old), "new_shards": list(self.new),
                "cost_per_shard_seconds": [round(c, 5) for c in self.cost_per_shard],
                "predicted_step_seconds": {"old": _round(self.predicted_old), "new": _round(self.predicted_new)},
                "reason": self.reason, **self.extra}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def host_counts_from_devices(device_counts: list[int], device_host: list[int], hosts: int) -> list[int]:
    out = [0] * hosts
    for c, h in zip(device_counts, device_host):
        out[h] += c
    return out


def device_counts(host_counts: list[int], device_host: list[int], slots: int) -> list[int]:
    """Split each host's shards over its devices (grid order), the first ones one more."""
    out = []
    seen: dict[int, int] = {}
    per_host = {h: device_host.count(h) for h in set(device_host)}
    for h in device_host:
        j = seen.get(h, 0)
        seen[h] = j + 1
        q, r = divmod(host_counts[h], per_host[h])
        out.append(q + (1 if j < r else 0))
    if any(c > slots for c in out):
        raise ValueError(f"host shards {host_counts} do not fit {slots} slots per device")
    return out


def proportional(total: int, cost: list[float], capacity: list[int]) -> list[int]:
    """Integer shares of `total` in proportion to 1/cost, capped per host (water-filling), by
    largest remainder; ties go to the lower host index (deterministic)."""
    n = len(cost)
    counts = [0] * n
    free = list(range(n))
    left = total
    while True:
        speed = {h: 1.0 / max(cost[h], 1e-9) for h in free}
        norm = sum(speed.values())
        ideal = {h: left * speed[h] / norm for h in free}
        over = [h for h in free if ideal[h] >= capacity[h]]
        if not over:
            break
        for h in over:
            counts[h] = capacity[h]
            left -= capacity[h]
            free.remove(h)
        if not free or left <= 0:
            return counts
    floors = {h: math.floor(ideal[h]) for h in free}
    for h in free:
        counts[h] = floors[h]
    rest = left - sum(floors.values())
    for h in sorted(free, key=lambda h: (-(ideal[h] - floors[h]), h))[:rest]:
        counts[h] += 1
    return counts


def predicted_seconds(counts, cost) -> float:
    return max(c * k for c, k in zip(counts, cost))


def _costs(planner: Planner) -> tuple[list[float], float] | None:
    """(e[h] + t per host, t) from the window, or None when it says nothing about device time."""
    n = len(planner.counts)
    t_steps, e_steps = [], [[] for _ in range(n)]
    for s in planner.window:
        last = max(range(n), key=lambda h: (s.ready[h], -s.in_step[h]))
        if s.shards[last] > 0:
            t_steps.append(s.in_step[last] / s.shards[last])
        for h in range(n):
            if s.shards[h] > 0:
                e_steps[h].append(s.ready[h] / s.shards[h])
    if not t_steps:
        return None
    t = statistics.median(t_steps)
    e = [statistics.median(x) if x else planner.per_shard[h] for h, x in enumerate(e_steps)]
    return [t + (0.0 if x is None else x) for x in e], t


def observe(planner: Planner, sample: Sample, policy: Policy) -> tuple[Planner, Decision | None]:
    """Add one step's sample; return the planner for the next step and the decision, if any.

    `sample.step` is the step just completed; a decision takes effect from the next one.
    """
    if sample.shards != planner.counts:
        raise DisagreementError(f"step {sample.step} ran {sample.shards}, the planner has {planner.counts}: "
                                "hosts disagree")
    planner = replace(planner, window=(planner.window + (sample,))[-policy.window:])
    nxt = sample.step + 1
    probe = _probe(planner, nxt, policy)
    if probe is not None:
        return _take(planner, probe, nxt), probe
    if len(planner.window) < policy.window:
        return planner, None
    costs = _costs(planner)
    if costs is None:
        return planner, None
    cost, t = costs
    planner = replace(planner, per_shard=tuple(c - t for c in cost))
    total = sum(planner.counts)
    new = tuple(proportional(total, cost, list(planner.capacity)))
    old_p, new_p = predicted_seconds(planner.counts, cost), predicted_seconds(new, cost)
    if new == planner.counts or new_p > (1.0 - policy.hysteresis) * old_p:
        return planner, None
    decision = Decision(step=nxt, old=planner.counts, new=new, kind="rebalance", cost_per_shard=tuple(cost),
                        predicted_old=old_p, predicted_new=new_p,
                        reason=(f"measured seconds per shard {', '.join(f'{c:.4f}' for c in cost)} over steps "
                                f"{planner.window[0].step}..{sample.step}: predicted step {old_p:.3f} s -> "
                                f"{new_p:.3f} s (hysteresis {policy.hysteresis:g})"),
                        extra={"window_steps": [planner.window[0].step, sample.step]})
    return _take(planner, decision, nxt), decision


def _probe(planner: Planner, nxt: int, policy: Policy) -> Decision | None:
    """One shard for a host idle for probe_after steps (from the most loaded host)."""
    for h, since in enumerate(planner.idle_from):
        if since is not None and nxt - since >= policy.probe_after and planner.counts[h] == 0:
            donor = max(range(len(planner.counts)), key=lambda j: (planner.counts[j], -j))
            if planner.counts[donor] <= 1:
                return None
            new = list(planner.counts)
            new[h], new[donor] = 1, new[donor] - 1
            return Decision(step=nxt, old=planner.counts, new=tuple(new), kind="probe",
                            reason=f"host {h} idle since step {since}: one shard to measure it again")
    return None


def _take(planner: Planner, decision: Decision, nxt: int) -> Planner:
    idle = tuple((planner.idle_from[h] if planner.idle_from[h] is not None and decision.kind != "probe" else nxt)
                 if c == 0 else None for h, c in enumerate(decision.new))
    return replace(planner, counts=decision.new, window=(), idle_from=idle)
