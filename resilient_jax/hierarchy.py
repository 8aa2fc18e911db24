"""Region-aware gradient reduction: which devices sum together, in which order (pure planning).

The flat reduction all-reduces every data-parallel replica's gradient buffer over the whole `data`
axis: each host hands its FULL buffer to a collective whose group spans every region. With the
exact (integer) reduction any order gives the same bits, so the sum can instead run

    1. within each region: a reduce-scatter, leaving member j of the region with slice j of the
       region's partial sum (k slices, k = the smallest region's member count);
    2. across regions: member j of every region all-reduces slice j only -- the one collective
       that crosses a region boundary, carrying 1/k of the buffer per member;
    3. within each region: an all-gather of the k slices.

The exact sum over equal regions splits phase 2 too (collectives.data_scatter_sum): member j of
every region reduce-scatters slice j across regions, each converts its part to float32, and the
float32 parts come back by an all-gather across regions and one within.

Regions of unequal size (46 nodes as 12+12+12+10, or any region after a host loss) cannot use a
reduce-scatter with one group size, so phases 1 and 3 become all-reduces within the region (phase
3 of a buffer that is zero outside each member's slice: exact), and members j >= k sit phase 2 out
(a group of one). Only phase 2 crosses regions either way.

Members are indices along the mesh's `data` axis; a device's region is its host's. The planner sees
only region names, so every process derives the same groups from the same world.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RegionGroups:
    regions: tuple[str, ...]  # the region of each data index
    in_region: tuple[tuple[int, ...], ...]  # each region's data indices, ascending, regions in first-seen order
    cross: tuple[tuple[int, ...], ...]  # phase 2: one group per slice (member j of every region), then singletons
    slices: int  # k: the buffer is cut into k slices for the cross-region phase

    @property
    def uniform(self) -> bool:
        """Every region has k members: phases 1 and 3 are a reduce-scatter and an all-gather."""
        return all(len(g) == self.slices for g in self.in_region)

    def position(self) -> tuple[int, ...]:
        """Each data index's position within its region (member j)."""
        pos = [0] * len(self.regions)
        for group in self.in_region:
            for j, d in enumerate(group):
                pos[d] = j
        return tuple(pos)

    def describe(self) -> str:
        sizes = "+".join(str(len(g)) for g in self.in_region)
        return (f"region-aware: {len(self.in_region)} regions of {sizes} replicas, "
                f"1/{self.slices} of the buffer per replica crosses regions")


def plan(regions: list[str]) -> RegionGroups | None:
    """The groups for `regions` (the region of each data index), or None where the region-aware
    order is the flat one: fewer than 2 regions, or one replica per region."""
    names = list(dict.fromkeys(regions))
    if len(names) < 2:
        return None
    in_region = tuple(tuple(d for d, r in enumerate(regions) if r == name) for name in names)
    if all(len(g) == 1 for g in in_region):
        return None
    k = min(len(g) for g in in_region)
    cross = [tuple(g[j] for g in in_region) for j in range(k)]
    cross += [(d,) for g in in_region for d in g[k:]]
    return RegionGroups(regions=tuple(regions), in_region=in_region, cross=tuple(cross), slices=k)


def data_regions(devices: np.ndarray, region_of_process: dict[int, str]) -> list[str] | None:
    """The region of each index of the mesh's `data` axis (axis 0 of `devices`), or None when a
    data index's devices lie in more than one region (the order then stays flat)."""
    regions = []
    for row in devices:
        names = {region_of_process[d.process_index] for d in np.asarray(row).flat}
        if len(names) != 1:
            return None
        regions.append(names.pop())
    return regions


def device_regions(devices: np.ndarray, region_of_process: dict[int, str]) -> list[str]:
    """The region of each device in the mesh's flat order (the compiled program's device ids)."""
    return [region_of_process[d.process_index] for d in np.asarray(devices).flat]
