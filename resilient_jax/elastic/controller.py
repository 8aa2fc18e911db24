"""The controller: membership, generations and the coordination service. It never trains.

Workers talk to it over a small JSON-over-HTTP API (stdlib `http.server`, see `channel`):

    POST /register  {host, region, devices, config_hash, spare} -> {accepted, run_started}
    POST /heartbeat {host, generation, step, step_seconds, stalled_seconds, deadline_seconds, timings,
                     progress}                              -> {reform_signal, abort, stop}
    POST /world     {host, after}                           -> the first world newer than `after`
    POST /reform    {host, generation, completed_step, data_position, reason} -> the next world
    POST /fault     {host, kind, step}                       (an injector announces a fault it fires)
    POST /progress  {host, generation, step}                 (first step done in a new generation)
    POST /precompiled {host, generation, worlds, stopped, seconds, error}  (rank 0 compiled the likely
                                                             next worlds ahead: elastic/precompile)
    POST /resumed   {host, generation, step, checkpoint, config_changes}  (a world restored from disk)
    POST /adopted   {host, generation, how, seconds, state_shard_bytes, peak_bytes, peak_over_shard}
                                                             (replica groups: how a member got its slices)
    POST /failed    {host, error, bad_input}                 (a worker's uncaught error, before it exits)
    POST /done      {host, summary}
    POST /drain     {host}                                   (an operator takes a host out at a step boundary)
    GET  /status

Generations: world g is (members in rank order, coordination service address, resume step,
the member whose state everyone adopts). A new generation is formed when a member dies (its
process exits, or it is silent for `dead_after_seconds`) or when registered newcomers wait and
the members agree to grow. All live members of world g ask for world g+1 (`/reform`), reporting
how many steps they completed; world g+1 resumes from max(completed) -- the state of a member
that completed them -- so a fault costs zero steps. Who is in world g+1, and from whose state, is
decided by the pure function `membership.plan_reform`; this module applies it. Step numbers follow the run's convention:
step k is the update that brings the run to k completed steps (what its checkpoint carries).

Stopping (Ctrl-C, SIGTERM: `request_stop`): every heartbeat reply says `stop`, the members agree on
one step boundary through the per-step all-gather they already do, checkpoint there and report
`/done` with `stopped` set.

Failures are detected by liveness, never by a collective timing out: a member whose process exits,
or whose heartbeats (sent from their own thread, so a slow step does not stop them) stop for
`dead_after_seconds`, is declared dead, fenced, and every heartbeat reply to its world says
`abort` -- the workers then abort their in-flight collectives and re-form. A step that runs past a
worker's adaptive stall deadline is reported; with every member alive the verdict is to wait
(backpressure), and the stall is recorded with its numbers. Per-step timings in the heartbeats
feed the straggler check (`stragglers`), whose decisions reslot a host at a step boundary through
the same agreement as growth (`reform_signal`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from resilient_jax.elastic import channel, groups as groups_lib, membership, stragglers
from resilient_jax.elastic.tls import ServerTls, connect_host
from resilient_jax.run_history import DONE, RunHistory
from resilient_jax.elastic.world import CoordinationService

log = logging.getLogger(__name__)


@dataclass
class Member:
    host: str
    region: str
    devices: int
    status: str = "registered"  # registered | spare -> active -> dead | reslotted | drained | done
    last_seen: float = field(default_factory=time.monotonic)
    step: int = 0  # steps completed, as its last heartbeat said
    generation: int = -1
    step_seconds: float = 0.0


@dataclass(frozen=True)
class World:
    generation: int
    coordinator: str
    members: tuple[str, ...]
    regions: dict[str, str]
    devices_per_host: dict[str, int]
    resume_step: int
    source: str | None  # the member whose state every member adopts; None = fresh start
    # Members that already hold that state in their own memory. When every member does (survivors
    # only, no newcomer), the world adopts without sending any state: the worker reads `holders`.
    holders: tuple[str, ...]
    data_position: dict | None
    reason: str
    # Replica groups (parallel.hosts_per_replica > 1): the hosts of each replica, one `data` row
    # each, in rank order; `source_group` the row whose state the others heal from. Empty: k = 1.
    groups: tuple[tuple[str, ...], ...] = ()
    source_group: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "members": list(self.members), "holders": list(self.holders),
                "groups": [list(g) for g in self.groups]}


@dataclass
class GenerationEvent:
    generation: int
    reason: str
    lost: list[str]
    joined: list[str]
    fault_at: float | None = None  # monotonic time an injector announced the fault
    detected_at: float | None = None  # first member asking to re-form, or first death noticed
    formed_at: float | None = None
    first_step_at: float | None = None
    resume_step: int = 0
    steps_lost: int = 0
    reslotted: list[str] = field(default_factory=list)
    decision: dict | None = None  # the straggler decision behind a reslot, with its numbers
    from_checkpoint: str | None = None  # the checkpoint a world resumed from, when not from memory
    adoption: dict = field(default_factory=dict)  # replica groups: host -> how it got its slices, and its cost

    def report(self) -> dict[str, Any]:
        origin = self.fault_at if self.fault_at is not None else self.detected_at
        def since(t):
            return None if t is None or origin is None else round(t - origin, 3)
        return {
            "generation": self.generation,
            "reason": self.reason,
            "lost": self.lost,
            "joined": self.joined,
            "resume_step": self.resume_step,
            "detection_seconds": since(self.detected_at),
            "reformation_seconds": None if self.formed_at is None or self.detected_at is None
            else round(self.formed_at - self.detected_at, 3),
            "recovery_seconds": since(self.first_step_at),
            # The fault (or its detection) on the wall clock, to place it on the hosts' lifecycle journals.
            "origin_wall": None if origin is None else round(time.time() - time.monotonic() + origin, 3),
            "steps_lost": self.steps_lost,
            "reslotted": self.reslotted,
            "decision": self.decision,
            "from_checkpoint": self.from_checkpoint,
            **({"adoption": self.adoption} if self.adoption else {}),
        }


@dataclass
class Stall:
    """A step that ran past a worker's stall deadline while every member was alive: waited out."""

    generation: int
    step: int
    deadline_seconds: float
    reported_by: set[str]
    longest_wait_seconds: float  # the longest in-step time a heartbeat reported
    alive: int

    def report(self, timings: dict[str, "stragglers.StepTiming"] | None) -> dict[str, Any]:
        late = max(timings, key=lambda h: timings[h].ready) if timings else None
        return {
            "generation": self.generation, "step": self.step, "deadline_seconds": round(self.deadline_seconds, 3),
            "waited_seconds": round(max([self.longest_wait_seconds] + [t.step for t in (timings or {}).values()]), 3),
            "late_host": late, "late_by_seconds": round(timings[late].ready, 3) if late else None,
            # Waited out when the step completed in this world; a step that never completed here was
            # a member failing (a hang looks like a stall until its heartbeats time out).
            "response": f"waited: all {self.alive} members alive (backpressure, no failure declared)" if timings
            else "ended by a failure: the step did not complete in this generation (see events)",
        }


@dataclass(frozen=True)
class Change:
    """A planned world change at the next agreed step boundary: `host` leaves, `spare` (if any) takes its slot."""

    kind: str  # "reslot" (a straggler decision) | "drain" (an operator's request)
    host: str
    spare: str | None
    record: dict  # the decision and its numbers, as reported in the event


class RunFailed(RuntimeError):
    """The run cannot go on; `failure` is the first worker error reported ({host, error, bad_input}), if any."""

    def __init__(self, message: str, failure: dict | None = None):
        super().__init__(message)
        self.failure = failure


class Controller:
    def __init__(self, *, config_hash: str, expected_hosts: int, run_dir: Path, bind: str = "127.0.0.1",
                 port: int = 0, token: str = "", dead_after_seconds: float = 6.0, min_hosts: int = 1,
                 total_steps: int = 0, straggler_factor: float = 1.5, straggler_window: int = 10,
                 on_dead: Callable[[str], None] | None = None, console: Callable[[str], None] | None = None,
                 run_options: dict | None = None, history: RunHistory | None = None,
                 tls: ServerTls | None = None, assignment: str = "uniform", coordination_heartbeat_seconds: int = 30,
                 hosts_per_replica: int = 1, min_replicas: int = 1, cross_region_replica: bool = False,
                 launched_at: float | None = None, devices_per_host: int | None = None,
                 regions: tuple[str, ...] = ()):
        """`console` receives one sentence per event and a progress line per logged step (the
        driver prints them); `run_options` go to every worker as it registers (this invocation's
        --resume / --allow-config-change / --stop-at); `history` is the run's record across
        invocations (run_history.json), kept by the driver since rank 0 may change hands. `tls`:
        serve https with that certificate (resilient_jax.elastic.tls). `assignment`: the workers'
        shard assignment ("proportional" absorbs a slow host by moving its shards; then only a
        spare replaces a straggler, and an idle host that still holds the step back is reslotted).
        `coordination_heartbeat_seconds`: each generation's JAX coordination service declares a
        silent member dead after this long (runtime.coordination_heartbeat_seconds).
        `hosts_per_replica` > 1: the membership unit is a replica group of that many hosts
        (resilient_jax.elastic.groups); fewer complete groups than `min_replicas` fail the run.
        `launched_at`: time.monotonic() when the run was launched (default: now); the cold start,
        launch -> generation 0's first step done, is what each recovery is compared with.
        `devices_per_host`, `regions` (topology.*): what a registering host must have and be in; a
        hand-started worker with another --devices would break the next world's mesh for everyone."""
        channel.check_bind(bind, token, tls is not None)
        self.devices_per_host, self.regions = devices_per_host, tuple(regions)
        self.config_hash = config_hash
        self.expected_hosts = expected_hosts
        self.run_dir = Path(run_dir)
        self.bind = bind
        self.token = token
        self.dead_after = dead_after_seconds
        self.coordination_heartbeat = coordination_heartbeat_seconds
        self.min_hosts = min_hosts
        self.hosts_per_replica, self.min_replicas = hosts_per_replica, min_replicas
        self.cross_region_replica = cross_region_replica
        self.groups: tuple[groups_lib.Group, ...] = ()  # every replica group, complete or not (k > 1)
        self.total_steps = total_steps
        self.straggler_factor, self.straggler_window = straggler_factor, straggler_window
        self.assignment = assignment
        self.reassignments: list[dict] = []  # the workers' shard re-plans, with their numbers
        self.precompiles: list[dict] = []  # each generation's background compile of its likely next worlds
        self._status_written = 0.0
        self.on_dead = on_dead or (lambda host: None)
        self.console = console or (lambda text: None)
        self.run_options = dict(run_options or {})
        self.stop_reason: str | None = None  # "interrupted" | "preempted" once request_stop was called
        self.failures: list[dict] = []  # workers' uncaught errors, first first
        self.history = history
        self._history_begun = False
        self._started = time.perf_counter()
        self.launched_at = time.monotonic() if launched_at is None else launched_at
        self._progress_step = -1  # the last step a progress line was printed for
        self._eval_steps: set = set()  # the steps whose evaluation was printed
        self.members: dict[str, Member] = {}
        self.world: World | None = None
        self.services: dict[int, CoordinationService] = {}
        self.events: list[GenerationEvent] = []
        self.reform_requests: dict[str, dict] = {}
        self.pending_fault_at: float | None = None
        self.announced: list[dict] = []  # every injected fault a worker announced
        self.broken: set[int] = set()  # generations with a dead member: their collectives must abort
        self.timings: dict[int, dict[int, dict[str, stragglers.StepTiming]]] = {}  # generation -> step -> host
        self.timeline: list[dict] = []  # per host and step, for plots
        self.stalls: dict[tuple[int, int], Stall] = {}
        self.pending_change: Change | None = None
        self.decisions: list[dict] = []
        # Restarts, counted not assumed: a host process that registers again under its old id, or a
        # world after the first that had to resume from disk instead of from a member's memory.
        self.restarts = 0
        self._detected_at: float | None = None  # when the pending generation change was first noticed
        self.summary: dict | None = None
        self.error: str | None = None
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self.server = channel.serve(self, bind, port, token, tls.server_context() if tls else None)
        self.url = (f"https://{connect_host(bind)}:{self.server.server_address[1]}" if tls
                    else f"http://{bind}:{self.server.server_address[1]}")
        self._pauses: list[tuple[float, float]] = []  # spans the process did not run (_clock), not yet applied
        self._pauses_lock = threading.Lock()
        self._last_tick = time.monotonic()
        self._clock_thread = threading.Thread(target=self._clock, name="controller-clock", daemon=True)
        self._clock_thread.start()
        self._monitor = threading.Thread(target=self._watch, name="controller-monitor", daemon=True)
        self._monitor.start()
        self._write_status()

    # -- API handlers (called by channel on the server's threads) ----------------------------------

    def register(self, host: str, region: str, devices: int, config_hash: str, spare: bool = False) -> dict:
        if config_hash != self.config_hash:
            raise channel.Refused(
                409, f"worker {host} runs config {config_hash[:16]}..., this run is {self.config_hash[:16]}...; "
                     "start it with the run's config")
        if self.devices_per_host is not None and devices != self.devices_per_host:
            raise channel.Refused(
                409, f"worker {host} has {devices} devices, this run's hosts {self.devices_per_host} "
                     f"(topology.devices_per_host); start it with --devices {self.devices_per_host}")
        if self.regions and region not in self.regions:
            raise channel.Refused(
                409, f"worker {host}: region {region!r} is not one of this run's (topology.regions: "
                     f"{', '.join(self.regions)}); start it with --region set to one of them")
        with self._lock:
            existing = self.members.get(host)
            if existing is not None and existing.status in ("registered", "spare", "active"):
                raise channel.Refused(409, f"host {host} is already a member; pick another host id")
            if existing is not None:
                self.restarts += 1
            self.members[host] = Member(host=host, region=region, devices=devices,
                                        status="spare" if spare else "registered")
            log.info("registered %s (%s, %d devices%s)", host, region, devices, ", spare" if spare else "")
            if self.world is None and self._count("registered") >= self.expected_hosts:
                regrouping = None
                if self.hosts_per_replica > 1:
                    hosts = sorted((h for h, m in self.members.items() if m.status == "registered"),
                                   key=groups_lib.host_order)
                    regrouping = groups_lib.regroup(
                        groups_lib.initial([(h, self.members[h].region) for h in hosts], self.hosts_per_replica),
                        live=hosts, spares=(), newcomers=(), k=self.hosts_per_replica,
                        cross_region=self.cross_region_replica)
                self._form(reason="start", resume_step=0, source=None, data_position=None, lost=[],
                           regrouping=regrouping)
            self._lock.notify_all()
            self._write_status()
            return {"accepted": True, "run_started": self.world is not None, "options": self.run_options}

    def heartbeat(self, host: str, generation: int, step: int, step_seconds: float = 0.0,
                  stalled_seconds: float = 0.0, deadline_seconds: float = 0.0, timings: list | None = None,
                  progress: list | None = None, reassignments: list | None = None,
                  evals: list | None = None) -> dict:
        """`step`: steps completed; `timings`: [step, ready s, step s, wall, shards] per step since
        the last heartbeat; `progress`: [step, loss, tokens/s] per logged step (printed once per
        step); `reassignments`: shard re-plans the world took (rank 0 reports them); `evals`: eval
        events (resilient_jax.evaluation), printed once per step."""
        for event in reassignments or ():
            self.reassign(host, generation, event)
        with self._lock:
            member = self._member(host)
            member.last_seen = time.monotonic()
            member.step, member.generation, member.step_seconds = step, generation, step_seconds
            for k, ready, seconds, wall, *shards in timings or ():
                shards = shards[0] if shards else None
                self.timings.setdefault(generation, {}).setdefault(k, {})[host] = stragglers.StepTiming(
                    ready, seconds, shards)
                self.timeline.append({"host": host, "generation": generation, "step": k, "wall": wall,
                                      "ready_seconds": ready, "step_seconds": seconds, "shards": shards})
            abort = generation in self.broken
            if stalled_seconds > 0 and not abort and self.world is not None and generation == self.world.generation:
                self._record_stall(host, step + 1, stalled_seconds, deadline_seconds)
            for k, loss, tokens_per_s in progress or ():
                self._print_progress(generation, k, loss, tokens_per_s)
                if k == 1 and self._history_begun:
                    self.history.first_loss = loss
            self._print_evals(evals)
            if self._history_begun and step > self.history.current.last_step:
                self.history.current.last_step = step  # saved with status.json, below
            if time.monotonic() - self._status_written > 1.0:  # keep status.json's steps fresh, cheaply
                self._write_status()
                if self._history_begun:
                    self.history.save()
            return {"reform_signal": self._reform_signal(), "abort": abort, "stop": self.stop_reason,
                    "precompiled": max((p["generation"] for p in self.precompiles if not p["stopped"]), default=-1)}

    def wait_world(self, host: str, after: int, timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                self._member(host).last_seen = time.monotonic()
                if self.error:
                    return {"error": self.error}
                if self.world is not None and self.world.generation > after:
                    if host in self.world.members:
                        return {"world": self.world.to_dict()}
                    if self.members[host].status in ("dead", "reslotted", "drained"):
                        return {"evicted": True}
                if self.summary is not None:
                    return {"finished": True}
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return {"wait": True}
                self._lock.wait(timeout=min(remaining, 0.5))

    def reform(self, host: str, generation: int, completed_step: int, data_position: dict | None,
               reason: str = "failure") -> dict:
        with self._lock:
            member = self._member(host)
            member.last_seen = time.monotonic()
            if self.world is not None and generation == self.world.generation:
                if not self.reform_requests:
                    self._detected_at = self._detected_at or time.monotonic()
                self.reform_requests[host] = {"completed_step": completed_step, "data_position": data_position,
                                              "reason": reason}
                self._lock.notify_all()
        return self.wait_world(host, generation)

    def fault(self, host: str, kind: str, step: int) -> dict:
        with self._lock:
            self.announced.append({"host": host, "kind": kind, "step": step, "at": time.monotonic()})
            if self.pending_fault_at is None and kind in ("kill_host", "hang_host", "kill_region"):
                self.pending_fault_at = time.monotonic()
            log.info("fault announced by %s: %s at step %d", host, kind, step)
        return {}

    def precompiled(self, host: str, generation: int, worlds: list, stopped: bool, seconds: float,
                    error: str | None = None) -> dict:
        """Rank 0 of `generation` compiled the steps of the likely next worlds into the cache."""
        with self._lock:
            self.precompiles.append({"host": host, "generation": generation, "worlds": worlds, "stopped": stopped,
                                     "seconds": seconds, "error": error})
            log.info("generation %d: %s precompiled %d next worlds in %.1f s%s", generation, host, len(worlds),
                     seconds, " (stopped: the world was left)" if stopped else "")
        return {}

    def reassign(self, host: str, generation: int, event: dict) -> dict:
        """A shard re-plan every member took at the same step boundary (from rank 0's heartbeat)."""
        with self._lock:
            self.reassignments.append({**event, "generation": generation})
            moved = ", ".join(f"{h} {a}->{b}" for h, a, b in zip(event["hosts"], event["old_shards"],
                                                                 event["new_shards"]) if a != b)
            self.console(f"step {event['step']}: shards reassigned ({event['kind']}: {moved})")
        return {}

    def progress(self, host: str, generation: int, step: int) -> dict:
        with self._lock:
            if generation == 0:
                self._begin_history(step - 1, None)  # no-op after a resume from disk was reported
            for event in self.events:
                if event.generation == generation and event.first_step_at is None:
                    event.first_step_at = time.monotonic()
            self._write_status()
        return {}

    def resumed(self, host: str, generation: int, step: int, checkpoint: str, config_changes: list | None = None) -> dict:
        """A world started from a checkpoint on disk (not from a member's memory)."""
        with self._lock:
            for event in self.events:
                if event.generation == generation:
                    event.resume_step = step
                    event.from_checkpoint = checkpoint
            if generation == 0:
                self._begin_history(step, checkpoint)
            changed = f"; config changed (allowed): {', '.join(config_changes)}" if config_changes else ""
            self.console(f"generation {generation} resumes from the checkpoint of step {step} ({checkpoint}){changed}")
            self._write_status()
        return {}

    def adopted(self, host: str, generation: int, **record) -> dict:
        """Replica groups: how `host` got its slices of the state in `generation` (own, or healed from a
        sibling replica), with the seconds and its peak device bytes over its shard."""
        with self._lock:
            for event in self.events:
                if event.generation == generation:
                    event.adoption[host] = record
            log.info("generation %d: %s adopted its slices: %s", generation, host, record)
        return {}

    def failed(self, host: str, error: str, bad_input: bool = False) -> dict:
        """A worker's uncaught error, reported before it exits. An input error is the same on every
        host (a dataset, a checkpoint, a config key): the run fails at once instead of shrinking."""
        with self._lock:
            first = not self.failures
            self.failures.append({"host": host, "error": error, "bad_input": bool(bad_input)})
            log.error("worker %s failed: %s", host, error)
            if first and not bad_input:  # an input error ends the run; the driver prints it once
                self.console(f"worker {host} failed: {error}")
            if bad_input:
                self.fail(self._failure_message())
        return {}

    def worker_exited(self, host: str, code: int, last_error: str | None = None) -> None:
        """The launcher saw `host`'s process exit with `code` != 0; `last_error` is its log's last error line."""
        with self._lock:
            if last_error and not any(f["host"] == host for f in self.failures):
                self.failures.append({"host": host, "error": last_error, "bad_input": False})
            member = self.members.get(host)
            if member is None and self.world is None and self.summary is None:
                # It never registered: the first world can never form.
                self.fail(self._failure_message() if self.failures else
                          f"worker {host} exited with code {code} before registering")
                return
        self.mark_dead(host, f"process exited with code {code}")

    def request_stop(self, reason: str) -> None:
        """Ctrl-C / SIGTERM on the driver: every member checkpoints at one agreed step boundary and stops."""
        with self._lock:
            if self.stop_reason is None:
                self.stop_reason = reason
                self._write_status()

    def done(self, host: str, summary: dict, reassignments: list | None = None, evals: list | None = None) -> dict:
        """The final rank 0's summary; `reassignments`, `evals`: its re-plans and evaluations not
        yet sent by a heartbeat."""
        with self._lock:
            self._print_evals(evals)
        for event in reassignments or ():
            self.reassign(host, self.world.generation if self.world else 0, event)
        with self._lock:
            self.summary = summary
            if self._history_begun:  # this invocation's figures, from the final rank 0
                entry = self.history.current
                entry.last_step = max(entry.last_step, int(summary["final_step"]))
                for key in ("train_seconds", "compile_seconds", "data_wait_seconds", "tokens"):
                    if summary.get(key) is not None:
                        setattr(entry, key, summary[key])
                self.history.end(summary.get("stopped") or DONE)
            for member in self.members.values():
                if member.status in ("active", "idle"):
                    member.status = "done"
            self._lock.notify_all()
            self._write_status()
        return {}

    def status(self) -> dict:
        with self._lock:
            return self._status()

    def drain(self, host: str) -> dict:
        """Take `host` out of the world at the next step boundary (a spare, if any, takes its slot)."""
        with self._lock:
            world = self.world
            if world is None or host not in world.members or self.members[host].status != "active":
                raise channel.Refused(409, f"host {host} is not an active member of the running world "
                                           f"({', '.join(world.members) if world else 'no world yet'})")
            if self.pending_change is not None:
                raise channel.Refused(409, f"a change is already pending ({self.pending_change.kind} of "
                                           f"{self.pending_change.host}); drain again after it")
            spare = next((h for h, m in sorted(self.members.items()) if m.status == "spare"), None)
            if spare is None and len(world.members) - 1 < self.min_hosts:
                raise channel.Refused(409, f"draining {host} would leave {len(world.members) - 1} hosts < "
                                           f"runtime.min_hosts {self.min_hosts}, and no spare is registered")
            record = {"action": "drain", "host": host, "spare": spare, "reason": "operator request"}
            self.pending_change = Change("drain", host, spare, record)
            self._detected_at = self._detected_at or time.monotonic()
            log.info("drain %s requested%s", host, f"; spare {spare} takes its slot" if spare else "")
            self.console(f"drain {host} requested: it leaves at the next step boundary"
                         + (f"; spare {spare} takes its slot" if spare else ""))
            self._write_status()
            return {"pending": record}

    # -- called by the launcher --------------------------------------------------------------------

    def mark_dead(self, host: str, why: str) -> None:
        with self._lock:
            member = self.members.get(host)
            if member is None or member.status in ("dead", "done"):
                return
            self._declare_dead(member, why)

    def wait_finished(self, timeout: float | None = None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self.summary is None and self.error is None:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError("the run did not finish in time")
                self._lock.wait(timeout=0.5)
            if self.error:
                raise RunFailed(self.error, self.failures[0] if self.failures else None)
            return self.summary

    def fail(self, message: str) -> None:
        with self._lock:
            if self.error is None:
                log.error("the run failed: %s", message)
                if self._history_begun:
                    self.history.save()  # `ended` stays None: the next resume is a restart
            self.error = self.error or message
            self._lock.notify_all()
            self._write_status()

    def close(self) -> None:
        with self._lock:  # per-host step timings, for the chaos drill's plots
            (self.run_dir / "elastic" / "timeline.json").write_text(json.dumps(self.timeline))
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        for service in self.services.values():
            service.shutdown()
        self.services.clear()

    def elastic_report(self) -> dict:
        """The summary fields that only the controller knows."""
        with self._lock:
            failures = [e for e in self.events if e.reason == "failure"]
            cold_start = self._cold_start_seconds()
            events = [e.report() for e in self.events if e.reason != "start" or e.from_checkpoint]
            for event in events:
                if event["recovery_seconds"] is not None and event["reason"] != "start" and cold_start:
                    event["recovery_vs_cold_start"] = round(event["recovery_seconds"] / cold_start, 3)
            return {
                "stalls": [s.report(self.timings.get(s.generation, {}).get(s.step))
                           for s in sorted(self.stalls.values(), key=lambda s: (s.generation, s.step))],
                "straggler_decisions": self.decisions,
                "straggler_window": self.straggler_window,
                "assignment": {"policy": self.assignment, "decisions": list(self.reassignments)},
                "precompiled": list(self.precompiles),
                "injected": [{k: v for k, v in a.items() if k != "at"} for a in self.announced],
                "restarts": self.restarts,
                "generations": (self.world.generation + 1) if self.world else 0,
                "failures_absorbed": sum(len(e.lost) for e in failures),
                "fault_events": len(failures),
                "steps_lost": sum(e.steps_lost for e in self.events),
                # Launch -> generation 0's first step done: imports, formation, restore or a
                # fresh state, the first compile, the first step. A recovery is compared with it.
                "cold_start_seconds": cold_start,
                "events": events,
                "members": {h: {"region": m.region, "status": m.status} for h, m in sorted(self.members.items())},
                "replica_groups": [g.to_dict() for g in self.groups],
            }

    # -- internals (lock held) ---------------------------------------------------------------------

    def _cold_start_seconds(self) -> float | None:
        first = next((e for e in self.events if e.generation == 0), None)
        if first is None or first.first_step_at is None:
            return None
        return round(first.first_step_at - self.launched_at, 3)

    def _begin_history(self, start_step: int, checkpoint: str | None) -> None:
        if self.history is not None and not self._history_begun:
            self._history_begun = True
            self.history.begin(start_step, checkpoint, started=self._started)

    def _failure_message(self) -> str:
        first = self.failures[0]
        return f"worker {first['host']} failed: {first['error']}"

    def _print_evals(self, evals: list | None) -> None:
        """Each evaluation once (every member reports it; a world that resumed at an eval step
        reports it again)."""
        if not evals:
            return
        from resilient_jax.metrics import describe  # not at import: it brings TensorBoard's writer

        for record in evals:
            if isinstance(record, dict) and record.get("step") not in self._eval_steps:
                self._eval_steps.add(record.get("step"))
                self.console(describe(record))

    def _print_progress(self, generation: int, step: int, loss: float, tokens_per_s: float) -> None:
        if step <= self._progress_step:
            return  # every member reports the same logged step; print it once
        self._progress_step = step
        hosts = len(self.world.members) if self.world is not None else 0
        self.console(f"step {step}/{self.total_steps} | loss {loss:.4f} | {tokens_per_s:,.0f} tokens/s | "
                     f"{hosts} hosts | generation {generation}")

    def _member(self, host: str) -> Member:
        member = self.members.get(host)
        if member is None:
            raise channel.Refused(404, f"host {host} is not registered")
        return member

    def _count(self, status: str) -> int:
        return sum(1 for m in self.members.values() if m.status == status)

    def _reform_signal(self) -> int:
        """Non-zero (the next generation) while the world should change at the next step boundary:
        newcomers wait to join, or a straggler is to be reslotted."""
        if self.world is not None and (self._count("registered") > 0 or self.pending_change is not None):
            return self.world.generation + 1
        return 0

    def _record_stall(self, host: str, step: int, waited: float, deadline: float) -> None:
        world = self.world
        stall = self.stalls.get((world.generation, step))
        if stall is None:
            alive = sum(1 for h in world.members if self.members[h].status == "active")
            stall = self.stalls[(world.generation, step)] = Stall(world.generation, step, deadline, set(), 0.0, alive)
            log.info("step %d stalled %.1f s on %s (deadline %.2f s): all %d members alive -> waiting (backpressure)",
                     step, waited, host, deadline, alive)
            self.console(f"step {step} is slow on {host} ({waited:.1f} s, deadline {deadline:.1f} s); all {alive} "
                         "hosts are alive, so the run waits")
        stall.reported_by.add(host)
        stall.longest_wait_seconds = max(stall.longest_wait_seconds, waited)

    def _check_stragglers(self) -> None:
        world = self.world
        if (world is None or self.pending_change is not None or self.reform_requests or self.summary is not None
                or world.generation in self.broken):
            return
        members = list(world.members)
        window = self.timings.get(world.generation, {})
        # The first step of a world (resume_step + 1) carries its warm-up; judge steady steps only.
        steady = {k: v for k, v in window.items() if k > world.resume_step + 1}
        candidates = members
        if self.assignment == "proportional" and not any(m.status == "spare" for m in self.members.values()):
            # Moving shards absorbs a slow host; removing it is for one that held none over the
            # whole window and still held the step back (worse than idle).
            candidates = stragglers.idle_throughout(steady, members, self.straggler_window)
        found = stragglers.find_straggler(steady, members, factor=self.straggler_factor, steps=self.straggler_window,
                                          candidates=candidates)
        if found is None:
            return
        formed = self.events[-1] if self.events else None
        reform_seconds = (formed.first_step_at - formed.formed_at) if formed and formed.first_step_at else 0.0
        spares = sorted((h for h, m in self.members.items() if m.status == "spare"),
                        key=lambda h: (self.members[h].region != world.regions[found.host], h))
        step_now = max(self.members[h].step for h in members)
        decision = stragglers.decide(found, members=members, spares=spares,
                                     remaining_steps=max(0, self.total_steps - step_now),
                                     reform_seconds=reform_seconds, min_hosts=self.min_hosts,
                                     idle=candidates is not members)
        record = {**decision.to_dict(), "generation": world.generation, "at_step": step_now}
        if self.decisions and self.decisions[-1]["generation"] == world.generation and decision.action == "keep":
            return  # already judged in this world; "keep" stands until the world changes
        self.decisions.append(record)
        log.warning("straggler %s: %s -- %s", found.host, decision.action, decision.reason)
        self.console(f"straggler {found.host}: {decision.action} ({decision.reason})")
        if decision.action != "keep":
            self.pending_change = Change("reslot", found.host, decision.spare, record)
            self._detected_at = self._detected_at or time.monotonic()
        self._write_status()

    def _declare_dead(self, member: Member, why: str) -> None:
        log.warning("host %s declared dead: %s", member.host, why)
        if self.error is None and self.summary is None:  # after the end, hosts going away is no news
            self.console(f"host {member.host} is dead ({why})" + (": fenced" if "silent" in why else ""))
        was_active = member.status == "active"
        member.status = "dead"
        if was_active:
            self._detected_at = self._detected_at or time.monotonic()
            if self.world is not None and member.host in self.world.members:
                self.broken.add(self.world.generation)  # its peers' collectives must not wait for it
        self.on_dead(member.host)
        self._lock.notify_all()
        self._write_status()

    def _clock(self) -> None:
        """Ticks every 0.05 s, taking no controller lock: a gap between ticks is a span the process
        did not run. (The controller's lock held by a slow request is not one: the other threads run
        and hear the hosts meanwhile.)"""
        while not self._stop.wait(0.05):
            self._tick(time.monotonic())

    def _tick(self, now: float) -> None:
        """Notes a pause ending at `now` if no tick (the clock's or the monitor's, whichever runs
        first after one) came for PAUSE_SECONDS."""
        with self._pauses_lock:
            if now - self._last_tick > membership.PAUSE_SECONDS:
                self._pauses.append((self._last_tick, now))
            self._last_tick = max(self._last_tick, now)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._tick(time.monotonic())  # before the lock: a pause is seen even if this thread runs first
            with self._lock:
                with self._pauses_lock:
                    pauses, self._pauses = self._pauses, []
                for start, end in pauses:
                    log.warning("the controller did not run for %.1f s; not counted as its hosts' silence",
                                end - start)
                watched = {m.host: m.last_seen for m in self.members.values()
                           if m.status in ("registered", "spare", "active", "idle")}
                last_seen, silent = membership.silent_hosts(watched, time.monotonic(), pauses, self.dead_after)
                for host, seen in last_seen.items():
                    self.members[host].last_seen = seen
                for host, silence in silent:
                    self._declare_dead(self.members[host], f"silent for {silence:.1f} s")
                self._check_stragglers()
                self._maybe_reform()
            time.sleep(0.05)

    def _maybe_reform(self) -> None:
        world = self.world
        if world is None or self.summary is not None or self.error:
            return
        change = self.pending_change
        plan = membership.plan_reform(
            world.members, {h: m.status for h, m in self.members.items()},
            {h: r["completed_step"] for h, r in self.reform_requests.items() if h in world.members},
            None if change is None else membership.PlannedChange(change.kind, change.host, change.spare),
            min_hosts=self.min_hosts, registered=self._count("registered"),
            spares=sorted(h for h, m in self.members.items() if m.status == "spare"))
        if plan is None:
            return
        if isinstance(plan, membership.TooFewHosts):
            self.fail(self._failure_message() if self.failures else
                      f"only {len(plan.live)} hosts left ({', '.join(plan.live) or 'none'}); runtime.min_hosts is "
                      f"{self.min_hosts}")
            return
        if self.hosts_per_replica > 1:
            self._reform_groups(plan, change)
            return
        self.pending_change = None
        for host in plan.evicted:
            self.members[host].status = plan.evicted_status
        for host in plan.promoted:
            self.members[host].status = "registered"
        self._form(reason=plan.reason, resume_step=plan.resume_step, source=plan.source, holders=plan.holders,
                   data_position=None if plan.source is None else self.reform_requests[plan.source]["data_position"],
                   lost=list(plan.lost), reslotted=list(plan.evicted),
                   decision=change.record if change is not None else None)

    def _reform_groups(self, plan: membership.ReformPlan, change: Change | None) -> None:
        """`_maybe_reform` with replica groups: the plan's lost and evicted hosts vacate their slots,
        spares and newcomers fill them, and the next world is the complete groups, adopting the state
        of the newest group that holds it whole (groups.pick_source)."""
        gone = set(plan.lost) | set(plan.evicted)
        live = [h for h, m in self.members.items() if m.status in ("active", "idle") and h not in gone]
        by_order = sorted(self.members, key=groups_lib.host_order)
        named = change.spare if change is not None and change.spare else None  # a reslot's chosen spare first
        spares = [(h, self.members[h].region) for h in ([named] if named else []) + [h for h in by_order if h != named]
                  if self.members[h].status == "spare"]
        newcomers = [(h, self.members[h].region) for h in by_order if self.members[h].status == "registered"]
        regrouping = groups_lib.regroup(self.groups, live=live, spares=spares, newcomers=newcomers,
                                        k=self.hosts_per_replica, cross_region=self.cross_region_replica)
        if len(regrouping.complete) < self.min_replicas:
            self.fail(self._failure_message() if self.failures else
                      f"only {len(regrouping.complete)} complete replica groups of {self.hosts_per_replica} hosts left "
                      f"({', '.join('+'.join(h or '-' for h in g.slots) for g in regrouping.groups)}); "
                      f"runtime.min_replicas is {self.min_replicas}")
            return
        completed = {h: r["completed_step"] for h, r in self.reform_requests.items()}
        source = groups_lib.pick_source(regrouping, completed)
        self.pending_change = None
        for host in plan.evicted:
            self.members[host].status = plan.evicted_status
        for host in regrouping.unplaced:
            self.members[host].status = "spare"
        self._form(reason=plan.reason, resume_step=0 if source is None else source.step,
                   source=None if source is None else source.host, holders=() if source is None else source.holders,
                   data_position=None if source is None else self.reform_requests[source.host]["data_position"],
                   lost=list(plan.lost), reslotted=list(plan.evicted),
                   decision=change.record if change is not None else None, regrouping=regrouping,
                   source_group=None if source is None else source.group)

    def _form(self, *, reason: str, resume_step: int, source: str | None, data_position: dict | None,
              lost: list[str], holders: tuple[str, ...] = (), reslotted: list[str] | None = None,
              decision: dict | None = None, regrouping: groups_lib.Regrouping | None = None,
              source_group: int | None = None) -> None:
        generation = 0 if self.world is None else self.world.generation + 1
        # A world that restores from disk is a restart -- unless no world of this invocation has run
        # a step yet (generation 0 failed while forming): then the checkpoint is where it started anyway.
        if generation > 0 and source is None and any(e.first_step_at is not None for e in self.events):
            self.restarts += 1
        old = [] if self.world is None else [h for h in self.world.members if self.members[h].status == "active"]
        if regrouping is None:
            joiners = sorted(h for h, m in self.members.items() if m.status == "registered")
            members = tuple(old + joiners)
        else:  # replica groups: the complete groups' hosts; the survivors of broken ones wait, idle
            members = regrouping.members
            joiners = [h for h in members if h not in old and self.members[h].status != "idle"]
            self.groups = regrouping.groups
            for h in regrouping.idle:
                self.members[h].status = "idle"
        address = f"{self.bind}:{channel.free_port(self.bind)}"
        self.services[generation] = CoordinationService(address, len(members),
                                                        heartbeat_timeout=self.coordination_heartbeat)
        for stale in [g for g in self.services if g < generation - 1]:
            self.services.pop(stale).shutdown()
        for h in members:
            self.members[h].status = "active"
            self.members[h].last_seen = time.monotonic()
        self.world = World(
            generation=generation, coordinator=address, members=members,
            regions={h: self.members[h].region for h in members},
            devices_per_host={h: self.members[h].devices for h in members},
            resume_step=resume_step, source=source, holders=tuple(h for h in members if h in holders),
            data_position=data_position, reason=reason,
            groups=() if regrouping is None else tuple(regrouping.groups[i].slots for i in regrouping.complete),
            source_group=source_group,
        )
        now = time.monotonic()
        detected = self._detected_at or now
        fault_at = self.pending_fault_at
        if reslotted:  # a reslot's "fault" began when the straggler was slowed down, if it was injected
            fault_at = next((a["at"] for a in self.announced if a["host"] in reslotted and a["kind"] == "slow_host"),
                            None)
        event = GenerationEvent(generation=generation, reason=reason, lost=lost, joined=joiners if old else [],
                                fault_at=fault_at, detected_at=detected, formed_at=now,
                                resume_step=resume_step, reslotted=reslotted or [], decision=decision)
        if self.reform_requests:
            # Steps lost: completed steps that the new world does not start after.
            event.steps_lost = max(0, max(r["completed_step"] for r in self.reform_requests.values()) - resume_step)
        self.events.append(event)
        self.reform_requests = {}
        self.pending_fault_at = None
        self._detected_at = None
        log.info("generation %d (%s): %s, resume at step %d", generation, reason, ", ".join(members), resume_step)
        self.console(_formed_sentence(self.world, lost, joiners if old else [], reslotted or []))
        self._lock.notify_all()
        self._write_status()

    def _status(self) -> dict:
        # "step": steps completed, the number the newest checkpoint of the run would carry.
        world = self.world
        return {
            "controller": self.url,
            "generation": None if world is None else world.generation,
            "world": None if world is None else world.to_dict(),
            "step": max((m.step for m in self.members.values() if m.status in ("active", "done")), default=0),
            "members": {h: {"region": m.region, "status": m.status, "step": m.step, "generation": m.generation,
                            "step_seconds": round(m.step_seconds, 4)}
                        for h, m in sorted(self.members.items())},
            "events": [e.report() for e in self.events],
            "groups": [g.to_dict() for g in self.groups],
            "finished": self.summary is not None,
            "stopping": self.stop_reason,
            "error": self.error,
        }

    def _write_status(self) -> None:
        self._status_written = time.monotonic()
        path = self.run_dir / "elastic" / "status.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._status(), indent=2, sort_keys=True))
        tmp.replace(path)


def _formed_sentence(world: World, lost: list[str], joined: list[str], reslotted: list[str]) -> str:
    """One line for the console: which world formed, why, and where it resumes."""
    why = {"start": "", "failure": f" after losing {', '.join(lost)}", "join": f" to admit {', '.join(joined)}",
           "reslot": f" to replace straggler {', '.join(reslotted)}", "drain": f" to drain {', '.join(reslotted)}",
           "collective-timeout": " after a collective timed out"}.get(world.reason, f" ({world.reason})")
    if world.source is not None:
        start = f"; resumes from step {world.resume_step} with {world.source}'s state in memory"
        if set(world.members) <= set(world.holders):
            start += " (every member holds it: nothing is sent)"
    else:  # the first world, or every member lost its state: from the newest checkpoint, if any
        start = "" if world.generation == 0 else "; no member holds a state: starts from the newest checkpoint, if any"
    hosts = (f"{len(world.groups)} replica groups ({'; '.join('+'.join(g) for g in world.groups)})" if world.groups
             else f"{len(world.members)} hosts ({', '.join(world.members)})")
    return f"generation {world.generation} formed{why}: {hosts}{start}"
