"""Joining a multi-process run and leaving it: the only module that calls ``jax.distributed``.

:func:`initialize` and :func:`join` take the settings of
:func:`~effijax.distributed.find_launch`, force CPU devices when asked, and connect. After
initialisation ``jax.devices()`` lists every process' devices; only the main process
(:func:`is_main`) writes files or prints; :func:`barrier` and :func:`shutdown` are no-ops in
one process.

Start-up: before jax's own connection, the processes meet on the coordinator's port
(``effijax._rendezvous``), because jax 0.10 waits in silence and, when a process never comes,
aborts the interpreter from C++ after five minutes. While a process waits it says for whom
(``print_fn``, by default to stderr); after ``join_timeout`` seconds (300 by default) it raises a
:class:`~effijax.errors.ConfigError` naming the missing processes, as does a process started
with another process count, or an id two processes share.

On CPU the cross-process collectives use gloo (jax 0.10's CPU default). A coordinator on a
loopback address (``127.0.0.1:PORT``) binds to that address only, never to every interface.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Callable

import jax

from effijax import _rendezvous
from effijax.distributed._launch import (
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    Launch,
    _int_setting,
    find_launch,
    parse_address,
)
from effijax.errors import ConfigError, whole_number

__all__ = ["initialize", "join", "is_main", "barrier", "shutdown", "MAX_CPU_DEVICES"]

_LOOPBACK_NAMES = {"localhost", "ip6-localhost"}
# jax's coordinator binds here when the address is not a loopback one (jax/_src/distributed.py).
_JAX_BIND = "JAX_COORDINATOR_BIND_ADDRESS"
# The seconds jax's own connection may take once every process has met: gRPC backs off for
# seconds between attempts while process 0's service starts, so a short join_timeout (a test's)
# must not become jax's, whose expiry aborts the interpreter.
_JAX_CONNECT_S = 60
# The most CPU devices one process may force. XLA starts every one up front (a client, a
# thread pool and buffers each), so 100,000 take the machine for minutes before one line is
# printed; 1,024 is far above any mesh a host simulates (a TPU pod slice's is 256 or 512).
MAX_CPU_DEVICES = 1024


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    cluster: str = "auto",
    local_device_count: int | None = None,
    join_timeout: int = 300,
    print_fn: Callable[[str], None] | None = None,
) -> bool:
    """Joins a multi-process run (a no-op for one process); call it before any other jax use.

    Args:
      coordinator_address: ``host:port`` of the coordinator that process 0 starts; default
        ``$EFFIJAX_COORDINATOR``, then ``$JAX_COORDINATOR_ADDRESS``, then the launcher's.
      num_processes: processes in the run; default ``$EFFIJAX_NUM_PROCESSES``, else the
        launcher's (see :func:`find_launch`), else 1.
      process_id: this process' index in ``[0, num_processes)``; default
        ``$EFFIJAX_PROCESS_ID``, else the launcher's.
      cluster: launcher detection, one of :data:`CLUSTERS` (``auto``: whichever launcher
        started this process; ``none``: only the explicit settings).
      local_device_count: force this many CPU devices in this process (CPU runs and tests);
        applied before the backend starts (if it already started, it must have that many).
      join_timeout: seconds this process waits for the others to join (process 0: for all
        of them; the others: for process 0 and, through it, for the rest).
      print_fn: receives a line (no prefix) whenever this process reports what it waits for:
        after a couple of seconds of waiting, then every half minute; default: stderr, as
        ``effijax: ...``.

    Returns:
      True if this call connected to a multi-process run, False for a single process (or when
      this process had already joined one).

    Raises:
      ConfigError: bad settings (see :func:`find_launch`), all found before connecting; then, while
        joining: a process missing after ``join_timeout`` (``num_processes``, naming it), a
        process started with another process count (``num_processes``), an id two processes
        share (``process_id``), a coordinator port process 0 cannot listen on
        (``coordinator_address``). Every process that knows of the problem raises it.
      RuntimeError: jax's backend already started (``jax.devices()`` or any computation ran
        first), with what to do instead.

    Example:
      >>> initialize()  # no settings, no launcher: one process, nothing to do
      False
      >>> initialize("127.0.0.1:1234", 2, 2)
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: process_id=2: must be in [0, num_processes=2)
    """
    launch = find_launch(coordinator_address, num_processes, process_id, cluster=cluster)
    return _join(launch, local_device_count, join_timeout, print_fn)


def join(launch: Launch | None = None, *, local_device_count: int | None = None,
         join_timeout: int = 300, print_fn: Callable[[str], None] | None = None) -> Launch:
    """Joins the run ``launch`` describes (default: :func:`find_launch` of the environment and
    the launcher), as :func:`initialize` does with the same keyword arguments, and returns how
    this process joined (for a start-up line).

    Example:
      >>> join().describe()
      '1 process (no launcher)'
      >>> join(find_launch("127.0.0.1:1", 2, 1), join_timeout=1, print_fn=print)
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: num_processes=2: process 0 did not answer at 127.0.0.1:1 ...
    """
    launch = find_launch() if launch is None else launch
    _join(launch, local_device_count, join_timeout, print_fn)
    if local_device_count is not None:  # forced CPU devices: no accelerator is narrowed
        launch = launch._replace(local_device_ids=None)
    return launch


def _join(launch: Launch, local_device_count: int | None, join_timeout: int,
          print_fn: Callable[[str], None] | None) -> bool:
    settings = launch.settings
    local = _int_setting("local_device_count", local_device_count, 1)
    if local is not None:
        whole_number("local_device_count", local, maximum=MAX_CPU_DEVICES)
    timeout = _int_setting("join_timeout", join_timeout, 1)
    if timeout is None:
        raise ConfigError("join_timeout", join_timeout, "must be an integer >= 1")
    if jax.distributed.is_initialized():
        return False
    if local is not None:
        _force_cpu_devices(local)
    if settings.num_processes == 1:
        return False
    bind = _bind_address(settings.coordinator_address)
    try:
        _rendezvous.meet(settings.coordinator_address, parse_address(bind, _JAX_BIND),
                         settings.num_processes, settings.process_id, timeout_s=timeout,
                         print_fn=print_fn or _to_stderr)
    except _rendezvous.JoinError as e:
        raise _join_error(launch, e) from None
    kwargs = {"cluster_detection_method": "deactivate",  # find_launch() decided everything
              "coordinator_bind_address": bind,
              "initialization_timeout": max(timeout, _JAX_CONNECT_S)}
    if launch.local_device_ids is not None and local is None:  # accelerators, not forced CPUs
        kwargs["local_device_ids"] = list(launch.local_device_ids)
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


def _bind_address(address: str) -> str:
    """Where process 0 listens: the meeting's socket first, then jax's coordinator service."""
    host, port = parse_address(address)
    if _is_loopback(host):  # a local run: listen on loopback only, not on every interface
        return address
    return os.environ.get(_JAX_BIND) or f"[::]:{port}"  # jax's own default


def _is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _to_stderr(line: str) -> None:
    print(f"effijax: {line}", file=sys.stderr, flush=True)


# How each source of the settings names them, for errors found while joining.
_SETTING_NAMES = {
    "environment": {"num_processes": ENV_NUM_PROCESSES, "process_id": ENV_PROCESS_ID},
    "slurm": {"num_processes": "SLURM_NTASKS", "process_id": "SLURM_PROCID"},
    "ompi": {"num_processes": "OMPI_COMM_WORLD_SIZE", "process_id": "OMPI_COMM_WORLD_RANK"},
}


def _join_error(launch: Launch, error: _rendezvous.JoinError) -> ConfigError:
    """``error`` under the name of the setting to fix, with what to do about it."""
    s = launch.settings
    own = {"num_processes": s.num_processes, "process_id": s.process_id,
           "coordinator_address": s.coordinator_address}
    value = error.value if error.value is not None else own.get(error.setting)
    return ConfigError(_setting_name(launch.launcher, error.setting), value,
                       error.problem + _join_hint(launch.launcher, sorted(error.missing)))


def _setting_name(source: str | None, setting: str) -> str:
    if source in (None, "flags"):
        return setting
    if source == "environment":
        return _SETTING_NAMES[source].get(setting, setting)
    return _SETTING_NAMES.get(source, {}).get(setting, f"{source} {setting.replace('_', ' ')}")


def _join_hint(source: str | None, missing: list[int]) -> str:
    """What to do about the processes that did not join, by who started them."""
    by_hand = source in ("flags", "environment")
    if not missing:
        return ""
    if missing == [0]:
        first = ("start process 0 (it hosts the coordinator) there with the same process count"
                 if by_hand else "see process 0's output (did it fail before listening?)")
        return f"; {first}, and check that this host can reach that address"
    one = len(missing) == 1
    them, their, they = ("it", "its", "it") if one else ("them", "their", "they")
    if by_hand:
        numbers = _rendezvous.ids(missing).split(" ", 1)[1]
        return (f"; start {them} with process {'id' if one else 'ids'} {numbers} and the same "
                "coordinator and process count, or lower the process count")
    return (f"; {source} started {them}: see {their} output, and check that {they} can reach "
            "that address")


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
