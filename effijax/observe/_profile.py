"""A ``jax.profiler`` trace of chosen training steps."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import jax

from effijax.errors import ConfigError, whole_number

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

    A resumed run passes ``start_step``: steps already done are not traced again; the rest
    of the range is.

    Args:
      directory: where the trace goes.
      first, last: the steps to trace, ``1 <= first <= last``.
      start_step: the step the loop starts from (its first dispatched step is
        ``start_step + 1``).
      perfetto: also write the Perfetto trace.

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
                 start_step: int = 0, perfetto: bool = True):
        if not (whole_number("profile_steps", first) <= whole_number("profile_steps", last)):
            raise ConfigError("profile_steps", f"{first}:{last}", "expected 1 <= first <= last")
        self.directory = Path(directory)
        self.first, self.last, self.perfetto = first, last, perfetto
        self.next_step = start_step + 1
        self.tracing = False
        self.finished = start_step >= last

    def wrap(self, step_fn: Callable) -> Callable:
        """``step_fn`` with the trace started, annotated and stopped around the chosen
        steps; call the result once per step, in order."""

        def step(*args, **kwargs):
            k = self.next_step
            self.next_step += 1
            if not self.tracing and not self.finished and self.first <= k <= self.last:
                self.directory.mkdir(parents=True, exist_ok=True)
                jax.profiler.start_trace(str(self.directory),
                                         create_perfetto_trace=self.perfetto)
                self.tracing = True
            if not self.tracing:
                return step_fn(*args, **kwargs)
            with jax.profiler.StepTraceAnnotation("train", step_num=k):
                out = step_fn(*args, **kwargs)
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
            jax.profiler.stop_trace()

    def trace_files(self) -> list[Path]:
        """The ``.xplane.pb`` files written under ``directory`` (oldest first)."""
        return sorted(self.directory.glob("plugins/profile/*/*.xplane.pb"))
