"""Multi-process runs: the only module that calls ``jax.distributed``.

One process per host (or, for tests, several processes on one machine with forced CPU devices)
joins a run with :func:`initialize`, before anything touches a jax backend. Arguments win over
the environment: ``EFFIJAX_COORDINATOR`` (``host:port`` of process 0's coordinator; jax's own
``JAX_COORDINATOR_ADDRESS`` is accepted too), ``EFFIJAX_NUM_PROCESSES`` and
``EFFIJAX_PROCESS_ID``. One process (no setting at all, or ``num_processes=1``) is a no-op, so
single-process code calls :func:`initialize` unconditionally. Settings are checked before
connecting: a wrong process id or address is a :class:`~effijax.errors.ConfigError`, not a
five-minute connection timeout.

After initialisation ``jax.devices()`` lists every process' devices; each process feeds only
its own rows of a global batch, and :func:`global_batch` assembles them into global arrays with
``jax.make_array_from_process_local_data``. Only the main process (:func:`is_main`) writes files
or prints.

On CPU the cross-process collectives use gloo (jax 0.10's CPU default). A coordinator on a
loopback address (``127.0.0.1:PORT``) binds to that address only, never to every interface.
"""

from __future__ import annotations

import ipaddress
import os
from typing import NamedTuple

import jax

from effijax.errors import ConfigError

__all__ = ["initialize", "resolve", "ProcessSettings", "is_main", "barrier", "shutdown",
           "global_batch", "parse_address", "ENV_COORDINATOR", "ENV_NUM_PROCESSES",
           "ENV_PROCESS_ID"]

ENV_COORDINATOR = "EFFIJAX_COORDINATOR"
ENV_NUM_PROCESSES = "EFFIJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "EFFIJAX_PROCESS_ID"
# jax.distributed.initialize itself reads this one (jax/_src/distributed.py); jax documents no
# environment variables for the process count or id.
_JAX_COORDINATOR = "JAX_COORDINATOR_ADDRESS"

_LOOPBACK_NAMES = {"localhost", "ip6-localhost"}


def _int_setting(field: str, value, minimum: int) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ConfigError(field, value, "must be an integer") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(field, value, f"must be an integer >= {minimum}")
    return value


def parse_address(address: str, field: str = "coordinator_address") -> tuple[str, int]:
    """Splits ``host:port`` (``[v6]:port`` for IPv6), checking both parts.

    Raises:
      ConfigError: naming ``field``, when the port is missing or not in 1..65535, or the host
        is empty.

    Example:
      >>> parse_address("127.0.0.1:1234")
      ('127.0.0.1', 1234)
      >>> parse_address("[::1]:80")
      ('::1', 80)
      >>> parse_address("node-0")
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: coordinator_address='node-0': expected host:port, ...
    """
    if not isinstance(address, str):
        raise ConfigError(field, address, "expected a 'host:port' string")
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port:
        raise ConfigError(field, address, "expected host:port, e.g. 127.0.0.1:1234")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(field, address, f"port {port!r} is not an integer") from None
    if not 1 <= number <= 65535:
        raise ConfigError(field, address, f"port {number} is not in 1..65535")
    return host, number


def _is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ProcessSettings(NamedTuple):
    """Where this process stands in a run (see :func:`resolve`).

    Attributes:
      coordinator_address: ``host:port`` of process 0's coordinator (None for one process).
      num_processes: processes in the run.
      process_id: this process' index.
    """

    coordinator_address: str | None
    num_processes: int
    process_id: int


def resolve(coordinator_address: str | None = None, num_processes: int | None = None,
            process_id: int | None = None) -> ProcessSettings:
    """The run's process settings from the arguments, else the environment, all checked.

    Nothing connects and jax's backend does not start: this is the pre-flight half of
    :func:`initialize` (the command line calls it while validating its flags).

    Raises:
      ConfigError: naming the argument or environment variable: a count or id that is not an
        int, ``process_id`` out of range or missing, a malformed address, or an address given
        with one process.

    Example:
      >>> resolve()
      ProcessSettings(coordinator_address=None, num_processes=1, process_id=0)
      >>> resolve("127.0.0.1:1234", 2, 1)
      ProcessSettings(coordinator_address='127.0.0.1:1234', num_processes=2, process_id=1)
      >>> resolve("127.0.0.1", 2, 1)
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: coordinator_address='127.0.0.1': expected host:port, ...
    """
    env = os.environ
    if num_processes is not None:
        num = _int_setting("num_processes", num_processes, 1)
    else:
        num = _int_setting(ENV_NUM_PROCESSES, env.get(ENV_NUM_PROCESSES), 1) or 1
    if process_id is not None:
        pid, pid_field = _int_setting("process_id", process_id, 0), "process_id"
    else:
        pid, pid_field = _int_setting(ENV_PROCESS_ID, env.get(ENV_PROCESS_ID), 0), ENV_PROCESS_ID
    if coordinator_address is not None:
        address, field = coordinator_address, "coordinator_address"
    elif env.get(ENV_COORDINATOR):
        address, field = env[ENV_COORDINATOR], ENV_COORDINATOR
    elif env.get(_JAX_COORDINATOR) and num > 1:
        address, field = env[_JAX_COORDINATOR], _JAX_COORDINATOR
    else:
        address, field = None, "coordinator_address"

    if num == 1:
        if pid not in (None, 0):
            raise ConfigError(pid_field, pid, "must be 0 when there is one process (set "
                              "num_processes for a multi-process run)")
        if coordinator_address is not None:
            raise ConfigError("num_processes", num, f"a coordinator ({coordinator_address}) "
                              "was given but the run has 1 process; set num_processes too")
        return ProcessSettings(None, 1, 0)
    if pid is None:
        raise ConfigError("process_id", None, f"required with num_processes={num} (or set "
                          f"${ENV_PROCESS_ID})")
    if not pid < num:
        raise ConfigError(pid_field, pid, f"must be in [0, num_processes={num})")
    if address is None:
        raise ConfigError("coordinator_address", None, f"required with num_processes={num}: "
                          f"process 0's host:port (or set ${ENV_COORDINATOR})")
    host, port = parse_address(address, field)
    return ProcessSettings(f"{host}:{port}" if ":" not in host else f"[{host}]:{port}", num,
                           pid)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_count: int | None = None,
) -> bool:
    """Joins a multi-process run (a no-op for one process); call it before any other jax use.

    Args:
      coordinator_address: ``host:port`` of the coordinator that process 0 starts; default
        ``$EFFIJAX_COORDINATOR``, then ``$JAX_COORDINATOR_ADDRESS``.
      num_processes: processes in the run; default ``$EFFIJAX_NUM_PROCESSES``, else 1.
      process_id: this process' index in ``[0, num_processes)``; default
        ``$EFFIJAX_PROCESS_ID``.
      local_device_count: force this many CPU devices in this process (CPU runs and tests);
        applied before the backend starts (if it already started, it must have that many).

    Returns:
      True if this call connected to a multi-process run, False for a single process (or when
      this process had already joined one).

    Raises:
      ConfigError: bad settings (see :func:`resolve`), all found before connecting.
      RuntimeError: jax's backend already started (``jax.devices()`` or any computation ran
        first), with what to do instead.

    Example:
      >>> initialize()  # no settings: one process, nothing to do
      False
      >>> initialize("127.0.0.1:1234", 2, 2)
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: process_id=2: must be in [0, num_processes=2)
    """
    settings = resolve(coordinator_address, num_processes, process_id)
    local = _int_setting("local_device_count", local_device_count, 1)
    if jax.distributed.is_initialized():
        return False
    if local is not None:
        _force_cpu_devices(local)
    if settings.num_processes == 1:
        return False
    host, port = parse_address(settings.coordinator_address)
    kwargs = {}
    if _is_loopback(host):  # a local run: listen on loopback only, not on every interface
        kwargs["coordinator_bind_address"] = settings.coordinator_address
    try:
        jax.distributed.initialize(settings.coordinator_address, settings.num_processes,
                                   settings.process_id, **kwargs)
    except RuntimeError as e:
        if "before any JAX calls" in str(e):
            raise RuntimeError(
                "effijax.distributed.initialize must run before anything starts jax's backend "
                "(jax.devices(), jax.device_put, any computation): call it first thing in the "
                f"program. jax said: {e}"
            ) from e
        raise
    return True


def _force_cpu_devices(count: int) -> None:
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # the backend already started: fine if it has what was asked for
        have = jax.local_device_count()
        if have != count:
            raise ConfigError("local_device_count", count, f"jax already started with {have} "
                              "device(s) in this process; force CPU devices before anything "
                              "uses jax (first thing in the program)") from None


def is_main() -> bool:
    """True in the process that writes files and prints (process 0; always in one process).

    Example:
      >>> is_main()
      True
    """
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Waits until every process of the run has called ``barrier(name)``; a no-op in one
    process. Use it between reads every process makes on its own (of a shared directory) and
    the first write that would change what a late reader sees.

    Example:
      >>> barrier("example")
    """
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def shutdown() -> None:
    """Leaves the multi-process run (waits for the others); a no-op when not in one.

    Example:
      >>> shutdown()
    """
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


def global_batch(local_batch, sharding):
    """Global arrays from each process' own rows: ``make_array_from_process_local_data``.

    Every process passes its contiguous block of rows (e.g. from
    ``effijax.data.batch_at(..., process_index=jax.process_index(),
    process_count=jax.process_count())``); the result is one global array per leaf, laid out by
    ``sharding`` (usually :func:`effijax.sharding.batch_sharding`): each process' rows become
    the shards its own devices hold, so the global batch is the processes' blocks in process
    order when the mesh's batch axes list each process' devices together.

    Args:
      local_batch: a pytree of host arrays, this process' rows.
      sharding: the global arrays' sharding (one for the whole tree).

    Example:
      >>> import numpy as np
      >>> from effijax.sharding import batch_sharding, make_mesh
      >>> x = global_batch({"x": np.ones((16, 3), np.float32)}, batch_sharding(make_mesh()))
      >>> x["x"].shape, len(x["x"].addressable_shards)
      ((16, 3), 8)
    """
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x),
                        local_batch)
