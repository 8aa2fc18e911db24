"""examples/: a model that is not a transformer LM, defined outside the package and named by
model.factory, trains elastically with a killed host under every guarantee of the built-in one."""

from __future__ import annotations

import json

import jax
import pytest

from resilient_jax.checkpoint import reader
from resilient_jax.config import load_config
from resilient_jax.fingerprinting import params_fingerprint
from resilient_jax.trainer import Trainer

from conftest import REPO, read_summary, run_cli

GRU = REPO / "examples" / "gru_lm.yaml"
# Few steps and tiny widths: the test is about the guarantees, not the model.
STEPS, KILL_AT = 8, 4
SMALL = ["model.args={vocab_size: 256, d_embed: 16, d_hidden: 32, dropout: 0.1}", f"train.steps={STEPS}",
         f"eval.every_steps={KILL_AT}", "eval.batches=2"]


@pytest.mark.slow
def test_gru_example_absorbs_a_killed_host_with_the_fault_free_fingerprint(tmp_path, default_dataset):
    # Fault-free: one process on 8 devices (the invariant reduction makes it the 4-host trajectory too).
    ref_cfg = load_config(GRU, [*SMALL, "topology.regions=[]", f"run.dir={tmp_path / 'ref'}",
                                "checkpoint.enabled=false", "run.progress=quiet"])
    ref_summary = Trainer(ref_cfg, devices=jax.devices()[:8]).run()
    reference = ref_summary["params_fingerprint"]

    run_dir = tmp_path / "elastic"
    proc = run_cli("resilient_jax.train", "--config", str(GRU), *[a for s in SMALL for a in ("--set", s)],
                   "--set", f"run.dir={run_dir}", "--set", "run.progress=plain", "--fault", f"kill_host:1@{KILL_AT}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = read_summary(run_dir)
    assert summary["final_step"] == STEPS
    assert summary["restarts"] == 0 and summary["steps_lost"] == 0
    assert summary["failures_absorbed"] == 1 and summary["worker_exit_codes"]["h1"] == -9
    assert summary["params_fingerprint"] == reference
    # Held-out loss: evaluated by the 4-host world at step 4 (then h1 died in step 5), again by the
    # 3-host world that resumed there, and at step 8 -- each the fault-free run's bits.
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"event": "eval"' in line]
    expected = [(r["step"], r["loss"]) for r in ref_summary["eval"]["history"]]
    assert expected[0][0] == KILL_AT and expected[-1][0] == STEPS
    assert [(r["step"], r["loss"]) for r in evals] == expected
    assert summary["eval"]["last"]["loss"] == expected[-1][1]
    assert f"eval at step {STEPS}: loss {expected[-1][1]:.4f}" in proc.stdout  # the driver's console
    logs = "".join(p.read_text() for p in (run_dir / "elastic" / "logs").glob("h*.log"))
    assert f"eval at step {KILL_AT} again (resumed at an eval step): the same loss, bit for bit" in logs
    assert "gave loss" not in logs  # what a re-evaluation that differed would say

    step_dir = run_dir / "checkpoints" / str(STEPS)
    verify = run_cli("resilient_jax.checkpoint", "verify", str(step_dir))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    # The framework-free reader loads the user model's weights, bit for bit the trained ones.
    assert params_fingerprint(reader.load(step_dir).weights) == reference
