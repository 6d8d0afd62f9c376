"""Run directories and the host-side training loop.

A run directory holds what a researcher looks at after a run:

* ``config.json``: every setting of the run, plus library versions;
* ``metrics.jsonl``: one JSON object per step (``step``, ``loss``, ``loss_scale``, ``skipped``,
  ``grad_norm``, ``tokens_per_s``, ``learning_rate``, ...);
* ``summary.json``: final numbers (loss, evaluation loss, throughput, skipped steps);
* ``loss.png``: the loss curve, with the loss scale when it moved.

Every file is written whole or not at all and never through a link (:mod:`effijax.atomic`);
``summary.json`` is written last, so a run whose summary records its last step has its end
written. A write that fails (a full disk) is :class:`~effijax.errors.WriteError`: one line
naming the file, the traceback in ``error.log``.

:func:`train_loop` drives a jitted step: it dispatches step ``k+1`` before reading step ``k``'s
metrics, so logging does not stall the device, and only the main process writes files.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from effijax import atomic
from effijax.checkpoint import free_room, keep_room, write_errors
from effijax.provenance import library_versions

__all__ = ["RunDir", "train_loop", "NonFiniteError", "StopFlag", "read_metrics", "plot_metrics"]


class NonFiniteError(RuntimeError):
    """Training produced non-finite losses or gradients for too many steps in a row.

    Raised by :func:`train_loop` (``max_non_finite``) for steps that were *not* skipped: with
    a loss scale, overflowing steps are skipped and harmless; without one, a non-finite
    gradient is applied and the parameters are lost from then on.

    Attributes:
      step: the last step of the streak (1-based, as in ``metrics.jsonl``).
      count: how many consecutive steps were non-finite.
      first_step: the first step of the streak.
      where: what the caller knows about recovering (e.g. the last good checkpoint).
    """

    def __init__(self, step: int, count: int, where: str | None = None):
        self.step, self.count, self.first_step = step, count, step - count + 1
        self.where = where
        text = (f"steps {self.first_step}..{step}: {count} consecutive steps with a "
                "non-finite loss or gradient norm that were not skipped (no loss scaling), so "
                "the parameters are no longer finite")
        super().__init__(text if where is None else f"{text}; {where}")


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic | np.ndarray | jax.Array):
        value = np.asarray(value).item() if np.ndim(value) == 0 else np.asarray(value).tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no inf/nan; keep them readable and parseable
    if isinstance(value, Path):
        return str(value)
    return value


class RunDir:
    """The files of one run, and while the recipe trains in it, its lock and its checkpointer.
    Only the main process (``jax.process_index() == 0``) writes.

    Args:
      path: the directory (created if missing).
      config: the run's settings, written to ``config.json`` with library versions (None: the
        files are written later, by :meth:`begin`, once the run knows what it resumes).
      append: keep an existing ``metrics.jsonl`` (a resumed run) instead of starting it anew.
      lock: the directory's :class:`~effijax.checkpoint.RunLock` (None: not locked here).
      ckpt: the run's :class:`~effijax.checkpoint.Checkpointer` (None: no checkpoints).

    Example:
      >>> import tempfile
      >>> d = RunDir(tempfile.mkdtemp(), config={"lr": 1e-3})
      >>> d.log({"step": 1, "loss": 2.5})
      >>> read_metrics(d.path)[0]["loss"]
      2.5
      >>> d.release()  # nothing held: nothing to do
    """

    def __init__(self, path: str | os.PathLike, *, config: dict | None = None,
                 append: bool = False, lock: Any = None, ckpt: Any = None):
        self.path = Path(path)
        self.is_main = jax.process_index() == 0
        self.lock, self.ckpt = lock, ckpt
        if config is not None:
            self.begin(config, append=append)

    def begin(self, config: dict, *, append: bool = False) -> None:
        """Creates the directory, writes ``config.json`` (with library versions) and starts
        ``metrics.jsonl`` anew unless ``append``."""
        if not self.is_main:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        keep_room(self.path)  # so that a full disk later still gets its traceback logged
        self.write_json("config.json", {**config, "versions": library_versions()})
        metrics = self.path / "metrics.jsonl"
        if not append and (metrics.exists() or metrics.is_symlink()):
            metrics.unlink()  # a link itself, never its target

    def writing(self):
        """A block whose failed writes (``OSError``: a full disk) end the run in one line,
        :class:`~effijax.errors.WriteError`: the traceback goes to ``error.log``, and the
        checkpointer and the lock are released quietly first (their writes in flight fail on
        the same disk, each printing a traceback)."""
        return write_errors(self.path, release=lambda: self.release(quiet=True))

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """Releases the lock and the checkpointer; when the block failed, quietly (its own
        error is the one to report)."""
        self.release(quiet=error is not None)

    def close(self) -> None:
        """Waits for the checkpoint writes and closes the checkpointer (the lock stays)."""
        if self.ckpt is not None:
            try:
                self.ckpt.close()
            finally:
                self.ckpt = None

    def release(self, quiet: bool = False) -> None:
        """Closes the checkpointer (``quiet``: ignoring its errors, when the run is already
        failing), then releases the directory's lock."""
        try:
            if quiet:
                with contextlib.suppress(Exception):
                    self.close()
            else:
                self.close()
        finally:
            if self.lock is not None:
                if self.is_main:
                    with contextlib.suppress(OSError):
                        free_room(self.path)
                self.lock.release()
                self.lock = None

    def write_json(self, name: str, obj: dict) -> None:
        """Writes ``name`` atomically (temp file, fsync, rename; never through a link), so a
        killed run never leaves half; a failed write is :class:`~effijax.errors.WriteError`."""
        if not self.is_main:
            return
        with self.writing():
            atomic.write_text(self.path / name,
                              json.dumps(_jsonable(obj), indent=2, sort_keys=True) + "\n")

    def log(self, record: dict) -> None:
        """Appends one record to ``metrics.jsonl``, whole: one ``write`` of the line; a write
        cut short (a full disk) is undone, so the file never holds half a record, and the run
        ends with :class:`~effijax.errors.WriteError`."""
        if not self.is_main:
            return
        with self.writing():
            atomic.append(self.path / "metrics.jsonl",
                          (json.dumps(_jsonable(record)) + "\n").encode())

    def finish(self, summary: dict, *, title: str = "") -> None:
        """Writes ``loss.png``, then ``summary.json``: last, as it marks the run's end
        written."""
        if not self.is_main:
            return
        records = read_metrics(self.path)
        if records:
            with self.writing():
                plot_metrics({title or self.path.name: records}, self.path / "loss.png")
        self.write_json("summary.json", summary)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Reads ``metrics.jsonl`` of a run directory (or the file itself).

    Example:
      >>> import tempfile, pathlib
      >>> p = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
      >>> _ = p.write_text('{"step": 1, "loss": 3.0}\\n')
      >>> read_metrics(p)
      [{'step': 1, 'loss': 3.0}]
    """
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.exists():
        raise FileNotFoundError(f"no metrics file at {p}")
    with open(p) as f:
        return [json.loads(line) for line in f if line.strip()]


def _as_float(v) -> float:
    return float(v)  # also parses the "inf"/"nan" strings that _jsonable writes


def plot_metrics(runs: dict[str, list[dict]], path: str | os.PathLike, *,
                 title: str | None = None) -> Path:
    """Plots loss curves of one or more runs, and their loss scales when any moved.

    Args:
      runs: ``{label: records}`` where records are dicts with ``step`` and ``loss`` (and
        optionally ``loss_scale``).
      path: output PNG.
      title: optional figure title.

    Example:
      >>> import tempfile, pathlib
      >>> p = plot_metrics({"a": [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}]},
      ...                  pathlib.Path(tempfile.mkdtemp()) / "loss.png")
      >>> p.exists()
      True
    """
    # A bare Figure renders to the file by itself: no pyplot, no global backend switch, so a
    # notebook that trains keeps its inline plots.
    from matplotlib.figure import Figure

    scales = {k: [r.get("loss_scale", 1.0) for r in v] for k, v in runs.items()}
    show_scale = any(len({_as_float(s) for s in v}) > 1 for v in scales.values())
    fig = Figure(figsize=(11 if show_scale else 6, 4))
    axes = fig.subplots(1, 2 if show_scale else 1)
    axes = np.atleast_1d(axes)
    for label, records in runs.items():
        steps = [r["step"] for r in records]
        axes[0].plot(steps, [_as_float(r["loss"]) for r in records], label=label, lw=1.2)
        if show_scale:
            axes[1].plot(steps, [_as_float(s) for s in scales[label]], label=label)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("training loss")
    axes[0].legend()
    axes[0].grid(alpha=0.3)
    if show_scale:
        axes[1].set_yscale("log", base=2)
        axes[1].set_xlabel("step")
        axes[1].set_ylabel("loss scale")
        axes[1].grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    # Written whole or not at all, like the run's other files: the program ends at once on
    # Ctrl-C, and a finished run is not written again.
    image = io.BytesIO()
    fig.savefig(image, dpi=110, format=path.suffix[1:] or "png")
    return atomic.write_bytes(path, image.getvalue())


def train_loop(
    step_fn: Callable,
    state,
    batch_fn: Callable[[int], Any],
    *,
    num_steps: int,
    tokens_per_step: int,
    run_dir: RunDir | None = None,
    progress: bool = True,
    callbacks: Iterable[Callable[[dict], None]] = (),
    should_stop: Callable[[], bool] | None = None,
    checkpoint: Callable[[Any], Any] | None = None,
    checkpoint_every: int | None = None,
    max_non_finite: int | None = None,
) -> tuple[Any, dict]:
    """Runs ``step_fn`` from ``state.step`` up to ``num_steps`` and logs every step.

    Args:
      step_fn: a jitted ``(state, batch) -> (state, metrics)``; the state may be donated.
      state: a :class:`~effijax.step.TrainState` (its ``step`` says where to start).
      batch_fn: ``step -> batch`` (a deterministic function of the step, so resuming is exact).
      num_steps: the step number to stop at.
      tokens_per_step: tokens in one global batch, for throughput.
      run_dir: where to log; None logs nothing.
      progress: show a tqdm bar with loss, loss scale and tokens/s.
      callbacks: ``f(record)`` called with each step's host-side record after it is logged.
      should_stop: polled after each step; True ends the loop early at that step boundary.
      checkpoint: ``f(state)`` called with the state after every ``checkpoint_every``-th step
        (``state.step % checkpoint_every == 0``), once that step's metrics are logged (so a
        checkpoint never runs ahead of ``metrics.jsonl``) and before the next step donates
        the state. The final state is not offered: the caller saves what the loop returns.
      checkpoint_every: see ``checkpoint``.
      max_non_finite: stop after this many consecutive steps whose loss or gradient norm is
        not finite and that were not skipped (by a loss scale); None never stops. Checked as
        each step's metrics are read (one step behind the dispatch), before that step's
        checkpoint, so a checkpoint never holds what the streak produced.

    Returns:
      ``(state, summary)`` with ``steps``, ``final_loss`` (mean of the last 10 losses, or of
      fewer when fewer ran: ``final_loss_steps`` says how many),
      ``tokens_per_s`` (median over steps after the first, which includes compilation),
      ``first_step_s`` (compile + first step), ``skipped_steps``, ``final_loss_scale``.

    Raises:
      NonFiniteError: ``max_non_finite`` consecutive non-finite steps.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from effijax.step import init_train_state, make_train_step
      >>> loss_fn = lambda p, b, rng: jnp.mean((p["w"] - b) ** 2)
      >>> tx = optax.sgd(0.5)
      >>> step = jax.jit(make_train_step(loss_fn, tx))
      >>> state = init_train_state({"w": jnp.zeros(2)}, tx, 0)
      >>> state, summary = train_loop(step, state, lambda s: jnp.ones(2), num_steps=20,
      ...                             tokens_per_step=2, progress=False)
      >>> summary["steps"], summary["final_loss"] < 1e-3
      (20, True)
    """
    from tqdm.auto import tqdm

    if max_non_finite is not None and not (isinstance(max_non_finite, int)
                                           and max_non_finite >= 1):
        raise ValueError(f"max_non_finite must be an int >= 1 or None, got {max_non_finite!r}")
    start = int(state.step)
    if num_steps < start:
        raise ValueError(f"num_steps={num_steps} is before the state's step {start}")
    is_main = jax.process_index() == 0
    bar = tqdm(total=num_steps, initial=start, disable=not (progress and is_main),
               dynamic_ncols=True, unit="step")
    losses, rates, skipped = [], [], 0
    streak = 0  # consecutive non-finite steps that were applied
    first_step_s = None
    last_scale = float("nan")
    pending = None  # (step number, metrics on device, dispatch time)
    t_prev = time.perf_counter()

    def drain(pending):
        nonlocal t_prev, first_step_s, skipped, last_scale, streak
        step_no, metrics, _ = pending
        host = jax.device_get(metrics)
        now = time.perf_counter()
        dt = now - t_prev
        t_prev = now
        record = {"step": step_no}
        record.update({k: np.asarray(v).item() for k, v in host.items()})
        record["tokens_per_s"] = tokens_per_step / dt if dt > 0 else float("inf")
        record["step_time_s"] = dt
        if first_step_s is None:
            first_step_s = dt
        else:
            rates.append(record["tokens_per_s"])
        losses.append(record["loss"])
        skipped += int(bool(record.get("skipped", False)))
        last_scale = record.get("loss_scale", 1.0)
        if run_dir is not None:
            run_dir.log(record)
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.4f}", scale=f"{last_scale:.3g}",
                        tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
        for cb in callbacks:
            cb(record)
        finite = math.isfinite(record["loss"]) and bool(record.get("grads_finite", True))
        streak = 0 if finite or record.get("skipped", False) else streak + 1
        if max_non_finite is not None and streak >= max_non_finite:
            raise NonFiniteError(step_no, streak)

    stopped_early = False
    try:
        for step_no in range(start, num_steps):
            batch = batch_fn(step_no)
            state, metrics = step_fn(state, batch)
            if pending is not None:
                drain(pending)
            pending = (step_no + 1, metrics, time.perf_counter())
            if (checkpoint is not None and checkpoint_every and step_no + 1 < num_steps
                    and (step_no + 1) % checkpoint_every == 0):
                drain(pending)
                pending = None
                checkpoint(state)
            if should_stop is not None and should_stop():
                stopped_early = True
                break
        if pending is not None:
            drain(pending)
    finally:
        bar.close()
    tail = losses[-10:]
    summary = {
        "steps": int(state.step),
        "start_step": start,
        "stopped_early": stopped_early,
        "final_loss": float(np.mean(tail)) if tail else float("nan"),
        "final_loss_steps": len(tail),
        "tokens_per_s": float(np.median(rates)) if rates else float("nan"),
        "first_step_s": first_step_s,
        "skipped_steps": skipped,
        "final_loss_scale": last_scale,
    }
    return state, summary


class StopFlag:
    """Set by SIGTERM/SIGINT while installed; :func:`train_loop` polls it after each step.

    Outside :meth:`installed`'s block the signals are what they were: in the ``effijax`` program,
    Ctrl-C then ends the process at once with one line (``effijax.cli._interrupt``); in a
    notebook, it raises ``KeyboardInterrupt``.

    With several processes the signal may reach only one of them (a preempted host), yet all
    must stop at the same step boundary and save the same step (a checkpoint is a collective
    write). So every ``every``-th poll all-gathers the processes' flags (a few bytes; every
    process polls after every step, so they exchange at the same steps) and any raised flag
    stops everyone. Not at every step: waiting for the exchange's result waits for the step
    just dispatched, which would stop the host from running ahead of the devices.

    Example:
      >>> flag = StopFlag()
      >>> with flag.installed():
      ...     flag()
      False
    """

    def __init__(self, num_processes: int = 1, every: int = 10):
        self.signal_name: str | None = None
        self.signum = 0
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
        from jax.experimental import multihost_utils

        # Each process's signal number (0: none), so every process can name the signal it
        # stops for. A launcher that forwards one signal to every rank (``mpirun``) may reach
        # some only after the exchange: they report it as the signal to the one that had it.
        signums = np.asarray(multihost_utils.process_allgather(np.int32(self.signum if local
                                                                         else 0)))
        self.stopped = bool(np.any(signums))
        if self.stopped and not local:
            first = int(np.argmax(signums != 0))
            self.signal_name = f"{signal.Signals(int(signums[first])).name} to process {first}"
        return self.stopped

    def _handle(self, signum, frame) -> None:
        self.signum = signum  # before the name: __call__ reads the name, then the number
        self.signal_name = signal.Signals(signum).name

    @contextlib.contextmanager
    def installed(self):
        """Installs the SIGTERM/SIGINT handlers for the block (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield self  # handlers can only be installed from the main thread
            return
        old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
