"""A world's step exported once and called by a later trainer of the same shape
(resilient_jax.exported): the same bits, the model not traced again, bad stores refused."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from resilient_jax import exported
from resilient_jax import state as state_lib
from resilient_jax.fingerprinting import params_fingerprint
from resilient_jax.metrics import MetricsLog
from resilient_jax.trainer import RunTotals, Trainer

from conftest import tiny_config

DEVICES = 6  # a world of 3 hosts x 2 devices, as cpu-4host's after a death


def _train(trainer: Trainer, steps: int, tmp_path) -> tuple[str, float]:
    state = state_lib.init_state(trainer.model_def, trainer.tx, trainer.mesh, trainer.cfg.train.seed)
    loader = trainer.open_loader(start_step=0)
    totals, log = RunTotals(), MetricsLog(tmp_path, steps, enabled=False)
    try:
        for step in range(steps):
            result = trainer.compute_finite(state.params, loader, step, totals, log)
            state, _ = trainer.apply(state, result.grads, np.int32(step))  # donates the state
    finally:
        loader.close()
    return params_fingerprint(state.params), float(result.loss)


@pytest.mark.parametrize("layout", [[], ["parallel.tensor=2"]], ids=["data", "tensor"])
def test_a_trainer_calling_the_exported_step_trains_the_same_bits_without_tracing_the_model(tmp_path, monkeypatch,
                                                                                           layout):
    cfg = tiny_config(tmp_path / "run", "eval.every_steps=2", "eval.holdout_shards=2", "eval.batches=1",  # 3 programs
                      *layout)
    first = Trainer(cfg, devices=jax.devices()[:DEVICES])
    folder = tmp_path / "exported" / exported.world_key(["us", "eu", "eu"], [2, 2, 2])
    programs = first.export_programs()
    assert sorted(programs) == ["apply", "compute", "evaluate"]
    exported.save(folder, programs)
    direct = _train(first, 3, tmp_path)
    direct_eval = _evaluate(first)

    later = Trainer(cfg, devices=jax.devices()[:DEVICES])
    later.use_exported(later.exported_calls(exported.load(folder)))
    # Lowering, compiling and running the later trainer's programs never runs the model's code.
    monkeypatch.setattr(state_lib.ModelDef, "forward", _must_not_trace)
    later.lowered(later.abstract_state())
    assert _train(later, 3, tmp_path) == direct
    assert _evaluate(later) == direct_eval


def _must_not_trace(*args, **kwargs):
    raise AssertionError("the model was traced")


def _evaluate(trainer: Trainer) -> tuple[bytes, bytes]:
    """The eval program on a fixed batch and a fixed state: its sums' bytes."""
    from resilient_jax import mesh as mesh_lib

    rows, seq = trainer.plan.padded_rows, trainer.cfg.data.seq_len
    tokens = np.arange(rows * (seq + 1), dtype=np.int32).reshape(rows, seq + 1) % 200
    batch = mesh_lib.batch_sharding(trainer.mesh)
    params = jax.tree.map(lambda x: jax.device_put(np.full(x.shape, 0.01, x.dtype), x.sharding),
                          trainer.abstract_state().params)
    result = trainer.evaluate(params, jax.device_put(tokens, batch),
                              jax.device_put(np.ones((rows, seq), np.float32), batch), np.int32(0), trainer.layout)
    return np.asarray(result.shard_loss).tobytes(), np.asarray(result.shard_weight).tobytes()


def test_an_incomplete_or_foreign_store_is_not_used(tmp_path):
    cfg = tiny_config(tmp_path / "run")
    trainer = Trainer(cfg, devices=jax.devices()[:DEVICES])
    programs = trainer.export_programs()
    folder = tmp_path / "w"
    exported.save(folder, programs)
    (folder / "complete").unlink()  # a writer that died before its last file: nothing to load
    assert exported.load(folder) is None
    assert exported.load(tmp_path / "absent") is None
    # A world of another shape (2 devices): its programs take other arrays. Refused whole: the
    # trainer keeps its own step.
    other = Trainer(cfg, devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="returns|takes"):
        trainer.exported_calls({**programs, "apply": other.export_programs()["compute"]})
    with pytest.raises(ValueError, match="takes other arrays|runs on 2 devices"):
        trainer.exported_calls(other.export_programs())
    with pytest.raises(KeyError):
        trainer.exported_calls({"compute": programs["compute"]})
    (folder / "apply.bin").write_bytes(b"\x00" * 64)  # not a program: the store is not used
    (folder / "complete").write_text('["apply", "compute"]')
    assert exported.load(folder) is None
    assert exported.world_key(["us", "eu"], [2, 2]) != exported.world_key(["eu", "us"], [2, 2])


def test_a_world_calls_the_programs_exported_ahead_or_on_one_machine_its_rank_0s_or_traces_its_own():
    one_machine = ["boot-a /runs/x/compile_cache"] * 3
    apart = ["boot-a /runs/x/compile_cache", "boot-b /runs/x/compile_cache", "boot-c /runs/x/compile_cache"]
    # Every member holds programs exported ahead: called, wherever the members run.
    assert exported.world_programs([True] * 3, one_machine, "cpu") == exported.EARLIER
    assert exported.world_programs([True] * 3, apart, "gpu") == exported.EARLIER
    assert exported.world_programs([True], one_machine[:1], "cpu") == exported.EARLIER
    # One machine, one cache: rank 0 exports for the world (also where only some members hold them).
    assert exported.world_programs([False] * 3, one_machine, "cpu") == exported.FOR_THIS_WORLD
    assert exported.world_programs([True, False, True], one_machine, "cpu") == exported.FOR_THIS_WORLD
    # Machines of their own (their own cores), a lone member, or a GPU world: each member traces.
    assert exported.world_programs([True, False, True], apart, "cpu") is None
    assert exported.world_programs([False], one_machine[:1], "cpu") is None
    assert exported.world_programs([False] * 3, one_machine, "gpu") is None
    assert exported.world_programs([False] * 3, ["boot-a "] * 3, "cpu") is None  # no compile cache


def test_export_and_reload_returns_the_calls_read_back_or_leaves_no_folder_behind(tmp_path, monkeypatch):
    """What rank 0 does for its world (and the compile-ahead thread for the next ones): the calls
    it returns are the stored programs read back; a failure at any point removes the folder, so a
    member never loads a partial export, and reaches the caller, which then traces."""
    cfg = tiny_config(tmp_path / "run")
    trainer = Trainer(cfg, devices=jax.devices()[:DEVICES])
    folder = tmp_path / "exported" / "w"
    calls = exported.export_and_reload(trainer, folder)
    assert sorted(calls) == ["apply", "compute"] and sorted(exported.load(folder)) == ["apply", "compute"]

    real_save = exported.save

    def dies_after_one_program(directory, programs):  # a full disk after the first file
        real_save(directory, dict(list(programs.items())[:1]))
        raise OSError(28, "No space left on device")

    for name, failure in [("save", dies_after_one_program),
                          ("load", lambda directory: None)]:  # written, but does not read back
        with monkeypatch.context() as m:
            m.setattr(exported, name, failure)
            broken = tmp_path / "exported" / name
            with pytest.raises((OSError, ValueError)):
                exported.export_and_reload(trainer, broken)
            assert not broken.exists(), name
    other = Trainer(cfg, devices=jax.devices()[:2])  # programs of another world's shape
    with monkeypatch.context() as m:
        m.setattr(trainer, "export_programs", other.export_programs)
        with pytest.raises(ValueError):
            exported.export_and_reload(trainer, tmp_path / "exported" / "foreign")
    assert not (tmp_path / "exported" / "foreign").exists()
