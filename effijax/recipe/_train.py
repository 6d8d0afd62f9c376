"""``train(config)``: the one training recipe, readable top to bottom.

Every stage of a run is one call in :func:`train`: start (processes, devices, mesh) → source →
model → data → optimizer → plan (abstract state, shardings, step) → run directory (lock,
resume) → state (fresh, ``model_from``, or resumed) → compile → loop → evaluate → export →
summary. The CLI, the experiments and the notebooks all train through it; each stage is a
small function with a typed input and output (its own module when it is more than a few
lines), so a stage can also be called on its own.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from effijax import distributed
from effijax.errors import ConfigError
from effijax.models import format_of
from effijax.precision import PRESET_NAMES, AutoPrecision, auto_precision, cpu_flags, native_bf16
from effijax.recipe import _finish, _job, _report, _resume, _sources, _watch
from effijax.recipe._config import TrainConfig, lora_fields
from effijax.recipe._loop import loop, records_log
from effijax.recipe._objectives import get_objective
from effijax.recipe._optimizer import optimizer_for
from effijax.recipe._rundir import TASK_SCORES, open_run, run_record
from effijax.recipe._sections import (
    DataSection,
    LoraSection,
    ModelSection,
    ObjectiveSection,
    OutputSection,
    ParallelSection,
    PrecisionSection,
    TrainingSection,
)
from effijax.recipe._state import Initial, initial_state
from effijax.sharding import make_mesh
from effijax.sources import (
    Dataset,
    check_compiled_memory,
    check_sources,
    load_dataset,
    training_data,
)

__all__ = ["train", "TrainResult", "start", "model_for", "decide_precision", "placement",
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
    s = config.sections  # each stage receives the sections it reads
    _sources.check_paths(s.model, s.data, s.output, s.lora)  # before any process joins
    if get_objective(config.objective).load is None:  # else its loader reads and checks it
        check_sources(config.data, config.data_format, config.text_column)
    # From the tokenizer alone: before any weights.
    _sources.check_chat_template(s.model, s.data, objective=config.objective)
    if get_objective(config.objective).check is not None:  # GRPO's rewards, imported
        get_objective(config.objective).check(**s.objective.settings)
    tasks = None
    if config.eval_tasks:  # the harness's task names, before any weights
        from effijax.harness import check_eval_tasks

        tasks = check_eval_tasks(config.eval_tasks)
    mesh = start(s.parallel, verbose=config.verbose)
    try:
        if tasks and jax.process_count() > 1:
            raise ConfigError("eval_tasks", config.eval_tasks, "harness tasks are evaluated in "
                              "one process for now; drop --eval-tasks and run effijax eval "
                              "--tasks on the run directory afterwards")
        if config.model_from:
            _report.reading(config.model_from)
        source = _sources.read_source(config.model_from, config.seq_len,
                                      keep_blocks=config.frozen_dtype == "gguf") \
            if config.model_from else None
        model = model_for(s.model, s.data, s.training, source)
        precision = decide_precision(s.precision, s.output, model)
        config = config.resolved(precision.precision, **placement(s.parallel, mesh))
        s = config.sections  # every auto decided
        _report.stage(config.model_from,
                      f"reading the data ({config.data or 'the standard library'})")
        data = load_data(s.data, model, objective=config.objective,
                         settings=s.objective.settings)
        optimizer = optimizer_for(s.training, s.optimizer, s.precision)
        job = plan_run(model, optimizer, data, mesh, None if source is None else source.params,
                       precision=s.precision, training=s.training, parallel=s.parallel,
                       lora=s.lora, objective=s.objective)
        origin = None
        if source is not None:  # its checkpoint checked against the plan, its params loaded
            origin, source = _sources.starting_point(source, model, mesh)
        run = open_run(config.to_dict(), s.output, s.training, job, run_record(
            job, origin, data, None if source is None else source.weights,
            chat_template=model.tokenizer.chat_template if config.chat_template else None))
        if run.finished:  # the same run, already trained this far: its files stay as they are
            _report.finished_before(config.out, config.steps, run.resume_step)
            return TrainResult(config.out, {}, "finished_before", config)
        with run.dir:  # its lock and checkpointer, released however the run ends
            initial = initial_state(s.output, s.training, job, run, source)
            if source is not None:
                # The loaded weights now live in the state or the frozen base (quantized, or
                # cast): drop the source's full-precision copy rather than hold it all run.
                source = source._replace(params=None)
            if job.objective.prepare is not None:  # dpo's reference log-probabilities, once
                data = job.objective.prepare(job, data, params=initial.state.params,
                                             frozen=initial.frozen, out=config.out,
                                             resumed=run.resume_step is not None)
            _report.stage(config.model_from, "compiling the training step")
            compiled = compile_run(job, initial, source, data, precision.reason, model=s.model,
                                   precision=s.precision, training=s.training,
                                   parallel=s.parallel, output=s.output)
            memory = _report.summary_extras(job, compiled)["memory"]
            # An objective without a validation loss (GRPO's) evaluates nothing.
            evaluated = (config.eval_batches
                         if get_objective(config.objective).eval_batches is not None else 0)
            with _watch.watching(s.output, run.run_json, memory, run.resume_step or 0) as watch:
                resumed = run.resume_step is not None
                before = _finish.evaluate_start(  # before the loop donates the state
                    job, initial, data.val, run.config_json["run"] if resumed else None,
                    eval_batches=evaluated, model_from=config.model_from) if evaluated else {}
                run.dir.begin(_finish.with_start(run.config_json, before), append=resumed)
                score_tasks = None if tasks is None else (  # params -> {name: score}
                    lambda params: _finish.score_tasks(
                        job, params, initial.frozen, tasks=tasks[0],
                        limit=config.eval_tasks_limit, precision=config.precision,
                        manager=tasks[1], model_from=config.model_from))
                trained = loop(s.output, job, run, compiled, initial, data.train, watch,
                               steps=config.steps, prefetch=config.prefetch,
                               max_non_finite=config.max_non_finite, evaluate=score_tasks,
                               evaluate_every=config.eval_tasks_every)
                if trained.signal is not None:
                    _report.stopped(config.out, trained.summary, trained.signal,
                                    config.checkpoints, argv)
                    return TrainResult(config.out, trained.summary, "stopped", config)
                evaluation = _finish.evaluate_end(
                    job, trained.state.params, data.val, initial.frozen,
                    eval_batches=evaluated, model_from=config.model_from)
                scores = {} if score_tasks is None else score_tasks(trained.state.params)
                if scores:  # a record of the last step in task_scores.jsonl, and the sinks'
                    records_log(run.dir, trained.summary["steps"], TASK_SCORES)(
                        {"step": trained.summary["steps"], **scores})
                    watch.sinks.values(trained.summary["steps"], scores)
                exports = _finish.export(s.output, s.training, job, trained.state.params,
                                         initial.frozen, model_from=config.model_from)
                summary = _finish.summarize(job, compiled, trained.summary, config.out,
                                            {**before, **evaluation, **scores, **exports})
                watch.finish(summary)
                run.dir.finish(summary, title=_report.title(
                    job, precision=config.precision, model_from=config.model_from))
                _report.done(config.out, summary)
                return TrainResult(config.out, summary, "done", config)
    finally:
        distributed.shutdown()


def start(parallel: ParallelSection, *, verbose: bool = False):
    """Joins the multi-process run (if any), forces CPU devices, builds the mesh against the
    devices found (None: one device), as ``parallel`` says: the last checks before anything is
    compiled (``verbose``: every process prints how it joined, not only process 0)."""
    # Every process says what it waits for (stderr: the other processes' stdout stays quiet).
    launch = distributed.join(distributed.find_launch(
        parallel.coordinator_address, parallel.num_processes, parallel.process_id,
        cluster=parallel.cluster), local_device_count=parallel.cpu_devices,
        join_timeout=parallel.join_timeout, print_fn=_to_stderr)
    if launch.launcher is not None and (verbose or launch.settings.process_id == 0):
        print(f"effijax train: {launch.describe()}", flush=True)
    if parallel.strategy is None and parallel.mesh is None and jax.process_count() == 1:
        if parallel.cpu_devices and parallel.cpu_devices > 1 and jax.process_index() == 0:
            print(f"effijax train: note: {parallel.cpu_devices} CPU devices but no --strategy or "
                  "--mesh: training on 1 device (add --strategy ddp or fsdp to use them all)")
        return None
    try:
        return make_mesh(**(parallel.mesh or {"fsdp": -1}))
    except ConfigError as e:
        hint = ("" if parallel.cpu_devices else "; on CPU, --cpu-devices N forces N devices")
        raise ConfigError("mesh", e.value, e.problem + hint) from None


def _to_stderr(line: str) -> None:
    print(f"effijax train: {line}", file=sys.stderr, flush=True)


def model_for(settings: ModelSection, data: DataSection, training: TrainingSection, source):
    """The run's model (:func:`effijax.recipe._sources.build_model`: the one ``settings``
    names, or ``source``'s, with ``data``'s chat template), checked against what ``training``
    exports."""
    model = _sources.build_model(settings, source, chat_template=data.chat_template)
    if training.export_hf:
        try:
            format_of(model)
        except ConfigError as e:
            raise ConfigError("export_hf", True, f"writes a Hugging Face model directory; "
                              f"{e.problem}") from None
    if training.export_gguf is not None:
        from effijax.interop import gguf_format

        try:
            gguf_format(model)
        except ConfigError as e:
            raise ConfigError("export_gguf", training.export_gguf, f"writes a GGUF file; "
                              f"{e.field}={e.value!r}: {e.problem}") from None
    return model


def decide_precision(precision: PrecisionSection, output: OutputSection, model) -> AutoPrecision:
    """``precision.precision`` decided (:func:`effijax.precision.auto_precision` for ``auto``:
    the backend, the model's width, the CPU's native bf16) and why, for the start-up line.

    ``auto`` keeps the precision of the run ``output.out`` already holds (its resume on
    another machine continues as it began; a run without checkpoints starts afresh). With
    several processes, every process takes process 0's view of the run directory, and bf16 on
    a CPU needs every process' CPU to have native bf16: they must run one program.
    """
    if precision.precision != "auto":
        return AutoPrecision(precision.precision, "")
    saved = _saved_precision(output) if jax.process_index() == 0 else None
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


def _saved_precision(output: OutputSection) -> str | None:
    """The precision in ``output.out``'s ``config.json`` (None: no such file, or no checkpoints
    to resume from it). A file that cannot be read is reported when the run is opened."""
    saved = Path(output.out) / "config.json"
    if not output.checkpoints or not saved.is_file():
        return None
    try:
        precision = _resume.read_run_json(saved, need_model=False).get("precision")
    except ConfigError:
        return None
    return precision if precision in PRESET_NAMES else None


def placement(parallel: ParallelSection, mesh) -> dict:
    """The run's ``strategy`` and ``mesh`` as ``config.json`` records them
    (:meth:`~effijax.recipe.TrainConfig.resolved`): both None on one device (``mesh`` None),
    else ``parallel``'s strategy (or the one its mesh implies) and the mesh's actual shape.

    Example:
      >>> from effijax.recipe import TrainConfig
      >>> from effijax.sharding import make_mesh
      >>> parallel = TrainConfig(mesh="data=2,fsdp=4").sections.parallel
      >>> placement(parallel, make_mesh(data=2, fsdp=4))
      {'strategy': 'fsdp', 'mesh': {'data': 2, 'fsdp': 4, 'tensor': 1}}
      >>> placement(parallel, None)  # one device
      {'strategy': None, 'mesh': None}
    """
    if mesh is None:
        return {"strategy": None, "mesh": None}
    return {"strategy": parallel.strategy or implied_strategy(mesh if parallel.mesh else None),
            "mesh": {k: int(v) for k, v in mesh.shape.items()}}


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


def load_data(data: DataSection, model, *, objective: str = "sft",
              settings: dict | None = None) -> Dataset:
    """The run's :class:`~effijax.sources.Dataset`: ``data.data`` through the model's
    tokenizer, read as ``data.data_format`` says, 5% held out for validation. A Parquet,
    Arrow or ``datasets`` source (and a mixture's part that is not a store) is first prepared
    into a store in effijax's cache (:func:`~effijax.sources.training_data`).
    An ``objective`` with data of its own reads it instead (the preference objectives' JSONL pairs:
    :func:`~effijax.recipe._pairs.load_pairs`; GRPO's prompts, bounded by its ``settings``'
    ``max_completion_length``: :func:`~effijax.recipe._grpo.load_prompts`)."""
    chosen = get_objective(objective)
    if chosen.load is not None:
        cut = {} if data.truncation_mode is None else {"truncation_mode": data.truncation_mode}
        return chosen.load(data.data, model, **{k: (settings or {})[k]
                                                 for k in chosen.load_settings}, **cut)
    say = (lambda line: print(f"effijax train: data: {line}", flush=True)) \
        if jax.process_index() == 0 else (lambda line: _to_stderr(f"data: {line}"))
    read = training_data(data.data, getattr(model, "tokenizer", None),
                         chat_template=data.chat_template, data_format=data.data_format,
                         text_column=data.text_column, print_fn=say)
    return load_dataset(read, model, data_format=data.data_format)


def plan_run(model, optimizer, data: Dataset, mesh, base: Any = None, *,
             precision: PrecisionSection, training: TrainingSection,
             parallel: ParallelSection, lora: LoraSection,
             objective: ObjectiveSection) -> _job.Job:
    """The run's :class:`~effijax.recipe.Job` (:func:`~effijax.recipe.plan_job`): abstract
    state, shardings and step for ``precision`` (decided: not ``auto``), ``parallel``'s
    strategy, ``lora``'s adapters, ``training``'s batch and seed and the ``objective``
    (``base``: the loaded pretrained parameters, whose kept GGUF blocks a ``gguf`` frozen base
    uses)."""
    spec = lora.spec(model.lora_targets)
    chosen = get_objective(objective.objective)
    # A sampled batch (GRPO) is rows of [padding, prompt, completion]: masked and segmented.
    sampled = chosen.rollout is not None
    settings = {**objective.settings,
                **({} if chosen.data_settings is None else chosen.data_settings(data))}
    with lora_fields():  # the spec's checks against the model: rank, targets
        return _job.plan_job(model, precision.precision, optimizer,
                             batch_size=training.batch_size, mesh=mesh,
                             strategy=parallel.strategy or implied_strategy(None), lora=spec,
                             seed=training.seed, frozen_dtype=None if lora.frozen_dtype == "auto"
                             else lora.frozen_dtype, masked=data.masked or sampled,
                             segmented=data.segmented or sampled,
                             kept_blocks=base if lora.frozen_dtype == "gguf" else None,
                             objective=chosen, objective_settings=settings)


def compile_run(job, initial: Initial, source, data: Dataset, why: str = "", *,
                model: ModelSection, precision: PrecisionSection, training: TrainingSection,
                parallel: ParallelSection, output: OutputSection):
    """Compiles the step (a :class:`~effijax.recipe.CompiledStep`), checks its memory against
    every process' devices (``parallel.device_memory``, for ``training.steps``) and prints the
    start-up lines (``why``: how ``auto`` decided the precision, as :func:`decide_precision`
    says; ``model.model_from``: the source named)."""
    compiled = _job.compile_job(job)
    _resume.agree(check_compiled_memory, compiled.memory, job, parallel.device_memory,
                  training.steps)
    _report.print_start(job, compiled, source, initial.frozen, initial.state,
                        precision=precision.precision, strategy=parallel.strategy,
                        out=output.out, model_from=model.model_from, data=data.note, why=why)
    return compiled
