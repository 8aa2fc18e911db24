"""Orbax's failure noise: what it leaves behind after a save or restore fails, and how to quiet it.

When one array of a save or restore fails (a full disk, a truncated file), orbax abandons the
other items' writes and reads: their threads keep running, their coroutines are garbage collected
with exceptions nobody retrieved, their tensorstore callbacks hit a closed event loop, and its
threads log each of those with a full traceback. The store reports the failure once, as one line
naming the field (CheckpointError / CheckpointSaveError), so this module

- drops exactly those records and unraisable errors (matched narrowly; everything else still
  reaches the previous logging handler or sys.unraisablehook);
- waits for the abandoned writer threads, so a temporary directory removed after a failed save is
  not recreated behind our back;
- classifies and shortens errors for that one line.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import threading
import time


class _RethrownSaveFailures(logging.Filter):
    """Drops orbax's tracebacks of a failed background save: CheckpointStore re-raises that error
    as one CheckpointSaveError line, and the CLI promises one line, not pages of threads."""

    PATTERNS = ("_SignalingThread.run() raised an exception", "Handler Commit operations",
                "Save Finalize thread", "Failed to finalize")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (record.levelno >= logging.ERROR and any(p in message for p in self.PATTERNS))


class _AbandonedOrbaxFutures(logging.Filter):
    """Drops asyncio's "exception was never retrieved" for the sibling reads/writes orbax abandons
    once one array of a restore or save failed; that failure reaches the user as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("exception was never retrieved" in message
                    and any(word in message for word in ("OCDBT", "TensorStore", "orbax")))


def install_log_filters() -> None:
    """Adds the two filters above to the absl and asyncio loggers (once)."""
    for name, cls in (("absl", _RethrownSaveFailures), ("asyncio", _AbandonedOrbaxFutures)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, cls) for f in logger.filters):
            logger.addFilter(cls())


def join_background_writes(timeout: float = 120.0) -> None:
    """Waits for orbax's per-item background writer threads (private class; skipped if it moved)."""
    from orbax.checkpoint._src.futures import future as orbax_future

    thread_cls = getattr(orbax_future, "_SignalingThread", None)
    if thread_cls is None:
        return
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if isinstance(thread, thread_cls) and thread is not threading.current_thread():
            try:
                thread.join(max(0.0, deadline - time.monotonic()))
            except Exception:  # orbax's join re-raises the thread's own failure: already reported
                pass


def _abandoned_async_error(unraisable) -> bool:
    """Errors orbax leaves behind after a save or restore failed -- already reported by us."""
    if unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed":
        # Tensorstore writes that orbax abandoned finish and call back into a closed event loop.
        return True
    code = getattr(unraisable.object, "cr_code", None)
    # A sibling read/write coroutine that failed too but was never awaited (garbage collected).
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


def quiet_abandoned_async_errors() -> None:
    """Each abandoned error above reaches sys.unraisablehook, which prints a page of traceback;
    the CheckpointError/CheckpointSaveError already says what failed in one line, so a store drops
    exactly those (everything else still reaches the previous hook)."""
    previous = sys.unraisablehook
    if getattr(previous, "_drops_abandoned_async", False):
        return

    def hook(unraisable):
        if not _abandoned_async_error(unraisable):
            previous(unraisable)

    hook._drops_abandoned_async = True
    sys.unraisablehook = hook


def is_disk_full(error: BaseException) -> bool:
    seen: set[int] = set()
    # Each exception once: orbax re-raises a stored failure inside the handler of an error chained
    # from it, and the chain becomes a cycle (seen: a save's cleanup spinning here forever).
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(error) or "ENOSPC" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:300]


def failed_path(error: BaseException) -> str:
    """The file a failed write was writing, as far as the error tells.

    Tensorstore names the file in its message; Python's file layer, under orbax's metadata writers,
    raises a bare `OSError(28, 'No space left on device')` with no filename. Its innermost frame
    that holds a path (etils' `write_text(self, ...)`) still knows it, so look there.
    """
    if getattr(error, "filename", None):
        return str(error.filename)
    if os.sep in str(error):
        return str(error)
    frame_path = ""
    tb = error.__traceback__
    while tb is not None:
        for name in ("self", "path", "filename"):
            value = tb.tb_frame.f_locals.get(name)
            if isinstance(value, (str, os.PathLike)) and os.sep in os.fspath(value):
                frame_path = os.fspath(value)
                break
        tb = tb.tb_next
    return frame_path or str(error)
