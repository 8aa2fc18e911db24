"""CheckpointSession: the trainer's one handle on checkpoints -- resume, save when due, stop, close.

    session = CheckpointSession(cfg, mesh, dataset_version, resume="latest")
    resumed = session.restore(abstract_state)         # None: start from scratch
    for step in range(start, end):
        ...train step...
        if session.after_step(step + 1, state, loader.position()):
            break                                        # preempted: saved, stop now
    session.finish(step, state, loader.position())       # final save, wait for commit, close

Which checkpoint a run continues from (`resume`):
    None      the newest in the checkpoint dir, if it holds any (automatic resume, unless
              checkpoint.enabled is false), else start fresh
    "latest"  the newest in the checkpoint dir; an error if there is none
    "STEP"    that step of the checkpoint dir
    PATH      a step directory, or another checkpoint root (its newest step)
A checkpoint with a field missing or corrupt is refused with the field named, and the newest
complete older one is offered. Resuming from an older step than the newest in the checkpoint dir
moves the newer ones into `<dir>/superseded/` (they belong to an abandoned future; nothing is
deleted), so the run can write its own steps again.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from resilient_jax.checkpoint import checksums, reader
from resilient_jax.checkpoint.context import (
    History, build_context, config_field, provenance_field, regions_of, rng_field,
)
from resilient_jax.checkpoint.policy import SavePolicy
from resilient_jax.checkpoint.preemption import PreemptionWatch
from resilient_jax.checkpoint.reader import CheckpointError
from resilient_jax.checkpoint.store import CheckpointStore
from resilient_jax.checkpoint.topology import build_topology
from resilient_jax.checkpoint.validate import ResumeDecision, check_resume, check_shapes
from resilient_jax.config import Config
from resilient_jax.data import DataPosition

SUPERSEDED = "superseded"


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.run.dir) / "checkpoints"


@dataclass
class Resumed:
    state: Any
    position: DataPosition
    path: Path
    decision: ResumeDecision

    @property
    def step(self) -> int:
        return self.position.step


@dataclass
class SessionStats:
    saves: list[int] = field(default_factory=list)
    save_call_seconds: list[float] = field(default_factory=list)  # time the training thread waited
    superseded: list[str] = field(default_factory=list)
    removed_temporary: list[str] = field(default_factory=list)


class CheckpointSession:
    def __init__(self, cfg: Config, mesh, dataset_version: str, *, resume: str | None = None,
                 allow_config_change: Sequence[str] = (), clock: Callable[[], float] = time.monotonic,
                 generation: int = 0, regions: dict[int, str] | None = None, interruptible: bool = False,
                 tokenizer_sha256: str = ""):
        """`interruptible`: Ctrl-C (SIGINT) stops at the next step boundary with a checkpoint, as
        SIGTERM does (see PreemptionWatch); for a single-process run in the foreground.
        `tokenizer_sha256`: the dataset's; a resume with another tokenizer is refused."""
        import jax

        self.cfg = cfg
        self.mesh = mesh
        self.dataset_version = dataset_version
        self.tokenizer_sha256 = tokenizer_sha256
        self.resume = resume
        self.allow_config_change = list(allow_config_change)
        self.generation = generation
        self.regions = regions
        self.root = checkpoint_root(cfg)
        self.policy = SavePolicy.from_config(cfg.checkpoint, clock)
        self.history = History()
        self.stats = SessionStats()
        self.is_primary = jax.process_index() == 0
        self._multi = jax.process_count() > 1
        self.store: CheckpointStore | None = None
        if cfg.checkpoint.enabled:
            self.store = CheckpointStore(self.root, async_save=cfg.checkpoint.async_save, keep=self.policy.keep,
                                         generation=generation, write_priority=cfg.checkpoint.write_priority)
            self.stats.removed_temporary = [str(p) for p in self.store.removed_temporary]
        self.preemption = PreemptionWatch(interruptible=interruptible)
        self._last_saved: int | None = None
        self._closed = False
        # Called with the step once a save has started (written in the background when async): a
        # hook for fault injection at that moment (resilient_jax.elastic.injection).
        self.on_save: Callable[[int], None] | None = None
        # How `finish` runs the final save up to its commit: called with a function that does it.
        # The elastic worker's runs it on a thread and stops waiting when a member of the world dies
        # (a save's barriers go through the coordination service, which aborting the world's
        # collectives does not end; a synchronous save has them all in the save call).
        self.await_commit: Callable[[Callable[[], None]], None] = lambda save_and_wait: save_and_wait()

    # -- resume ------------------------------------------------------------------------------------

    def _target(self) -> Path | None:
        """The step directory to resume from, or None to start fresh."""
        arg = self.resume
        if arg is None and not self.cfg.checkpoint.enabled:
            # Checkpoints off: no automatic resume (an explicit --resume still loads) -- and no fresh
            # start over a run that has checkpoints here either: it would retrain from step 0 and
            # rewrite that run's history and metrics in run.dir.
            steps = reader.list_steps(self.root) if self.root.is_dir() else []
            if steps:
                raise CheckpointError(self.root, "resume", f"checkpoint.enabled is false, but this directory holds "
                                      f"the run's checkpoints (newest step {steps[-1]}), which a fresh start would "
                                      "train over from step 0; pass --resume latest to continue without saving, "
                                      "set checkpoint.enabled=true, or pick another run.dir")
            return None
        if arg is None or arg == "latest":
            steps = reader.list_steps(self.root)
            if not steps:
                if arg == "latest":
                    raise CheckpointError(self.root, "resume", "--resume latest: the checkpoint dir holds no checkpoint")
                return None
            return self.root / str(steps[-1])
        if arg.isdigit():
            path = self.root / arg
            if not path.is_dir():
                steps = reader.list_steps(self.root)
                raise CheckpointError(path, "resume", f"no checkpoint at step {arg} (steps here: {steps or 'none'})")
            return path
        return reader.resolve(arg)

    def _offer(self, path: Path) -> str:
        step = int(path.name) if path.name.isdigit() else None
        older = reader.newest_complete(path.parent, below=step) if step is not None else None
        if older is None:
            return "no older complete checkpoint exists"
        return f"the newest complete checkpoint before it is step {older}: rerun with --resume {path.parent / str(older)}"

    def restore(self, abstract_state) -> Resumed | None:
        """Validate and restore the checkpoint to resume from (see the module docstring)."""
        path = self._target()
        if path is None:
            return None
        try:
            missing = reader.missing_field(path)
            if missing:
                raise CheckpointError(path, *missing)
            manifest = reader.read_manifest(path)
            saved = reader.read_context(path, manifest)
        except CheckpointError as e:
            raise CheckpointError(e.path, e.field, f"{e.problem}; {self._offer(path)}") from None
        position = DataPosition.from_dict(saved["data"])
        current = {
            "rng": rng_field(self.cfg.train.seed, position.step),
            "data": {"dataset_version": self.dataset_version, "tokenizer_sha256": self.tokenizer_sha256},
            "config": config_field(self.cfg),
            "topology": build_topology(self.mesh, generation=self.generation, regions=self.regions if self.regions is not None else regions_of(self.cfg)),
            "provenance": provenance_field(),
        }
        decision = check_resume(path, saved, current, self.allow_config_change)
        # Another model's weights: every checkpoint of the run has them, so no older one is offered.
        check_shapes(path, manifest, checksums.manifest_entries(abstract_state.params))
        try:
            state = CheckpointStore.restore_arrays(path, abstract_state, verify=self.cfg.checkpoint.verify_on_load)
        except CheckpointError as e:
            raise CheckpointError(e.path, e.field, f"{e.problem}; {self._offer(path)}") from None
        self.history = decision.history
        self._last_saved = position.step if self._in_root(path) else None
        self._supersede_newer(position.step)
        self.policy.start()
        return Resumed(state=state, position=position, path=path, decision=decision)

    def _in_root(self, path: Path) -> bool:
        return path.parent.resolve() == self.root.resolve()

    def _supersede_newer(self, step: int) -> None:
        if self.store is None:
            return
        newer = [s for s in self.store.steps() if s > step]
        if newer and self.is_primary:
            target = self.root / SUPERSEDED
            target.mkdir(exist_ok=True)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for s in newer:
                dest = target / f"{s}.{stamp}"
                (self.root / str(s)).rename(dest)
                self.stats.superseded.append(str(dest))
        self._sync("supersede")
        self.store.reload()

    def _sync(self, name: str) -> None:
        if self._multi:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"resilient_jax.checkpoint.{name}")

    # -- saving ------------------------------------------------------------------------------------

    def _agree(self, flag: bool) -> bool:
        """Process 0's decision, on every process (time-based decisions may differ per host)."""
        if not self._multi:
            return flag
        from jax.experimental import multihost_utils

        return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))

    def save(self, step: int, state, position: DataPosition, *, wait: bool = False) -> None:
        if self.store is None or step == self._last_saved or step in self.store.steps():
            return
        t0 = time.perf_counter()
        # Built on the saver thread from values fixed now (the history and regions are copied).
        context = functools.partial(build_context, self.cfg, self.mesh, position, self.history.copy(),
                                    generation=self.generation,
                                    regions=dict(self.regions) if self.regions is not None else None)
        self.store.save(step, state, context)
        if self.on_save is not None:
            self.on_save(step)
        if wait:
            self.store.wait()
        self.stats.save_call_seconds.append(time.perf_counter() - t0)
        self.stats.saves.append(step)
        self._last_saved = step
        self.policy.saved(step)

    @property
    def stop_reason(self) -> str | None:
        """Why the run stopped early: "preempted" (SIGTERM) or "interrupted" (Ctrl-C); None if not."""
        return self.preemption.reason

    def after_step(self, step: int, state, position: DataPosition) -> bool:
        """After `step` completed steps: save if due; True if preempted or interrupted (saved, stop now)."""
        if self.preemption.reached(step):
            self.save(step, state, position, wait=True)
            return True
        due = self.policy.due(step)
        if self.cfg.checkpoint.every_seconds:
            due = self._agree(due)
        if due:
            self.save(step, state, position)
        return False

    def finish(self, step: int, state, position: DataPosition) -> None:
        """The final checkpoint (if not already saved at `step`), committed before returning."""
        def save_and_wait() -> None:  # no signal handler in here: any thread may run it
            self.save(step, state, position)
            self.wait()

        self.await_commit(save_and_wait)
        self.close()

    def wait(self) -> None:
        """Until the save in flight, if any, has committed (CheckpointStore.wait). Unlike `close` it
        touches no signal handler, so any thread may call it."""
        if self.store is not None:
            self.store.wait()

    def abandon(self) -> None:
        """The world this session saves with has failed: see CheckpointStore.abandon."""
        if self.store is not None:
            self.store.abandon()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.preemption.close()
        if self.store is not None:
            self.store.close()

    def summary(self) -> dict[str, Any]:
        return {
            "dir": str(self.root) if self.store is not None else None,
            "saves": self.stats.saves,
            "save_call_seconds": [round(s, 4) for s in self.stats.save_call_seconds],
            "superseded": self.stats.superseded,
            "removed_temporary": self.stats.removed_temporary,
        }

