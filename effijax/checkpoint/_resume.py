"""Resume policy: which step of a run's checkpoints to resume from, and what to do with the rest.

:func:`validate_resume` checks, from metadata alone, that the latest step fits the model
before anything is compiled; :func:`restore_newest` restores the newest step that restores,
skipping (and reporting) damaged ones, agreed by every process; :func:`set_aside` moves a
damaged step out of orbax's sight; :func:`latest_step` is a look any process may take alone.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from effijax.checkpoint._format import (
    CorruptCheckpoint,
    _compare,
    _last_line,
    _root_cause,
    _saved_leaves,
    _step_record,
)
from effijax.checkpoint._orbax_manager import _manager, _orbax_errors_only
from effijax.checkpoint._restore import _check_target, _restore
from effijax.errors import ConfigError

__all__ = ["validate_resume", "Restored", "restore_newest", "set_aside", "latest_step"]


def validate_resume(directory: str | os.PathLike, abstract_state) -> int | None:
    """Pre-flight check that ``directory``'s latest checkpoint fits the model; its step or None.

    Reads only orbax's metadata of the latest committed step (no array is loaded, nothing is
    compiled) and compares the tree structure, every leaf's shape and dtype with
    ``abstract_state`` (typed PRNG keys are compared as their key data).

    Args:
      directory: a checkpoint directory (it may not exist yet).
      abstract_state: the state the run would restore into, e.g.
        ``jax.eval_shape(init_fn, key)`` (shardings are not needed here).

    Returns:
      The latest committed step, or None when the directory has none (a fresh run).

    Raises:
      ConfigError: naming the first differing leaf path, the saved and expected shape and
        dtype, and the fix.

    Example:
      >>> import tempfile, jax, jax.numpy as jnp, optax
      >>> from effijax.checkpoint import open_checkpoints
      >>> from effijax.step import init_train_state
      >>> init = lambda n: init_train_state({"w": jnp.ones(n)}, optax.sgd(0.1), 0)
      >>> d = tempfile.mkdtemp()
      >>> validate_resume(d, jax.eval_shape(lambda: init(2))) is None
      True
      >>> with open_checkpoints(d) as ckpt:
      ...     ckpt.save(init(2)).saved
      True
      >>> validate_resume(d, jax.eval_shape(lambda: init(2)))
      0
      >>> validate_resume(d, jax.eval_shape(lambda: init(3)))  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: checkpoint=...: ...'params/w' as float32[2] but the model ...
    """
    directory = Path(directory)
    if not directory.is_dir():
        if directory.exists():
            raise ConfigError("checkpoint", str(directory), "is a file, not a directory")
        return None
    manager = _manager(directory, every=1, keep=None, async_save=False, reader=True)
    try:
        step = manager.latest_step()
        if step is None:
            return None
        _step_record(manager, step, directory)
        _compare(_saved_leaves(manager, step), abstract_state, directory, step)
        return int(step)
    finally:
        manager.close()


class Restored(NamedTuple):
    """What :func:`restore_newest` found.

    Attributes:
      step: the step restored; None when no step restores (or there is none).
      state: the restored state (None with ``step``).
      record: that step's metadata record (see :meth:`Checkpointer.metadata`).
      bad: ``(step, reason)`` of each newer step that failed to restore, newest first;
        ``reason`` is the underlying error's last line.
    """

    step: int | None
    state: Any
    record: dict | None
    bad: list[tuple[int, str]]


def _everywhere(ok: bool) -> bool:
    """True when ``ok`` on every process (a collective in a multi-process run: each process
    reads only its own shards, so one may fail where another succeeds)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def restore_newest(directory: str | os.PathLike, *, target_state_abstract,
                   check=None, steps=None, arrays: bool = True) -> Restored:
    """Restores the newest step of ``directory`` that restores, changing nothing on disk.

    Steps are tried newest first. A step whose metadata is missing or malformed, or whose
    arrays fail to load (a truncated or damaged file), is skipped and reported in
    :attr:`Restored.bad`; a step that is intact but does not fit (another model, a newer
    format, or ``check`` refusing it) raises, since an older step would not fit either. In a
    multi-process run every process calls it, and a step counts only where it restores on
    every process.

    Args:
      directory: a checkpoint directory written by :class:`Checkpointer`.
      target_state_abstract: as in :meth:`Checkpointer.restore` (:func:`restore_target`).
      check: ``check(step, record)``, called before a step's arrays are read; raises
        ConfigError to refuse the step (e.g. the run's settings changed).
      steps: the candidate steps (default: every committed step).
      arrays: False to stop after the checks (metadata, shapes, ``check``): the step found
        is the newest whose record is intact and fits, its arrays are not read, and
        ``Restored.state`` is None (e.g. to compare a finished run's settings cheaply).

    Returns:
      A :class:`Restored`.

    Raises:
      ConfigError: a step does not fit the target, is in a newer format, or ``check`` raised.

    Example:
      >>> import tempfile, pathlib, jax, jax.numpy as jnp, optax
      >>> from effijax.checkpoint import open_checkpoints, restore_target
      >>> from effijax.sharding import make_mesh, replicated
      >>> from effijax.step import init_train_state
      >>> state = init_train_state({"w": jnp.ones(2)}, optax.sgd(0.1), 0)
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> with open_checkpoints(d, keep=None) as ckpt:
      ...     for s in (1, 2):
      ...         _ = ckpt.save(state._replace(step=jnp.int32(s)))
      >>> (d / "2" / "_CHECKPOINT_METADATA").unlink()  # step 2 is damaged
      >>> target = restore_target(jax.eval_shape(lambda: state), replicated(make_mesh()))
      >>> found = restore_newest(d, target_state_abstract=target)
      >>> found.step, int(found.state.step), found.bad[0][0]
      (1, 1, 2)
    """
    directory = Path(directory)
    if not directory.is_dir():
        return Restored(None, None, None, [])
    _check_target(target_state_abstract)
    manager = _manager(directory, every=1, keep=None, async_save=False, reader=True)
    bad: list[tuple[int, str]] = []
    with _orbax_errors_only(), contextlib.closing(manager):
        candidates = sorted(manager.all_steps() if steps is None else steps, reverse=True)
        for step in candidates:
            state = record = None
            try:
                record = _step_record(manager, step, directory)
                if check is not None:  # first: a changed setting says more than a shape
                    check(step, record)
                _compare(_saved_leaves(manager, step), target_state_abstract, directory, step)
                if arrays:
                    state = _restore(manager, directory, step, target_state_abstract)
                reason = None
            except CorruptCheckpoint as e:
                reason = (e.problem if e.field == "checkpoint"
                          else f"{e.field}={e.value!r}: {e.problem}")
            except ConfigError:
                raise
            except Exception as e:  # orbax/tensorstore: a damaged or truncated array file
                reason = _last_line(_root_cause(e), limit=400)
            if _everywhere(reason is None):
                return Restored(int(step), state, record, bad)
            bad.append((int(step), reason or "failed on another process"))
        return Restored(None, None, None, bad)


def set_aside(directory: str | os.PathLike, step: int) -> Path:
    """Moves step ``step`` of ``directory`` to ``<step>.corrupt-<n>`` beside it (the first
    unused ``n``), where orbax never lists, restores or deletes it; returns the new path.

    Example:
      >>> import tempfile, pathlib
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> (d / "4").mkdir()
      >>> set_aside(d, 4).name
      '4.corrupt-1'
    """
    directory = Path(directory)
    n = 1
    while (directory / f"{step}.corrupt-{n}").exists():
        n += 1
    target = directory / f"{step}.corrupt-{n}"
    os.replace(directory / str(step), target)
    return target


def latest_step(directory: str | os.PathLike) -> int | None:
    """The latest committed step in ``directory``, or None (no directory, or no step yet).

    A look only: nothing on disk is created or cleaned up and no process waits for another,
    so any process may call it on its own (a :class:`Checkpointer` opens the directory for
    writing, which every process of a run must do together).

    Example:
      >>> import tempfile, jax.numpy as jnp, optax
      >>> from effijax.checkpoint import open_checkpoints
      >>> from effijax.step import init_train_state
      >>> d = tempfile.mkdtemp()
      >>> latest_step(d) is None
      True
      >>> with open_checkpoints(d) as ckpt:
      ...     ckpt.save(init_train_state({"w": jnp.ones(2)}, optax.sgd(0.1), 0)).saved
      True
      >>> latest_step(d)
      0
    """
    directory = Path(directory)
    tries = 3  # a running run may delete an old step while this reads the list
    for attempt in range(1, tries + 1):
        try:
            return _newest(directory)
        except FileNotFoundError:
            if attempt == tries:
                raise


def _newest(directory: Path) -> int | None:
    if not directory.is_dir():
        return None
    manager = _manager(directory, every=1, keep=None, async_save=False, reader=True)
    try:
        step = manager.latest_step()
        return None if step is None else int(step)
    finally:
        manager.close()
