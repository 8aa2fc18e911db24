"""The five context fields of a checkpoint, built from the live run.

    rng         seed, PRNG impl, base key data, the next step (keys derive from (seed, step, shard))
    data        the loader's DataPosition: step, offset, epoch, dataset version, quarantine list
    config      the canonical config hash, the resolved config, and the changes allowed on resume
    topology    hosts, regions, devices per host, mesh, generation, and topology changes
    provenance  commit sha, dirty flag, package and library versions, and commit changes

Each `history` list is carried from checkpoint to checkpoint, so the newest checkpoint tells every
allowed config change, reshard and code change the run went through.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from resilient_jax import rng
from resilient_jax.checkpoint.topology import build_topology
from resilient_jax.config import Config
from resilient_jax.data import DataPosition
from resilient_jax.provenance import code_provenance, library_versions


@dataclass
class History:
    """What previous resumes recorded; appended to by `validate.check_resume`."""

    config: list[dict[str, Any]] = field(default_factory=list)
    topology: list[dict[str, Any]] = field(default_factory=list)
    provenance: list[dict[str, Any]] = field(default_factory=list)

    def copy(self) -> History:
        return History(config=list(self.config), topology=list(self.topology), provenance=list(self.provenance))

    @classmethod
    def of(cls, context: dict[str, dict[str, Any]]) -> History:
        return cls(config=list(context["config"]["history"]), topology=list(context["topology"]["history"]),
                   provenance=list(context["provenance"]["history"]))


def rng_field(seed: int, next_step: int) -> dict[str, Any]:
    return {**rng.describe(seed), "next_step": int(next_step)}


def config_field(cfg: Config, history: list[dict[str, Any]] = ()) -> dict[str, Any]:
    return {"hash": cfg.hash, "config": cfg.to_dict(), "history": list(history)}


def provenance_field(history: list[dict[str, Any]] = ()) -> dict[str, Any]:
    return {**code_provenance(), "libraries": library_versions(), "history": list(history)}


def regions_of(cfg: Config) -> dict[int, str]:
    """Process index -> region name from the config's `topology.regions`, hosts numbered region by
    region; empty (every host "local") when the config names no regions."""
    regions = getattr(getattr(cfg, "topology", None), "regions", None) or []
    out: dict[int, str] = {}
    for region in regions:
        for _ in range(region.hosts):
            out[len(out)] = region.name
    return out


def build_context(cfg: Config, mesh, position: DataPosition, history: History | None = None, *,
                  generation: int = 0, regions: dict[int, str] | None = None) -> dict[str, dict[str, Any]]:
    """The five context dicts for a checkpoint at `position.step`. `regions` (process index ->
    region) overrides the config's static layout; the elastic runtime passes the live one."""
    history = history or History()
    return {
        "rng": rng_field(cfg.train.seed, position.step),
        "data": position.to_dict(),
        "config": config_field(cfg, history.config),
        "topology": build_topology(mesh, generation=generation,
                                   regions=regions if regions is not None else regions_of(cfg),
                                   history=history.topology),
        "provenance": provenance_field(history.provenance),
    }
