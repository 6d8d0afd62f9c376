"""Exact resume of the host-side log: drop the metrics a killed run wrote past its checkpoint.

A resumed run needs nothing but the restored state: the data position and the per-step PRNG
key are functions of ``state.step``. Its ``metrics.jsonl`` however may hold records of steps
after the last checkpoint (the killed run logged them, the resumed run will log them again);
:func:`truncate_metrics` removes them before the resumed run appends.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from effijax import atomic
from effijax.checkpoint._failures import write_errors

__all__ = ["truncate_metrics"]


def _record_step(line: bytes) -> int | None:
    """The ``"step"`` of a metrics record, or None for a damaged line (not UTF-8 JSON, not an
    object, no whole-number step)."""
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def truncate_metrics(metrics_path: str | os.PathLike, step: int, *,
                     report: Callable[[str], None] | None = None,
                     every_step: bool = True) -> int:
    """Drops the records with ``"step" > step`` from a ``metrics.jsonl``, atomically.

    Records are those of :class:`effijax.run.RunDir` (``"step"`` = steps completed). Kept lines
    are copied verbatim; the file is rewritten through a temporary file and ``os.replace``, so
    a crash leaves either the old or the new file. A damaged line (not a JSON object with a
    whole-number ``"step"``: a last line cut short by a kill, or a line edited or corrupted
    anywhere) is dropped too, and said in one line to ``report`` unless it is the last: the
    log is rebuilt from the records up to the checkpoint's step, and a resume never stops on it.
    The records kept are put in step order (a step recorded twice keeps its last record), and
    steps of ``1..step`` with no record (a deleted or damaged file) are said in one line: the
    whole-run numbers computed from the file leave them out, and ``summary.json`` counts them.

    Args:
      metrics_path: the ``metrics.jsonl`` file, or the run directory holding it.
      step: the restored step.
      report: where a dropped damaged line is said (default: standard error).
      every_step: whether the file holds a record of every step (``metrics.jsonl``): a missing
        file or step is then said. ``False`` for a file that records some steps (GRPO's
        ``completions.jsonl``, one record a rollout): only its damaged lines are.

    Returns:
      How many records (or damaged lines) were dropped; 0 when the file does not exist.

    Raises:
      effijax.errors.WriteError: the file could not be rewritten (a full disk): one line naming
        it, the traceback in the folder's ``error.log``; the file keeps what it held.

    Example:
      >>> import tempfile, pathlib
      >>> p = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
      >>> _ = p.write_text("".join(f'{{"step": {i}, "loss": 1.0}}\\n' for i in range(1, 6)))
      >>> truncate_metrics(p, 3)
      2
      >>> [line[:10] for line in p.read_text().splitlines()]
      ['{"step": 1', '{"step": 2', '{"step": 3']
      >>> _ = p.write_text('{"step": 1}\\nnot json\\n{"step": 2}\\n')
      >>> truncate_metrics(p, 2, report=print)  # doctest: +ELLIPSIS
      effijax: .../metrics.jsonl: line 2 is not a metrics record ('not json'); dropped it
      1
      >>> truncate_metrics(p.parent / "completions.jsonl", 2, report=print)  # doctest: +ELLIPSIS
      effijax: .../completions.jsonl: missing, so the run's whole-run numbers ... steps 1-2; ...
      0
      >>> truncate_metrics(p.parent / "completions.jsonl", 2, report=print, every_step=False)
      0
    """
    path = Path(metrics_path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    report = report or (lambda line: print(line, file=sys.stderr, flush=True))
    if not path.exists():
        if step and every_step:
            report(f"effijax: {path}: missing, so the run's whole-run numbers (summary.json, "
                   f"loss.png) leave out steps 1-{step:,}; summary.json counts them as "
                   "missing_metrics")
        return 0
    lines = path.read_bytes().splitlines(keepends=True)
    kept, dropped = {}, 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        record_step = _record_step(line)
        if record_step is None and i < len(lines) - 1:  # the last: a write cut short by a kill
            shown = line.decode("utf-8", "replace").strip()[:80]
            report(f"effijax: {path}: line {i + 1} is not a metrics record ({shown!r}); "
                   "dropped it")
        if record_step is None or not 1 <= record_step <= step:
            dropped += 1
        else:  # a step recorded twice keeps its last record
            dropped += record_step in kept
            kept[record_step] = line if line.endswith(b"\n") else line + b"\n"
    if list(kept) != sorted(kept):
        report(f"effijax: {path}: records out of step order; put them back in order")
    missing = step - len(kept)
    if missing and every_step:
        report(f"effijax: {path}: holds no record of {missing:,} of steps 1-{step:,} "
               f"({_ranges(sorted(set(range(1, step + 1)) - set(kept)))}); the run's whole-run "
               "numbers (summary.json, loss.png) leave them out, and summary.json counts them "
               "as missing_metrics")
    with write_errors(path.parent):  # never through a link planted at its temporary name
        atomic.write_bytes(path, b"".join(kept[s] for s in sorted(kept)))
    return dropped


def _ranges(steps: list[int], most: int = 4) -> str:
    """``[1, 2, 3, 7]`` as ``"1-3, 7"`` (the first ``most`` ranges, then how many more)."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    shown = [f"{a}-{b}" if b > a else f"{a}" for a, b in runs[:most]]
    return ", ".join(shown) + (f" and {len(runs) - most} more" if len(runs) > most else "")
