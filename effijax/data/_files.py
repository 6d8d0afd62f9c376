"""What effijax agrees to read as data or settings: regular files and folders, in bounded lines.

A FIFO, a socket or a device (``/dev/zero``) given as ``--data`` or ``--config`` would be read
for ever or block; :func:`regular_path` refuses them before anything is opened. A JSONL record
is one line of at most :data:`MAX_RECORD_BYTES` (:func:`bounded_lines`), so one forged line
cannot take the memory of the machine: its rendering and tokenization cost many times its size.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

from effijax.errors import ConfigError

__all__ = ["MAX_RECORD_BYTES", "regular_path", "bounded_lines"]

# 4 MiB: about a million tokens, far beyond any sequence effijax trains (longer examples are
# cut to one row anyway). A line over it is refused, naming its number.
MAX_RECORD_BYTES = 4 * 2**20

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def regular_path(path: str | os.PathLike, field: str) -> Path:
    """``path`` when it is a regular file, a folder or nothing yet (the caller says what is
    missing); a pipe, socket or device is refused before it is opened.

    Example:
      >>> regular_path("/dev/zero", "data")
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: data='/dev/zero': is a character device; effijax reads \
regular files and folders only (a pipe or device may never end)
    """
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return path  # missing or unreadable: the reader names it
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise ConfigError(field, str(path), f"is {_kind(mode)}; effijax reads regular files "
                          "and folders only (a pipe or device may never end)")
    return path


def is_regular_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a regular file (following links): folders' entries that are not
    (pipes, sockets, devices) are skipped when a folder is read."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def bounded_lines(path: str | os.PathLike, field: str, *,
                  limit: int | None = None) -> Iterator[tuple[int, str]]:
    """``(number, line)`` of a UTF-8 text file, each line at most ``limit`` bytes
    (:data:`MAX_RECORD_BYTES` by default).

    Raises:
      ConfigError: ``field`` with ``"file:line"``: a line is longer, or is not UTF-8.

    Example:
      >>> import pathlib, tempfile
      >>> f = pathlib.Path(tempfile.mkdtemp()) / "a.jsonl"
      >>> _ = f.write_bytes(b"ab\\n" + b"x" * 9 + b"\\n")
      >>> list(bounded_lines(f, "data", limit=8))  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      effijax.errors.ConfigError: data='.../a.jsonl:2': longer than 8 bytes; ...
    """
    limit = MAX_RECORD_BYTES if limit is None else limit
    path = regular_path(path, field)
    with open(path, "rb") as f:
        number = 0
        while line := f.readline(limit + 1):
            number += 1
            if len(line) > limit and not (len(line) == limit + 1 and line.endswith(b"\n")):
                raise ConfigError(field, f"{path}:{number}", f"longer than {limit:,} bytes; "
                                  "one record (line) may not be longer: shorten or split it")
            try:
                yield number, line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(field, f"{path}:{number}", f"not UTF-8 (byte {e.start + 1} of "
                                  "the line); save the file as UTF-8") from None
