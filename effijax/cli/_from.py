"""``--from``: the one flag for the model a command starts from.

``train``, ``eval``, ``generate``, ``memory`` and ``plan`` take ``--from SOURCE``, where the
source is a run directory (``effijax train --out``), a ``.gguf`` file, a Hugging Face directory,
or a bundled model (``smollm2``: SmolLM2-135M-Instruct; ``gemma3-270m``: Gemma 3 270M). It
sets the config field ``model_from``, the name every run's ``config.json`` records.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from effijax.sources import BUNDLED, missing_source

__all__ = ["FLAG", "DEST", "SOURCES", "add_flag", "check_exists", "names_a_source"]

FLAG = "--from"
DEST = "model_from"  # TrainConfig's field: one attribute name in every command's namespace
SOURCES = ("a run directory (effijax train --out), a .gguf file, a Hugging Face directory, or "
           "a bundled model: smollm2 (SmolLM2-135M-Instruct) or gemma3-270m (Gemma 3 270M)")


def names_a_source(value: str) -> bool:
    """Whether ``VALUE`` names a source (what ``--from`` takes) rather than a preset (what
    ``--model`` takes): a bundled name, something path-like, or an existing file or directory.
    Presets are names without a separator or suffix, and knowing them all would import the
    models (and JAX), so the test is on the text.

    Example:
      >>> names_a_source("smollm2"), names_a_source("runs/base"), names_a_source("llama-2-7b")
      (True, True, False)
    """
    return (value in BUNDLED or "/" in value or "\\" in value
            or value.endswith((".gguf", ".json")) or Path(value).exists())


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
