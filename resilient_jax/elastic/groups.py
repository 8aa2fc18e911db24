"""Replica groups: the membership unit when one replica spans several hosts.

With `parallel.hosts_per_replica = k > 1` a replica's weights, gradients and optimizer state are
sharded (fsdp x tensor) over the k x devices_per_host devices of k hosts, and replicas run along
`data`. A host then holds only its slice of the state, so a host's death breaks its whole group:
the group's survivors stop computing and wait, idle, holding their slices; the run goes on with
the remaining complete groups (the virtual shards spread over them; the exact reduction keeps the
bits); and when a replacement host (or a spare) fills the vacant slot, the group re-forms and
heals from a sibling replica, slice by slice (resilient_jax.elastic.transfer.heal).

A group is k slots with stable positions: slot i holds fsdp positions [i*d, (i+1)*d) of its
replica (d = devices per host), so a survivor keeps its slices' place in every later world and
a replacement takes exactly the vacant one. The next world's members are the complete groups'
hosts, group-major (mesh.build_mesh puts each group on one `data` row).

Everything here is pure: the controller applies the result under its lock; tests/test_groups.py
covers every transition.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from resilient_jax.config import Config, ConfigError


@dataclass(frozen=True)
class Group:
    region: str  # its hosts' region ("a+b" for a group spanning regions: allow_cross_region_replica)
    slots: tuple[str | None, ...]  # host per slot; None: vacant

    def complete(self, live: Collection[str]) -> bool:
        return all(h is not None and h in live for h in self.slots)

    def to_dict(self) -> dict:
        return {"region": self.region, "slots": list(self.slots)}


@dataclass(frozen=True)
class Regrouping:
    groups: tuple[Group, ...]  # every group, complete or not, in its stable order
    complete: tuple[int, ...]  # indices of the complete groups: the next world's replicas, in this order
    members: tuple[str, ...]  # their hosts, group-major: the next world in rank order
    idle: tuple[str, ...]  # live hosts of incomplete groups: in no world, holding their slices
    placed: tuple[str, ...]  # candidates (spares, newcomers) that took a slot
    unplaced: tuple[str, ...]  # newcomers left without a slot: they wait as spares


def host_order(host: str) -> tuple[int, str]:
    """h2 before h10 (host ids are h<number>; any other id sorts after, by name)."""
    return (int(host[1:]), "") if host[1:].isdigit() else (1 << 30, host)


def layout(cfg: Config) -> Config:
    """The effective config of a run with replica groups: fsdp spans the group's devices when it
    was left at 1; data (when -1) follows from the world's devices. Refuses, naming the key, a
    layout that cannot make groups. k = 1 returns `cfg` unchanged."""
    k = cfg.parallel.hosts_per_replica
    if k == 1:
        return cfg
    per_host, tensor = cfg.topology.devices_per_host, max(cfg.parallel.tensor, 1)
    group_devices = k * per_host
    fsdp = cfg.parallel.fsdp
    if fsdp == 1:
        if group_devices % tensor:
            raise ConfigError(f"parallel.tensor = {tensor} does not divide the {group_devices} devices of a replica "
                              f"group (parallel.hosts_per_replica {k} x topology.devices_per_host {per_host})")
        fsdp = group_devices // tensor
    if fsdp * tensor != group_devices:
        raise ConfigError(
            f"parallel.hosts_per_replica = {k}: a replica group has {group_devices} devices ({k} hosts x "
            f"{per_host}), but parallel.fsdp x parallel.tensor = {fsdp * tensor}; leave parallel.fsdp at 1 (it "
            f"becomes {group_devices // tensor}) or set it so that fsdp x tensor = {group_devices}")
    hosts = [r.hosts for r in cfg.topology.regions]
    if cfg.parallel.allow_cross_region_replica:
        if sum(hosts) % k:
            raise ConfigError(f"parallel.hosts_per_replica = {k} does not divide the run's {sum(hosts)} hosts "
                              "(topology.regions[].hosts); pick a k that does")
    else:
        for region in cfg.topology.regions:
            if region.hosts % k:
                raise ConfigError(
                    f"parallel.hosts_per_replica = {k} does not divide topology.regions[{region.name}].hosts = "
                    f"{region.hosts}: a replica group would span regions (its fsdp collectives crossing the WAN "
                    "every layer); give each region a multiple of k hosts, or set "
                    "parallel.allow_cross_region_replica: true")
    groups = sum(hosts) // k
    if groups < cfg.runtime.min_replicas:
        raise ConfigError(f"runtime.min_replicas = {cfg.runtime.min_replicas}, but the topology makes only {groups} "
                          f"replica groups of {k} hosts; lower it or add hosts")
    if cfg.parallel.data not in (-1, groups):
        raise ConfigError(f"parallel.data = {cfg.parallel.data}: with replica groups it is the number of complete "
                          f"groups ({groups} at the start, fewer after a loss); set it to -1")
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, fsdp=fsdp, data=-1))


def initial(hosts: Sequence[tuple[str, str]], k: int) -> tuple[Group, ...]:
    """`hosts`: (host, region) in topology order; each k consecutive hosts form a group (`layout`
    made k divide each region's hosts, or with allow_cross_region_replica their total)."""
    groups = []
    for i in range(0, len(hosts) - len(hosts) % k, k):
        chunk = hosts[i:i + k]
        groups.append(Group(_region_name(r for _, r in chunk), tuple(h for h, _ in chunk)))
    return tuple(groups)


def regroup(groups: Sequence[Group], *, live: Collection[str], spares: Sequence[tuple[str, str]],
            newcomers: Sequence[tuple[str, str]], k: int, cross_region: bool) -> Regrouping:
    """The groups of the next world.

    `live`: hosts that keep their slot (alive members and idle hosts); every other slot is vacated.
    A group with vacancies is completed from `spares`, then `newcomers`, of its region (any region
    with `cross_region`) -- only when all its vacancies can be filled, so a candidate never waits
    in a group that stays broken. A group emptied (a region lost) re-forms from k candidates of one
    region. Newcomers left over form new groups, k of one region at a time (growth); the rest wait
    as spares."""
    pool = [(h, r, False) for h, r in spares] + [(h, r, True) for h, r in newcomers]
    regions_of = {h: r for h, r, _ in pool}
    placed: list[str] = []

    def take(n: int, region: str | None, *, newcomers_only: bool = False) -> list[str] | None:
        chosen = _choose([c for c in pool if c[2] or not newcomers_only], n, region, cross_region)
        if chosen is not None:
            pool[:] = [c for c in pool if c[0] not in chosen]
            placed.extend(chosen)
        return chosen

    out: list[Group] = []
    for group in groups:
        slots = [h if h is not None and h in live else None for h in group.slots]
        vacant = [i for i, h in enumerate(slots) if h is None]
        region = group.region
        if vacant:
            emptied = len(vacant) == len(slots)
            taken = take(len(vacant), None if emptied else group.region)
            if taken is not None:
                for i, h in zip(vacant, taken):
                    slots[i] = h
                if emptied:
                    region = _region_name(regions_of[h] for h in taken)
        out.append(Group(region, tuple(slots)))
    # Growth: newcomers left over, k of one region at a time, form new groups.
    while (taken := take(k, None, newcomers_only=True)) is not None:
        out.append(Group(_region_name(regions_of[h] for h in taken), tuple(taken)))
    filled = set(live) | set(placed)
    complete = tuple(i for i, g in enumerate(out) if g.complete(filled))
    members = tuple(h for i in complete for h in out[i].slots)
    idle = tuple(h for i, g in enumerate(out) if i not in complete for h in g.slots if h is not None)
    return Regrouping(groups=tuple(out), complete=complete, members=members, idle=idle, placed=tuple(placed),
                      unplaced=tuple(h for h, _, new in pool if new))


@dataclass(frozen=True)
class Source:
    step: int  # steps completed by the state the next world adopts
    group: int  # its row along `data` in the next world (index into Regrouping.complete)
    host: str  # the group's first host (the world's `source`)
    holders: tuple[str, ...]  # members holding that step's slices of their own slot


def pick_source(regrouping: Regrouping, completed: Mapping[str, int]) -> Source | None:
    """The complete group of the next world that holds the newest state whole: every one of its
    hosts reported the same completed step. A host's slices are the state after its own completed
    step, so a group whose hosts differ holds no consistent state. None: no complete group holds
    one (the world restores from the newest checkpoint)."""
    best: tuple[int, int] | None = None
    for row, index in enumerate(regrouping.complete):
        steps = {completed.get(h, -1) for h in regrouping.groups[index].slots}
        if len(steps) == 1 and (step := steps.pop()) >= 0 and (best is None or step > best[0]):
            best = (step, row)
    if best is None:
        return None
    step, row = best
    host = regrouping.groups[regrouping.complete[row]].slots[0]
    return Source(step=step, group=row, host=host,
                  holders=tuple(h for h in regrouping.members if completed.get(h, -1) == step))


def _region_name(regions) -> str:
    return "+".join(sorted(set(regions)))


def _choose(pool: list[tuple[str, str, bool]], n: int, region: str | None, cross_region: bool) -> list[str] | None:
    """The first n candidates of `region` (None: of the first region that has n; with
    cross_region, of any), or None when there are fewer."""
    if cross_region:
        fits = pool
    elif region is not None:
        fits = [c for c in pool if c[1] == region]
    else:
        regions = [r for _, r, _ in pool]
        region = next((r for r in dict.fromkeys(regions) if regions.count(r) >= n), None)
        fits = [c for c in pool if c[1] == region]
    return [h for h, _, _ in fits[:n]] if n and len(fits) >= n else None
