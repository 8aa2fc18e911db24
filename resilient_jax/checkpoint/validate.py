"""Validation on load: may this checkpoint continue this run, and what must the next one record?

Pure functions on the context dicts (no JAX), one rule per field:

    data        another dataset version                      -> refuse
    config      another hash                                  -> refuse unless --allow-config-change
                                                                 names every differing key; record
    rng         another PRNG impl or key for the same seed    -> refuse (keys would differ)
    topology    other hosts / devices / mesh                  -> allowed (restore reshards); record
    provenance  another commit sha                            -> warn; record

Keys that cannot change the trajectory (OPERATIONAL: where output goes, how progress shows, when
checkpoints are written, where the data is read from) are recorded like any change but need no
allowance: refusing a resume because the progress bar, the run directory or the dataset's path
changed would protect nothing. Paths are absolute (resolved at config load), so the same run
resumed from another directory records the new path instead of refusing it. Likewise keys that
newer code added, absent from the saved config and at their default value now. Naming a key in
--allow-config-change that did not change is only a warning, so a wrapper that always passes the
flag keeps working once the change has been recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resilient_jax.checkpoint import topology as topology_lib
from resilient_jax.checkpoint.context import History
from resilient_jax.checkpoint.reader import CheckpointError
from resilient_jax.config import BUILTIN_MODEL, Config, diff_keys
from resilient_jax.data.errors import DatasetError
from resilient_jax.data.order import QuarantineEvent
from resilient_jax.data.position import DataPosition

# Config keys (or "section." prefixes) that never change the trajectory of a run.
# Layout keys (how many devices and hosts, how they are meshed, how the runtime watches them)
# are a topology change, not a config change: the state is resharded onto the new mesh and the
# change recorded in the topology field -- in invariant mode the trajectory does not move. So is the
# order of the gradient sum across regions (parallel.cross_region: an integer sum in any order).
# How many hosts one replica spans (parallel.hosts_per_replica, and whether it may span regions)
# is layout too: it only changes fsdp and data, so a run resumes onto another k.
# Not parallel.tensor: the bits are the same for every (data, fsdp) layout at ONE tensor size (the
# Megatron split changes the float sums inside a layer), so another tensor size is another trajectory.
LAYOUT = ("parallel.devices", "parallel.data", "parallel.fsdp", "parallel.cross_region",
          "parallel.hosts_per_replica", "parallel.allow_cross_region_replica", "topology.", "runtime.")
# Where the data is read from (data.dataset, data.src, data.build_if_missing) is operational too:
# what the run trains on is pinned by the dataset version, which is checked on its own (above), so a
# dataset moved to another directory, or the same relative path resolved from another directory,
# resumes; another dataset is refused by its version whatever its path. data.tokenizer likewise: the
# path of an hf:/sp: file is made absolute at load (a checkpoint may hold it relative), and another
# tokenizer is refused by the sha256 the dataset's manifest records (data.prepare.ensure_dataset).
DATA_LOCATION = ("data.dataset", "data.src", "data.build_if_missing", "data.tokenizer")
# task.import_dir only says where model.factory / task.loss are found (the config file's directory
# by default): the model is pinned by model.factory, model.args and the params' shapes, checked on restore.
PLUGIN_LOCATION = ("task.import_dir",)
# Evaluation reads the state and writes records; it never changes the trajectory -- except
# eval.holdout_shards, which takes shards out of the training order (so it is not listed here).
EVAL = ("eval.every_steps", "eval.dataset", "eval.batches")
OPERATIONAL = ("run.", "checkpoint.", "train.log_every", "data.prefetch", *DATA_LOCATION, *PLUGIN_LOCATION, *EVAL,
               *LAYOUT)


SECRET_KEY = "runtime.token"

# Keys no checkpoint of this run can continue under, whatever --allow-config-change says: the data
# position counts whole global batches (step x global_batch samples), and the built-in model's
# widths and depth are the shapes of the saved weights and optimizer state.
NOT_RESUMABLE = {
    "data.global_batch": "the data position counts samples in global batches of the checkpoint's size",
    "model.vocab_size": "the saved weights have the checkpoint's shapes",
    "model.d_model": "the saved weights have the checkpoint's shapes",
    "model.n_layers": "the saved weights have the checkpoint's shapes",
    "model.n_heads": "the saved weights have the checkpoint's shapes",
    "model.d_ff": "the saved weights have the checkpoint's shapes",
    "model.scan_layers": "the saved weights are laid out per layer or stacked, as the checkpoint's were",
}


def is_operational(key: str) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in OPERATIONAL)


@dataclass
class ResumeDecision:
    step: int
    config_changes: list[str] = field(default_factory=list)
    topology_changed: bool = False
    commit_changed: bool = False
    warnings: list[str] = field(default_factory=list)
    history: History = field(default_factory=History)

    def events(self, path: str | Path) -> list[dict[str, Any]]:
        """What to log about this resume (a metrics.jsonl event each)."""
        out = [{"event": "resume", "step": self.step, "checkpoint": str(path)}]
        if self.config_changes:
            out.append({"event": "config_change", "step": self.step, **self.history.config[-1]})
        if self.topology_changed:
            out.append({"event": "topology_change", **self.history.topology[-1]})
        if self.commit_changed:
            out.append({"event": "commit_change", **self.history.provenance[-1]})
        return out


def _short(sha: str | None) -> str:
    return "unknown" if not sha else sha[:12]


def check_resume(path: str | Path, saved: dict[str, dict[str, Any]], current: dict[str, dict[str, Any]],
                 allow_config_change: Sequence[str] = ()) -> ResumeDecision:
    """Compare a checkpoint's context with the run about to continue from it.

    `current` holds the five context fields the new run would write at the same step.
    """
    step = int(saved["data"]["step"])
    decision = ResumeDecision(step=step, history=History.of(saved))

    saved_tok, tok = saved["data"].get("tokenizer_sha256", ""), current["data"].get("tokenizer_sha256", "")
    if saved_tok and tok and saved_tok != tok:  # before the version check: it names what changed
        raise CheckpointError(path, "data", f"tokenizer sha256 {saved_tok} differs from the configured dataset's "
                                            f"tokenizer sha256 {tok}; resume with the tokenizer the run started on")
    saved_version, version = saved["data"]["dataset_version"], current["data"]["dataset_version"]
    if saved_version != version:
        raise CheckpointError(path, "data", f"dataset version {_short(saved_version)} differs from the configured "
                                            f"dataset's {_short(version)}; resume with the dataset the run started on")

    _check_reachable(path, step, saved["data"], current["config"]["config"])
    _check_config(path, saved["config"], current["config"], allow_config_change, decision)

    if "train.seed" not in decision.config_changes:
        for key in ("impl", "base_key_data"):
            if saved["rng"].get(key) != current["rng"].get(key):
                raise CheckpointError(path, "rng", f"{key} {saved['rng'].get(key)!r} differs from this run's "
                                                   f"{current['rng'].get(key)!r} for the same seed (another JAX "
                                                   "PRNG?); the resumed run would draw different keys")

    old_topology, new_topology = saved["topology"], current["topology"]
    if topology_lib.comparable(old_topology) != topology_lib.comparable(new_topology):
        decision.topology_changed = True
        decision.history.topology.append({
            "step": step,
            "from": topology_lib.comparable(old_topology),
            "to": topology_lib.comparable(new_topology),
            "from_text": topology_lib.describe(old_topology),
            "to_text": topology_lib.describe(new_topology),
        })

    old_code, new_code = saved["provenance"], current["provenance"]
    if old_code.get("commit") != new_code.get("commit"):
        decision.commit_changed = True
        decision.history.provenance.append({
            "step": step,
            "from": {k: old_code.get(k) for k in ("commit", "dirty", "version")},
            "to": {k: new_code.get(k) for k in ("commit", "dirty", "version")},
        })
        decision.warnings.append(
            f"checkpoint {path} was written by commit {_short(old_code.get('commit'))}, this is "
            f"{_short(new_code.get('commit'))}; continuing and recording the change"
        )
    return decision


def _check_reachable(path, step: int, position: dict[str, Any], config: dict[str, Any]) -> None:
    """What no checkpoint at `step` can give, allowed or not -- checked before the allowance, so the
    refusal never sends you to --allow-config-change only to refuse again: fewer train.steps than
    it has trained, and a data.quarantine of a shard from a step it has trained on that shard."""
    steps = _lookup(config, "train.steps")
    if isinstance(steps, int) and steps < step:  # it "finished" at the checkpoint's step, past train.steps
        raise CheckpointError(path, "config", f"train.steps {steps} is before this checkpoint's step {step}, which "
                                              f"trained past it; resume a checkpoint at or before step {steps} "
                                              "(--resume STEP), or start a new run (another run.dir)")
    configured = _lookup(config, "data.quarantine")
    if isinstance(configured, list) and configured:  # the rule is the data position's own
        try:
            DataPosition.from_dict(position).with_quarantine(
                tuple(QuarantineEvent(q["shard"], q["from_step"]) for q in configured))
        except DatasetError as e:
            raise CheckpointError(path, "config", str(e)) from None


def _check_config(path, saved: dict[str, Any], current: dict[str, Any], allow: Sequence[str],
                  decision: ResumeDecision) -> None:
    allowed = {k.strip() for k in allow if k.strip()}
    changed = diff_keys(saved["config"], current["config"]) if saved["hash"] != current["hash"] else []
    # A checkpoint written before the token was left out of recorded configs may hold one: it is a
    # credential, not a setting, so it is neither a change nor copied into the new history.
    changed = [k for k in changed if k != SECRET_KEY]
    defaults = Config().to_dict()
    added = [k for k in changed
             if _lookup(saved["config"], k) is _ABSENT and _lookup(current["config"], k) == _lookup(defaults, k)]
    builtin = _lookup(current["config"], "model.factory") in (BUILTIN_MODEL, _ABSENT)
    fixed = [k for k in changed if k in NOT_RESUMABLE and (builtin or not k.startswith("model."))]
    if fixed:
        reasons = "; ".join(f"{k} is {_lookup(saved['config'], k)!r} in the checkpoint and "
                            f"{_lookup(current['config'], k)!r} now, and cannot change on resume ({NOT_RESUMABLE[k]})"
                            for k in fixed)
        raise CheckpointError(path, "config", f"{reasons}; set it back to continue this run, or start a new run "
                                              "(another run.dir) with the new value")
    unallowed = [k for k in changed if k not in allowed and not is_operational(k) and k not in added]
    if unallowed:
        raise CheckpointError(
            path, "config",
            f"hash {_short(saved['hash'])} differs from this run's {_short(current['hash'])} in "
            f"{', '.join(unallowed)}; to continue anyway, pass --allow-config-change {','.join(unallowed)}",
        )
    unused = sorted(allowed - set(changed))
    if unused:
        decision.warnings.append(f"--allow-config-change names {', '.join(unused)}, which did not change")
    if changed:
        decision.config_changes = changed
        decision.history.config.append({
            "step": decision.step,
            "keys": changed,
            "allowed": sorted(k for k in changed if not is_operational(k) and k not in added),
            "added_with_defaults": added,
            "from_hash": saved["hash"],
            "to_hash": current["hash"],
            "from": {k: _json_value(_lookup(saved["config"], k)) for k in changed},
            "to": {k: _json_value(_lookup(current["config"], k)) for k in changed},
        })


_ABSENT = object()


def _json_value(value: Any) -> Any:
    return "<absent>" if value is _ABSENT else value


def _lookup(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def check_shapes(path, manifest: dict[str, Any], params: dict[str, dict[str, Any]]) -> None:
    """The checkpoint's weights (its manifest) against this run's model (`params`: the manifest
    entries of its abstract params, resilient_jax.checkpoint.checksums.manifest_entries): another
    model (a changed model.* key, a model of your own built otherwise) is refused in one line that
    says so, before orbax is asked to restore arrays of other shapes."""
    saved = manifest["arrays"]["weights"]
    other = [name for name in sorted(saved.keys() & params.keys()) if saved[name]["shape"] != params[name]["shape"]]
    missing, extra = sorted(params.keys() - saved.keys()), sorted(saved.keys() - params.keys())
    if not (other or missing or extra):
        return
    if other:
        name = other[0]
        what = (f"{len(other)} of its weights have other shapes than this run's model (e.g. {name}: "
                f"{tuple(saved[name]['shape'])} in the checkpoint, {tuple(params[name]['shape'])} now)")
    else:
        parts = []
        if missing:
            parts.append(f"the model's {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                         + " not in the checkpoint")
        if extra:
            parts.append(f"the checkpoint's {extra[0]}" + (f" and {len(extra) - 1} more" if len(extra) > 1 else "")
                         + " not in the model")
        what = f"its weights are another model's ({'; '.join(parts)})"
    raise CheckpointError(path, "weights", f"{what}: the model's config (model.*) must be the one the run was "
                                           "trained with to resume it; set it back, or train this model in a new run "
                                           "(another run.dir)")
