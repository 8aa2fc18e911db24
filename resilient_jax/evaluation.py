"""Held-out evaluation: when it runs, what it computes, and the record it leaves.

After every `eval.every_steps` completed steps, and after the last one, the run evaluates its
params on the eval set (resilient_jax.data.evalset): the same `batches` global batches every time.
Each virtual shard of a batch is computed whole on one device (step.make_evaluate) and its loss sum
comes back with the same bits whoever computed it; the host adds them up in float64, in
(batch, shard) order. So the eval loss is a function of the params and the eval set alone -- not of
the mesh, the host count, the shard assignment, or which faults the run absorbed on the way.

    loss       = sum of every weighted token loss / sum of the weights (the default task.loss:
                 mean next-token cross-entropy in nats)
    perplexity = exp(loss)

Every member of a world evaluates (the forward pass is a collective), at the same step boundary:
`due` is a pure function of the completed steps. A world that resumes at an eval boundary
evaluates it again (it cannot know whether the world before it got that far); the records keep
one entry per step (MetricsLog.eval).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

if TYPE_CHECKING:
    from resilient_jax.trainer import Trainer


def due(completed: int, every_steps: int, total_steps: int) -> bool:
    """Whether the state after `completed` steps is evaluated."""
    return every_steps > 0 and completed > 0 and (completed % every_steps == 0 or completed == total_steps)


@dataclass(frozen=True)
class EvalRecord:
    step: int  # the completed steps of the params evaluated
    loss: float
    perplexity: float
    tokens: float  # the loss weight summed (tokens, for unweighted data)
    batches: int
    seconds: float

    def to_event(self) -> dict[str, Any]:
        return {"event": "eval", **asdict(self)}


def combine(step: int, shard_sums: list[tuple[np.ndarray, np.ndarray]], seconds: float) -> EvalRecord:
    """The record of one evaluation from each batch's per-shard (loss sums, weights), added in
    float64 in (batch, shard) order -- the same order, so the same bits, on every host."""
    loss_sum = weight_sum = 0.0
    for losses, weights in shard_sums:
        for loss, weight in zip(np.asarray(losses, np.float64), np.asarray(weights, np.float64)):
            loss_sum += float(loss)
            weight_sum += float(weight)
    loss = loss_sum / weight_sum if weight_sum > 0 else math.nan
    # exp overflows a float64 past ~709; a NaN loss keeps a NaN perplexity
    perplexity = loss if math.isnan(loss) else math.exp(loss) if loss < 700 else math.inf
    return EvalRecord(step=step, loss=loss, perplexity=perplexity, tokens=weight_sum, batches=len(shard_sums),
                      seconds=seconds)


class Evaluator:
    """One world's evaluation: the trainer's eval set and compiled forward pass, its batches placed
    as the trainer places training batches (so the current shard layout applies)."""

    def __init__(self, trainer: Trainer):
        from resilient_jax.data.reader import BatchReader

        self.trainer, self.evalset = trainer, trainer.evalset
        self._reader = BatchReader(self.evalset.manifest, trainer.local_rows())

    def run(self, params, completed: int) -> EvalRecord:
        trainer, started = self.trainer, time.perf_counter()
        results = []
        rows = lo, hi = trainer.local_rows()
        for i in range(self.evalset.batches):
            batch = self._reader.read_ids(self.evalset.batch_ids(i)[lo:hi], step=completed)
            tokens, weights = trainer._place(batch, rows)
            result = trainer.evaluate(params, tokens, weights, np.int32(i), trainer.layout)
            results.append((result.shard_loss, result.shard_weight))
        return combine(completed, jax.device_get(results), time.perf_counter() - started)

    def close(self) -> None:
        self._reader.close()
