"""How this process joins its run: the coordinator, process count and id, all checked.

Arguments win over the environment: ``EFFIJAX_COORDINATOR`` (``host:port`` of process 0's
coordinator; jax's own ``JAX_COORDINATOR_ADDRESS`` is accepted too), ``EFFIJAX_NUM_PROCESSES``
and ``EFFIJAX_PROCESS_ID``. Settings are checked before connecting: a wrong process id or
address is a :class:`~effijax.errors.ConfigError`, not a five-minute connection timeout.

Launchers: with no process count given (no argument, no ``EFFIJAX_NUM_PROCESSES``),
:func:`find_launch` asks jax's cluster detection (``jax._src.clusters``, what jax's distributed
``initialize()`` does with no arguments) whether a launcher started this process:
SLURM's ``srun``, Open MPI's ``mpirun``, mpi4py (on request only), a Kubernetes indexed Job, or a
Cloud TPU slice; the launcher then gives the coordinator, the process count and this process' id
(an explicit coordinator still wins). ``cluster="none"`` turns detection off, a launcher's name
forces it. A launcher environment that is half there (``OMPI_COMM_WORLD_SIZE`` without Open MPI
4's ``OMPI_MCA_orte_hnp_uri``, a Kubernetes indexed Job without the ``kubernetes`` package, a
rank outside the task count) is a :class:`~effijax.errors.ConfigError`, never a silent single
process: sixteen processes that each think they are alone would write one directory sixteen
times. Nothing here connects.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import jax

from effijax.errors import ConfigError, whole_number

__all__ = ["find_launch", "process_settings", "Launch", "ProcessSettings", "CLUSTERS",
           "parse_address", "ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID"]

ENV_COORDINATOR = "EFFIJAX_COORDINATOR"
ENV_NUM_PROCESSES = "EFFIJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "EFFIJAX_PROCESS_ID"
# jax's distributed initialize() itself reads this one (jax/_src/distributed.py); jax documents no
# environment variables for the process count or id.
_JAX_COORDINATOR = "JAX_COORDINATOR_ADDRESS"


def _int_setting(field: str, value, minimum: int) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ConfigError(field, value, "must be an integer") from None
    return whole_number(field, value, minimum=minimum)


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


class ProcessSettings(NamedTuple):
    """Where this process stands in a run (see :func:`process_settings`).

    Attributes:
      coordinator_address: ``host:port`` of process 0's coordinator (None for one process).
      num_processes: processes in the run.
      process_id: this process' index.
    """

    coordinator_address: str | None
    num_processes: int
    process_id: int


# The launchers effijax names, each with jax's detector class (jax._src.clusters), in the order
# jax tries them; mpi4py is opt-in in jax too (it needs a working MPI).
CLUSTERS = ("auto", "none", "ompi", "slurm", "mpi4py", "gke-tpu", "gce-tpu", "k8s")
_DETECTORS = {"ompi": "OmpiCluster", "slurm": "SlurmCluster", "mpi4py": "Mpi4pyCluster",
              "gke-tpu": "GkeTpuCluster", "gce-tpu": "GceTpuCluster", "k8s": "K8sCluster"}
_AUTO = ("ompi", "slurm", "gke-tpu", "gce-tpu", "k8s")
# What each launcher sets in every process it starts (for the messages and partial-env checks).
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
               "SLURM_LOCALID")
_OMPI_URI = "OMPI_MCA_orte_hnp_uri"
_OMPI_VARS = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
_K8S_INDEX = "JOB_COMPLETION_INDEX"


class Launch(NamedTuple):
    """How this process joins its run (see :func:`find_launch`).

    Attributes:
      settings: the coordinator, process count and this process' id.
      launcher: where they came from: ``"flags"`` (arguments), ``"environment"``
        (``EFFIJAX_*``), a launcher of :data:`CLUSTERS` (``"slurm"``, ``"ompi"``, ...), or None
        (one process, nothing said).
      local_device_ids: the accelerators this process keeps when a launcher starts several
        processes per host (its local rank, as jax does); None: every visible device.
    """

    settings: ProcessSettings
    launcher: str | None
    local_device_ids: tuple[int, ...] | None = None

    def describe(self) -> str:
        """One line for the start of a run: the launcher, the process count and this id.

        Example:
          >>> find_launch("127.0.0.1:1234", 2, 1).describe()
          'process 1 of 2 (from flags), coordinator 127.0.0.1:1234'
        """
        s = self.settings
        source = {None: "no launcher", "flags": "from flags",
                  "environment": "from $EFFIJAX_*"}.get(self.launcher,
                                                       f"launcher {self.launcher}")
        if s.num_processes == 1:
            return f"1 process ({source})"
        line = f"process {s.process_id} of {s.num_processes} ({source}), coordinator " \
               f"{s.coordinator_address}"
        if self.local_device_ids is not None:
            line += f", local devices {list(self.local_device_ids)}"
        return line


def _explicit(coordinator_address, num_processes, process_id) -> ProcessSettings:
    """The settings from arguments and ``EFFIJAX_*`` alone (no launcher)."""
    env = os.environ
    if num_processes is not None:
        num = _int_setting("num_processes", num_processes, 1)
    else:
        num = _int_setting(ENV_NUM_PROCESSES, env.get(ENV_NUM_PROCESSES), 1) or 1
    if process_id is not None:
        pid, pid_field = _int_setting("process_id", process_id, 0), "process_id"
    else:
        pid, pid_field = _int_setting(ENV_PROCESS_ID, env.get(ENV_PROCESS_ID), 0), ENV_PROCESS_ID
    address, field = _coordinator(coordinator_address, num > 1)

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
    return ProcessSettings(_normal_address(address, field), num, pid)


def _coordinator(coordinator_address, allow_jax_env: bool) -> tuple[str | None, str]:
    env = os.environ
    if coordinator_address is not None:
        return coordinator_address, "coordinator_address"
    if env.get(ENV_COORDINATOR):
        return env[ENV_COORDINATOR], ENV_COORDINATOR
    if env.get(_JAX_COORDINATOR) and allow_jax_env:
        return env[_JAX_COORDINATOR], _JAX_COORDINATOR
    return None, "coordinator_address"


def _normal_address(address: str, field: str) -> str:
    host, port = parse_address(address, field)
    return f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"


def _env_int(name: str, minimum: int = 0) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ConfigError(name, None, "not set")
    return _int_setting(name, value, minimum)


def _partial(name: str) -> str | None:
    """Why this process looks started by launcher ``name`` whose environment jax would not
    recognise (so it would run alone), or None."""
    env = os.environ
    if name == "slurm" and "SLURM_STEP_NODELIST" in env:  # inside an srun step
        missing = [v for v in _SLURM_VARS if v not in env]
        if missing:
            return (f"srun's step environment lacks {', '.join(missing)} (a container or "
                    "wrapper that drops SLURM_* variables?)")
    if name == "ompi":
        have = [v for v in _OMPI_VARS if v in env]
        if _OMPI_URI in env and len(have) < len(_OMPI_VARS):
            missing = [v for v in _OMPI_VARS if v not in env]
            return f"mpirun's environment lacks {', '.join(missing)}"
        if _OMPI_URI not in env and "OMPI_COMM_WORLD_SIZE" in env:
            return ("OMPI_COMM_WORLD_SIZE is set but not OMPI_MCA_orte_hnp_uri: Open MPI 5 (or "
                    "another launcher setting Open MPI's variables), which jax's detection does "
                    "not read. Use cluster mpi4py (with mpi4py installed), or give the process "
                    "settings explicitly: --num-processes $OMPI_COMM_WORLD_SIZE --process-id "
                    "$OMPI_COMM_WORLD_RANK --coordinator HOST:PORT")
    if name == "k8s" and "KUBERNETES_SERVICE_HOST" in env and _K8S_INDEX in env:
        import importlib.util

        if importlib.util.find_spec("kubernetes") is None:
            return (f"a Kubernetes indexed Job ({_K8S_INDEX}={env[_K8S_INDEX]}) but the "
                    "'kubernetes' package, which jax's detection needs, is not installed: "
                    "pip install 'jax[k8s]'")
    return None


def _present(name: str) -> bool:
    """Whether jax's detector for ``name`` finds its launcher (cheap checks first: the
    Kubernetes detector calls the cluster's API, so it runs only in an indexed Job)."""
    env = os.environ
    if name == "k8s" and not ("KUBERNETES_SERVICE_HOST" in env and _K8S_INDEX in env):
        return False
    if name == "ompi" and _OMPI_URI not in env:
        return False
    if name == "slurm" and not all(v in env for v in _SLURM_VARS):
        return False
    if name == "mpi4py":
        import importlib.util

        if importlib.util.find_spec("mpi4py") is None:
            return False
    try:
        detector = _detector(name)
    except ConfigError:  # this jax cannot detect that launcher: it did not start us
        return False
    return bool(detector.is_env_present())


def _detector(name: str):
    try:
        from jax._src import clusters  # jax's launcher detection (what initialize() uses)

        by_class = {cls.__name__: cls for cls in clusters.ClusterEnv._cluster_types}
    except (ImportError, AttributeError):  # a jax that moved its private detection
        by_class = {}
    cls = by_class.get(_DETECTORS[name])
    if cls is None:
        raise ConfigError("cluster", name, f"this jax ({jax.__version__}) has no "
                          f"{_DETECTORS[name]} launcher detection; give the process settings "
                          "explicitly")
    return cls


def _launcher_settings(name: str, timeout_s: int) -> tuple[str, int, int]:
    """``(coordinator, count, id)`` as the launcher gives them, checked."""
    if name == "slurm":
        count, pid = _env_int("SLURM_NTASKS", 1), _env_int("SLURM_PROCID")
        count_field, pid_field = "SLURM_NTASKS", "SLURM_PROCID"
        _env_int("SLURM_JOB_ID")
    elif name == "ompi":
        count, pid = _env_int("OMPI_COMM_WORLD_SIZE", 1), _env_int("OMPI_COMM_WORLD_RANK")
        count_field, pid_field = "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"
    else:
        cls = _detector(name)
        try:
            count, pid = int(cls.get_process_count()), int(cls.get_process_id())
        except (RuntimeError, ValueError, KeyError) as e:
            raise ConfigError("cluster", name, f"the launcher's environment does not give a "
                              f"process count and id: {e}") from None
        count_field, pid_field = f"{name} process count", f"{name} process id"
    if not 0 <= pid < count:
        raise ConfigError(pid_field, pid, f"outside [0, {count_field}={count}): the "
                          "launcher's environment is inconsistent")
    if count == 1:
        return "", 1, 0
    try:
        address = _detector(name).get_coordinator_address(
            timeout_secs=timeout_s, override_coordinator_port=os.environ.get(
                "JAX_COORDINATOR_PORT"))
    except (RuntimeError, ValueError, KeyError) as e:
        raise ConfigError("cluster", name, f"could not find the coordinator from the "
                          f"launcher's environment: {e}") from None
    return address, count, pid


def _local_device_ids(name: str) -> tuple[int, ...] | None:
    """This process' local rank as its one accelerator when the launcher put several processes
    on this host and nothing else narrows the devices (jax's rule for SLURM and Open MPI);
    None (every device) with one process per host, the layout this library suggests."""
    env = os.environ
    if env.get("JAX_LOCAL_DEVICE_IDS"):
        return None  # jax reads it itself
    visible = env.get("CUDA_VISIBLE_DEVICES") or env.get("ROCR_VISIBLE_DEVICES")
    if visible is not None and len([d for d in visible.split(",") if d.strip()]) == 1:
        return None  # the launcher bound one device to this process already
    if name == "slurm":
        nodes = _int_setting("SLURM_STEP_NUM_NODES", env.get("SLURM_STEP_NUM_NODES"), 1)
        several = nodes is None or _env_int("SLURM_NTASKS", 1) > nodes
        local = _env_int("SLURM_LOCALID")
    elif name == "ompi":
        several = _int_setting("OMPI_COMM_WORLD_LOCAL_SIZE",
                               env.get("OMPI_COMM_WORLD_LOCAL_SIZE"), 1) != 1
        local = _env_int("OMPI_COMM_WORLD_LOCAL_RANK")
    elif name == "mpi4py":
        from mpi4py import MPI

        node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
        several, local = node.Get_size() > 1, node.Get_rank()
    else:
        return None  # TPU hosts and Kubernetes pods: jax leaves the devices alone too
    return (local,) if several else None


def find_launch(coordinator_address: str | None = None, num_processes: int | None = None,
                process_id: int | None = None, *, cluster: str = "auto",
                timeout_s: int = 300) -> Launch:
    """How this process joins its run: from the arguments, ``EFFIJAX_*``, or its launcher.

    A process count (argument or ``$EFFIJAX_NUM_PROCESSES``) means explicit settings, and no
    launcher is asked. Otherwise, unless ``cluster="none"``, jax's detection of SLURM, Open MPI,
    Cloud TPU and Kubernetes Jobs runs (``cluster="auto"``; mpi4py only when named); the
    launcher gives the count and the id, and the coordinator unless one is given
    (``coordinator_address``, ``$EFFIJAX_COORDINATOR``, ``$JAX_COORDINATOR_ADDRESS``;
    ``$JAX_COORDINATOR_PORT`` changes only the launcher's port). Nothing connects.

    Args:
      coordinator_address, num_processes, process_id: explicit settings (see
        :func:`initialize`).
      cluster: one of :data:`CLUSTERS`.
      timeout_s: how long a launcher may wait for its coordinator's host name to resolve
        (Kubernetes, Cloud TPU).

    Raises:
      ConfigError: bad explicit settings (see :func:`process_settings`); a launcher named but not
        found; a partial or inconsistent launcher environment; a ``process_id`` given without
        a count while a launcher numbers the processes.

    Example:
      >>> find_launch().launcher, find_launch().settings  # no launcher variables here
      (None, ProcessSettings(coordinator_address=None, num_processes=1, process_id=0))
      >>> find_launch(cluster="slurm")
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: cluster='slurm': no srun task environment here (missing ...
    """
    if cluster not in CLUSTERS:
        raise ConfigError("cluster", cluster, f"choose one of {', '.join(CLUSTERS)}")
    env = os.environ
    explicit = num_processes is not None or bool(env.get(ENV_NUM_PROCESSES))
    if explicit or cluster == "none":
        settings = _explicit(coordinator_address, num_processes, process_id)
        source = None
        if settings.num_processes > 1:
            source = "flags" if num_processes is not None else "environment"
        return Launch(settings, source)
    names = _AUTO if cluster == "auto" else (cluster,)
    for name in names:
        problem = _partial(name)
        if problem:
            raise ConfigError("cluster", name, f"{problem}; or run it as one process with "
                              "cluster none")
    found = next((n for n in names if _present(n)), None)
    if found is None:
        if cluster != "auto":
            raise ConfigError("cluster", cluster, _absent(cluster))
        return Launch(_explicit(coordinator_address, None, process_id), None)
    if process_id is not None or env.get(ENV_PROCESS_ID):
        raise ConfigError("process_id", process_id if process_id is not None else
                          env.get(ENV_PROCESS_ID), f"{found} numbers the processes; drop it, or "
                          "give num_processes too (then no launcher is asked)")
    address, count, pid = _launcher_settings(found, timeout_s)
    if count == 1:
        return Launch(ProcessSettings(None, 1, 0), found)
    given, field = _coordinator(coordinator_address, True)
    address, field = (given, field) if given is not None else (address, f"{found} coordinator")
    return Launch(ProcessSettings(_normal_address(address, field), count, pid), found,
                  _local_device_ids(found))


def _absent(name: str) -> str:
    if name == "slurm":
        missing = [v for v in _SLURM_VARS if v not in os.environ]
        return (f"no srun task environment here (missing {', '.join(missing) or 'nothing'}): "
                "run the command under srun, or use cluster auto")
    if name == "ompi":
        return (f"no Open MPI 4 task environment here (${_OMPI_URI} is not set): run the "
                "command under mpirun, or use cluster auto")
    if name == "mpi4py":
        return "mpi4py is not installed or finds no MPI launcher"
    if name == "k8s":
        return (f"not a pod of a Kubernetes indexed Job (needs $KUBERNETES_SERVICE_HOST and "
                f"${_K8S_INDEX}, and the 'kubernetes' package)")
    return f"jax's {_DETECTORS[name]} detection finds no Cloud TPU slice here"


def process_settings(coordinator_address: str | None = None,
                     num_processes: int | None = None, process_id: int | None = None, *,
                     cluster: str = "auto") -> ProcessSettings:
    """The run's process settings from the arguments, else the environment, all checked.

    Nothing connects and jax's backend does not start: this is the pre-flight half of
    :func:`initialize` (``find_launch(...).settings``; see :func:`find_launch` for launchers).

    Raises:
      ConfigError: naming the argument or environment variable: a count or id that is not an
        int, ``process_id`` out of range or missing, a malformed address, or an address given
        with one process.

    Example:
      >>> process_settings()
      ProcessSettings(coordinator_address=None, num_processes=1, process_id=0)
      >>> process_settings("127.0.0.1:1234", 2, 1)
      ProcessSettings(coordinator_address='127.0.0.1:1234', num_processes=2, process_id=1)
      >>> process_settings("127.0.0.1", 2, 1)
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: coordinator_address='127.0.0.1': expected host:port, ...
    """
    return find_launch(coordinator_address, num_processes, process_id, cluster=cluster).settings
