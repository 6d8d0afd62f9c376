"""A global batch from each process' own rows.

Each process builds only the rows of a global batch that its devices hold
(:func:`process_rows`), and :func:`global_batch` assembles every process' rows into global
arrays with ``jax.make_array_from_process_local_data``; in one process the rows are the batch.
"""

from __future__ import annotations

import jax

from effijax.errors import ConfigError, whole_number

__all__ = ["process_rows", "global_batch"]


def process_rows(sharding, batch_size: int) -> tuple[int, int]:
    """Which block of a global batch's rows this process's devices hold under ``sharding``.

    A batch split over ``("data", "fsdp")`` spanning the processes gives each its own block; a
    batch axis that stays within a process (a ``tensor`` axis across the processes, say
    ``tensor=8`` over 2 processes of 4 devices) gives every process every row. Each process
    builds just those rows (``effijax.data.batch_at(..., process_index=index,
    process_count=count)``) and :func:`global_batch` assembles them.

    Args:
      sharding: the batch's sharding (:func:`effijax.sharding.batch_sharding`).
      batch_size: the global batch's rows.

    Returns:
      ``(index, count)``: this process holds rows ``[index * b, (index + 1) * b)`` with
      ``b = batch_size // count``.

    Raises:
      ConfigError: the process's devices hold rows that are not one contiguous block of equal
        size on every process (a mesh whose batch axes interleave the processes' devices).

    Example:
      >>> from effijax.sharding import batch_sharding, make_mesh
      >>> process_rows(batch_sharding(make_mesh(fsdp=2, tensor=4)), 16)  # one process
      (0, 1)
    """
    whole_number("batch_size", batch_size, maximum=None)
    me = jax.process_index()
    rows = set()
    for device, index in sharding.devices_indices_map((batch_size,)).items():
        if device.process_index == me:
            rows.update(range(batch_size)[index[0]])
    start, stop = min(rows), max(rows) + 1
    if len(rows) != stop - start or batch_size % len(rows) or start % len(rows):
        raise ConfigError("mesh", dict(sharding.mesh.shape), f"process {me}'s devices hold rows "
                          f"{sorted(rows)} of the batch of {batch_size}, not one block of "
                          "batch_size / (processes along the batch axes); order the devices "
                          "so that each process's are together (effijax.sharding.make_mesh does)")
    return start // len(rows), batch_size // len(rows)


def global_batch(local_batch, sharding, batch_size: int | None = None):
    """Global arrays from each process' own rows: ``make_array_from_process_local_data``.

    Every process passes the block of rows its devices hold (:func:`process_rows`: e.g.
    ``effijax.data.batch_at(..., process_index=index, process_count=count)`` with ``index,
    count = process_rows(sharding, batch_size)``); the result is one global array per leaf,
    laid out by ``sharding`` (usually :func:`effijax.sharding.batch_sharding`).

    Args:
      local_batch: a pytree of host arrays, this process' rows.
      sharding: the global arrays' sharding (one for the whole tree).
      batch_size: the global batch's rows; needed where the processes' blocks are not the
        batch split evenly over every process (every process holding every row, say), and
        None to let JAX infer it from the even split.

    Example:
      >>> import numpy as np
      >>> from effijax.sharding import batch_sharding, make_mesh
      >>> x = global_batch({"x": np.ones((16, 3), np.float32)}, batch_sharding(make_mesh()))
      >>> x["x"].shape, len(x["x"].addressable_shards)
      ((16, 3), 8)
    """
    def make(x):
        shape = None if batch_size is None else (batch_size, *x.shape[1:])
        return jax.make_array_from_process_local_data(sharding, x, shape)

    return jax.tree.map(make, local_batch)
