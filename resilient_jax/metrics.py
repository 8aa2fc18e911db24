"""Run outputs that a person or a tool reads while and after training.

metrics.jsonl (one JSON object per logged step), TensorBoard event files (tensorboardX), and
progress on the terminal: a live tqdm bar on a TTY, plain lines otherwise. Only the process that
owns the run directory (process 0) writes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tensorboardX import SummaryWriter
from tqdm import tqdm


class MetricsLog:
    def __init__(self, run_dir: Path, total_steps: int, *, progress: str = "auto", start_step: int = 0,
                 enabled: bool = True):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._bar = None
        self._plain = False
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self._tb = SummaryWriter(logdir=str(run_dir / "tensorboard"))
        use_bar = progress == "bar" or (progress == "auto" and sys.stderr.isatty())
        self._plain = progress == "plain" or (progress == "auto" and not use_bar)
        if use_bar:
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def event(self, record: dict[str, Any]) -> None:
        """A non-metric event (quarantine, topology change, ...): to the JSONL and the console."""
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record, sort_keys=True) + "\n")
        self.console(f"[{record.get('event', 'event')}] " + json.dumps(record, sort_keys=True))

    def log(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, **values}, sort_keys=True) + "\n")
        for name, value in values.items():
            self._tb.add_scalar(f"train/{name}", value, step)
        text = " ".join(f"{k}={v:.4g}" for k, v in values.items() if k in ("loss", "lr", "grad_norm", "tokens_per_s"))
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
        elif self._plain:
            print(f"step {step}: {text}", flush=True)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def console(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
