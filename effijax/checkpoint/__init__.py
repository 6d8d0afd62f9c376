"""Checkpoints: async, atomic, finite-only saves of a TrainState; restore onto any mesh.

The only effijax package that imports orbax. A run opens its directory once and offers every
state to :meth:`Checkpointer.save`, which writes when the step is due::

    ckpt = open_checkpoints(out / "checkpoints", every=100, keep=3, metadata=config)
    start = validate_resume(ckpt.directory, abstract_state)     # fast: metadata only
    if start is not None:
        state = ckpt.restore(target_state_abstract=restore_target(abstract_state, shardings))
        truncate_metrics(out / "metrics.jsonl", start)
    ...                                                          # in the loop:
    result = ckpt.save(state)                                    # SaveResult(step, saved, reason)
    ...
    ckpt.close()                                                 # waits; raises a failed write

Exact resume needs nothing else: batches and per-step keys are functions of ``state.step``.
LoRA runs save only the adapters and their optimizer state, with the base referenced by a
fingerprint (:func:`save_adapters_checkpoint`). A failed write is one line,
:class:`~effijax.errors.SaveError`, with the rest in the run's logs (:func:`save_errors`).
"""

from effijax.checkpoint._adapters import (
    base_fingerprint,
    base_reference,
    restore_adapters_checkpoint,
    save_adapters_checkpoint,
)
from effijax.checkpoint._failures import (
    failure_reason,
    last_good,
    orbax_log,
    rest_of_stderr_to,
    save,
    save_errors,
    step_of,
)
from effijax.checkpoint._lock import LOCK_FILE, RunLock, lock_holder, lock_run_dir
from effijax.checkpoint._manager import (
    FORMAT_VERSION,
    OLDEST_FORMAT,
    Checkpointer,
    CorruptCheckpoint,
    Restored,
    SaveResult,
    latest_step,
    open_checkpoints,
    read_checkpoint,
    restore_newest,
    restore_target,
    set_aside,
    validate_resume,
)
from effijax.checkpoint._metrics import truncate_metrics

__all__ = [
    "Checkpointer",
    "SaveResult",
    "latest_step",
    "open_checkpoints",
    "read_checkpoint",
    "restore_target",
    "validate_resume",
    "truncate_metrics",
    "base_fingerprint",
    "base_reference",
    "save_adapters_checkpoint",
    "restore_adapters_checkpoint",
    "FORMAT_VERSION",
    "OLDEST_FORMAT",
    "CorruptCheckpoint",
    "Restored",
    "restore_newest",
    "set_aside",
    "RunLock",
    "lock_run_dir",
    "lock_holder",
    "LOCK_FILE",
    "orbax_log",
    "save",
    "save_errors",
    "step_of",
    "failure_reason",
    "last_good",
    "rest_of_stderr_to",
]
