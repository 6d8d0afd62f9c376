"""``--from``: the one flag for the model a command starts from, and the spellings it replaced.

``train``, ``eval``, ``generate``, ``memory`` and ``plan`` take ``--from SOURCE``, where the
source is a run directory (``effijax train --out``), a ``.gguf`` file, a Hugging Face directory,
or a bundled model (``smollm2``: SmolLM2-135M-Instruct; ``gemma3-270m``: Gemma 3 270M). It
sets the config field ``init_from``, the name every run's ``config.json`` records.

The spellings of the release before (``train --init-from``, ``generate --model-from``, ``eval
MODEL DATA`` and ``memory``/``plan --model PATH``) still work for one release:
:func:`rewrite` turns them into ``--from`` before argparse reads the command line, and says so
in one line on standard error. It runs on the words alone, without JAX.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from effijax.recipe import BUNDLED, missing_source

__all__ = ["FLAG", "DEST", "SOURCES", "Deprecated", "DEPRECATED", "add_flag", "check_exists",
           "names_a_source", "rewrite"]

FLAG = "--from"
DEST = "init_from"  # TrainConfig's field: one attribute name in every command's namespace
SOURCES = ("a run directory (effijax train --out), a .gguf file, a Hugging Face directory, or "
           "a bundled model: smollm2 (SmolLM2-135M-Instruct) or gemma3-270m (Gemma 3 270M)")


def names_a_source(value: str) -> bool:
    """Whether ``memory``/``plan --model VALUE`` meant a source (``--from``) rather than a
    preset: a bundled name, something path-like, or an existing file or directory. Presets
    are names without a separator or suffix, and knowing them all would import the models
    (and JAX), so the test is on the text.

    Example:
      >>> names_a_source("smollm2"), names_a_source("runs/base"), names_a_source("llama-2-7b")
      (True, True, False)
    """
    return (value in BUNDLED or "/" in value or "\\" in value
            or value.endswith((".gguf", ".json")) or Path(value).exists())


class Deprecated(NamedTuple):
    """An old spelling of ``--from`` in one command.

    Attributes:
      command: the subcommand (``train``).
      old: the old flag, or None for the first of two positional arguments (``eval MODEL
        DATA``).
      note: what the one line on standard error says after ``effijax COMMAND: note: ``.
      when: the old flag meant ``--from`` only for the values it accepts (None: for all).
    """

    command: str
    old: str | None
    note: str
    when: Callable[[str], bool] | None = None


DEPRECATED = (
    Deprecated("train", "--init-from", "--init-from is deprecated; use --from"),
    Deprecated("generate", "--model-from", "--model-from is deprecated; use --from"),
    Deprecated("eval", None, "MODEL before DATA is deprecated; use --from MODEL"),
    *(Deprecated(command, "--model", "--model with a file, a directory or smollm2 is deprecated; "
                 "use --from (--model names a preset)", names_a_source)
      for command in ("memory", "plan")),
)


def add_flag(parser: argparse.ArgumentParser, what: str, *, required: bool = True) -> None:
    """Adds ``--from SOURCE`` to a command's parser (or a group of it); ``what`` is the
    source's role in that command ("the model to evaluate")."""
    parser.add_argument(FLAG, dest=DEST, required=required, metavar="SOURCE",
                        help=f"{what}: {SOURCES}")


def check_exists(value: str) -> None:
    """Refuses a ``--from`` that names nothing (before anything is loaded).

    Example:
      >>> check_exists("/no/such/run")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: --from='/no/such/run': no such run directory, GGUF file or ...
    """
    if value not in BUNDLED and not Path(value).exists():
        raise missing_source(FLAG, value)


def _given(words: Sequence[str], flag: str) -> bool:
    return any(w == flag or w.startswith(flag + "=") for w in words)


def _old_flag(rule: Deprecated, words: list[str], parser) -> bool:
    """Renames ``rule.old`` to ``--from`` in ``words`` (in place); whether it did."""
    used = False
    for i, word in enumerate(words):
        if word == "--":
            break
        if word == rule.old and i + 1 < len(words):
            value, new = words[i + 1], FLAG
        elif word.startswith(f"{rule.old}="):
            value = word.split("=", 1)[1]
            new = f"{FLAG}={value}"
        else:
            continue
        if rule.when is None or rule.when(value):
            words[i], used = new, True
    return used


def _old_positional(rule: Deprecated, words: list[str], parser) -> bool:
    """Moves the first of two positional arguments to ``--from`` (in place); whether it did."""
    if _given(words, FLAG):
        return False
    valued = {s for a in parser._actions if a.nargs != 0 for s in a.option_strings}
    positions, skip, options = [], False, True
    for i, word in enumerate(words):
        if skip:
            skip = False
        elif options and word == "--":
            options = False
        elif options and word.startswith("-") and word != "-":
            skip = word in valued  # its value is the next word
        else:
            positions.append(i)
    if len(positions) < 2:
        return False
    value = words.pop(positions[0])
    words.insert(0, f"{FLAG}={value}")  # "=": a value after "--" may start with "-"
    return True


def rewrite(argv: Sequence[str], commands: Mapping[str, argparse.ArgumentParser]) -> list[str]:
    """``argv`` with the old spellings of :data:`DEPRECATED` written as ``--from``; prints one
    note on standard error for each old spelling used.

    Args:
      argv: the command line after the program's name.
      commands: each subcommand's parser (it says which flags take a value).

    Example:
      >>> from effijax.cli import build_parser
      >>> commands = build_parser().commands()
      >>> import contextlib, io
      >>> with contextlib.redirect_stderr(io.StringIO()) as err:
      ...     words = rewrite(["eval", "--seq-len", "64", "smollm2", "notes.txt"], commands)
      >>> words
      ['eval', '--from=smollm2', '--seq-len', '64', 'notes.txt']
      >>> print(err.getvalue(), end="")
      effijax eval: note: MODEL before DATA is deprecated; use --from MODEL
      >>> rewrite(["train", "--from", "runs/base"], commands)
      ['train', '--from', 'runs/base']
    """
    words = list(argv)
    at = next((i for i, w in enumerate(words) if not w.startswith("-")), None)
    if at is None or words[at] not in commands:
        return words
    command, rest = words[at], words[at + 1:]
    for rule in DEPRECATED:
        change = _old_positional if rule.old is None else _old_flag
        if rule.command == command and change(rule, rest, commands[command]):
            print(f"effijax {command}: note: {rule.note}", file=sys.stderr, flush=True)
    return [*words[:at + 1], *rest]
