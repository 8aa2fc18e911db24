"""Seven-field checkpoints: weights, optimizer state, RNG, data position, config, topology, provenance.

Written together by one orbax save, committed atomically, loaded together, refused by field name
when any file is missing or corrupt. The on-disk format is specified in
runbooks/checkpoint-format.md. Modules, one concern each:

- `reader`      the format from the reading side; stdlib + numpy + tensorstore + crc32c only (no JAX)
- `commit`      the commit manifest: crc32c of every file, per writing process, written after orbax's commit
- `cli`         `python -m resilient_jax.checkpoint inspect|verify PATH` (on the reader; no JAX)
- `checksums`   the manifest's array entries (names, shapes, dtypes) from a live state tree
- `context`     building the five context fields from the live run
- `topology`    the topology field (hosts, regions, mesh, generation) and how two compare
- `validate`    may a checkpoint continue this run? (dataset, config, rng, topology, commit rules)
- `policy`      SavePolicy: every N steps / T seconds, keep the last K plus every M-th
- `preemption`  SIGTERM (and Ctrl-C, single process) -> the step every process stops and saves at
- `store`       CheckpointStore: the orbax CheckpointManager, async save, restore with resharding
- `orbax_errors` quieting orbax's leftovers after a failed save/restore (one line, not pages)
- `session`     CheckpointSession: what the trainer calls (resume, save when due, finish)

This package's import is light (no JAX): import the submodule you need.
"""

from resilient_jax.checkpoint.reader import FIELDS, FORMAT_VERSION, CheckpointError

__all__ = ["FIELDS", "FORMAT_VERSION", "CheckpointError"]
