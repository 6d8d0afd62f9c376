"""What effijax agrees to read as data or settings: regular files and folders, in bounded lines.

A FIFO, a socket or a device (``/dev/zero``) given as ``--data`` or ``--config`` would be read
for ever or block; :func:`regular_path` refuses them before anything is opened. A JSONL record
is one line of at most :data:`MAX_RECORD_BYTES` (:func:`bounded_lines`), so one forged line
cannot take the memory of the machine: its rendering and tokenization cost many times its size.
A JSON settings file (a model's ``config.json``, its tokenizer files) is read whole only when it
is a regular file of bounded size (:func:`read_json`); what is wrong with it is one
:class:`~effijax.errors.FileError` naming the file and where.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from effijax.errors import ConfigError, FileError

__all__ = ["MAX_RECORD_BYTES", "MAX_JSON_BYTES", "regular_path", "bounded_lines", "parse_objects",
           "regular_size", "read_json"]

#: The largest JSON file read whole (a tokenizer.json is tens of MB at most).
MAX_JSON_BYTES = 256 * 2**20

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


def parse_objects(path: str | os.PathLike, parse, what: str, expected: str,
                  field: str = "data") -> list:
    """Each non-blank line of a JSONL file (:func:`bounded_lines`), a JSON object, as
    ``parse(obj, "file:line", line)`` makes it, in order.

    Raises:
      ConfigError: ``field`` with ``"file:line"``: a line :func:`bounded_lines` refuses, one
        that is not a JSON object (the error ends ``expected``: what a line should hold), or
        what ``parse`` raises; with the path, a file with no record (``what``: e.g. ``"pair"``).

    Example:
      >>> import pathlib, tempfile
      >>> f = pathlib.Path(tempfile.mkdtemp()) / "a.jsonl"
      >>> _ = f.write_text('{"a": 1}\\n\\n{"a": 2}\\n[3]\\n')
      >>> parse_objects(f, lambda obj, where, line: obj["a"], "number", '{"a": 1}')
      Traceback (most recent call last):
      effijax.errors.ConfigError: data='...a.jsonl:4': a JSON list, not an object; expected \
one JSON object per line: {"a": 1}
    """
    def one(line: str, source: str):
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            obj = None
            problem = "not valid JSON"
        else:
            problem = None if isinstance(obj, dict) else \
                f"a JSON {type(obj).__name__}, not an object"
        if problem is not None:
            raise ConfigError(field, source, f"{problem}; expected one JSON object per line: "
                              f"{expected}")
        return parse(obj, source, line)

    records = [one(line, f"{path}:{number}") for number, line in bounded_lines(path, field)
               if line.strip()]
    if not records:
        raise ConfigError(field, str(path), f"holds no {what} (one JSON object per line)")
    return records


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


def regular_size(path: str | os.PathLike) -> int:
    """The size of ``path``, which must be a regular file (a FIFO or a device never ends).

    Example:
      >>> regular_size("/dev/zero")
      Traceback (most recent call last):
      ...
      effijax.errors.FileError: /dev/zero: file: is not a regular file (a FIFO, device or directory)
    """
    try:
        st = os.stat(path)
    except OSError as e:
        raise FileError(path, "file", f"cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise FileError(path, "file", "is not a regular file (a FIFO, device or directory)")
    return st.st_size


def read_json(path: str | os.PathLike, *, limit: int = MAX_JSON_BYTES) -> dict:
    """A JSON object from a regular file of at most ``limit`` bytes.

    Example:
      >>> import tempfile, os
      >>> path = os.path.join(tempfile.mkdtemp(), "config.json")
      >>> with open(path, "w") as f:
      ...     _ = f.write('[1, 2]')
      >>> read_json(path)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      effijax.errors.FileError: .../config.json: top level: is a list; expected a JSON object
    """
    size = regular_size(path)
    if size > limit:
        raise FileError(path, "file", f"is {size:,} bytes; expected at most {limit:,}")
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read().decode("utf-8"))
    except OSError as e:
        raise FileError(path, "file", f"cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise FileError(path, f"byte {e.start:,}", "is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise FileError(path, f"line {e.lineno} column {e.colno}", f"not JSON ({e.msg})") \
            from None
    except RecursionError:
        raise FileError(path, "file", "nests too deep to be a JSON configuration") from None
    if not isinstance(value, dict):
        raise FileError(path, "top level", f"is a {type(value).__name__}; expected a JSON "
                        "object")
    return value
