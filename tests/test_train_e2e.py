"""End to end: runs are reproducible by seed. (The README's main job itself, run as written on a fresh
copy, is tests/test_first_hour.py's.)"""

from __future__ import annotations


import jax
import numpy as np

from resilient_jax import fingerprint
from resilient_jax.trainer import Trainer

from conftest import tiny_config

def test_same_config_same_fingerprint_other_seed_other(tmp_path, default_dataset):
    runs = {
        name: Trainer(tiny_config(tmp_path / name, "train.steps=12", *extra), devices=jax.devices()[:4]).run()
        for name, extra in [("a", []), ("b", []), ("seed1", ["train.seed=1"])]
    }
    assert runs["a"]["params_fingerprint"] == runs["b"]["params_fingerprint"]
    assert runs["a"]["params_fingerprint"] != runs["seed1"]["params_fingerprint"]


def test_fingerprint_is_sha256_of_leaf_bytes_in_sorted_path_order():
    import hashlib

    tree = {"b": np.arange(3, dtype=np.float32), "a": {"z": np.ones(2, np.int32), "c": np.zeros(1)}}
    expected = hashlib.sha256()
    for leaf in (tree["a"]["c"], tree["a"]["z"], tree["b"]):  # ['a']['c'] < ['a']['z'] < ['b']
        expected.update(leaf.tobytes())
    assert fingerprint(tree) == expected.hexdigest()
    tree["b"][0] = 1.0
    assert fingerprint(tree) != expected.hexdigest()
