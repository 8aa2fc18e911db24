"""Fault injections, named in config (`faults:`) or on the command line (`--fault`).

Spec grammar (one string per fault):
    nan_shard:SHARD@STEP      poison data shard SHARD's loss weights with NaN from STEP on
    kill_host:H@STEP          SIGKILL host H (index in topology order) during step STEP
    kill_host:H@formation:G   SIGKILL host H while generation G forms: after the world is announced and
                              H has joined it, before its first step (a death during a recovery when G > 0)
    kill_host:H@adopt:G       SIGKILL host H as generation G adopts the state (G >= 1: the first
                              world restores from disk or starts fresh; a world that restores from disk
                              adopts nothing, so the fault does not fire there). With a newcomer the
                              state is being broadcast; with survivors only, each is placing its own copy
    kill_host:H@save:STEP     SIGKILL host H while the checkpoint of STEP (completed steps) is being written
    kill_host:H@report:STEP   SIGKILL host H as it reports the run's end after STEP (= train.steps) completed
                              steps, its final checkpoint committed: only the final world's rank 0 reports
                              it, so the fault fires only where H is that rank 0
    kill_host:H@precompiled:G SIGKILL host H during the first step after rank 0 of generation G (or a later
                              one) has compiled the likely next worlds ahead (runtime.precompile_next_worlds;
                              without it the fault never fires)
    kill_region:R@STEP        SIGKILL every host of region R at once during step STEP
    hang_host:H@STEP          SIGSTOP host H during step STEP (it stops answering, it does not exit)
    join_host@STEP            one more host joins once the run reaches step STEP (its worker starts with the
                              run and registers then, so the join lands there on a slow machine too)
    delay_host:H@A-B:SECONDS  a latency spike: host H enters each of steps A..B SECONDS late
    slow_host:H@STEP[-LAST]:FACTOR
                              a persistent straggler: from STEP on (to LAST), host H's work takes FACTOR x
                              as long (its extra time scales with the virtual shards it holds)

Host faults are fired by the worker process itself, at the exact step, from a timer thread so
that the death lands inside the step's collectives. Every injected fault is reported in
summary.json next to the response the run took.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from resilient_jax.config import ConfigError

_SPECS = {
    "nan_shard": (re.compile(r"^nan_shard:(?P<target>\d+)@(?P<step>\d+)$"), "nan_shard:SHARD@STEP"),
    "kill_host": (re.compile(r"^kill_host:(?P<target>\d+)@((?P<moment>[a-z_]+):)?(?P<step>\d+)$"),
                  "kill_host:HOST@STEP or kill_host:HOST@MOMENT:N (MOMENT: formation, adopt, save, report, precompiled)"),
    "kill_region": (re.compile(r"^kill_region:(?P<target>[\w.-]+)@(?P<step>\d+)$"), "kill_region:REGION@STEP"),
    "hang_host": (re.compile(r"^hang_host:(?P<target>\d+)@(?P<step>\d+)$"), "hang_host:HOST@STEP"),
    "join_host": (re.compile(r"^join_host@(?P<step>\d+)$"), "join_host@STEP"),
    "delay_host": (re.compile(r"^delay_host:(?P<target>\d+)@(?P<step>\d+)-(?P<until>\d+):(?P<amount>\d+(\.\d*)?)$"),
                   "delay_host:HOST@FIRST-LAST:SECONDS"),
    "slow_host": (re.compile(r"^slow_host:(?P<target>\d+)@(?P<step>\d+)(-(?P<until>\d+))?:(?P<amount>\d+(\.\d*)?)$"),
                  "slow_host:HOST@STEP[-LAST]:FACTOR"),
}

# When a kill_host fires, besides inside a step: the moments of a recovery and of a checkpoint save.
# formation, adopt and precompiled count generations; save and report count completed steps.
MOMENTS = ("formation", "adopt", "save", "report", "precompiled")

# Faults whose target is a host index (hN), checked against the run's host plan.
HOST_TARGETED = ("kill_host", "hang_host", "delay_host", "slow_host")
# Faults that a worker fires on itself or the controller acts on: they need an elastic run.
ELASTIC_ONLY = (*HOST_TARGETED, "kill_region", "join_host")


@dataclass(frozen=True)
class Fault:
    kind: str
    target: str | None
    step: int  # the step; for moment formation/adopt the generation G
    until: int | None = None  # delay_host, slow_host: last delayed step
    amount: float | None = None  # delay_host: seconds per step; slow_host: factor
    moment: str = "step"  # kill_host: "step" (inside step `step`) or one of MOMENTS

    def __str__(self) -> str:
        at = str(self.step) if self.moment == "step" else f"{self.moment}:{self.step}"
        text = f"{self.kind}{'' if self.target is None else ':' + self.target}@{at}"
        if self.until is not None:
            text += f"-{self.until}"
        return text if self.amount is None else f"{text}:{self.amount:g}"

    def delay_before(self, step: int, own_step_seconds: float) -> float:
        """Seconds this host waits before entering `step` (delay_host / slow_host)."""
        if self.kind == "delay_host" and self.step <= step <= self.until:
            return self.amount
        if self.kind == "slow_host" and step >= self.step and (self.until is None or step <= self.until):
            return (self.amount - 1.0) * own_step_seconds
        return 0.0


def parse_fault(spec: str) -> Fault:
    kind = spec.split(":", 1)[0].split("@", 1)[0]
    if kind not in _SPECS:
        usage = ", ".join(u for _, u in _SPECS.values())
        raise ConfigError(f"fault {spec!r}: unknown kind {kind!r} (known: {usage})")
    pattern, usage = _SPECS[kind]
    match = pattern.match(spec.strip())
    if not match:
        raise ConfigError(f"fault {spec!r}: expected {usage}")
    groups = match.groupdict()
    moment = groups.get("moment") or "step"
    if moment not in ("step", *MOMENTS):
        raise ConfigError(f"fault {spec!r}: unknown moment {moment!r} (known: {', '.join(MOMENTS)}; or a step "
                          f"number alone: {kind}:HOST@STEP)")
    fault = Fault(kind=kind, target=groups.get("target"), step=int(match["step"]),
                  until=int(groups["until"]) if groups.get("until") else None,
                  amount=float(groups["amount"]) if groups.get("amount") else None, moment=moment)
    if moment == "adopt" and fault.step < 1:
        raise ConfigError(f"fault {spec!r}: generation 0 adopts no state (it starts fresh or restores from "
                          "disk), so this can never fire; use adopt:G with G >= 1 (the world after a change)")
    if moment == "save" and fault.step < 1:
        raise ConfigError(f"fault {spec!r}: checkpoints are numbered by completed steps, from 1")
    if fault.until is not None and fault.until < fault.step:
        raise ConfigError(f"fault {spec!r}: the last delayed step {fault.until} is before the first {fault.step}")
    if fault.kind == "slow_host" and fault.amount <= 1.0:
        raise ConfigError(f"fault {spec!r}: FACTOR must be > 1 (a straggler is slower than the rest)")
    return fault


def parse_faults(specs: list[str]) -> list[Fault]:
    return [parse_fault(s) for s in specs]


def nan_shard_poison(faults: list[Fault]) -> dict[int, int]:
    """{data shard id: first poisoned step} for the data loader's poison hook."""
    poison: dict[int, int] = {}
    for fault in faults:
        if fault.kind == "nan_shard":
            shard = int(fault.target)
            poison[shard] = min(fault.step, poison.get(shard, fault.step))
    return poison
