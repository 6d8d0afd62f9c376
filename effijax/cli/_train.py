"""``effijax train``: argparse → :class:`~effijax.recipe.TrainConfig` → ``recipe.train``.

With no flags it trains the ``mini`` GPT on the local Python standard library's source for 300
steps and writes ``runs/train/``: ``config.json``, ``metrics.jsonl``, ``summary.json``,
``loss.png`` and ``checkpoints/``. ``--config FILE`` (TOML or JSON, e.g. an earlier run's
``config.json``) sets any field; flags given on the command line override it.

``--strategy {ddp,zero1,zero2,fsdp}`` with ``--mesh data=2,fsdp=4`` trains data-parallel over
every device (``--cpu-devices 8`` forces CPU devices). Several processes run the same command
with ``--coordinator HOST:PORT --num-processes N --process-id I`` (or the ``EFFIJAX_*``
environment); only process 0 prints and writes files. While a process waits for the others
to join it says whom it waits for (on stderr); after ``--join-timeout`` seconds (300) it exits 2
with one line naming the processes that did not come. Running the same command on an ``--out``
that holds checkpoints resumes exactly; SIGTERM or SIGINT during the training loop saves at the
next step boundary and exits 0. Ctrl-C before the loop (start-up, loading, compilation) or after
it (the final save, evaluation and export) ends the process at once with one line saying what
the run directory holds, exit 130 (``effijax.cli._interrupt``). ``--from SOURCE``
fine-tunes a model (an earlier run's, a ``.gguf`` file, a Hugging Face directory or the bundled
``smollm2``); with ``--lora-rank R`` only rank-R LoRA adapters train, and the run writes them as
``adapters.safetensors`` and in PEFT's format (``peft/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from effijax.cli import _interrupt
from effijax.cli._importing import import_models
from effijax.cli._status import status
from effijax.errors import ConfigError
from effijax.recipe import OutputSection, TrainConfig, field_kind, flag_of, summary_step

__all__ = ["add_parsers", "config_from_args", "run"]

def _flag_type(field: dataclasses.Field):
    """The argparse type of a field: its annotated number type, else the text as given (the
    config parses names, numbers and meshes itself)."""
    kind = field_kind(field)
    return kind if kind in (int, float) else str


def add_parsers(sub) -> None:
    """Registers ``train`` on an ``argparse`` subparsers object: one flag per config field,
    its help and default read from the field."""
    p = sub.add_parser("train", help="train or fine-tune a model", description=(
        "Train or fine-tune a language model. With no flags: the mini GPT on the Python standard "
        "library's source (on every machine), 300 steps, written to runs/train/. Every flag is a "
        "setting of effijax.recipe.TrainConfig, which --config FILE (TOML or JSON) also sets."))
    p.add_argument("--config", metavar="FILE", help="a TOML or JSON file of settings (e.g. an "
                   "earlier run's config.json); flags override it")
    groups = {}
    for f in dataclasses.fields(TrainConfig):
        meta = f.metadata
        section = meta.get("section", "training")
        group = groups.get(section) or groups.setdefault(
            section, p if section == "training" else p.add_argument_group(section))
        flag = flag_of(f.name)
        if isinstance(f.default, bool):
            # A setting that is on by default has a --no- flag: its help says what it turns off.
            help_text = f"do not {meta['help']}" if f.default else meta["help"]
            group.add_argument(flag, dest=f.name, action="store_const", const=not f.default,
                               default=argparse.SUPPRESS, help=help_text)
            continue
        default = f.default if f.default is not None else "see above"
        help_text = meta["help"] if f.default is None else f"{meta['help']} (default: {default})"
        group.add_argument(flag, dest=f.name, type=_flag_type(f), default=argparse.SUPPRESS,
                           metavar=meta.get("metavar"), choices=meta.get("choices"),
                           help=help_text)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The config the command line describes: ``--config``'s file (or the defaults), then the
    flags that were given.

    Example:
      >>> from effijax.cli import build_parser
      >>> args = build_parser().parse_args(["train", "--steps", "5", "--no-progress"])
      >>> cfg = config_from_args(args)
      >>> cfg.steps, cfg.progress, cfg.batch_size
      (5, False, 16)
    """
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in names}
    base = TrainConfig.from_file(args.config) if getattr(args, "config", None) else TrainConfig()
    return base.with_overrides(**given)


def _error(e: ConfigError) -> int:
    field = "--config" if e.field == "config" else flag_of(e.field)
    print(f"effijax train: error: {e.renamed(field)}", file=sys.stderr, flush=True)
    return 2


def _interrupted(output: OutputSection, steps: int) -> str:
    """The line for Ctrl-C outside the training loop (start-up, compilation, the final save,
    evaluation and export): what the run directory (``output.out``, a run of ``steps``) holds
    now, so what the same command will do.

    Said from the checkpoint folders' names alone, as the signal handler should not start
    orbax: a committed step is a folder named by its number; a write in flight
    (``<step>.orbax-checkpoint-tmp``, removed by the next run) and a damaged step set aside
    (``<step>.corrupt-<n>``) are not.
    """
    head = "effijax train: interrupted"
    if not output.checkpoints:
        return f"{head}; nothing was saved (--no-checkpoints; run the same command to start again)"
    out = Path(output.out)
    folder = out / "checkpoints"
    saved = ([int(p.name) for p in folder.iterdir() if p.name.isascii() and p.name.isdigit()
              and p.is_dir()] if folder.is_dir() else [])
    if not saved:
        return (f"{head} before the first checkpoint; nothing was saved (run the same command "
                "to start again)")
    step = max(saved)
    if step < steps:
        return (f"{head}; nothing after step {step} was saved (run the same command to resume "
                "from it)")
    if summary_step(out) == step:
        return f"{head}; the run had finished at step {step}"
    return (f"{head} after the last step ({step}) was saved, before the final evaluation, "
            "exports and summary.json were written (run the same command to complete them)")


def run(args: argparse.Namespace) -> int:
    """Runs ``effijax train``; returns the exit code (2: bad settings, including processes of
    a multi-process run that did not join; 1: training failed)."""
    try:
        config = config_from_args(args)
    except ConfigError as e:
        return _error(e)
    _interrupt.describe(lambda: _interrupted(config.sections.output, config.steps))
    status("train")("starting (importing JAX)")  # a terminal's first line, before seconds
    import_models()
    from effijax.checkpoint import rest_of_stderr_to
    from effijax.errors import SaveError, WriteError
    from effijax.recipe import train
    from effijax.run import NonFiniteError

    try:
        train(config, argv=getattr(args, "argv", None))
    except ConfigError as e:
        return _error(e)
    except (SaveError, WriteError) as e:  # a full disk: one line, the traceback in a log
        print(f"effijax train: error: {e}", file=sys.stderr, flush=True)
        rest_of_stderr_to(e.log)
        return 1
    except NonFiniteError as e:
        print(f"effijax train: error: {e}. Lower the learning rate (--lr {config.lr / 10:g}), "
              f"clip harder (--clip {min(config.clip or 1.0, 1.0) / 4:g}), or skip such steps "
              "with a loss scale (--loss-scale dynamic)", file=sys.stderr, flush=True)
        return 1
    return 0
