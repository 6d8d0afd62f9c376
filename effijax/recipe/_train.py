"""``train(config)``: the one training recipe, readable top to bottom.

Every stage of a run is one call in :func:`train`: start (processes, devices, mesh) → source →
model → data → optimizer → plan (abstract state, shardings, step) → run directory (lock,
resume) → state (fresh, ``init_from``, or resumed) → compile → loop → evaluate → export →
summary. The CLI, the experiments and the notebooks all train through it; each stage is a
small function with a typed input and output (its own module when it is more than a few
lines), so a stage can also be called on its own.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from effijax import distributed
from effijax.errors import ConfigError
from effijax.models import format_of
from effijax.precision import PRESET_NAMES, AutoPrecision, auto_precision, cpu_flags, native_bf16
from effijax.recipe import _finish, _job, _preflight, _report, _resume, _sources, _watch
from effijax.recipe._config import TrainConfig, lora_fields
from effijax.recipe._data import Dataset, load_dataset
from effijax.recipe._identity import default_warmup
from effijax.recipe._loop import loop
from effijax.recipe._objectives import get_objective
from effijax.recipe._optimizer import optimizer_for
from effijax.recipe._prepared import check_sources, training_data
from effijax.recipe._rundir import open_run, run_record
from effijax.recipe._state import Initial, initial_state
from effijax.sharding import make_mesh

__all__ = ["train", "TrainResult", "start", "model_for", "decide_precision", "resolve",
           "load_data", "plan_run", "compile_run"]


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


def train(config: TrainConfig, *, argv: list[str] | None = None) -> TrainResult:
    """Trains as ``config`` says; see the module docstring for the stages.

    Args:
      config: the run's settings.
      argv: the command line that started it (printed as the command that resumes it).

    Raises:
      ConfigError: a bad setting, found before anything is compiled.
      effijax.run.NonFiniteError: too many consecutive non-finite steps (the message says
        which checkpoint is the last good one).
      effijax.errors.SaveError: a checkpoint could not be written (one line; the details in
        the run directory's ``error.log``).

    Example:
      >>> import tempfile
      >>> cfg = TrainConfig(model="tiny", seq_len=16, steps=4, batch_size=2, eval_batches=1,
      ...                   checkpoints=False, progress=False, out=tempfile.mkdtemp())
      >>> result = train(cfg)  # doctest: +ELLIPSIS
      effijax train: tiny GPT, ... params, precision fp32 (auto: ...), 1 device -> ...
      >>> result.status, result.summary["steps"]
      ('done', 4)
    """
    _sources.check_paths(config)  # before any process joins or anything is created
    check_sources(config.data, config.data_format, config.text_column)
    _sources.check_chat_template(config)  # from the tokenizer alone: before any weights
    mesh = start(config)
    try:
        if config.init_from:
            _report.reading(config.init_from)
        source = _sources.read_source(config.init_from, config.seq_len,
                                      keep_blocks=config.frozen_dtype == "gguf") \
            if config.init_from else None
        model = model_for(config, source)
        precision = decide_precision(config, model)
        config = resolve(config, mesh, precision.precision)
        _report.stage(config, f"reading the data ({config.data or 'the standard library'})")
        data = load_data(config, model)
        optimizer = optimizer_for(config)
        job = plan_run(config, model, optimizer, data, mesh,
                   None if source is None else source.params)
        origin = None
        if source is not None:  # its checkpoint checked against the plan, its params loaded
            origin, source = _sources.starting_point(source, model, mesh)
        run = open_run(config, job, run_record(
            job, origin, data, None if source is None else source.weights,
            chat_template=model.tokenizer.chat_template if config.chat_template else None))
        if run.finished:  # the same run, already trained this far: its files stay as they are
            _report.finished_before(config, run.resume_step)
            return TrainResult(config.out, {}, "finished_before", config)
        with run.dir:  # its lock and checkpointer, released however the run ends
            initial = initial_state(config, job, run, source)
            if source is not None:
                # The loaded weights now live in the state or the frozen base (quantized, or
                # cast): drop the source's full-precision copy rather than hold it all run.
                source = source._replace(params=None)
            _report.stage(config, "compiling the training step")
            compiled = compile_run(config, job, initial, source, data, precision.reason)
            memory = _report.summary_extras(job, compiled)["memory"]
            with _watch.watching(config, run.run_json, memory, run.resume_step or 0) as watch:
                resumed = run.resume_step is not None
                before = _finish.evaluate_start(  # before the loop donates the state
                    config, job, initial, data.val, run.config_json["run"] if resumed else None)
                run.dir.begin(_finish.with_start(run.config_json, before), append=resumed)
                trained = loop(config, job, run, compiled, initial, data.train, watch)
                if trained.signal is not None:
                    _report.stopped(config, trained.summary, trained.signal,
                                    config.checkpoints, argv)
                    return TrainResult(config.out, trained.summary, "stopped", config)
                evaluation = _finish.evaluate_end(config, job, trained.state.params, data.val,
                                              initial.frozen)
                exports = _finish.export(config, job, trained.state.params, initial.frozen)
                summary = _finish.summarize(job, compiled, trained.summary, config.out,
                                            {**before, **evaluation, **exports})
                watch.finish(summary)
                run.dir.finish(summary, title=_report.title(config, job))
                _report.done(config, summary)
                return TrainResult(config.out, summary, "done", config)
    finally:
        distributed.shutdown()


def start(config: TrainConfig):
    """Joins the multi-process run (if any), forces CPU devices, builds the mesh against the
    devices found (None: one device): the last checks before anything is compiled."""
    # Every process says what it waits for (stderr: the other processes' stdout stays quiet).
    launch = distributed.join(config.coordinator_address, config.num_processes,
                              config.process_id, cluster=config.cluster,
                              local_device_count=config.cpu_devices,
                              join_timeout=config.join_timeout, print_fn=_to_stderr)
    if launch.launcher is not None and (config.verbose or launch.settings.process_id == 0):
        print(f"effijax train: {launch.describe()}", flush=True)
    if config.strategy is None and config.mesh is None and jax.process_count() == 1:
        if config.cpu_devices and config.cpu_devices > 1 and jax.process_index() == 0:
            print(f"effijax train: note: {config.cpu_devices} CPU devices but no --strategy or "
                  "--mesh: training on 1 device (add --strategy ddp or fsdp to use them all)")
        return None
    try:
        return make_mesh(**(config.mesh or {"fsdp": -1}))
    except ConfigError as e:
        hint = ("" if config.cpu_devices else "; on CPU, --cpu-devices N forces N devices")
        raise ConfigError("mesh", e.value, e.problem + hint) from None


def _to_stderr(line: str) -> None:
    print(f"effijax train: {line}", file=sys.stderr, flush=True)


def model_for(config: TrainConfig, source):
    """The run's model (:func:`effijax.recipe._sources.build_model`), checked against what the
    run exports."""
    model = _sources.build_model(config, source)
    if config.export_hf:
        try:
            format_of(model)
        except ConfigError as e:
            raise ConfigError("export_hf", True, f"writes a Hugging Face model directory; "
                              f"{e.problem}") from None
    if config.export_gguf is not None:
        from effijax.interop import gguf_format

        try:
            gguf_format(model)
        except ConfigError as e:
            raise ConfigError("export_gguf", config.export_gguf, f"writes a GGUF file; "
                              f"{e.field}={e.value!r}: {e.problem}") from None
    return model


def decide_precision(config: TrainConfig, model) -> AutoPrecision:
    """``config.precision`` decided (:func:`effijax.precision.auto_precision` for ``auto``:
    the backend, the model's width, the CPU's native bf16) and why, for the start-up line.

    ``auto`` keeps the precision of the run ``config.out`` already holds (its resume on
    another machine continues as it began; a run without checkpoints starts afresh). With
    several processes, every process takes process 0's view of the run directory, and bf16 on
    a CPU needs every process' CPU to have native bf16: they must run one program.
    """
    if config.precision != "auto":
        return AutoPrecision(config.precision, "")
    saved = _saved_precision(config) if jax.process_index() == 0 else None
    kept = -1 if saved is None else PRESET_NAMES.index(saved)
    flags = cpu_flags()
    native = native_bf16(flags) is not None
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        rows = np.asarray(multihost_utils.process_allgather(np.array([kept, native], np.int32)))
        kept, native = int(rows[0, 0]), bool(rows[:, 1].all())
    if kept >= 0:
        return AutoPrecision(PRESET_NAMES[kept], "auto: the run's own")
    return auto_precision(jax.default_backend(), model.shape().hidden,
                          flags if native else frozenset())


def _saved_precision(config: TrainConfig) -> str | None:
    """The precision in ``config.out``'s ``config.json`` (None: no such file, or no checkpoints
    to resume from it). A file that cannot be read is reported when the run is opened."""
    saved = Path(config.out) / "config.json"
    if not config.checkpoints or not saved.is_file():
        return None
    try:
        precision = _resume.read_run_json(saved, need_model=False).get("precision")
    except ConfigError:
        return None
    return precision if precision in PRESET_NAMES else None


def resolve(config: TrainConfig, mesh, precision: str) -> TrainConfig:
    """Every ``auto`` decided: the precision (``precision``, a preset's name: what
    :func:`decide_precision` decided), the strategy, warm-up, loss scale and the mesh's actual
    shape (what ``config.json`` records).

    A warm-up at its default follows ``steps``: when a resume may change ``steps``
    (``allow_changes``), it may change that warm-up too, without a second name (a warm-up
    set to another value is a setting of its own).
    """
    allow = config.allowed_changes
    if ("steps" in allow and "warmup" not in allow
            and config.warmup_steps == default_warmup(config.steps)):  # it follows the steps
        allow = (*allow, "warmup")
    return dataclasses.replace(
        config, **config.hyperparameters, precision=precision, loss_scale=config.loss_scale_mode,
        warmup=config.warmup_steps, allow_changes=",".join(allow) or None,
        strategy=None if mesh is None else (config.strategy or implied_strategy(
            mesh if config.mesh else None)),
        mesh=None if mesh is None else {k: int(v) for k, v in mesh.shape.items()})


def implied_strategy(mesh) -> str:
    """The strategy of a run without ``--strategy``: ``fsdp`` for a ``--mesh`` with an ``fsdp``
    axis over more than one device (what naming that axis asks for), else ``ddp`` (``mesh``
    None: no mesh was given, as for several processes, whose mesh effijax chose).

    Example:
      >>> from effijax.sharding import make_mesh
      >>> implied_strategy(make_mesh(fsdp=2, tensor=4)), implied_strategy(make_mesh(data=8))
      ('fsdp', 'ddp')
    """
    return "fsdp" if mesh is not None and mesh.shape.get("fsdp", 1) > 1 else "ddp"


def load_data(config: TrainConfig, model) -> Dataset:
    """The run's :class:`~effijax.recipe.Dataset`: ``config.data`` through the model's
    tokenizer, read as ``config.data_format`` says, 5% held out for validation. A Parquet,
    Arrow or ``datasets`` source (and a mixture's part that is not a store) is first prepared
    into a store in effijax's cache (:func:`~effijax.recipe._prepared.training_data`).
    An objective with data of its own reads it instead (the preference objectives' JSONL pairs:
    :func:`~effijax.recipe._pairs.load_pairs`)."""
    load = get_objective(config.objective).load
    if load is not None:
        return load(config.data, model)
    say = (lambda line: print(f"effijax train: data: {line}", flush=True)) \
        if jax.process_index() == 0 else (lambda line: _to_stderr(f"data: {line}"))
    data = training_data(config.data, getattr(model, "tokenizer", None),
                         chat_template=config.chat_template, data_format=config.data_format,
                         text_column=config.text_column, print_fn=say)
    return load_dataset(data, model, data_format=config.data_format)


def plan_run(config: TrainConfig, model, optimizer, data: Dataset, mesh,
         base: Any = None) -> _job.Job:
    """The run's :class:`~effijax.recipe.Job` (:func:`~effijax.recipe.plan_job`): abstract
    state, shardings and step for the config's precision, strategy, LoRA and batch
    (``base``: the loaded pretrained parameters, whose kept GGUF blocks a ``gguf`` frozen base
    uses)."""
    spec = config.lora_spec(model.lora_targets)
    with lora_fields():  # the spec's checks against the model: rank, targets
        return _job.plan_job(model, config.precision, optimizer, batch_size=config.batch_size,
                             mesh=mesh, strategy=config.strategy or implied_strategy(None),
                             lora=spec,
                             seed=config.seed, frozen_dtype=None if config.frozen_dtype == "auto"
                             else config.frozen_dtype, masked=data.masked,
                             segmented=data.segmented,
                             kept_blocks=base if config.frozen_dtype == "gguf" else None,
                             objective=get_objective(config.objective),
                             objective_settings=config.objective_settings)


def compile_run(config: TrainConfig, job, initial: Initial, source, data: Dataset,
                why: str = ""):
    """Compiles the step (a :class:`~effijax.recipe.CompiledStep`), checks its memory against
    every process' devices and prints the start-up lines (``why``: how ``auto`` decided the
    precision, as :func:`decide_precision` says)."""
    compiled = _job.compile_job(job)
    _resume.agree(_preflight.memory, compiled.memory, job, config.device_memory, config.steps)
    _report.print_start(config, job, compiled, source, initial.frozen, initial.state,
                        data=data.note, why=why)
    return compiled
