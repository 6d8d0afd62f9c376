"""An exclusive lock on a run directory for a run's lifetime.

Two runs writing one directory interleave ``metrics.jsonl`` and delete each other's
checkpoints (each keeps only its newest N). :func:`lock_run_dir` takes ``fcntl.flock`` on
``<dir>/.effijax.lock``: the kernel holds the lock for the open file, so it is released when
the process ends, however it ends (a SIGKILLed run never leaves a stale lock). The file holds
the holder's host, pid and start time, so a refused run can name it. ``flock`` works on local
file systems and, on Linux, on NFS (where it is emulated with POSIX locks).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path

from effijax.errors import ConfigError

__all__ = ["RunLock", "lock_run_dir", "lock_holder", "LOCK_FILE"]

LOCK_FILE = ".effijax.lock"


class RunLock:
    """A held lock on a run directory; :meth:`release` (or the process' end) frees it."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Unlocks and closes the file (idempotent). The file stays: removing it would let a
        third run lock a new file while a second one waits on the old."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_holder(directory: str | os.PathLike) -> str:
    """Who holds (or last held) ``directory``'s lock, as "host H, pid P, since T"."""
    try:
        info = json.loads((Path(directory) / LOCK_FILE).read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or not info:
        return "an unknown process"
    return (f"host {info.get('host', '?')}, pid {info.get('pid', '?')}, since "
            f"{info.get('started', '?')}")


def lock_run_dir(directory: str | os.PathLike, field: str = "out") -> RunLock:
    """Takes the exclusive lock on ``directory`` (created if missing), without waiting.

    Args:
      directory: the run directory.
      field: the setting reported in the error (the CLI shows its flag).

    Returns:
      A :class:`RunLock`; hold it for the run's lifetime.

    Raises:
      ConfigError: another process holds the lock (naming its host, pid and start time), or
        the lock file cannot be created.

    Example:
      >>> import tempfile
      >>> d = tempfile.mkdtemp()
      >>> with lock_run_dir(d):
      ...     lock_run_dir(d)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: out=...: another run is writing this directory (host ...
      >>> lock_run_dir(d).held  # released on leaving the block
      True
    """
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # Never through a link: the holder's details are written into the file, and a link
        # planted there would have them overwrite a file outside the run directory.
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if (directory / LOCK_FILE).is_symlink():
            raise ConfigError(field, str(directory), f"its lock file {LOCK_FILE} is a symbolic "
                              f"link (to {os.readlink(directory / LOCK_FILE)}); effijax never "
                              "writes through links in a run directory: remove it") from None
        raise ConfigError(field, str(directory), f"cannot create its lock file "
                          f"({e.strerror}); choose a writable directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(field, str(directory), f"another run is writing this directory "
                          f"({lock_holder(directory)}); wait for it to end, stop it, or choose "
                          "another directory") from None
    except OSError as e:
        os.close(fd)
        raise ConfigError(field, str(directory), f"cannot lock it ({e.strerror})") from None
    info = {"host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    return RunLock(directory / LOCK_FILE, fd)
