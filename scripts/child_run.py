"""One helper for the benchmark scripts: a training run in a child process, its output kept out of
the report -- and, when it fails, its own one-line reason (the `error:` line a bad config or fault
gets) shown instead of a CalledProcessError with the reason thrown away."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_quietly(cmd: list[str], cwd: Path) -> None:
    """Runs `cmd`; on a non-zero exit, stops the script with the child's last stderr lines."""
    proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        tail = [line for line in proc.stderr.splitlines() if line.strip()][-3:]
        print(f"error: a run the benchmark started failed (exit {proc.returncode}): {' '.join(cmd[1:4])} ...",
              *tail, sep="\n  ", file=sys.stderr)
        raise SystemExit(2 if proc.returncode == 2 else 1)
