"""SIGKILL at random moments during asynchronous saves: a partial checkpoint is never loaded.

Each trial starts a small worker (this file run as a script) that opens the checkpoint root,
resumes from the newest checkpoint -- checking every file's crc32c against the commit manifest --
and then saves steps back to back until the test SIGKILLs it at a random moment. Over the trials
the kill lands in every phase of a save: the device-to-host copy, the background writes, the
manifest, orbax's rename, the commit files, the deletion of old steps. What must hold every time:

- the newest listed step is complete (the commit file is the commit), and the worker resumes from it;
- the restored arrays are exactly the ones saved at that step;
- temporary and uncommitted directories of killed saves are removed when the next store opens.

The worker saves a toy state (two array trees) with schema-valid context fields, so a trial costs
about one second (the import of JAX and orbax), not a training run.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TRIALS = 24
KEEP = 3


# -- the worker (runs in a subprocess) ------------------------------------------------------------------


def _expected_state(step: int):
    import numpy as np

    params = {"w": np.full((256, 256), step, np.float32), "layers": {"0": {"b": np.arange(4096, dtype=np.float32) + step}}}
    opt_state = {"mu": {"w": np.full((256, 256), -step, np.float32)}, "count": np.int32(step)}
    return params, opt_state


def _context(step: int) -> dict:
    from resilient_jax.checkpoint.reader import json_sha256

    config = {"toy": True}
    return {
        "rng": {"seed": 0, "impl": "toy", "base_key_data": [0, 0], "next_step": step},
        "data": {"step": step, "global_offset": step, "epoch": 0, "dataset_version": "toy", "quarantine": []},
        "config": {"hash": json_sha256(config), "config": config, "history": []},
        "topology": {"generation": 0, "process_count": 1, "devices_per_host": 1, "hosts": [], "mesh": {},
                     "history": []},
        "provenance": {"commit": None, "dirty": None, "version": "0", "history": []},
    }


def worker(root: Path) -> None:
    from typing import NamedTuple

    import jax
    import numpy as np

    from resilient_jax.checkpoint import reader
    from resilient_jax.checkpoint.store import CheckpointStore

    class State(NamedTuple):
        params: dict
        opt_state: dict

    def device_state(step):
        params, opt = _expected_state(step)
        return State(*jax.tree.map(jax.numpy.asarray, (params, opt)))

    store = CheckpointStore(root, async_save=True, keep=lambda steps: set(sorted(steps)[-KEEP:]))
    report = {
        "temporary_after_open": [p.name for p in (*reader.temporary_dirs(root), *reader.uncommitted_dirs(root))],
        "listed": reader.list_steps(root),
        "newest_complete": reader.newest_complete(root),
    }
    start = 0
    if report["listed"]:
        start = report["listed"][-1]
        abstract = jax.eval_shape(lambda: device_state(start))
        abstract = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])),
            abstract,
        )
        restored = CheckpointStore.restore_arrays(root / str(start), abstract, verify=True)
        expected = _expected_state(start)
        for got, want in zip(jax.tree.leaves((restored.params, restored.opt_state)), jax.tree.leaves(expected)):
            assert np.array_equal(np.asarray(got), want), "restored arrays differ from the saved ones"
        assert reader.read_context(root / str(start))["data"]["step"] == start
    print(json.dumps({"resumed": start, **report}), flush=True)
    for step in range(start + 1, start + 10_000):
        store.save(step, device_state(step), _context(step))
    store.close()


# -- the test ----------------------------------------------------------------------------------------------


def _start_worker(root: Path) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, __file__, "worker", str(root)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow
def test_sigkill_during_saves_never_loads_a_partial_checkpoint(tmp_path):
    from resilient_jax.checkpoint import reader

    root = tmp_path / "checkpoints"
    rng = random.Random(1234)
    leftovers_seen = 0
    resumed_steps = []
    for trial in range(TRIALS):
        listed_before = reader.list_steps(root)
        leftovers_seen += bool(reader.temporary_dirs(root) or reader.uncommitted_dirs(root))
        proc = _start_worker(root)
        try:
            line = proc.stdout.readline()
            if not line:
                proc.wait(timeout=30)
                pytest.fail(f"trial {trial}: the worker failed to resume:\n{proc.stderr.read()[-3000:]}")
            report = json.loads(line)
            # Anything the killed save left behind is gone once a store has opened.
            assert report["temporary_after_open"] == [], report
            # The newest committed step is always complete: the rename is the commit.
            assert report["listed"] == listed_before
            if listed_before:
                assert report["newest_complete"] == listed_before[-1], report
                assert report["resumed"] == listed_before[-1]
            resumed_steps.append(report["resumed"])
            time.sleep(rng.uniform(0.0, 0.5))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            proc.stdout.close()
            proc.stderr.close()
    # The runs made progress across kills, and kills did land mid-save (leaving temporary dirs).
    assert resumed_steps[-1] > resumed_steps[1] > 0, resumed_steps
    assert leftovers_seen >= 1, "no kill landed during a save; the test did not test anything"
    assert len(reader.list_steps(root)) <= KEEP + 1
    assert all(reader.verify(root / str(step)) == [] for step in reader.list_steps(root))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        worker(Path(sys.argv[2]))
    else:
        sys.exit(f"usage: {sys.argv[0]} worker ROOT")
