"""The orbax ``CheckpointManager`` a checkpoint directory is opened with, to write or to look.

Every reader and writer of a checkpoint directory goes through :func:`_manager`: one handler
registry for the step's items (the state's pytree, and the host arrays some steps hold beside
it), the options effijax relies on (temporary directories created in ``save`` itself and
removed on open, nothing created or cleaned up by a reader), and in a multi-process run
barriers through jax's coordination service instead of device collectives
(:func:`_coordination_barriers`).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from effijax.checkpoint._format import _EXTRA, _ITEM


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
    for item in (_ITEM, _EXTRA):
        registry.add(item, ocp.args.StandardSave, ocp.StandardCheckpointHandler)
        registry.add(item, ocp.args.StandardRestore, ocp.StandardCheckpointHandler)
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
