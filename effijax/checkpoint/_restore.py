"""Restoring a step onto an abstract target: onto any mesh, whatever the mesh it was saved from.

Restoring needs an abstract target whose every leaf carries a sharding
(:func:`restore_target`): the arrays land directly in that layout, on any mesh or strategy.
Before an array is read the step's record is checked and its saved leaves compared with the
target (:mod:`effijax.checkpoint._format`). :func:`read_checkpoint` reads another run's
directory without changing anything on disk; :func:`read_params` only its parameters.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from effijax.checkpoint import _orphans
from effijax.checkpoint._format import (
    _ITEM,
    _abstract_savable,
    _compare,
    _from_savable,
    _saved_leaves,
    _step_record,
)
from effijax.checkpoint._orbax_manager import _manager
from effijax.errors import ConfigError
from effijax.paths import map_with_path, named_leaves

__all__ = ["restore_target", "read_checkpoint", "read_params"]


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
      >>> from effijax.checkpoint import open_checkpoints
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
    with _reading(directory, step) as (manager, step):
        state = _restore(manager, directory, step, target_state_abstract)
        return state, _step_record(manager, step, directory)


@contextlib.contextmanager
def _reading(directory: Path, step: int | None):
    """A reader's orbax manager of ``directory`` and the step to read (None: the latest
    committed one), closed when done."""
    if not directory.is_dir():
        raise FileNotFoundError(f"no checkpoint directory {directory}")
    manager = _manager(directory, every=1, keep=None, async_save=False, reader=True)
    try:
        yield manager, _resolve_step(manager, directory, step)
    finally:
        manager.close()


def read_params(directory: str | os.PathLike, *, params_abstract,
                step: int | None = None) -> Any:
    """Restores the parameters of a step of another run's checkpoints onto this process' first
    device, without knowing the rest of its state (the optimizer that wrote it).

    What opening a run's model for evaluation or generation needs: the state's other leaves are
    read as the checkpoint describes them and dropped. Nothing on disk changes.

    Args:
      directory: a checkpoint directory written by :class:`Checkpointer`.
      params_abstract: the parameters' shapes and dtypes (``model.abstract_params(policy)``).
      step: the step to restore (default: the latest committed one).

    Returns:
      The parameters, with the structure of ``params_abstract``.

    Raises:
      FileNotFoundError: no committed checkpoint (or not ``step``).
      ConfigError: the checkpoint's parameters do not fit ``params_abstract``.

    Example:
      >>> import tempfile, jax, jax.numpy as jnp, optax
      >>> from effijax import checkpoint, step
      >>> d = tempfile.mkdtemp()  # a run whose optimizer the reader need not know: adam's
      >>> with checkpoint.open_checkpoints(d) as ckpt:
      ...     _ = ckpt.save(step.init_train_state({"w": jnp.ones(2)}, optax.adam(0.1), 0))
      >>> w = jax.ShapeDtypeStruct((2,), jnp.float32)
      >>> read_params(d, params_abstract={"w": w})["w"].tolist()
      [1.0, 1.0]
    """
    directory = Path(directory)
    with _reading(directory, step) as (manager, step):
        _step_record(manager, step, directory)  # a record in a format this library reads
        saved = _saved_leaves(manager, step)
        _compare({p.removeprefix("params/"): leaf for p, leaf in saved.items()
                  if p.startswith("params/")}, params_abstract, directory, step)
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        with _orphans.guard():
            item = manager.item_metadata(step)[_ITEM]
            target = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                getattr(item, "tree", item), is_leaf=lambda x: hasattr(x, "shape"))
            restored = manager.restore(step, args=ocp.args.Composite(
                **{_ITEM: ocp.args.StandardRestore(target)}))
        params = restored[_ITEM]["params"]
        return jax.tree.unflatten(jax.tree.structure(params_abstract), jax.tree.leaves(params))
