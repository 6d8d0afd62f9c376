"""``effijax generate``: continue a prompt (or answer it, ``--chat``) with a model or a run.

``--model-from`` names a run directory (a full run's latest checkpoint, or a finished LoRA run's
adapters on its base, applied without merging), a ``.gguf`` file, a Hugging Face directory, or
``smollm2`` (the bundled SmolLM2-135M-Instruct). The continuation goes to standard output; the
timings (compile, prefill, decode, tokens/s) to standard error. Flags are checked before JAX is
imported.
"""

from __future__ import annotations

import argparse
import math
import sys

from effijax.errors import ConfigError

__all__ = ["add_parsers", "run"]


def add_parsers(sub) -> None:
    """Registers ``generate`` on an ``argparse`` subparsers object.

    Example:
      >>> from effijax.cli import build_parser
      >>> args = build_parser().parse_args(["generate", "--model-from", "smollm2", "--prompt",
      ...                                   "Hi", "--chat", "--top-p", "0.9"])
      >>> args.chat, args.top_p, args.temperature, args.max_new_tokens
      (True, 0.9, 0.0, 64)
    """
    p = sub.add_parser("generate", help="generate text with a model or a run", description=(
        "Continue a prompt with a model, KV-cached: greedy by default, or sampled with "
        "--temperature/--top-p and --seed. Prints the continuation on stdout and the timings "
        "on stderr."))
    p.add_argument("--model-from", required=True, metavar="PATH",
                   help="a run directory (effijax train --out), a .gguf file, a Hugging Face "
                   "model directory, or smollm2 (the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", required=True, help="the text to continue (with --chat: the "
                   "user's message)")
    p.add_argument("--chat", action="store_true", help="format the prompt with the model's chat "
                   "template as a user turn and generate the assistant's reply")
    p.add_argument("--system", default=None, help="with --chat: a system message")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="tokens to generate at most (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 for greedy decoding, else the sampling temperature (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: sample from the most likely tokens holding this "
                   "probability mass (default: 1, all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--verbose", action="store_true", help="also print the prompt as the model "
                   "sees it and the model's source on stderr")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    """Flag errors that need no model (and no JAX)."""
    from pathlib import Path

    from effijax.recipe import BUNDLED

    if args.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", args.max_new_tokens, "must be >= 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError("--temperature", args.temperature, "must be >= 0 (0: greedy)")
    if not 0 < args.top_p <= 1:
        raise ConfigError("--top-p", args.top_p, "must be in (0, 1]")
    if args.system is not None and not args.chat:
        raise ConfigError("--system", args.system, "only applies with --chat")
    if args.model_from not in BUNDLED and not Path(args.model_from).exists():
        raise ConfigError("--model-from", args.model_from, "no such run directory, GGUF file "
                          f"or Hugging Face directory (or a bundled name: {', '.join(BUNDLED)})")


def _error(e: ConfigError) -> int:
    field = e.field if e.field.startswith("--") else "--" + e.field.replace("_", "-")
    print(f"effijax generate: error: {e.renamed(field)}", file=sys.stderr, flush=True)
    return 2


def run(args: argparse.Namespace) -> int:
    """Runs ``effijax generate``; returns the exit code (2: bad flags or model)."""
    try:
        _check(args)
    except ConfigError as e:
        return _error(e)
    import time

    from effijax.generate import load

    t0 = time.perf_counter()
    try:
        loaded = load(args.model_from)
        load_s = time.perf_counter() - t0
        out = loaded.complete(args.prompt, chat=args.chat, system=args.system,
                              max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    except ConfigError as e:
        return _error(e)
    if args.verbose:
        print(f"model: {loaded.source}\nprompt ({out.generation.prompt_tokens} tokens):\n"
              f"{out.prompt}", file=sys.stderr, flush=True)
    print(out.text, flush=True)
    g = out.generation
    n = int(g.lengths[0]) + int(g.finished[0])  # tokens produced, the EOS included
    decode_rate = (n - 1) / g.decode_s if n > 1 and g.decode_s > 0 else float("nan")
    stop = "end of sequence" if g.finished[0] else f"--max-new-tokens {args.max_new_tokens}"
    print(f"effijax generate: {n} tokens (stopped at {stop}); load {load_s:.2f} s, compile "
          f"{g.compile_s:.2f} s, prefill {g.prompt_tokens} tokens {g.prefill_s * 1e3:.0f} ms, "
          f"decode {decode_rate:.1f} tokens/s, overall {n / (g.prefill_s + g.decode_s):.1f} "
          "tokens/s", file=sys.stderr, flush=True)
    return 0
