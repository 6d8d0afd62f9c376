"""What a checkpoint step directory holds, and reading it back without loading an array.

One checkpoint directory holds one run's steps, ``<dir>/<step>/``. A step directory holds:

* ``state/``: the pytree (a ``TrainState``, or any pytree of arrays), one array per leaf.
  Typed PRNG keys are stored as their key data (``jax.random.key_data``) and re-wrapped on
  restore with the implementation recorded in the step's metadata (:func:`_to_savable`,
  :func:`_from_savable`);
* ``_CHECKPOINT_METADATA``: JSON with the step, library versions, the key implementations,
  the run's metadata (its config) and, for adapter checkpoints, the base reference: the step
  record, checked and migrated to :data:`FORMAT_VERSION` by :func:`_step_record`;
* ``extra/``, only in a step saved with host arrays beside the state (GRPO's rollout inside a
  group of ``num_iterations`` steps): ``{name: {key: array}}``, its names listed under the
  record's ``extra``. A step saved without any has neither.

A step is compared with the state it would restore into leaf by leaf from orbax's array
metadata alone (:func:`_compare`): a model mismatch is found before an array is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from effijax.checkpoint import _orphans
from effijax.errors import ConfigError
from effijax.paths import map_with_path, named_leaves

__all__ = ["FORMAT_VERSION", "OLDEST_FORMAT", "CorruptCheckpoint"]

# The step record's format. 1: the first release. 2: adds ``state_bytes`` (the saved arrays'
# total size, read by the storage pre-flight); a format-1 record gets it from orbax's array
# metadata when read (:func:`_migrate`). A record newer than FORMAT_VERSION is refused.
FORMAT_VERSION = 2
OLDEST_FORMAT = 1
_ITEM = "state"  # the orbax item name of the pytree inside a step directory
_EXTRA = "extra"  # the orbax item of the host arrays saved beside it, when there are any
_META_KEY = "effijax"  # the top-level key of the step's custom metadata


class CorruptCheckpoint(ConfigError):
    """A step directory that cannot be read: its metadata is missing or malformed, or an array
    fails to load. A resume falls back to an older step; a model mismatch or a newer format is
    a plain :class:`~effijax.errors.ConfigError` instead (no older step would fix it)."""


def _is_key(leaf) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _key_data_sharding(sharding):
    # A key array of shape S is stored as uint32 data of shape S + (2,) (threefry); a
    # NamedSharding's spec leaves the trailing axis replicated, so the same object fits both.
    return sharding


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
