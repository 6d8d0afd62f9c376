"""``effijax eval --from MODEL DATA``: loss and perplexity of a model on a text or chat JSONL file.

``--from`` is ``smollm2``, a GGUF file, a Hugging Face directory or a run directory (a LoRA run
evaluates its base with its adapters); ``DATA`` a text file or folder, or a ``.jsonl`` file of
``{"messages": [...]}`` or ``{"prompt": ..., "response": ...}`` records, scored on the
assistant's tokens as training does (:func:`effijax.recipe.evaluate_model`), or a token store
(``effijax data prepare``), scored whole. ``DATA`` is read by training's reader: text and JSONL
over 8 MiB from the store training prepares of it in the cache, host memory flat.

``--precision`` is ``auto`` by default, decided as ``effijax train`` decides it
(:func:`effijax.recipe.scoring_precision`): a run directory scores in the precision it trained
in; any other model in bf16 on a GPU or TPU, and on a CPU with native bf16 matmuls for a model
256 wide or wider, fp32 elsewhere (so the tiny models score in fp32 on any CPU). The result
line names the precision (``in fp32``); at a terminal, the status line before compiling says
how ``auto`` decided it.

The result line says how much was measured (windows and scored tokens); a measure over few
tokens (:attr:`~effijax.recipe.EvalResult.caution`) adds one warning line on standard error.

``effijax eval --from MODEL --tasks a,b`` runs lm-evaluation-harness tasks instead (no
``DATA``): the offline ones shipped with effijax (``effijax_offline``: Q&A exact match and
multiple choice, held-out perplexity) or any the harness knows, through
:class:`effijax.harness.EffijaxLM`; it prints the harness's table and, when ``MODEL`` is a run
directory, writes the results to ``eval_tasks.json`` in it. ``--limit``, ``--num-fewshot`` and
``--batch-size`` are the harness's, ``--chat`` its ``apply_chat_template``; ``--seq-len`` is
the longest row (default: the model's context).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from effijax.cli import _from
from effijax.cli._importing import import_models
from effijax.cli._status import status
from effijax.errors import NO_VALUE, ConfigError, whole_number
from effijax.recipe import TrainConfig

__all__ = ["add_parsers", "run"]


def add_parsers(sub) -> None:
    """Registers ``eval`` on an ``argparse`` subparsers object.

    Example:
      >>> from effijax.cli import build_parser
      >>> args = build_parser().parse_args(["eval", "--from", "smollm2", "qa.jsonl",
      ...                                   "--seq-len", "256"])
      >>> args.model_from, args.data, args.seq_len, args.batch_size
      ('smollm2', 'qa.jsonl', 256, 8)
    """
    p = sub.add_parser("eval", help="loss and perplexity of a model on a file", description=(
        "Loss and perplexity of a model (smollm2, a GGUF file, a Hugging Face directory, or a "
        "run directory: a LoRA run is its base plus adapters) on a text file or folder or a chat "
        "/ instruction .jsonl file (scored on the assistant's tokens, as training is)."))
    _from.add_flag(p, "the model to evaluate (a LoRA run: its base with its adapters)")
    p.add_argument("data", nargs="?", default=None, help="a text file or folder, a .jsonl "
                   "file of chat / instruction records, or a token store (effijax data "
                   "prepare) (not with --tasks)")
    p.add_argument("--seq-len", type=int, default=None, help="window length (default: the "
                   "model's)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass "
                   "(default: 8)")
    p.add_argument("--data-format", choices=("auto", "text", "chat"), default="auto",
                   help="auto: chat for a .jsonl file, else text (default: auto)")
    p.add_argument("--chat-template", default=None, metavar="FILE", help="a Jinja chat "
                   "template file that renders chat data instead of the model's own (a base "
                   "model without one)")
    p.add_argument("--max-batches", type=int, default=None, help="evaluate only the first K "
                   "batches (default: all)", metavar="K")
    default = TrainConfig.__dataclass_fields__["precision"].default  # train's: auto
    p.add_argument("--precision", default=default, help="precision policy of the forward pass: "
                   "fp32, bf16, fp16, pure_bf16, or auto, decided as effijax train decides it "
                   "(bf16 on a GPU or TPU and, for a model 256 wide or wider, on a CPU with "
                   f"native bf16 matmuls; fp32 elsewhere) (default: {default})")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--tasks", default=None, metavar="A,B", help="lm-evaluation-harness tasks "
                   "to run instead of DATA: effijax_offline (shipped, offline), its tasks "
                   "effijax_qa_exact, effijax_qa_choice, effijax_docs_perplexity, or any task "
                   "lm_eval knows (needs pip install 'effijax[eval]')")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="with --tasks: the "
                   "first N documents of each task (default: all)")
    p.add_argument("--num-fewshot", type=int, default=None, metavar="K", help="with --tasks: "
                   "K examples before each question (default: each task's own)")
    p.add_argument("--chat", action="store_true", help="with --tasks: render the prompts "
                   "(few-shot examples as turns) with the model's chat template")
    p.set_defaults(func=run)
    # train's --data is eval's DATA (read by the unknown-flag error, effijax.cli._main).
    p.positional = {"--data": "the data as DATA (effijax eval --from MODEL FILE)"}


def _check(args) -> None:
    """Flag errors that need no model (and no JAX)."""
    whole_number("--batch-size", args.batch_size)
    whole_number("--max-batches", args.max_batches, none=True)
    whole_number("--seq-len", args.seq_len, minimum=2, none=True)  # a token read, one predicted
    whole_number("--limit", args.limit, none=True)
    whole_number("--num-fewshot", args.num_fewshot, minimum=0, none=True)
    if args.tasks is None:
        for flag, value in (("--limit", args.limit), ("--num-fewshot", args.num_fewshot)):
            if value is not None:
                raise ConfigError(flag, value, "counts harness documents: give --tasks too")
        if args.chat:
            raise ConfigError("--chat", True, "renders harness prompts: give --tasks too (a "
                              "chat .jsonl DATA file is rendered with the template anyway)")
        if args.data is None:
            raise ConfigError("data", NO_VALUE, "give a file to evaluate on, or --tasks A,B to "
                              "run harness tasks")
    elif args.data is not None:
        raise ConfigError("data", args.data, "--tasks runs the tasks' own data: drop DATA, or "
                          "drop --tasks to evaluate on it")
    _from.check_exists(args.model_from)


def _flag(field: str) -> str:
    """The flag behind a field of :func:`~effijax.recipe.evaluate_model`'s errors."""
    if field in ("model", "model_from"):
        return _from.FLAG
    # data and memory name no flag of their own: the file, the device's memory.
    if field in ("data", "memory") or field.startswith("--"):
        return field
    return "--" + field.replace("_", "-")


def run(args: argparse.Namespace) -> int:
    """Runs ``effijax eval``; returns the exit code (2: bad arguments or data)."""
    try:
        _check(args)
        if args.tasks is not None:
            return _run_tasks(args)
        status("eval")("starting (importing JAX)")  # a terminal's first line, before seconds
        import_models()
        from effijax.recipe import evaluate_model

        result = evaluate_model(args.model_from, args.data, seq_len=args.seq_len,
                                batch_size=args.batch_size, data_format=args.data_format,
                                max_batches=args.max_batches, precision=args.precision,
                                chat_template=args.chat_template, say=status("eval"))
    except ConfigError as e:
        print(f"effijax eval: error: {e.renamed(_flag(e.field))}", file=sys.stderr, flush=True)
        return 2
    if args.json:
        print(json.dumps(result.to_dict()), flush=True)
    else:
        what = "assistant token" if result.format == "chat" else "token"
        print(f"effijax eval: {result.model} on {args.data} ({result.format}, "
              f"{_count(result.rows, 'window')} of {result.seq_len}, in {result.precision}): "
              f"loss {result.loss:.4f}, "
              f"perplexity {result.perplexity:.3f} over {_count(result.tokens, what)}",
              flush=True)
    if result.caution is not None:  # on stderr: the result line (or JSON) stays as it is
        print(f"effijax eval: warning: {result.caution}", file=sys.stderr, flush=True)
    return 0


def _run_tasks(args: argparse.Namespace) -> int:
    """``effijax eval --tasks``: the tasks checked (before the model is loaded), run through the
    harness, its table printed; the results written into a run directory."""
    from effijax.harness import SHIPPED_TASKS, TASK_GROUP, check_tasks, task_manager

    say = status("eval")
    # The shipped tasks alone need no index of lm_eval's 14,000 others (15 s to read).
    shipped = all(t.strip() in (*SHIPPED_TASKS, TASK_GROUP) for t in args.tasks.split(","))
    say("reading the shipped tasks" if shipped else "reading lm-evaluation-harness's task index")
    manager = task_manager(include_defaults=not shipped)
    names = check_tasks(args.tasks, manager)
    say(f"loading {args.model_from}")
    from lm_eval.utils import handle_non_serializable, make_table

    from effijax.generate import load
    from effijax.harness import EffijaxLM, evaluate_tasks
    from effijax.recipe import scoring_precision

    loaded = load(args.model_from)
    decided = scoring_precision(args.precision, loaded)
    lm = EffijaxLM(loaded=loaded, batch_size=args.batch_size, max_length=args.seq_len,
                   precision=decided.precision)
    say(f"running {', '.join(names)} in {decided.precision}")
    results = evaluate_tasks(lm, names, limit=args.limit, num_fewshot=args.num_fewshot,
                             apply_chat_template=args.chat, manager=manager)
    text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
    if _is_run(args.model_from):
        from effijax.atomic import write_text

        path = write_text(Path(args.model_from) / "eval_tasks.json", text + "\n")
        say(f"wrote {path}")
    if args.json:
        print(text, flush=True)
        return 0
    print(f"effijax eval: {loaded.source} in {decided.precision}, batch {args.batch_size}"
          f"{'' if args.limit is None else f', limit {args.limit}'}", flush=True)
    print(make_table(results), end="", flush=True)
    if results.get("groups"):
        print(make_table(results, "groups"), end="", flush=True)
    return 0


def _is_run(model_from: str) -> bool:
    """Whether ``--from`` is a run directory (its ``config.json`` records a run)."""
    config = Path(model_from) / "config.json"
    if not config.is_file():
        return False
    from effijax.data import read_json

    values = read_json(config)
    return isinstance(values, dict) and isinstance(values.get("run"), dict)


def _count(n: int, what: str) -> str:
    """``n`` things, in words.

    Example:
      >>> _count(1, "window"), _count(4880, "token")
      ('1 window', '4,880 tokens')
    """
    return f"{n:,} {what}{'' if n == 1 else 's'}"
