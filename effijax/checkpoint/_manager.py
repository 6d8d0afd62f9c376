"""A :class:`Checkpointer` over one orbax ``CheckpointManager``: every-K saves, keep-N, async.

One checkpoint directory holds one run's steps, ``<dir>/<step>/``. Each step is written by orbax
to a temporary ``<step>.orbax-checkpoint-tmp-*`` directory and renamed when complete, so a run
killed mid-write leaves a temporary directory that :meth:`Checkpointer.latest_step` ignores
(and that the next :func:`open_checkpoints` removes). A step directory holds:

* ``state/``: the pytree (a ``TrainState``, or any pytree of arrays), one array per leaf.
  Typed PRNG keys are stored as their key data (``jax.random.key_data``) and re-wrapped on
  restore with the implementation recorded in the step's metadata;
* ``_CHECKPOINT_METADATA``: JSON with the step, library versions, the key implementations,
  the run's metadata (its config) and, for adapter checkpoints, the base reference.

Saving is asynchronous by default: :meth:`Checkpointer.save` returns once the arrays are
copied off the device and the files are written by a background thread; errors of that thread
surface from the next :meth:`~Checkpointer.save`, :meth:`~Checkpointer.wait` or
:meth:`~Checkpointer.close` (never swallowed). A state with a non-finite parameter or
optimizer-state value is not written: ``save`` says so in its :class:`SaveResult`.

Restoring needs an abstract target whose every leaf carries a sharding
(:func:`restore_target`): the arrays land directly in that layout, on any mesh or strategy,
whatever the mesh they were saved from.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp

from effijax.checkpoint import _orphans
from effijax.errors import ConfigError, whole_number
from effijax.paths import map_with_path, named_leaves
from effijax.precision import all_finite
from effijax.provenance import library_versions

__all__ = [
    "SaveResult",
    "Checkpointer",
    "open_checkpoints",
    "restore_target",
    "validate_resume",
    "CorruptCheckpoint",
    "FORMAT_VERSION",
    "OLDEST_FORMAT",
]

# The step record's format. 1: the first release. 2: adds ``state_bytes`` (the saved arrays'
# total size, read by the storage pre-flight); a format-1 record gets it from orbax's array
# metadata when read (:func:`_migrate`). A record newer than FORMAT_VERSION is refused.
FORMAT_VERSION = 2
OLDEST_FORMAT = 1
_ITEM = "state"  # the orbax item name of the pytree inside a step directory
_META_KEY = "effijax"  # the top-level key of the step's custom metadata


class CorruptCheckpoint(ConfigError):
    """A step directory that cannot be read: its metadata is missing or malformed, or an array
    fails to load. A resume falls back to an older step; a model mismatch or a newer format is
    a plain :class:`~effijax.errors.ConfigError` instead (no older step would fix it)."""


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


def _is_key(leaf) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _key_data_sharding(sharding):
    # A key array of shape S is stored as uint32 data of shape S + (2,) (threefry); a
    # NamedSharding's spec leaves the trailing axis replicated, so the same object fits both.
    return sharding


def _host_int(x) -> int:
    """An int from a (possibly sharded, possibly multi-host) scalar array, without a gather."""
    if isinstance(x, jax.Array):
        return int(np.asarray(x.addressable_data(0)))
    return int(x)


def _to_savable(tree):
    """``tree`` with typed PRNG keys replaced by their key data; returns it and {path: impl}."""
    impls: dict[str, str] = {}

    def convert(path, leaf):
        if _is_key(leaf):
            impls[path] = str(jax.random.key_impl(leaf))
            return jax.random.key_data(leaf)
        return leaf

    return map_with_path(convert, tree), impls


def _abstract_savable(target):
    """The orbax restore target: key leaves become ShapeDtypeStructs of their key data."""

    def convert(leaf):
        if _is_key(leaf):
            data = jax.eval_shape(jax.random.key_data,
                                  jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
            return jax.ShapeDtypeStruct(data.shape, data.dtype,
                                        sharding=_key_data_sharding(leaf.sharding))
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)

    return jax.tree.map(convert, target)


def _abstract_leaf(path: str, leaf, sharding=None):
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        raise ConfigError("abstract_state", path, f"leaf is a {type(leaf).__name__}, expected an "
                          "array or jax.ShapeDtypeStruct (build the state with jax.eval_shape)")
    sharding = sharding if sharding is not None else getattr(leaf, "sharding", None)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


def restore_target(abstract_state, shardings):
    """The abstract target of :meth:`Checkpointer.restore`: every leaf with its sharding.

    Orbax places each restored array as its target leaf's sharding says. A leaf without one
    (typically a scalar: the step, a loss scale, Adam's count, the PRNG key) would land on a
    single device and break the next ``jit`` on a mesh ("incompatible devices"), so this
    attaches a sharding to *every* leaf, scalars and typed keys included.

    Args:
      abstract_state: a pytree of ``jax.ShapeDtypeStruct`` (``jax.eval_shape(init_fn, ...)``)
        or of arrays; typed PRNG keys stay typed (their key data is handled on restore).
      shardings: a pytree of ``jax.sharding.Sharding`` with the structure of
        ``abstract_state`` (``effijax.sharding.state_shardings(abstract_state, mesh,
        strategy)``), or one sharding for every leaf (e.g. ``effijax.sharding.replicated``).

    Returns:
      ``abstract_state`` with every leaf a ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``.

    Raises:
      ConfigError: a leaf is not array-like, or the shardings tree does not match.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from effijax.sharding import make_mesh, state_shardings
      >>> from effijax.step import init_train_state
      >>> init = lambda key: init_train_state({"w": jnp.zeros((64, 32))}, optax.adam(1e-3), key)
      >>> abstract = jax.eval_shape(init, jax.random.key(0))
      >>> target = restore_target(abstract, state_shardings(abstract, make_mesh(), "fsdp"))
      >>> target.params["w"].sharding.spec, target.step.sharding.spec, target.rng.dtype
      (P('fsdp',), P(), key<fry>)
    """
    if isinstance(shardings, jax.sharding.Sharding):
        return map_with_path(lambda path, leaf: _abstract_leaf(path, leaf, shardings),
                             abstract_state)
    try:
        return map_with_path(_abstract_leaf, abstract_state, shardings)
    except ValueError as e:  # jax's tree-structure mismatch
        if isinstance(e, ConfigError):
            raise
        raise ConfigError("shardings", type(shardings).__name__,
                          f"does not match the structure of abstract_state ({e}); derive it "
                          "with effijax.sharding.state_shardings(abstract_state, mesh, "
                          "strategy)") from e


def _check_target(target) -> None:
    missing = [path for path, leaf in named_leaves(target)
               if getattr(leaf, "sharding", None) is None]
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ConfigError(
            "target_state_abstract", shown,
            f"{len(missing)} leaves carry no sharding; restored without one they land on a "
            "single device and break jit on a mesh. Build the target with "
            "effijax.checkpoint.restore_target(abstract_state, shardings)")


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


def _coordination_barriers() -> None:
    """Makes orbax synchronise processes through jax's coordination service.

    By default orbax's barriers are device collectives (``sync_global_devices``), and an
    async save runs some of them from its background thread while the training thread runs
    the step's collectives (and ``effijax train``'s stop-flag exchange). Collectives issued in
    different orders on different processes can deadlock, since nothing orders a background
    thread's collective against the main thread's. The coordination service's barriers are
    RPCs to the coordinator, outside the devices' streams. A no-op in a single-process run.
    """
    if jax.process_count() == 1:
        return
    from absl import flags  # orbax's own flag library; the setting is read at each barrier

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()  # nothing reads argv here; every flag keeps its default
    flags.FLAGS.experimental_orbax_use_distributed_barrier = True


def _manager(directory, *, every: int, keep: int | None, async_save: bool,
             reader: bool = False) -> ocp.CheckpointManager:
    """The orbax manager; ``reader=True`` for a look at the metadata that changes nothing on
    disk (no directory creation, no cleanup; orbax's ``read_only`` would say the same with a
    warning on every call)."""
    directory = Path(directory).absolute()  # orbax's tensorstore paths must be absolute
    _coordination_barriers()
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add(_ITEM, ocp.args.StandardSave, ocp.StandardCheckpointHandler)
    registry.add(_ITEM, ocp.args.StandardRestore, ocp.StandardCheckpointHandler)
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=every,
        max_to_keep=None if reader else keep,
        enable_async_checkpointing=async_save,
        # Create the step's temporary directory in save() itself: created in the background, a
        # failure (unwritable or vanished directory) leaves the array writers waiting for its
        # signal until a timeout (minutes) instead of raising at once.
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        # A killed save leaves <step>.orbax-checkpoint-tmp*: never restored, removed on open.
        cleanup_tmp_directories=not reader,
        create=not reader,
    )
    # Opening reads every step's metadata: orbax would warn about a damaged step too.
    with _orbax_errors_only():
        return ocp.CheckpointManager(directory, options=options, handler_registry=registry)


@contextlib.contextmanager
def _orbax_errors_only():
    """orbax logs only errors in the block: a damaged step it meets (opening a directory,
    reading a step) is reported once, by effijax (:func:`restore_newest`), not also by orbax's
    warnings ("Metadata file does not exist", an unreadable file)."""
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl_logger.setLevel(level)


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

    def save(self, state, *, force: bool = False, step: int | None = None) -> SaveResult:
        """Saves ``state`` when its step is due (``step % every == 0``) or ``force``.

        Before writing, one jitted, on-device check that every floating leaf of ``params`` and
        ``opt_state`` is finite (of the whole tree for a pytree that is not a TrainState);
        a non-finite state is not written. With ``async_save`` the call returns once the
        arrays are off the device; the files are committed atomically in the background.

        Args:
          state: a ``TrainState`` (or any pytree of arrays when ``step`` is given).
          force: save even if the step is not a multiple of ``every``.
          step: the step to save under; default ``state.step``.

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
        args = ocp.args.Composite(**{_ITEM: ocp.args.StandardSave(tree)})
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
        :func:`open_checkpoints`) and, for adapter checkpoints, ``base_reference``.
        """
        step = self._resolve_step(step)
        return _step_record(self._manager, step, self.directory)

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


def _resolve_step(manager, directory, step: int | None) -> int:
    steps = manager.all_steps()
    if step is None:
        if not steps:
            raise FileNotFoundError(f"no committed checkpoint in {directory}")
        return max(steps)
    if step not in steps:
        raise FileNotFoundError(f"no checkpoint of step {step} in {directory}; "
                                f"committed steps: {sorted(steps)}")
    return int(step)


def _restore(manager, directory, step: int | None, target_state_abstract):
    step = _resolve_step(manager, directory, step)
    _check_target(target_state_abstract)
    record = _step_record(manager, step, directory)
    _compare(_saved_leaves(manager, step), target_state_abstract, directory, step)
    with _orphans.guard():  # a damaged file leaves the other reads pending (see _orphans)
        restored = manager.restore(
            step, args=ocp.args.Composite(
                **{_ITEM: ocp.args.StandardRestore(_abstract_savable(target_state_abstract))}))
    return _from_savable(restored[_ITEM], target_state_abstract, record.get("prng_keys", {}),
                         directory)


def read_checkpoint(directory: str | os.PathLike, *, target_state_abstract,
                    step: int | None = None) -> tuple[Any, dict]:
    """Restores a step of another run's checkpoints without changing anything on disk.

    What ``effijax train --from`` uses: unlike :func:`open_checkpoints` it creates no
    directory and cleans up nothing (the other run may still be writing).

    Args:
      directory: a checkpoint directory written by :class:`Checkpointer`.
      target_state_abstract: as in :meth:`Checkpointer.restore` (:func:`restore_target`).
      step: the step to restore (default: the latest committed one).

    Returns:
      ``(state, record)``: the restored state and the step's metadata record (see
      :meth:`Checkpointer.metadata`).

    Raises:
      FileNotFoundError: no committed checkpoint (or not ``step``).
      ConfigError: the checkpoint does not fit the target (see :func:`validate_resume`).

    Example:
      >>> import tempfile, jax, jax.numpy as jnp, optax
      >>> from effijax.step import init_train_state
      >>> state = init_train_state({"w": jnp.ones(2)}, optax.sgd(0.1), 0)
      >>> d = tempfile.mkdtemp()
      >>> with open_checkpoints(d) as ckpt:
      ...     ckpt.save(state).saved
      True
      >>> sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      >>> target = restore_target(state, jax.tree.map(lambda _: sharding, state))
      >>> restored, record = read_checkpoint(d, target_state_abstract=target)
      >>> restored.params["w"].tolist(), record["step"]
      ([1.0, 1.0], 0)
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no checkpoint directory {directory}")
    manager = _manager(directory, every=1, keep=None, async_save=False, reader=True)
    try:
        step = _resolve_step(manager, directory, step)
        state = _restore(manager, directory, step, target_state_abstract)
        return state, _step_record(manager, step, directory)
    finally:
        manager.close()


def latest_step(directory: str | os.PathLike) -> int | None:
    """The latest committed step in ``directory``, or None (no directory, or no step yet).

    A look only: nothing on disk is created or cleaned up and no process waits for another,
    so any process may call it on its own (a :class:`Checkpointer` opens the directory for
    writing, which every process of a run must do together).

    Example:
      >>> import tempfile, jax.numpy as jnp, optax
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


def _tree_bytes(tree) -> int:
    return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


# Each record field a reader relies on, and its JSON type.
_RECORD_TYPES = {"format": int, "step": int, "prng_keys": dict, "metadata": dict}


def _step_record(manager, step: int, directory) -> dict:
    """The step's effijax record, checked and migrated to :data:`FORMAT_VERSION`.

    Raises:
      CorruptCheckpoint: the metadata file is missing, unreadable or malformed (naming it and
        the field).
      ConfigError: the record's format is newer than this library reads.
    """
    where = Path(directory) / str(step) / "_CHECKPOINT_METADATA"
    try:
        with _orphans.guard():
            custom = manager.metadata(step).custom_metadata
    except Exception as e:  # orbax reads and parses the file: any failure means unreadable
        raise CorruptCheckpoint("checkpoint", str(where), f"step {step}'s metadata cannot be "
                                f"read ({_last_line(_root_cause(e), limit=400)})") from e
    record = (custom or {}).get(_META_KEY) if isinstance(custom, Mapping) else None
    if not isinstance(record, dict):
        raise CorruptCheckpoint("checkpoint", str(where), f"step {step} has no effijax record "
                                "(missing or rewritten metadata file)")
    for field, kind in _RECORD_TYPES.items():
        value = record.get(field)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CorruptCheckpoint(f"{where}:{_META_KEY}.{field}", value,
                                    f"expected {'an integer' if kind is int else 'an object'}")
    version = record["format"]
    if version > FORMAT_VERSION:
        raise ConfigError("checkpoint", str(directory), f"step {step} is in checkpoint format "
                          f"{version}, newer than this effijax reads (format {FORMAT_VERSION}); "
                          "upgrade effijax to restore it")
    if version < OLDEST_FORMAT:
        raise CorruptCheckpoint(f"{where}:{_META_KEY}.format", version, f"formats "
                                f"{OLDEST_FORMAT}..{FORMAT_VERSION} are readable")
    if record["step"] != step:
        raise CorruptCheckpoint(f"{where}:{_META_KEY}.step", record["step"],
                                f"the directory is step {step}")
    return _migrate(record, manager, step)


def _migrate(record: dict, manager, step: int) -> dict:
    """Lifts a supported older record to :data:`FORMAT_VERSION`, one version at a time."""
    record = dict(record)
    if record["format"] == 1:  # 1 -> 2: the arrays' total size, from orbax's metadata
        record["state_bytes"] = _tree_bytes(list(_saved_leaves(manager, step).values()))
        record["format"] = 2
    return record


def _last_line(e: BaseException, limit: int = 200) -> str:
    """An exception's message in one line: its last non-empty line, at most ``limit``
    characters."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    text = f"{type(e).__name__}: {lines[-1]}" if lines else type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _root_cause(e: BaseException) -> BaseException:
    """The innermost explicit cause (``raise ... from``): for a failed read, TensorStore's
    error naming the file and what is wrong with it, under orbax's wrapper (whose message
    ends in a dump of the array's spec)."""
    seen = {id(e)}
    while e.__cause__ is not None and id(e.__cause__) not in seen:
        e = e.__cause__
        seen.add(id(e))
    return e


def _saved_leaves(manager, step: int) -> dict[str, Any]:
    """``{path: ArrayMetadata}`` of a step, read from orbax's metadata (no array is loaded)."""
    try:
        with _orphans.guard():  # one damaged array's metadata leaves the others' reads pending
            item = manager.item_metadata(step)[_ITEM]
    except Exception as e:
        raise CorruptCheckpoint("checkpoint", str(Path(manager.directory) / str(step)),
                                f"step {step}'s array metadata cannot be read "
                                f"({_last_line(_root_cause(e), limit=400)})") from e
    tree = getattr(item, "tree", item)
    return dict(named_leaves(tree, is_leaf=lambda x: hasattr(x, "shape")))


def _describe(shape, dtype) -> str:
    return f"{np.dtype(dtype).name}{list(shape)}"


_FIX = "use a fresh --out or the same --model"


def _compare(saved: dict[str, Any], abstract_state, directory, step: int) -> None:
    """Raises ConfigError at the first leaf where the checkpoint and the model differ."""
    expected = named_leaves(_abstract_savable(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_state)))
    where = f"checkpoint {directory} (step {step})"
    for path, leaf in expected:
        if path not in saved:
            raise ConfigError("checkpoint", str(directory),
                              f"{where} has no leaf {path!r} that the model expects "
                              f"({_describe(leaf.shape, leaf.dtype)}): the state's tree "
                              f"structure differs; {_FIX}")
        got = saved[path]
        if tuple(got.shape) != tuple(leaf.shape) or np.dtype(got.dtype) != np.dtype(leaf.dtype):
            raise ConfigError("checkpoint", str(directory),
                              f"{where} holds {path!r} as {_describe(got.shape, got.dtype)} but "
                              f"the model expects {_describe(leaf.shape, leaf.dtype)}; {_FIX}")
    extra = [p for p in saved if p not in dict(expected)]
    if extra:
        raise ConfigError("checkpoint", str(directory),
                          f"{where} holds {len(extra)} leaves the model does not have, first "
                          f"{extra[0]!r}: the state's tree structure differs; {_FIX}")


def _from_savable(restored, target, impls: Mapping[str, str], directory):
    """Re-wraps key data as typed keys; every leaf keeps the target's sharding."""
    rebuilt = jax.tree.unflatten(jax.tree.structure(target), jax.tree.leaves(restored))

    def convert(path, leaf, abstract):
        if not _is_key(abstract):
            return leaf
        if path not in impls:
            raise ConfigError("checkpoint", str(directory), f"leaf {path!r} is a PRNG key in "
                              "the target but was not saved as one")
        return jax.random.wrap_key_data(leaf, impl=impls[path])

    return map_with_path(convert, rebuilt, target)


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
