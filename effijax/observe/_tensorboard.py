"""TensorBoard event files, written with tensorboardX (the ``tensorboard`` extra)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from effijax.errors import ConfigError
from effijax.observe._sink import scalars

__all__ = ["TensorBoardSink"]


class TensorBoardSink:
    """Writes each step's scalars, named values and Markdown text as TensorBoard events.

    A resumed run passes ``start_step`` (the checkpoint's step): the writer opens with
    tensorboardX's ``purge_step=start_step + 1``, which tells TensorBoard's readers to drop
    whatever the earlier process logged after that step (it ran those steps past its last
    checkpoint before it died), so the stream holds one value per step.

    Args:
      logdir: the event files' directory (created if missing).
      start_step: the step the run starts from (0: a fresh run).
      flush_s: seconds between flushes to disk (the writer also flushes on ``close``).

    Raises:
      ConfigError: tensorboardX is not installed (``pip install 'effijax[tensorboard]'``).

    Example:
      >>> import tempfile
      >>> sink = TensorBoardSink(tempfile.mkdtemp())
      >>> sink.log({"step": 1, "loss": 2.5, "learning_rate": 1e-3})
      >>> sink.values(1, {"eval/loss": 2.4})
      >>> sink.text("memory", "| per device | bytes |", 0)
      >>> sink.close()
      >>> from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
      >>> events = EventAccumulator(sink.logdir)
      >>> _ = events.Reload()
      >>> [(e.step, e.value) for e in events.Scalars("train/loss")]
      [(1, 2.5)]
    """

    def __init__(self, logdir: str | os.PathLike, *, start_step: int = 0, flush_s: int = 10):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ConfigError("tensorboard", True, "needs tensorboardX: pip install "
                              "'effijax[tensorboard]'") from None
        self.logdir = str(logdir)
        os.makedirs(self.logdir, exist_ok=True)
        self._writer = SummaryWriter(self.logdir, purge_step=start_step + 1 if start_step
                                     else None, flush_secs=flush_s)

    def log(self, record: Mapping) -> None:
        """Writes every number of a step's record (see :func:`~effijax.observe.scalars`)."""
        step = int(record["step"])
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, step)

    def values(self, step: int, values: Mapping[str, float]) -> None:
        """Writes named scalars at ``step`` (e.g. ``eval/loss``)."""
        for tag, value in values.items():
            self._writer.add_scalar(tag, float(value), int(step))

    def text(self, tag: str, text: str, step: int) -> None:
        """Writes Markdown text (TensorBoard's Text tab)."""
        self._writer.add_text(tag, text, int(step))

    def close(self) -> None:
        """Flushes and closes the event file."""
        self._writer.close()
