"""Subprocess worker of tests/test_run_end_kill.py (run as a script; not a test module).

``python tests/_end_kill_worker.py POINT ARGS...`` runs ``effijax ARGS...`` (through
:func:`effijax.cli.main`) and SIGKILLs its own process at ``POINT`` in the run's end, after the
training loop has returned:

* ``checkpoint``: as soon as the loop returns (its final checkpoint committed, the checkpointer
  closed), before anything of the end is written;
* ``evaluation``: inside the final evaluation, once its loss is computed, before it returns;
* a file name (``adapters.safetensors``, ``adapter_model.safetensors``, ``model.safetensors``,
  ``summary.json``): in the middle of that file's write, after half of its bytes (``summary.json``:
  before its first byte).

Nothing in effijax knows about it: the worker wraps effijax's own functions (the recipe's loop,
the evaluation, the atomic writer's inner write) before calling the command line. A run that
never reaches ``POINT`` exits 3 with a line saying so, so a test cannot pass without the kill.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

# This checkout's package, installed or not (the worker runs as a script from tests/).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from effijax import atomic  # noqa: E402
from effijax.cli import main  # noqa: E402
from effijax.recipe import _job, _train  # noqa: E402

POINTS = ("checkpoint", "evaluation", "adapters.safetensors", "adapter_model.safetensors",
          "model.safetensors", "summary.json")


def _kill() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def arm(point: str) -> None:
    """Wraps the functions that lead to ``point`` so that reaching it kills the process."""
    if point not in POINTS:
        raise SystemExit(f"unknown kill point {point!r}; expected one of {', '.join(POINTS)}")
    in_end = {"yes": False}
    loop, evaluate = _train.loop, _job.evaluate_metrics
    write_bytes, write_all = atomic.write_bytes, atomic._write_all
    writing = {"name": None}

    def loop_then(*args, **kwargs):
        trained = loop(*args, **kwargs)
        in_end["yes"] = trained.signal is None
        if in_end["yes"] and point == "checkpoint":
            _kill()
        return trained

    def evaluate_then(*args, **kwargs):
        found = evaluate(*args, **kwargs)
        if in_end["yes"] and point == "evaluation":
            _kill()
        return found

    def tracked(path, data, **kwargs):
        writing["name"] = Path(path).name
        try:
            return write_bytes(path, data, **kwargs)
        finally:
            writing["name"] = None

    def part_then(fd, data):
        if in_end["yes"] and writing["name"] == point:
            write_all(fd, data[: len(data) // 2 if point != "summary.json" else 0])
            os.fsync(fd)
            _kill()
        write_all(fd, data)

    _train.loop, _job.evaluate_metrics = loop_then, evaluate_then
    atomic.write_bytes, atomic._write_all = tracked, part_then


if __name__ == "__main__":
    arm(sys.argv[1])
    code = main(sys.argv[2:])
    print(f"_end_kill_worker: the run ended (exit {code}) without reaching {sys.argv[1]!r}",
          file=sys.stderr, flush=True)
    sys.exit(3)
