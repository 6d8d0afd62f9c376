"""A :class:`Checkpointer` over one orbax ``CheckpointManager``: every-K saves, keep-N, async.

Each step is written by orbax to a temporary ``<step>.orbax-checkpoint-tmp-*`` directory and
renamed when complete, so a run killed mid-write leaves a temporary directory that
:meth:`Checkpointer.latest_step` ignores (and that the next :func:`open_checkpoints` removes).
What a step directory holds is :mod:`effijax.checkpoint._format`'s business.

Saving is asynchronous by default: :meth:`Checkpointer.save` returns once the arrays are
copied off the device and the files are written by a background thread; errors of that thread
surface from the next :meth:`~Checkpointer.save`, :meth:`~Checkpointer.wait` or
:meth:`~Checkpointer.close` (never swallowed). A state with a non-finite parameter or
optimizer-state value is not written: ``save`` says so in its :class:`SaveResult`.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp

from effijax.checkpoint import _orphans
from effijax.checkpoint._format import (
    _EXTRA,
    _ITEM,
    _META_KEY,
    FORMAT_VERSION,
    CorruptCheckpoint,
    _is_key,
    _last_line,
    _root_cause,
    _step_record,
    _to_savable,
    _tree_bytes,
)
from effijax.checkpoint._orbax_manager import _manager
from effijax.checkpoint._restore import _resolve_step, _restore
from effijax.errors import ConfigError, whole_number
from effijax.precision import all_finite
from effijax.provenance import library_versions

__all__ = ["SaveResult", "Checkpointer", "open_checkpoints"]


class SaveResult(NamedTuple):
    """What :meth:`Checkpointer.save` did.

    Attributes:
      step: the state's step.
      saved: True if a checkpoint of ``step`` was written (or, asynchronously, started).
      reason: ``"saved"``; ``"not_due"`` (``step % every != 0`` and not forced);
        ``"exists"`` (this step is already checkpointed); ``"non_finite"`` (a parameter or
        optimizer-state value is inf/nan: nothing was written, the caller decides what to do).
    """

    step: int
    saved: bool
    reason: str


def _host_int(x) -> int:
    """An int from a (possibly sharded, possibly multi-host) scalar array, without a gather."""
    if isinstance(x, jax.Array):
        return int(np.asarray(x.addressable_data(0)))
    return int(x)


def _jsonable(metadata: Mapping | None, field: str) -> dict:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ConfigError(field, type(metadata).__name__, "must be a dict (stored as JSON)")
    # Values JSON has no type for (dtypes, paths, enums) are stored as their str().
    return json.loads(json.dumps(dict(metadata), default=str))


def _check_every_keep(every, keep) -> None:
    whole_number("every", every)  # a step is saved when step % every == 0
    whole_number("keep", keep, none=True)  # None keeps every checkpoint


@jax.jit
def _finite_flag(tree):
    return all_finite(tree)


def _finite_part(state):
    """The leaves whose finiteness gates a save: params and opt_state, or the whole tree."""
    if hasattr(state, "params") and hasattr(state, "opt_state"):
        return (state.params, state.opt_state)
    return jax.tree.map(lambda x: None if _is_key(x) else x, state)


class Checkpointer:
    """Saves and restores one run's states in ``directory`` (see :func:`open_checkpoints`).

    Not thread-safe; in a multi-process run every process calls every method (orbax
    coordinates the writes). Use it as a context manager, or call :meth:`close`, so that the
    last asynchronous write is waited for and its errors are raised.

    Args:
      directory: where the steps live (created if missing).
      every: :meth:`save` writes when ``state.step % every == 0`` (or when forced).
      keep: how many most recent checkpoints to keep; None keeps all.
      async_save: write in a background thread (the train loop only waits for the
        device-to-host copy).
      metadata: the run's settings (JSON-able dict), stored with every step.
      base_reference: for adapter-only checkpoints, the base model they apply to (see
        :func:`effijax.checkpoint.save_adapters_checkpoint`); stored with every step.

    Example:
      >>> import tempfile, jax, jax.numpy as jnp, optax
      >>> from effijax.checkpoint import restore_target
      >>> from effijax.sharding import make_mesh, replicated
      >>> from effijax.step import init_train_state
      >>> state = init_train_state({"w": jnp.ones(4)}, optax.sgd(0.1), 0)
      >>> with open_checkpoints(tempfile.mkdtemp(), every=10, keep=2) as ckpt:
      ...     print(ckpt.save(state))
      ...     ckpt.wait()
      ...     target = restore_target(jax.eval_shape(lambda: state), replicated(make_mesh()))
      ...     restored = ckpt.restore(target_state_abstract=target)
      SaveResult(step=0, saved=True, reason='saved')
      >>> restored.params["w"].sharding.is_fully_replicated, restored.rng.dtype
      (True, key<fry>)
    """

    def __init__(self, directory: str | os.PathLike, *, every: int = 1, keep: int | None = 3,
                 async_save: bool = True, metadata: Mapping | None = None,
                 base_reference: Mapping | None = None):
        _check_every_keep(every, keep)
        self.directory = Path(directory)
        self.every = every
        self.keep = keep
        self.async_save = bool(async_save)
        self._run_metadata = _jsonable(metadata, "metadata")
        self._base_reference = (None if base_reference is None
                                else _jsonable(base_reference, "base_reference"))
        self._versions = library_versions()
        self._closed = False
        self._pending: int | None = None  # the step whose asynchronous write is in flight
        self.failed_step: int | None = None  # the step whose write raised, once one has
        try:
            self._manager = _manager(self.directory, every=every, keep=keep,
                                     async_save=self.async_save)
        except BaseException as e:
            e.add_note(f"effijax: could not open checkpoint directory {self.directory}")
            raise

    # -- saving ---------------------------------------------------------------------------

    def save(self, state, *, force: bool = False, step: int | None = None,
             extra: Mapping[str, Mapping[str, np.ndarray]] | None = None) -> SaveResult:
        """Saves ``state`` when its step is due (``step % every == 0``) or ``force``.

        Before writing, one jitted, on-device check that every floating leaf of ``params`` and
        ``opt_state`` is finite (of the whole tree for a pytree that is not a TrainState);
        a non-finite state is not written. With ``async_save`` the call returns once the
        arrays are off the device; the files are committed atomically in the background.

        Args:
          state: a ``TrainState`` (or any pytree of arrays when ``step`` is given).
          force: save even if the step is not a multiple of ``every``.
          step: the step to save under; default ``state.step``.
          extra: host arrays that belong with this step beside the state, ``{name: {key:
            array}}`` (GRPO's rollout inside a group of steps), read back by :meth:`extra`;
            written in the same step directory, committed with the state. None or empty:
            the step holds the state alone, as it always did.

        Returns:
          A :class:`SaveResult`.

        Raises:
          OSError, ValueError, ...: the write failed (unwritable directory, disk full, an
            orbax error), now or in the previous asynchronous save. The exception carries a
            note naming the directory and step; it is never swallowed.
        """
        self._check_open()
        step = _host_int(state.step if step is None else step)
        if not force and step % self.every:
            return SaveResult(step, False, "not_due")
        if step in self._manager.all_steps():
            return SaveResult(step, False, "exists")
        if not _host_int(_finite_flag(_finite_part(state))):
            return SaveResult(step, False, "non_finite")
        extra = _host_extra(extra)
        self._wait_pending()  # a failure here is the previous step's write
        tree, impls = _to_savable(state)
        record = {
            "format": FORMAT_VERSION,
            "step": step,
            "state_bytes": _tree_bytes(tree),
            "saved_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "versions": self._versions,
            "prng_keys": impls,
            "metadata": self._run_metadata,
        }
        if self._base_reference is not None:
            record["base_reference"] = self._base_reference
        items = {_ITEM: ocp.args.StandardSave(tree)}
        if extra:
            record["extra"] = sorted(extra)
            items[_EXTRA] = ocp.args.StandardSave(extra)
        args = ocp.args.Composite(**items)
        try:
            self._manager.save(step, args=args, custom_metadata={_META_KEY: record}, force=True)
        except BaseException as e:
            self.failed_step = step
            e.add_note(f"effijax: saving step {step} to {self.directory} failed")
            raise
        self._pending = step if self.async_save else None
        return SaveResult(step, True, "saved")

    def _wait_pending(self) -> None:
        try:
            self._manager.wait_until_finished()
        except BaseException as e:
            self.failed_step = self._pending
            e.add_note(f"effijax: the asynchronous write of step {self._pending} to "
                       f"{self.directory} failed")
            raise
        self._pending = None

    def wait(self) -> None:
        """Blocks until the asynchronous write in flight (if any) is committed.

        Raises:
          The write's exception (with a note naming the directory), if it failed.
        """
        self._wait_pending()

    def close(self) -> None:
        """Waits for the last write (raising its error, if any) and releases orbax's resources.

        Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the Checkpointer of {self.directory} is closed")

    # -- reading --------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """The steps, ascending: committed ones and the one being written, if any (temporary
        directories of killed writes are never listed)."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest step, or None when there is none.

        A step whose asynchronous write is still in flight counts (orbax's view); after
        :meth:`wait`, or in a new process, only committed steps do.

        Example:
          >>> import tempfile
          >>> open_checkpoints(tempfile.mkdtemp()).latest_step() is None
          True
        """
        return self._manager.latest_step()

    def metadata(self, step: int | None = None) -> dict:
        """The JSON record stored with ``step`` (default: the latest).

        Keys: ``format``, ``step``, ``saved_at``, ``versions`` (library versions),
        ``prng_keys`` (``{path: key implementation}``), ``metadata`` (the run's, as given to
        :func:`open_checkpoints`), for adapter checkpoints ``base_reference`` and, for a step
        saved with arrays beside the state, ``extra`` (their names; :meth:`extra`).
        """
        step = self._resolve_step(step)
        return _step_record(self._manager, step, self.directory)

    def extra(self, step: int | None = None) -> dict[str, dict[str, np.ndarray]]:
        """The host arrays saved beside the state of ``step`` (default: the latest), ``{name:
        {key: array}}`` as :meth:`save` was given them; ``{}`` for a step saved without any.

        Raises:
          FileNotFoundError: there is no committed checkpoint (or not ``step``).
          CorruptCheckpoint: the record lists arrays that cannot be read.

        Example:
          >>> import tempfile, numpy as np, jax.numpy as jnp, optax
          >>> from effijax.step import init_train_state
          >>> state = init_train_state({"w": jnp.ones(2)}, optax.sgd(0.1), 0)
          >>> with open_checkpoints(tempfile.mkdtemp(), keep=None) as ckpt:
          ...     _ = ckpt.save(state, extra={"rows": {"ids": np.arange(3, dtype=np.int32)}})
          ...     _ = ckpt.save(state._replace(step=jnp.int32(1)))
          ...     ckpt.wait()
          ...     ckpt.extra(0)["rows"]["ids"].tolist(), ckpt.extra(1)
          ([0, 1, 2], {})
        """
        self._check_open()
        step = self._resolve_step(step)
        record = _step_record(self._manager, step, self.directory)
        names = record.get("extra")
        if not names:
            return {}
        where = self.directory / str(step) / _EXTRA
        try:
            with _orphans.guard():
                restored = self._manager.restore(step, args=ocp.args.Composite(
                    **{_EXTRA: ocp.args.StandardRestore()}))[_EXTRA]
        except Exception as e:  # orbax/tensorstore: a missing, damaged or truncated file
            raise CorruptCheckpoint("checkpoint", str(where), f"step {step}'s record lists "
                                    f"{names}, which cannot be read "
                                    f"({_last_line(_root_cause(e), limit=400)}); move "
                                    f"{self.directory / str(step)} aside to resume from the "
                                    "step before") from e
        held = sorted(restored) if isinstance(restored, dict) else type(restored).__name__
        if held != sorted(names):
            raise CorruptCheckpoint("checkpoint", str(where), f"holds {held}, the step's "
                                    f"record lists {names}")
        return {name: {k: np.asarray(v) for k, v in arrays.items()}
                for name, arrays in restored.items()}

    def restore(self, step: int | None = None, *, target_state_abstract):
        """Restores ``step`` (default: the latest) into the target's shapes and shardings.

        Args:
          step: the step to restore; None means :meth:`latest_step`.
          target_state_abstract: the abstract state from :func:`restore_target`: every leaf a
            ``jax.ShapeDtypeStruct`` with a sharding (scalars and typed keys too). Its mesh
            and strategy may differ from the saving run's.

        Returns:
          The state, with the target's tree structure, dtypes and shardings; typed PRNG keys
          come back typed.

        Raises:
          FileNotFoundError: there is no committed checkpoint (or not ``step``).
          ConfigError: a target leaf has no sharding, or the checkpoint's tree, shapes or
            dtypes differ from the target's (see :func:`validate_resume`).
        """
        self._check_open()
        return _restore(self._manager, self.directory, step, target_state_abstract)

    def _resolve_step(self, step: int | None) -> int:
        return _resolve_step(self._manager, self.directory, step)


def _host_extra(extra) -> dict[str, dict[str, np.ndarray]]:
    """``extra`` as :meth:`Checkpointer.save` writes it: host copies (an asynchronous write
    reads them after ``save`` returns; the caller may replace them meanwhile)."""
    if not extra:
        return {}
    if not isinstance(extra, Mapping) or not all(
            isinstance(name, str) and isinstance(arrays, Mapping) and arrays
            and all(isinstance(k, str) for k in arrays) for name, arrays in extra.items()):
        raise ConfigError("extra", type(extra).__name__, "expected {name: {key: array}}, "
                          "names and keys strings, each name with at least one array")
    return {name: {k: np.array(v) for k, v in arrays.items()} for name, arrays in extra.items()}


def open_checkpoints(directory: str | os.PathLike, *, every: int = 1, keep: int | None = 3,
                     async_save: bool = True, metadata: Mapping | None = None) -> Checkpointer:
    """Opens (creating if needed) a run's checkpoint directory.

    Args:
      directory: the checkpoint directory.
      every: save when ``state.step % every == 0`` (``save(..., force=True)`` saves anyway).
      keep: keep the ``keep`` most recent checkpoints; None keeps all.
      async_save: write in a background thread; call :meth:`Checkpointer.wait` or
        :meth:`Checkpointer.close` before relying on the files.
      metadata: the run's settings (its config), a JSON-able dict stored with every step
        next to the library versions.

    Returns:
      A :class:`Checkpointer` (a context manager).

    Raises:
      ConfigError: ``every``, ``keep`` or ``metadata`` is invalid.
      OSError: the directory cannot be created.

    Example:
      >>> import tempfile, jax.numpy as jnp, optax
      >>> from effijax.step import init_train_state
      >>> state = init_train_state({"w": jnp.ones(2)}, optax.sgd(0.1), 0)
      >>> with open_checkpoints(tempfile.mkdtemp(), every=5, metadata={"lr": 0.1}) as ckpt:
      ...     ckpt.save(state._replace(step=jnp.int32(3))).reason
      ...     ckpt.save(state._replace(step=jnp.int32(5))).reason
      ...     ckpt.wait()
      ...     ckpt.latest_step(), ckpt.metadata()["metadata"]
      'not_due'
      'saved'
      (5, {'lr': 0.1})
    """
    return Checkpointer(directory, every=every, keep=keep, async_save=async_save,
                        metadata=metadata)
