"""The controller: membership, generations and the coordination service. It never trains.

Workers talk to it over a small JSON-over-HTTP API (stdlib `http.server`, see `channel`):

    POST /register  {host, region, devices, config_hash}   -> {accepted, run_started}
    POST /heartbeat {host, generation, step, step_seconds}  -> {join_signal}
    POST /world     {host, after}                           -> the first world newer than `after`
    POST /reform    {host, generation, completed_step, data_position, reason} -> the next world
    POST /fault     {host, kind, step}                       (an injector announces a fault it fires)
    POST /progress  {host, generation, step}                 (first step done in a new generation)
    POST /done      {host, summary}
    GET  /status

Generations: world g is (members in rank order, coordination service address, resume step,
the member whose state everyone adopts). A new generation is formed when a member dies (its
process exits, or it is silent for `dead_after_seconds`) or when registered newcomers wait and
the members agree to grow. All live members of world g ask for world g+1 (`/reform`), reporting
the last step they completed; world g+1 resumes at max(completed) + 1 from a member that
completed it, so a fault costs zero steps.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from resilient_jax.elastic import channel
from resilient_jax.elastic.world import CoordinationService

log = logging.getLogger(__name__)


@dataclass
class Member:
    host: str
    region: str
    devices: int
    status: str = "registered"  # registered -> active -> dead | done
    last_seen: float = field(default_factory=time.monotonic)
    step: int = -1
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
    data_position: dict | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "members": list(self.members)}


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
            "steps_lost": self.steps_lost,
        }


class RunFailed(RuntimeError):
    pass


class Controller:
    def __init__(self, *, config_hash: str, expected_hosts: int, run_dir: Path, bind: str = "127.0.0.1",
                 port: int = 0, token: str = "", dead_after_seconds: float = 6.0, min_hosts: int = 1,
                 on_dead: Callable[[str], None] | None = None):
        channel.check_bind(bind, token)
        self.config_hash = config_hash
        self.expected_hosts = expected_hosts
        self.run_dir = Path(run_dir)
        self.bind = bind
        self.token = token
        self.dead_after = dead_after_seconds
        self.min_hosts = min_hosts
        self.on_dead = on_dead or (lambda host: None)
        self.members: dict[str, Member] = {}
        self.world: World | None = None
        self.services: dict[int, CoordinationService] = {}
        self.events: list[GenerationEvent] = []
        self.reform_requests: dict[str, dict] = {}
        self.pending_fault_at: float | None = None
        self._detected_at: float | None = None  # when the pending generation change was first noticed
        self.summary: dict | None = None
        self.error: str | None = None
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self.server = channel.serve(self, bind, port, token)
        self.url = f"http://{bind}:{self.server.server_address[1]}"
        self._monitor = threading.Thread(target=self._watch, name="controller-monitor", daemon=True)
        self._monitor.start()
        self._write_status()

    # -- API handlers (called by channel on the server's threads) ----------------------------------

    def register(self, host: str, region: str, devices: int, config_hash: str) -> dict:
        if config_hash != self.config_hash:
            raise channel.Refused(
                409, f"worker {host} runs config {config_hash[:16]}..., this run is {self.config_hash[:16]}...; "
                     "start it with the run's config")
        with self._lock:
            existing = self.members.get(host)
            if existing is not None and existing.status in ("registered", "active"):
                raise channel.Refused(409, f"host {host} is already a member; pick another host id")
            self.members[host] = Member(host=host, region=region, devices=devices)
            log.info("registered %s (%s, %d devices)", host, region, devices)
            if self.world is None and self._count("registered") >= self.expected_hosts:
                self._form(reason="start", resume_step=0, source=None, data_position=None, lost=[])
            self._lock.notify_all()
            self._write_status()
            return {"accepted": True, "run_started": self.world is not None}

    def heartbeat(self, host: str, generation: int, step: int, step_seconds: float = 0.0) -> dict:
        with self._lock:
            member = self._member(host)
            member.last_seen = time.monotonic()
            member.step, member.generation, member.step_seconds = step, generation, step_seconds
            return {"join_signal": self._join_signal()}

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
                    if self.members[host].status == "dead":
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
            if self.pending_fault_at is None:
                self.pending_fault_at = time.monotonic()
            log.info("fault announced by %s: %s at step %d", host, kind, step)
        return {}

    def progress(self, host: str, generation: int, step: int) -> dict:
        with self._lock:
            for event in self.events:
                if event.generation == generation and event.first_step_at is None:
                    event.first_step_at = time.monotonic()
            self._write_status()
        return {}

    def done(self, host: str, summary: dict) -> dict:
        with self._lock:
            self.summary = summary
            for member in self.members.values():
                if member.status == "active":
                    member.status = "done"
            self._lock.notify_all()
            self._write_status()
        return {}

    def status(self) -> dict:
        with self._lock:
            return self._status()

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
                raise RunFailed(self.error)
            return self.summary

    def fail(self, message: str) -> None:
        with self._lock:
            self.error = self.error or message
            self._lock.notify_all()
            self._write_status()

    def close(self) -> None:
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
            return {
                "restarts": 0,
                "generations": (self.world.generation + 1) if self.world else 0,
                "failures_absorbed": sum(len(e.lost) for e in failures),
                "fault_events": len(failures),
                "steps_lost": sum(e.steps_lost for e in self.events),
                "events": [e.report() for e in self.events if e.reason != "start"],
                "members": {h: {"region": m.region, "status": m.status} for h, m in sorted(self.members.items())},
            }

    # -- internals (lock held) ---------------------------------------------------------------------

    def _member(self, host: str) -> Member:
        member = self.members.get(host)
        if member is None:
            raise channel.Refused(404, f"host {host} is not registered")
        return member

    def _count(self, status: str) -> int:
        return sum(1 for m in self.members.values() if m.status == status)

    def _join_signal(self) -> int:
        """Non-zero (the next generation) while newcomers wait to join a running world."""
        if self.world is not None and self._count("registered") > 0:
            return self.world.generation + 1
        return 0

    def _declare_dead(self, member: Member, why: str) -> None:
        log.warning("host %s declared dead: %s", member.host, why)
        was_active = member.status == "active"
        member.status = "dead"
        if was_active and self._detected_at is None:
            self._detected_at = time.monotonic()
        self.on_dead(member.host)
        self._lock.notify_all()
        self._write_status()

    def _watch(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                now = time.monotonic()
                for member in self.members.values():
                    if member.status in ("registered", "active") and now - member.last_seen > self.dead_after:
                        self._declare_dead(member, f"silent for {now - member.last_seen:.1f} s")
                self._maybe_reform()
            time.sleep(0.05)

    def _maybe_reform(self) -> None:
        world = self.world
        if world is None or self.summary is not None or self.error:
            return
        live = [h for h in world.members if self.members[h].status == "active"]
        lost = [h for h in world.members if self.members[h].status == "dead"]
        if not self.reform_requests and not lost:
            return
        if any(h not in self.reform_requests for h in live):
            return  # a live member is still in the old world; it will fail its collective and ask
        if len(live) < self.min_hosts:
            self.fail(f"only {len(live)} hosts left ({', '.join(live) or 'none'}); runtime.min_hosts is "
                      f"{self.min_hosts}")
            return
        completed = {h: self.reform_requests[h]["completed_step"] for h in live}
        best = max(completed.values())
        source = min((h for h in live if completed[h] == best), key=world.members.index)
        reason = "failure" if lost else "join"
        self._form(reason=reason, resume_step=best + 1, source=source,
                   data_position=self.reform_requests[source]["data_position"], lost=lost)

    def _form(self, *, reason: str, resume_step: int, source: str | None, data_position: dict | None,
              lost: list[str]) -> None:
        generation = 0 if self.world is None else self.world.generation + 1
        old = [] if self.world is None else [h for h in self.world.members if self.members[h].status == "active"]
        joiners = sorted(h for h, m in self.members.items() if m.status == "registered")
        members = tuple(old + joiners)
        address = f"{self.bind}:{channel.free_port(self.bind)}"
        self.services[generation] = CoordinationService(address, len(members))
        for stale in [g for g in self.services if g < generation - 1]:
            self.services.pop(stale).shutdown()
        for h in members:
            self.members[h].status = "active"
            self.members[h].last_seen = time.monotonic()
        self.world = World(
            generation=generation, coordinator=address, members=members,
            regions={h: self.members[h].region for h in members},
            devices_per_host={h: self.members[h].devices for h in members},
            resume_step=resume_step, source=source, data_position=data_position, reason=reason,
        )
        now = time.monotonic()
        detected = self._detected_at or now
        event = GenerationEvent(generation=generation, reason=reason, lost=lost, joined=joiners if old else [],
                                fault_at=self.pending_fault_at, detected_at=detected, formed_at=now,
                                resume_step=resume_step)
        if self.reform_requests:
            # Steps lost: completed steps that the new world does not start after.
            event.steps_lost = max(0, max(r["completed_step"] for r in self.reform_requests.values()) + 1 - resume_step)
        self.events.append(event)
        self.reform_requests = {}
        self.pending_fault_at = None
        self._detected_at = None
        log.info("generation %d (%s): %s, resume at step %d", generation, reason, ", ".join(members), resume_step)
        self._lock.notify_all()
        self._write_status()

    def _status(self) -> dict:
        world = self.world
        return {
            "controller": self.url,
            "generation": None if world is None else world.generation,
            "world": None if world is None else world.to_dict(),
            "step": max((m.step for m in self.members.values() if m.status == "active"), default=-1),
            "members": {h: {"region": m.region, "status": m.status, "step": m.step, "generation": m.generation,
                            "step_seconds": round(m.step_seconds, 4)}
                        for h, m in sorted(self.members.items())},
            "events": [e.report() for e in self.events],
            "finished": self.summary is not None,
            "error": self.error,
        }

    def _write_status(self) -> None:
        path = self.run_dir / "elastic" / "status.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._status(), indent=2, sort_keys=True))
        tmp.replace(path)
