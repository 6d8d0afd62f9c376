"""A failed checkpoint write, said in one line: the terminal gets the reason, a log the rest.

orbax writes in background threads; a failed write (a full disk, a read-only folder) logs a
traceback per thread through absl, and closing the manager afterwards lets the write's
remaining callbacks meet a closed event loop, each printing another traceback. A run needs one
line: :class:`~effijax.errors.SaveError` (the step, the directory, the operating system's
reason, the log's path). This module turns the failure into that line and sends everything
else to ``OUT/orbax.log`` and ``OUT/error.log``:

* :func:`orbax_log` routes orbax's log records to a file while checkpoints are written;
* :func:`save_errors` turns a failed write (or close) into :class:`SaveError`;
* :func:`write_errors` turns a failed write of any other file of the run directory (metrics,
  exports, the summary) into :class:`~effijax.errors.WriteError`, the same way;
* :func:`save` offers a state to the checkpointer under :func:`save_errors`;
* :func:`last_good` says where a run that went non-finite can resume from;
* :func:`rest_of_stderr_to` sends what the unfinished writes print at exit to the log.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import numpy as np

from effijax import atomic
from effijax.errors import SaveError, WriteError

__all__ = ["orbax_log", "save_errors", "write_errors", "save", "step_of", "failure_reason",
           "last_good", "rest_of_stderr_to", "keep_room", "free_room", "ROOM_FILE"]


def _per_process(out, stem: str) -> Path:
    """``OUT/<stem>.log`` on process 0, ``OUT/<stem>-<process>.log`` on the others."""
    index = jax.process_index()
    return Path(out) / (f"{stem}.log" if index == 0 else f"{stem}-{index}.log")


class _QuietFileHandler(logging.FileHandler):
    """A log file that is opened without following a link, and that stays silent when it
    cannot be written (a full disk): logging's default prints a traceback per record, and the
    failed write itself is reported in one line."""

    def _open(self):
        return atomic.open_append(self.baseFilename)

    def handleError(self, record) -> None:
        pass


@contextlib.contextmanager
def orbax_log(out) -> Iterator[None]:
    """Sends orbax's log records (absl's logger) to ``OUT/orbax.log`` (``orbax-<process>.log``)
    while checkpoints are written: a failed background write logs a traceback per thread,
    hundreds of lines that the one-line :class:`SaveError` replaces on the terminal. The file
    is created only if something is logged."""
    handler = _QuietFileHandler(_per_process(out, "orbax"), delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger = logging.getLogger("absl")
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
        handler.close()


@contextlib.contextmanager
def _fd_to(fd: int, stream) -> Iterator[None]:
    """File descriptor ``fd`` writes to ``stream``'s file for the block (what threads of C
    libraries print goes there too)."""
    sys.__stderr__.flush()
    saved = os.dup(fd)
    os.dup2(stream.fileno(), fd)
    try:
        yield
    finally:
        stream.flush()
        os.dup2(saved, fd)
        os.close(saved)


@contextlib.contextmanager
def _logs_to(stream, *names: str) -> Iterator[None]:
    """The named loggers write only to ``stream`` for the block."""
    handler = logging.StreamHandler(stream)
    loggers = [logging.getLogger(n) for n in names]
    saved = [(x.handlers[:], x.propagate) for x in loggers]
    for x in loggers:
        x.handlers, x.propagate = [handler], False
    try:
        yield
    finally:
        for x, (handlers, propagate) in zip(loggers, saved, strict=True):
            x.handlers, x.propagate = handlers, propagate


def step_of(state) -> int:
    """The state's step without a gather (every process holds the replicated scalar)."""
    step = state.step
    return int(np.asarray(step.addressable_data(0)) if hasattr(step, "addressable_data")
               else step)


def failure_reason(e: BaseException) -> str:
    """The operating system's words for a failed write, found anywhere in the chain.

    Example:
      >>> failure_reason(ValueError("a message\\nits last line"))
      'ValueError: its last line'
      >>> e = RuntimeError("save failed")
      >>> e.__cause__ = OSError(28, "No space left on device")
      >>> failure_reason(e)
      '[Errno 28] No space left on device'
    """
    seen, todo = set(), [e]
    while todo:
        x = todo.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.strerror:
            return f"[Errno {x.errno}] {x.strerror}" if x.errno else x.strerror
        code = re.search(r"os_error_code='(\d+)'", str(x))  # tensorstore's form of errno
        if code:
            return f"[Errno {code.group(1)}] {os.strerror(int(code.group(1)))}"
        todo.extend([x.__cause__, x.__context__, *getattr(x, "exceptions", ())])
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1].strip()}" if lines else type(e).__name__


ROOM_FILE = ".error-log-room"
_ROOM_BYTES = 32 * 1024  # a few tracebacks


def keep_room(out) -> None:
    """Sets aside room on the run directory's disk for ``error.log``: a file of zeros that
    is removed before a failure is logged, so a full disk still gets its traceback written.
    :func:`free_room` removes it when the run ends. Best effort: without room for it, the run
    goes on (and a failure may find no room for its traceback)."""
    with contextlib.suppress(OSError):
        atomic.write_bytes(_room(out), bytes(_ROOM_BYTES))


def free_room(out) -> None:
    """Removes what :func:`keep_room` set aside (nothing if there is nothing)."""
    room = _room(out)
    if room.is_file() and not room.is_symlink():
        room.unlink()


def _room(out) -> Path:
    index = jax.process_index()
    return Path(out) / (ROOM_FILE if index == 0 else f"{ROOM_FILE}-{index}")


def _write_log(out, what: str, e: BaseException) -> Path | None:
    """Appends what failed and its traceback to ``OUT/error.log`` (never through a link);
    None if that cannot be written (the disk is full for the log too)."""
    log = _per_process(out, "error")
    with contextlib.suppress(OSError):
        free_room(out)
    try:
        with atomic.open_append(log) as f:
            f.write(f"{what}\n{''.join(traceback.format_exception(e))}")
    except OSError:
        return None
    return log


def _release_into(log: Path | None, release: Callable[[], None]) -> None:
    """Calls ``release`` with everything it prints going to ``log``."""
    # Closing a manager whose write failed lets the write's remaining callbacks meet a
    # closed event loop, each printing a traceback: into the log, not the terminal.
    with (atomic.open_append(log) if log is not None else open(os.devnull, "a")) as sink, \
            contextlib.redirect_stderr(sink), _logs_to(sink, "asyncio", "absl"), \
            _fd_to(2, sink):
        release()
        time.sleep(1.0)  # the failed write's other array writes end (and print) here
        gc.collect()  # and its tasks report themselves when collected


@contextlib.contextmanager
def save_errors(out, ckpt, step: int, release: Callable[[], None]) -> Iterator[None]:
    """Turns a failed checkpoint write into :class:`SaveError`: one line, and the traceback
    in ``OUT/error.log`` (``error-<process>.log`` on the other processes).

    Args:
      out: the run directory.
      ckpt: the run's :class:`~effijax.checkpoint.Checkpointer` (None once closed).
      step: the step being saved (an asynchronous write surfaces at a later call: the
        checkpointer's ``failed_step`` is said instead when it has one).
      release: closes the checkpointer, ignoring its errors (the write's failure is the one
        to report), and releases the run directory.
    """
    try:
        yield
    except Exception as e:
        failed = ckpt.failed_step if ckpt is not None else None
        step = failed if failed is not None else step
        directory = str(ckpt.directory if ckpt is not None else Path(out) / "checkpoints")
        log = _write_log(out, f"step {step}: saving to {directory}", e)
        _release_into(log, release)
        raise SaveError(step, directory, failure_reason(e),
                        None if log is None else str(log)) from None


@contextlib.contextmanager
def write_errors(out, release: Callable[[], None] | None = None) -> Iterator[None]:
    """Turns a failed write of a run directory's file (an ``OSError``: a full disk, a link
    refused) into :class:`~effijax.errors.WriteError`: one line naming the file, the traceback
    in ``OUT/error.log``. :class:`SaveError` and other errors pass through as they are.

    Args:
      out: the run directory.
      release: called (its output into the log) before the error is raised: closes the
        checkpointer, whose writes in flight fail on the same full disk, and the directory.

    Example:
      >>> import tempfile
      >>> out = tempfile.mkdtemp()
      >>> try:
      ...     with write_errors(out):
      ...         raise OSError(28, "No space left on device", out + "/metrics.jsonl")
      ... except WriteError as e:
      ...     print(e.reason, os.path.basename(e.path), os.path.basename(e.log))
      [Errno 28] No space left on device metrics.jsonl error.log
    """
    try:
        yield
    except OSError as e:
        path = e.filename if e.filename is not None else out
        log = _write_log(out, f"writing {path}", e)
        if release is not None:
            _release_into(log, release)
        raise WriteError(os.fspath(path), failure_reason(e),
                         None if log is None else str(log)) from None


def save(ckpt, state, *, out, release: Callable[[], None], force: bool = False,
         extra=None):
    """``ckpt.save(state, force=force, extra=extra)`` (a
    :class:`~effijax.checkpoint.SaveResult`), a failed write raised as :class:`SaveError` (see
    :func:`save_errors`)."""
    with save_errors(out, ckpt, step_of(state), release):
        return ckpt.save(state, force=force, extra=extra)


def last_good(ckpt, close: Callable[[], None]) -> str:
    """Where a run that went non-finite can resume from; closes the checkpointer (``close``)
    once its writes in flight, which hold older, finite states, have ended."""
    if ckpt is None:
        return "no checkpoint (--no-checkpoints)"
    ckpt.wait()
    last = ckpt.latest_step()
    directory = ckpt.directory
    close()
    if last is None:
        return "no checkpoint yet"
    return (f"the last good checkpoint is step {last} in {directory}; rerun the same command "
            "to resume from it")


def rest_of_stderr_to(log: str | None) -> None:
    """After a failed checkpoint write, the storage library's unfinished writes report
    themselves as the process exits (a traceback each): they go to the log, after the one
    line already printed. Only a real terminal's stderr is redirected."""
    if log is None or sys.stderr is not sys.__stderr__:
        return
    try:
        with atomic.open_append(log) as f:  # never through a link; fd 2 keeps its own copy
            os.dup2(f.fileno(), 2)
    except OSError:
        return
    for name in ("asyncio", "absl"):
        logging.getLogger(name).propagate = True
