"""Opening a run directory safely: its lock, its records, and the newest step that restores.

* The directory is locked for the run's lifetime (:func:`effijax.checkpoint.lock_run_dir`);
  in a multi-process run process 0 takes the lock and every process learns the outcome, so
  all stop together when another run holds it.
* ``config.json`` of an earlier run is read and checked field by field: a malformed file is a
  :class:`~effijax.errors.ConfigError` naming the file and the field, never a traceback.
* The newest intact checkpoint is restored (:func:`effijax.checkpoint.restore_newest`), after
  checking that the resume repeats the run's identity (:mod:`effijax.recipe._identity`);
  damaged newer steps are reported in one line each and moved aside, never deleted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from effijax import distributed
from effijax.checkpoint import (
    CorruptCheckpoint,
    lock_holder,
    lock_run_dir,
    restore_newest,
    restore_target,
    set_aside,
)
from effijax.data import read_json
from effijax.errors import ConfigError
from effijax.models import model_from_dict
from effijax.recipe import _identity, _report
from effijax.recipe._config import TrainConfig
from effijax.sources import MAX_CONFIG_BYTES

__all__ = ["agree", "lock", "read_run_json", "restore", "set_aside_bad", "no_intact_step"]


def agree(check, *args, other=None) -> Any:
    """Runs ``check(*args)`` on every process; if it raised ConfigError on any, every process
    raises (the others ``other()``'s error, or a note naming the failing process), so that no
    process goes on to a collective the failed one will never join."""
    result, error = None, None
    try:
        result = check(*args)
    except ConfigError as e:
        error = e
    if jax.process_count() > 1:
        flags = np.asarray(multihost_utils.process_allgather(np.int32(error is not None)))
        if error is None and flags.any():
            first = int(np.argmax(flags))
            error = other() if other is not None else ConfigError(
                "process", first, "a pre-flight check failed there (see its output)")
    if error is not None:
        raise error
    return result


def lock(out: Path):
    """Process 0 locks ``out``; every process raises the same ConfigError if it could not."""
    def other():  # another process' view: name the holder from the lock file
        return ConfigError("out", str(out), "another run is writing this directory "
                           f"({lock_holder(out)}); wait for it to end, stop it, or choose "
                           "another directory")

    return agree(lambda: lock_run_dir(out) if distributed.is_main() else None, other=other)


def _field_error(path: Path, e: ConfigError, prefix: str = "") -> ConfigError:
    return ConfigError(f"{path}:{prefix}{e.field}", e.value, e.problem)


def read_run_json(path: Path, *, need_model: bool = True) -> dict:
    """A run's ``config.json``, each field checked: the settings (as :class:`TrainConfig`),
    ``run.model_config`` (as the model family's config) and the ``resumes`` list.

    Raises:
      ConfigError: naming the file and the field (``PATH:field``), e.g. a string where a
        number belongs, an unknown key or a negative length.

    Example:
      >>> import tempfile, pathlib
      >>> p = pathlib.Path(tempfile.mkdtemp()) / "config.json"
      >>> _ = p.write_text('{"steps": -3, "run": {"model_config": {}}}')
      >>> read_run_json(p)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: .../config.json:steps=-3: must be an integer >= 1
    """
    values = read_json(path, limit=MAX_CONFIG_BYTES)  # a FIFO or a 3 GB file is never read
    try:
        TrainConfig.from_dict(values)
    except ConfigError as e:
        raise _field_error(path, e) from None
    record = values.get("run")
    if need_model:
        if not isinstance(record, dict):
            raise ConfigError(f"{path}:run", record, "expected the run record (an object)")
        try:
            model_from_dict(record.get("model_config"))
        except ConfigError as e:
            field = e.field if e.field.startswith("model_config") else f"model_config.{e.field}"
            raise ConfigError(f"{path}:run.{field}", e.value, e.problem) from None
    resumes = values.get("resumes", [])
    if not isinstance(resumes, list) or not all(isinstance(r, dict) for r in resumes):
        raise ConfigError(f"{path}:resumes", resumes, "expected a list of objects")
    return values


def _saved_config(record: dict, where: str) -> dict:
    """The run's settings stored with a checkpoint step, checked like a config.json."""
    saved = record.get("metadata", {}).get("config")
    if not isinstance(saved, dict):
        raise CorruptCheckpoint(f"{where}:metadata.config", saved, "expected the run's "
                                "settings (an object)")
    try:
        TrainConfig.from_dict(saved)
    except ConfigError as e:
        raise CorruptCheckpoint(f"{where}:metadata.config.{e.field}", e.value,
                                e.problem) from None
    return saved


def restore(ckpt_dir: Path, job, run_json: dict, allow: tuple[str, ...], *,
            arrays: bool = True):
    """The newest intact step of the run's own checkpoints, restored into the job's layout,
    once its settings are checked against the resuming run's (see :mod:`_identity`);
    ``arrays=False`` checks without reading the arrays (``restored.state`` is None).

    Returns:
      ``(restored, changes)``: a :class:`effijax.checkpoint.Restored` and the allowed changes.
    """
    changes: dict[str, Any] = {}

    def check(step: int, record: dict) -> None:
        where = str(ckpt_dir / str(step) / "_CHECKPOINT_METADATA")
        saved = _saved_config(record, where)
        changes.update(_identity.check_resume(saved, run_json, allow,
                                              where=str(ckpt_dir / str(step))))

    found = restore_newest(ckpt_dir, target_state_abstract=restore_target(job.state,
                                                                           job.shardings),
                           check=check, arrays=arrays)
    return found, changes


def _bad_list(bad) -> str:
    return "; ".join(f"step {step}: {reason}" for step, reason in bad)


def no_intact_step(ckpt_dir: Path, bad, field: str = "checkpoint") -> ConfigError:
    """The error when no step restores: each step's reason, and what to remove."""
    fix = (f"remove {ckpt_dir} (or choose another --out) to start this run afresh"
           if field == "checkpoint" else
           "resume or rerun that run so it writes an intact checkpoint, or start from "
           "another run")
    return ConfigError(field, str(ckpt_dir), f"no checkpoint step restores ({_bad_list(bad)}); "
                       f"{fix}")


def set_aside_bad(ckpt_dir: Path, bad, used: int) -> None:
    """Moves the damaged steps aside (process 0) and reports each in one line."""
    if not distributed.is_main():
        return
    for step, reason in bad:
        if not (ckpt_dir / str(step)).is_dir():
            continue
        moved = set_aside(ckpt_dir, step)
        _report.warn(f"checkpoint step {step} in {ckpt_dir} cannot be restored ({reason}); "
                     f"moved it to {moved.name} and resuming from step {used}")
