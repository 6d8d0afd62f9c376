"""What a command is doing, said while it waits: a line on standard error when that is a
terminal, as a progress bar would be (a script reading standard error gets the command's
results, or its one error line, alone)."""

from __future__ import annotations

import sys

__all__ = ["status"]


def status(command: str):
    """A function that says ``effijax COMMAND: LINE`` on a terminal's standard error.

    Example:
      >>> say = status("eval")
      >>> say("loading smollm2")  # nothing under a test: its stderr is not a terminal
    """
    def say(line: str) -> None:
        if sys.stderr.isatty():
            print(f"effijax {command}: {line}", file=sys.stderr, flush=True)

    return say
