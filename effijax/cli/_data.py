"""``effijax data make-example OUT.jsonl``: writes the offline instruction set.

Question/answer records about the Python standard library's functions (their signatures and
one-line summaries), answered from the running interpreter (:func:`effijax.data.stdlib_qa`):
data that exists on every machine, for the fine-tuning examples.
"""

from __future__ import annotations

import argparse
import sys

from effijax.errors import ConfigError

__all__ = ["add_parsers", "run"]


def add_parsers(sub) -> None:
    """Registers ``data`` (with ``make-example``) on an ``argparse`` subparsers object.

    Example:
      >>> from effijax.cli import build_parser
      >>> build_parser().parse_args(["data", "make-example", "qa.jsonl"]).out
      'qa.jsonl'
    """
    p = sub.add_parser("data", help="build example data", description="Build data for the "
                       "fine-tuning examples, offline.")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    make = actions.add_parser("make-example", help="write question/answer records about the "
                              "Python standard library as chat JSONL", description=(
                                  "Write {prompt, response} records about the standard "
                                  "library's functions (signature and one-line summary, "
                                  "answered from this interpreter) to OUT, one per line."))
    make.add_argument("out", help="the .jsonl file to write (its folder is created)")
    make.add_argument("--modules", default=None, help="comma-separated standard-library "
                      "modules (default: a fixed list of 24)")
    make.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Runs ``effijax data make-example``; returns the exit code (2: bad arguments)."""
    from effijax.data import STDLIB_MODULES, stdlib_qa, write_jsonl

    modules = (tuple(m.strip() for m in args.modules.split(",") if m.strip())
               if args.modules else STDLIB_MODULES)
    try:
        records = stdlib_qa(modules)
        if not records:
            raise ConfigError("modules", args.modules, "no function with a docstring and a "
                              "signature found there")
        from pathlib import Path

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        n = write_jsonl(args.out, records)
    except ModuleNotFoundError as e:
        print(f"effijax data: error: --modules: no module {e.name!r}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"effijax data: error: {e}", file=sys.stderr)
        return 2
    print(f"effijax data: wrote {n} question/answer records about {len(modules)} modules to "
          f"{args.out}")
    return 0
