"""``effijax generate``: continue prompts (or answer them, ``--chat``) with a model or a run.

``--from`` names a run directory (a full run's latest checkpoint, or a finished LoRA run's
adapters on its base, applied without merging), a ``.gguf`` file, a Hugging Face directory, or
a bundled model (``smollm2``, ``gemma3-270m``). The prompts (``--prompt``, repeatable, and
``--prompts-file``) run as one batch of any lengths. One prompt's continuation goes to standard
output as text; several go as JSON lines, ``{"prompt": ..., "completion": ...}`` in order. The
timings (compile, prefill, decode, tokens/s) go to standard error. Flags and the prompts file
are checked before JAX is imported.

A prompt must be text that UTF-8 can write, and one that is not is refused (exit 2), naming
it, never decoded with replacement: a model given U+FFFD for the bytes it was meant to read
continues another prompt than the one asked for, and says nothing. So are a command line's
bytes that are not UTF-8 (which Python hands over as lone surrogates), a ``.jsonl`` prompt
with an unpaired ``\ud800`` escape, and a text prompts file's line that is not UTF-8.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from effijax.cli import _from
from effijax.cli._importing import import_models
from effijax.cli._status import status
from effijax.data import bounded_lines, regular_path
from effijax.errors import ConfigError, whole_number
from effijax.generate import check_prompt_count
from effijax.memory import format_bytes

__all__ = ["add_parsers", "run"]


def add_parsers(sub) -> None:
    """Registers ``generate`` on an ``argparse`` subparsers object.

    Example:
      >>> from effijax.cli import build_parser
      >>> args = build_parser().parse_args(["generate", "--from", "smollm2", "--prompt", "Hi",
      ...                                   "--chat", "--top-p", "0.9"])
      >>> args.chat, args.top_p, args.temperature, args.max_new_tokens
      (True, 0.9, 0.0, 64)
      >>> build_parser().parse_args(["generate", "--from", "smollm2", "--prompt", "a",
      ...                            "--prompt", "b c"]).prompt
      ['a', 'b c']
    """
    p = sub.add_parser("generate", help="generate text with a model or a run", description=(
        "Continue prompts with a model, KV-cached, as one batch of any lengths: greedy by "
        "default, or sampled with --temperature/--top-p and --seed. Prints one prompt's "
        "continuation on stdout as text, several as JSON lines ({\"prompt\": ..., "
        "\"completion\": ...}, in order), and the timings on stderr."))
    _from.add_flag(p, "the model (a LoRA run: its adapters on its base, unmerged)")
    p.add_argument("--prompt", action="append", default=None, help="a text to continue "
                   "(with --chat: the user's message); repeat for several")
    p.add_argument("--prompts-file", default=None, metavar="FILE", help="more prompts, after "
                   "the --prompt ones: a text file of one prompt per line (blank lines skipped), "
                   "or a .jsonl file of {\"prompt\": ...} records or JSON strings")
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
    p.add_argument("--no-stream", dest="stream", action="store_false", help="print one "
                   "prompt's continuation when it is complete, not token by token as it is "
                   "decoded (the text printed is the same)")
    p.set_defaults(func=run)


def read_prompts(file: str) -> list[str]:
    r"""The prompts of ``--prompts-file``: one per line of a text file (blank lines skipped), or
    the records of a ``.jsonl`` file (``{"prompt": ...}`` objects or JSON strings); at most
    :data:`~effijax.generate.MAX_PROMPTS` of them, each line at most
    :data:`~effijax.data.MAX_RECORD_BYTES`.

    Example:
      >>> import pathlib, tempfile
      >>> folder = pathlib.Path(tempfile.mkdtemp())
      >>> _ = (folder / "p.jsonl").write_text('{"prompt": "two\\nlines"}\n"plain"\n')
      >>> read_prompts(str(folder / "p.jsonl"))
      ['two\nlines', 'plain']
    """
    path = regular_path(file, "--prompts-file")
    if not path.is_file():
        raise ConfigError("--prompts-file", file, "no such file")
    jsonl = path.suffix == ".jsonl"
    prompts = []
    for n, line in bounded_lines(path, "--prompts-file"):
        if line.strip():
            prompts.append(_json_prompt(line, n, file) if jsonl else line.rstrip("\r\n"))
            check_prompt_count(len(prompts), "--prompts-file")  # before reading them all
    if not prompts:
        raise ConfigError("--prompts-file", file, "holds no prompts")
    return prompts


def _shown(text: str, limit: int = 40) -> str:
    """The start of a prompt, for a message."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _not_text(text: str) -> str | None:
    r"""Why ``text`` is no prompt (None: it is UTF-8 text): a lone surrogate, which no UTF-8
    text holds. Python writes a command line's bytes that are not UTF-8 as U+DC80..U+DCFF
    (``surrogateescape``); JSON can spell any (``"\ud800"``).

    Example:
      >>> _not_text("héllo") is None
      True
      >>> _not_text("ok \udcff")
      'character 4 is the byte 0xff, which is not UTF-8'
      >>> _not_text("a\ud800b")
      "character 2 is a lone surrogate ('\\ud800'), which no UTF-8 text holds"
    """
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        c = text[e.start]
        if "\udc80" <= c <= "\udcff":
            return f"character {e.start + 1} is the byte {ord(c) - 0xDC00:#04x}, which is not UTF-8"
        return f"character {e.start + 1} is a lone surrogate ({c!r}), which no UTF-8 text holds"


def _json_prompt(line: str, n: int, file: str) -> str:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as e:
        raise ConfigError("--prompts-file", file, f"line {n} is not JSON ({e})") from None
    if isinstance(record, dict):
        record = record.get("prompt")
    if not isinstance(record, str):
        raise ConfigError("--prompts-file", file, f"line {n}: expected a JSON string "
                          'or an object with a "prompt" string')
    why = _not_text(record)
    if why is not None:
        raise ConfigError("--prompts-file", f"{file}:{n}", f"the prompt on line {n} is not "
                          f"text: {why} (a JSON escape of half a surrogate pair?); write it as "
                          "UTF-8 text")
    return record


def _check(args: argparse.Namespace) -> list[str]:
    """Flag errors that need no model (and no JAX); returns the prompts."""
    prompts = list(args.prompt or [])
    for i, prompt in enumerate(prompts):
        why = _not_text(prompt)
        if why is not None:
            raise ConfigError("--prompt", _shown(prompt), f"prompt {i + 1} of {len(prompts)} "
                              f"is not text: {why} (a terminal or script in another encoding?); "
                              "pass it as UTF-8")
    why = None if args.system is None else _not_text(args.system)
    if why is not None:
        raise ConfigError("--system", _shown(args.system), f"is not text: {why}; pass it as "
                          "UTF-8")
    if args.prompts_file is not None:
        prompts += read_prompts(args.prompts_file)
    check_prompt_count(len(prompts), "--prompts-file" if args.prompts_file else "--prompt")
    if not prompts:
        raise ConfigError("--prompt", None, "give a prompt (--prompt TEXT, repeatable) or a "
                          "--prompts-file")
    whole_number("--max-new-tokens", args.max_new_tokens)
    whole_number("--seed", args.seed, minimum=0)  # as TrainConfig's seed
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError("--temperature", args.temperature, "must be >= 0 (0: greedy)")
    if not 0 < args.top_p <= 1:
        raise ConfigError("--top-p", args.top_p, "must be in (0, 1]")
    if args.system is not None and not args.chat:
        raise ConfigError("--system", args.system, "only applies with --chat")
    _from.check_exists(args.model_from)
    return prompts


def _error(e: ConfigError) -> int:
    if e.field == "model_from":  # effijax.generate.load's name for what --from gives
        field = _from.FLAG
    elif e.field == "chat_template":  # the template --chat renders with
        field = "--chat"
    elif e.field == "memory":  # the device's, not a flag's
        field = "memory"
    else:
        field = e.field if e.field.startswith("--") else "--" + e.field.replace("_", "-")
    print(f"effijax generate: error: {e.renamed(field)}", file=sys.stderr, flush=True)
    return 2


_say = status("generate")  # what it waits for (stdout holds the text only)


def _print_piece(piece: str) -> None:
    print(piece, end="", flush=True)


def run(args: argparse.Namespace) -> int:
    """Runs ``effijax generate``; returns the exit code (2: bad flags or model)."""
    try:
        prompts = _check(args)
    except ConfigError as e:
        return _error(e)
    import time

    t0 = time.perf_counter()
    _say(f"loading {args.model_from}")  # seconds for a real model (and JAX): say what it waits on
    import_models()
    from effijax.generate import load

    settings = dict(chat=args.chat, system=args.system, max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    streamed = args.stream and len(prompts) == 1
    try:
        loaded = load(args.model_from)
        load_s = time.perf_counter() - t0
        _say(f"loaded in {load_s:.1f} s; compiling the decoder for this prompt's length "
             "(once per length bucket), then generating")
        if streamed:  # the reply as it is decoded, on standard output
            outs = [loaded.complete(prompts[0], on_text=_print_piece, **settings)]
        else:
            outs = loaded.complete_batch(prompts, **settings)
    except ConfigError as e:  # refused before any token is generated
        return _error(e)
    g = outs[0].generation
    if streamed:
        print(flush=True)  # the line the pieces were written on ends
    if args.verbose:
        print(f"model: {loaded.source}", file=sys.stderr, flush=True)
        for out in outs:
            print(f"prompt ({g.prompt_lengths[out.row]} tokens):\n{out.prompt}", file=sys.stderr,
                  flush=True)
    if len(outs) == 1 and not streamed:
        print(outs[0].text, flush=True)
    elif len(outs) > 1:
        for given, out in zip(prompts, outs, strict=True):
            print(json.dumps({"prompt": given, "completion": out.text}, ensure_ascii=False),
                  flush=True)
    produced_B = g.lengths + g.finished  # tokens produced per row, the EOS included
    n = int(produced_B.sum())
    steps = int(produced_B.max())  # the first token comes from the prefill
    decode_rate = (n - len(outs)) / g.decode_s if steps > 1 and g.decode_s > 0 else float("nan")
    if len(outs) == 1:
        stop = "end of sequence" if g.finished[0] else f"--max-new-tokens {args.max_new_tokens}"
        what = f"{n} tokens (stopped at {stop})"
        prefill = f"{g.prompt_tokens} tokens"
    else:
        what = (f"{len(outs)} prompts, {n} tokens ({int(g.finished.sum())} stopped at end of "
                "sequence)")
        prefill = f"{int(g.prompt_lengths.sum())} tokens"
    print(f"effijax generate: {what}; load {load_s:.2f} s, compile {g.compile_s:.2f} s, "
          f"prefill {prefill} {g.prefill_s * 1e3:.0f} ms, decode {decode_rate:.1f} tokens/s, "
          f"overall {n / (g.prefill_s + g.decode_s):.1f} tokens/s, KV cache "
          f"{format_bytes(g.cache_bytes)}", file=sys.stderr, flush=True)
    return 0
