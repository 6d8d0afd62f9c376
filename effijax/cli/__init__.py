"""The ``effijax`` command line: ``effijax train``, ``effijax memory``, ``effijax plan``,
``effijax eval``, ``effijax data``, ``effijax generate``.

Each subcommand lives in its own module, parses its flags, validates them before anything is
compiled, and calls library functions. ``python -m effijax`` is the same program.
"""

from __future__ import annotations

import argparse
import sys

from effijax.cli import _interrupt

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered.

    Example:
      >>> build_parser().parse_args(["train", "--steps", "5"]).steps
      5
    """
    from effijax.cli import _data, _eval, _generate, _memory, _train

    parser = argparse.ArgumentParser(
        prog="effijax",
        description="Efficient training in plain functional JAX: mixed precision, sharding, "
        "LoRA, memory accounting.",
    )
    from importlib import metadata

    try:
        version = metadata.version("effijax")
    except metadata.PackageNotFoundError:  # a source tree that was not installed
        version = "unknown (not installed)"
    parser.add_argument("--version", action="version", version=f"effijax {version}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _train.add_parsers(sub)
    _memory.add_parsers(sub)
    _eval.add_parsers(sub)
    _data.add_parsers(sub)
    _generate.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``effijax`` console script; returns the exit code.

    Called without ``argv``, as the program (the console script, ``python -m effijax``), it
    owns the process: from its first line on, Ctrl-C prints one line (``effijax COMMAND:
    interrupted``; ``effijax train`` says what its run directory holds) and exits 130 at once,
    instead of a traceback (and, with XLA's threads at work, a segmentation fault). Called
    with ``argv`` (a test, a notebook), Ctrl-C stays Python's ``KeyboardInterrupt``.
    """
    if argv is None:
        argv = sys.argv[1:]
        _interrupt.install(argv[0] if argv and not argv[0].startswith("-") else None)
    parser = build_parser()
    argv = list(argv)
    args = parser.parse_args(argv)
    args.argv = argv  # what to tell a user to run again (e.g. to resume)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
