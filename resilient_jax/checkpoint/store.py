"""CheckpointStore: one checkpoint root written through one orbax CheckpointManager.

A save commits in two stages, and only the second makes it a checkpoint:

1. ONE orbax Composite save of eight items -- the seven fields plus the manifest. Orbax writes
   `<step>.orbax-checkpoint-tmp.../` and renames it to `<step>/` once every item is written on
   every process.
2. Then, in orbax's finalize (its background thread for async saves; before old steps are deleted
   by retention), each process hashes the files it wrote with crc32c and writes
   `<step>/commit/process_<i>.json` atomically (`commit.py`). Readers list a step only when every
   process's commit file is there.

A process killed in stage 1 leaves a temporary directory, in stage 2 a step directory without its
commit files; no reader lists either and the next store removes both on open.

    weights, optimizer       StandardSave (OCDBT + zarr, each process writes its own shards)
    rng, data, config,       JsonSave (process 0 writes)
    topology, provenance
    manifest                 format version, array shapes/dtypes, per-context sha256 (process 0)

Asynchronous saves: `save` dispatches one copy of each unique shard of the state off the devices
(`snapshot.py`) and returns; the caller may then donate the state. Orbax's own save call -- its
barriers, directory creation, metadata and the copy to host numpy that it writes from -- runs on
the store's saver thread, so its fixed cost (0.1-0.2 s per save, mostly starting its writer
threads) is not paid by the training thread. With `write_priority="low"` the saver thread and the
threads it starts run at the lowest scheduling priority (`_yield_to_training`). At most one save
waits to start: a `save` while the previous one has not yet reached orbax waits for it. A failed
background write or commit (e.g. a full disk) surfaces as CheckpointSaveError at the next `save`,
`wait` or `close`, and its temporary or uncommitted directory is removed; committed steps are
never touched.

`save` must be called on every process with the same step (orbax synchronises them). With several
processes orbax's barriers go through the coordination service's key-value barriers
(`use_distributed_barriers`), not device collectives: a collective issued from the saver thread
could interleave with the training step's collectives in a different order on each process.
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import os
import re
import shutil
import sys
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from resilient_jax.checkpoint import checksums, commit, orbax_errors, reader, snapshot
from resilient_jax.checkpoint.reader import (
    ARRAY_FIELDS, CONTEXT_FIELDS, FIELDS, FORMAT_VERSION, MANIFEST, CheckpointError, json_sha256,
)


Context = dict[str, dict[str, Any]]  # the five context fields (context.py builds them)


def _check_context(context: Context) -> Context:
    missing = [name for name in CONTEXT_FIELDS if name not in context]
    if missing:
        raise ValueError(f"context lacks field(s) {', '.join(missing)}")
    return context


class CheckpointSaveError(RuntimeError):
    """A save that could not be completed; committed checkpoints are intact."""


orbax_errors.install_log_filters()


class _CommittingManager(ocp.CheckpointManager):
    """Orbax's manager plus stage 2 (see the module docstring): after orbax renamed the step into
    place (its finalize runs once the rename is visible to every process) and before retention
    deletes old steps, this process hashes its files and writes its commit file."""

    def __init__(self, directory, *, process: int, process_count: int,
                 unless_abandoned: Callable[[Callable[[], None]], None], **kwargs):
        """`process`, `process_count`: this world's, read when the store opened (a save abandoned
        with its world may still be finalizing when the next world has begun). `unless_abandoned(f)`:
        runs `f` unless the store was abandoned, excluding an abandon meanwhile."""
        self._process, self._process_count, self._unless_abandoned = process, process_count, unless_abandoned
        super().__init__(directory, **kwargs)
        # A private attribute of orbax's CheckpointManager (0.12.8): fail loudly if it moves.
        inner = getattr(self, "_checkpoint_deleter", None)
        if inner is None or not hasattr(inner, "delete"):
            raise RuntimeError("orbax.checkpoint.CheckpointManager has no _checkpoint_deleter any more: "
                               "resilient_jax.checkpoint.store._UncommitFirst must follow it")
        self._checkpoint_deleter = _UncommitFirst(inner, Path(directory), primary=process == 0)

    def reached_preemption(self, step: int) -> bool:
        # Preemption is ours to handle (preemption.PreemptionWatch, on the training thread, at every
        # step); orbax would ask JAX's preemption sync point again, for an older step and from the
        # saver thread. Our saves are forced, so its answer changed nothing but a log line.
        del step
        return False

    def _finalize_checkpoint(self, step: int):
        super()._finalize_checkpoint(step)
        self.check_for_errors()  # a failed item must not be committed (orbax only logs it here)
        step_dir = Path(self.directory) / str(step)
        # Hashing may take minutes on a large state; the commit file is written only if no abandon
        # came meanwhile: the next world may be saving the same step into this directory by then.
        doc = commit.build(step_dir, step, self._process, self._process_count)
        self._unless_abandoned(lambda: commit.write_built(step_dir, self._process, doc))


class _UncommitFirst:
    """Orbax's step deleter (retention, `delete`), made safe against a kill mid-delete: the step's
    process-0 commit file goes first, so the step is no longer listed (reader.list_steps) before
    any other file of it is removed. Deleting a directory is not atomic: a process killed inside
    orbax's removal once left an old step with its commit files but without its manifest and
    metadata -- listed, and failing verify. Now such a leftover is uncommitted, and the next store
    removes it on open like any other."""

    def __init__(self, inner, root: Path, *, primary: bool):
        self._inner, self._root, self._primary = inner, root, primary

    def delete(self, step: int) -> None:
        if self._primary:  # orbax deletes on its primary host, process 0
            commit.commit_file(self._root / str(step), 0).unlink(missing_ok=True)
        self._inner.delete(step)

    def delete_steps(self, steps: Sequence[int]) -> None:
        for step in steps:
            self.delete(step)

    def close(self) -> None:
        self._inner.close()


class _Retention:
    """Adapts `keep(steps) -> set` (SavePolicy.keep) to orbax's PreservationPolicy protocol, over
    the committed steps only. Orbax offers every numbered directory, checkpoints of format 1
    included: counted as steps, they would push the run's own checkpoints out ("the newest is never
    deleted" would protect one of them)."""

    def __init__(self, keep: Callable[[Sequence[int]], set[int]], root: Path, saving: Callable[[], int | None]):
        """`saving()`: the step being saved (orbax asks while it starts that save, before its commit)."""
        self._keep, self._root, self._saving = keep, root, saving

    def should_preserve(self, checkpoints, *, context):
        del context
        ours = set(reader.list_steps(self._root)) | {self._saving()}
        kept = self._keep([c.step for c in checkpoints if c.step in ours])
        return [c.step in kept or c.step not in ours for c in checkpoints]


# Orbax splits a replicated array into slices written by different replicas ("replica parallel").
# Across hosts that spreads the write bandwidth; inside one process it only adds a device slice per
# replica per array (~2 s of compiles on the first save of the tiny model, for nothing). So: only
# with several processes, and only for slices of at least this many bytes.
REPLICA_PARALLEL_MIN_SLICE_BYTES = 4 << 20


_configured_for: int | None = None


def use_distributed_barriers() -> None:
    """Orbax's barriers through the coordination service (see the module docstring). Its absl flag
    is read with `.value`, which refuses flags that were never parsed: parse just this one."""
    from absl import flags
    from orbax.checkpoint._src.multihost import multihost

    flag = flags.FLAGS[multihost.EXPERIMENTAL_ORBAX_USE_DISTRIBUTED_BARRIER.name]
    if not flag.value:
        flag.parse("true")


def configure_array_writes() -> None:
    """Registers orbax's jax.Array handler with the replica-parallel setting above (process-wide)."""
    global _configured_for
    from orbax.checkpoint._src.metadata import array_metadata_store

    if _configured_for == jax.process_count():
        return
    use_distributed_barriers()
    handler = ocp.type_handlers.ArrayHandler(
        array_metadata_store=array_metadata_store.Store(),
        use_replica_parallel=jax.process_count() > 1,
        min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_SLICE_BYTES,
        # No `_sharding` file (how the writer's mesh held each array): only a restore without target
        # shardings reads it, and ours always pass them (restore_arrays; any mesh). Writing it
        # serialised every array's sharding on threads of its own: a synchronous save of tiny took
        # 280-310 CPU-ms with it, 175-210 without, on the cores the next step needs.
        enable_write_sharding_file=False,
    )
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)  # orbax warns that it overrides its default; that is the point
    try:
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
    finally:
        absl_logger.setLevel(level)
    _configured_for = jax.process_count()


def world_temporary_path(generation: int):
    """Orbax's atomic-rename temporary path, named `<step>.orbax-checkpoint-tmp-g<generation>`.

    A save abandoned with its failed world (abandon) may still have writer threads finishing
    their files; with orbax's fixed name they would write into the next world's save of the same
    step -- the final checkpoint, re-saved by the survivors -- after its commit. Each world writes
    its own directory; the rename to `<step>` is orbax's (it cuts the name at the marker)."""
    base = ocp.path.atomicity.AtomicRenameTemporaryPath

    class WorldTemporaryPath(base):
        @classmethod
        def from_final(cls, final_path, **kwargs):
            name = f"{final_path.name}{ocp.path.atomicity.TMP_DIR_SUFFIX}-g{generation}"
            return cls(final_path.parent / name, final_path, **kwargs)

    return WorldTemporaryPath


WRITE_PRIORITIES = ("normal", "low")
SAVER_NICENESS = 19  # write_priority "low"


def _yield_to_training() -> None:
    """Runs on the saver thread as it starts (write_priority "low"): the lowest scheduling priority
    for it and for every thread it starts (Linux threads inherit their creator's niceness: orbax's
    commit thread, and tensorstore's writers when a save is the first to use them). Where the
    step's compute shares the host's cores (CPU devices), the background write then takes the
    cores the step leaves idle instead of a share of the step's: on 2 cores with tiny
    (bench_checkpoint), the step right after a save lost 21-27 ms at niceness 0 and 8-10 ms here.
    The price: on cores the step keeps busy the write barely runs, so a save commits late -- at
    the latest when the training thread waits for it (the save after next, `wait`, a preemption);
    with other processes on the cores too (a loaded CI machine), a step-10 checkpoint of a 20-step
    tiny run committed only after its last step. Hence not the default. A thread's niceness is its
    own on Linux only (elsewhere the call would renice the whole process); raising it needs no
    privilege, and the thread is never given its priority back (lowering it would)."""
    if sys.platform.startswith("linux"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SAVER_NICENESS)


def check_writable(root: Path) -> None:
    """Fails early (and by name) when the checkpoint directory cannot be written."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(root, "checkpoint.dir", f"is not writable ({e.strerror or e})") from None


def remove_temporary(root: Path) -> list[Path]:
    """Deletes leftovers of saves that never committed (either stage); returns what was removed."""
    removed = []
    for path in [*reader.temporary_dirs(root), *reader.uncommitted_dirs(root)]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class CheckpointStore:
    def __init__(self, root: str | Path, *, async_save: bool = True,
                 keep: Callable[[Sequence[int]], set[int]] | None = None, generation: int = 0,
                 write_priority: str = "normal"):
        """`generation`: the elastic world this store saves with (names its temporary directories).
        `write_priority`: "normal", or "low" for the background write (checkpoint.write_priority)."""
        if write_priority not in WRITE_PRIORITIES:
            raise ValueError(f"write_priority {write_priority!r}: one of {', '.join(WRITE_PRIORITIES)}")
        self.root = Path(root)
        check_writable(self.root)
        process = jax.process_index()  # read now: after an abandon, it is another world's
        self._primary = process == 0
        foreign = reader.foreign_dirs(self.root)
        if foreign:  # orbax would take it for a step: list it, and in time delete it
            raise CheckpointError(self.root, "checkpoint.dir", f"holds {foreign[0].name}/, a numbered directory that "
                                  "no checkpoint save wrote; checkpoints need a directory of their own: move it "
                                  "away, or set checkpoint.dir to another directory")
        if self._primary:
            # Orbax can also do this (cleanup_tmp_directories) but in the background; doing it here
            # means a store that opened has no leftovers, which the kill tests check.
            self.removed_temporary = remove_temporary(self.root)
        else:
            self.removed_temporary = []
        if jax.process_count() > 1:
            # No process lists the steps (orbax does, below) before process 0 has removed the
            # uncommitted ones: one that listed a step about to be removed would refuse to save it
            # again while the others waited for it. A collective, not a coordination-service
            # barrier: the controller's verdict ends it when a member dies meanwhile.
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("resilient_jax.checkpoint.store.cleaned")
        configure_array_writes()
        orbax_errors.quiet_abandoned_async_errors()
        handlers: dict[str, Any] = {name: ocp.StandardCheckpointHandler() for name in ARRAY_FIELDS}
        handlers.update({name: ocp.JsonCheckpointHandler(filename=f"{name}.json")
                         for name in (*CONTEXT_FIELDS, MANIFEST)})
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=async_save,
            # check_writable made the root on every process. Orbax's create=True would add a
            # coordination-service barrier to opening the store, and a member dying while a world
            # forms would hold every survivor in it for orbax's fixed 300 s barrier timeout (the
            # controller's verdict aborts collectives, not coordination-service barriers); the
            # ordering that barrier gave is the collective above.
            create=False,
            preservation_policy=(_Retention(keep, self.root, lambda: self._pending_step) if keep is not None
                                 else None),
            save_root_metadata=False,
            temporary_path_class=world_temporary_path(generation),
        )
        self._manager = _CommittingManager(self.root, process=process, process_count=jax.process_count(),
                                           unless_abandoned=self._unless_abandoned, options=options,
                                           item_handlers=handlers)
        self._pending_step: int | None = None
        self._async = async_save
        # Orbax's save call (see the module docstring), one at a time, in the order of `save`.
        self._saver = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="checkpoint-save",
            initializer=_yield_to_training if write_priority == "low" else None)
        self._starting: concurrent.futures.Future | None = None
        self._abandoned = False
        self._abandon_lock = threading.Lock()  # an abandon and a failed save's cleanup exclude each other

    # -- listing ------------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        return reader.list_steps(self.root)

    def reload(self) -> None:
        """Re-reads the step list after steps were moved by hand (orbax caches it)."""
        self._manager.reload()

    def step_dir(self, step: int) -> Path:
        return self.root / str(step)

    # -- saving ---------------------------------------------------------------------------------------

    def save(self, step: int, state, context: Context | Callable[[], Context]) -> None:
        """Starts saving `state` (a TrainState) and its context as step `step`. `context` is the five
        context dicts, or a function of no arguments that builds them: an asynchronous save calls
        it on the saver thread (building them costs the training thread ~0.5 ms, as much as the
        copies of a small state), so it must only read values fixed when `save` was called."""
        if not callable(context):
            _check_context(context)
        if self._abandoned:
            raise CheckpointSaveError(f"checkpoint save of step {step} to {self.root}: this store was abandoned "
                                      "with its world (a member died)")
        self._await_started()
        self._raise_failed_save()
        self._pending_step = step
        if self._async:
            # The one thing the training thread waits for: the copies off the devices.
            params, opt_state = snapshot.take(state.params), snapshot.take(state.opt_state)
            self._starting = self._saver.submit(
                lambda: self._orbax_save(step, type(state)(params=params.arrays(), opt_state=opt_state.arrays()),
                                         context))
            return
        try:
            self._orbax_save(step, state, context)
        except Exception as e:
            self._fail(step, e)

    def _orbax_save(self, step: int, state, context: Context | Callable[[], Context]) -> None:
        if callable(context):
            context = _check_context(context())
        args = ocp.args.Composite(
            weights=ocp.args.StandardSave(state.params),
            optimizer=ocp.args.StandardSave(state.opt_state),
            **{name: ocp.args.JsonSave(context[name]) for name in CONTEXT_FIELDS},
            **{MANIFEST: ocp.args.JsonSave(_manifest(step, state, context))},
        )
        self._manager.save(step, args=args, force=True)

    def abandon(self) -> None:
        """The processes this store saves with are no longer one world (a member died): a save in
        flight can never commit, and orbax's threads for it wait on the dead member's signals
        until orbax's own timeout (300 s). From now on nothing of this store waits for them or
        touches the directory -- not even to remove the save's temporary directory, which the
        next store opened on it removes (a late removal from here could hit that store's save of
        the same step). Thread-safe: another thread may be inside `wait` or `close`; it waits for a
        failed save's cleanup or a commit file's write in progress (milliseconds) to end."""
        with self._abandon_lock:
            self._abandoned = True

    def _unless_abandoned(self, work: Callable[[], None]) -> None:
        with self._abandon_lock:
            if not self._abandoned:
                work()

    def wait(self) -> None:
        """Blocks until the last save committed; raises CheckpointSaveError if it failed."""
        if self._abandoned:
            self._starting = self._pending_step = None
            return
        self._await_started()
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            self._fail(self._pending_step, e)
        self._pending_step = None

    def _await_started(self) -> None:
        """Waits until the saver thread has handed the last save to orbax; raises its error."""
        starting, self._starting = self._starting, None
        if starting is None:
            return
        try:
            starting.result()
        except Exception as e:
            self._fail(self._pending_step, e)

    def _take_failure(self) -> None:
        try:
            self._manager.wait_until_finished()
        except Exception:
            pass  # the failure being reported

    def _raise_failed_save(self) -> None:
        # orbax re-raises a background failure on the next call that waits; make it ours.
        try:
            self._manager.check_for_errors()
        except Exception as e:
            self._fail(self._pending_step, e)

    def _fail(self, step: int | None, error: BaseException) -> None:
        # The first failing item ends the save, but other items' writes may still be running and
        # would recreate the temporary directory after we removed it: let them finish first.
        abandoned = CheckpointSaveError(f"checkpoint save of step {step} to {self.root} was abandoned: a member of "
                                        f"its world died ({orbax_errors.first_line(error)})")
        if not self._abandoned:
            orbax_errors.join_background_writes()
        if self._abandoned:  # then or meanwhile: leave the directory to the next store
            self._pending_step = None
            raise abandoned from error
        # Orbax raises a failed background commit once per thread that waits for it: let the saver
        # thread take it now, or it would come back as the next save's failure.
        self._saver.submit(self._take_failure).result()
        with self._abandon_lock:  # not after an abandon: the next store may be saving into the root
            if self._abandoned:
                self._pending_step = None
                raise abandoned from error
            if self._primary:
                remove_temporary(self.root)
        self._manager.reload()  # orbax listed the step it renamed; it is gone again
        committed = self.steps()
        intact = (f"the newest committed checkpoint, step {committed[-1]}, is intact" if committed
                  else "no checkpoint was committed before")
        item = re.search(r"orbax-checkpoint-tmp[^/]*/(\w+)\.orbax-checkpoint-tmp", orbax_errors.failed_path(error))
        where = f" while writing {item.group(1)}" if item else ""
        if orbax_errors.is_disk_full(error):
            cause = f"no space left on device{where}"
        elif isinstance(error, OSError) and error.strerror:
            cause = f"{error.strerror}{where} ({error.filename})"
        else:
            cause = f"{orbax_errors.first_line(error)}{where}"
        self._pending_step = None
        raise CheckpointSaveError(f"checkpoint save of step {step} to {self.root} failed: {cause}; {intact}") from error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._abandoned:  # its saver thread may be held in a dead world's barrier
                self._saver.shutdown(wait=False, cancel_futures=True)
            else:
                self._saver.shutdown(wait=True)
                self._manager.close()

    # -- restoring ------------------------------------------------------------------------------------

    @staticmethod
    def restore_arrays(step_dir: str | Path, abstract_state, *, verify: bool = True):
        """The state saved in `step_dir`, laid out as `abstract_state` says (its shardings: reshards).

        `verify` first checks the crc32c of every file orbax reads for the two array fields (and
        the manifest); each array field is then restored on its own so that a failure names it.
        """
        step_dir = Path(step_dir)
        if verify:
            problems = reader.verify_files(step_dir, select=_read_by_restore)
            if problems:
                raise problems[0]
        manifest = reader.read_manifest(step_dir)
        orbax_errors.quiet_abandoned_async_errors()
        restored = {}
        for name, target in (("weights", abstract_state.params), ("optimizer", abstract_state.opt_state)):
            try:
                with ocp.StandardCheckpointer() as checkpointer:
                    restored[name] = checkpointer.restore((step_dir / name).resolve(), target)
            except Exception as e:  # orbax/tensorstore raise many types; all mean "unusable"
                gc.collect()  # finalize the sibling reads orbax abandoned now, while they are filtered
                raise _diagnose(step_dir, name, manifest, e) from None
        return type(abstract_state)(params=restored["weights"], opt_state=restored["optimizer"])


def _diagnose(step_dir: Path, name: str, manifest: dict[str, Any], error: Exception) -> CheckpointError:
    """Names the array orbax could not restore, by re-reading the field with the reference reader."""
    for array_name, entry in manifest["arrays"][name].items():
        try:
            reader.read_array(step_dir, name, array_name, entry)
        except CheckpointError as found:
            return found
    return CheckpointError(step_dir, name, f"could not be restored ({orbax_errors.first_line(error)})")


def _read_by_restore(relpath: str) -> bool:
    """The files a restore of the array fields reads: theirs and the manifest (the context fields
    are read, and checked, by `reader.read_context`)."""
    return reader.field_of(relpath) in (*ARRAY_FIELDS, MANIFEST)


def _manifest(step: int, state, context: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "fields": list(FIELDS),
        "process_count": jax.process_count(),
        "arrays": {"weights": checksums.manifest_entries(state.params),
                   "optimizer": checksums.manifest_entries(state.opt_state)},
        "context_sha256": {name: json_sha256(context[name]) for name in CONTEXT_FIELDS},
    }
