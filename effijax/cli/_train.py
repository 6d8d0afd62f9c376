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
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from effijax.errors import ConfigError

PRECISIONS = ("auto", "fp32", "bf16", "fp16", "pure_bf16")


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
    p.add_argument("--model", default="mini", help="GPT preset: tiny, mini, small, base")
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
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
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
    if args.model not in MODEL_PRESETS:
        raise ConfigError("--model", args.model, f"unknown preset; choose from "
                          f"{', '.join(MODEL_PRESETS)}")
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
    return TrainSettings(
        precision=args.precision, loss_scale=loss_scale, model=args.model, steps=steps,
        batch_size=batch, seq_len=args.seq_len, lr=args.lr, warmup=warmup,
        weight_decay=args.weight_decay, clip=args.clip or None, accumulate=accumulate,
        seed=args.seed, data=args.data, out=str(out), eval_batches=args.eval_batches,
        strategy=strategy, mesh=mesh, **processes,
        checkpoint_every=None if args.no_checkpoints else checkpoint_every, keep=keep,
    )


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
    from effijax.models import gpt_config
    from effijax.train import make_optimizer

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
    optimizer = make_optimizer(
        settings.lr, settings.steps // settings.accumulate,
        warmup_steps=settings.warmup // settings.accumulate,
        weight_decay=settings.weight_decay, clip_norm=settings.clip,
        loss_scale=settings.loss_scale, accumulate=settings.accumulate,
    )
    ckpt_dir = Path(settings.out) / "checkpoints"
    resume_step = None
    if settings.checkpoint_every is not None:
        # Pre-flight, before anything is initialized or compiled: shapes and dtypes only.
        from effijax.checkpoint import validate_resume
        from effijax.jobs import abstract_lm_state

        try:
            resume_step = validate_resume(ckpt_dir, abstract_lm_state(
                model, settings.precision, optimizer, seed=settings.seed))
        except ConfigError as e:
            print(f"effijax train: error: {e}", file=sys.stderr)
            return 2
        if resume_step is not None and resume_step > settings.steps:
            print(f"effijax train: error: --steps={settings.steps}: {ckpt_dir} holds step "
                  f"{resume_step}, past --steps; raise --steps or choose another --out",
                  file=sys.stderr)
            return 2
    job = build_lm_job(model, settings.precision, optimizer, train_tokens=train_tokens,
                       val_tokens=val_tokens, batch_size=settings.batch_size, seed=settings.seed,
                       num_eval_batches=settings.eval_batches, mesh=mesh,
                       strategy=settings.strategy or "ddp")
    config = {
        **dataclasses.asdict(settings),
        "mesh": None if mesh is None else dict(mesh.shape),
        "strategy": job.strategy or "single-device",
        "model_config": dataclasses.asdict(model),
        "num_params": job.num_params,
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
            shardings = (job.shardings if job.shardings is not None
                         else jax.tree.map(lambda x: x.sharding, job.state))
            state = ckpt.restore(resume_step,
                                 target_state_abstract=restore_target(job.state, shardings))
            job = job._replace(state=None)  # the initial state is not needed any more
            if is_main:
                truncate_metrics(Path(settings.out) / "metrics.jsonl", resume_step)
                saved = ckpt.metadata(resume_step).get("metadata", {}).get("config", {})
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


def _loop(args, settings: TrainSettings, mesh, job, state, config: dict, ckpt,
          resume_step: int | None) -> int:
    """Compiles, trains (checkpointing, stopping cleanly on SIGTERM/SIGINT), evaluates."""
    import jax

    from effijax.run import RunDir, train_loop
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

    def save(state, force: bool = False) -> None:
        result = ckpt.save(state, force=force)
        if result.reason == "non_finite" and run_dir.is_main:
            print(f"effijax train: warning: step {result.step} has non-finite parameters or "
                  "optimizer state; not checkpointed (training goes on)", file=sys.stderr,
                  flush=True)

    stop = _StopFlag()
    t0 = time.perf_counter()
    with stop.installed():
        state, summary = train_loop(
            compiled.step, state, job.batch, num_steps=settings.steps,
            tokens_per_step=job.tokens_per_step, run_dir=run_dir,
            progress=not args.no_progress, should_stop=stop,
            checkpoint=save if ckpt is not None else None,
            checkpoint_every=settings.checkpoint_every)
    summary["wall_time_s"] = time.perf_counter() - t0
    if ckpt is not None:
        save(state, force=True)
        ckpt.close()  # waits for the last write; raises if any write failed
    summary["compile_s"] = compile_s
    if stop.signal_name is not None:
        if run_dir.is_main:
            print(f"effijax train: stopped at step {summary['steps']} by {stop.signal_name}"
                  + (f"; resume with: effijax train --out {settings.out} ..." if ckpt is not None
                     else " (--no-checkpoints: nothing saved)"), flush=True)
        return 0
    if settings.eval_batches:
        summary["eval_loss"] = job.evaluate(state.params)
    summary["num_params"] = job.num_params
    summary["memory"] = _memory_summary(compiled.memory)
    summary["collectives"] = census_records(compiled.census)
    run_dir.finish(summary, title=f"{settings.model} GPT, {settings.precision}")
    if run_dir.is_main:
        ev = f", eval loss {summary['eval_loss']:.4f}" if "eval_loss" in summary else ""
        print(f"done: {summary['steps']} steps in {summary['wall_time_s']:.1f}s, final loss "
              f"{summary['final_loss']:.4f}{ev}, {summary['tokens_per_s']:.0f} tokens/s, "
              f"{summary['skipped_steps']} skipped; wrote {settings.out}/")
    return 0


class _StopFlag:
    """Set by SIGTERM/SIGINT while installed; ``train_loop`` polls it after each step."""

    def __init__(self):
        self.signal_name: str | None = None

    def __call__(self) -> bool:
        return self.signal_name is not None

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
