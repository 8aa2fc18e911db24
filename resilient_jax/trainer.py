"""The training loop: build everything from a Config, run steps, absorb NaN shards, write the summary.

One step, as the loop runs it:
    batch  = loader.next()                          this host's rows of global batch k
    result = compute(params, batch, k)              collectives; the state is not touched
    if some virtual shard is non-finite:            (fault class 4: a NaN data shard)
        quarantine the offending data shards from k, re-read step k, recompute
    elif the exact sum could have overflowed:       (rare; resilient_jax.reduce)
        recompute with exponents fixed in advance   (Compute.second_pass)
    state  = apply(state, result.grads, k)          local update; donates the old state

and before a step k at an eval boundary (and after the last), the held-out loss of the state after
k steps (resilient_jax.evaluation), which donates nothing either.
"""

from __future__ import annotations

import functools
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from resilient_jax import assignment as assignment_lib
from resilient_jax import compile_cache
from resilient_jax import data as data_lib
from resilient_jax import evaluation
from resilient_jax import exported as exported_lib
from resilient_jax import faults as faults_lib
from resilient_jax import flops as flops_lib
from resilient_jax import hierarchy
from resilient_jax import mesh as mesh_lib
from resilient_jax import plugins
from resilient_jax import state as state_lib
from resilient_jax import step as step_lib
from resilient_jax.checkpoint.session import CheckpointSession
from resilient_jax.config import DEFAULT_LOSS, Config, DataConfig
from resilient_jax.data.evalset import build_eval_set, check_held_out, holdout_quarantine
from resilient_jax.data.errors import named_as_config_keys
from resilient_jax.data.location import check_buildable, check_prepared_as_configured
from resilient_jax.fingerprinting import params_fingerprint
from resilient_jax.metrics import MetricsLog, StepWindow
from resilient_jax.model import count_params
from resilient_jax.optimizer import build_optimizer, lr_schedule
from resilient_jax.run_history import DONE, RunHistory

# A step that is still non-finite after this many quarantines is not a data problem.
MAX_QUARANTINES_PER_STEP = 4


# Names the compiles of a multi-process run apart (Trainer.compile_programs: the fresh state's and
# the step's share it); every process compiles the same programs in the same order, so the names agree.
_RUN_COMPILES = itertools.count()


class NonFiniteStepError(RuntimeError):
    """Gradients stayed non-finite after quarantining the data shards behind them."""


def resolve_dataset(cfg: DataConfig, verified: data_lib.Manifest | None = None,
                    model_vocab_size: int | None = None) -> data_lib.Manifest:
    """The configured dataset, built on first use (see data.location); verified against its manifest.

    `verified`: the manifest this process already verified in full (an elastic worker's earlier
    world). If the dataset still has that version, only the cheap identity checks run (manifest
    version, every shard present with its size) -- re-hashing every shard at each world formation
    would make recovery cost grow with the corpus. `model_vocab_size`: the built-in model's, named
    with the data keys when a prepared dataset's vocabulary is larger.
    """
    path = check_buildable(cfg)
    with named_as_config_keys():  # a data error names data.format, not prepare's --format
        check_prepared_as_configured(cfg, path, model_vocab_size)
        manifest = data_lib.ensure_dataset(path, src=cfg.src, shards=cfg.shards, seq_len=cfg.seq_len,
                                           tokenizer=cfg.tokenizer, fmt=cfg.format,
                                           text_field=cfg.text_field)  # loads the manifest and checks sizes
    if verified is not None and verified.root == manifest.root and verified.version == manifest.version:
        return manifest
    return data_lib.verify_dataset(path)


@dataclass
class QuarantineRecord:
    step: int  # the step index the loader uses: completed steps before the step that hit the shard
    shard: int
    samples: list[int]

    def to_dict(self) -> dict[str, Any]:
        # "step": the step (1-based, like every record) whose batch held the shard; "from_step":
        # the data.quarantine / loader index it is excluded from (= step - 1).
        return {"event": "quarantine", "step": self.step + 1, "from_step": self.step, "shard": self.shard,
                "samples": self.samples}


@dataclass
class RunTotals:
    """This process's figures for one invocation (a RunHistory adds up the whole run's)."""

    first_loss: float | None = None  # the first step this invocation ran
    last_loss: float | None = None
    train_seconds: float = 0.0  # inside steps; compiling is counted apart
    compile_seconds: float = 0.0
    data_wait_seconds: float = 0.0
    tokens: int = 0
    steps: int = 0
    quarantines: list[QuarantineRecord] = field(default_factory=list)
    evals: dict[int, evaluation.EvalRecord] = field(default_factory=dict)  # by step: one each
    eval_seconds: float = 0.0

    def record_step(self, loss: float, seconds: float, data_wait: float, tokens: int) -> None:
        if self.first_loss is None:
            self.first_loss = loss
        self.last_loss = loss
        self.train_seconds += seconds
        self.data_wait_seconds += data_wait
        self.tokens += tokens
        self.steps += 1

    def record_eval(self, record: evaluation.EvalRecord) -> None:
        self.evals[record.step] = record  # a re-evaluation after a resume replaces its twin
        self.eval_seconds += record.seconds


class Trainer:
    def __init__(self, cfg: Config, *, devices: list[jax.Device] | None = None, resume: str | None = None,
                 allow_config_change: list[str] = (), stop_at: int | None = None,
                 verified_dataset: data_lib.Manifest | None = None, regions: dict[int, str] | None = None,
                 hosts: int | None = None, verified_eval_dataset: data_lib.Manifest | None = None):
        """`resume`, `allow_config_change`: see resilient_jax.checkpoint.session; `stop_at`: stop (and
        checkpoint) after that many steps, as a preemption would; `verified_dataset`: see
        resolve_dataset (`verified_eval_dataset`: the same for eval.dataset); `regions`: each process's region (an elastic world), for the
        region-aware reduction (`parallel.cross_region`); `hosts`: the processes of the world this
        trainer is for (default: this one's; another for a trainer that only compiles the step of
        a world to come, see precompile_abstract)."""
        self.cfg = cfg
        self.resume = resume
        self.allow_config_change = list(allow_config_change)
        self.stop_at = stop_at
        self.faults = faults_lib.parse_faults(cfg.faults)
        self.mesh = mesh_lib.build_mesh(cfg.parallel, devices)
        # Slots for an uneven assignment wherever shards could move between hosts (see assignment.py),
        # whatever the policy: `uniform` then runs the same program, so a run that switches policy,
        # and the worlds of runs with either, share compiled programs.
        hosts = jax.process_count() if hosts is None else hosts
        self.assignment = assignment_lib.effective_policy(cfg.runtime.assignment, cfg.parallel.reduction, hosts)
        self.plan = step_lib.make_shard_plan(
            cfg.data.global_batch, cfg.parallel.virtual_shards, mesh_lib.grid_size(self.mesh),
            max_share=cfg.runtime.max_share if assignment_lib.shards_can_move(cfg.parallel.reduction, hosts) else 1.0,
        )
        self.layout = self.plan.layout()
        self._grid_processes = self._owners_of_grid()
        self.model_def = state_lib.make_model_def(cfg.model, cfg.task.import_dir)
        self.model_def.check_layout(dict(self.mesh.shape))  # before the dataset is hashed
        self.manifest = resolve_dataset(cfg.data, verified_dataset,
                                        cfg.model.vocab_size if self.model_def.builtin else None)
        # Held-out data (None: no evaluation); checked against the training data before any step.
        self.evalset = build_eval_set(cfg.eval, self.manifest, cfg.data.global_batch, verified_eval_dataset)
        if not self.model_def.builtin:
            self.model_def.check_output(cfg.data.seq_len, self.manifest.vocab_size)
        elif self.manifest.vocab_size > cfg.model.vocab_size:
            raise ValueError(
                f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the dataset's vocabulary "
                f"({self.manifest.vocab_size}); raise model.vocab_size"
            )
        loss_fn = plugins.load_callable(cfg.task.loss, "task.loss", cfg.task.import_dir)
        if cfg.task.loss != DEFAULT_LOSS:
            state_lib.check_loss(loss_fn, cfg.task.loss, cfg.data.seq_len,
                                 cfg.model.vocab_size if self.model_def.builtin else self.manifest.vocab_size)
        self.tx = build_optimizer(cfg.optimizer, cfg.train.steps)
        self.schedule = lr_schedule(cfg.optimizer, cfg.train.steps)
        self.shardings = state_lib.state_shardings(self.model_def, self.tx, self.mesh)
        # A model of your own always gets a dropout key (it may ignore it); the built-in only with dropout.
        use_dropout = cfg.model.dropout > 0 if self.model_def.builtin else True
        self.region_groups = self._region_groups(regions)
        self.compute = step_lib.make_compute(
            self.model_def, self.mesh, self.plan,
            seed=cfg.train.seed, mode=cfg.parallel.reduction, use_dropout=use_dropout, loss_fn=loss_fn,
            regions=self.region_groups,
        )
        self.apply = step_lib.make_apply(self.tx, self.schedule, self.shardings, self.mesh)
        # How a program needed in the middle of a run (the exact sum's second pass) is compiled:
        # compile(lower, what). The elastic worker sets its own (world.compile_world, ended by the
        # controller's verdict), so that the members of a world on one machine compile it once and
        # meet its first collective together.
        self.compile_midrun: Callable[[Callable[[], list], str], Any] = self.compile_programs
        self._second_pass_compiled = False
        self.evaluate = None if self.evalset is None else step_lib.make_evaluate(
            self.model_def, self.mesh, self.plan, seed=cfg.train.seed, loss_fn=loss_fn)
        self.run_dir = Path(cfg.run.dir)
        self.is_writer = jax.process_index() == 0

    def _region_groups(self, regions: dict[int, str] | None) -> hierarchy.RegionGroups | None:
        if self.cfg.parallel.cross_region == "flat" or not regions:
            return None
        by_data = hierarchy.data_regions(self.mesh.devices, regions)
        return hierarchy.plan(by_data) if by_data else None

    def reduction_order(self) -> str:
        """How the gradient sum crosses hosts and regions (for logs and events)."""
        return self.region_groups.describe() if self.region_groups else "flat"

    # -- batch placement ------------------------------------------------------------------------

    def grid_processes(self) -> list[int]:
        """The process of each device of the data x fsdp grid (data-major: grid device (d, f) = d*fsdp + f)."""
        return list(self._grid_processes)

    def _owners_of_grid(self) -> list[int]:
        fsdp = self.mesh.shape[mesh_lib.FSDP_AXIS]
        owner: dict[int, int] = {}
        for idx, d in np.ndenumerate(self.mesh.devices):
            owner.setdefault(idx[0] * fsdp + idx[1], d.process_index)
        return [owner[g] for g in range(len(owner))]

    def local_grid(self) -> list[int]:
        grid = [g for g, p in enumerate(self.grid_processes()) if p == jax.process_index()]
        if grid != list(range(grid[0], grid[-1] + 1)):
            raise ValueError(f"this process's devices are not contiguous on the data x fsdp grid ({grid}); "
                             "order parallel.data/fsdp so that each host's devices are adjacent")
        return grid

    def set_layout(self, device_counts: list[int] | None) -> None:
        """The shards each grid device computes from the next step on (None: the uniform layout)."""
        self.layout = self.plan.layout(device_counts)

    def local_rows(self) -> tuple[int, int]:
        """[lo, hi) of the global batch held by this process's devices under the current layout
        (contiguous: a host's devices are adjacent on the grid and hold consecutive shards)."""
        grid, b = self.local_grid(), self.plan.rows_per_shard
        first = int(self.layout.starts[grid[0]])
        end = int(self.layout.starts[grid[-1]] + self.layout.counts[grid[-1]])
        return first * b, end * b

    def _place(self, batch: data_lib.Batch, rows: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
        """Host rows -> global arrays: each local device's shards in its first slots; the other
        slots hold zeros (zero weights: a slot computed only to keep an fsdp group in step adds
        nothing)."""
        grid, C, b = self.local_grid(), self.plan.slots_per_device, self.plan.rows_per_shard
        tokens = np.zeros((len(grid) * C * b, batch.tokens.shape[1]), np.int32)
        weights = np.zeros((len(grid) * C * b, batch.weights.shape[1]), np.float32)
        lo, hi = rows
        if hi > lo:
            assert batch.tokens.shape[0] == hi - lo, (batch.tokens.shape, rows)
            for j, g in enumerate(grid):
                src, n = int(self.layout.starts[g]) * b - lo, int(self.layout.counts[g]) * b
                tokens[j * C * b:j * C * b + n] = batch.tokens[src:src + n]
                weights[j * C * b:j * C * b + n] = batch.weights[src:src + n]
        sharding = mesh_lib.batch_sharding(self.mesh)
        total = self.plan.padded_rows
        return (
            jax.make_array_from_process_local_data(sharding, tokens, (total, tokens.shape[1])),
            jax.make_array_from_process_local_data(sharding, weights, (total, weights.shape[1])),
        )

    def open_loader(self, start_step: int, quarantine=(),
                    position: data_lib.DataPosition | None = None) -> data_lib.HostBatchLoader:
        real_rows = self.local_rows()
        held_out = holdout_quarantine(len(self.manifest.shards), self.cfg.eval.holdout_shards)
        configured = tuple(data_lib.QuarantineEvent(q.shard, q.from_step) for q in self.cfg.data.quarantine)
        if position is not None:  # a resume: checks the dataset version and global batch too
            check_held_out(position.quarantine, held_out)
            position = position.with_quarantine(configured)  # a data.quarantine added since the checkpoint
            return data_lib.HostBatchLoader.from_position(
                self.manifest, position, seed=self.cfg.train.seed, global_batch=self.cfg.data.global_batch,
                rows=real_rows, prefetch=self.cfg.data.prefetch,
                poison=faults_lib.nan_shard_poison(self.faults),
            )
        return data_lib.HostBatchLoader(
            self.manifest,
            seed=self.cfg.train.seed,
            global_batch=self.cfg.data.global_batch,
            rows=real_rows,
            start_step=start_step,
            quarantine=tuple(quarantine) + configured + held_out,
            prefetch=self.cfg.data.prefetch,
            poison=faults_lib.nan_shard_poison(self.faults),
        )

    # -- one step ---------------------------------------------------------------------------------

    def compute_finite(self, params, loader: data_lib.HostBatchLoader, step: int, totals: RunTotals,
                       log: MetricsLog) -> step_lib.GradResult:
        """Compute step `step`'s gradients, quarantining data shards until every virtual shard is finite."""
        for _ in range(MAX_QUARANTINES_PER_STEP + 1):
            batch = next(loader)
            assert batch.step == step, (batch.step, step)
            tokens, weights = self._place(batch, self.local_rows())
            result = self.compute.first_pass(params, tokens, weights, np.int32(step), self.layout)
            # The step's one host readback: finiteness, loss and the exact sum's `fits` together (all
            # replicated: every process decides alike).
            shard_finite, loss, fits = jax.device_get((result.shard_finite, result.loss, result.fits))
            if shard_finite.all():
                if not fits:  # rare: the exact sum's second pass (its loss has the same bits)
                    result = self._second_pass(params, tokens, weights, step, totals, log)
                return result.replace(loss=loss)
            for record in self._quarantine(loader, step, shard_finite, np.asarray(result.row_finite)):
                totals.quarantines.append(record)
                log.event(record.to_dict())
        raise NonFiniteStepError(
            f"step {step}: gradients are still non-finite after quarantining {MAX_QUARANTINES_PER_STEP} data "
            "shards; the model itself diverged (lower optimizer.lr or check the data)"
        )

    def _second_pass(self, params, tokens, weights, step: int, totals: RunTotals, log) -> step_lib.GradResult:
        """Step `step` again with the exact sum's exponents fixed in advance (Compute.second_pass),
        its program compiled through `compile_midrun` the first time, and counted as compiling."""
        args = (params, tokens, weights, np.int32(step), self.layout)
        if not self._second_pass_compiled:
            compiled = compile_cache.timed_compile(
                lambda: self.compile_midrun(lambda: [self.compute.lower_second_pass(*args)], "second-pass"))
            self._second_pass_compiled = True
            totals.compile_seconds += compiled.seconds
            if log is not None:
                log.event({"event": "compile", "step": step, "program": "second pass", **compiled.to_event()})
        result = self.compute.second_pass(*args)
        if not bool(result.fits):  # cannot happen: the second pass's exponents leave room for every sum
            raise NonFiniteStepError(f"step {step}: the exact gradient sum overflowed even with exponents fixed "
                                     "in advance; report this with the run's config")
        return result

    def _quarantine(self, loader, step: int, shard_finite: np.ndarray, row_finite: np.ndarray):
        """Map non-finite virtual shards to data shards (the same answer on every host: the global
        order is computable everywhere) and quarantine them from this step on."""
        b = self.plan.rows_per_shard
        bad_rows = np.flatnonzero(~row_finite)
        if bad_rows.size == 0:
            # The loss was finite per sample but a gradient was not: blame every row of the shard.
            bad_rows = np.concatenate([np.arange(v * b, (v + 1) * b) for v in np.flatnonzero(~shard_finite)])
        sample_ids = data_lib.global_batch_ids(loader.order, step)[bad_rows]
        shard_ids = self.manifest.shard_of(sample_ids)
        records = []
        for shard in sorted(set(int(s) for s in shard_ids)):
            loader.quarantine(shard, step)
            samples = sorted(int(x) for x in sample_ids[shard_ids == shard])
            records.append(QuarantineRecord(step=step, shard=shard, samples=samples))
        return records

    # -- states ------------------------------------------------------------------------------------

    def fresh_state(self, compiler: Callable[[Callable[[], list]], Any] | None = None) -> state_lib.TrainState:
        """The state at step 0. Its program is compiled first by `compiler(lower)` (default:
        `compile_programs`), so that the members of a world on one machine compile it once."""
        init = state_lib.init_program(self.model_def, self.tx, self.mesh, self.cfg.train.seed)
        (compiler or functools.partial(self.compile_programs, what="init"))(lambda: [init.lower()])
        # The program just compiled, from JAX's in-memory cache: the call and `lower()` share one
        # lowering (with jax_enable_pgle, which this project never sets, the call would compile again).
        return init()

    def host_state_template(self) -> state_lib.TrainState:
        """Zeros shaped like the state, in host memory (what a newcomer offers to a broadcast)."""
        abstract = self.abstract_state()
        return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract)

    def evaluates_after(self, completed: int) -> bool:
        """Whether the state after `completed` steps is evaluated (eval.every_steps, the last step)."""
        cfg = self.cfg
        return self.evalset is not None and evaluation.due(completed, cfg.eval.every_steps, cfg.train.steps)

    def runs_a_program(self, start: int, end: int) -> bool:
        """Whether a loop from `start` completed steps to `end` runs any of this world's programs: a
        step, or the run's last evaluation (a loop that starts at the run's end evaluates it again:
        the world that ran the last step may have died before its evaluation was recorded)."""
        return start < end or (start >= self.cfg.train.steps and self.evaluates_after(start))

    def abstract_state(self) -> state_lib.TrainState:
        """The state's shapes, dtypes and shardings on this world's mesh, without allocating it."""
        return state_lib.abstract_state(self.model_def, self.tx, self.mesh)

    def state_from_host(self, host_state) -> state_lib.TrainState:
        """Place a full host copy of the state onto this world's mesh with the state's shardings.

        Every leaf must have the shape and dtype of this trainer's state: a leaf that changed shape on
        its way through host memory still holds the right values, but it compiles another program,
        and that program's bits need not be the fault-free run's.
        """
        def check(path, got, want):
            if (np.shape(got), np.result_type(got)) != (tuple(want.shape), np.dtype(want.dtype)):
                raise ValueError(f"state leaf {jax.tree_util.keystr(path)} is {np.result_type(got)}"
                                 f"{list(np.shape(got))}; this model's state has {np.dtype(want.dtype)}{list(want.shape)}")

        jax.tree_util.tree_map_with_path(check, host_state, self.abstract_state())
        return jax.tree.map(
            lambda x, sharding: jax.make_array_from_callback(x.shape, sharding, lambda index: x[index]),
            host_state, self.shardings,
        )

    def compile_programs(self, lower: Callable[[], list], what: str) -> None:
        """Compile the programs `lower()` returns (traced and lowered) for this trainer's mesh.

        A multi-process run outside the elastic runtime compiles through world.compile_world: on
        one machine rank 0 compiles and the others load its programs from the persistent cache. No
        controller here: a process that dies ends the run, as it always did. `what` names the
        programs; every process compiles the same ones in the same order."""
        processes = len({d.process_index for d in self.mesh.devices.flat})
        if processes == 1 or processes != jax.process_count():
            compile_cache.compile_all(lower())
            return
        from resilient_jax.elastic import world as world_lib

        world_lib.compile_world(lower, f"{what}-{next(_RUN_COMPILES)}", jax.process_index(), processes,
                                self.mesh.devices.flat[0].platform)

    def precompile(self, state: state_lib.TrainState) -> None:
        """Compile compute and apply for this world without running them (no collective runs).

        Members of a new world compile at different speeds; compiling first and then meeting at a
        barrier keeps that skew out of the first collective, whose wait is bounded by a timeout.
        """
        compile_cache.compile_all(self.lowered(state))

    def lowered(self, state: state_lib.TrainState) -> list:
        """This world's programs (compute, apply, and evaluate if any) traced and lowered, not yet
        compiled: `precompile` compiles them."""
        args = self._program_args(state)
        lowered = [self.compute.lower(*args["compute"]), self.apply.lower(*args["apply"])]
        if self.evaluate is not None:
            lowered.append(self.evaluate.lower(*args["evaluate"]))
        return lowered

    def _program_args(self, state: state_lib.TrainState) -> dict[str, tuple]:
        """Each program's arguments: `state`'s, and the batch's shapes and shardings."""
        batch = mesh_lib.batch_sharding(self.mesh)
        rows, seq = self.plan.padded_rows, self.cfg.data.seq_len
        tokens = jax.ShapeDtypeStruct((rows, seq + 1), np.int32, sharding=batch)
        weights = jax.ShapeDtypeStruct((rows, seq), np.float32, sharding=batch)
        grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state.params)
        layout = self.plan.layout()  # arrays: every layout runs the same program
        args = {"compute": (state.params, tokens, weights, np.int32(0), layout),
                "apply": (state, grads, np.int32(0))}
        if self.evaluate is not None:
            args["evaluate"] = (state.params, tokens, weights, np.int32(0), layout)
        return args

    def export_programs(self) -> dict:
        """This world's programs, exported (resilient_jax.exported): traced and lowered from the
        state's shapes alone, not compiled; for a later world of the same shape (`use_exported`)."""
        args = self._program_args(self.abstract_state())
        jitted = {"compute": self.compute.jitted, "apply": self.apply,
                  "evaluate": None if self.evaluate is None else self.evaluate.jitted}
        return {name: exported_lib.export(jitted[name], program_args) for name, program_args in args.items()}

    def exported_calls(self, programs: dict) -> dict:
        """`programs` (what `export_programs` made for a world of this shape) as this trainer's
        calls, each checked against the arrays this world passes it; ValueError (KeyError: one is
        missing) if they do not fit. Nothing changes until `use_exported`."""
        state = self.abstract_state()
        zero = np.int32(0)
        templates = {
            "compute": step_lib.GradResult(grads=state.params, loss=zero, shard_loss=zero, shard_finite=zero,
                                           row_finite=zero, passes=zero, fits=zero),
            "apply": (state, step_lib.ApplyMetrics(grad_norm=zero, lr=zero)),
            "evaluate": step_lib.EvalResult(shard_loss=zero, shard_weight=zero),
        }
        devices = len(self.mesh.devices.flat)
        calls = {}
        for name, args in self._program_args(state).items():
            calls[name] = exported_lib.ExportedCall(
                programs[name], templates[name], donate=exported_lib.donated_leaves(state) if name == "apply" else ())
            calls[name].check(args, devices)
        return calls

    def use_exported(self, calls: dict) -> None:
        """Run this world's step through `calls` (`exported_calls`) instead of tracing the model:
        the modules that tracing it lowers, so the same bits."""
        self.compute.jitted, self.apply = calls["compute"], calls["apply"]
        if self.evaluate is not None:
            self.evaluate.jitted = calls["evaluate"]

    def precompile_abstract(self) -> None:
        """`precompile` from the state's shapes and shardings alone: for a world that does not exist
        yet (its cache entries are what matter), nothing is allocated."""
        self.precompile(self.abstract_state())

    def checkpoints(self, *, generation: int = 0, regions: dict[int, str] | None = None,
                    interruptible: bool = False) -> CheckpointSession:
        return CheckpointSession(self.cfg, self.mesh, self.manifest.version, resume=self.resume,
                                 allow_config_change=self.allow_config_change, generation=generation,
                                 regions=regions, interruptible=interruptible,
                                 tokenizer_sha256=self.manifest.tokenizer_sha256)

    def restore(self, ckpt: CheckpointSession):
        """The checkpoint to resume from (validated), or None; closes `ckpt` if that fails."""
        try:
            return ckpt.restore(self.abstract_state())
        except BaseException:
            ckpt.close()
            raise

    def write_run_config(self) -> None:
        if self.is_writer:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(
                json.dumps({"config_hash": self.cfg.hash, "config": self.cfg.to_dict()}, indent=2, sort_keys=True)
            )

    def banner(self) -> str:
        return (f"resilient_jax: config {self.cfg.hash} | dataset {self.manifest.version[:16]} | "
                f"mesh {dict(self.mesh.shape)} | {self.plan.num_shards} virtual shards ({self.cfg.parallel.reduction}, "
                f"{self.reduction_order()})")

    # -- the run ------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """A single-world run: resume if there is a checkpoint, train to the end (or a stop), summarise."""
        cfg = self.cfg
        start_wall = time.perf_counter()
        ckpt = self.checkpoints(interruptible=True)  # Ctrl-C: checkpoint at the step boundary, stop
        resumed = self.restore(ckpt)
        # After the resume is accepted: a refused config change leaves the run's config.json as it was.
        self.write_run_config()
        start = resumed.step if resumed else 0
        try:
            history = RunHistory.load(self.run_dir, enabled=self.is_writer)
            # With several processes, making it waits on the others (compile_programs).
            state = resumed.state if resumed else self.fresh_state()
        except BaseException:
            ckpt.close()
            raise
        # Steps after the checkpoint run again: MetricsLog keeps one record per step of them.
        log = MetricsLog(self.run_dir, cfg.train.steps, progress=cfg.run.progress, start_step=start,
                         enabled=self.is_writer)
        log.console(self.banner())
        history.begin(start, resumed.path if resumed else None, started=start_wall)
        if resumed:
            for event in resumed.decision.events(resumed.path):
                if event["event"] == "resume":
                    last = history.resumes()[-1]
                    event = {**event, "dropped_metrics": log.dropped, "after": last["reason"],
                             "steps_lost": last["steps_lost"]}
                log.event(event)
            for warning in resumed.decision.warnings:
                log.console(f"warning: {warning}")
        loop = StepLoop(self, log, RunTotals(), ckpt, start_step=start,
                        position=resumed.position if resumed else None, history=history)
        end = StepLoop.end_of(cfg.train.steps, self.stop_at)
        step = start
        stopped = None
        try:
            if self.runs_a_program(step, end):
                loop.compile(state)
            for state, step in loop.run(state, step, end):
                # SIGTERM / Ctrl-C: the checkpoint of this step is being written. One that lands in
                # the last step stops nothing: the run is complete (its last evaluation runs), as the
                # elastic worker decides at its boundaries too.
                if loop.preempted and step < cfg.train.steps:
                    stopped = ckpt.stop_reason or "preempted"
                    break
            else:
                stopped = StepLoop.stopped_at_end(step, cfg.train.steps)
            loop.finish(state, step, stopped=stopped)
            # Only now is the stop clean: the checkpoint of `step` is committed.
            history.end(DONE if step == cfg.train.steps else stopped)
        except BaseException:
            history.save()  # the wall seconds so far; `ended` stays None: the next resume is a restart
            raise
        finally:
            loop.close()
            ckpt.close()
        summary = self.summarize(state, loop.totals, time.perf_counter() - start_wall, loop.data_position(),
                                 history=history)
        summary.update(final_step=step, stopped=stopped, checkpoint=ckpt.summary())
        if self.is_writer:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
        log.close()  # the bar first: the last line stands on its own
        log.console(self.closing_line(summary))
        return summary

    @staticmethod
    def closing_line(summary: dict[str, Any]) -> str:
        stopped = summary.get("stopped")
        if stopped in ("interrupted", "preempted"):
            # A signal is a pause, not an end: one line that says how to go on (the figures are in
            # summary.json).
            return f"stopped ({stopped}) at step {summary['final_step']}; rerun the same command to continue"
        losses = (f"loss {summary['first_loss']:.4f} (step 1) -> {summary['final_loss']:.4f}"
                  if summary["first_loss"] is not None and summary["final_loss"] is not None else
                  "no steps left to run" if summary["final_loss"] is None else f"loss {summary['final_loss']:.4f}")
        tps = summary.get("tokens_per_second")
        mfu = summary.get("mfu")
        last_eval = (summary.get("eval") or {}).get("last")
        if last_eval is not None:
            losses += f" | eval loss {last_eval['loss']:.4f} (step {last_eval['step']})"
        return (f"{'stopped (' + stopped + ')' if stopped else 'done'}: step {summary['final_step']} {losses} | "
                f"{'-' if tps is None else f'{tps:,.0f}'} tokens/s"
                f"{'' if mfu is None else f', MFU {mfu:.1%}'} | compile {summary['compile_seconds']:.1f} s | "
                f"fingerprint {summary['params_fingerprint'][:16]} | {summary['invocation_wall_seconds']:.1f} s"
                f" ({summary['wall_seconds']:.1f} s over {summary.get('invocations', 1)} invocation(s))")

    def summarize(self, state, totals: RunTotals, wall: float, position,
                  history: RunHistory | None = None) -> dict[str, Any]:
        """summary.json fields (collective when params span processes: call on every process).

        With a `history` the run's figures span every invocation (see resilient_jax.run_history);
        without one (an elastic worker, whose controller adds restarts and steps lost) they are
        this process's.
        """
        cfg = self.cfg
        if history is not None:
            run = history.totals()
        else:
            run = {"first_loss": totals.first_loss, "wall_seconds": wall, "train_seconds": totals.train_seconds,
                   "compile_seconds": totals.compile_seconds, "data_wait_seconds": totals.data_wait_seconds,
                   "tokens": totals.tokens, "final_loss": totals.last_loss}
        tokens_per_second = run["tokens"] / run["train_seconds"] if run["train_seconds"] > 0 else None
        throughput = Throughput.of(self)
        flops_per_second = throughput.flops_per_token * tokens_per_second if tokens_per_second else None
        return {
            **run,
            "final_step": cfg.train.steps,
            "invocation_wall_seconds": wall,
            "tokens_per_second": tokens_per_second,
            "flops_per_token": throughput.flops_per_token,
            "model_flops_per_second": flops_per_second,
            "mfu": flops_lib.mfu(flops_per_second, throughput.peak_per_device, throughput.devices),
            "peak_flops_per_device": throughput.peak_per_device,
            "device_kind": throughput.device_kind,
            "device_memory_bytes_in_use": flops_lib.device_memory_in_use(throughput.local_devices),
            "config_hash": cfg.hash,
            "dataset_version": self.manifest.version,
            "params_fingerprint": params_fingerprint(state.params),
            "num_params": count_params(state.params),
            "mesh": dict(self.mesh.shape),
            "processes": jax.process_count(),
            "reduction": cfg.parallel.reduction,
            "virtual_shards": cfg.parallel.virtual_shards,
            "faults_injected": [str(f) for f in self.faults],
            "quarantined_shards": sorted({q.shard for q in totals.quarantines}),
            "quarantine_events": [q.to_dict() for q in totals.quarantines],
            "data_position": position.to_dict(),
            "eval": self.eval_summary(totals),
        }

    def eval_summary(self, totals: RunTotals) -> dict[str, Any] | None:
        """summary.json's `eval`: the eval set, the last evaluation and every one this process ran
        (None without evaluation)."""
        if self.evalset is None:
            return None
        records = [totals.evals[k].to_event() for k in sorted(totals.evals)]
        return {**self.evalset.describe(), "every_steps": self.cfg.eval.every_steps,
                "last": records[-1] if records else None, "history": records, "seconds": totals.eval_seconds}


@dataclass(frozen=True)
class Throughput:
    """What turns tokens/s into FLOP/s and MFU for this world (see resilient_jax.flops)."""

    flops_per_token: float
    peak_per_device: float | None
    devices: int
    device_kind: str
    local_devices: tuple

    @classmethod
    def of(cls, trainer: Trainer) -> Throughput:
        cfg, devices = trainer.cfg, list(trainer.mesh.devices.flat)
        kind = devices[0].device_kind
        if trainer.model_def.builtin:
            per_token = flops_lib.flops_per_token(cfg.model, cfg.data.seq_len)
        else:
            params = trainer.model_def.abstract_params
            per_token = flops_lib.dense_flops_per_token(count_params(params))
        return cls(flops_per_token=per_token,
                   peak_per_device=flops_lib.peak_flops(kind, cfg.model.dtype, cfg.run.peak_flops),
                   devices=len(devices), device_kind=kind,
                   local_devices=tuple(d for d in devices if d.process_index == jax.process_index()))


class StepLoop:
    """One world's training loop state: this host's loader, metrics, running totals, checkpoints.

    `step(state, k)` is one full step -- load, compute (quarantining NaN shards), apply, log, and
    save if due -- taking the state from k to k+1 completed steps; it is logged and checkpointed as
    step k+1 (the project's step numbers: step k brings the run to k completed steps). A
    collective failure raises out of `compute` before `apply`, so the caller still holds the state
    after k steps.

    `run` and `finish` are the run loop itself, the same for a single-process run (Trainer.run) and
    for every world of an elastic run (elastic.worker): evaluate when due, step, hand each boundary
    to the caller; at the end the last evaluation, the last log line and the final checkpoint.
    What differs between the two is only what the caller decides at a boundary.
    """

    def __init__(self, trainer: Trainer, log: MetricsLog, totals: RunTotals, ckpt: CheckpointSession | None, *,
                 start_step: int, position: data_lib.DataPosition | None = None,
                 history: RunHistory | None = None):
        self.trainer, self.log, self.totals, self.ckpt = trainer, log, totals, ckpt
        self.history = history
        self.loader = trainer.open_loader(start_step=start_step, position=position)
        self.preempted = False
        cfg = trainer.cfg
        self.tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
        self.throughput = Throughput.of(trainer)
        self.window = StepWindow()
        self.completed = start_step
        self._applied = None
        self.evaluator = None if trainer.evalset is None else evaluation.Evaluator(trainer)
        self.on_eval: Callable[[evaluation.EvalRecord], None] | None = None  # the elastic worker reports it
        self.last_step_seconds = 0.0  # the latest step() call, whole: load, compute, apply, log, save if due
        self.last_data_wait = 0.0  # of which waiting for this host's input

    @staticmethod
    def end_of(total: int, stop_at: int | None) -> int:
        """The completed-step count this invocation trains to: the run's steps, or --stop-at's."""
        return total if stop_at is None else min(stop_at, total)

    @staticmethod
    def stopped_at_end(step: int, total: int) -> str | None:
        """Why a loop that ran to its end stopped: "stop_at" short of the run's steps, else None
        (the run is complete, even where --stop-at named an earlier step)."""
        return "stop_at" if step < total else None

    def run(self, state, step: int, end: int, *, before_step: Callable[[int], None] | None = None):
        """Train from `step` completed steps to `end`: evaluate the state first where due, then
        `before_step(k)` (the elastic worker's fault hooks and timings), then the step. Yields
        (state, completed steps) at every step boundary, where the caller decides: go on, or stop
        the iteration (a preemption checkpoint, the members' agreement to stop or re-form). The
        caller always holds the newest state it was given, so a step that raises (a dead peer)
        leaves it the state of the last boundary, never one half-applied."""
        while step < end:
            self.evaluate_if_due(state, step)  # before the step: a run that resumes at an eval step evaluates it
            if before_step is not None:
                before_step(step)
            state = self.step(state, step)
            step += 1
            yield state, step

    def finish(self, state, step: int, *, stopped: str | None) -> None:
        """The end of an invocation: the last step's evaluation (a run that ends early, stopped,
        leaves it to the rerun that reaches it), its last log line, and its final checkpoint,
        committed before this returns."""
        if stopped is None:
            self.evaluate_if_due(state, step)
        self.flush_log()
        if self.ckpt is not None:
            self.ckpt.finish(step, state, self.data_position())

    def eval_due(self, completed: int) -> bool:
        return self.trainer.evaluates_after(completed)

    def evaluate_if_due(self, state, completed: int) -> evaluation.EvalRecord | None:
        """Evaluate the state after `completed` steps if it is an eval step (every member of a world
        calls this at the same boundaries: the forward pass is a collective). Donates nothing: a
        collective failing here leaves `state` as it was."""
        if not self.eval_due(completed):
            return None
        record = self.evaluator.run(state.params, completed)
        self.totals.record_eval(record)
        self.log.eval(record.to_event())
        if self.on_eval is not None:
            self.on_eval(record)
        return record

    def compile(self, state) -> float:
        """Compile this world's step before the first one runs, so compiling is reported as
        compile_seconds and never as a slow step."""
        compiled = compile_cache.timed_compile(
            lambda: self.trainer.compile_programs(lambda: self.trainer.lowered(state), "run"))
        self.totals.compile_seconds += compiled.seconds
        if self.history is not None:
            self.history.compiled(compiled.seconds)
        self.log.event({"event": "compile", "step": self.completed, **compiled.to_event()})
        return compiled.seconds

    def step(self, state, step: int):
        cfg, totals = self.trainer.cfg, self.totals
        waited = self.loader.wait_seconds
        t0 = time.perf_counter()
        result = self.trainer.compute_finite(state.params, self.loader, step, totals, self.log)
        state, applied = self.trainer.apply(state, result.grads, np.int32(step))
        loss = float(result.loss)
        seconds = time.perf_counter() - t0
        data_wait = self.loader.wait_seconds - waited
        done = self.completed = step + 1
        totals.record_step(loss, seconds, data_wait, self.tokens_per_step)
        if self.history is not None:
            self.history.step_done(done, loss, seconds, data_wait, self.tokens_per_step)
        self.window.add(loss, seconds, data_wait)
        self._applied = applied
        if done == 1 or done % cfg.train.log_every == 0 or done == cfg.train.steps:
            self.flush_log()
        self.log.advance()
        if self.ckpt is not None and self.ckpt.after_step(done, state, self.loader.position()):
            self.preempted = True
        self.last_step_seconds = time.perf_counter() - t0
        self.last_data_wait = min(data_wait, self.last_step_seconds)
        return state

    def set_layout(self, device_counts: list[int], from_step: int) -> None:
        """Hold another set of shards from step `from_step` on: the loader re-reads from there with
        this host's new rows (batches read ahead for the old rows are dropped)."""
        self.trainer.set_layout(device_counts)
        self.loader.reassign(self.trainer.local_rows(), from_step)

    def flush_log(self) -> None:
        """Log the steps since the last line as one line for the latest step (a no-op if none)."""
        if not len(self.window):
            return
        values = self.window.values(self.tokens_per_step)
        throughput = self.throughput
        flops_per_second = (throughput.flops_per_token * values["tokens_per_s"]) if values["tokens_per_s"] else None
        self.log.log(self.completed, {
            **values,
            "lr": float(self._applied.lr),
            "grad_norm": float(self._applied.grad_norm),
            "flops_per_token": throughput.flops_per_token,
            "flops_per_s": flops_per_second,
            "mfu": flops_lib.mfu(flops_per_second, throughput.peak_per_device, throughput.devices),
            "memory_bytes_in_use": flops_lib.device_memory_in_use(throughput.local_devices),
        })
        self.window = StepWindow()

    def data_position(self) -> data_lib.DataPosition:
        return self.loader.position()

    def position_at(self, step: int) -> data_lib.DataPosition:
        """The data position of a state that has completed `step` steps (the loader may be ahead)."""
        return data_lib.DataPosition.at(self.loader.order, self.trainer.manifest.version, step,
                                        self.trainer.manifest.tokenizer_sha256)

    def close(self) -> None:
        self.loader.close()
        if self.evaluator is not None:
            self.evaluator.close()
