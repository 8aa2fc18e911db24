"""Fault injections, named in config (`faults:`) or on the command line (`--fault`).

Spec grammar (one string per fault):
    nan_shard:SHARD@STEP      poison data shard SHARD's loss weights with NaN from STEP on
    kill_host:H@STEP          SIGKILL host H (index in topology order) during step STEP
    kill_region:R@STEP        SIGKILL every host of region R at once during step STEP
    hang_host:H@STEP          SIGSTOP host H during step STEP (it stops answering, it does not exit)
    join_host@STEP            start one more host once the run reaches step STEP

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
    "kill_host": (re.compile(r"^kill_host:(?P<target>\d+)@(?P<step>\d+)$"), "kill_host:HOST@STEP"),
    "kill_region": (re.compile(r"^kill_region:(?P<target>[\w.-]+)@(?P<step>\d+)$"), "kill_region:REGION@STEP"),
    "hang_host": (re.compile(r"^hang_host:(?P<target>\d+)@(?P<step>\d+)$"), "hang_host:HOST@STEP"),
    "join_host": (re.compile(r"^join_host@(?P<step>\d+)$"), "join_host@STEP"),
}


@dataclass(frozen=True)
class Fault:
    kind: str
    target: str | None
    step: int

    def __str__(self) -> str:
        return f"{self.kind}{'' if self.target is None else ':' + self.target}@{self.step}"


def parse_fault(spec: str) -> Fault:
    kind = spec.split(":", 1)[0].split("@", 1)[0]
    if kind not in _SPECS:
        usage = ", ".join(u for _, u in _SPECS.values())
        raise ConfigError(f"fault {spec!r}: unknown kind {kind!r} (known: {usage})")
    pattern, usage = _SPECS[kind]
    match = pattern.match(spec.strip())
    if not match:
        raise ConfigError(f"fault {spec!r}: expected {usage}")
    return Fault(kind=kind, target=match.groupdict().get("target"), step=int(match["step"]))


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
