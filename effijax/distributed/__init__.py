"""Multi-process runs: how a process joins its run, joining it, and each process' batch rows.

One process per host (or, for tests, several processes on one machine with forced CPU devices)
joins a run with :func:`initialize` (or :func:`join`, which also says how it joined), before
anything touches a jax backend; one process (no setting at all) is a no-op, so single-process
code calls it unconditionally. :func:`find_launch` works out, without connecting, how this
process joins: from arguments, ``EFFIJAX_*``, or the launcher that started it (SLURM, Open MPI,
Cloud TPU, a Kubernetes indexed Job); :func:`process_settings` is its coordinator, process count
and id. After joining, each process builds only its own rows of a global batch
(:func:`process_rows`) and :func:`global_batch` assembles them into global arrays; only the
main process (:func:`is_main`) writes files or prints.

One module per job: ``_launch`` (the settings, checked before anything connects), ``_join``
(joining and leaving; the only module that calls jax's distributed runtime), ``_batch`` (rows).
"""

from effijax._lazy import attach

# Each name is imported from its module on first use (the package convention, see
# effijax/_lazy.py): importing the package imports no JAX until a name is used.
__getattr__, __dir__, __all__ = attach(__name__, {
    "effijax.distributed._launch": ("find_launch", "process_settings", "Launch",
        "ProcessSettings", "CLUSTERS", "parse_address", "ENV_COORDINATOR", "ENV_NUM_PROCESSES",
        "ENV_PROCESS_ID"),
    "effijax.distributed._join": ("initialize", "join", "is_main", "barrier", "shutdown",
        "MAX_CPU_DEVICES"),
    "effijax.distributed._batch": ("process_rows", "global_batch"),
})
