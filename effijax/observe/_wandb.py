"""Weights & Biases logging (the ``wandb`` extra), resumable across restarts of a run."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path

from effijax import atomic
from effijax.errors import ConfigError
from effijax.observe._sink import scalars

__all__ = ["WandbSink"]

_ID_FILE = "wandb_run_id"


class WandbSink:
    """Logs each step's scalars to a W&B run, with the run's config.

    The run id is kept in ``directory/wandb_run_id``: the first start writes it, a resumed run
    reads it and continues the same W&B run (``resume="allow"``). Steps are W&B's step axis; a
    step logged twice (a run that died past its last checkpoint and ran those steps again) keeps
    its first value, which the exact resume makes equal to the second. W&B's own files go to
    ``directory/wandb/``; ``mode="offline"`` (or ``WANDB_MODE=offline``) writes only there, for
    ``wandb sync`` later.

    Args:
      project: the W&B project.
      directory: the run directory.
      config: the settings recorded with the run.
      mode: ``online``, ``offline`` or ``disabled``; None: ``$WANDB_MODE``, else online.
      name: the run's display name (default: the directory's name).

    Raises:
      ConfigError: wandb is not installed (``pip install 'effijax[wandb]'``).

    Example:
      >>> import tempfile, pathlib
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> sink = WandbSink("demo", d, config={"lr": 1e-3}, mode="disabled")
      >>> sink.log({"step": 1, "loss": 2.5})
      >>> sink.close()
      >>> (d / "wandb_run_id").read_text() == sink.run_id
      True
    """

    def __init__(self, project: str, directory: str | os.PathLike, *, config: Mapping,
                 mode: str | None = None, name: str | None = None):
        try:
            import wandb
        except ImportError:
            raise ConfigError("wandb", project, "needs wandb: pip install "
                              "'effijax[wandb]'") from None
        self._wandb = wandb
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        id_file = directory / _ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else ""
        if not re.fullmatch(r"[A-Za-z0-9_-]+", run_id):
            run_id = secrets.token_hex(6)  # W&B ids: letters, digits, - and _
            atomic.write_text(id_file, run_id)
        self.run_id = run_id
        self._run = wandb.init(project=project, id=run_id, resume="allow", dir=str(directory),
                               config=dict(config), mode=mode, name=name or directory.name,
                               reinit="create_new")

    def log(self, record: Mapping) -> None:
        """Logs every number of a step's record at its step."""
        self._run.log(scalars(record), step=int(record["step"]))

    def values(self, step: int, values: Mapping[str, float]) -> None:
        """Logs named values at ``step`` and keeps them in the run's summary."""
        self._run.log(dict(values), step=int(step))
        self._run.summary.update(dict(values))

    def text(self, tag: str, text: str, step: int) -> None:
        """Keeps Markdown text in the run's summary under ``tag``."""
        self._run.summary[tag] = text

    def close(self) -> None:
        """Finishes the run (flushes; offline runs stay on disk)."""
        self._run.finish()
