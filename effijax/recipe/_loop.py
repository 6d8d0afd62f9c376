"""The loop stage: trains to the run's ``steps``, checkpointing, and saves the last state.

Each step's batch is built ahead, while the steps before it run, by a
:class:`~effijax.data.Prefetcher` (``prefetch`` batches deep; 0: between the steps). An
objective that samples its batches from the policy (GRPO) builds each between the steps, from
the parameters the step before returned; what its draw keeps across steps (GRPO's rollout,
shared by a group of ``num_iterations`` steps) is saved with each checkpoint beside the state
(``draw.carried``) and taken back on resume (``draw.resume``), so that a run stopped at any
step resumes exactly.

A signal (SIGTERM, SIGINT) stops the loop at a step boundary; the state is saved either way. A
failed checkpoint write is one line (:class:`~effijax.errors.SaveError`,
:mod:`effijax.checkpoint`), and a run that goes non-finite says which checkpoint is the last
good one.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from effijax import atomic, checkpoint
from effijax.data import Prefetcher
from effijax.recipe import _job, _report
from effijax.recipe._objective import COMPLETIONS, ROLLOUT_METRICS, ROLLOUT_SAMPLES
from effijax.recipe._rundir import TASK_SCORES, RunStart
from effijax.recipe._sections import OutputSection
from effijax.recipe._state import Initial
from effijax.recipe._watch import Watch
from effijax.run import NonFiniteError, StopFlag, train_loop

__all__ = ["Trained", "loop", "records_log"]


class Trained(NamedTuple):
    """What the loop produced.

    Attributes:
      state: the last state (saved when the run checkpoints).
      summary: :func:`~effijax.run.train_loop`'s summary, with ``wall_time_s``, and this
        session's ``trained_tokens`` (``trained_tokens_per_s`` for masked data).
      signal: the signal that stopped the loop early (None: it ran to ``config.steps``).
    """

    state: Any
    summary: dict
    signal: str | None = None


def loop(output: OutputSection, job, run: RunStart, compiled, initial: Initial, tokens,
         watch: Watch, *, steps: int, prefetch: int, max_non_finite: int,
         evaluate=None, evaluate_every: int = 0) -> Trained:
    """Trains ``initial.state`` on ``tokens`` to ``steps`` (checkpointing into ``run.dir``
    every ``output.checkpoint_every`` steps), then saves and closes the checkpoints; ``watch``
    sees every step. ``prefetch``: batches built ahead; ``max_non_finite``: consecutive
    non-finite steps before it stops (0: never). ``evaluate``: ``params -> {name: score}``,
    called with the live parameters after every ``evaluate_every``-th step but the last (its
    scores a record of that step in the run directory's ``task_scores.jsonl`` and the
    sinks)."""
    run_dir = run.dir
    trained = _TrainedTokens()
    stop = StopFlag(jax.process_count())
    t0 = time.perf_counter()
    # The batches of the steps to come are built (and put on the devices) on a worker thread
    # while each step runs; those built for steps that never run are dropped.
    step, params = watch.step(compiled.step), None
    carried = getattr(job.rollout, "carried", None)
    if job.rollout is not None:  # each batch is sampled from the state the step before made
        step, params = _following(step, initial.state, records_log(
            run_dir, int(initial.state.step), COMPLETIONS))
        prefetch = 0
        _resume_draw(job, run)
    with stop.installed(), checkpoint.orbax_log(output.out), Prefetcher(
            _job.batch_fn(job, tokens, initial.frozen,
                          **({} if params is None else {"params": params})),
            range(int(initial.state.step), steps), depth=prefetch) as batches:
        try:
            state, summary = train_loop(
                step, initial.state, batches,
                num_steps=steps, tokens_per_step=job.tokens_per_step, run_dir=run_dir,
                progress=output.progress, should_stop=stop,
                **_between_steps(run_dir, watch, output.checkpoint_every, evaluate,
                                 evaluate_every,
                                 records_log(run_dir, int(initial.state.step), TASK_SCORES),
                                 carried),
                max_non_finite=max_non_finite or None,
                callbacks=(trained, *watch.callbacks))
        except NonFiniteError as e:
            where = checkpoint.last_good(run_dir.ckpt, run_dir.close)
            raise NonFiniteError(e.step, e.count, where=where) from None
    summary["wall_time_s"] = time.perf_counter() - t0
    if run_dir.ckpt is not None:
        with checkpoint.orbax_log(output.out):
            _save(run_dir, state, force=True, carried=carried)
            with checkpoint.save_errors(output.out, run_dir.ckpt,
                                        checkpoint.step_of(state), _release_quietly(run_dir)):
                run_dir.close()  # waits for the last write; raises if any write failed
    if stop.stopped:
        return Trained(state, summary, stop.signal_name)
    return Trained(state, {**summary, **trained.summary(job.masked)})


def _between_steps(run_dir, watch, checkpoint_every: int, evaluate, evaluate_every: int,
                   log_scores, carried=None):
    """``train_loop``'s ``checkpoint`` and ``checkpoint_every``: the state saved every
    ``checkpoint_every`` steps (when the run checkpoints; with what the draw ``carried``) and
    its parameters evaluated every ``evaluate_every`` (when ``evaluate``; ``log_scores`` keeps
    the record): at the step boundary where the state is live."""
    save_every = checkpoint_every if run_dir.ckpt else 0
    score_every = evaluate_every if evaluate is not None else 0
    if not (save_every or score_every):
        return {"checkpoint": None, "checkpoint_every": checkpoint_every}

    def between(state):
        step = int(state.step)
        if save_every and step % save_every == 0:
            _save(run_dir, state, carried=carried)
        if score_every and step % score_every == 0:
            scores = evaluate(state.params)
            log_scores({"step": step, **scores})
            watch.sinks.values(step, scores)

    return {"checkpoint": between, "checkpoint_every": math.gcd(save_every, score_every)}


def _resume_draw(job, run: RunStart) -> None:
    """Gives a draw that keeps something across steps (``draw.resume``: GRPO's rollout) what
    the checkpoint the run resumes from holds beside the state (``{}`` for none)."""
    resume = getattr(job.rollout, "resume", None)
    ckpt = run.dir.ckpt
    if resume is None or run.resume_step is None or ckpt is None:
        return
    resume(ckpt.extra(run.resume_step), seed=job.seed, step=run.resume_step,
           batch_size=job.batch_size, where=str(ckpt.directory / str(run.resume_step)))


def _following(step, state, samples=lambda record: None):
    """``(step, params)``: ``step`` that also remembers the state it returns, adds a sampled
    batch's rollout statistics to its metrics and gives its rows' record (if any) to
    ``samples``, and ``params()``: the current state's parameters, read when the next batch is
    built (before the step donates them)."""
    current = [state]

    def tracked(state, batch):
        extra = dict(batch.get(ROLLOUT_METRICS, {}))
        record = extra.pop(ROLLOUT_SAMPLES, None)
        state, metrics = step(state, {k: v for k, v in batch.items() if k != ROLLOUT_METRICS})
        current[0] = state
        if record is not None:
            samples(record)
        return state, {**metrics, **extra}

    return tracked, lambda: current[0].params


def records_log(run_dir, start_step: int, name: str):
    """Appends a record to the run directory's file ``name`` (GRPO's COMPLETIONS: a rollout's
    rows; TASK_SCORES: the harness's scores), whole, on the main process; a run that starts at
    step 0 starts it anew (a resume has cut it back to its checkpoint's step)."""
    path = run_dir.path / name
    if run_dir.is_main and start_step == 0 and (path.exists() or path.is_symlink()):
        path.unlink()  # a link itself, never its target

    def log(record: dict) -> None:
        if run_dir.is_main:
            with run_dir.writing():
                atomic.append(path, (json.dumps(record) + "\n").encode())

    return log


def _release_quietly(run_dir):
    return lambda: run_dir.release(quiet=True)


def _save(run_dir, state, force: bool = False, carried=None) -> None:
    """Saves ``state`` (when due, or ``force``), with what ``carried(step)`` says the steps
    after it read beside it (a draw's kept rollout)."""
    extra = None if carried is None else carried(checkpoint.step_of(state))
    result = checkpoint.save(run_dir.ckpt, state, out=run_dir.path,
                             release=_release_quietly(run_dir), force=force, extra=extra)
    if result.reason == "non_finite" and run_dir.is_main:
        _report.warn(f"step {result.step} has non-finite parameters or optimizer state; not "
                     "checkpointed (training goes on)")


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
            rates = self.rates[1:]
            out["trained_tokens_per_s"] = float(np.median(rates)) if rates else float("nan")
        return out
