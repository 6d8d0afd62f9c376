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

__all__ = [
    "DEFAULT_MAX_BYTES",
    "corpus_fingerprint",
    "load_corpus",
    "split_corpus",
    "stdlib_files",
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
        found += [Path(dirpath, f) for f in filenames if not f.startswith(".")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(_BINARY_PROBE_BYTES)


def _read_capped(files: list[Path], max_bytes: int | None) -> bytes:
    chunks, total = [], 0
    for path in files:
        if max_bytes is not None and total >= max_bytes:
            break
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
    out = b"".join(chunks)
    return out if max_bytes is None else out[:max_bytes]


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
        order of relative paths, skipping ``__pycache__`` and binary files (a NUL byte in the first
        8 KiB). Files are concatenated without separators.
      max_bytes: keep at most this many bytes. ``None`` means :data:`DEFAULT_MAX_BYTES` (8 MiB)
        for the default corpus and no cap for a given ``path``.
      min_bytes: raise if the corpus has fewer bytes (pass ``seq_len + 1`` for training).

    Returns:
      A 1-D ``np.uint8`` array.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: the corpus is empty or shorter than ``min_bytes``, or ``max_bytes`` is not
        positive.

    Example:
      >>> tokens = load_corpus(max_bytes=1000)
      >>> tokens.dtype, tokens.shape
      (dtype('uint8'), (1000,))
    """
    if max_bytes is not None and (isinstance(max_bytes, bool) or max_bytes <= 0):
        raise ValueError(f"max_bytes: expected a positive int or None, got {max_bytes!r}")
    if path is None:
        files = stdlib_files()
        source = f"the standard library at {sysconfig.get_paths()['stdlib']}"
        max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    else:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"corpus path {str(p)!r} does not exist")
        source = repr(str(p))
        if p.is_dir():
            files = [f for f in _folder_files(p) if not _is_binary(f)]
            if not files:
                raise ValueError(f"corpus folder {source} holds no readable text files")
        else:
            files = [p]
    data = _read_capped(files, max_bytes)
    if not data:
        raise ValueError(f"corpus {source} is empty")
    if len(data) < min_bytes:
        raise ValueError(
            f"corpus {source} has {len(data)} bytes, fewer than the {min_bytes} needed "
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

    Example:
      >>> import numpy as np
      >>> train, val = split_corpus(np.arange(100, dtype=np.uint8), 0.1)
      >>> len(train), val[:3].tolist()
      (90, [90, 91, 92])
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction: expected a fraction in (0, 1), got {val_fraction!r}")
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size < 2:
        raise ValueError(f"tokens: expected a 1-D corpus of at least 2 tokens, got {tokens.shape}")
    n_val = min(max(1, round(tokens.size * val_fraction)), tokens.size - 1)
    return tokens[: tokens.size - n_val], tokens[tokens.size - n_val:]
