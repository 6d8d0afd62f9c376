"""Ctrl-C in the ``effijax`` program: one line on standard error and exit status 130, at once.

Python turns SIGINT into a ``KeyboardInterrupt`` that unwinds the main thread from wherever it
is, and in a JAX program that is rarely harmless:

* interrupted while XLA compiles, the main thread stops waiting but the compilation goes on in
  XLA's thread pool; the interpreter then tears down, frees the XLA client and its devices
  under that compilation, and the compiling thread crashes on them (SIGSEGV);
* interrupted while jaxlib's nanobind extension is being imported, Python frees the half-made
  module and nanobind's module destructor crashes (SIGSEGV);
* raised inside a garbage-collection callback (XLA registers one), the interrupt is printed as
  "Exception ignored" and dropped: the run goes on as if Ctrl-C had not been pressed.

So the program (and only it: a notebook or a test calling the library keeps its
``KeyboardInterrupt``) handles SIGINT itself: it flushes what was printed, writes one line and
ends the process with ``os._exit``, with no unwinding, no teardown and no thread left to run
into freed memory. What is on disk stays usable, as after a SIGKILL: every file of a run is
written whole or not at all (``config.json`` through a rename, each ``metrics.jsonl`` record in
one ``write``, a checkpoint committed by renaming its temporary folder, which the next run
removes), and the kernel releases the run directory's lock.

While the training loop runs, :class:`effijax.run.StopFlag` takes SIGINT over (a stop at the
next step boundary that saves and exits 0) and hands it back when the loop ends; the
evaluation, export and final save after the loop are interrupted here again.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

__all__ = ["ExitOnInterrupt", "install", "describe"]


class ExitOnInterrupt:
    """A SIGINT handler that writes ``line()`` to standard error and ends the process.

    ``line`` is called in the handler, so it may say what holds at that moment (a run
    directory's newest checkpoint); it should only look (no imports, no threads). If it fails,
    the handler says ``fallback``.
    """

    def __init__(self, line: Callable[[], str], fallback: str):
        self.line = line
        self.fallback = fallback

    def __call__(self, signum, frame) -> None:
        # A second Ctrl-C while this one is being reported (a look at a stalled file system)
        # ends the process without a second line.
        signal.signal(signum, lambda *_: os._exit(128 + signum))
        try:
            text = self.line()
        except Exception:  # a failed look at the disk must not cost the exit
            text = self.fallback
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # e.g. the signal arrived inside this stream's own write
                pass
        try:
            os.write(2, (text + "\n").encode())
        finally:
            os._exit(128 + signum)


def install(command: str | None) -> bool:
    """Ends the process with one line and status 130 on SIGINT from now on (until a
    :class:`~effijax.run.StopFlag` takes the signal over for a training loop). Returns whether
    it did: only the main thread can install a handler, and a SIGINT the parent process set to
    be ignored (``nohup``, a background job of a script) stays ignored.

    Args:
      command: the subcommand, for the line (``effijax train: interrupted``); None before one
        is known.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return False
    line = f"effijax {command}: interrupted" if command else "effijax: interrupted"
    signal.signal(signal.SIGINT, ExitOnInterrupt(lambda: line, line))
    return True


def describe(line: Callable[[], str]) -> None:
    """From now on the interruption's line is ``line()``, where :func:`install` put the handler
    (the program); elsewhere (the library called in-process) nothing changes."""
    handler = signal.getsignal(signal.SIGINT)
    if isinstance(handler, ExitOnInterrupt):
        handler.line = line
