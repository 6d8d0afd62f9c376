"""Exact resume of the host-side log: drop the metrics a killed run wrote past its checkpoint.

A resumed run needs nothing but the restored state: the data position and the per-step PRNG
key are functions of ``state.step``. Its ``metrics.jsonl`` however may hold records of steps
after the last checkpoint (the killed run logged them, the resumed run will log them again);
:func:`truncate_metrics` removes them before the resumed run appends.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from effijax import atomic

__all__ = ["truncate_metrics"]


def truncate_metrics(metrics_path: str | os.PathLike, step: int) -> int:
    """Drops the records with ``"step" > step`` from a ``metrics.jsonl``, atomically.

    Records are those of :class:`effijax.run.RunDir` (``"step"`` = steps completed). Kept lines
    are copied verbatim; the file is rewritten through a temporary file and ``os.replace``, so
    a crash leaves either the old or the new file. A last line cut short by a kill (not valid
    JSON) is dropped too; an invalid line elsewhere is an error.

    Args:
      metrics_path: the ``metrics.jsonl`` file, or the run directory holding it.
      step: the restored step.

    Returns:
      How many records (or broken last lines) were dropped; 0 when the file does not exist.

    Raises:
      ValueError: a line other than the last is not a JSON object with a ``"step"``.

    Example:
      >>> import tempfile, pathlib
      >>> p = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
      >>> _ = p.write_text("".join(f'{{"step": {i}, "loss": 1.0}}\\n' for i in range(1, 6)))
      >>> truncate_metrics(p, 3)
      2
      >>> [line[:10] for line in p.read_text().splitlines()]
      ['{"step": 1', '{"step": 2', '{"step": 3']
    """
    path = Path(metrics_path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    kept, dropped = [], 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            record_step = record["step"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            if i == len(lines) - 1:  # a write cut short by the kill
                dropped += 1
                continue
            raise ValueError(f"{path}: line {i + 1} is not a metrics record ({e}): "
                             f"{line[:80]!r}") from e
        if record_step > step:
            dropped += 1
        else:
            kept.append(line if line.endswith("\n") else line + "\n")
    atomic.write_text(path, "".join(kept))  # never through a link planted at its temp name
    return dropped
