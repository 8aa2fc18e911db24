"""`runtime.launcher: ray` -- one worker per node of a Ray cluster.

Same contract as `LocalLauncher` (start_host / fence / stop / pids). Three modules: the pure
placement rules (`ray_placement`), the actor that runs one worker (`ray_actor`), and this launcher
that connects, places, watches and fences. Each host is a small Ray actor
(`HostActor`, pinned to its node) that runs the ordinary worker CLI as a subprocess on that node:
`python -m resilient_jax.elastic worker --controller URL --host hN --region R --config-json FILE
--devices N [--spare]`, with the token in $RESILIENT_JAX_TOKEN. The controller stays in the driver
process (the train CLI); the launcher only starts, watches and kills workers.

Connecting (`runtime.ray_address`):
  ""            starts a private Ray instance on this machine (one node; `stop()` shuts it down).
  "auto"        attaches to the cluster this machine belongs to; host:port attaches to that one.
                `stop()` only disconnects; the cluster keeps running.

Which nodes run workers -- the preflight check, done before anything starts -- is `ray_placement`'s
(the custom resource `resilient_jax_host`, devices, `region:<name>` labels, a reachable controller).

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
else to `<host>.log` in the actor's private temp directory on the node (the path is in its `info()`).
The worker's environment is the node's (minus what Ray sets for its own worker processes) plus the
driver's RESILIENT_JAX_* variables and the token; JAX/XLA settings come from the node and from
`resilient_jax.gpu_env`, which the worker applies itself.

Ray's own access control (`ray_auth_decision`): a Ray cluster runs code for anyone who can reach
its GCS port, unless token authentication is on (RAY_AUTH_MODE=token on every `ray start` and on
the driver, with the token in RAY_AUTH_TOKEN_PATH, RAY_AUTH_TOKEN or ~/.ray/auth_token). Such a
client could also read this run's controller token from the actors' environment. So, attaching to a
cluster with the controller off loopback, the launcher asks the GCS an unauthenticated question
(`probe_gcs_auth`): a cluster that answers it is refused; one that cannot be asked (TLS, Ray
Client, a timeout) is a warning. scripts/slurm/train.sbatch and scripts/ray/cluster.yaml start
their clusters with token auth. A private instance (runtime.ray_address "") is not checked.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from resilient_jax.config import Config, ConfigError
from resilient_jax.elastic.channel import is_loopback
from resilient_jax.elastic.ray_actor import remote_host_actor
from resilient_jax.elastic.ray_placement import (
    HOST_RESOURCE, Node, device_problem, is_worker_node, node_problem, pick_node, plan_placement, uses_gpus,
)
from resilient_jax.elastic.tls import CA_ENV as TLS_CA_ENV

log = logging.getLogger(__name__)

NODE_POLL_SECONDS = 1.0


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


# -- Ray token authentication -------------------------------------------------------------------

RAY_AUTH_ON, RAY_AUTH_OFF, RAY_AUTH_UNKNOWN = "token", "off", "unknown"
RAY_AUTH_HOWTO = ("start every `ray start` (head and workers) and this driver with RAY_AUTH_MODE=token and "
                  "RAY_AUTH_TOKEN_PATH=<a 0600 file holding the cluster's token>, as scripts/slurm/train.sbatch "
                  "and scripts/ray/cluster.yaml do")


def probe_gcs_auth(gcs_address: str, timeout: float = 5.0) -> tuple[str, str]:
    """Does the Ray cluster at `gcs_address` (host:port) require a token? Asks its GCS one read-only
    question (NodeInfoGcsService.GetClusterId) on a bare gRPC channel that carries no token:
    (RAY_AUTH_ON, "") when the GCS refuses it UNAUTHENTICATED, (RAY_AUTH_OFF, "") when it answers,
    (RAY_AUTH_UNKNOWN, why) otherwise (unreachable, TLS, a ray:// address, ...)."""
    if not gcs_address or gcs_address == "auto" or "://" in gcs_address or ":" not in gcs_address:
        return RAY_AUTH_UNKNOWN, f"{gcs_address!r} is not a GCS host:port"
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError as e:
        return RAY_AUTH_UNKNOWN, f"cannot import Ray's gRPC stubs ({e})"
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return RAY_AUTH_UNKNOWN, "RAY_USE_TLS is set (the probe speaks plain gRPC)"
    channel = grpc.insecure_channel(gcs_address)
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout)
        return RAY_AUTH_OFF, ""
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            return RAY_AUTH_ON, ""
        details = (e.details() or "").strip().splitlines()
        return RAY_AUTH_UNKNOWN, f"the GCS probe got {e.code().name}" + (f": {details[0]}" if details else "")
    finally:
        channel.close()


def ray_auth_decision(auth: str, why: str, *, address: str, gcs_address: str, bind: str) -> tuple[str, str]:
    """What to do about an attached cluster's token authentication (`probe_gcs_auth`'s answer):
    ("error", line) refuses the run, ("warning", line) logs it, ("", "") is fine. Off loopback the
    controller token travels in the actors' environment, which any Ray client can read: an open
    cluster is refused there. On loopback an open cluster is still a warning (it runs code for
    anyone who reaches it); an unknown answer off loopback is a warning (it cannot be checked)."""
    if auth == RAY_AUTH_ON:
        return "", ""
    off_loopback = not is_loopback(bind.strip("[]"))
    where = f"the Ray cluster at {gcs_address}"
    if auth == RAY_AUTH_OFF and off_loopback:
        return "error", (f"runtime.ray_address={address!r}: {where} has no token authentication (it answers "
                         f"clients without a token), so anyone who can reach it can run code on every node and "
                         f"read this run's controller token (runtime.bind={bind} is off loopback); {RAY_AUTH_HOWTO}")
    if auth == RAY_AUTH_OFF:
        return "warning", (f"ray: {where} has no token authentication: anyone who can reach it can run code on "
                           f"its nodes; {RAY_AUTH_HOWTO}")
    if off_loopback:
        return "warning", (f"ray: could not tell whether {where} has token authentication ({why}); make sure it "
                           f"does: {RAY_AUTH_HOWTO}")
    return "", ""


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
                except (ConnectionError, ValueError, RuntimeError, ray.exceptions.RayError) as e:
                    sends_token = os.environ.get("RAY_AUTH_MODE", "").lower() == "token"  # else Ray sends none
                    if not sends_token and probe_gcs_auth(address)[0] == RAY_AUTH_ON:
                        raise ConfigError(f"runtime.ray_address={address!r}: the Ray cluster there requires a "
                                          "token (token authentication is on) and this driver has none; set "
                                          "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH=<the cluster's token "
                                          "file> for it") from None
                    raise ConfigError(f"runtime.ray_address={address!r}: could not attach to a Ray cluster "
                                      f"({str(e).splitlines()[0]}); start one (`ray start --head`) or set "
                                      "runtime.ray_address=\"\" for a private instance") from None
        try:
            self.address = ray.get_runtime_context().gcs_address
            if not self._private:
                self._check_ray_auth(address, cfg.runtime.bind)
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
        self._pending: list[tuple[str, str, bool, int | None]] = []  # start_host calls waiting for a free node
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

    def start_host(self, host: str, region: str, spare: bool = False, register_at_step: int | None = None) -> None:
        """As LocalLauncher.start_host; a host that finds no free node starts when one joins."""
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
                self._pending.append((host, region, spare, register_at_step))
                log.warning("ray: no free node for %s (%s%s); it starts when a node joins the cluster",
                            host, region, ", spare" if spare else "")
                return
            self._launch(host, region, spare, node, register_at_step)

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

    def _check_ray_auth(self, address: str, bind: str) -> None:
        verdict, line = ray_auth_decision(*probe_gcs_auth(self.address), address=address,
                                          gcs_address=self.address, bind=bind)
        if verdict == "error":
            raise ConfigError(line)
        if verdict == "warning":
            log.warning("%s", line)

    def _bump_index(self, host: str) -> None:
        if host[:1] == "h" and host[1:].isdigit():
            self._next_index = max(self._next_index, int(host[1:]) + 1)

    def _launch(self, host: str, region: str, spare: bool, node: Node, register_at_step: int | None = None) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        argv = ["--controller", self.controller_url, "--host", host, "--region", region,
                "--devices", str(self.devices_per_host)] + (["--spare"] if spare else [])
        if register_at_step is not None:
            argv += ["--register-at-step", str(register_at_step)]
        actor = remote_host_actor().options(
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
            for pending in list(self._pending):
                host, region, spare, register_at_step = pending
                node = pick_node(region, self._free_nodes(nodes), usable, self.names)
                if node is not None:
                    self._pending.remove(pending)
                    self._known_nodes.add(node.node_id)
                    self._launch(host, region, spare, node, register_at_step)
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
