"""A ``jax.profiler`` trace of chosen training steps, written into the run directory.

The trace's folders must not be links (:func:`~effijax.observe._folders.own_folder`, checked
before the trace starts and before it is written), the Perfetto file is written by effijax,
whole and never through a link (:mod:`effijax.atomic`), and a failed write (a full disk) is
one line, :class:`~effijax.errors.WriteError`, with the traceback in the run directory's
``error.log``.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable
from pathlib import Path

import jax

from effijax import atomic
from effijax.checkpoint import failure_reason, write_errors
from effijax.errors import ConfigError, whole_number
from effijax.observe._breakdown import step_breakdown
from effijax.observe._folders import own_folder

__all__ = ["Profiler"]


class Profiler:
    """Traces steps ``first`` to ``last`` (1-based, inclusive) of a training loop.

    :meth:`wrap` wraps the step function: the trace starts just before step ``first`` is
    dispatched, each traced step runs under ``jax.profiler.StepTraceAnnotation("train",
    step_num=k)`` (TensorBoard's profiler splits the timeline by these), and after dispatching
    step ``last`` it waits for that step's results and stops, so the device work of every
    traced step is inside. The trace lands in ``directory/plugins/profile/<time>/`` as
    ``<host>.xplane.pb`` (TensorBoard's and XProf's profiler tab, ``tensorboard --logdir``
    on ``directory`` or its parent) and ``perfetto_trace.json.gz`` (ui.perfetto.dev).
    ``directory``, its ``plugins/profile`` folders and their entries must not be symbolic
    links.

    A resumed run passes ``start_step``: steps already done are not traced again; the rest
    of the range is.

    Where the wrapped step is a compiled program (``jitted.lower(...).compile()``, which has
    ``as_text()``), the trace is also summed by kind of work
    (:func:`~effijax.observe.step_breakdown`) into ``breakdown.md`` beside it, kept as
    :attr:`breakdown` and handed to ``report`` (a one-line heading and the Markdown table).

    Args:
      directory: where the trace goes.
      first, last: the steps to trace, ``1 <= first <= last``.
      start_step: the step the loop starts from (its first dispatched step is
        ``start_step + 1``).
      perfetto: also write the Perfetto trace.
      run_dir: the run directory, whose ``error.log`` takes the traceback of a failed write
        (default: ``directory``'s parent).
      report: called with the breakdown's text once the trace is written (``print``, say).

    Raises:
      ConfigError: (when the trace starts or is written) a symbolic link where it is written.
      effijax.errors.WriteError: (when the trace is written) a file could not be written.

    Example:
      >>> import tempfile, jax.numpy as jnp
      >>> prof = Profiler(tempfile.mkdtemp(), 2, 3)
      >>> step = prof.wrap(lambda x, b: (x + b, {"loss": x}))
      >>> x = jnp.zeros(())
      >>> for _ in range(4):
      ...     x, metrics = step(x, 1.0)
      >>> prof.close()
      >>> [p.suffix for p in prof.trace_files()]
      ['.pb']
    """

    def __init__(self, directory: str | os.PathLike, first: int, last: int, *,
                 start_step: int = 0, perfetto: bool = True,
                 run_dir: str | os.PathLike | None = None,
                 report: Callable[[str], None] | None = None):
        if not (whole_number("profile_steps", first) <= whole_number("profile_steps", last)):
            raise ConfigError("profile_steps", f"{first}:{last}", "expected 1 <= first <= last")
        self.directory = Path(directory)
        self.run_dir = Path(run_dir) if run_dir is not None else self.directory.parent
        self.first, self.last, self.perfetto = first, last, perfetto
        self.next_step = start_step + 1
        self.tracing = False
        self.finished = start_step >= last
        self._before: set[Path] = set()  # the trace folders there before this trace
        self.report = report
        self.breakdown = None  # a StepBreakdown, once a compiled step's trace is written
        self._hlo_text: Callable[[], str] | None = None
        self._traced: list[int] = []  # the steps run inside the trace

    def wrap(self, step_fn: Callable) -> Callable:
        """``step_fn`` with the trace started, annotated and stopped around the chosen
        steps; call the result once per step, in order."""

        self._hlo_text = getattr(step_fn, "as_text", None)

        def step(*args, **kwargs):
            k = self.next_step
            self.next_step += 1
            if not self.tracing and not self.finished and self.first <= k <= self.last:
                self._before = set(self._folders())
                jax.profiler.start_trace(str(own_folder(self.directory, _INSIDE)))
                self.tracing = True
            if not self.tracing:
                return step_fn(*args, **kwargs)
            with jax.profiler.StepTraceAnnotation("train", step_num=k):
                out = step_fn(*args, **kwargs)
            self._traced.append(k)
            if k >= self.last:
                jax.block_until_ready(out)
                self.close()
            return out

        return step

    def close(self) -> None:
        """Stops a trace still running (a run stopped inside the range); idempotent."""
        if self.tracing:
            self.tracing = False
            self.finished = True
            self._write()

    def trace_files(self) -> list[Path]:
        """The ``.xplane.pb`` files written under ``directory`` (oldest first)."""
        return sorted(self.directory.glob("plugins/profile/*/*.xplane.pb"))

    def _folders(self) -> list[Path]:
        """The trace folders (``plugins/profile/<time>/``), one per trace written."""
        return [p for p in self.directory.glob("plugins/profile/*") if p.is_dir()]

    def _write(self) -> None:
        """Stops the trace, which writes it (the profiler's own writer), then its Perfetto
        file."""
        with write_errors(self.run_dir):
            own_folder(self.directory, _INSIDE)  # nothing planted while the steps ran
            try:
                jax.profiler.stop_trace()
            except RuntimeError as e:  # the profiler's writer failed: its reason, in one line
                raise OSError(None, failure_reason(e), str(self.directory)) from e
            new = [p for p in self._folders() if p not in self._before]
            folders = new or self._folders()
            if folders:
                folder = max(folders, key=lambda p: p.stat().st_mtime)
                if self.perfetto:
                    _write_perfetto(folder)
                self._summarize(folder)

    def _summarize(self, folder: Path) -> None:
        """``breakdown.md`` beside the trace: the compiled step's time by kind of work."""
        traces = sorted(folder.glob("*.trace.json.gz"))
        if self._hlo_text is None or not self._traced or len(traces) != 1:
            return
        a, b = self._traced[0], self._traced[-1]  # a resumed or stopped run traces fewer
        steps = f"step {a}" if a == b else f"steps {a}-{b}"
        try:
            self.breakdown = step_breakdown(traces[0], self._hlo_text(), len(self._traced))
        except ValueError as e:  # a backend whose trace names no HLO op: the trace still stands
            text = f"the trace of {steps} could not be summed by kind of work: {e}"
        else:
            text = (f"the compiled step's time by kind of work ({steps}, "
                    f"{1e3 * self.breakdown.step_s:.1f} ms a step; "
                    "effijax.observe.step_breakdown):\n\n" + self.breakdown.markdown())
        atomic.write_text(folder / "breakdown.md", text[:1].upper() + text[1:] + "\n")
        if self.report is not None:
            self.report(text)


# The folders the profiler's writer creates below ``directory`` and writes into.
_INSIDE = ("plugins", "plugins/profile")


def _write_perfetto(folder: Path) -> None:
    """``perfetto_trace.json.gz`` beside the trace's ``*.trace.json.gz``: the same events
    without their ``metadata`` entry, which ui.perfetto.dev does not load."""
    traces = sorted(folder.glob("*.trace.json.gz"))
    if len(traces) != 1:
        return  # no events trace to convert (or several: not one trace's folder)
    events = json.loads(gzip.decompress(traces[0].read_bytes()))
    events.pop("metadata", None)
    atomic.write_bytes(folder / "perfetto_trace.json.gz",
                       gzip.compress(json.dumps(events).encode("utf-8"), mtime=0))
