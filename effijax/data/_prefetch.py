"""Batches built ahead of the step: a background thread that never changes which batch a step gets.

A training batch is a pure function of ``(seed, step)`` (:func:`~effijax.data.batch_at`), so it
can be built early without changing anything: :class:`Prefetcher` calls ``batch_fn(step)`` for
the next ``depth`` steps on one worker thread while the caller's step runs (JAX dispatches the
step asynchronously, so the host is idle until it reads the step's metrics), and hands them
back in order. When ``batch_fn`` also puts the batch on the devices (the recipe's does:
``make_array_from_process_local_data``), the copy happens on the worker too.

Nothing outlives the ``with`` block: leaving it (the last step, a signal that stops the loop
early, an error in the step) stops and joins the thread and drops the batches built for steps
that never ran; resuming recomputes them from ``(seed, step)``. An exception raised by
``batch_fn`` on the worker is raised again, the same exception, by the call that asks for that
step. ``depth=0`` builds each batch in the calling thread (the same contract, no thread).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from effijax.errors import whole_number

__all__ = ["Prefetcher"]


class Prefetcher:
    """``batch_fn(step)`` for ``steps``, built up to ``depth`` steps ahead on a worker thread.

    Use it as a context manager, and call it with the steps of ``steps`` in order: the call
    for ``step`` returns ``batch_fn(step)``, built while the caller did something else.

    Args:
      batch_fn: ``step -> batch``; called on the worker thread (with ``depth > 0``), so it must
        not depend on the caller's thread (a pure function of the step does not).
      steps: the steps to build, in the order they are asked for (a ``range``).
      depth: how many built batches may wait for the caller (one more may be in the making;
        0: no thread, each call builds its batch, as ``batch_fn`` would).

    Example:
      >>> with Prefetcher(lambda step: step * step, range(3, 6), depth=2) as batches:
      ...     [batches(step) for step in range(3, 6)]
      [9, 16, 25]
      >>> with Prefetcher(lambda step: 1 // (step - 1), range(3), depth=2) as batches:
      ...     batches(0), batches(1)
      Traceback (most recent call last):
      ...
      ZeroDivisionError: integer division or modulo by zero
    """

    def __init__(self, batch_fn: Callable[[int], Any], steps: range, depth: int = 2):
        if not isinstance(steps, range) or steps.step != 1:
            raise TypeError(f"steps must be a range of consecutive steps, got {steps!r}")
        whole_number("depth", depth, minimum=0)
        self.batch_fn, self.steps, self.depth = batch_fn, steps, depth
        self._next = steps.start
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._thread: threading.Thread | None = None
        if depth and len(steps):
            self._thread = threading.Thread(target=self._work, name="effijax-prefetch",
                                            daemon=True)
            self._thread.start()

    def _work(self) -> None:
        for step in self.steps:
            if self._stop.is_set():
                return
            try:
                item = (self.batch_fn(step), None)
            except BaseException as e:  # handed to the caller, raised there
                item = (None, e)
            # Never blocks for ever: close() sets the flag, then empties the queue, so this put
            # finds room and the next turn of the loop sees the flag.
            self._queue.put(item)
            if item[1] is not None:
                return

    def __call__(self, step: int) -> Any:
        """The batch of ``step``: the next step of ``steps`` (built ahead, or now with
        ``depth=0``); raises again what building it raised."""
        if self._stop.is_set():
            raise RuntimeError("this Prefetcher is closed: its thread has stopped")
        if self._error is not None:
            raise self._error
        if step != self._next or step not in self.steps:
            raise ValueError(f"batches are read in the order of {self.steps}: expected step "
                             f"{self._next}, got {step}")
        self._next += 1
        if self._thread is None:
            return self.batch_fn(step)
        batch, error = self._queue.get()
        if error is not None:
            self._error = error
            raise error
        return batch

    def close(self) -> None:
        """Stops the worker, drops the batches built for steps not asked for, and joins the
        thread (waiting at most for the batch it is building). Idempotent."""
        self._stop.set()
        while self._thread is not None and self._thread.is_alive():
            self._drain()  # room for the worker's last put, whichever step it was building
            self._thread.join(timeout=0.05)
        self._thread = None
        self._drain()

    def _drain(self) -> None:
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.close()
