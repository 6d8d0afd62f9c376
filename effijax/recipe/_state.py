"""A run's state across its life: the run directory and checkpoints, the starting state
(fresh, from an earlier run, or resumed), the loop with its stop signals, and the end (final
checkpoint, evaluation, adapter export, summary)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from effijax.errors import ConfigError
from effijax.recipe import _report
from effijax.recipe._config import TrainConfig

__all__ = ["Run", "open_run", "summary_step", "initial_state", "loop_and_finish"]


@dataclasses.dataclass
class Run:
    """The run directory's side of a run: its lock, where it resumes from, its checkpointer.

    Attributes:
      config, record: the run's settings and its ``run`` record (model, data, devices).
      resume_step: the step restored (None: a fresh run); ``restored`` holds its state until
        :func:`initial_state` takes it.
      finished: the run directory already holds this run, trained to ``config.steps`` or
        past it (at step ``resume_step``): nothing is restored, opened or written.
      original: on resume, the ``config.json`` of the run as it started (kept as written);
        ``resumes`` lists each resume's step and what it changed.
    """

    config: TrainConfig
    record: dict
    resume_step: int | None
    ckpt: Any = None
    lock: Any = None
    restored: Any = None
    original: dict | None = None
    resumes: list = dataclasses.field(default_factory=list)
    finished: bool = False

    @property
    def json(self) -> dict:
        """The settings in effect and the run record (stored with every checkpoint)."""
        return {**self.config.to_dict(), "run": self.record}

    @property
    def config_json(self) -> dict:
        """``config.json``: the run's original settings, and what each resume changed."""
        if self.original is None:
            return self.json
        kept = {k: v for k, v in self.original.items() if k not in ("versions", "resumes")}
        return {**kept, "resumes": self.resumes}

    def close(self) -> None:
        """Waits for the checkpoint writes and closes the checkpointer (the lock stays)."""
        if self.ckpt is not None:
            try:
                self.ckpt.close()
            finally:
                self.ckpt = None

    def release(self, quiet: bool = False) -> None:
        """Closes the checkpointer (``quiet``: ignoring its errors, when the run is already
        failing), then releases the run directory's lock."""
        try:
            if quiet:
                with contextlib.suppress(Exception):
                    self.close()
            else:
                self.close()
        finally:
            if self.lock is not None:
                self.lock.release()
                self.lock = None


def open_run(config: TrainConfig, job, origin: dict | None, *, fingerprint: str,
             corpus_tokens: int) -> Run:
    """Locks the run directory, restores its newest intact checkpoint (checked against the
    job and the run's identity) and opens its checkpoints.

    A directory that already holds the run trained to ``config.steps`` (or past it) is checked
    like a resume, from the step's metadata alone: the same settings give a :class:`Run` with
    ``finished`` set and nothing read, opened or written; other settings are refused listing
    each difference, as a resume is.

    Raises:
      ConfigError: another run holds the directory; checkpoints of another model or optimizer,
        or of a run with other settings (each difference listed); no step restores; a
        malformed ``config.json``.
    """
    import datetime

    import jax

    from effijax import distributed
    from effijax.checkpoint import open_checkpoints
    from effijax.provenance import library_versions
    from effijax.recipe import _identity, _preflight, _resume

    record = {
        "model_config": job.model.to_dict(),
        "num_params": job.num_params,
        "trainable_params": job.trainable_params,
        "init_from_checkpoint": origin,
        "corpus_tokens": int(corpus_tokens),
        "corpus_sha256": fingerprint,
        "devices": [str(d) for d in jax.devices()],
        "process_count": jax.process_count(),
    }
    out = Path(config.out).resolve()
    ckpt_dir = out / "checkpoints"
    is_main = jax.process_index() == 0
    if config.checkpoints:
        done = _finished_step(config, job, {**config.to_dict(), "run": record}, ckpt_dir)
        if jax.process_count() > 1:  # finished only where every process saw its end written
            from jax.experimental import multihost_utils

            seen = multihost_utils.process_allgather(np.int32(done is not None))
            done = done if bool(np.all(np.asarray(seen))) else None
        if done is not None:  # the same run, trained this far: not even its lock is touched
            return Run(config, record, done, finished=True)
    run = Run(config, record, None, lock=_resume.lock(out, is_main))
    try:
        bad = []
        if config.checkpoints:
            found, _ = _resume.restore(ckpt_dir, job, run.json, config.allowed_changes)
            bad = found.bad
            if found.step is None and bad:
                raise _resume.no_intact_step(ckpt_dir, bad)
            run.resume_step, run.restored = found.step, found.state
            if found.step is not None:
                saved = found.record["metadata"]["config"]
                path = out / "config.json"
                run.original = (_resume.read_run_json(path) if path.exists() else saved)
                run.resumes = [*run.original.get("resumes", []), {
                    "step": found.step,
                    "at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "changed": _identity.changed(saved, run.json)}]
        # Every process has read the directory (the restore) before any
        # process moves, creates or cleans up anything: their decisions agree.
        distributed.barrier("effijax:run-directory-read")
        if run.resume_step is not None and bad:
            _resume.set_aside_bad(ckpt_dir, bad, run.resume_step, is_main)
            distributed.barrier("effijax:damaged-steps-set-aside")
        if config.checkpoints:
            _resume.agree(_preflight.storage, ckpt_dir, _preflight.state_bytes(job.state),
                          config.keep)
            run.ckpt = open_checkpoints(ckpt_dir, every=config.checkpoint_every,
                                        keep=config.keep,
                                        metadata={"config": run.json,
                                                  "versions": library_versions()})
    except BaseException:
        run.release()
        raise
    return run


def _finished_step(config: TrainConfig, job, run_json: dict, ckpt_dir: Path) -> int | None:
    """The step of the finished run in ``ckpt_dir`` (trained to ``config.steps`` or past it)
    when its settings match, checked like a resume from the step's metadata alone; None when
    the run is not finished (or its newest finished step is damaged: it resumes instead).

    Raises:
      ConfigError: the finished run has other settings (each difference listed).
    """
    from effijax.checkpoint import latest_step
    from effijax.recipe import _resume

    newest = latest_step(ckpt_dir)  # a look only: nothing is locked, opened or written
    if newest is None or newest < config.steps:
        return None
    try:
        found, _ = _resume.restore(ckpt_dir, job, run_json, config.allowed_changes,
                                   arrays=False)
    except ConfigError as e:
        if e.field != "resume":
            raise
        raise ConfigError("out", config.out, f"holds a run finished at step {newest} with "
                          "other settings: "
                          + e.problem.removeprefix("the run's settings changed: ")) from None
    if found.step is None or found.step < config.steps:
        return None
    # Finished means its end was written too: a run stopped after its last checkpoint (killed,
    # Ctrl-C in the final evaluation or export) resumes there and completes the end.
    return found.step if summary_step(config.out) == found.step else None


def summary_step(out) -> int | None:
    """The step ``OUT/summary.json`` records (a run's end is written up to it), or None: no
    summary, or one that cannot be read. Only looks (no jax, no orbax), so the Ctrl-C handler
    of the program may call it.

    Example:
      >>> import tempfile, pathlib
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> summary_step(d) is None
      True
      >>> _ = (d / "summary.json").write_text('{"steps": 6}')
      >>> summary_step(d)
      6
    """
    try:
        step = json.loads((Path(out) / "summary.json").read_text()).get("steps")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def initial_state(job, run: Run, source, is_main: bool) -> tuple[Any, Any]:
    """``(state, frozen)``: resumed from the run's checkpoint, or fresh (adapters from the seed,
    parameters from the seed or from ``source``'s checkpoint); a LoRA run's frozen base."""
    from effijax.checkpoint import truncate_metrics
    from effijax.recipe import _job, _sources

    base = None
    if source is not None and (job.lora is not None or run.resume_step is None):
        base = _sources.load_params(source, job.model, None if job.mesh.size == 1 else job.mesh,
                                    run.record["init_from_checkpoint"].get("step"))
    frozen = _job.init_frozen(job, base) if job.lora is not None else None
    if run.resume_step is not None:
        state, run.restored = run.restored, None
        if is_main:
            truncate_metrics(Path(run.config.out) / "metrics.jsonl", run.resume_step)
            if run.resume_step >= run.config.steps:
                print(f"effijax train: the run reached step {run.resume_step} in "
                      f"{run.ckpt.directory} but stopped before its end was written; "
                      "completing it (final evaluation, exports, summary.json)", flush=True)
            else:
                print(f"effijax train: resuming from step {run.resume_step} in "
                      f"{run.ckpt.directory}", flush=True)
        return state, frozen
    state = _job.init_state(job, base if job.lora is None else None)
    return state, frozen


def loop_and_finish(config: TrainConfig, job, run: Run, compiled, state, frozen, tokens,
                    *, argv=None, watch=None):
    """Trains to ``config.steps`` (checkpointing; a signal stops at a step boundary), then
    evaluates, exports the adapters and writes the summary; ``watch`` (a
    :class:`~effijax.recipe._watch.Watch`) sees every step, the profiled steps and the end."""
    import jax

    from effijax.recipe import _job
    from effijax.recipe._train import TrainResult
    from effijax.run import NonFiniteError, RunDir, StopFlag, train_loop

    run_dir = RunDir(config.out, config=run.config_json, append=run.resume_step is not None)
    train_tokens, val_tokens = tokens
    evaluate = (lambda p: _job.evaluate(job, p, val_tokens, num_batches=config.eval_batches,
                                        frozen=frozen)) if config.eval_batches else None
    start = {}
    if run.resume_step is None and evaluate and (config.init_from or job.lora is not None):
        start["eval_loss_start"] = evaluate(state.params)  # before the state is donated
        _report.eval_start(start["eval_loss_start"], run_dir.is_main)
    trained = _TrainedTokens()
    stop = StopFlag(jax.process_count())
    t0 = time.perf_counter()
    with stop.installed(), _orbax_log(run.config.out):
        try:
            state, summary = train_loop(
                watch.step(compiled.step) if watch else compiled.step, state,
                _job.batch_fn(job, train_tokens, frozen),
                num_steps=config.steps, tokens_per_step=job.tokens_per_step, run_dir=run_dir,
                progress=config.progress, should_stop=stop,
                checkpoint=(lambda s: _save(run, s, run_dir.is_main)) if run.ckpt else None,
                checkpoint_every=config.checkpoint_every,
                max_non_finite=config.max_non_finite or None,
                callbacks=(trained, *(watch.callbacks if watch else ())))
        except NonFiniteError as e:
            raise NonFiniteError(e.step, e.count, where=_last_good(run)) from None
    summary["wall_time_s"] = time.perf_counter() - t0
    if run.ckpt is not None:
        with _orbax_log(run.config.out):
            _save(run, state, run_dir.is_main, force=True)
            with _save_errors(run, _step_of(state)):
                run.close()  # waits for the last write; raises if any write failed
    if stop.stopped:
        _report.stopped(config, summary, stop.signal_name, run.ckpt is not None or
                        config.checkpoints, argv, run_dir.is_main)
        return TrainResult(config.out, summary, "stopped", config)
    summary.update(start)
    summary.update(trained.summary(job.masked))
    summary.update(_whole_run(Path(config.out), summary))
    if evaluate:
        summary["eval_loss"] = evaluate(state.params)
    if job.lora is not None:
        summary["adapters"] = _export_adapters(state.params, job, config, run_dir.is_main)
    if config.export_hf:
        summary["hf"] = _export_hf(state.params, frozen, job, config, run_dir.is_main)
    summary.update(_report.summary_extras(job, compiled))
    if watch:
        watch.finish(summary)
    run_dir.finish(summary, title=_report.title(config, job))
    _report.done(config, summary, run_dir.is_main)
    return TrainResult(config.out, summary, "done", config)


def _whole_run(out: Path, summary: dict) -> dict:
    """The summary entries that describe the run from step 1, whatever its resumes, read back
    from ``metrics.jsonl`` (one record per step): the final loss over its last 10 steps and
    the trained tokens; a session that trained no step (it completed a run's end) takes the
    throughput and loss scale of the steps before it too."""
    from effijax.run import read_metrics

    try:
        records = [r for r in read_metrics(out) if r.get("step", 0) <= summary["steps"]]
    except (OSError, ValueError):
        return {}  # another process of the run, or a file it cannot read: this session's
    if not records:
        return {}
    tail = [float(r["loss"]) for r in records[-10:] if "loss" in r]
    whole = {"final_loss": float(np.mean(tail)) if tail else float("nan"),
             "final_loss_steps": len(tail),
             "trained_tokens": int(sum(r.get("tokens", 0) for r in records))}
    if summary["steps"] == summary["start_step"]:
        rates = [float(r["tokens_per_s"]) for r in records[1:] if "tokens_per_s" in r]
        whole["tokens_per_s"] = float(np.median(rates)) if rates else float("nan")
        whole["final_loss_scale"] = float(records[-1].get("loss_scale", float("nan")))
    return whole


class _TrainedTokens:
    """Sums the steps' ``tokens`` metric (trained target positions) and their rate."""

    def __init__(self):
        self.total, self.rates = 0, []

    def __call__(self, record: dict) -> None:
        tokens = int(record.get("tokens", 0))
        self.total += tokens
        dt = record.get("step_time_s")
        self.rates.append(tokens / dt if dt else float("nan"))

    def summary(self, masked: bool) -> dict:
        """``trained_tokens`` (this session's steps) and, for masked data,
        ``trained_tokens_per_s`` (median over the steps after the first, like ``tokens_per_s``)."""
        out = {"trained_tokens": self.total}
        if masked:
            import numpy as np

            rates = self.rates[1:]
            out["trained_tokens_per_s"] = float(np.median(rates)) if rates else float("nan")
        return out


@contextlib.contextmanager
def _orbax_log(out):
    """Sends orbax's log records (absl's logger) to ``OUT/orbax.log`` (``orbax-<process>.log``)
    while checkpoints are written: a failed background write logs a traceback per thread,
    hundreds of lines that the one-line :class:`SaveError` replaces on the terminal. The file
    is created only if something is logged."""
    import logging

    import jax

    index = jax.process_index()
    handler = logging.FileHandler(Path(out) / ("orbax.log" if index == 0
                                               else f"orbax-{index}.log"), delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger = logging.getLogger("absl")
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
        handler.close()


@contextlib.contextmanager
def _fd_to(fd: int, stream):
    """File descriptor ``fd`` writes to ``stream``'s file for the block (what threads of C
    libraries print goes there too)."""
    import os
    import sys

    sys.__stderr__.flush()
    saved = os.dup(fd)
    os.dup2(stream.fileno(), fd)
    try:
        yield
    finally:
        stream.flush()
        os.dup2(saved, fd)
        os.close(saved)


@contextlib.contextmanager
def _logs_to(stream, *names):
    """The named loggers write only to ``stream`` for the block."""
    import logging

    handler = logging.StreamHandler(stream)
    loggers = [logging.getLogger(n) for n in names]
    saved = [(x.handlers[:], x.propagate) for x in loggers]
    for x in loggers:
        x.handlers, x.propagate = [handler], False
    try:
        yield
    finally:
        for x, (handlers, propagate) in zip(loggers, saved, strict=True):
            x.handlers, x.propagate = handlers, propagate


def _step_of(state) -> int:
    """The state's step without a gather (every process holds the replicated scalar)."""
    import numpy as np

    step = state.step
    return int(np.asarray(step.addressable_data(0)) if hasattr(step, "addressable_data")
               else step)


def _reason(e: BaseException) -> str:
    """The operating system's words for a failed write, found anywhere in the chain."""
    import os
    import re

    seen, todo = set(), [e]
    while todo:
        x = todo.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.strerror:
            return f"[Errno {x.errno}] {x.strerror}" if x.errno else x.strerror
        code = re.search(r"os_error_code='(\d+)'", str(x))  # tensorstore's form of errno
        if code:
            return f"[Errno {code.group(1)}] {os.strerror(int(code.group(1)))}"
        todo.extend([x.__cause__, x.__context__, *getattr(x, "exceptions", ())])
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1].strip()}" if lines else type(e).__name__


@contextlib.contextmanager
def _save_errors(run: Run, step: int):
    """Turns a failed checkpoint write into :class:`SaveError`: one line, and the traceback
    in ``OUT/error.log`` (``error-<process>.log`` on the other processes)."""
    import gc
    import os
    import traceback

    import jax

    from effijax.errors import SaveError

    try:
        yield
    except Exception as e:
        index = jax.process_index()
        log = Path(run.config.out) / ("error.log" if index == 0 else f"error-{index}.log")
        try:
            with open(log, "a") as f:
                f.write(f"step {run.ckpt.failed_step if run.ckpt is not None else step}: "
                        f"saving to {Path(run.config.out) / 'checkpoints'}\n")
                f.write("".join(traceback.format_exception(e)))
        except OSError:
            log = None
        if run.ckpt is not None and run.ckpt.failed_step is not None:
            step = run.ckpt.failed_step  # an asynchronous write surfaces at a later call
        directory = str(run.ckpt.directory if run.ckpt is not None
                        else Path(run.config.out) / "checkpoints")
        # Closing a manager whose write failed lets the write's remaining callbacks meet a
        # closed event loop, each printing a traceback: into the log, not the terminal.
        with open(log if log is not None else os.devnull, "a") as sink, \
                contextlib.redirect_stderr(sink), _logs_to(sink, "asyncio", "absl"), \
                _fd_to(2, sink):
            run.release(quiet=True)
            time.sleep(1.0)  # the failed write's other array writes end (and print) here
            gc.collect()  # and its tasks report themselves when collected
        raise SaveError(step, directory, _reason(e), None if log is None else str(log)) from None


def _save(run: Run, state, is_main: bool, force: bool = False) -> None:
    with _save_errors(run, _step_of(state)):
        result = run.ckpt.save(state, force=force)
    if result.reason == "non_finite" and is_main:
        _report.warn(f"step {result.step} has non-finite parameters or optimizer state; not "
                     "checkpointed (training goes on)")


def _last_good(run: Run) -> str:
    """Where a run that went non-finite can resume from."""
    if run.ckpt is None:
        return "no checkpoint (--no-checkpoints)"
    run.ckpt.wait()  # the writes in flight hold older, finite states
    last = run.ckpt.latest_step()
    directory = run.ckpt.directory
    run.close()
    if last is None:
        return "no checkpoint yet"
    return (f"the last good checkpoint is step {last} in {directory}; rerun the same command "
            "to resume from it")


def _export_hf(params, frozen, job, config: TrainConfig, is_main: bool) -> str:
    """Writes ``OUT/hf``: the trained model (a LoRA run's adapters merged into its base, in
    f32) as a Hugging Face directory, with the tokenizer; returns its path. Every process takes
    part in gathering the parameters (they may be sharded over processes); process 0 writes."""
    import jax
    from jax.experimental import multihost_utils

    from effijax.interop import save_hf

    def host(tree):
        return (multihost_utils.process_allgather(tree, tiled=True)
                if jax.process_count() > 1 else tree)

    directory = str(Path(config.out) / "hf")
    base, adapters = (params, None) if job.lora is None else (frozen, params)
    base, adapters = host(base), None if adapters is None else host(adapters)
    if is_main:
        save_hf(directory, job.model, base, adapters=adapters, lora=job.lora)
    return directory


def _export_adapters(adapters, job, config: TrainConfig, is_main: bool) -> dict:
    """Writes ``OUT/adapters.safetensors`` and ``OUT/peft/`` (PEFT's format, with the model
    family's module names); returns their paths. Every process gathers the (small) adapters;
    process 0 writes."""
    from jax.experimental import multihost_utils

    from effijax.interop import export_adapters
    from effijax.lora import save_adapters

    host = multihost_utils.process_allgather(adapters, tiled=True)
    files = {"adapters": str(Path(config.out) / "adapters.safetensors"),
             "peft": str(Path(config.out) / "peft")}
    if is_main:
        save_adapters(files["adapters"], host, job.lora)
        export_adapters(files["peft"], job.model, host, job.lora,
                        base_model=config.init_from or job.model.name)
    return files
