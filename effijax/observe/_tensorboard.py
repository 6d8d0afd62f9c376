"""TensorBoard event files: tensorboardX's protocol buffers (the ``tensorboard`` extra), written
by effijax into the run directory.

An event file is a sequence of TFRecords (each: its length, a checksum of the length, the
serialized ``Event``, a checksum of it), named ``events.out.tfevents.<seconds>.<host>`` so that
TensorBoard reads every writer's file of a folder. The sink writes them itself, in the calling
thread, because the run directory is ours: the folder must not be a link
(:func:`~effijax.observe._folders.own_folder`), the file is created without following a link
(a name already taken, by a link or a file, is passed over for the next free one) and each
flush appends whole records without following one (:func:`effijax.atomic.append`); a write
that fails (a full disk) is one line, :class:`~effijax.errors.WriteError`, with the traceback
in the run directory's ``error.log``, and the sink writes nothing after it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from collections.abc import Mapping
from pathlib import Path

from effijax import atomic
from effijax.checkpoint import write_errors
from effijax.errors import ConfigError, WriteError
from effijax.observe._folders import own_folder
from effijax.observe._sink import scalars

__all__ = ["TensorBoardSink"]

class TensorBoardSink:
    """Writes each step's scalars, named values and Markdown text as TensorBoard events.

    A resumed run passes ``start_step`` (the checkpoint's step): the new event file starts by
    declaring ``start_step + 1`` a restart (what tensorboardX calls ``purge_step``), which tells
    TensorBoard's readers to drop whatever the earlier process logged after that step (it ran
    those steps past its last checkpoint before it died), so the stream holds one value per step.

    Args:
      logdir: the event files' folder (created if missing), inside the run directory.
      start_step: the step the run starts from (0: a fresh run).
      flush_s: seconds between writes to disk (``close`` writes what is left).
      run_dir: the run directory, whose ``error.log`` takes the traceback of a failed write
        (default: ``logdir``'s parent).

    Raises:
      ConfigError: tensorboardX is not installed (``pip install 'effijax[tensorboard]'``), or
        ``logdir`` is a symbolic link.
      effijax.errors.WriteError: (any method) an event file could not be written.

    Example:
      >>> import tempfile
      >>> sink = TensorBoardSink(tempfile.mkdtemp() + "/tensorboard")
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

    def __init__(self, logdir: str | os.PathLike, *, start_step: int = 0, flush_s: int = 10,
                 run_dir: str | os.PathLike | None = None):
        try:
            from tensorboardX import summary
            from tensorboardX.proto.event_pb2 import Event, SessionLog
            from tensorboardX.record_writer import masked_crc32c
        except ImportError:
            raise ConfigError("tensorboard", True, "needs tensorboardX: pip install "
                              "'effijax[tensorboard]'") from None
        self._summary, self._event, self._crc = summary, Event, masked_crc32c
        self.logdir = str(logdir)
        self._run_dir = Path(run_dir) if run_dir is not None else Path(logdir).parent
        self._flush_s, self._last_write = flush_s, time.monotonic()
        self._pending: list[bytes] = []
        self._broken = False
        with self._writing():
            self.path = _new_event_file(own_folder(logdir))
        self._add(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if start_step:
            self._add(Event(wall_time=time.time(), step=start_step + 1,
                            file_version="brain.Event:2"))
            self._add(Event(wall_time=time.time(), step=start_step + 1,
                            session_log=SessionLog(status=SessionLog.START)))
        self.flush()

    def log(self, record: Mapping) -> None:
        """Writes every number of a step's record (see :func:`~effijax.observe.scalars`)."""
        self.values(int(record["step"]), scalars(record))

    def values(self, step: int, values: Mapping[str, float]) -> None:
        """Writes named scalars at ``step`` (e.g. ``eval/loss``)."""
        for tag, value in values.items():
            self._add_summary(self._summary.scalar(tag, float(value)), step)

    def text(self, tag: str, text: str, step: int) -> None:
        """Writes Markdown text (TensorBoard's Text tab)."""
        self._add_summary(self._summary.text(tag, text), step)

    def flush(self) -> None:
        """Appends the events not yet on disk to the event file, whole records only."""
        if self._broken or not self._pending:
            return
        data, self._pending = b"".join(self._pending), []
        self._last_write = time.monotonic()
        with self._writing():
            atomic.append(self.path, data)

    def close(self) -> None:
        """Writes what is left (nothing after a failed write)."""
        self.flush()

    def _add_summary(self, summary, step: int) -> None:
        self._add(self._event(wall_time=time.time(), step=int(step), summary=summary))
        if time.monotonic() - self._last_write >= self._flush_s:
            self.flush()

    def _add(self, event) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self._pending.append(b"".join([header, struct.pack("<I", self._crc(header)), data,
                                       struct.pack("<I", self._crc(data))]))

    @contextlib.contextmanager
    def _writing(self):
        """A block whose failed write is one line; the sink writes nothing after it."""
        try:
            with write_errors(self._run_dir):
                yield
        except WriteError:
            self._broken, self._pending = True, []
            raise


def _new_event_file(logdir: Path) -> Path:
    """A new, empty event file in ``logdir``, created without following a link: a name
    already taken (by a link, or by another writer in the same second) is passed over."""
    stem = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
    for n in range(1000):
        try:
            return atomic.create(logdir / (stem if n == 0 else f"{stem}.{n}"))
        except FileExistsError:
            continue
    raise FileExistsError(f"{logdir}: 1000 event files named {stem}[.N] already")
