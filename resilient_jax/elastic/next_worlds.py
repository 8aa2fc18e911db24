"""The worlds most likely to follow the current one, as pure functions (for background compiles).

A world's compiled step depends on how many processes it has, their devices, and the region of
each rank (the region-aware reduction); not on which hosts they are. Survivors keep their order,
so the next world's ranks are the current ranks minus the lost ones, renumbered -- and JAX numbers
devices by process (process p owns the same device ids in every world). A world of n processes
therefore uses exactly the devices of ranks 0..n-1 of the current world, so rank 0 can compile its
program now, over that sub-mesh, and the persistent cache entry is the one the new world looks up
(measured: a 2-process program compiled by rank 0 of a 3-process world is a cache hit in a
2-process world, on every rank).

Candidates, most likely first: one host fewer (one candidate per region a host can be lost from;
removing any host of a contiguous region gives the same sequence), then one region fewer. A world
with more hosts needs devices that do not exist yet, so it cannot be compiled ahead; nor can one
below `min_hosts` (it is never formed).

With replica groups of k hosts (parallel.hosts_per_replica), the unit is a group: a world's ranks
are its complete groups, k consecutive ranks each, and a death idles its whole group. So the
candidates are one group fewer, then every group with a host in one region fewer; never fewer
than `min_replicas` groups.
"""

from __future__ import annotations

from collections.abc import Sequence


def likely_next_worlds(regions_by_rank: Sequence[str], *, min_hosts: int = 1, hosts_per_replica: int = 1,
                       min_replicas: int = 1) -> list[tuple[str, ...]]:
    """The region of each rank (rank order) of every likely next world, most likely first, unique."""
    current = tuple(regions_by_rank)
    k = hosts_per_replica
    groups = [current[i:i + k] for i in range(0, len(current), k)]
    out: list[tuple[str, ...]] = []

    def add(kept: list[tuple[str, ...]]) -> None:
        world = tuple(r for group in kept for r in group)
        if (len(world) >= max(1, min_hosts) and len(kept) >= max(1, min_replicas) and world != current
                and world not in out):
            out.append(world)

    for i in range(len(groups)):
        add(groups[:i] + groups[i + 1:])
    for region in dict.fromkeys(current):
        add([g for g in groups if region not in g])
    return out
