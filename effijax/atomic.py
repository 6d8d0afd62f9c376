"""Writing files inside a directory effijax owns: whole or not at all, never through a link.

A run directory is read back by people and by effijax itself (a resume, ``generate --from``,
the finished-run check), so a file there must never look complete when it is not: a killed
process, a full disk or Ctrl-C in the middle of a write leaves the old file or none. Each file
is written to a temporary name in the same directory, flushed to the disk (``fsync``) and
renamed over its final name; a directory (a Hugging Face or PEFT export) is written whole under
a temporary name and renamed into place. A symbolic link planted in the directory is never
written through: temporary files are created with ``O_EXCL | O_NOFOLLOW`` (a link left there
is removed, not followed), a rename replaces a link instead of writing its target, and an
append (``metrics.jsonl``, ``error.log``) opens with ``O_NOFOLLOW``.

This module imports nothing of effijax's above floor 0, so ``lora/`` and ``interop/`` use it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["write_bytes", "write_text", "write_with", "append", "open_append", "create",
           "fresh_dir", "replace_dir", "links", "temporary_name"]

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)


def temporary_name(name: str) -> str:
    """The name a file or directory ``name`` is written under before its rename into place.

    Example:
      >>> temporary_name("summary.json")
      '.summary.json.tmp'
    """
    return f".{name}.tmp"


def _tmp(path: Path) -> Path:
    return path.with_name(temporary_name(path.name))


def _remove(path: Path) -> None:
    """Removes a file, a link (never its target) or a directory left at ``path``."""
    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    else:
        shutil.rmtree(path)


def _sync_dir(directory: Path) -> None:
    """Makes a rename inside ``directory`` durable (where the platform allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_bytes(path: str | os.PathLike, data: bytes, *, mode: int = 0o644) -> Path:
    """Writes ``data`` to ``path`` atomically: ``.<name>.tmp`` beside it, fsync, rename.

    A file, or link, left at the temporary name is removed first (never followed). On any
    error (a full disk) the temporary file is removed and the error raised; ``path`` keeps
    what it held.

    Args:
      path: the file; its folder must exist.
      data: the bytes.
      mode: the new file's permissions (before the umask; 0644 like any output file).

    Returns:
      ``path``, as a :class:`~pathlib.Path`.

    Example:
      >>> import os, tempfile, pathlib
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> (d / "elsewhere").write_text("keep")
      4
      >>> os.symlink(d / "elsewhere", d / ".a.txt.tmp")  # a planted link
      >>> write_bytes(d / "a.txt", b"hello").read_bytes(), (d / "elsewhere").read_text()
      (b'hello', 'keep')
    """
    path = Path(path)
    tmp = _tmp(path)
    _remove(tmp)
    fd = os.open(tmp, _FLAGS, mode)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)  # replaces a link at ``path`` itself, never its target
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError) and e.filename is None:  # say which file could not be written
            raise OSError(e.errno, e.strerror, os.fspath(path)) from e
        raise
    _sync_dir(path.parent)
    return path


def write_text(path: str | os.PathLike, text: str, *, mode: int = 0o644) -> Path:
    """:func:`write_bytes` of ``text`` in UTF-8.

    Example:
      >>> import tempfile, pathlib
      >>> write_text(pathlib.Path(tempfile.mkdtemp()) / "a.json", "{}\\n").read_text()
      '{}\\n'
    """
    return write_bytes(path, text.encode("utf-8"), mode=mode)


def write_with(path: str | os.PathLike, fill: Callable[[Path], None]) -> Path:
    """Writes ``path`` atomically with a writer that wants a file name: ``fill(tmp)`` writes
    the new, empty file ``.<name>.tmp`` (created here, never through a link), which is then
    flushed to the disk and renamed over ``path``. On any error the temporary file is removed
    and ``path`` keeps what it held. For files another library writes (a GGUF).

    Example:
      >>> import tempfile, pathlib
      >>> p = pathlib.Path(tempfile.mkdtemp()) / "model.bin"
      >>> write_with(p, lambda tmp: tmp.write_bytes(b"weights")).read_bytes()
      b'weights'
    """
    path = Path(path)
    tmp = _tmp(path)
    _remove(tmp)
    create(tmp)
    try:
        fill(tmp)
        fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _sync_dir(path.parent)
    return path


def append(path: str | os.PathLike, data: bytes) -> None:
    """Appends ``data`` to ``path`` in one ``write``, whole or not at all.

    A write cut short (a full disk) is undone before the error is raised, so the file never
    holds part of ``data``; the error names ``path``. A link at ``path`` is refused (``ELOOP``).

    Example:
      >>> import tempfile, pathlib
      >>> p = pathlib.Path(tempfile.mkdtemp()) / "m.jsonl"
      >>> append(p, b'{"step": 1}\\n'); append(p, b'{"step": 2}\\n')
      >>> p.read_text().count("step")
      2
    """
    fd = os.open(path, _APPEND, 0o644)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            written = os.write(fd, data)
        except OSError as e:
            os.ftruncate(fd, start)
            raise OSError(e.errno, e.strerror, os.fspath(path)) from e
        if written != len(data):
            os.ftruncate(fd, start)
            raise OSError(28, f"{os.strerror(28)} (wrote {written} of {len(data)} bytes)",
                          os.fspath(path))
    finally:
        os.close(fd)


def open_append(path: str | os.PathLike):
    """``path`` opened to append text, never through a link (a log's file object).

    Example:
      >>> import tempfile, pathlib
      >>> p = pathlib.Path(tempfile.mkdtemp()) / "error.log"
      >>> with open_append(p) as f:
      ...     _ = f.write("one line\\n")
      >>> p.read_text()
      'one line\\n'
    """
    return os.fdopen(os.open(path, _APPEND, 0o644), "a")


def create(path: str | os.PathLike) -> Path:
    """A new, empty file at ``path``, never through a link.

    Raises:
      FileExistsError: the name is taken, by a file or by a link (never followed).

    Example:
      >>> import os, tempfile, pathlib
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> create(d / "events").stat().st_size
      0
      >>> os.symlink("/etc/hostname", d / "taken")
      >>> try:
      ...     create(d / "taken")
      ... except FileExistsError:
      ...     print("taken")
      taken
    """
    os.close(os.open(path, _FLAGS, 0o644))
    return Path(path)


def fresh_dir(path: str | os.PathLike) -> Path:
    """An empty directory ``.<name>.tmp`` beside ``path`` to write a directory export into
    (what an earlier, killed export left there is removed); :func:`replace_dir` puts it in
    place."""
    tmp = _tmp(Path(path))
    _remove(tmp)
    tmp.mkdir()
    return tmp


def replace_dir(tmp: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Puts the directory ``tmp`` (from :func:`fresh_dir`) in place of ``path``.

    Its files are flushed to the disk first. What was at ``path`` (an earlier export, or a
    link, never followed) is moved to ``.<name>.old`` and removed after the rename, so
    ``path`` is either absent or complete at every moment.

    Example:
      >>> import tempfile, pathlib
      >>> final = pathlib.Path(tempfile.mkdtemp()) / "hf"
      >>> _ = write_text(fresh_dir(final) / "config.json", "{}")
      >>> sorted(p.name for p in replace_dir(final.with_name(".hf.tmp"), final).iterdir())
      ['config.json']
    """
    tmp, path = Path(tmp), Path(path)
    for f in tmp.rglob("*"):
        if f.is_file() and not f.is_symlink():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _sync_dir(tmp)
    old = path.with_name(f".{path.name}.old")
    _remove(old)
    if path.is_symlink() or path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    _sync_dir(path.parent)
    _remove(old)
    return path


def links(directory: str | os.PathLike, names: Iterable[str]) -> list[str]:
    """The ``names`` in ``directory`` that are symbolic links.

    Example:
      >>> import os, tempfile, pathlib
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> os.symlink("/etc/hostname", d / "loss.png")
      >>> links(d, ["loss.png", "config.json"])
      ['loss.png']
    """
    return [n for n in names if (Path(directory) / n).is_symlink()]

