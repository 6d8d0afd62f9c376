"""``effijax train``: train a GPT on an offline byte corpus with a precision policy.

With no flags it trains the ``mini`` GPT on the local Python standard library's source for 300
steps (a couple of minutes on a 2-core CPU) and writes ``runs/train/``: ``config.json``,
``metrics.jsonl``, ``summary.json`` and ``loss.png``.

``--strategy {ddp,zero1,zero2,fsdp}`` with ``--mesh data=2,fsdp=4`` trains data-parallel over
every device (``--cpu-devices 8`` forces CPU devices); ``summary.json`` then records the
per-device memory and the collectives of the compiled step. Several processes run the same
command with ``--coordinator HOST:PORT --num-processes N --process-id I`` (or the
``EFFIJAX_COORDINATOR``/``EFFIJAX_NUM_PROCESSES``/``EFFIJAX_PROCESS_ID`` environment); only
process 0 prints and writes files.

Checkpoints go to ``OUT/checkpoints`` every ``--checkpoint-every`` steps (asynchronously) and at
the end, the newest ``--keep`` kept. Running the same command on an ``OUT`` that holds
checkpoints resumes from the latest one (checked against the model before anything is
compiled) and continues exactly as the uninterrupted run would have, on the same devices.
SIGTERM or SIGINT saves at the next step boundary and exits 0.

``--init-from RUN_DIR`` starts from the parameters of an earlier run's latest checkpoint (the
model is that run's), e.g. to fine-tune on another ``--data``; with ``--lora-rank R`` only
rank-R LoRA adapters train while that base stays frozen (stored in ``--frozen-dtype``), and the
run writes the adapters alone (``adapters.safetensors``) and in Hugging Face PEFT's format
(``peft/``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import shlex
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from effijax.errors import ConfigError

PRECISIONS = ("auto", "fp32", "bf16", "fp16", "pure_bf16")
DEFAULT_MODEL = "mini"
# Every linear layer of the blocks: what "LoRA Learns Less and Forgets Less" adapts.
LORA_TARGETS = r"(attn/(q|k|v|o)|mlp/(fc_in|fc_out))/kernel"
FROZEN_DTYPES = ("auto", "fp32", "bf16", "fp16")


def add_parsers(sub) -> None:
    """Registers ``train`` on an ``argparse`` subparsers object."""
    p = sub.add_parser(
        "train",
        help="train a GPT on an offline corpus",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--precision", default="auto", choices=PRECISIONS,
                   help="precision policy preset; auto = bf16 on GPU/TPU, fp32 on CPU (where "
                   "bf16 matmuls are emulated and slower)")
    p.add_argument("--loss-scale", default="auto",
                   help="'auto' (dynamic for fp16, none otherwise), 'dynamic', 'none', or a "
                   "number for a static scale")
    p.add_argument("--model", default=None,
                   help=f"GPT preset: tiny, mini, small, base (default: {DEFAULT_MODEL}, or "
                   "the --init-from run's model)")
    p.add_argument("--steps", type=int, default=300, help="training steps")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="sequence length (default: the model preset's)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 5%%)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0, help="global-norm clip; 0 disables")
    p.add_argument("--accumulate", type=int, default=1,
                   help="micro-steps per optimizer step (optax.MultiSteps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None,
                   help="a text file or folder (default: the Python standard library source)")
    p.add_argument("--out", default="runs/train", help="run directory")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches at the end")
    p.add_argument("--cpu-devices", type=int, default=None,
                   help="force N CPU devices (for runs without an accelerator); per process")
    p.add_argument("--strategy", default=None, metavar="{ddp,zero1,zero2,fsdp,zero3}",
                   help="data-parallel sharding strategy over the mesh; default: one device, "
                   "or ddp when --mesh is given or the run has several processes")
    p.add_argument("--mesh", default=None,
                   help="mesh axis sizes, e.g. 'data=2,fsdp=4' (default: every device on fsdp)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="multi-process: process 0's coordinator address (default: "
                   "$EFFIJAX_COORDINATOR)")
    p.add_argument("--num-processes", type=int, default=None,
                   help="multi-process: number of processes (default: $EFFIJAX_NUM_PROCESSES "
                   "or 1)")
    p.add_argument("--process-id", type=int, default=None,
                   help="multi-process: this process' index (default: $EFFIJAX_PROCESS_ID)")
    p.add_argument("--checkpoint-every", type=int, default=100,
                   help="save a checkpoint to OUT/checkpoints every K steps (and at the end)")
    p.add_argument("--keep", type=int, default=3, help="checkpoints to keep (the newest)")
    p.add_argument("--no-checkpoints", action="store_true",
                   help="write no checkpoints (and do not resume from OUT/checkpoints)")
    p.add_argument("--max-non-finite", type=int, default=3, metavar="K",
                   help="stop with an error after K consecutive steps whose loss or gradients "
                   "are not finite and were not skipped by a loss scale; 0 never stops")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    ft = p.add_argument_group("fine-tuning")
    ft.add_argument("--init-from", default=None, metavar="RUN_DIR",
                    help="start from the parameters of an earlier run's latest checkpoint "
                    "(RUN_DIR/checkpoints); the model is that run's")
    ft.add_argument("--lora-rank", type=int, default=None, metavar="R",
                    help="train rank-R LoRA adapters; the base parameters stay frozen")
    ft.add_argument("--lora-alpha", type=float, default=None, metavar="A",
                    help="LoRA alpha; updates are scaled by alpha/rank (default: 8, PEFT's)")
    ft.add_argument("--lora-targets", default=None, metavar="REGEX",
                    help="regex over '/'-joined parameter paths (default: every attention and "
                    f"MLP kernel, {LORA_TARGETS!r})")
    ft.add_argument("--lora-dropout", type=float, default=None, metavar="P",
                    help="dropout on the adapters' input (default: 0)")
    ft.add_argument("--frozen-dtype", default=None, choices=FROZEN_DTYPES,
                    help="storage dtype of the frozen base (default auto: the precision's "
                    "compute dtype)")
    p.set_defaults(func=run)


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """The validated settings of one ``effijax train`` run (what ``config.json`` records)."""

    precision: str
    loss_scale: str | float | None
    model: str
    steps: int
    batch_size: int
    seq_len: int | None
    lr: float
    warmup: int
    weight_decay: float
    clip: float | None
    accumulate: int
    seed: int
    data: str | None
    out: str
    eval_batches: int
    strategy: str | None = None
    mesh: dict | None = None
    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    checkpoint_every: int | None = 100
    keep: int = 3
    max_non_finite: int | None = 3
    init_from: str | None = None
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_targets: str | None = None
    lora_dropout: float | None = None
    frozen_dtype: str | None = None

    def lora_spec(self):
        """The run's :class:`~effijax.lora.LoraSpec`, or None for full training."""
        if self.lora_rank is None:
            return None
        from effijax.lora import LoraSpec

        return LoraSpec(rank=self.lora_rank, alpha=self.lora_alpha, targets=self.lora_targets,
                        dropout=self.lora_dropout)


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if not isinstance(value, int) or value < minimum:
        raise ConfigError(name, value, f"must be an integer >= {minimum}")
    return value


def validate(args: argparse.Namespace) -> TrainSettings:
    """Checks every flag before jax starts; raises :class:`ConfigError` naming the flag.

    What needs the device count (``--mesh`` against the devices, ``--batch-size`` against
    data*fsdp) is checked right after jax starts, still before anything is compiled.
    """
    from effijax.models import PRESETS as MODEL_PRESETS

    steps = _positive_int("--steps", args.steps)
    batch = _positive_int("--batch-size", args.batch_size)
    accumulate = _positive_int("--accumulate", args.accumulate)
    _positive_int("--eval-batches", args.eval_batches, 0)
    if args.seq_len is not None:
        _positive_int("--seq-len", args.seq_len, 2)
    if args.model is not None and args.model not in MODEL_PRESETS:
        raise ConfigError("--model", args.model, f"unknown preset; choose from "
                          f"{', '.join(MODEL_PRESETS)}")
    model = args.model or DEFAULT_MODEL
    if args.init_from is not None:
        source = source_config(args.init_from)
        model = _check_same_model(args, source)
    if not args.lr > 0:
        raise ConfigError("--lr", args.lr, "must be > 0")
    if args.clip < 0:
        raise ConfigError("--clip", args.clip, "must be >= 0 (0 disables clipping)")
    if args.weight_decay < 0:
        raise ConfigError("--weight-decay", args.weight_decay, "must be >= 0")
    warmup = args.warmup if args.warmup is not None else max(1, steps // 20)
    if not 0 <= warmup <= steps:
        raise ConfigError("--warmup", warmup, f"must be in [0, --steps={steps}]")
    if steps % accumulate:
        raise ConfigError("--steps", steps, f"must be a multiple of --accumulate={accumulate}")
    if args.cpu_devices is not None:
        _positive_int("--cpu-devices", args.cpu_devices)
    checkpoint_every = _positive_int("--checkpoint-every", args.checkpoint_every)
    keep = _positive_int("--keep", args.keep)
    max_non_finite = _positive_int("--max-non-finite", args.max_non_finite, 0) or None
    strategy, mesh, processes = _validate_parallel(args, batch)

    ls = args.loss_scale.strip().lower() if isinstance(args.loss_scale, str) else args.loss_scale
    if ls == "auto":
        loss_scale = "dynamic" if args.precision == "fp16" else None
    elif ls == "none":
        loss_scale = None
    elif ls == "dynamic":
        loss_scale = "dynamic"
    else:
        try:
            loss_scale = float(ls)
        except ValueError:
            raise ConfigError("--loss-scale", args.loss_scale,
                              "use auto, dynamic, none or a positive number") from None
        if not loss_scale > 0:
            raise ConfigError("--loss-scale", args.loss_scale, "a static scale must be > 0")
    if args.precision == "fp16" and loss_scale is None:
        raise ConfigError("--loss-scale", args.loss_scale,
                          "fp16 without loss scaling loses small gradients; use dynamic")
    if args.data is not None and not Path(args.data).exists():
        raise ConfigError("--data", args.data, "no such file or folder")
    out = Path(args.out)
    try:  # create it now and prove it writable: a run must not fail at its first log line
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out):
            pass
    except OSError as e:
        raise ConfigError("--out", args.out, f"cannot write there ({e.strerror}); choose "
                          "a writable directory") from None
    if args.init_from is not None and Path(args.init_from).resolve() == out.resolve():
        raise ConfigError("--out", args.out, "is the --init-from run itself; write the new run "
                          "to another directory")
    lora = _validate_lora(args)
    return TrainSettings(
        precision=args.precision, loss_scale=loss_scale, model=model, steps=steps,
        batch_size=batch, seq_len=args.seq_len, lr=args.lr, warmup=warmup,
        weight_decay=args.weight_decay, clip=args.clip or None, accumulate=accumulate,
        seed=args.seed, data=args.data, out=str(out), eval_batches=args.eval_batches,
        strategy=strategy, mesh=mesh, **processes,
        checkpoint_every=None if args.no_checkpoints else checkpoint_every, keep=keep,
        max_non_finite=max_non_finite,
        init_from=None if args.init_from is None else str(Path(args.init_from).resolve()),
        **lora,
    )


def source_config(run_dir: str) -> dict:
    """The ``config.json`` of the ``--init-from`` run, checked to be a full (non-LoRA) run
    with checkpoints; raises :class:`ConfigError` naming ``--init-from``."""
    run = Path(run_dir)
    if not run.is_dir():
        raise ConfigError("--init-from", run_dir, "no such run directory")
    try:
        config = json.loads((run / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError("--init-from", run_dir, f"cannot read its config.json ({e}); pass "
                          "the --out directory of an earlier effijax train run") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_config"), dict):
        raise ConfigError("--init-from", run_dir, "its config.json has no model_config; pass "
                          "the --out directory of an earlier effijax train run")
    if config.get("lora_rank") is not None:
        raise ConfigError("--init-from", run_dir, "is a LoRA run (its checkpoints hold adapters, "
                          "not a model); start from the run it fine-tuned, or merge its "
                          "adapters with effijax.lora.merge first")
    if config.get("checkpoint_every") is None or not (run / "checkpoints").is_dir():
        raise ConfigError("--init-from", run_dir, "has no checkpoints (it ran with "
                          "--no-checkpoints?); rerun it with checkpoints")
    return config


def _check_same_model(args, source: dict) -> str:
    """The --init-from run's preset; --model and --seq-len may only repeat the run's."""
    name = source.get("model")
    if args.model is not None and args.model != name:
        raise ConfigError("--model", args.model, f"the --init-from run trained {name!r}; drop "
                          "--model (the run's model is used) or start from another run")
    seq_len = source["model_config"].get("seq_len")
    if args.seq_len is not None and args.seq_len != seq_len:
        raise ConfigError("--seq-len", args.seq_len, f"the --init-from run's model has "
                          f"{seq_len} positions; drop --seq-len or use {seq_len}")
    return name


def _validate_lora(args) -> dict:
    """The LoRA settings (defaults filled in when --lora-rank is given), checked."""
    given = {flag: value for flag, value in (
        ("--lora-alpha", args.lora_alpha), ("--lora-targets", args.lora_targets),
        ("--lora-dropout", args.lora_dropout), ("--frozen-dtype", args.frozen_dtype))
        if value is not None}
    if args.lora_rank is None:
        if given:
            flag, value = next(iter(given.items()))
            raise ConfigError(flag, value, "only applies to LoRA; add --lora-rank R")
        return {}
    _positive_int("--lora-rank", args.lora_rank)
    targets = LORA_TARGETS if args.lora_targets is None else args.lora_targets
    try:
        re.compile(targets)
    except re.error as e:
        raise ConfigError("--lora-targets", targets, f"not a valid regex ({e})") from None
    alpha = 8.0 if args.lora_alpha is None else args.lora_alpha
    if not alpha > 0:
        raise ConfigError("--lora-alpha", alpha, "must be > 0")
    dropout = 0.0 if args.lora_dropout is None else args.lora_dropout
    if not 0 <= dropout < 1:
        raise ConfigError("--lora-dropout", dropout, "must be in [0, 1)")
    frozen = None if args.frozen_dtype in (None, "auto") else args.frozen_dtype
    return {"lora_rank": args.lora_rank, "lora_alpha": alpha, "lora_targets": targets,
            "lora_dropout": dropout, "frozen_dtype": frozen}


_FLAGS = {"coordinator_address": "--coordinator", "num_processes": "--num-processes",
          "process_id": "--process-id", "mesh": "--mesh", "batch_size": "--batch-size",
          "strategy": "--strategy", "local_device_count": "--cpu-devices"}


def _as_flag(e: ConfigError) -> ConfigError:
    """The same error, naming the command-line flag instead of the library argument."""
    field = e.field
    for name, flag in _FLAGS.items():
        if field == name or field.startswith(name + "="):
            field = flag
    return ConfigError(field, e.value, e.problem)


def _validate_parallel(args, batch: int):
    """Strategy, mesh and process flags: everything checkable before jax starts."""
    from effijax.distributed import resolve
    from effijax.sharding import get_strategy, parse_mesh

    try:
        processes = resolve(args.coordinator, args.num_processes, args.process_id)
        strategy = None if args.strategy is None else get_strategy(args.strategy).name
        mesh = None if args.mesh is None else parse_mesh(args.mesh)
    except ConfigError as e:
        raise _as_flag(e) from None
    if strategy is None and (mesh is not None or processes.num_processes > 1):
        strategy = "ddp"  # a mesh (or several processes) means data-parallel
    if strategy is not None and mesh is None:
        mesh = {"fsdp": -1}
    if batch % processes.num_processes:
        raise ConfigError("--batch-size", batch, f"must be divisible by --num-processes="
                          f"{processes.num_processes} (each process builds its own rows)")
    return strategy, mesh, {"coordinator": processes.coordinator_address,
                            "num_processes": processes.num_processes,
                            "process_id": processes.process_id}


def _start(settings: TrainSettings, cpu_devices: int | None):
    """Starts jax (forced CPU devices, the multi-process run) and builds the mesh against the
    devices it found: the last pre-flight checks, before anything is compiled."""
    from effijax import distributed
    from effijax.sharding import check_batch, make_mesh

    try:
        distributed.initialize(settings.coordinator, settings.num_processes,
                               settings.process_id, local_device_count=cpu_devices)
        if settings.strategy is None:
            return None
        mesh = make_mesh(**settings.mesh)
        check_batch(settings.batch_size, mesh)
    except ConfigError as e:
        raise _as_flag(e) from None
    return mesh


def run(args: argparse.Namespace) -> int:
    """Runs ``effijax train``; returns the exit code."""
    try:
        settings = validate(args)
    except ConfigError as e:
        print(f"effijax train: error: {e}", file=sys.stderr)
        return 2
    try:
        mesh = _start(settings, args.cpu_devices)
    except ConfigError as e:
        print(f"effijax train: error: {e}", file=sys.stderr)
        return 2
    from effijax import distributed

    try:
        return _train(args, settings, mesh)
    finally:
        distributed.shutdown()


def _train(args: argparse.Namespace, settings: TrainSettings, mesh) -> int:
    import jax

    if settings.precision == "auto":
        resolved = "fp32" if jax.default_backend() == "cpu" else "bf16"
        settings = dataclasses.replace(settings, precision=resolved)

    from effijax.data import corpus_fingerprint, load_corpus, split_corpus
    from effijax.jobs import build_lm_job
    from effijax.models import GPTConfig, gpt_config

    if settings.init_from is not None:
        model = GPTConfig(**source_config(settings.init_from)["model_config"])
    else:
        overrides = {} if settings.seq_len is None else {"seq_len": settings.seq_len}
        model = gpt_config(settings.model, **overrides)
    try:
        tokens = load_corpus(settings.data)
    except (FileNotFoundError, ValueError) as e:
        print(f"effijax train: error: --data: {e}", file=sys.stderr)
        return 2
    train_tokens, val_tokens = split_corpus(tokens)
    if min(len(train_tokens), len(val_tokens)) <= model.seq_len + 1:
        print(f"effijax train: error: --data: corpus of {len(tokens)} bytes is too short for "
              f"--seq-len {model.seq_len}", file=sys.stderr)
        return 2
    optimizer = _optimizer(dataclasses.asdict(settings))
    spec = settings.lora_spec()
    ckpt_dir = Path(settings.out) / "checkpoints"
    resume_step = None
    try:
        # Pre-flight, before anything is initialized or compiled: shapes and dtypes only.
        from effijax.jobs import abstract_lm_state

        abstract = _lora_flags(lambda: abstract_lm_state(
            model, settings.precision, optimizer, seed=settings.seed, lora=spec))
        if settings.checkpoint_every is not None:
            from effijax.checkpoint import validate_resume

            resume_step = validate_resume(ckpt_dir, abstract)
        base, source = (None, None) if settings.init_from is None else _load_init_from(
            settings.init_from, model, mesh)
    except ConfigError as e:
        print(f"effijax train: error: {e}", file=sys.stderr)
        return 2
    if resume_step is not None and resume_step > settings.steps:
        print(f"effijax train: error: --steps={settings.steps}: {ckpt_dir} holds step "
              f"{resume_step}, past --steps; raise --steps or choose another --out",
              file=sys.stderr)
        return 2
    job = build_lm_job(
        model, settings.precision, optimizer, train_tokens=train_tokens, val_tokens=val_tokens,
        batch_size=settings.batch_size, seed=settings.seed,
        num_eval_batches=settings.eval_batches, mesh=mesh, strategy=settings.strategy or "ddp",
        **({} if spec is None else {"lora": spec, "frozen_dtype": settings.frozen_dtype}),
        **({} if spec is None or base is None else {"base_params": base}))
    if spec is None and base is not None:  # full fine-tuning: the run's parameters, our layout
        job = job._replace(state=job.state._replace(params=_like(base, job.state.params)))
    del base
    config = {
        **dataclasses.asdict(settings),
        "mesh": None if mesh is None else dict(mesh.shape),
        "strategy": job.strategy or "single-device",
        "model_config": dataclasses.asdict(model),
        "num_params": job.num_params,
        "trainable_params": job.trainable_params,
        "init_from_checkpoint": source,
        "corpus_bytes": int(len(tokens)),
        "corpus_sha256": corpus_fingerprint(tokens),
        "devices": [str(d) for d in jax.devices()],
        "process_count": jax.process_count(),
    }
    is_main = jax.process_index() == 0
    ckpt = None
    state = job.state
    if settings.checkpoint_every is not None:
        from effijax.checkpoint import open_checkpoints, restore_target, truncate_metrics
        from effijax.run import library_versions

        ckpt = open_checkpoints(ckpt_dir, every=settings.checkpoint_every, keep=settings.keep,
                                metadata={"config": config, "versions": library_versions()})
    try:
        if resume_step is not None:
            saved = ckpt.metadata(resume_step).get("metadata", {}).get("config", {})
            if saved.get("init_from_checkpoint") != source:
                print(f"effijax train: error: --init-from: {ckpt_dir} continues a run that "
                      f"started from {saved.get('init_from_checkpoint')}, not from {source}; "
                      "use a fresh --out", file=sys.stderr)
                ckpt.close()
                return 2
            shardings = (job.shardings if job.shardings is not None
                         else jax.tree.map(lambda x: x.sharding, job.state))
            state = ckpt.restore(resume_step,
                                 target_state_abstract=restore_target(job.state, shardings))
            job = job._replace(state=None)  # the initial state is not needed any more
            if is_main:
                truncate_metrics(Path(settings.out) / "metrics.jsonl", resume_step)
                if saved.get("steps") not in (None, settings.steps):
                    print(f"effijax train: warning: --steps={settings.steps} but the checkpointed "
                          f"run had --steps={saved['steps']}; the learning-rate schedule spans "
                          "--steps, so the continued run differs from an uninterrupted one")
                print(f"effijax train: resuming from step {resume_step}")
        return _loop(args, settings, mesh, job, state, config, ckpt, resume_step)
    except BaseException:
        if ckpt is not None:
            try:
                ckpt.close()
            except BaseException:  # the first error is the one to report
                pass
        raise


def _optimizer(cfg: dict):
    """The run's optimizer from its settings (those of ``config.json``, so an --init-from
    run's state structure can be rebuilt from its config)."""
    from effijax.train import make_optimizer

    accumulate = cfg.get("accumulate", 1)
    return make_optimizer(cfg["lr"], cfg["steps"] // accumulate,
                          warmup_steps=cfg["warmup"] // accumulate,
                          weight_decay=cfg["weight_decay"], clip_norm=cfg["clip"],
                          loss_scale=cfg["loss_scale"], accumulate=accumulate)


_LORA_FIELDS = {"rank": "--lora-rank", "targets": "--lora-targets", "alpha": "--lora-alpha",
                "dropout": "--lora-dropout"}


def _lora_flags(build):
    """Runs ``build()``; a LoraSpec error (rank above a dimension, targets matching nothing)
    names the command-line flag."""
    try:
        return build()
    except ConfigError as e:
        flag = _LORA_FIELDS.get(e.field.split("=")[0])
        raise e if flag is None else ConfigError(flag, e.value, e.problem) from None


def _load_init_from(run_dir: str, model, mesh):
    """The parameters of ``run_dir``'s latest checkpoint, and where they came from.

    The run's state structure is rebuilt from its ``config.json`` and checked against the
    checkpoint's metadata first (nothing loaded). The state is restored laid out like fsdp
    over ``mesh`` (every device holds 1/N of it; on one device, whole), read-only.
    """
    import warnings

    import jax

    from effijax.checkpoint import read_checkpoint, restore_target, validate_resume
    from effijax.jobs import abstract_lm_state
    from effijax.sharding import ReplicatedParameterWarning, state_shardings

    config = source_config(run_dir)
    directory = Path(run_dir) / "checkpoints"
    try:
        abstract = abstract_lm_state(model, config["precision"], _optimizer(config),
                                     seed=config.get("seed", 0))
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError("--init-from", run_dir, f"its config.json cannot be read as an "
                          f"effijax train config ({e!r})") from None
    try:
        step = validate_resume(directory, abstract)
    except ConfigError as e:
        raise ConfigError("--init-from", run_dir, e.problem) from None
    if step is None:
        raise ConfigError("--init-from", run_dir, f"{directory} holds no committed checkpoint")
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: device, abstract)
    else:
        with warnings.catch_warnings():  # a transient layout: small leaves stay whole
            warnings.simplefilter("ignore", ReplicatedParameterWarning)
            shardings = state_shardings(abstract, mesh, "fsdp")
    state, record = read_checkpoint(directory, step=step,
                                    target_state_abstract=restore_target(abstract, shardings))
    source = {"run": str(Path(run_dir).resolve()), "step": int(step),
              "saved_at": record.get("saved_at")}
    return state.params, source


def _like(params, target):
    """``params`` in ``target``'s dtypes and shardings (a full fine-tune's starting point)."""
    import jax

    shardings = jax.tree.map(lambda x: x.sharding, target)
    dtypes = jax.tree.map(lambda x: x.dtype, target)
    return jax.jit(lambda p: jax.tree.map(lambda x, d: x.astype(d), p, dtypes),
                   out_shardings=shardings)(params)


def _loop(args, settings: TrainSettings, mesh, job, state, config: dict, ckpt,
          resume_step: int | None) -> int:
    """Compiles, trains (checkpointing, stopping cleanly on SIGTERM/SIGINT), evaluates."""
    import jax

    from effijax.run import NonFiniteError, RunDir, train_loop
    from effijax.sharding import census_records

    run_dir = RunDir(settings.out, config=config, append=resume_step is not None)
    # Every process compiles the step once; the census is read from that same compilation.
    t_compile = time.perf_counter()
    compiled = job.compile(census=mesh is not None)
    compile_s = time.perf_counter() - t_compile
    if run_dir.is_main:
        where = (f"{job.strategy} on mesh {_mesh_text(mesh)}, {jax.process_count()} "
                 "process(es)" if mesh is not None else "1 device")
        print(f"effijax train: {settings.model} GPT, {job.num_params:,} params, "
              f"precision {settings.precision}, {where} -> {settings.out}")
        print(_memory_line(compiled))
        if settings.init_from is not None:
            print(f"effijax train: initialised from {settings.init_from} (step "
                  f"{config['init_from_checkpoint']['step']})")
        if job.lora is not None:
            from effijax.lora import trainable_report

            frozen = {str(x.dtype) for x in jax.tree.leaves(job.frozen)}
            print(f"effijax train: LoRA rank {job.lora.rank}, alpha {job.lora.alpha:g} on "
                  f"{job.lora.targets!r}, frozen base in {'/'.join(sorted(frozen))}; "
                  + trainable_report(job.frozen, state.params))
    start = {}
    if resume_step is None and settings.eval_batches and (
            settings.init_from is not None or job.lora is not None):
        start["eval_loss_start"] = job.evaluate(state.params)  # before the state is donated

    def save(state, force: bool = False) -> None:
        result = ckpt.save(state, force=force)
        if result.reason == "non_finite" and run_dir.is_main:
            print(f"effijax train: warning: step {result.step} has non-finite parameters or "
                  "optimizer state; not checkpointed (training goes on)", file=sys.stderr,
                  flush=True)

    stop = _StopFlag(jax.process_count())
    t0 = time.perf_counter()
    with stop.installed():
        try:
            state, summary = train_loop(
                compiled.step, state, job.batch, num_steps=settings.steps,
                tokens_per_step=job.tokens_per_step, run_dir=run_dir,
                progress=not args.no_progress, should_stop=stop,
                checkpoint=save if ckpt is not None else None,
                checkpoint_every=settings.checkpoint_every,
                max_non_finite=settings.max_non_finite)
        except NonFiniteError as e:
            if ckpt is None:
                where = "no checkpoint (--no-checkpoints)"
            else:
                ckpt.wait()  # the writes in flight hold older, finite states
                last = ckpt.latest_step()
                ckpt.close()
                where = ("no checkpoint yet" if last is None else
                         f"the last good checkpoint is step {last} in {ckpt.directory}; "
                         "rerun the same command to resume from it")
            if run_dir.is_main:
                print(f"effijax train: error: {e}; {where}. Lower --lr, clip harder, or train "
                      "with --precision fp16 --loss-scale dynamic (skips such steps)",
                      file=sys.stderr, flush=True)
            return 1
    summary["wall_time_s"] = time.perf_counter() - t0
    if ckpt is not None:
        save(state, force=True)
        ckpt.close()  # waits for the last write; raises if any write failed
    summary["compile_s"] = compile_s
    if stop.stopped:
        if run_dir.is_main:
            again = shlex.join(["effijax", *getattr(args, "argv", ["train", "--out",
                                                                   settings.out])])
            print(f"effijax train: stopped at step {summary['steps']} by {stop.signal_name}"
                  + (f"; saved; resume with: {again}" if ckpt is not None
                     else " (--no-checkpoints: nothing saved)"), flush=True)
        return 0
    summary.update(start)
    if settings.eval_batches:
        summary["eval_loss"] = job.evaluate(state.params)
    if job.lora is not None:
        summary["adapters"] = _write_adapters(state.params, job.lora, settings.out,
                                              run_dir.is_main)
    summary["num_params"] = job.num_params
    summary["memory"] = _memory_summary(compiled.memory)
    summary["collectives"] = census_records(compiled.census)
    run_dir.finish(summary, title=f"{settings.model} GPT, {settings.precision}")
    if run_dir.is_main:
        ev = f", eval loss {summary['eval_loss']:.4f}" if "eval_loss" in summary else ""
        if "eval_loss_start" in summary:
            ev += f" (from {summary['eval_loss_start']:.4f})"
        ran = summary["steps"] - summary["start_step"]
        steps = (f"{summary['steps']} steps" if not summary["start_step"] else
                 f"{summary['steps']} steps ({ran} after resuming at {summary['start_step']})")
        print(f"done: {steps} in {summary['wall_time_s']:.1f}s, final loss "
              f"{summary['final_loss']:.4f}{ev}, {summary['tokens_per_s']:.0f} tokens/s, "
              f"{summary['skipped_steps']} skipped; wrote {settings.out}/")
    return 0


def _write_adapters(adapters, spec, out: str, is_main: bool) -> dict:
    """Writes ``OUT/adapters.safetensors`` and ``OUT/peft/``; returns their paths.

    Every process gathers the (small) adapters; process 0 writes.
    """
    from jax.experimental import multihost_utils

    from effijax.lora import export_peft, save_adapters

    host = multihost_utils.process_allgather(adapters, tiled=True)  # global values, on host
    files = {"adapters": str(Path(out) / "adapters.safetensors"),
             "peft": str(Path(out) / "peft")}
    if is_main:
        save_adapters(files["adapters"], host, spec)
        export_peft(files["peft"], host, spec)
    return files


class _StopFlag:
    """Set by SIGTERM/SIGINT while installed; ``train_loop`` polls it after each step.

    With several processes the signal may reach only one of them (a preempted host), yet all
    must stop at the same step boundary and save the same step (a checkpoint is a collective
    write). So every ``every``-th poll all-gathers the processes' flags (a few bytes; every
    process polls after every step, so they exchange at the same steps) and any raised flag
    stops everyone. Not at every step: waiting for the exchange's result waits for the step
    just dispatched, which would stop the host from running ahead of the devices.
    """

    def __init__(self, num_processes: int = 1, every: int = 10):
        self.signal_name: str | None = None
        self.num_processes = num_processes
        self.every = every
        self.polls = 0
        self.stopped = False  # what the processes agreed on; a later signal changes nothing

    def __call__(self) -> bool:
        local = self.signal_name is not None  # one read: the handler may run at any bytecode
        if self.num_processes == 1:
            self.stopped = local
            return local
        self.polls += 1
        if self.polls % self.every:
            return False
        import numpy as np
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(local))
        self.stopped = bool(np.any(flags))
        if self.stopped and not local:
            self.signal_name = f"a signal to process {int(np.argmax(flags))}"
        return self.stopped

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield self  # handlers can only be installed from the main thread
            return
        old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)


def _mesh_text(mesh) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.shape.items())


def _memory_summary(report) -> dict:
    """Per-device bytes for ``summary.json``: model states from the shardings, the rest from
    ``compiled.memory_analysis()``."""
    out = dataclasses.asdict(report)
    out["model_states"] = report.params + (report.grads or 0) + report.opt_state
    return out


def _memory_line(compiled) -> str:
    from effijax.memory import format_bytes
    from effijax.sharding import census_records

    m = compiled.memory
    text = (f"per device: params {format_bytes(m.params)}, grads {format_bytes(m.grads or 0)}, "
            f"optimizer {format_bytes(m.opt_state)}, temporaries {format_bytes(m.temporaries)}")
    if compiled.census.ops:
        kinds = "; ".join(f"{r['count']} {r['kind']} {r['dtype']} {format_bytes(r['bytes'])}"
                          for r in census_records(compiled.census) if r["bytes"] >= 1024)
        text += f"\ncollectives per step (>= 1 KB): {kinds}"
    return text
