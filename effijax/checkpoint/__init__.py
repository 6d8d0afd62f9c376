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

Exact resume needs nothing else: batches and per-step keys are functions of ``state.step``;
what a step's batch reads that is not (GRPO's rollout, kept across a group of steps) is saved
beside the state with ``save(state, extra=...)`` and read back by :meth:`Checkpointer.extra`.
LoRA runs save only the adapters and their optimizer state, with the base referenced by a
fingerprint (:func:`save_adapters_checkpoint`). A failed write is one line,
:class:`~effijax.errors.SaveError`, with the rest in the run's logs (:func:`save_errors`).
"""

from effijax._lazy import attach

# Each name is imported from its module on first use (the package convention, see
# effijax/_lazy.py): importing the package costs only what is used.
__getattr__, __dir__, __all__ = attach(__name__, {
    "effijax.checkpoint._adapters": ("base_fingerprint", "base_reference",
        "restore_adapters_checkpoint", "save_adapters_checkpoint"),
    "effijax.checkpoint._failures": ("failure_reason", "last_good", "orbax_log",
        "rest_of_stderr_to", "save", "save_errors", "step_of", "write_errors", "keep_room",
        "free_room", "ROOM_FILE"),
    "effijax.checkpoint._lock": ("LOCK_FILE", "RunLock", "lock_holder", "lock_run_dir"),
    "effijax.checkpoint._checkpointer": ("Checkpointer", "SaveResult", "open_checkpoints"),
    "effijax.checkpoint._format": ("FORMAT_VERSION", "OLDEST_FORMAT", "CorruptCheckpoint"),
    "effijax.checkpoint._restore": ("read_checkpoint", "read_params", "restore_target"),
    "effijax.checkpoint._resume": ("Restored", "latest_step", "restore_newest", "set_aside",
        "validate_resume"),
    "effijax.checkpoint._metrics": ("truncate_metrics",),
})
