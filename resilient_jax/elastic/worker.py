"""A worker: one host of an elastic run. It trains, and when the world changes it re-forms in-process.

The worker's life is one state machine, `resilient_jax.elastic.lifecycle` (an enum of states and
one transition table; every transition is logged with its reason):

    WAITING -> JOINING -> RESTORING | ADOPTING -> COMPILING -> TRAINING -> DONE
       ^                                                          |
       +------------- LEAVING <-- a collective failed (at any of these states),
                                  or the members agreed to change the world

TRAINING runs the run loop a single-process run runs (trainer.StepLoop.run: evaluate when due,
the two-phase step, a boundary); what the worker adds is its decision at each boundary, below.
A failed collective raises inside `compute`, which never touches
the state, so the state of the last completed step is still on this host's devices: it is copied
to host memory, the JAX world is left (shutdown, clear backends) and the controller is asked for
the next world. There every member adopts the state of the member that completed the most steps,
and training resumes at the next step: zero steps lost. When every member of the new world holds
that state already (survivors only), each places its own copy and nothing is sent; when one does
not (a newcomer, a spare, a survivor a step behind), the source's copy reaches all in one bit-exact
broadcast.

Growth and reslots are agreed inside the world: after every step each member contributes the
controller's latest reform signal to a tiny all-gather; when the maximum is set, every member
re-forms at the same step boundary, and a newcomer (or a spare taking a straggler's slot) receives
the state from a peer, never from disk. A stop (the driver got Ctrl-C or SIGTERM; JAX's preemption
notice; --stop-at) rides the same all-gather: every member checkpoints at the same boundary and the
run reports `stopped`. Ctrl-C itself is ignored here: it is the driver's to act on. The same
all-gather carries every member's timings of the step, from which every member plans the next
step's shard assignment alike (`ShareKeeper`, resilient_jax.assignment): shards move between the
members of a world at any step boundary, without a re-formation and without changing a bit.

The run ends the same way: the final checkpoint commits across the world (its barriers go through
the coordination service, so the wait for it ends at the controller's verdict too), rank 0 reports
the summary, and the other members exit only once the controller holds it. A member dying at any
of these moments fails the world like a failed step; the survivors form one with no step left to
run, which compiles no step, commits the checkpoint (or finds it committed) and reports the end.

Step numbers sent to the controller follow the run's convention: step k is the update that
brings the run to k completed steps (the loop's index k-1).

Failures are not detected by timeouts here: the heartbeat thread reports this host's step timings
and, when a step runs past the stall deadline (a multiple of the recent p95 step time, with a
floor), how long it has waited. The controller answers from liveness: while every member is alive
the step simply goes on waiting (backpressure); once a member is dead the reply says abort, and the
heartbeat thread aborts this world's collectives so the step raises at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from resilient_jax import compile_cache
from resilient_jax.elastic.lifecycle import Event, Lifecycle, State, lifecycle_journal

log = logging.getLogger("resilient_jax.worker")

# Why a run stops early, as agreed across members (the all-gather takes the maximum).
STOP_REASONS = (None, "interrupted", "preempted", "stop_at")
# How long leaving a failed world waits for its checkpoint save in flight to end, once its
# coordination client is shut down: one whose barrier that fails ends in ~0.2 s (measured); one
# whose orbax threads wait on a dead member is abandoned after it (a failed world's save can
# never commit: every member writes its part).
FAILED_SAVE_GRACE_SECONDS = 1
# A save that failed because a member died may fail before the controller's verdict names the
# death: how long past runtime.dead_after_seconds to wait for it before reporting the failure.
VERDICT_MARGIN_SECONDS = 2
BAD_INPUT_EXIT = 2  # as `python -m resilient_jax.train`: a mistake of the caller's, said in one line


def resume_for_world(resume: str | None, generation: int, checkpoints: bool) -> str | None:
    """The --resume a world that restores from disk passes its checkpoint session. An explicit
    --resume names where the invocation starts; a later world takes the newest checkpoint, which
    this run wrote itself -- unless it writes none (checkpoint.enabled false): then the invocation's
    --resume is still where its state began (None there would start from step 0, or be refused
    over the checkpoints it resumed from)."""
    return resume if generation == 0 or not checkpoints else None


@dataclass
class HostState:
    """What survives a re-formation: the training state in host memory, and where training stands."""

    state: object | None = None  # TrainState of numpy arrays
    completed_step: int = -1
    data_position: dict | None = None


class StallClock:
    """This host's recent step times and the adaptive stall deadline derived from them."""

    def __init__(self, floor_seconds: float, multiple: float, history: int = 50):
        self.floor, self.multiple = floor_seconds, multiple
        self.recent: deque[float] = deque(maxlen=history)
        self.started_at: float | None = None  # perf_counter at entry into the current step

    def deadline(self) -> float:
        if len(self.recent) < 5:  # too little history (a world's first steps): never call a stall
            return float("inf")
        p95 = float(np.percentile(np.asarray(self.recent), 95))
        return max(self.floor, self.multiple * p95)

    def stalled_for(self) -> float:
        """Seconds the current step has run, if past the deadline; else 0."""
        started = self.started_at
        if started is None:
            return 0.0
        elapsed = time.perf_counter() - started
        return elapsed if elapsed > self.deadline() else 0.0


class Heartbeat(threading.Thread):
    """Reports liveness, step timings and stalls on its own thread; training never waits for it."""

    def __init__(self, client, host: str, interval: float, clock: StallClock):
        super().__init__(name="heartbeat", daemon=True)
        self.client, self.host, self.interval, self.clock = client, host, interval, clock
        self.generation, self.step, self.step_seconds = -1, 0, 0.0  # step: steps completed
        self.reform_signal = 0
        self.precompiled = -1  # the newest generation whose next worlds rank 0 compiled ahead (controller's word)
        self.stop_reason: str | None = None  # the controller asks every member to stop (Ctrl-C, SIGTERM)
        self.on_abort = lambda generation: None
        self._timings: list[list] = []  # [step, ready s, step s, wall time, shards held] not yet reported
        self._progress: list[list] = []  # [step, loss, tokens/s] of logged steps not yet reported
        self._reassignments: list[dict] = []  # shard re-plans not yet reported
        self._evals: list[dict] = []  # eval events not yet reported
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def record(self, step: int, ready_seconds: float, step_seconds: float, shards: int) -> None:
        with self._lock:
            self._timings.append([step, ready_seconds, step_seconds, time.time(), shards])
        self.step, self.step_seconds = step, step_seconds

    def report_reassignment(self, event: dict) -> None:
        """A shard re-plan (rank 0 reports it for the world), sent with the next heartbeat."""
        with self._lock:
            self._reassignments.append(event)

    def take_evals(self) -> list[dict]:
        """The evaluations not sent yet (the last rank 0 hands them over with its summary)."""
        with self._lock:
            taken, self._evals = self._evals, []
        return taken

    def take_reassignments(self) -> list[dict]:
        """The re-plans not sent yet (the last rank 0 hands them over with its summary)."""
        with self._lock:
            taken, self._reassignments = self._reassignments, []
        return taken

    def report_eval(self, event: dict) -> None:
        """An evaluation, for the driver's console (sent with the next heartbeat)."""
        with self._lock:
            self._evals.append(event)

    def report_progress(self, step: int, loss: float, tokens_per_s: float) -> None:
        """A logged step, for the driver's console (sent with the next heartbeat)."""
        with self._lock:
            self._progress.append([step, loss, tokens_per_s])

    def run(self) -> None:
        from resilient_jax.elastic.channel import ControllerError

        while not self._stop.wait(self.interval):
            with self._lock:
                timings, self._timings = self._timings, []
                progress, self._progress = self._progress, []
                reassignments, self._reassignments = self._reassignments, []
                evals, self._evals = self._evals, []
            generation = self.generation
            stalled = self.clock.stalled_for()
            try:
                reply = self.client.call("/heartbeat", retry_seconds=0, host=self.host, generation=generation,
                                         step=self.step, step_seconds=self.step_seconds, stalled_seconds=stalled,
                                         deadline_seconds=min(self.clock.deadline(), 1e9), timings=timings,
                                         progress=progress, reassignments=reassignments, evals=evals)
            except ControllerError as e:
                # Briefly unreachable: keep training; membership has not changed as far as we know.
                log.debug("heartbeat failed: %s", e)
                with self._lock:
                    self._timings = timings + self._timings
                    self._progress = progress + self._progress
                    self._reassignments = reassignments + self._reassignments
                    self._evals = evals + self._evals
                continue
            self.reform_signal = int(reply.get("reform_signal", 0))
            self.stop_reason = reply.get("stop") or self.stop_reason
            self.precompiled = int(reply.get("precompiled", -1))
            if reply.get("abort"):
                try:
                    self.on_abort(generation)
                except Exception:  # the heartbeat must outlive anything an abort runs into
                    log.exception("aborting the collectives of generation %d failed", generation)

    def stop(self) -> None:
        self._stop.set()


@dataclass
class Reassignment:
    decision: object  # assignment.Decision
    device_counts: list[int]

    def to_event(self, hosts: list[str]) -> dict:
        return {**self.decision.to_event(hosts), "device_shards": self.device_counts}


class ShareKeeper:
    """This world's shard assignment (resilient_jax.assignment): the planner every member holds
    identically, fed from the step-boundary all-gather."""

    def __init__(self, trainer, planner, policy, device_host: list[int]):
        self.trainer, self.planner, self.policy, self.device_host = trainer, planner, policy, device_host

    @classmethod
    def start(cls, trainer, step: int) -> ShareKeeper:
        import jax

        from resilient_jax import assignment

        rt = trainer.cfg.runtime
        device_host = trainer.grid_processes()
        hosts = jax.process_count()
        uniform = assignment.host_counts_from_devices(trainer.plan.uniform_counts(), device_host, hosts)
        capacity = [device_host.count(h) * trainer.plan.slots_per_device for h in range(hosts)]
        planner = assignment.Planner.start(uniform, capacity, step)
        policy = assignment.Policy(window=rt.assignment_window, hysteresis=rt.assignment_hysteresis,
                                   max_share=rt.max_share)
        return cls(trainer, planner if trainer.assignment == "proportional" else None, policy, device_host)

    @staticmethod
    def encode(ready_seconds: float, step_seconds: float) -> list[int]:
        # Microseconds, as int32 (the all-gather's type; 35 minutes at most).
        return [min(int(round(x * 1e6)), 2**31 - 1) for x in (ready_seconds, step_seconds)]

    def mine(self) -> int:
        import jax

        grid = self.trainer.layout.counts
        return int(sum(int(c) for c, h in zip(grid, self.device_host) if h == jax.process_index()))

    def share(self) -> float:
        import jax

        if self.planner is None:
            return 1.0
        uniform = self.planner.uniform[jax.process_index()]
        return self.mine() / uniform if uniform else 1.0

    def observe(self, completed: int, gathered: np.ndarray, *, skip: bool) -> Reassignment | None:
        """`gathered`: per host [ready us, in-step us, shards held], from the step-boundary all-gather."""
        from resilient_jax import assignment

        if self.planner is None:
            return None
        sample = assignment.Sample(step=completed, shards=tuple(int(x) for x in gathered[:, 2]),
                                   ready=tuple(float(x) / 1e6 for x in gathered[:, 0]),
                                   in_step=tuple(float(x) / 1e6 for x in gathered[:, 1]))
        if sample.shards != self.planner.counts:  # every host ran what every host planned, or stop here
            raise assignment.DisagreementError(
                f"step {completed}: the hosts held {list(sample.shards)} shards, this host planned "
                f"{list(self.planner.counts)}")
        if skip:  # a world's first step carries warm-up; a stopping or changing world plans nothing
            return None
        self.planner, decision = assignment.observe(self.planner, sample, self.policy)
        if decision is None:
            return None
        counts = assignment.device_counts(list(decision.new), self.device_host, self.trainer.plan.slots_per_device)
        return Reassignment(decision, counts)


def _cannot_register(host: str, error: Exception) -> str:
    """The one line for a registration that failed: no controller there, or one that said no."""
    from resilient_jax.elastic.channel import ControllerUnreachable

    if isinstance(error, ControllerUnreachable):
        return f"error: {host} cannot reach the controller: {error}; is the run still running, at that address?"
    return f"error: the controller refused {host}: {error}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m resilient_jax.elastic worker",
        description="One host of an elastic run (a launcher starts it). Exit codes: 0 the run finished or this host "
        "left it as asked, 1 a failure, 2 bad input (one line on stderr: a --controller, --tls-ca or config this "
        "host cannot use, or the controller refusing it).")
    parser.add_argument("--controller", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--region", default="local")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--spare", action="store_true", help="wait outside the world until given a slot")
    parser.add_argument("--register-at-step", type=int, metavar="N",
                        help="stay outside the run until it has completed N steps, then register: a host that "
                        "becomes available then (join_host@N)")
    parser.add_argument("--tls-ca", type=Path, help="the CA file an https controller is verified against "
                        "(runtime.tls=auto: run.dir/elastic/tls/ca.pem); launched workers get it in the environment")
    args = parser.parse_args(argv)
    from resilient_jax.elastic.channel import check_controller_url

    try:  # before anything else: the run's token must never go to a server we cannot verify
        check_controller_url(args.controller)
        if args.tls_ca and not args.controller.startswith("https:"):
            raise ValueError(f"{args.controller} is not https, so --tls-ca {args.tls_ca} would verify nothing; use "
                             "the https:// address the controller prints")
    except ValueError as e:
        print(f"error: --controller {e}", file=sys.stderr)
        return BAD_INPUT_EXIT
    # A terminal's Ctrl-C reaches the whole process group; the driver turns it into an agreed stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.host} %(levelname)s %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save step at INFO

    from resilient_jax.config import ConfigError, from_dict

    try:  # the run's resolved config, as the driver writes it (run.dir/elastic/config.json)
        cfg = from_dict(json.loads(Path(args.config_json).read_text()))
    except (OSError, ValueError) as e:  # unreadable, not JSON (a YAML file?), or a bad value (ConfigError)
        print(f"error: --config-json {args.config_json}: {e}; pass the run's run.dir/elastic/config.json",
              file=sys.stderr)
        return BAD_INPUT_EXIT
    from resilient_jax.elastic import world as world_lib

    try:
        world_lib.configure_process(cfg, args.devices)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return BAD_INPUT_EXIT

    # Before the first compile: later worlds of a size seen before load their step from disk.
    cache = compile_cache.enable(cfg.runtime.compile_cache, cfg.run.dir)
    if cache.warning:
        log.warning("%s", cache.warning)
    from resilient_jax.elastic.channel import ControllerClient, ControllerError

    from resilient_jax.elastic.tls import CA_ENV

    try:
        ca_pem = args.tls_ca.read_text() if args.tls_ca else os.environ.get(CA_ENV, "")
        client = ControllerClient(args.controller, os.environ.get("RESILIENT_JAX_TOKEN", ""), ca_pem=ca_pem)
    except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
        print(f"error: --tls-ca {args.tls_ca or '$' + CA_ENV}: not a readable PEM CA certificate ({e})", file=sys.stderr)
        return BAD_INPUT_EXIT
    if args.register_at_step is not None:
        import resilient_jax.trainer  # noqa: F401  (seconds of imports done while waiting, not after the step)

        try:
            reached = _run_reached(client, args.register_at_step)
        except ControllerError as e:  # a refusal (token, TLS): the join can never happen
            print(_cannot_register(args.host, e), file=sys.stderr)
            return BAD_INPUT_EXIT
        if not reached:
            log.info("leaving: the run ended before step %d", args.register_at_step)
            return 0
    try:
        registered = client.call("/register", host=args.host, region=args.region, devices=args.devices,
                                 config_hash=cfg.hash, spare=args.spare)
    except ControllerError as e:
        print(_cannot_register(args.host, e), file=sys.stderr)
        return BAD_INPUT_EXIT
    clock = StallClock(cfg.runtime.stall_floor_seconds, cfg.runtime.stall_multiple)
    heartbeat = Heartbeat(client, args.host, cfg.runtime.heartbeat_seconds, clock)
    heartbeat.start()  # right after registering: the imports below can take seconds on a busy host
    worker = Worker(cfg, args.host, args.region, client, heartbeat, options=registered.get("options") or {},
                    cache_on=cache.path is not None)
    heartbeat.on_abort = worker.abort
    try:
        return worker.run()
    except Exception as e:
        from resilient_jax.checkpoint.store import CheckpointSaveError

        # Tell the driver what went wrong before exiting, so its console names the error (and this log).
        # ValueErrors name a key, file or field the user gave (ConfigError, DatasetError, CheckpointError).
        bad_input = isinstance(e, (ValueError, CheckpointSaveError))
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        error = text if bad_input and text else f"{type(e).__name__}: {text}"
        if bad_input:
            print(f"error: {error}", file=sys.stderr, flush=True)
        else:
            log.exception("worker %s failed", args.host)
        try:
            client.call("/failed", retry_seconds=5, host=args.host, error=error[:2000], bad_input=bad_input)
        except ControllerError:
            pass  # the controller is gone; the launcher still sees the exit code
        heartbeat.stop()
        # Exit now: the JAX client's exit-time shutdown would wait on peers that are failing too
        # (seen: every worker stuck until the controller fenced it as silent).
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(BAD_INPUT_EXIT if bad_input else 1)
    finally:
        heartbeat.stop()


def _run_reached(client, step: int, poll_seconds: float = 0.25) -> bool:
    """Wait until the run has completed `step` steps (True), or is over or stopping without having
    reached it while this host waited (False); a refusal (ControllerError) is raised.

    A host started ahead of its join (the launcher starts it with the run) has imported JAX and
    read its config by then, so it registers the moment the run reaches the step, on a fast machine
    or a slow one: a join that waited for a new process to start could come after the last step.
    The run's end is checked first: a run that passed the step and then finished, failed or began
    stopping before this host's first look has no world left to join."""
    from resilient_jax.elastic.channel import ControllerUnreachable

    while True:
        try:
            status = client.call("/status", method="GET", retry_seconds=60)
        except ControllerUnreachable as e:
            log.warning("the controller is gone before step %d: %s", step, e)
            return False
        if status["finished"] or status["error"] or status["stopping"]:
            return False
        if status["step"] >= step:
            return True
        time.sleep(poll_seconds)


class Worker:
    def __init__(self, cfg, host: str, region: str, client, heartbeat: Heartbeat, options: dict | None = None,
                 cache_on: bool = False):
        """`options`: this invocation's resume / allow_config_change / stop_at (from the controller)."""
        from resilient_jax import faults as faults_lib
        from resilient_jax.elastic.injection import HostFaults

        self.cfg, self.host, self.region = cfg, host, region
        self.client, self.heartbeat = client, heartbeat
        index = int(host[1:]) if host[1:].isdigit() else -1
        self.faults = HostFaults(faults_lib.parse_faults(cfg.faults), index, region, client, host)
        from resilient_jax.trainer import RunTotals

        self.kept = HostState()
        self.life = Lifecycle(host, journal=lifecycle_journal(cfg.run.dir, host))
        self.cache_on = cache_on  # the persistent compile cache is in use (precompiles need it)
        self.precompiler = None  # rank 0's background compile of the likely next worlds, while it trains
        self.verified_dataset = None  # the dataset's Manifest once this process has hashed its shards
        self.verified_eval_dataset = None  # eval.dataset's, likewise
        self.generation = -1
        self.coordinator_port: int | None = None  # set while this process is in a JAX world
        self._world_lock = threading.Lock()  # an abort must hit the world it was meant for
        self.totals = RunTotals()
        self.metrics = None
        self.metrics_dropped = 0  # metrics.jsonl records the rank-0 writer dropped when it opened
        self.started = time.perf_counter()
        options = options or {}
        self.resume = options.get("resume")  # for this invocation's first world only
        self.allow_config_change = list(options.get("allow_config_change") or [])
        self.stop_at = options.get("stop_at")
        invocation = options.get("invocation")  # names this invocation's exported programs (a folder)
        self.invocation = invocation if isinstance(invocation, str) and re.fullmatch("[0-9a-f]{16}", invocation) else None
        self._last_progress: tuple[int, float] | None = None  # (step, perf_counter) of the last progress line
        self._unstuck: threading.Thread | None = None  # a checkpoint wait a verdict left running (_unless_aborted)
        self._finishing = False  # this world has run its last step and is ending the run (_finish)

    def run(self) -> int:
        """The state machine's loop (resilient_jax.elastic.lifecycle): wait for a world, live in it
        until the run is done or the world is left, and ask for the next one."""
        life = self.life
        while True:
            world = self._wait_world()
            if world is None:
                life.fire(Event.RUN_OVER, "no world for this host")
                return 0
            life.fire(Event.WORLD, f"generation {world['generation']} of {len(world['members'])} hosts")
            self._train_in(world)
            if life.state is State.DONE:
                return 0
            # -1: this host holds no state in memory (its first world failed while forming), so it
            # must never be the source the next world adopts from.
            held = self.kept.completed_step + 1 if self.kept.state is not None else -1
            life.fire(Event.LEFT, f"generation {self.generation}, holding the state of step {held}")
            self.client.call("/reform", retry_seconds=60, host=self.host, generation=self.generation,
                             completed_step=held, data_position=self.kept.data_position, reason=life.leave_reason)

    def abort(self, generation: int) -> None:
        """The controller says a member of `generation` is dead: make our collectives fail now."""
        from resilient_jax.elastic import world as world_lib

        # Under the lock: the main thread cannot leave this world and join the next one meanwhile,
        # so only this world's connections are shut down.
        with self._world_lock:
            if self.coordinator_port is None or generation != self.generation:
                return
            keep = {self.coordinator_port, self.client.port}
            self.coordinator_port = None  # once per world
            n = world_lib.abort_collectives(keep)
        log.warning("a member of generation %d is dead: aborted this host's collectives (%d connections)",
                    generation, n)

    def _compile(self, lower, what: str, rank: int, world_size: int) -> compile_cache.CompileRecord:
        """This world's programs `lower()`, compiled -- or, on one machine, loaded from the cache once
        rank 0 has compiled them (world.compile_world); the controller's verdict ends any wait."""
        import jax

        from resilient_jax.elastic import world as world_lib

        return compile_cache.timed_compile(lambda: world_lib.compile_world(
            lower, f"{what}-{self.generation}", rank, world_size, jax.devices()[0].platform,
            aborted=lambda: self.coordinator_port is None))

    def _wait_world(self) -> dict | None:
        while True:
            reply = self.client.call("/world", retry_seconds=60, host=self.host, after=self.generation)
            if "world" in reply:
                return reply["world"]
            if reply.get("evicted") or reply.get("finished"):
                log.info("leaving the run: %s", "evicted" if reply.get("evicted") else "finished")
                return None
            if "error" in reply:
                log.error("the run failed: %s", reply["error"])
                return None

    def _train_in(self, world: dict) -> None:
        """Join `world` and train in it until the run is done (state DONE) or the world is left
        (state LEAVING: a member died, or the members agreed to change it). The JAX world is torn
        down before returning."""
        import jax

        from resilient_jax.elastic import world as world_lib
        from resilient_jax.trainer import StepLoop, Trainer

        members = self.members = world["members"]
        rank = members.index(self.host)
        try:
            # Not under the lock: it waits for peers.
            world_lib.join(world["coordinator"], len(members), rank,
                           heartbeat_timeout=self.cfg.runtime.coordination_heartbeat_seconds)
        except world_lib.WorldFormationError as e:
            # What this host kept from the last world is unchanged; ask for the next one.
            self.generation = self.heartbeat.generation = world["generation"]
            self.life.fire(Event.JOIN_FAILED, str(e))
            world_lib.leave()
            return
        with self._world_lock:
            self.generation = world["generation"]
            self.coordinator_port = int(world["coordinator"].rsplit(":", 1)[1])
        world_lib.number_orbax_operations(self.generation)
        self.heartbeat.generation = self.generation
        log.info("generation %d: rank %d of %d, resume at step %d", self.generation, rank, len(members),
                 world["resume_step"])
        self.faults.joined(self.generation, world["resume_step"])
        resume = resume_for_world(self.resume, self.generation, self.cfg.checkpoint.enabled)
        # The dataset is hashed in full once per worker process; later worlds check its identity.
        regions = {i: world["regions"][h] for i, h in enumerate(members)}
        if world["source"] is None:
            self.life.fire(Event.FROM_DISK, "a checkpoint, or a fresh state")
        else:
            self.life.fire(Event.FROM_PEER, f"{world['source']}'s state after step {world['resume_step']}")
        ckpt = None
        try:
            # Building the trainer and its checkpoint session runs collectives too (the store syncs
            # once process 0 has cleaned it): a member dying here fails the world like one dying in
            # the adoption.
            trainer = Trainer(self.cfg, devices=jax.devices(), resume=resume,
                              allow_config_change=self.allow_config_change,
                              verified_dataset=self.verified_dataset, regions=regions,
                              verified_eval_dataset=self.verified_eval_dataset)
            trainer.compile_midrun = lambda lower, what: self._compile(lower, what, rank, len(members))
            self.verified_dataset = trainer.manifest
            self.verified_eval_dataset = trainer.evalset.manifest if trainer.evalset else None
            ckpt = trainer.checkpoints(generation=self.generation, regions=regions)
            ckpt.on_save = lambda step, root=ckpt.root: self.faults.saving(step, root)
            if world["source"] is None:
                # A new run, or one resuming from the persistent checkpoint in run.dir.
                resumed = trainer.restore(ckpt)
                made = []
                state = resumed.state if resumed else trainer.fresh_state(
                    compiler=lambda lower: made.append(self._compile(lower, "init", rank, len(members))))
                start, position = (resumed.step, resumed.position) if resumed else (0, None)
                ready = f"step {start}" + (f", a fresh state ({made[0].describe()})" if made else "")
                if resumed and rank == 0:
                    self._announce_resume(trainer, resumed)
            else:
                # Everyone adopts the state of the member that completed the most steps (not from disk).
                self.faults.adopting(self.generation, world["resume_step"])
                state = self._adopt(trainer, world)
                start = world["resume_step"]
                position = _position_from_dict(world["data_position"])
                ready = f"step {start}"
            self.life.fire(Event.STATE_READY, ready)
            compiled, called_exported = None, []
            # A world with no step left to run (the last world's member died as it ended the run, or
            # a rerun of a finished run) only commits the final checkpoint and reports, unless the
            # run's last evaluation is due: compiling its programs -- minutes at scale -- would hold
            # the survivors for nothing.
            if trainer.runs_a_program(start, StepLoop.end_of(self.cfg.train.steps, self.stop_at)):
                def lower():  # the export, where rank 0 exports for this world, is part of its compile
                    called_exported.append(self._use_exported(trainer, world, members))
                    return trainer.lowered(state)

                compiled = self._compile(lower, "step", rank, len(members))
                self.totals.compile_seconds += compiled.seconds
                log.info("generation %d: compiled the step in %.2f s (%s); gradient sum %s", self.generation,
                         compiled.seconds, compiled.describe(), trainer.reduction_order())
                # The controller's verdict (abort() clears coordinator_port) ends the wait at once.
                world_lib.barrier(f"compiled-{self.generation}", timeout_seconds=300,
                                  aborted=lambda: self.coordinator_port is None)
        except (jax.errors.JaxRuntimeError, world_lib.WorldAborted, world_lib.BarrierTimeout) as e:
            # A member died while this world was forming (the adoption broadcast or the barrier
            # failed): what this host kept from the last world is unchanged; ask for the next one.
            self.life.fire(Event.FAILED, f"forming generation {self.generation}: {str(e).splitlines()[0][:200]}")
            self._leave(ckpt)
            return
        if compiled is None:
            self.life.fire(Event.COMPILED, f"nothing: no step left to run after step {start}")
        else:
            self.life.fire(Event.COMPILED, f"{compiled.seconds:.2f} s, {compiled.describe()}"
                           + (f", calling the step {called_exported[0]}" if called_exported[0] else ""))
            if rank == 0:
                self._start_precompile(world, members)
        metrics = self._metrics(trainer, start)
        if compiled is not None:
            metrics.event({"event": "compile", "step": start, "generation": self.generation, **compiled.to_event(),
                           "reduction_order": trainer.reduction_order()})
        loop = StepLoop(trainer, metrics, self.totals, ckpt, start_step=start, position=position)
        try:
            event, reason = self._steps(trainer, loop, state, start)
            self.life.fire(event, reason)
        finally:
            loop.close()
            self._leave(ckpt)

    def _exported_dir(self):
        from resilient_jax import exported

        return None if self.invocation is None else exported.folder(self.cfg.run.dir, self.invocation)

    def _use_exported(self, trainer, world: dict, members: list[str]) -> str | None:
        """Call this world's step through exported programs (resilient_jax.exported) where every
        member can, so that the members do not each trace the model (`exported.world_programs`):
        those rank 0 exported ahead for a world of this shape (elastic/precompile), whose compiled
        form is in the cache, or, on one machine, those its rank 0 exports now (`_share_export`).
        All or none: programs lowered apart may differ, and the members of one world must run one
        program. Where any member lacks them (another machine's run.dir, a world nobody foresaw on
        machines of their own) every member traces its own, as always. Returns which programs are
        called, or None."""
        import jax

        from resilient_jax import exported
        from resilient_jax.elastic import world as world_lib

        folder = self._exported_dir()
        if folder is None:  # the same for every member: the controller names the invocation
            return None
        folder = folder / exported.world_key([world["regions"][h] for h in members],
                                             [world["devices_per_host"][h] for h in members])
        calls = self._exported_calls(trainer, folder)
        rank, size = members.index(self.host), len(members)
        aborted = lambda: self.coordinator_port is None  # noqa: E731 -- the controller's verdict
        words = [json.loads(w) for w in world_lib.exchange(
            f"exported-{self.generation}", rank, size, json.dumps([compile_cache.placement(), calls is not None]),
            aborted=aborted)]
        which = exported.world_programs([ready for _, ready in words], [placement for placement, _ in words],
                                        jax.devices()[0].platform)
        if which == exported.FOR_THIS_WORLD:
            calls = self._share_export(trainer, folder, rank, aborted)
            if not world_lib.all_agree(f"exported-shared-{self.generation}", rank, size, calls is not None,
                                       aborted=aborted):
                return None
        elif which is None:
            return None
        trainer.use_exported(calls)
        log.info("generation %d: calling the step %s", self.generation, which)
        return which

    def _exported_calls(self, trainer, folder) -> dict | None:
        """The programs in `folder` as `trainer`'s calls, or None where there are none that fit."""
        from resilient_jax import exported

        programs = exported.load(folder)
        if programs is None:
            return None
        try:
            return trainer.exported_calls(programs)
        except (KeyError, ValueError) as e:  # not this world's programs after all
            log.warning("generation %d: the exported programs do not fit this world (%s)", self.generation, e)
            return None

    def _share_export(self, trainer, folder, rank: int, aborted) -> dict | None:
        """Rank 0 exports this world's programs into `folder` and says so; the other members wait
        for its word and load them. None where that failed here (a program jax.export refuses, a
        full disk): the caller then traces.

        The others wait for rank 0's word however long its export takes, as for a live peer in a
        collective: rank 0 always answers ("1" or "0"), and only the controller's verdict (rank 0
        dead) ends the wait. A fixed timeout would let a member give up while rank 0 finishes, and
        the agreement that follows would then time out in turn and fail the world -- again in
        every world after it, with the same rank 0 and model."""
        import math

        from resilient_jax import exported
        from resilient_jax.elastic import world as world_lib

        name = f"exported-{self.generation}/shared"
        if rank != 0:
            word = world_lib.read_word(name, 0, timeout_seconds=math.inf, aborted=aborted)
            return self._exported_calls(trainer, folder) if word == "1" else None
        try:
            calls = exported.export_and_reload(trainer, folder)
        except Exception as e:  # an optimisation: never a reason for the world to fail
            log.warning("generation %d: this world's step could not be exported (%s: %s); each member traces "
                        "its own", self.generation, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            calls = None
        world_lib.publish(name, 0, "1" if calls is not None else "0")
        return calls

    def _adopt(self, trainer, world: dict):
        """The state after world["resume_step"], on this world's devices."""
        from jax.experimental import multihost_utils

        from resilient_jax.elastic import transfer

        if world.get("groups"):
            return self._adopt_slices(trainer, world)
        if set(world["members"]) <= set(world["holders"]):
            # Every member holds it in its own memory (survivors only, no newcomer). Replicas are
            # bit-identical -- the same program ran on the same inputs on every host (DESIGN
            # invariant 3) -- so nothing is sent: no state-sized collective across regions, and no
            # second copy of the state in memory, at the moment of recovery.
            state = trainer.state_from_host(self.kept.state)
            # One tiny collective where the broadcast would have been: a member that died since
            # joining is a closed connection found now, not at the compile barrier's 30 s
            # coordination heartbeat.
            multihost_utils.sync_global_devices(f"resilient_jax.adopted.{self.generation}")
            log.info("adopted state after step %d: its own copy, which every member holds (nothing sent)",
                     world["resume_step"])
            return state
        # A newcomer, a promoted spare or a member a step behind: the source's copy reaches all in
        # one bit-exact broadcast (survivors offer their own copy, the others zeros of its shape).
        template = self.kept.state if self.kept.state is not None else trainer.host_state_template()
        source = world["source"]
        state = trainer.state_from_host(transfer.broadcast(template, is_source=source == self.host))
        log.info("adopted state from %s after step %d (%s)", source, world["resume_step"],
                 "own copy" if source == self.host else "from a peer, over the collective, not from disk")
        return state

    def _adopt_slices(self, trainer, world: dict):
        """`_adopt` with replica groups: a host holds only its slot's slices of its replica. Members
        that hold the resume step's slices place their own; otherwise every replica heals from the
        source group's (transfer.heal: slice by slice over `data`, no disk). Reports how it went --
        the seconds, and this host's peak device bytes during it over its shard of the state."""
        import jax
        from jax.experimental import multihost_utils

        from resilient_jax.elastic import transfer

        started = time.perf_counter()
        abstract = trainer.abstract_state()
        if set(world["members"]) <= set(world["holders"]):
            state = transfer.place_slices(self.kept.state, abstract)
            multihost_utils.sync_global_devices(f"resilient_jax.adopted.{self.generation}")
            how, peak = "own slices (every member holds its slot's)", None
        else:
            row = world["source_group"]
            mine = next(i for i, g in enumerate(world["groups"]) if self.host in g)
            holds = mine == row and self.host in world["holders"]
            if not holds:
                self.kept.state = None  # stale slices (an idle survivor's): gone before the new ones arrive
            peak = [0]

            def sample(_):
                peak[0] = max(peak[0], _device_bytes(jax.live_arrays()))

            state = transfer.heal(self.kept.state, abstract, trainer.mesh, row, holds_source=holds, on_leaf=sample)
            how = "source replica (offered its slices)" if holds else f"healed from replica {row} ({world['source']}'s group)"
        shard = _device_bytes(jax.tree.leaves(state))
        record = {"host": self.host, "generation": self.generation, "how": how,
                  "seconds": round(time.perf_counter() - started, 3), "state_shard_bytes": shard,
                  "peak_bytes": None if peak is None else peak[0],
                  "peak_over_shard": None if peak is None else round(peak[0] / shard, 3)}
        log.info("adopted state after step %d: %s in %.2f s%s", world["resume_step"], how, record["seconds"],
                 "" if peak is None else f"; peak device bytes {peak[0]:,} = {record['peak_over_shard']}x this host's "
                 f"shard of the state ({shard:,})")
        self.client.call("/adopted", retry_seconds=5, **record)
        return state

    def _announce_resume(self, trainer, resumed) -> None:
        """Rank 0: metrics.jsonl keeps one record per step from here (the steps after the checkpoint
        run again), the resume is logged as the single-process trainer logs it, and the controller
        is told (generation 0's event then says where the run resumed)."""
        metrics = self._metrics(trainer, resumed.step)
        for event in resumed.decision.events(resumed.path):
            metrics.event({**event, "dropped_metrics": self.metrics_dropped} if event["event"] == "resume" else event)
        for warning in resumed.decision.warnings:
            metrics.console(f"warning: {warning}")
        self.client.call("/resumed", retry_seconds=5, host=self.host, generation=self.generation, step=resumed.step,
                         checkpoint=str(resumed.path), config_changes=resumed.decision.config_changes)

    def _start_precompile(self, world: dict, members: list[str]) -> None:
        import jax

        from resilient_jax.elastic import precompile

        if not precompile.wanted(self.cfg.runtime.precompile_next_worlds, jax.devices()[0].platform, self.cache_on):
            return
        if len({world["devices_per_host"][h] for h in members}) > 1:
            log.info("generation %d: hosts with different device counts; the next worlds are not compiled ahead",
                     self.generation)
            return
        generation = self.generation

        def report(result: dict) -> None:
            self.client.call("/precompiled", retry_seconds=2, host=self.host, **result)

        self.precompiler = precompile.Precompiler(
            self.cfg, generation=generation, regions_by_rank=[world["regions"][h] for h in members],
            devices=jax.devices(), verified_dataset=self.verified_dataset,
            verified_eval_dataset=self.verified_eval_dataset, on_done=report, exported_dir=self._exported_dir())
        self.precompiler.start()

    def _leave(self, ckpt) -> None:
        from resilient_jax.elastic import world as world_lib

        if self.precompiler is not None:  # the backend must not be cleared under a compile
            waited = self.precompiler.stop()
            self.precompiler = None
            if waited > 0.5:
                log.info("waited %.2f s for the background compile in flight before leaving the world", waited)
        if ckpt is not None and self.life.state is State.LEAVING and self.life.leave_reason == "change":
            self._commit_before_leaving(ckpt)
        with self._world_lock:  # no abort may land on the next world's connections
            if self.coordinator_port is not None and self.life.state is State.LEAVING \
                    and self.life.leave_reason == "failure":
                # A failed world: abort what is left of its collectives ourselves (the controller's
                # verdict only reaches hosts still in it). A gloo operation still queued on a live
                # peer would otherwise run out its collective timeout inside the old backend's
                # destructor -- which runs, holding the GIL, wherever the old arrays are collected:
                # measured, the next world's compile on one survivor took 120 s (the timeout) instead of 3.
                n = world_lib.abort_collectives({self.coordinator_port, self.client.port})
                log.info("left a failed world: shut down this host's %d collective connections of generation %d",
                         n, self.generation)
            self.coordinator_port = None
        world_lib.leave(before_reset=None if ckpt is None else lambda: self._close_checkpoints(ckpt))

    def _close_checkpoints(self, ckpt) -> None:
        """Closes this world's checkpoint session, after its coordination client is shut down.

        A world left as planned, or at the run's end, closes it as usual. A failed world closes it
        with a deadline: a save in flight whose barrier the shutdown fails ends at once (its
        temporary directory removed); one whose orbax threads wait on a dead member's signals --
        rank 0's -- would wait out orbax's 300 s timeout, so it is abandoned (CheckpointStore.abandon)
        and the next world's store removes what it left."""
        stuck, self._unstuck = self._unstuck, None
        if stuck is None and not (self.life.state is State.LEAVING and self.life.leave_reason == "failure"):
            ckpt.close()
            return
        if stuck is None:
            stuck = threading.Thread(target=_quietly, args=(ckpt.wait,), name="checkpoint-wait", daemon=True)
            stuck.start()
        stuck.join(FAILED_SAVE_GRACE_SECONDS)
        if stuck.is_alive():
            ckpt.abandon()
            log.warning("left generation %d with its checkpoint save unfinished: abandoned (the next world "
                        "removes what it wrote)", self.generation)
        _quietly(ckpt.close)  # here, on the main thread: it restores signal handlers

    def _commit_before_leaving(self, ckpt) -> None:
        """A planned change (a join, a drain, a reslot: every member alive, all leaving at this
        boundary): the checkpoint save in flight commits before the world is left -- its barriers
        go through the coordination service, which leaving shuts down, and the save was lost. A
        verdict that a member died meanwhile (`abort`) ends the wait: then the save is lost, as in
        any failure, and the run goes on from the previous checkpoint."""
        from resilient_jax.checkpoint.store import CheckpointSaveError

        try:
            # The wait, not the close: closing restores signal handlers, which only the main thread may.
            self._unstuck = self._unless_aborted(ckpt.wait, "checkpoint-commit-before-leaving")
        except CheckpointSaveError as e:  # one line, already naming the step
            log.warning("leaving the world: %s", e)
            return
        if self._unstuck is not None:
            log.warning("a member died while the checkpoint in flight committed: leaving without it")

    def _unless_aborted(self, work, name: str) -> threading.Thread | None:
        """Runs `work()` on a thread named `name` and waits for it, unless the controller's verdict
        that a member of this world died (`abort`) comes first. None once `work` returned (its
        exception is raised here); else the thread, still running.

        For waits on the coordination service: an orbax save's barriers and commit go through it,
        and the verdict aborts the world's collectives, not those barriers -- a save in flight
        when a member dies would hold this host until orbax's own timeout (minutes). A thread left
        running is `_close_checkpoints`'s once the world is shut down: joined for a grace, else its
        save abandoned."""
        done, raised = threading.Event(), []

        def run() -> None:
            try:
                work()
            except BaseException as e:  # noqa: BLE001  (re-raised on the waiting thread)
                raised.append(e)
            finally:
                done.set()

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        while not done.wait(0.05):
            if self.coordinator_port is None and not done.is_set():
                return thread
        if raised:
            raise raised[0]
        return None

    def _verdict_within(self, seconds: float) -> bool:
        """Whether the controller's verdict that a member of this world died comes within `seconds`."""
        deadline = time.monotonic() + seconds
        while self.coordinator_port is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.coordinator_port is None

    def _steps(self, trainer, loop, state, step: int) -> tuple[Event, str]:
        """Run steps until the run ends or this world must be left; the event that ends the
        TRAINING state, and why. `step`: steps completed so far (the loop index of the next step)."""
        import jax
        from jax.experimental import multihost_utils

        from resilient_jax.elastic import world as world_lib
        from resilient_jax.trainer import StepLoop

        first = True
        self._finishing = False
        clock = self.heartbeat.clock
        total = self.cfg.train.steps
        shares = ShareKeeper.start(trainer, step)
        # The state this world starts from has `step` completed steps (restored from disk, or
        # adopted): a failure in its first step must report that, not an older world's count.
        self.kept.completed_step = step - 1
        self.heartbeat.step = step  # where this world starts (a resume from disk starts past 0)
        self._last_progress = None  # tokens/s windows do not span a re-formation
        first_of_world = True  # its timings carry warm-up: not planned from
        loop.on_eval = self._on_eval
        held = 0.0  # seconds the step's fault hooks held this host before the step started

        def before_step(k: int) -> None:  # after the evaluation: its seconds are neither ready time nor step
            nonlocal held
            ready_from = time.perf_counter()
            self.faults.before_step(k, clock, shares.share(), precompiled=self.heartbeat.precompiled)
            clock.started_at = time.perf_counter()
            held = clock.started_at - ready_from

        end = StepLoop.end_of(total, self.stop_at)  # the same step on every member
        try:
            for state, step in loop.run(state, step, end, before_step=before_step):
                clock.started_at = None
                seconds = loop.last_step_seconds
                clock.recent.append(seconds)
                self.kept.completed_step = step - 1  # the loop index of the step just run
                # Waiting for this host's input is host-side time, not time inside the step.
                data_wait = loop.last_data_wait
                ready, seconds_in_step = held + data_wait, seconds - data_wait
                self.heartbeat.record(step, ready, seconds_in_step, shares.mine())
                if first:
                    self.client.call("/progress", retry_seconds=5, host=self.host, generation=self.generation,
                                     step=step)
                    first = False
                self._report_progress(step, seconds, loop)
                # Change the world (growth, a reslot) or stop only when every member agrees, at the same boundary.
                stop = max(STOP_REASONS.index(self.heartbeat.stop_reason),
                           STOP_REASONS.index("preempted") if loop.preempted else 0)
                # The same all-gather carries every host's timings of this step: each host then plans
                # the next step's shard assignment from the same numbers (resilient_jax.assignment).
                signals = np.array([self.heartbeat.reform_signal, stop, *ShareKeeper.encode(ready, seconds_in_step),
                                    shares.mine()], np.int32)
                gathered = np.asarray(multihost_utils.process_allgather(signals)).reshape(-1, 5)
                agreed = gathered[:, :2].max(axis=0)
                planned_from = time.perf_counter()
                # No re-plan at a boundary where the world stops or changes (the next world starts uniform).
                decision = shares.observe(step, gathered[:, 2:], skip=first_of_world or bool(agreed.any()))
                first_of_world = False
                if decision is not None:
                    self._reassigned(decision, loop, step, started=planned_from)
                if agreed[1] and step < total:
                    return self._finish(trainer, loop, state, step, stopped=STOP_REASONS[int(agreed[1])])
                if agreed[0] > self.generation and step < total:
                    loop.flush_log()  # the steps since the last line, before this world's loop closes
                    self._keep(self._to_host(state), loop)
                    return Event.WORLD_CHANGE, f"the members agreed after step {step}"
            return self._finish(trainer, loop, state, step, stopped=StepLoop.stopped_at_end(step, total))
        except (jax.errors.JaxRuntimeError, world_lib.WorldAborted, world_lib.BarrierTimeout) as e:
            # WorldAborted, BarrierTimeout: a member died while the world compiled a program a step
            # needed (the exact sum's second pass, Trainer.compile_midrun).
            clock.started_at = None
            # compute() never donates: `state` is still the state after step `step`, on our devices.
            self._keep(self._to_host(state), loop)
            where = "the run's end" if self._finishing else f"step {step + 1}"
            return Event.STEP_FAILED, f"{where} in generation {self.generation}: {str(e).splitlines()[0][:200]}"

    def _reassigned(self, decision, loop, step: int, *, started: float) -> None:
        """Take the new assignment from the next step on (every member does, at the same step).

        The event's `replan_seconds`: planning and switching the loader to the new rows, on this
        host (the next step's re-read of its batch shows in that step's data wait, part of its
        ready time)."""
        import jax

        loop.set_layout(decision.device_counts, from_step=step)
        event = {**decision.to_event(self.members), "replan_seconds": round(time.perf_counter() - started, 6)}
        log.info("shards reassigned from step %d: %s -> %s (%s)", step + 1, list(decision.decision.old),
                 list(decision.decision.new), decision.decision.kind)
        if jax.process_index() == 0:
            loop.log.event({**event, "generation": self.generation})
            self.heartbeat.report_reassignment(event)  # with the next heartbeat: the step never waits

    def _finish(self, trainer, loop, state, step: int, *, stopped: str | None) -> tuple[Event, str]:
        """The last checkpoint (committed before returning), then the summary from rank 0."""
        import jax

        from resilient_jax.elastic import world as world_lib

        # The last checkpoint commits across the world, through the coordination service: a member
        # dying meanwhile fails this world like a step that failed (the survivors form the next
        # one, which has no step left to run and commits the checkpoint of the same step).
        self._finishing = True

        from resilient_jax.checkpoint.store import CheckpointSaveError

        def commit_unless_aborted(wait) -> None:
            died = world_lib.WorldAborted(f"a member of generation {self.generation} died while the checkpoint of "
                                          f"step {step} committed")
            try:
                self._unstuck = self._unless_aborted(wait, "final-checkpoint")
            except CheckpointSaveError as e:
                # A member's death can fail the save before the verdict names it (a barrier of the
                # dead task cancelled): wait for the verdict -- it comes with a heartbeat's reply --
                # before calling it the user's error. A world of one has no member to lose.
                runtime = self.cfg.runtime
                if len(self.members) > 1 and self._verdict_within(
                        runtime.dead_after_seconds + runtime.heartbeat_seconds + VERDICT_MARGIN_SECONDS):
                    raise died from e
                raise  # a full disk, a permission: one line, as in a single-process run
            if self._unstuck is not None:
                raise died

        if loop.ckpt is not None:
            loop.ckpt.await_commit = commit_unless_aborted
        loop.finish(state, step, stopped=stopped)
        summary = trainer.summarize(state, self.totals, time.perf_counter() - self.started, loop.data_position())
        summary.update(final_step=step, stopped=stopped, state_seconds=self.life.totals())
        if stopped:
            log.info("stopped (%s) at step %d with a checkpoint", stopped, step)
        if jax.process_index() == 0:
            self.faults.reporting(step)
            self.client.call("/done", retry_seconds=30, host=self.host, summary=summary,
                             reassignments=self.heartbeat.take_reassignments(), evals=self.heartbeat.take_evals())
        elif self._unless_aborted(self._await_run_reported, "run-end") is not None:
            # Rank 0 died before reporting the run's end. Had this host exited, the controller would
            # wait for members that are gone and fail a run whose final checkpoint is committed;
            # instead the survivors, holding the final state, form a world that reports it.
            raise world_lib.WorldAborted(f"a member of generation {self.generation} died before the run's end "
                                         "was reported")
        return (Event.STOPPED, f"{stopped} at step {step}") if stopped else (Event.FINISHED, f"step {step}")

    def _await_run_reported(self) -> None:
        """Returns once the controller holds rank 0's summary, or the run is over otherwise."""
        from resilient_jax.elastic.channel import ControllerError

        pause = 0.05
        while True:
            try:
                status = self.client.call("/status", method="GET", retry_seconds=60)
            except ControllerError as e:  # unreachable, or an answer that is not a status
                log.warning("no word from the controller before the run's end was reported: %s", e)
                return
            if status["finished"] or status["error"]:
                return
            # Rank 0 reports within a second or so on a small state; a large one's summary takes
            # longer, and every member asks: back off to one request a second per member.
            time.sleep(pause)
            pause = min(2 * pause, 1.0)

    def _on_eval(self, record) -> None:
        """An evaluation this world's loop ran: to the controller with the next heartbeat, and out
        of the tokens/s window (it counts training time, not evaluating)."""
        self.heartbeat.report_eval(record.to_event())
        if self._last_progress is not None:
            last_step, at = self._last_progress
            self._last_progress = (last_step, at + record.seconds)

    def _report_progress(self, step: int, seconds: float, loop) -> None:
        """Every train.log_every steps (and the first and last): loss and tokens/s over the window,
        for the driver's console."""
        cfg = self.cfg
        now = time.perf_counter()
        if step % cfg.train.log_every and step != cfg.train.steps and self._last_progress is not None:
            return
        tokens = cfg.data.global_batch * cfg.data.seq_len
        last = self._last_progress
        tokens_per_s = (tokens * (step - last[0]) / (now - last[1]) if last and step > last[0] and now > last[1]
                        else tokens / seconds)
        self._last_progress = (step, now)
        self.heartbeat.report_progress(step, float(loop.totals.last_loss), tokens_per_s)

    def _to_host(self, state):
        """This host's copy of the state in host memory: whole (a host holds whole replicas), or its
        own slices (a replica group of hosts: no host holds the whole)."""
        from resilient_jax.elastic import transfer

        return transfer.local_slices(state) if self.cfg.parallel.hosts_per_replica > 1 else transfer.to_host(state)

    def _keep(self, host_state, loop) -> None:
        self.kept.state = host_state
        self.kept.data_position = loop.position_at(self.kept.completed_step + 1).to_dict()

    def _metrics(self, trainer, start: int):
        """Rank 0 of the current world writes the run's metrics; it keeps its log across worlds."""
        import jax

        from resilient_jax.metrics import MetricsLog

        if jax.process_index() != 0:
            return MetricsLog(trainer.run_dir, self.cfg.train.steps, enabled=False)
        if self.metrics is None:
            trainer.write_run_config()
            # A new writer -- this invocation's first, or rank 0 changing hands -- opens at `start`:
            # MetricsLog drops the records of later steps (an earlier invocation's past its
            # checkpoint, or an old rank 0's) and purges them in TensorBoard: each step once.
            self.metrics = MetricsLog(trainer.run_dir, self.cfg.train.steps, progress="plain", start_step=start)
            self.metrics_dropped = self.metrics.dropped
        return self.metrics


def _quietly(call) -> None:
    """`call()` (a checkpoint session's wait or close) with its save's failure as one warning."""
    from resilient_jax.checkpoint.store import CheckpointSaveError

    try:
        call()
    except CheckpointSaveError as e:  # the failed world's save: one line, naming the step
        log.warning("leaving the world: %s", e)


def _device_bytes(arrays) -> int:
    """Bytes of this process's device buffers behind `arrays`, each buffer once: a shard's
    single-device view, or a host array aliasing a CPU buffer, is not counted twice."""
    seen: dict[tuple, int] = {}
    for a in arrays:
        for s in a.addressable_shards:
            seen[(s.device.id, s.data.unsafe_buffer_pointer())] = s.data.nbytes
    return sum(seen.values())


def _position_from_dict(d: dict | None):
    from resilient_jax.data import DataPosition

    return None if d is None else DataPosition.from_dict(d)


if __name__ == "__main__":
    sys.exit(main())
