"""``effijax data``: ``make-example OUT.jsonl`` writes the offline instruction set;
``prepare SOURCE --out STORE`` tokenizes a corpus once into a token store.

``make-example``: question/answer records about the Python standard library's functions (their
signatures and one-line summaries), answered from the running interpreter
(:func:`effijax.data.stdlib_qa`): data that exists on every machine, for the fine-tuning
examples. ``prepare``: text, JSONL, Parquet or Arrow files (or a ``datasets`` ``save_to_disk``
folder) through a model's tokenizer into a memory-mapped store that ``effijax train --data
STORE`` reads (:func:`effijax.sources.prepare`); chat records go through the model's chat
template, or a ``--chat-template FILE`` (a base model has none), which training repeats.
"""

from __future__ import annotations

import argparse
import sys

from effijax.errors import ConfigError

__all__ = ["add_parsers", "run", "run_prepare"]


def add_parsers(sub) -> None:
    """Registers ``data`` (with ``make-example``) on an ``argparse`` subparsers object.

    Example:
      >>> from effijax.cli import build_parser
      >>> build_parser().parse_args(["data", "make-example", "qa.jsonl"]).out
      'qa.jsonl'
    """
    p = sub.add_parser("data", help="prepare a token store (prepare), or write the example "
                       "instruction set (make-example)", description="Data for training: "
                       "tokenize a corpus once into a store every run memory-maps (prepare), "
                       "or write the offline instruction set of the examples (make-example).")
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
    prep = actions.add_parser("prepare", help="tokenize a corpus once into a token store for "
                              "--data", description=(
                                  "Tokenize SOURCE (a text file, JSONL, Parquet or Arrow file, "
                                  "a folder of them, or a datasets save_to_disk folder) into "
                                  "the store OUT, memory-mapped by effijax train --data OUT. "
                                  "A killed prepare continues when run again; the same input "
                                  "gives the same store and hash."))
    prep.add_argument("source", help="the file or folder to tokenize")
    prep.add_argument("--out", required=True, help="the store's folder (replaced when done)")
    prep.add_argument("--from", dest="model_from", default=None, metavar="MODEL",
                      help="the model whose tokenizer (and chat template) is used: a bundled "
                      "name (smollm2), a .gguf file or a Hugging Face folder (default: bytes, "
                      "for the byte-level GPT)")
    prep.add_argument("--chat-template", default=None, metavar="FILE", help="a Jinja chat "
                      "template file that renders chat records instead of the model's own (a "
                      "base model has none); train on the store with the same file")
    prep.add_argument("--format", dest="data_format", default="auto",
                      choices=("auto", "text", "chat"), help="text (documents), chat (records "
                      "with messages, or prompt and response), or auto (chat when the first "
                      "table has those columns)")
    prep.add_argument("--text-column", default="text", help="the column (JSONL key) holding "
                      "the documents (default: text)")
    prep.add_argument("--val-fraction", type=float, default=0.05, help="held out for "
                      "validation (default: 0.05)")
    prep.add_argument("--processes", type=int, default=None, help="tokenizing processes "
                      "(default: every core)")
    prep.set_defaults(func=run_prepare)


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


def run_prepare(args: argparse.Namespace) -> int:
    """Runs ``effijax data prepare``; returns the exit code (2: bad arguments or data)."""
    from effijax.data import check_columns, find_sources
    from effijax.sources import check_template_file, prepare, prepare_tokenizer

    def say(line: str) -> None:
        print(f"effijax data prepare: {line}", flush=True)

    try:
        # The template file and the columns first: a missing one is found in a second, before
        # the model is read.
        check_template_file(args.chat_template)
        check_columns(find_sources(args.source), args.data_format, args.text_column)
        tokenizer = prepare_tokenizer(args.model_from)
        manifest = prepare(args.source, args.out, tokenizer=tokenizer,
                           chat_template=args.chat_template,
                           data_format=args.data_format, text_column=args.text_column,
                           val_fraction=args.val_fraction, processes=args.processes,
                           print_fn=say)
    except ConfigError as e:
        # The template's errors name its flag, as effijax train's do.
        e = e.renamed("--chat-template") if e.field == "chat_template" else e
        print(f"effijax data prepare: error: {e}", file=sys.stderr)
        return 2
    split = manifest["split"]
    parts = (f"{split['train_examples']:,} training / {split['val_examples']:,} validation "
             "examples" if "train_examples" in split else
             f"{split['train_tokens']:,} training / {split['val_tokens']:,} validation tokens")
    say(f"wrote {args.out}: {manifest['data_format']}, {manifest['documents']:,} "
        f"{'examples' if manifest['data_format'] == 'chat' else 'documents'}, "
        f"{manifest['tokens']:,} tokens ({manifest['dtype']}), {parts}; "
        f"sha256 {manifest['sha256'][:16]}..")
    say(f"train on it: effijax train --data {args.out}"
        + (f" --from {args.model_from}" if args.model_from else "")
        + (f" --chat-template {args.chat_template}" if args.chat_template else ""))
    return 0
