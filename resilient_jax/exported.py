"""A world's step, exported once (traced and lowered to StableHLO by `jax.export`), called by the
members of a later world of the same shape without tracing the model again.

Why: a recovery's new world spent most of its compile phase tracing and lowering its step on every
member, even when rank 0 had compiled it ahead into the persistent cache (tiny's compute on 6
devices: trace 1.14 s + lower 0.53 s a member, on a process that had traced it before, and more
with the members on shared cores). An exported program is called through `jax.jit(exported.call)`,
whose lowering only wraps the stored module: 0.36 s. Rank 0 exports the likely next worlds' step
while it trains (elastic/precompile.py) and compiles it through that same call, so the new world's
members load it from the compile cache. A world whose members share one machine has its rank 0
export its own programs as it forms, and the others call them (`world_programs`): members tracing
the same model side by side on the same cores paid N traces for one.

The bits are those of the program the model's jit lowers: the exported module is that lowering,
run as it is (measured: tiny's compute, the same gradients to the bit and the same loss; the
elastic tests compare every world's trajectory with the fault-free run's).

Arguments and results cross as flat lists of arrays: `jax.export` serialises only pytrees of
built-in containers with string keys, and a model's parameters need not be that. The caller gives
the result's structure as a template (`out_template`); a count that does not match is an error,
never a silent reshuffle. Programs are stored as jax.export's flatbuffer serialisation -- data
for XLA, no Python object is loaded -- under the run's directory, one folder per invocation of
the run (`elastic/exported/<invocation>/<world>`): written by this invocation's rank 0, read only
by this invocation's members, whose code cannot have changed since.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resilient_jax import compile_cache

if TYPE_CHECKING:
    import jax

def folder(run_dir, invocation: str) -> Path:
    """Where the workers of one invocation of a run keep the programs their next worlds call."""
    return Path(run_dir) / "elastic" / "exported" / invocation


def world_key(regions_by_rank: Sequence[str], devices_by_rank: Sequence[int]) -> str:
    """A folder name for the programs of a world: what its step depends on (elastic/next_worlds)."""
    blob = json.dumps([list(regions_by_rank), list(devices_by_rank)]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# Programs in the invocation's folder for a world of this shape: exported ahead by elastic/precompile,
# or by the rank 0 of an earlier world of this shape (FOR_THIS_WORLD).
EARLIER = "rank 0 exported earlier for a world of this shape"
FOR_THIS_WORLD = "rank 0 exported for this world (one machine)"  # its rank 0 exports them as it forms


def world_programs(has_programs: Sequence[bool], placements: Sequence[str], platform: str) -> str | None:
    """Which exported programs a forming world calls, from what every member said (in rank order):
    whether it holds loadable programs for this world, and its compile_cache.placement().

    EARLIER where every member holds them. Else FOR_THIS_WORLD where the world shares one machine and
    one cache (compile_cache.leader_compiles: rank 0 alone compiles there anyway): N members tracing
    the same step side by side would cost N times the CPU on the same cores, so rank 0 traces and
    exports, and the others wait for its programs. Else None: each member traces its own. The
    same answer on every member, who all read the same words."""
    if all(has_programs):
        return EARLIER
    return FOR_THIS_WORLD if compile_cache.leader_compiles(list(placements), platform) else None


def export(jitted, args: Sequence[Any]) -> jax.export.Exported:
    """`jitted(*args)` traced and lowered with flat arguments and results (`args` may be
    ShapeDtypeStructs carrying their shardings: nothing is allocated or compiled)."""
    import jax

    flat, in_tree = jax.tree.flatten(tuple(args))

    def flat_program(*leaves):
        return jax.tree.leaves(jitted(*jax.tree.unflatten(in_tree, leaves)))

    return jax.export.export(jax.jit(flat_program))(*flat)


class ExportedCall:
    """A stored program called like the jit it was exported from: `call(*args)`, `lower(*args)`.

    `out_template`: any pytree with the structure of the program's result. `donate`: flat indices
    of donated arguments."""

    def __init__(self, exported: jax.export.Exported, out_template, donate: Sequence[int] = ()):
        import jax

        self.out_tree = jax.tree.structure(out_template)
        if self.out_tree.num_leaves != len(exported.out_avals):
            raise ValueError(f"the exported program {exported.fun_name} returns {len(exported.out_avals)} arrays, "
                             f"its template {self.out_tree.num_leaves}")
        self.exported = exported
        self._jit = jax.jit(exported.call, donate_argnums=tuple(donate))

    def check(self, args, devices: int) -> None:
        """ValueError unless this program takes `args` (arrays or ShapeDtypeStructs: their shapes
        and dtypes) on a world of `devices` devices."""
        given = [(tuple(x.shape), str(x.dtype)) for x in self._flat(args)]
        wanted = [(tuple(a.shape), str(a.dtype)) for a in self.exported.in_avals]
        if given != wanted:
            raise ValueError(f"the exported program {self.exported.fun_name} takes other arrays than this world's "
                             f"(first difference: {next(g for g, w in zip(given, wanted) if g != w)})")
        if self.exported.nr_devices != devices:
            raise ValueError(f"the exported program {self.exported.fun_name} runs on {self.exported.nr_devices} "
                             f"devices, this world has {devices}")

    def _flat(self, args) -> list:
        import jax

        flat = jax.tree.leaves(tuple(args))
        if len(flat) != len(self.exported.in_avals):
            raise ValueError(f"the exported program {self.exported.fun_name} takes {len(self.exported.in_avals)} "
                             f"arrays, given {len(flat)}")
        return flat

    def __call__(self, *args):
        import jax

        return jax.tree.unflatten(self.out_tree, self._jit(*self._flat(args)))

    def lower(self, *args):
        return self._jit.lower(*self._flat(args))

    def _cache_size(self) -> int:
        return self._jit._cache_size()


def donated_leaves(first_arg) -> list[int]:
    """Flat indices of the leaves of a program's first argument (apply donates the state)."""
    import jax

    return list(range(len(jax.tree.leaves(first_arg))))


def save(directory: Path, programs: dict[str, jax.export.Exported]) -> None:
    """Write `programs` into `directory`, each atomically (temporary file, then rename), the folder
    last complete: a reader sees every program of a world or none (`load` needs `complete`)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, exported in programs.items():
        _write_atomically(directory / f"{name}.bin", bytes(exported.serialize()))
    _write_atomically(directory / "complete", json.dumps(sorted(programs)).encode())


def load(directory: Path) -> dict[str, jax.export.Exported] | None:
    """The programs `save` wrote into `directory`, or None if it holds no complete set."""
    import jax

    try:
        names = json.loads((directory / "complete").read_text())
        return {name: jax.export.deserialize(bytearray((directory / f"{name}.bin").read_bytes())) for name in names}
    except Exception:  # unreadable, or not what `save` writes (a flatbuffer fails in many ways): not used
        return None


def export_and_reload(trainer, directory: Path) -> dict:
    """Exports `trainer`'s programs into `directory` and returns them, read back, as its calls
    (Trainer.exported_calls): the exporter then runs the bytes the others will load, not its own
    tracing. On any failure (a program jax.export refuses, a full disk, a set that does not read
    back) removes `directory`, so that no one loads a partial export, and raises."""
    try:
        save(directory, trainer.export_programs())
        programs = load(directory)
        if programs is None:
            raise ValueError(f"{directory} could not be read back")
        return trainer.exported_calls(programs)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
