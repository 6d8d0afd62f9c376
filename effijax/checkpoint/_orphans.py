"""The reads a failed orbax restore leaves behind, collected without noise.

orbax (0.12.7 and 0.12.8 at least) runs a restore's reads as asyncio tasks on an event loop
of its own and closes that loop as soon as the restore raises. When one array file is damaged,
its read fails first and the other reads are left pending on the closed loop:

- each pending read's coroutine, when garbage collected, raises from its ``except
  BaseException`` handler, and Python prints "Exception ignored in: <coroutine ...>";
- each TensorStore read that completes afterwards calls the closed loop, and Python prints
  "RuntimeError: Event loop is closed".

A resume that meets one damaged step printed dozens of such tracebacks (and under pytest's
``-W error`` each is a failure), although the damaged step is handled: set aside, reported in
one line, and the previous step restored.

:func:`guard` wraps a restore (and orbax's metadata reads, which run the same way). If it
raises, it finds the closed loop in the traceback and closes the pending reads' coroutines at
once (their errors are the damage already reported). While a read runs, and afterwards for
the loops of failed reads, the process's unraisable hook drops "Event loop is closed" raised
by a closed loop. Everything else goes to the hook that was there before.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import weakref

# The closed loops of failed restores; weak, so a loop is forgotten once nothing holds it.
_DEAD_LOOPS: weakref.WeakSet = weakref.WeakSet()
_LOCK = threading.Lock()
_installed_hook = None
_restoring = 0  # restores in flight: their loop may close before reap() has seen it


@contextlib.contextmanager
def guard():
    """Wraps an orbax read (a restore, or a step's metadata): if it fails, the reads it left
    pending are reaped and stay quiet.

    Example:
      >>> with guard():
      ...     pass
    """
    global _restoring
    _install_hook()
    with _LOCK:
        _restoring += 1
    try:
        yield
    except BaseException as e:
        reap(e)
        raise
    finally:
        with _LOCK:
            _restoring -= 1


def reap(error: BaseException) -> int:
    """Closes the reads a failed restore left pending; returns how many were closed.

    Args:
      error: the exception the restore raised; its traceback passes through the closed
        event loop's ``run_until_complete``.

    Returns:
      The number of pending tasks closed (0 when the traceback holds no closed loop, as when
      the restore failed before reading).

    Example:
      >>> reap(ValueError("not from a restore"))
      0
    """
    closed = 0
    for loop in _closed_loops(error.__traceback__):
        with _LOCK:
            _DEAD_LOOPS.add(loop)
        _install_hook()
        for task in asyncio.all_tasks(loop):
            # A task that is never run again must not log "destroyed but it is pending".
            task._log_destroy_pending = False
            try:
                task.get_coro().close()
            except BaseException:  # the read's own error: the damage already reported
                pass
            closed += 1
    return closed


def _closed_loops(tb) -> list[asyncio.AbstractEventLoop]:
    """The closed event loops whose methods the traceback ``tb`` passes through."""
    found = []
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if (isinstance(owner, asyncio.AbstractEventLoop) and owner.is_closed()
                and owner not in found):
            found.append(owner)
        tb = tb.tb_next
    return found


def _from_dead_loop(unraisable) -> bool:
    return isinstance(unraisable.exc_value, RuntimeError) and any(
        _restoring or loop in _DEAD_LOOPS for loop in _closed_loops(unraisable.exc_traceback))


def _install_hook() -> None:
    """Chains a filter in front of the current ``sys.unraisablehook`` (once per hook)."""
    global _installed_hook
    with _LOCK:
        if sys.unraisablehook is _installed_hook:
            return
        previous = sys.unraisablehook

        def hook(unraisable):
            if _from_dead_loop(unraisable):
                return
            previous(unraisable)

        sys.unraisablehook = _installed_hook = hook
