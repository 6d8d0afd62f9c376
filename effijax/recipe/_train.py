"""``train(config)``: the one training recipe, readable top to bottom.

start (processes, devices, mesh) → model → data → optimizer → plan (abstract state, shardings,
step) → state (fresh, ``init_from``, or resumed) → compile → loop → evaluate → export. The CLI,
the experiments and the notebooks all train through it; each stage is a small function of
explicit arguments, so a stage can also be called on its own.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, NamedTuple

from effijax.errors import ConfigError
from effijax.recipe import _report, _sources
from effijax.recipe._config import TrainConfig, lora_fields

__all__ = ["train", "TrainResult", "Session", "start", "resolve", "load_data", "optimizer_for"]


class TrainResult(NamedTuple):
    """What a run produced.

    Attributes:
      out: the run directory.
      summary: ``summary.json``'s content (final and evaluation losses, throughput, memory,
        collectives, exported files); empty when nothing was trained.
      status: ``"done"``, ``"stopped"`` (a signal; saved, resumable), or ``"finished_before"``
        (the run directory already held the finished run: nothing was touched).
      config: the resolved config (every ``auto`` decided), as written to ``config.json``.
    """

    out: str
    summary: dict
    status: str
    config: TrainConfig


class Session(NamedTuple):
    """The running processes and devices: ``mesh`` (None: one device), ``is_main``."""

    mesh: Any
    is_main: bool


def train(config: TrainConfig, *, argv: list[str] | None = None) -> TrainResult:
    """Trains as ``config`` says; see the module docstring for the stages.

    Args:
      config: the run's settings.
      argv: the command line that started it (printed as the command that resumes it).

    Raises:
      ConfigError: a bad setting, found before anything is compiled.
      effijax.run.NonFiniteError: too many consecutive non-finite steps (the message says
        which checkpoint is the last good one).

    Example:
      >>> import tempfile
      >>> cfg = TrainConfig(model="tiny", seq_len=16, steps=4, batch_size=2, eval_batches=1,
      ...                   checkpoints=False, progress=False, out=tempfile.mkdtemp())
      >>> result = train(cfg)  # doctest: +ELLIPSIS
      effijax train: tiny GPT, ... params, precision fp32, 1 device -> ...
      >>> result.status, result.summary["steps"]
      ('done', 4)
    """
    from effijax import distributed

    _sources.check_paths(config)
    session = start(config)
    try:
        return _run(config, session, argv)
    finally:
        distributed.shutdown()


def _run(config: TrainConfig, session: Session, argv) -> TrainResult:
    from effijax.recipe import _job, _preflight, _resume, _state, _watch

    source = (_sources.read_source(config.init_from, config.seq_len) if config.init_from
              else None)
    model = _sources.model_for(config, source)
    if config.export_hf and model.family != "llama":
        raise ConfigError("export_hf", True, f"writes a Hugging Face LlamaForCausalLM; the "
                          f"{model.family} family has no transformers counterpart")
    config = resolve(config, session.mesh)
    data = load_data(config, model)
    optimizer = optimizer_for(config)
    spec = config.lora_spec(model.lora_targets)
    with lora_fields():  # the spec's checks against the model: rank, targets
        job = _job.plan_job(model, config.precision, optimizer, batch_size=config.batch_size,
                            mesh=session.mesh, strategy=config.strategy or "ddp", lora=spec,
                            seed=config.seed, frozen_dtype=None if config.frozen_dtype == "auto"
                            else config.frozen_dtype, masked=data.masked,
                            segmented=data.segmented)
    origin = None
    if source is not None:
        origin, source = _sources.starting_point(source, model, session.mesh, session.is_main)
    run = _state.open_run(config, job, origin, fingerprint=data.fingerprint,
                          corpus_tokens=data.tokens)
    if run.finished:  # the same run, already trained this far: its files stay as they are
        run.release()
        _report.finished_before(config, run.resume_step, session.is_main)
        return TrainResult(config.out, {}, "finished_before", config)
    try:
        state, frozen = _state.initial_state(job, run, source, session.is_main)
        compiled = _job.compile_job(job)
        _resume.agree(_preflight.memory, compiled.memory, job, config.device_memory,
                      config.steps)
        _report.start(config, job, compiled, source, frozen, state, session.is_main,
                      data=data.note)
        memory = _report.summary_extras(job, compiled)["memory"]
        with _watch.watching(config, run.json, memory, run.resume_step or 0,
                             session.is_main) as watch:
            return _state.loop_and_finish(config, job, run, compiled, state, frozen,
                                          (data.train, data.val), argv=argv, watch=watch)
    except BaseException:
        run.release(quiet=True)  # the run's own error is the one to report
        raise
    finally:
        run.release()


def start(config: TrainConfig) -> Session:
    """Joins the multi-process run (if any), forces CPU devices, builds the mesh against the
    devices found: the last checks before anything is compiled."""
    import jax

    from effijax import distributed
    from effijax.sharding import make_mesh

    # Every process says what it waits for (stderr: the other processes' stdout stays quiet).
    launch = distributed.join(config.coordinator_address, config.num_processes,
                              config.process_id, cluster=config.cluster,
                              local_device_count=config.cpu_devices,
                              join_timeout=config.join_timeout, print_fn=_to_stderr)
    if launch.launcher is not None and (config.verbose or launch.settings.process_id == 0):
        print(f"effijax train: {launch.describe()}", flush=True)
    strategy = config.strategy
    processes = jax.process_count()
    if strategy is None and config.mesh is None and processes == 1:
        if config.cpu_devices and config.cpu_devices > 1 and jax.process_index() == 0:
            print(f"effijax train: note: {config.cpu_devices} CPU devices but no --strategy or "
                  "--mesh: training on 1 device (add --strategy ddp or fsdp to use them all)")
        return Session(mesh=None, is_main=True)
    try:
        mesh = make_mesh(**(config.mesh or {"fsdp": -1}))
    except ConfigError as e:
        hint = ("" if config.cpu_devices else "; on CPU, --cpu-devices N forces N devices")
        raise ConfigError("mesh", e.value, e.problem + hint) from None
    return Session(mesh=mesh, is_main=jax.process_index() == 0)


def _to_stderr(line: str) -> None:
    print(f"effijax train: {line}", file=sys.stderr, flush=True)


def resolve(config: TrainConfig, mesh) -> TrainConfig:
    """Every ``auto`` decided: precision from the backend, the strategy, warm-up, loss scale
    and the mesh's actual shape (what ``config.json`` records).

    A warm-up left to its default follows ``steps``: when a resume may change ``steps``
    (``allow_changes``), it may change the derived warm-up too, without a second name.
    """
    import jax

    precision = config.precision
    if precision == "auto":
        precision = "fp32" if jax.default_backend() == "cpu" else "bf16"
    allow = config.allowed_changes
    if config.warmup is None and "steps" in allow and "warmup" not in allow:
        allow = (*allow, "warmup")
    return dataclasses.replace(
        config, **config.hyperparameters, precision=precision, loss_scale=config.loss_scale_mode,
        warmup=config.warmup_steps, allow_changes=",".join(allow) or None,
        strategy=None if mesh is None else (config.strategy or "ddp"),
        mesh=None if mesh is None else {k: int(v) for k, v in mesh.shape.items()})


def load_data(config: TrainConfig, model):
    """The run's :class:`~effijax.recipe.Dataset`: ``config.data`` through the model's
    tokenizer, read as ``config.data_format`` says, 5% held out for validation."""
    from effijax.recipe._data import load_dataset

    return load_dataset(config.data, model, data_format=config.data_format)


def optimizer_for(config: TrainConfig):
    """The optimizer the config chooses, with its warm-up and schedule, clipping, loss scaling
    and accumulation (:func:`effijax.optimizers.make_optimizer`)."""
    from effijax.optimizers import make_optimizer

    k = config.accumulate
    scale = None if config.loss_scale_mode == "none" else config.loss_scale_mode
    return make_optimizer(config.lr, config.steps // k, optimizer=config.optimizer,
                          schedule=config.schedule, warmup_steps=config.warmup_steps // k,
                          lr_end=config.lr_end, decay_fraction=config.decay_fraction,
                          weight_decay=config.weight_decay, no_decay=config.no_decay,
                          clip_norm=config.clip or None, **config.hyperparameters,
                          loss_scale=scale, accumulate=k)
