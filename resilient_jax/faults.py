"""Fault injections, named in config (`faults:`) or on the command line (`--fault`).

Spec grammar (one string per fault):
    nan_shard:SHARD@STEP      poison data shard SHARD's loss weights with NaN from STEP on

Every injected fault is reported in summary.json next to the response the run took.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from resilient_jax.config import ConfigError

_SPECS = {
    "nan_shard": re.compile(r"^nan_shard:(?P<target>\d+)@(?P<step>\d+)$"),
}
_USAGE = {"nan_shard": "nan_shard:SHARD@STEP"}


@dataclass(frozen=True)
class Fault:
    kind: str
    target: int
    step: int

    def __str__(self) -> str:
        return f"{self.kind}:{self.target}@{self.step}"


def parse_fault(spec: str) -> Fault:
    kind = spec.split(":", 1)[0]
    if kind not in _SPECS:
        raise ConfigError(f"fault {spec!r}: unknown kind {kind!r} (known: {', '.join(sorted(_USAGE.values()))})")
    match = _SPECS[kind].match(spec.strip())
    if not match:
        raise ConfigError(f"fault {spec!r}: expected {_USAGE[kind]}")
    return Fault(kind=kind, target=int(match["target"]), step=int(match["step"]))


def parse_faults(specs: list[str]) -> list[Fault]:
    return [parse_fault(s) for s in specs]


def nan_shard_poison(faults: list[Fault]) -> dict[int, int]:
    """{data shard id: first poisoned step} for the data loader's poison hook."""
    poison: dict[int, int] = {}
    for fault in faults:
        if fault.kind == "nan_shard":
            poison[fault.target] = min(fault.step, poison.get(fault.target, fault.step))
    return poison
