"""Per-device figures read from a compiled XLA program's text: matmul FLOPs and collective bytes.

XLA's own `compiled.cost_analysis()` counts the body of a while loop once, whatever its trip count,
so a scanned layer stack or the `lax.map` over virtual shards is under-counted by the loop length.
This module walks the compiled HLO's call graph instead and multiplies every computation by how
often it runs: a while body by its `known_trip_count` (XLA annotates counted loops), everything
else (fusions, calls, conditionals' branches, reductions' combiners) by 1. A loop without a known
trip count is counted once and reported in `unknown_trip_counts`.

Counted per device (the compiled SPMD program is one device's program):
- dot FLOPs: 2 x prod(output dims) x prod(contracted dims of the left operand), for every `dot`.
  Elementwise work is not counted (cost_analysis's figure has it, once per loop body).
- collective bytes: what one device sends over the wire per execution, for ring algorithms over
  a group of n devices, with `size` = the op's full (unsharded-by-the-op) result in bytes:
      all-gather          size x (n-1)/n     (result = the gathered array)
      reduce-scatter      size x (n-1)       (result = one shard; the input is n shards)
      all-reduce          size x 2(n-1)/n    (reduce-scatter then all-gather)
      all-to-all          size x (n-1)/n
      collective-permute  size               (each device sends its whole buffer once)
  Async pairs are counted once, at their `-done` (whose result is the op's result). Groups of
  size 1 move nothing.

With `device_regions` (the region of each device id), two whole-cluster figures per execution
say what crosses a region boundary:
- `cross_region_operand_bytes`: for every collective whose replica group spans more than one
  region, the bytes each member hands to it (all-reduce: its buffer; reduce-scatter: the n
  shards; all-gather: its one shard), summed over the members. It does not depend on the
  algorithm: the flat reduction hands every replica's full buffer to a group spanning all regions.
- `cross_region_ring_bytes`: the ring model above, counting what each member sends to the next
  member of its group where that member lies in another region.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s+=\s+(.*?)\s+([a-z][\w\-]*)\((.*)$")
_SHAPE = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_IOTA_GROUPS = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")


def _shapes(text: str) -> list[tuple[str, list[int]]]:
    return [(dt, [int(d) for d in dims.split(",") if d]) for dt, dims in _SHAPE.findall(text)
            if dt in DTYPE_BYTES]


def _bytes(shapes) -> int:
    return sum(DTYPE_BYTES[dt] * math.prod(dims) for dt, dims in shapes)


def _group_size(line: str, num_devices: int) -> int:
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=", line)
    if iota:
        return int(iota.group(1).split(",")[-1])
    explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if explicit:
        return len([x for x in explicit.group(1).split(",") if x])
    pairs = re.search(r"source_target_pairs=\{([^}]*)\}", line)
    if pairs:
        return 2
    return num_devices  # replica_groups={} = every device


def _groups(line: str, num_devices: int) -> list[list[int]]:
    """The replica groups of a collective as lists of device ids (all devices for `{}`)."""
    iota = _IOTA_GROUPS.search(line)
    if iota:
        shape = [int(x) for x in iota.group(1).split(",")]
        ids = np.arange(math.prod(int(x) for x in iota.group(2).split(","))).reshape(
            [int(x) for x in iota.group(2).split(",")])
        if iota.group(3):
            ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
        return ids.reshape(shape).tolist()
    explicit = _EXPLICIT_GROUPS.search(line)
    if explicit and explicit.group(1):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))]
    return [list(range(num_devices))]


def _operand_bytes(op: str, size: int, n: int) -> float:
    """What one member hands to the collective (size: the op's result, as in _wire_bytes)."""
    return {"all-gather": size / n, "reduce-scatter": size * n}.get(op, float(size))


def _cross_region(op: str, line: str, size: int, num_devices: int, regions) -> tuple[float, float]:
    """(operand bytes, ring bytes) of one execution that cross a region boundary, whole cluster."""
    if op == "collective-permute":
        pairs = re.search(r"source_target_pairs=\{([^}]*)\}", line)
        crossing = [p for p in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1) if pairs else "")
                    if regions[int(p[0])] != regions[int(p[1])]]
        return float(size * len(crossing)), float(size * len(crossing))
    operand = ring = 0.0
    for group in _groups(line, num_devices):
        n = len(group)
        if n < 2 or len({regions[d] for d in group}) < 2:
            continue
        operand += n * _operand_bytes(op, size, n)
        hops = sum(regions[group[i]] != regions[group[(i + 1) % n]] for i in range(n))
        ring += hops * _wire_bytes(op, size, n)
    return operand, ring


def _wire_bytes(op: str, size: int, n: int) -> float:
    if n <= 1:
        return 0.0
    return {
        "all-gather": size * (n - 1) / n,
        "reduce-scatter": size * (n - 1),
        "all-reduce": size * 2 * (n - 1) / n,
        "all-to-all": size * (n - 1) / n,
        "collective-permute": float(size),
    }[op]


@dataclass
class _Computation:
    dot_flops: float = 0.0
    collective_bytes: dict[str, float] = field(default_factory=dict)
    collective_count: dict[str, int] = field(default_factory=dict)
    cross_region: list[float] = field(default_factory=lambda: [0.0, 0.0])  # operand, ring bytes
    calls: list[tuple[str, int]] = field(default_factory=list)  # (callee, times per execution)


@dataclass
class HloStats:
    dot_flops: float
    collective_bytes: dict[str, float]  # op -> bytes one device sends per program execution
    collective_count: dict[str, int]  # op -> executions per program execution (loops unrolled)
    unknown_trip_counts: int
    cross_region_operand_bytes: float | None = None  # whole cluster, with device_regions (see above)
    cross_region_ring_bytes: float | None = None

    @property
    def total_collective_bytes(self) -> float:
        return sum(self.collective_bytes.values())


def _collective_op(opcode: str) -> str | None:
    if opcode.endswith("-start"):
        return None  # counted at its -done
    base = opcode[: -len("-done")] if opcode.endswith("-done") else opcode
    return base if base in COLLECTIVES else None


def analyze(hlo_text: str, num_devices: int, device_regions: list[str] | None = None) -> HloStats:
    computations: dict[str, _Computation] = {}
    entry = None
    unknown = 0
    current: _Computation | None = None
    symbols: dict[str, list[tuple[str, list[int]]]] = {}
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = computations.setdefault(header.group(1), _Computation())
            symbols = {}
            if line.startswith("ENTRY"):
                entry = header.group(1)
            continue
        if current is None:
            continue
        inst = _INSTRUCTION.match(line)
        if not inst:
            continue
        name, result_type, opcode, rest = inst.groups()
        result = _shapes(result_type)
        symbols[name] = result
        if opcode == "dot" and result:
            lhs = re.match(r"\s*%?([\w.\-]+)", rest)
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
            lhs_shape = symbols.get(lhs.group(1)) if lhs else None
            if lhs_shape and contracting:
                dims = lhs_shape[0][1]
                k = math.prod(dims[int(i)] for i in contracting.group(1).split(",") if i)
                current.dot_flops += 2.0 * math.prod(result[0][1]) * k
        op = _collective_op(opcode)
        if op:
            size = _bytes(result)
            n = _group_size(rest, num_devices)
            current.collective_bytes[op] = current.collective_bytes.get(op, 0.0) + _wire_bytes(op, size, n)
            current.collective_count[op] = current.collective_count.get(op, 0) + 1
            if device_regions is not None:
                operand, ring = _cross_region(op, rest, size, num_devices, device_regions)
                current.cross_region[0] += operand
                current.cross_region[1] += ring
        trips = 1
        if opcode == "while":
            count = _TRIP_COUNT.search(rest)
            if count:
                trips = int(count.group(1))
            else:
                unknown += 1
        body = re.search(r"body=%?([\w.\-]+)", rest) if opcode == "while" else None
        for callee in _CALLEE.findall(rest):
            current.calls.append((callee, trips if body and callee == body.group(1) else 1))
        branches = _BRANCHES.search(rest)
        if branches:
            for callee in re.findall(r"%?([\w.\-]+)", branches.group(1)):
                current.calls.append((callee, 1))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")

    def total(name: str, seen: tuple[str, ...] = ()):
        comp = computations.get(name)
        if comp is None or name in seen:
            return 0.0, {}, {}, [0.0, 0.0]
        flops, coll, count = comp.dot_flops, dict(comp.collective_bytes), dict(comp.collective_count)
        cross = list(comp.cross_region)
        for callee, times in comp.calls:
            f, c, k, x = total(callee, (*seen, name))
            flops += times * f
            for op, b in c.items():
                coll[op] = coll.get(op, 0.0) + times * b
            for op, m in k.items():
                count[op] = count.get(op, 0) + times * m
            cross = [cross[0] + times * x[0], cross[1] + times * x[1]]
        return flops, coll, count, cross

    flops, coll, count, cross = total(entry)
    regional = device_regions is not None
    return HloStats(dot_flops=flops, collective_bytes=coll, collective_count=count, unknown_trip_counts=unknown,
                    cross_region_operand_bytes=cross[0] if regional else None,
                    cross_region_ring_bytes=cross[1] if regional else None)
