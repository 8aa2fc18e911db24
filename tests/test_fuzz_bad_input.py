"""Fuzzed bad input: seeded random mutations of configs, fault specs and dataset manifests.

Every mutation here is invalid by construction (or skipped when the validator rightly accepts it):
`python -m resilient_jax.train` must answer each with exit 2 and ONE `error:` line that names the
key, spec or file -- never a traceback -- and leave everything on disk as it was. The cases run in
this process (validation happens before JAX is touched), so hundreds take seconds. The seeds are
fixed so a failure reproduces; RESILIENT_JAX_FUZZ_SEED adds another seed's worth.

Checkpoint files are fuzzed in tests/test_checkpoint_integrity.py (a byte flipped in any file of a
committed step: verify names the file, or the resume is bit-exact).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import typing
from pathlib import Path

import pytest
import yaml

from resilient_jax import config as config_lib
from resilient_jax import train

from conftest import TINY

SEEDS = [0, 1, 2] + ([int(os.environ["RESILIENT_JAX_FUZZ_SEED"])] if os.environ.get("RESILIENT_JAX_FUZZ_SEED") else [])
CASES_PER_SEED = 40


def tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def one_error_line(capsys, code: int, what: str) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, f"{what}: exit {code}\n{out[-1500:]}\n{err[-1500:]}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{what}:\n{err}"
    assert "Traceback" not in err
    return lines[0]


# -- configs -----------------------------------------------------------------------------------------


def scalar_keys() -> list[tuple[str, str, object, object]]:
    """(section, key, default, annotation) of every scalar config key."""
    out = []
    for section in dataclasses.fields(config_lib.Config):
        cls = typing.get_type_hints(config_lib.Config)[section.name]
        if not dataclasses.is_dataclass(cls):
            continue
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = getattr(cls(), f.name)
            if isinstance(default, (bool, int, float, str)):
                out.append((section.name, f.name, default, hints[f.name]))
    return out


def invalid_mutation(rng: random.Random, keys) -> tuple[str, dict, str]:
    """(description, raw-config mutator applied to a parsed tiny.yaml, text the error must contain)."""
    section, key, default, hint = rng.choice(keys)
    dotted = f"{section}.{key}"
    bound = config_lib.RANGES.get(dotted)
    choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else ()
    kinds = ["unknown key", "list", "mapping", "section not a mapping"]
    if isinstance(default, bool):
        kinds += ["bool as text", "bool as number"]
    elif isinstance(default, (int, float)):
        kinds += ["number as text"] + (["below range", "above range"] if bound else [])
        if isinstance(default, int):
            kinds.append("fraction for an integer")
    elif choices:
        kinds.append("unknown choice")
    kind = rng.choice(kinds)
    value: object = None
    if kind == "unknown key":
        typo = key + rng.choice(["_", "s", "x", "2"])
        return kind, {section: {typo: default}}, f"{section}.{typo}"
    if kind == "section not a mapping":
        return kind, {section: rng.choice([7, "text", [1, 2]])}, section
    if kind == "list":
        value = [default, default]
    elif kind == "mapping":
        value = {"x": 1}
    elif kind == "bool as text":
        value = rng.choice(["maybe", "enabled", "2"])
    elif kind == "bool as number":
        value = rng.choice([2, -1, 0.5])
    elif kind == "number as text":
        value = rng.choice(["ten", "1e", "0x", "--3"])
    elif kind == "fraction for an integer":
        value = rng.choice([0.5, 2.5, 1e-3])
    elif kind == "below range":
        if bound.lo is None:
            return invalid_mutation(rng, keys)
        value = bound.lo if bound.lo_open else bound.lo - rng.choice([1, 0.5, 1000])
    elif kind == "above range":
        if bound.hi is None:
            return invalid_mutation(rng, keys)
        value = bound.hi if bound.hi_open else bound.hi + rng.choice([1, 0.5, 1000])
    elif kind == "unknown choice":
        value = rng.choice(["nope", "AUTO", ""]) if "" not in choices else "nope"
    if isinstance(default, int) and not isinstance(default, bool) and kind in ("below range", "above range"):
        value = int(value) if float(value).is_integer() else value
    if bound is not None and isinstance(value, (int, float)) and not isinstance(value, bool) and bound.allows(value):
        return invalid_mutation(rng, keys)  # a special value (e.g. -1 = "all"): valid, draw again
    return f"{kind}: {dotted}={value!r}", {section: {key: value}}, dotted


def merged(base: dict, mutation: dict) -> dict:
    out = json.loads(json.dumps(base))
    for section, change in mutation.items():
        if isinstance(change, dict) and isinstance(out.get(section), dict):
            out[section].update(change)
        else:
            out[section] = change
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_mutated_configs_get_one_line_naming_the_key(workdir, capsys, seed):
    rng = random.Random(seed)
    base = yaml.safe_load(TINY.read_text())
    base["run"]["dir"] = "runs/fuzz"  # in the file, not --set, so a mutated run.dir is what the run sees
    keys = scalar_keys()
    for i in range(CASES_PER_SEED):
        what, mutation, named = invalid_mutation(rng, keys)
        path = workdir / f"case-{i}.yaml"
        path.write_text(yaml.safe_dump(merged(base, mutation)))
        before = tree(workdir)
        # --stop-at 1: a mutation the validator wrongly accepted costs one step, not a whole run.
        line = one_error_line(capsys, train.main(["--config", str(path), "--stop-at", "1"]), what)
        assert named in line, f"{what}: the error does not name {named!r}: {line}"
        assert tree(workdir) == before, what


# -- fault specs ---------------------------------------------------------------------------------------

VALID_SPECS = ["nan_shard:3@20", "kill_host:1@20", "kill_region:eu@5", "hang_host:0@7", "join_host@9",
               "delay_host:2@5-8:1.5", "slow_host:1@4:2"]
ALPHABET = "0123456789:@-._,'\"[]{}# xyz"


def mutated_spec(rng: random.Random) -> str:
    spec = list(rng.choice(VALID_SPECS))
    # Half the edits land after the kind's name, where the numbers and separators are.
    first = rng.choice([0, "".join(spec).find(":") + 1 or "".join(spec).find("@") + 1])
    for _ in range(rng.randint(1, 3)):
        op, at = rng.choice(["insert", "delete", "replace"]), rng.randrange(min(first, len(spec)), len(spec) + 1)
        if op == "insert":
            spec.insert(at, rng.choice(ALPHABET))
        elif spec and at < len(spec):
            if op == "delete":
                del spec[at]
            else:
                spec[at] = rng.choice(ALPHABET)
    return "".join(spec)


def accepted(spec: str) -> bool:
    """Whether the single-process tiny run would accept this fault (then it is not bad input)."""
    from resilient_jax.preflight import check_run

    try:
        check_run(config_lib.load_config(TINY, ["run.dir=runs/fuzz", f"faults={[spec]!r}"]))
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("seed", SEEDS)
def test_mutated_fault_specs_get_one_line(workdir, capsys, seed):
    rng = random.Random(1000 + seed)
    tried = 0
    while tried < CASES_PER_SEED:
        spec = mutated_spec(rng)
        if accepted(spec):
            continue
        tried += 1
        before = tree(workdir)
        line = one_error_line(capsys, train.main(["--config", str(TINY), "--set", "run.dir=runs/fuzz",
                                                  "--stop-at", "1", "--fault", spec]), f"--fault {spec!r}")
        assert "fault" in line, line
        assert tree(workdir) == before, spec


# -- dataset manifests ---------------------------------------------------------------------------------


def mutated_manifest(rng: random.Random, text: str) -> str:
    """A manifest.json that differs from `text` in what it says (not only in whitespace)."""
    doc = json.loads(text)
    while True:
        kind = rng.choice(["flip a byte", "truncate", "drop a key", "retype a key", "edit a shard"])
        if kind == "flip a byte":
            data = bytearray(text.encode())
            data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
            out = data.decode("latin-1")
        elif kind == "truncate":
            out = text[: rng.randrange(len(text))]
        else:
            changed = json.loads(text)
            if kind == "drop a key":
                del changed[rng.choice(sorted(changed))]
            elif kind == "retype a key":
                changed[rng.choice(sorted(changed))] = rng.choice([None, [], "x", -1])
            else:
                shard = rng.choice(changed["shards"])
                shard[rng.choice(sorted(shard))] = rng.choice(["", 0, -5, "shard-99999.array_record", None])
            out = json.dumps(changed, indent=1)
        try:
            if json.loads(out) == doc:
                continue  # whitespace only: the same manifest
        except ValueError:
            pass
        return out


def test_mutated_manifests_get_one_line_naming_the_manifest(workdir, capsys, default_dataset):
    dataset = workdir / "data"
    shutil.copytree(default_dataset.root, dataset)
    manifest = dataset / "manifest.json"
    original = manifest.read_text()
    rng = random.Random(7)
    for i in range(CASES_PER_SEED):
        manifest.write_bytes(mutated_manifest(rng, original).encode("latin-1"))
        before = tree(workdir)
        line = one_error_line(capsys, train.main(["--config", str(TINY), "--set", "run.dir=runs/fuzz", "--stop-at",
                                                  "1", "--set", f"data.dataset={dataset}"]), f"manifest case {i}")
        assert str(manifest) in line, line
        assert tree(workdir) == before
