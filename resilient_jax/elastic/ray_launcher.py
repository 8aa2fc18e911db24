"""`runtime.launcher: ray` -- one worker per node of a Ray cluster.

Same contract as `LocalLauncher` (start_host / fence / stop / pids). Each host is a small Ray actor
(`HostActor`, pinned to its node) that runs the ordinary worker CLI as a subprocess on that node:
`python -m resilient_jax.elastic worker --controller URL --host hN --region R --config-json FILE
--devices N [--spare]`, with the token in $RESILIENT_JAX_TOKEN. The controller stays in the driver
process (the train CLI); the launcher only starts, watches and kills workers.

Connecting (`runtime.ray_address`):
  ""            starts a private Ray instance on this machine (one node; `stop()` shuts it down).
  "auto"        attaches to the cluster this machine belongs to; host:port attaches to that one.
                `stop()` only disconnects; the cluster keeps running.

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

Runtime:
  * Death: a watcher thread waits on every actor's `wait()`; the worker exiting reports
    `on_exit(host, code)`; the actor or its node dying (RayActorError, node removed, ...) reports
    `on_exit(host, -9)`. The worker subprocess is started with PR_SET_PDEATHSIG=SIGKILL, so it dies
    with its actor (a fake node removed from a `ray.cluster_utils.Cluster` takes its worker along).
  * Fence: SIGKILL the worker through its actor; if that fails, kill the actor (the worker dies
    with it); if the actor or node is already gone there is nothing left to do.
  * Node join: an alive usable node that was not in the cluster when the run started gets a new
    host (the next free id after initial hosts, spares and `join_host` faults; its region is the
    node's `region:` label, else the region with the fewest live hosts). It registers with the
    controller and joins the running world. A `start_host` that finds no free node (a spare, a
    `join_host`) waits for the next node that joins instead.

Limitations on a real multi-machine cluster: `resilient_jax` (same version) and the dataset must be
installed on every node; `run.dir` / `checkpoint.dir` must be on a filesystem all nodes share
(workers write checkpoints); the config travels as content (the actor writes it to a local temp
file). Worker logs go to `<run.dir>/elastic/logs/<host>.log` when that path is writable on the node,
else to `$TMPDIR/resilient_jax_logs/<host>.log` on the node (the path is in the actor's `info()`).
The worker's environment is the node's (minus what Ray sets for its own worker processes) plus the
driver's RESILIENT_JAX_* variables and the token; JAX/XLA settings come from the node and from
`resilient_jax.gpu_env`, which the worker applies itself.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from resilient_jax.config import Config, ConfigError
from resilient_jax.elastic.tls import CA_ENV as TLS_CA_ENV

log = logging.getLogger(__name__)

HOST_RESOURCE = "resilient_jax_host"
REGION_PREFIX = "region:"
NODE_POLL_SECONDS = 1.0


# -- nodes and the placement plan (pure functions, no Ray; unit-tested on fake node lists) ----------


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


def _is_loopback_or_any(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return addr.is_loopback or addr.is_unspecified


def _check_gcs_reachable(address: str, timeout: float = 5.0) -> None:
    """Fail fast, with one line, when runtime.ray_address names a host:port nothing listens on."""
    import socket

    if address == "auto" or address.startswith("ray://") or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return
    except (OSError, ValueError) as e:
        raise ConfigError(f"runtime.ray_address={address!r}: no Ray cluster answers there ({e}); start one "
                          "(`ray start --head`) and use its address (or \"auto\" on a cluster node), or set "
                          "runtime.ray_address=\"\" for a private instance on this machine") from None


# -- the actor that runs one worker on its node ----------------------------------------------------


def _prepare_child(libc, parent_pid: int, niceness: int) -> None:
    """preexec_fn of the worker: SIGKILL it when the thread that started it (alive as long as the
    child is) or its process dies -- a worker must not outlive its actor or node; and give it back
    the raylet's CPU priority (Ray runs its worker processes, hence this actor, at nice 15, which
    would make the training process lose every contest for the CPU). Best effort: without the
    permission to lower niceness the worker keeps the actor's."""
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
    except OSError:
        pass


def _raylet_niceness() -> int:
    try:
        return os.getpriority(os.PRIO_PROCESS, int(os.environ["RAY_RAYLET_PID"]))
    except (KeyError, ValueError, OSError):
        return 0


# The actor's own environment is the node's plus what Ray sets for its worker processes; the
# training process gets the node's, without Ray's per-task settings.
_RAY_ONLY_ENV = ("OMP_NUM_THREADS", "PYTHONBREAKPOINT")


class HostActor:
    """Runs one worker subprocess on this node; `wait()` returns its exit code. (Threaded actor:
    `kill()` and `info()` run while `wait()` blocks.)"""

    def __init__(self, host: str, argv: list[str], config_json: str, log_dir: str, env: dict, cwd: str):
        import ray

        self.host = host
        self.tmp = tempfile.mkdtemp(prefix=f"resilient-jax-{host}-")
        config_path = Path(self.tmp) / "config.json"
        config_path.write_text(config_json)
        self.log_path = self._log_path(Path(log_dir), host)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.ip = ray.util.get_node_ip_address()
        cmd = [sys.executable, "-m", "resilient_jax.elastic", "worker", *argv, "--config-json", str(config_path)]
        node_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k not in _RAY_ONLY_ENV}
        full_env = {**node_env, **env}
        self.code: int | None = None
        self.proc: subprocess.Popen | None = None
        self._done = threading.Event()
        self._started = threading.Event()
        self._error: str | None = None
        with open(self.log_path, "ab") as f:
            f.write(f"resilient_jax ray: {host} on node {self.node_id} ({self.ip}), actor pid {os.getpid()}\n"
                    .encode())
        # The child's PDEATHSIG follows the thread that forks it, so that thread lives as long as the child.
        threading.Thread(target=self._run, args=(cmd, full_env, cwd), name=f"{host}-worker", daemon=True).start()
        self._started.wait()
        if self._error:
            raise RuntimeError(self._error)

    @staticmethod
    def _log_path(log_dir: Path, host: str) -> Path:
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            path = log_dir / f"{host}.log"
            with open(path, "ab"):
                pass
            return path
        except OSError:
            fallback = Path(tempfile.gettempdir()) / "resilient_jax_logs"
            fallback.mkdir(parents=True, exist_ok=True)
            return fallback / f"{host}.log"

    def _run(self, cmd: list[str], env: dict, cwd: str) -> None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork: the child only calls it
        pid, nice = os.getpid(), _raylet_niceness()
        try:
            with open(self.log_path, "ab") as log_file:
                self.proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                             cwd=cwd if os.path.isdir(cwd) else self.tmp,
                                             preexec_fn=lambda: _prepare_child(libc, pid, nice))
        except OSError as e:
            self._error = f"could not start the worker for {self.host}: {e}"
            self.code = 127
            self._started.set()
            self._done.set()
            return
        self._started.set()
        self.code = self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._done.set()

    def info(self) -> dict:
        return {"node_id": self.node_id, "ip": self.ip, "pid": self.proc.pid if self.proc else None,
                "log": str(self.log_path)}

    def wait(self) -> int:
        self._done.wait()
        return self.code

    def kill(self) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # SIGKILL, which also ends a SIGSTOPped worker
        return self.code


# -- the launcher -----------------------------------------------------------------------------------


@dataclass
class _Host:
    host: str
    region: str
    spare: bool
    node: Node
    actor: object
    ref: object  # ObjectRef of actor.wait()
    info_ref: object
    code: int | None = None
    done: bool = False


class RayLauncher:
    def __init__(self, *, cfg: Config, controller_url: str, token: str, config_path: Path, log_dir: Path,
                 on_exit, devices_per_host: int, tls_ca_pem: str = ""):
        import ray

        from resilient_jax import faults as faults_lib
        from resilient_jax.elastic.run import host_plan

        self.cfg = cfg
        self.controller_url = controller_url
        self.token = token
        self.config_json = Path(config_path).read_text()
        self.log_dir = Path(log_dir).resolve()
        self.on_exit = on_exit
        self.devices_per_host = devices_per_host
        self.names = [r.name for r in cfg.topology.regions]
        address = cfg.runtime.ray_address
        self._owns_connection = not ray.is_initialized()
        self._private = self._owns_connection and not address
        if self._owns_connection:
            quiet = {"include_dashboard": False, "logging_level": logging.WARNING, "log_to_driver": False}
            if self._private:  # one node, this machine: small (the actor needs no CPU of its own)
                ray.init(address="local", num_cpus=1, resources={HOST_RESOURCE: 1},
                         object_store_memory=128 * 1024**2, **quiet)
            else:
                _check_gcs_reachable(address)  # ray.init would retry an unreachable address for minutes
                try:
                    ray.init(address=address, **quiet)
                except (ConnectionError, ValueError, RuntimeError) as e:
                    raise ConfigError(f"runtime.ray_address={address!r}: could not attach to a Ray cluster "
                                      f"({str(e).splitlines()[0]}); start one (`ray start --head`) or set "
                                      "runtime.ray_address=\"\" for a private instance") from None
        try:
            self.address = ray.get_runtime_context().gcs_address
            nodes = self._alive_nodes()
            self._planned, usable = plan_placement(cfg, nodes, self.address, private=self._private)
            self._check_reachable(usable)
        except BaseException:
            self._disconnect()
            raise
        plan = host_plan(cfg)
        spares = sum(getattr(r, "spares", 0) for r in cfg.topology.regions)
        extra = len(usable) - len(plan)
        if spares and extra < spares:
            log.warning("ray: %d spare hosts configured but only %d extra usable nodes; the other %d spares "
                        "start when nodes join the cluster", spares, max(extra, 0), spares - max(extra, 0))
        joins = sum(1 for f in faults_lib.parse_faults(cfg.faults) if f.kind == "join_host")
        # Ids run.py hands out itself (initial hosts, spares, join_host faults) are never reused here.
        self._next_index = len(plan) + spares + joins
        self._known_nodes = {n.node_id for n in nodes}
        self.hosts: dict[str, _Host] = {}
        self._pending: list[tuple[str, str, bool]] = []  # start_host calls waiting for a free node
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        # Forwarded from the driver: this package's settings (dataset cache, ...). Platform and XLA
        # settings are the node's own (a CPU-only driver must not turn GPU workers into CPU ones).
        self._env = {k: v for k, v in os.environ.items() if k.startswith("RESILIENT_JAX_")}
        self._env["RESILIENT_JAX_TOKEN"] = token
        self._env[TLS_CA_ENV] = tls_ca_pem  # the CA's PEM text: the nodes do not share this run.dir
        self._cwd = os.getcwd()
        log.info("ray: %d usable nodes; placement %s", len(usable),
                 ", ".join(f"{h}->{n.name}" for h, n in self._planned.items()))
        self._watcher = threading.Thread(target=self._watch, name="ray-launcher-watch", daemon=True)
        self._watcher.start()

    # -- the launcher contract ---------------------------------------------------------------------

    def start_host(self, host: str, region: str, spare: bool = False) -> None:
        with self._lock:
            if host in self.hosts:
                raise ValueError(f"host {host} was already started by this launcher")
            self._bump_index(host)
            node = self._planned.pop(host, None)
            nodes = self._alive_nodes()
            free = self._free_nodes(nodes)
            if node is None or node.node_id not in {n.node_id for n in free}:
                usable = [n for n in nodes if node_problem(n, self.devices_per_host) is None]
                node = pick_node(region, free, usable, self.names)
            if node is None:
                self._pending.append((host, region, spare))
                log.warning("ray: no free node for %s (%s%s); it starts when a node joins the cluster",
                            host, region, ", spare" if spare else "")
                return
            self._launch(host, region, spare, node)

    def fence(self, host: str) -> None:
        """A host declared dead must stay dead: SIGKILL its worker through the actor, else kill the
        actor (the worker dies with it). Called with the controller's lock held: never blocks."""
        with self._lock:
            entry = self.hosts.get(host)
            self._pending = [p for p in self._pending if p[0] != host]
        if entry is None or entry.done:
            return
        threading.Thread(target=self._fence, args=(entry,), name=f"fence-{host}", daemon=True).start()

    def pids(self) -> dict[str, int]:
        import ray

        out = {}
        with self._lock:
            entries = list(self.hosts.values())
        for entry in entries:
            try:
                pid = ray.get(entry.info_ref, timeout=5)["pid"]
            except Exception:  # noqa: BLE001 - an actor that is gone has no pid
                continue
            if pid is not None:
                out[entry.host] = pid
        return out

    def stop(self, timeout: float = 30.0) -> dict[str, int | None]:
        """Wait for workers to exit (they do after the run finishes), kill stragglers, release the
        actors, and disconnect from Ray (shutting down a private instance)."""
        import ray

        self._stopping.set()
        self._watcher.join(timeout=10)
        deadline = time.monotonic() + timeout
        codes: dict[str, int | None] = {}
        with self._lock:
            entries = list(self.hosts.values())
        for entry in entries:
            if not entry.done:
                entry.code, _ = self._get_code(entry.ref, max(0.1, deadline - time.monotonic()))
                if entry.code is _TIMEOUT:
                    try:
                        ray.get(entry.actor.kill.remote(), timeout=10)
                    except Exception:  # noqa: BLE001
                        pass
                    entry.code, _ = self._get_code(entry.ref, 10)
                    if entry.code is _TIMEOUT:
                        entry.code = None
                entry.done = True
            codes[entry.host] = entry.code
        for entry in entries:
            try:
                ray.kill(entry.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._disconnect()
        return codes

    # -- internals ---------------------------------------------------------------------------------

    def _alive_nodes(self) -> list[Node]:
        import ray

        return [Node.from_ray(n) for n in ray.nodes() if n.get("Alive")]

    def _free_nodes(self, nodes: list[Node]) -> list[Node]:
        busy = {e.node.node_id for e in self.hosts.values() if not e.done}
        busy |= {n.node_id for n in self._planned.values()}  # kept for initial hosts not started yet
        return [n for n in nodes if n.node_id not in busy and node_problem(n, self.devices_per_host) is None]

    def _check_reachable(self, usable: list[Node]) -> None:
        import ray

        from urllib.parse import urlparse

        here = ray.util.get_node_ip_address()
        remote = [n for n in usable if n.ip != here]
        bind = urlparse(self.controller_url).hostname or ""
        if remote and _is_loopback_or_any(bind):
            raise ConfigError(
                f"Ray cluster {self.address}: {remote[0].name} is on another machine than this driver ({here}) "
                f"but the controller listens on {bind} (runtime.bind), which it cannot reach; set runtime.bind to "
                f"this machine's cluster address (e.g. runtime.bind={here}) and a token (runtime.token or "
                "$RESILIENT_JAX_TOKEN)")

    def _bump_index(self, host: str) -> None:
        if host[:1] == "h" and host[1:].isdigit():
            self._next_index = max(self._next_index, int(host[1:]) + 1)

    def _launch(self, host: str, region: str, spare: bool, node: Node) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        argv = ["--controller", self.controller_url, "--host", host, "--region", region,
                "--devices", str(self.devices_per_host)] + (["--spare"] if spare else [])
        actor = _remote_host_actor().options(
            num_cpus=0, num_gpus=self.devices_per_host if uses_gpus(node) else 0, resources={HOST_RESOURCE: 1},
            max_concurrency=4, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node.node_id, soft=False),
        ).remote(host, argv, self.config_json, str(self.log_dir), self._env, self._cwd)
        self.hosts[host] = _Host(host=host, region=region, spare=spare, node=node, actor=actor,
                                 ref=actor.wait.remote(), info_ref=actor.info.remote())
        log.info("ray: started %s (%s%s) on %s", host, region, ", spare" if spare else "", node.name)

    def _fence(self, entry: _Host) -> None:
        import ray

        try:
            ray.get(entry.actor.kill.remote(), timeout=10)
            return
        except Exception:  # noqa: BLE001 - actor gone or unreachable: kill it outright
            pass
        try:
            ray.kill(entry.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone: nothing left to fence
            pass

    @staticmethod
    def _get_code(ref, timeout: float) -> tuple[object, str]:
        """(the worker's exit code, "") ; (None, why) when the actor or its node died; (_TIMEOUT, "")
        while it still runs."""
        import ray

        try:
            return ray.get(ref, timeout=timeout), ""
        except ray.exceptions.GetTimeoutError:
            return _TIMEOUT, ""
        except ray.exceptions.RayError as e:
            lines = str(e).strip().splitlines()
            return None, f"{type(e).__name__}: {lines[0] if lines else ''}"

    def _watch(self) -> None:
        import ray

        last_poll = 0.0
        while not self._stopping.is_set():
            with self._lock:
                waiting = {e.ref: e for e in self.hosts.values() if not e.done}
            if waiting:
                try:
                    ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=0.2)
                except Exception:  # noqa: BLE001 - Ray going away under us (shutdown)
                    ready = []
                    time.sleep(0.2)
                for ref in ready:
                    entry = waiting[ref]
                    code, why = self._get_code(ref, 5)
                    if code is _TIMEOUT:
                        continue
                    with self._lock:
                        entry.code, entry.done = code, True
                    if code is None:
                        log.warning("ray: %s lost its actor or its node (%s): %s", entry.host, entry.node.name, why)
                    if self._stopping.is_set():
                        break
                    self.on_exit(entry.host, -9 if code is None else code)
                    try:  # release the node for a later host
                        ray.kill(entry.actor, no_restart=True)
                    except Exception:  # noqa: BLE001
                        pass
            else:
                time.sleep(0.2)
            if time.monotonic() - last_poll >= NODE_POLL_SECONDS and not self._stopping.is_set():
                last_poll = time.monotonic()
                try:
                    self._adopt_new_nodes()
                except Exception as e:  # noqa: BLE001 - a failed poll is retried on the next tick
                    log.warning("ray: node poll failed: %s", e)

    def _adopt_new_nodes(self) -> None:
        """Nodes that joined the cluster after the start: serve waiting start_host calls first,
        then give each remaining new node a new host."""
        nodes = self._alive_nodes()
        with self._lock:
            if self._stopping.is_set():
                return
            usable = [n for n in nodes if node_problem(n, self.devices_per_host) is None]
            for host, region, spare in list(self._pending):
                node = pick_node(region, self._free_nodes(nodes), usable, self.names)
                if node is not None:
                    self._pending.remove((host, region, spare))
                    self._known_nodes.add(node.node_id)
                    self._launch(host, region, spare, node)
            for node in nodes:
                if node.node_id not in self._known_nodes and is_worker_node(node) and \
                        device_problem(node, self.devices_per_host) is not None:
                    self._known_nodes.add(node.node_id)
                    log.warning("ray: %s joined the cluster but %s; no worker started on it", node.name,
                                device_problem(node, self.devices_per_host))
            new = [n for n in self._free_nodes(nodes) if n.node_id not in self._known_nodes]
            for node in new:
                self._known_nodes.add(node.node_id)
                region = node.region(self.names) or self._least_region()
                host = f"h{self._next_index}"
                self._next_index += 1
                log.warning("ray: %s joined the cluster; starting %s (%s) on it", node.name, host, region)
                self._launch(host, region, False, node)

    def _least_region(self) -> str:
        live = {name: 0 for name in self.names}
        for e in self.hosts.values():
            if not e.done and e.region in live:
                live[e.region] += 1
        return min(self.names, key=lambda name: live[name])

    def _disconnect(self) -> None:
        import ray

        if self._owns_connection and ray.is_initialized():
            ray.shutdown()


_TIMEOUT = object()
_REMOTE = None


def _remote_host_actor():
    global _REMOTE
    if _REMOTE is None:
        import ray

        _REMOTE = ray.remote(HostActor)
    return _REMOTE
