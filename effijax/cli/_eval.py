"""``effijax eval MODEL DATA``: loss and perplexity of a model on a text or chat JSONL file.

``MODEL`` is ``smollm2``, a GGUF file, a Hugging Face directory or a run directory (a LoRA run
evaluates its base with its adapters); ``DATA`` a text file or folder, or a ``.jsonl`` file of
``{"messages": [...]}`` or ``{"prompt": ..., "response": ...}`` records, scored on the
assistant's tokens as training does (:func:`effijax.recipe.evaluate_model`).
"""

from __future__ import annotations

import argparse
import json
import sys

from effijax.errors import ConfigError

__all__ = ["add_parsers", "run"]


def add_parsers(sub) -> None:
    """Registers ``eval`` on an ``argparse`` subparsers object.

    Example:
      >>> from effijax.cli import build_parser
      >>> args = build_parser().parse_args(["eval", "smollm2", "qa.jsonl", "--seq-len", "256"])
      >>> args.model, args.data, args.seq_len, args.batch_size
      ('smollm2', 'qa.jsonl', 256, 8)
    """
    p = sub.add_parser("eval", help="loss and perplexity of a model on a file", description=(
        "Loss and perplexity of a model (smollm2, a GGUF file, a Hugging Face directory, or a "
        "run directory: a LoRA run is its base plus adapters) on a text file or folder or a chat "
        "/ instruction .jsonl file (scored on the assistant's tokens, as training is)."))
    p.add_argument("model", help="smollm2, a .gguf file, a Hugging Face directory or a run "
                   "directory")
    p.add_argument("data", help="a text file or folder, or a .jsonl file of chat / instruction "
                   "records")
    p.add_argument("--seq-len", type=int, default=None, help="window length (default: the "
                   "model's)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass "
                   "(default: 8)")
    p.add_argument("--data-format", choices=("auto", "text", "chat"), default="auto",
                   help="auto: chat for a .jsonl file, else text (default: auto)")
    p.add_argument("--max-batches", type=int, default=None, help="evaluate only the first K "
                   "batches (default: all)", metavar="K")
    p.add_argument("--precision", default="fp32", help="precision policy of the forward pass "
                   "(default: fp32)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)


def _check(args) -> None:
    for name in ("batch_size", "max_batches"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(name, value, "must be >= 1")
    if args.seq_len is not None and args.seq_len < 2:
        raise ConfigError("seq_len", args.seq_len, "must be >= 2")


def run(args: argparse.Namespace) -> int:
    """Runs ``effijax eval``; returns the exit code (2: bad arguments or data)."""
    try:
        _check(args)
        from effijax.recipe import evaluate_model

        result = evaluate_model(args.model, args.data, seq_len=args.seq_len,
                                batch_size=args.batch_size, data_format=args.data_format,
                                max_batches=args.max_batches, precision=args.precision)
    except ConfigError as e:
        field = e.field if e.field in ("model", "data") else "--" + e.field.replace("_", "-")
        print(f"effijax eval: error: {e.renamed(field)}", file=sys.stderr, flush=True)
        return 2
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    what = "assistant tokens" if result.format == "chat" else "tokens"
    print(f"effijax eval: {result.model} on {args.data} ({result.format}, {result.rows} windows "
          f"of {result.seq_len}): loss {result.loss:.4f}, perplexity {result.perplexity:.3f} "
          f"over {result.tokens:,} {what}", flush=True)
    return 0
