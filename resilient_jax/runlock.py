"""RunLock: one run at a time per run.dir.

`<run.dir>/run.lock` holds the holder's pid and host (JSON) and is flock()ed for as long as the
run lives, so the kernel releases it the moment the holder dies, however it dies:

    held by a live process            -> refused (RunLocked names the holder's pid and host)
    left by a dead pid on this host   -> taken over, with a warning naming the dead holder
    left by a process on another host -> refused: from here it cannot be told whether that run is
                                         alive (delete the file once it is not)

The lock is the first thing a run writes into run.dir; the file is removed when the run ends (and
the directories this run created for it, if it left them empty).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_NAME = "run.lock"


class RunLocked(ValueError):
    """Another run holds the run directory (a user-fixable condition: exit 2, one line)."""


def _read_holder(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode(errors="replace")
    try:
        holder = json.loads(text)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


class RunLock:
    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None
        self.took_over: dict | None = None  # the dead holder whose lock this run took over
        self._created_dirs: list[Path] = []  # made by acquire, deepest first: removed if left empty

    def acquire(self) -> "RunLock":
        missing = self.run_dir
        while not missing.exists():
            self._created_dirs.append(missing)
            missing = missing.parent
        self.run_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise RunLocked(self._in_use(_read_holder(fd))) from None
                if self._still_linked(fd):
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # the holder removed the file between our open and flock: open the new one
        try:
            holder = _read_holder(fd)
            if holder:
                self._take_over(holder)
            me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, (json.dumps(me) + "\n").encode())
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def _still_linked(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def _in_use(self, holder: dict) -> str:
        who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
        return (f"run.dir {self.run_dir} is in use by another run ({who}, lock {self.path}); wait for it "
                "to finish, or pick another --set run.dir=...")

    def _take_over(self, holder: dict) -> None:
        """The flock was free, so the holder is gone (a live holder on this host always holds it) --
        unless it ran on another host: flock on a shared filesystem may not reach across machines,
        and this host cannot check another's pids."""
        host = holder.get("host")
        if host != socket.gethostname():
            raise RunLocked(f"run.dir {self.run_dir} is locked by pid {holder.get('pid')} on host {host} "
                            f"({self.path}); if that run is no longer alive, delete the lock file")
        self.took_over = holder

    def warning(self) -> str | None:
        if self.took_over is None:
            return None
        return (f"warning: took over the stale lock of pid {self.took_over.get('pid')} on host "
                f"{self.took_over.get('host')} in {self.path} (that process is gone)")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
            for created in self._created_dirs:  # a run that wrote nothing (it failed at start-up)
                try:                              # leaves no empty run.dir behind
                    created.rmdir()
                except OSError:
                    break
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
