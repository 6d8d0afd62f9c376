"""The ``effijax`` program: the parser of every subcommand, and :func:`main`.

The parser matches no prefixes (``--data`` is never ``--data-format``), answers a misspelt flag
with the closest one, and reads the old spellings of ``--from`` (``effijax.cli._from``) before
argparse does.
"""

from __future__ import annotations

import argparse
import sys

from effijax.cli import _hugepages, _interrupt

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered.

    Example:
      >>> build_parser().parse_args(["train", "--steps", "5"]).steps
      5
    """
    # Imported here, not above: the console script imports this module before main() runs, and
    # main() installs the Ctrl-C handler first; the subcommands (and the settings they read
    # from the recipe) are the longest part of start-up.
    from importlib import metadata

    from effijax.cli import _data, _eval, _generate, _memory, _train

    parser = _Program(
        prog="effijax",
        description="Efficient training in plain functional JAX: mixed precision, sharding, "
        "LoRA, memory accounting.",
    )
    try:
        version = metadata.version("effijax")
    except metadata.PackageNotFoundError:  # a source tree that was not installed
        version = "unknown (not installed)"
    parser.add_argument("--version", action="version", version=f"effijax {version}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                parser_class=_Parser)
    _train.add_parsers(sub)
    _memory.add_parsers(sub)
    _eval.add_parsers(sub)
    _data.add_parsers(sub)
    _generate.add_parsers(sub)
    return parser


class _Parser(argparse.ArgumentParser):
    """argparse without prefix matching: ``--data`` never silently becomes
    ``--data-format``, and a misspelt flag is an error (subcommand parsers inherit this)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        """One line (and where the flags are listed), not the whole usage: ``train``'s usage
        is two dozen lines that would bury the error."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Program(_Parser):
    """The top-level parser: it reads the command line with the old spellings of ``--from``
    rewritten (and noted on standard error), however it is called (:func:`main`,
    ``build_parser().parse_args(...)``).

    Example:
      >>> build_parser().parse_args(["eval", "--from", "smollm2", "notes.txt"]).model_from
      'smollm2'
    """

    def commands(self) -> dict[str, argparse.ArgumentParser]:
        """Each subcommand's parser, by name."""
        return next(a.choices for a in self._actions
                    if isinstance(a, argparse._SubParsersAction))


def _subcommand_parser(parser: argparse.ArgumentParser, argv: list[str]):
    """The deepest subcommand parser that ``argv`` names (``effijax data make-example``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for word in argv:
                if word in action.choices:
                    return _subcommand_parser(action.choices[word], argv[argv.index(word) + 1:])
    return parser


def _unknown_flags_error(parser: argparse.ArgumentParser, argv: list[str], extras: list[str]):
    """Exits 2 naming the unknown arguments, with the closest flag of the command for each
    flag-like one (``--stpes`` -> ``--steps``), or for an old spelling the flag that replaced
    it (a parser's ``renamed``: ``{"--zero": "--strategy ..."}``)."""
    import difflib

    command = _subcommand_parser(parser, argv)
    known = [o for a in command._actions for o in a.option_strings if o.startswith("--")]
    # A command's old spellings (``memory``'s --zero), said with what replaced them, and the
    # flags of other commands it takes without a flag (``eval``'s DATA, train's --data).
    renamed = getattr(command, "renamed", {})
    positional = getattr(command, "positional", {})
    hints = []
    for word in extras:
        flag = word.split("=", 1)[0]
        if flag in renamed:
            hints.append((flag, f"{flag} is now {renamed[flag]}"))
        elif flag in positional:
            hints.append((flag, f"give {positional[flag]} without a flag"))
        elif flag.startswith("--"):
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            if close:
                hints.append((flag, f"did you mean {close[0]}?"))
    if len(hints) == 1:
        hint = f"; {hints[0][1]}"
    else:
        hint = "".join(f"; {flag}: {said}" for flag, said in hints)
    command.error(f"unrecognized arguments: {' '.join(extras)}{hint}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``effijax`` console script; returns the exit code.

    Called without ``argv``, as the program (the console script, ``python -m effijax``), it
    owns the process: from its first line on, Ctrl-C prints one line (``effijax COMMAND:
    interrupted``; ``effijax train`` says what its run directory holds) and exits 130 at once,
    instead of a traceback (and, with XLA's threads at work, a segmentation fault). Called
    with ``argv`` (a test, a notebook), Ctrl-C stays Python's ``KeyboardInterrupt``. As the
    program, the commands that run compiled steps (``train``, ``eval``, ``generate``) first
    re-execute themselves once with glibc's transparent-huge-page tunable on Linux
    (:mod:`effijax.cli._hugepages`; ``EFFIJAX_HUGEPAGES=0`` turns that off).
    """
    if argv is None:
        argv = sys.argv[1:]
        command = argv[0] if argv and not argv[0].startswith("-") else None
        if command in _hugepages.COMMANDS:
            _hugepages.reexec_with_hugepages()  # returns only where it does not re-execute
        _interrupt.install(command)
    parser = build_parser()
    argv = list(argv)
    args, extras = parser.parse_known_args(argv)
    if extras:
        _unknown_flags_error(parser, argv, extras)
    args.argv = argv  # what to tell a user to run again (e.g. to resume)
    return int(args.func(args) or 0)
