"""Offline byte corpora: the local Python standard library by default, or any text file/folder.

Tokens are bytes (``uint8``, vocabulary 256), so no tokenizer and no download is needed. The
default corpus is the ``.py`` files of the running interpreter's standard library, read in sorted
order of their relative paths and concatenated, capped at :data:`DEFAULT_MAX_BYTES`: the same
Python version always yields the same bytes, and :func:`corpus_fingerprint` records which bytes a
run trained on. The tail of the corpus is the validation split (:func:`split_corpus`).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np

from effijax.data._files import is_regular_file, regular_path
from effijax.errors import ConfigError, whole_number

__all__ = [
    "DEFAULT_MAX_BYTES",
    "corpus_fingerprint",
    "document_files",
    "load_corpus",
    "load_documents",
    "split_corpus",
    "stdlib_files",
    "val_count",
]

# Cap of the default (standard library) corpus: 8 MiB, plenty for the CPU-sized models.
DEFAULT_MAX_BYTES = 8 * 2**20

# Standard-library folders left out of the default corpus: installed packages, test suites and
# demo/tool code that is unlike ordinary library code (or huge generated tables).
_STDLIB_SKIP_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "lib2to3",
    "turtledemo", "__pycache__", "ensurepip", "encodings",
})

_BINARY_PROBE_BYTES = 8192


def _skipped_dir(name: str) -> bool:
    return name in _STDLIB_SKIP_DIRS or name.startswith("config-") or name.startswith(".")


def stdlib_files(root: str | os.PathLike | None = None) -> list[Path]:
    """The default corpus' files: the standard library's ``.py`` files in sorted relative order.

    Folders such as ``site-packages``, ``test``, ``idlelib``, ``lib2to3`` and ``encodings`` are
    skipped (see ``_STDLIB_SKIP_DIRS``).

    Example:
      >>> files = stdlib_files()
      >>> files == sorted(files), all(f.suffix == ".py" for f in files)
      (True, True)
    """
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not _skipped_dir(d)]
        found += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _folder_files(root: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        # Pipes, sockets and devices in a folder are skipped: reading one may never end.
        found += [Path(dirpath, f) for f in filenames
                  if not f.startswith(".") and is_regular_file(Path(dirpath, f))]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(_BINARY_PROBE_BYTES)


def _read_capped(files: list[Path], max_bytes: int | None) -> list[bytes]:
    """The files' contents in order, the last one cut so that the total is at most
    ``max_bytes``."""
    chunks, total = [], 0
    for path in files:
        if max_bytes is not None and total >= max_bytes:
            break
        data = path.read_bytes()
        if max_bytes is not None:
            data = data[: max_bytes - total]
        chunks.append(data)
        total += len(data)
    return chunks


def load_documents(
    path: str | os.PathLike | None = None,
    *,
    max_bytes: int | None = None,
) -> list[bytes]:
    """The corpus' documents: one ``bytes`` per file, in the order :func:`load_corpus` reads
    them (which is ``b"".join(load_documents(...))``).

    Args:
      path, max_bytes: as in :func:`load_corpus` (the cap cuts the last document).

    Raises:
      ConfigError: as :func:`load_corpus` (``field="path"`` or ``"max_bytes"``).

    Example:
      >>> docs = load_documents(max_bytes=1000)
      >>> sum(map(len, docs)), all(isinstance(d, bytes) for d in docs)
      (1000, True)
    """
    try:
        whole_number("max_bytes", max_bytes, maximum=None, none=True)
    except ConfigError as e:
        raise ConfigError("max_bytes", max_bytes, f"{e.problem}: None reads 8 MiB of the "
                          "standard library, or the whole of a given path") from None
    if path is None and max_bytes is None:
        max_bytes = DEFAULT_MAX_BYTES
    return _read_capped(document_files(path), max_bytes)


def document_files(path: str | os.PathLike | None = None) -> list[Path]:
    """The files :func:`load_documents` reads, in its order: one document each.

    Example:
      >>> document_files("/nonexistent")
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: path='/nonexistent': does not exist; pass a text file, a \
folder of text files, or None for the standard library
    """
    if path is None:
        return stdlib_files()
    p = regular_path(path, "path")
    if not p.exists():
        raise ConfigError("path", str(p), "does not exist; pass a text file, a folder of "
                          "text files, or None for the standard library")
    if p.is_dir():
        files = [f for f in _folder_files(p) if not _is_binary(f)]
        if not files:
            raise ConfigError("path", str(p), "the folder holds no readable text files "
                              "(binary, hidden and __pycache__ files are skipped)")
        return files
    return [p]


def load_corpus(
    path: str | os.PathLike | None = None,
    *,
    max_bytes: int | None = None,
    min_bytes: int = 2,
) -> np.ndarray:
    """Loads a byte corpus as a ``uint8`` array of token ids.

    Args:
      path: ``None`` for the standard library's ``.py`` files (:func:`stdlib_files`); a file
        (read whole); or a folder, of which every non-hidden file is read recursively in sorted
        order of relative paths, skipping ``__pycache__``, binary files (a NUL byte in the first
        8 KiB) and whatever is not a regular file (pipes, sockets, devices). Files are
        concatenated without separators.
      max_bytes: keep at most this many bytes. ``None`` means :data:`DEFAULT_MAX_BYTES` (8 MiB)
        for the default corpus and no cap for a given ``path``.
      min_bytes: raise if the corpus has fewer bytes (pass ``seq_len + 1`` for training).

    Returns:
      A 1-D ``np.uint8`` array.

    Raises:
      ConfigError: with ``field="path"``: the path does not exist or is a pipe or a device
        (:func:`~effijax.data.regular_path`), a folder holds no text file,
        the corpus is empty or shorter than ``min_bytes``; with ``field="max_bytes"``: it is not
        a positive int or None.

    Example:
      >>> tokens = load_corpus(max_bytes=1000)
      >>> tokens.dtype, tokens.shape
      (dtype('uint8'), (1000,))
    """
    data = b"".join(load_documents(path, max_bytes=max_bytes))
    source = ("the corpus" if path is not None
              else f"the standard library at {sysconfig.get_paths()['stdlib']}")
    shown = None if path is None else str(path)
    if not data:
        raise ConfigError("path", shown, f"{source} is empty")
    if len(data) < min_bytes:
        raise ConfigError(
            "path", shown, f"{source} has {len(data)} bytes, fewer than the {min_bytes} needed "
            "(a training window is seq_len + 1 bytes); use a bigger corpus or a shorter seq_len"
        )
    return np.frombuffer(data, dtype=np.uint8).copy()


def corpus_fingerprint(tokens: np.ndarray) -> str:
    """A short, stable identifier of a corpus' content: ``"<n bytes>:<sha256 prefix>"``.

    Example:
      >>> import numpy as np
      >>> corpus_fingerprint(np.frombuffer(b"hello", np.uint8))
      '5:2cf24dba5fb0a30e'
    """
    tokens = np.ascontiguousarray(tokens, dtype=np.uint8)
    return f"{tokens.size}:{hashlib.sha256(tokens.tobytes()).hexdigest()[:16]}"


def split_corpus(tokens: np.ndarray, val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Splits a corpus into ``(train, val)``; the last ``val_fraction`` of it is validation.

    Raises:
      ConfigError: ``val_fraction`` is not in (0, 1), or ``tokens`` is not a 1-D corpus of at
        least 2 tokens (the error's value is then its shape).

    Example:
      >>> import numpy as np
      >>> train, val = split_corpus(np.arange(100, dtype=np.uint8), 0.1)
      >>> len(train), val[:3].tolist()
      (90, [90, 91, 92])
      >>> split_corpus(np.arange(100, dtype=np.uint8), 5)
      Traceback (most recent call last):
      effijax.errors.ConfigError: val_fraction=5: expected a fraction in (0, 1), e.g. 0.05
    """
    if (isinstance(val_fraction, bool) or not isinstance(val_fraction, int | float | np.floating)
            or not 0.0 < val_fraction < 1.0):
        raise ConfigError("val_fraction", val_fraction, "expected a fraction in (0, 1), e.g. 0.05")
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size < 2:
        # The shape stands for the value: the repr of a whole corpus would drown the message.
        raise ConfigError("tokens", tokens.shape, "expected a 1-D corpus of at least 2 tokens")
    n_val = val_count(tokens.size, val_fraction)
    return tokens[: tokens.size - n_val], tokens[tokens.size - n_val:]


def val_count(n: int, val_fraction: float) -> int:
    """How many of ``n`` items (tokens, records) are held out for validation: ``round(n *
    val_fraction)``, at least 1 and at most ``n - 1``.

    Example:
      >>> val_count(100, 0.05), val_count(3, 0.05), val_count(2, 0.9)
      (5, 1, 1)
    """
    return min(max(1, round(n * val_fraction)), n - 1)
