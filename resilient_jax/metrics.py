"""Run outputs that a person or a tool reads while and after training.

metrics.jsonl (one JSON object per logged step, plus events), TensorBoard event files
(tensorboardX), and the console: a live tqdm bar on a TTY, plain lines otherwise. Only the
process that owns the run directory (process 0) writes.

Step numbers: "step k" is the update that brings the run to k completed steps (k = 1..train.steps),
the number the checkpoint of the resulting state carries. Every record, TensorBoard point and
progress line uses it.

Resumes: a MetricsLog opened at `start_step` (the completed steps of the state the run continues
from) drops the metrics.jsonl records of later steps and opens TensorBoard with
purge_step = start_step + 1, so readers hide the abandoned branch: after any number of resumes,
each step appears exactly once in both.

Console: every message goes through `console` (tqdm.write while the bar is up), so a message never
shares a line with the bar; events are printed as sentences and kept as JSON in metrics.jsonl.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensorboardX import SummaryWriter
from tqdm import tqdm

METRICS_FILE = "metrics.jsonl"


def rewind_metrics(path: Path, step: int) -> int:
    """Drops metrics.jsonl records of steps > `step` (they are recomputed); returns how many.

    After a crash the steps after the checkpoint run again; rewinding keeps exactly one record
    per step, the one on the trajectory the checkpoints continue. The resume event says how many
    records were dropped.
    """
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record_step = json.loads(line).get("step")
        except ValueError:
            dropped += 1  # a line torn by the crash
            continue
        if isinstance(record_step, int) and record_step > step:
            dropped += 1
        else:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)
    return dropped


def logged_evals(path: Path) -> dict[int, float]:
    """{step: loss} of the eval events in metrics.jsonl."""
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "eval" and isinstance(record.get("step"), int):
            out.setdefault(record["step"], record.get("loss"))  # the first is the one kept
    return out


def _same_float(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


@dataclass
class StepWindow:
    """The steps since the last logged line; the next line reports their averages."""

    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    data_wait_seconds: float = 0.0

    def add(self, loss: float, seconds: float, data_wait_seconds: float) -> None:
        self.losses.append(loss)
        self.seconds += seconds
        self.data_wait_seconds += data_wait_seconds

    def __len__(self) -> int:
        return len(self.losses)

    def values(self, tokens_per_step: int) -> dict[str, float]:
        steps = len(self.losses)
        return {
            "loss": sum(self.losses) / steps,
            "loss_last": self.losses[-1],
            "window_steps": steps,
            "step_seconds": self.seconds / steps,
            "data_wait_seconds": self.data_wait_seconds,
            "tokens_per_s": tokens_per_step * steps / self.seconds if self.seconds > 0 else None,
        }


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and abs(value) >= 1e4:
        return f"{value / 1e3:.1f}k"
    return f"{value:.4g}"


def describe(record: dict[str, Any]) -> str:
    """An event as a sentence for the console (metrics.jsonl keeps the record itself)."""
    kind, step = record.get("event", "event"), record.get("step")
    if kind == "resume":
        after, lost = record.get("after"), record.get("steps_lost") or 0
        why = {None: "", "unknown": "", "crash": " after a crash (a restart)", "done": " after the finished run"}
        text = f"resumed at step {step} from {record.get('checkpoint')}{why.get(after, f' after a clean stop ({after})')}"
        if lost:
            text += f"; {lost} completed steps run again"
        dropped = record.get("dropped_metrics") or 0
        return text + (f"; dropped {dropped} metrics records of later steps" if dropped else "")
    if kind == "config_change":
        changes = ", ".join(f"{k} {record['from'].get(k)!r} -> {record['to'].get(k)!r}" for k in record.get("keys", []))
        allowed = record.get("allowed") or []
        tail = f" (allowed by --allow-config-change {','.join(allowed)})" if allowed else ""
        return f"config changed at step {step}: {changes}{tail}"
    if kind == "topology_change":
        return (f"topology changed at step {step}: {record.get('from_text')} -> {record.get('to_text')}; "
                "the state was resharded onto the new mesh")
    if kind == "commit_change":
        old, new = record.get("from") or {}, record.get("to") or {}
        return (f"code changed since the checkpoint of step {step}: commit {str(old.get('commit'))[:12]} -> "
                f"{str(new.get('commit'))[:12]} (recorded)")
    if kind == "quarantine":
        return (f"step {step}: data shard {record.get('shard')} gave non-finite values "
                f"({len(record.get('samples', []))} samples); quarantined, the step is re-read without it")
    if kind == "eval":
        return (f"eval at step {step}: loss {record.get('loss', float('nan')):.4f}, perplexity "
                f"{_num(record.get('perplexity'))} ({_num(record.get('tokens'))} tokens in {record.get('batches')} "
                f"batches, {record.get('seconds', 0.0):.1f} s)")
    if kind == "compile":
        cached = " (from the compile cache)" if record.get("cache_hit") else ""
        return f"compiled the train step in {record.get('seconds', 0.0):.1f} s{cached}"
    rest = ", ".join(f"{k} {v}" for k, v in sorted(record.items()) if k not in ("event", "step", "time"))
    return f"{kind} at step {step}" + (f": {rest}" if rest else "")


class MetricsLog:
    def __init__(self, run_dir: Path, total_steps: int, *, progress: str = "auto", start_step: int = 0,
                 enabled: bool = True):
        """`start_step`: completed steps of the state this run continues from (0: a fresh run);
        everything logged earlier for later steps is dropped (see the module docstring)."""
        self.enabled = enabled
        self.total_steps = total_steps
        self.dropped = 0  # metrics.jsonl records of steps after start_step, dropped on open
        self._jsonl = None
        self._tb = None
        self._bar = None
        self._use_bar = False
        self._start_step = start_step
        self._plain = False
        self._evals: dict[int, float] = {}  # step -> eval loss already in metrics.jsonl
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.dropped = rewind_metrics(run_dir / METRICS_FILE, start_step)
        self._evals = logged_evals(run_dir / METRICS_FILE)
        self._jsonl = open(run_dir / METRICS_FILE, "a", buffering=1)
        # tensorboardX names files by the second they were opened: the suffix keeps two writers
        # opened within one second (a quick resume) from overwriting each other, in opening order.
        self._tb = SummaryWriter(logdir=str(run_dir / "tensorboard"), purge_step=start_step + 1,
                                 filename_suffix=f".{time.time_ns()}")
        self._use_bar = progress == "bar" or (progress == "auto" and sys.stderr.isatty())
        self._plain = progress == "plain" or (progress == "auto" and not self._use_bar)

    def _progress_bar(self):
        """The bar, drawn from the first step on: restoring and compiling are not in its rate."""
        if self._bar is None and self._use_bar:
            self._bar = tqdm(total=self.total_steps, initial=self._start_step, unit="step", dynamic_ncols=True)
        return self._bar

    def event(self, record: dict[str, Any]) -> None:
        """A non-metric event (quarantine, resume, ...): JSON to metrics.jsonl, a sentence to the console."""
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({**record, "time": time.time()}, sort_keys=True) + "\n")
        self.console(describe(record))

    def eval(self, record: dict[str, Any]) -> None:
        """An evaluation: an event, plus eval/* scalars in TensorBoard. A step evaluated again (a
        resume at an eval step) is written once; a second value that differs says so -- the eval
        loss is a function of the params, so it never should."""
        if not self.enabled:
            return
        step, loss = record["step"], record["loss"]
        if step in self._evals:
            if _same_float(self._evals[step], loss):
                self.console(f"eval at step {step} again (resumed at an eval step): the same loss, bit for bit")
            else:
                self.console(f"warning: eval at step {step} gave loss {loss!r} this time, {self._evals[step]!r} "
                             "before (eval.dataset or eval.batches changed on resume, or a bug: the same params "
                             "and eval set always give the same bits); the first is kept in metrics.jsonl")
            return
        self._evals[step] = loss
        self.event(record)
        for name in ("loss", "perplexity"):
            self._tb.add_scalar(f"eval/{name}", record[name], step)
        self._tb.flush()

    def log(self, step: int, values: dict[str, float | None]) -> None:
        """Step `step`'s metrics (None: not known here, e.g. MFU on a CPU); adds a wall-clock time."""
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **values}, sort_keys=True) + "\n")
        for name, value in values.items():
            if value is not None:
                self._tb.add_scalar(f"train/{name}", value, step)
        # Out of tensorboardX's queue now, like the line-buffered JSONL: a crash must not lose steps
        # up to the checkpoint it resumes from (the purge on resume only hides the later ones).
        self._tb.flush()
        if self._progress_bar() is not None:
            self._bar.set_postfix_str(
                f"loss={_num(values.get('loss'))} lr={_num(values.get('lr'))} tok/s={_num(values.get('tokens_per_s'))}",
                refresh=False)
        elif self._plain:
            mfu = values.get("mfu")
            print(f"step {step}/{self.total_steps}: loss {_num(values.get('loss'))} "
                  f"(last {_num(values.get('loss_last'))}) | lr {_num(values.get('lr'))} | "
                  f"{_num(values.get('tokens_per_s'))} tok/s | mfu {'-' if mfu is None else f'{mfu:.1%}'}",
                  flush=True)

    def advance(self, n: int = 1) -> None:
        if self._progress_bar() is not None:
            self._bar.update(n)

    def console(self, text: str) -> None:
        """The one way to print while a run is going (the bar is cleared and redrawn around it)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        """Closes the files and the bar; `console` still prints afterwards (the final line)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._use_bar = False
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
