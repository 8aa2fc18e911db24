"""The README's model-of-your-own example, run as written: its two Python blocks become
my_model.py and train_bigram.py in a fresh directory (beside a copy of configs/), and
`python train_bigram.py` trains the model elastically with a killed host."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import jax
import pytest

from resilient_jax.config import load_config
from resilient_jax.trainer import Trainer

from conftest import REPO

SECTION = "## Your own model and loss"


def readme_example() -> tuple[str, str]:
    """(my_model.py, train_bigram.py): the first two ```python blocks of the README's section."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index(SECTION):]
    section = section[:section.index("\n## ", len(SECTION))]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) >= 2, "the README's example lost a block"
    return blocks[0], blocks[1]


@pytest.mark.slow
def test_the_readme_example_trains_a_model_of_your_own_elastically_through_a_kill(tmp_path):
    model_py, train_py = readme_example()
    assert "resilient_jax.run(" in train_py and "kill_host" in train_py
    (tmp_path / "my_model.py").write_text(model_py)
    (tmp_path / "train_bigram.py").write_text(train_py)
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    proc = subprocess.run([sys.executable, "train_bigram.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed = proc.stdout.strip().splitlines()[-1]
    run = json.loads((tmp_path / "runs" / "bigram" / "summary.json").read_text())
    assert run["failures_absorbed"] == 1 and run["worker_exit_codes"]["h1"] == -9  # the kill did happen

    # The same run without the kill, in one process on 8 devices: the invariant reduction makes it
    # the 4-host trajectory.
    overrides = re.search(r"run\(\"configs/cpu-4host.yaml\", \[(.*?)\]\)", train_py, flags=re.S).group(1)
    keys = [k for k in re.findall(r'"([^"]+)"', overrides) if not k.startswith(("faults=", "run.dir="))]
    cfg = load_config(tmp_path / "configs" / "cpu-4host.yaml",
                      [*keys, f"task.import_dir={tmp_path}", "topology.regions=[]", f"run.dir={tmp_path / 'ref'}",
                       "checkpoint.enabled=false", "run.progress=quiet"])
    reference = Trainer(cfg, devices=jax.devices()[:8]).run()
    assert printed == reference["params_fingerprint"]
