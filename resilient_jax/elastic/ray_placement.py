"""Where the workers of a Ray run go: the preflight check and the placement plan, as pure functions.

No Ray here: nodes are plain `Node` records (built from `ray.nodes()` by the launcher), so every rule
is unit-tested on fake node lists (tests/test_ray_launcher.py).

Which nodes run workers -- the preflight check, done before anything starts:
  * A node runs a worker only if it advertises the custom resource `resilient_jax_host: 1`
    (`ray start --resources='{"resilient_jax_host": 1}'`, or `resources:` in a cluster YAML).
    Nodes without it (typically the head node that runs the driver) are left alone. The actor
    claims that resource, so Ray itself never puts two workers on one node.
  * Devices: a worker node that advertises GPUs runs its worker on them (the worker picks the
    platform itself, `gpu_env.detect_platform`: $JAX_PLATFORMS, else an installed CUDA plugin), so it
    must advertise GPU >= topology.devices_per_host, and the actor reserves that many GPUs (Ray sets
    CUDA_VISIBLE_DEVICES for it, which the worker inherits). A node without GPUs runs the worker on
    `devices_per_host` emulated CPU devices and needs CPU >= 1. A node that opted in but falls short
    is a ConfigError naming it and what it lacks, even if other nodes would do (`device_problem`).
    (The launcher cannot see which JAX plugin a node has installed; it takes the node's Ray GPU
    resource as the sign.)
  * Fewer usable alive nodes than max(runtime.min_hosts, initial hosts = sum of topology.regions
    hosts) is a ConfigError that says how many were found, how many are needed, which nodes are
    unusable and why, and what to do. Spares (`regions[].spares`) use extra nodes when there are
    some; otherwise they are started when nodes join (a warning says so).
  * Regions: a node may carry the custom resource `region:<name>` (cluster YAML:
    `resources: {"resilient_jax_host": 1, "region:us": 1}`). If any usable node carries
    `region:R`, hosts of region R go only to such nodes (too few is a ConfigError naming the
    region). A region no node is labelled with takes nodes without a region label of this config,
    in node order.
  * Workers on other machines must reach the controller: with nodes whose IP is not this machine's,
    `runtime.bind` must be an address of this machine they can reach (not loopback, not 0.0.0.0),
    with a token. The controller also hands that address to workers as the JAX coordinator.
"""

from __future__ import annotations

from dataclasses import dataclass

from resilient_jax.config import Config, ConfigError

HOST_RESOURCE = "resilient_jax_host"
REGION_PREFIX = "region:"


@dataclass(frozen=True)
class Node:
    node_id: str
    ip: str
    resources: dict

    @classmethod
    def from_ray(cls, entry: dict) -> Node:
        return cls(node_id=entry["NodeID"], ip=entry.get("NodeManagerAddress", "?"),
                   resources=dict(entry.get("Resources") or {}))

    @property
    def name(self) -> str:
        return f"node {self.node_id[:12]} ({self.ip})"

    def region(self, names: list[str]) -> str | None:
        """The config region this node is labelled with (`region:<name>`), if any."""
        for name in names:
            if self.resources.get(REGION_PREFIX + name, 0) > 0:
                return name
        return None


def is_worker_node(node: Node) -> bool:
    """Opted in to run a worker: advertises the custom resource resilient_jax_host."""
    return node.resources.get(HOST_RESOURCE, 0) >= 1


def uses_gpus(node: Node) -> bool:
    return node.resources.get("GPU", 0) > 0


def device_problem(node: Node, devices_per_host: int) -> str | None:
    """What a worker node lacks to provide `devices_per_host` devices, or None (the module docstring
    has the rule): GPU nodes need that many GPUs, every node at least one CPU."""
    missing = []
    if node.resources.get("CPU", 0) < 1:
        missing.append("CPU (has 0, needs >= 1)")
    gpus = node.resources.get("GPU", 0)
    if 0 < gpus < devices_per_host:
        missing.append(f"GPU (has {gpus:g}, topology.devices_per_host needs {devices_per_host})")
    return f"lacks {' and '.join(missing)}" if missing else None


def node_problem(node: Node, devices_per_host: int) -> str | None:
    """Why this node cannot run a worker, or None."""
    if not is_worker_node(node):
        return f"lacks resource {HOST_RESOURCE}"
    return device_problem(node, devices_per_host)


def pick_node(region: str, free: list[Node], usable: list[Node], names: list[str]) -> Node | None:
    """A free node for a host of `region`: one labelled `region:<region>` if the cluster labels any
    usable node so; otherwise the first free node without a label of this config."""
    if any(n.region(names) == region for n in usable):
        return next((n for n in free if n.region(names) == region), None)
    return next((n for n in free if n.region(names) is None), None)


def plan_placement(cfg: Config, nodes: list[Node], address: str, private: bool = False
                   ) -> tuple[dict[str, Node], list[Node]]:
    """(host -> node for the initial hosts, the usable nodes), or ConfigError naming the problem.
    `address`: the cluster's address, for messages; `private`: a private instance of this machine."""
    from resilient_jax.elastic.run import host_plan

    plan = host_plan(cfg)
    names = [r.name for r in cfg.topology.regions]
    devices = cfg.topology.devices_per_host
    usable = [n for n in nodes if node_problem(n, devices) is None]
    unusable = [f"{n.name} {node_problem(n, devices)}" for n in nodes if node_problem(n, devices) is not None]
    misconfigured = [n for n in nodes if is_worker_node(n) and device_problem(n, devices) is not None]
    shape = ", ".join(f"{r.name}={r.hosts}" for r in cfg.topology.regions)
    needed = max(cfg.runtime.min_hosts, len(plan))
    resources = f"--resources='{{\"{HOST_RESOURCE}\": 1}}'"
    if private:
        where = "private Ray instance (runtime.ray_address \"\")"
        start_node = (f"it has one node, this machine: start a cluster (`ray start --head {resources}`, then "
                      f"`ray start --address=<head>:6379 {resources}` on each other node) and set "
                      "runtime.ray_address=auto, or use runtime.launcher=local")
    else:
        where = f"Ray cluster {address}"
        start_node = (f"start more with `ray start --address={address} {resources}`"
                      f" (add \"{REGION_PREFIX}<name>\": 1 to pin a region), or shrink topology.regions")
    if misconfigured:  # meant to run a worker (it opted in) but cannot: the cluster needs fixing
        named = _some([f"{n.name} has resource {HOST_RESOURCE} but {device_problem(n, devices)}"
                       for n in misconfigured])
        gpus = f"GPU >= {devices} (topology.devices_per_host) and " if any(map(uses_gpus, misconfigured)) else ""
        raise ConfigError(
            f"{where}: {named}; a worker there needs {gpus}CPU >= 1: restart the node with the right resources "
            f"(`ray start --num-cpus/--num-gpus`) or without {HOST_RESOURCE}")
    if len(usable) < needed:
        why = f"; not usable: {_some(unusable)}" if unusable else ""
        raise ConfigError(
            f"{where}: {len(usable)} of {len(nodes)} alive nodes can run a worker, the config needs "
            f"{needed} (topology.regions {shape}, one node per host"
            f"{f', runtime.min_hosts {cfg.runtime.min_hosts}' if cfg.runtime.min_hosts > len(plan) else ''})"
            f"{why}; {start_node}")
    free = list(usable)
    placement: dict[str, Node] = {}
    for host, region in plan:
        node = pick_node(region, free, usable, names)
        if node is None:
            labelled = [n for n in usable if n.region(names) == region]
            wanted = sum(r.hosts for r in cfg.topology.regions if r.name == region)
            if labelled:
                what = (f"region {region} needs {wanted} hosts but only {len(labelled)} usable nodes carry "
                        f"resource {REGION_PREFIX}{region} ({', '.join(n.name for n in labelled)})")
            else:
                unlabelled = [n for n in usable if n.region(names) is None]
                what = (f"no usable node carries {REGION_PREFIX}{region}, so region {region} takes nodes without a "
                        f"region label, and only {len(unlabelled)} such nodes are left for the regions that need them")
            raise ConfigError(f"{where}: {what}; label more nodes (resources "
                              f"{{\"{HOST_RESOURCE}\": 1, \"{REGION_PREFIX}{region}\": 1}}) or change topology.regions")
        free.remove(node)
        placement[host] = node
    return placement, usable


def _some(items: list[str], shown: int = 4) -> str:
    """The first few of a list for a one-line message, and how many more."""
    more = f"; and {len(items) - shown} more" if len(items) > shown else ""
    return "; ".join(items[:shown]) + more
