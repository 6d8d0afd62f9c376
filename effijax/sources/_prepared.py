"""Raw sources that ``effijax train --data`` prepares itself into token stores, in the cache.

A Parquet or Arrow file, a folder holding them, or a ``datasets`` ``save_to_disk`` folder given
to ``--data`` (and any part of a mixture ``a:0.7,b:0.3`` that is not a store) is tokenized by
:func:`effijax.sources.prepare` into a store under :func:`stores_dir` (``~/.cache/effijax/
stores``, or ``$XDG_CACHE_HOME/effijax/stores``), and the run reads that store: memory-mapped,
its hash the run's data identity, exactly as if ``effijax data prepare`` had been run first.

Text files, folders of them and chat ``.jsonl`` files take the same way once they are larger than
:data:`MEMORY_BYTES` together (:func:`in_memory`): prepared as the in-memory reading reads them
(``like_memory``: every file one document, a ``.jsonl`` file records), tokenized in blocks by
worker processes (a file of any size keeps their memory bounded), so that the run's host memory
does not grow with its data. Such a store trains on the batches of the files read in memory, and
the run records the identity the files read in memory have (the manifest's ``content``): a run
resumes whichever way its data is read, and smaller data stays in memory, read at every start.

The store's name is the source's plus a key of everything that would make it another store: the
source's absolute path, the model's tokenizer (and chat template), the format, the text column
and the held-out fraction. So another model, or ``--text-column``, prepares another store beside
it. Once prepared, a stamp records every source file's size and modification time with the store's
hash: a later run whose files are unchanged uses the store at once, without reading the sources
again (start-up does not grow with the corpus); a changed file goes back through ``prepare``, which
hashes the sources: the same content is the same store, other content is tokenized again. A store
changed or damaged in the cache (:func:`effijax.data.verify_store`) is prepared again too.

Preparing takes a lock on the store's name and waits for it (:func:`waiting_lock`): the processes of
a multi-process run on one machine, or two runs, prepare one store once; the others find it done.
A killed prepare (Ctrl-C, a kill) keeps its committed shards, and the next run continues them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from pathlib import Path

from effijax import atomic
from effijax.data import (
    Source,
    check_columns,
    find_sources,
    is_store,
    verify_store,
)
from effijax.errors import ConfigError
from effijax.sources._data import VAL_FRACTION, _tables_in, mixture_spec, resolve_format
from effijax.sources._models import cache_root
from effijax.sources._prepare import prepare

__all__ = ["MEMORY_BYTES", "stores_dir", "needs_preparing", "in_memory", "cached_store",
           "check_sources", "training_data", "waiting_lock"]

#: Text and JSONL data of at most this many bytes (its files together) is read in memory at
#: every start; more is tokenized once into a store in the cache and memory-mapped, so that
#: the host memory of a run does not grow with its data. Both give the same batches.
MEMORY_BYTES = 8 * 2**20


def stores_dir() -> Path:
    """Where ``effijax train`` keeps the stores it prepared from raw sources.

    Example:
      >>> stores_dir().name, stores_dir().parent.name
      ('stores', 'effijax')
    """
    return cache_root() / "stores"


def needs_preparing(path: str) -> bool:
    """Whether ``--data path`` alone is prepared into a store first: it holds Parquet or Arrow
    data (or is a ``datasets`` folder), which is never read as bytes or text.

    Example:
      >>> import pathlib, tempfile
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> _ = (d / "notes.txt").write_text("hi"); _ = (d / "docs.parquet").write_bytes(b"PAR1")
      >>> [needs_preparing(str(p)) for p in (d / "notes.txt", d, d / "no")]
      [False, True, False]
    """
    return not is_store(path) and bool(_tables_in(Path(path)))


def _key(source: Path, tokenizer, fmt: str, text_column: str | None,
         like_memory: bool = False) -> str:
    identity = [str(source.resolve()),
                None if tokenizer is None else tokenizer.fingerprint(chat_template=fmt == "chat"),
                fmt, text_column, VAL_FRACTION]
    if like_memory:  # appended, so that the stores of tables keep their names
        identity.append("like_memory")
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:12]


def _sources(source: Path, fmt: str | None) -> list[Source]:
    """The files of ``source``: read as their suffixes say (None), or as ``--data`` reads
    text or chat files in memory (``fmt``, see :func:`effijax.sources.prepare`'s
    ``like_memory``)."""
    if fmt is None:
        return find_sources(source)
    return find_sources(source, kind="jsonl" if fmt == "chat" else "text")


def _stamp(sources: list[Source]) -> list:
    """Every file of ``sources`` with its size and modification time (nanoseconds)."""
    return [[str(s.path), s.size, s.path.stat().st_mtime_ns] for s in sources]


def _stamped(store: Path, stamp_file: Path, stamp: list) -> bool:
    """Whether ``store`` is the one prepared from files with exactly ``stamp``, and still
    holds what was prepared (:func:`effijax.data.verify_store`; a damaged one is prepared
    again)."""
    try:
        recorded = json.loads(stamp_file.read_text())
        return (is_store(store) and recorded["files"] == stamp
                and recorded["sha256"] == verify_store(store).sha256)
    except (OSError, ValueError, KeyError, TypeError):  # FileError is a ValueError
        return False


@contextlib.contextmanager
def waiting_lock(path: Path, *, print_fn=None):
    """Holds an exclusive lock on ``path`` (created if missing) for the block, waiting for
    another process (or thread) that holds it. ``print_fn`` hears once that it waits.

    Example:
      >>> import pathlib, tempfile
      >>> lock = pathlib.Path(tempfile.mkdtemp()) / "x.lock"
      >>> with waiting_lock(lock):
      ...     lock.exists()
      True
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if print_fn is not None:
                print_fn(f"waiting for another process preparing {path.with_suffix('')}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases its lock


def cached_store(source: str | os.PathLike, tokenizer, *, chat_template: str | None = None,
                 data_format: str = "auto", text_column: str = "text",
                 processes: int | None = None, folder: str | os.PathLike | None = None,
                 like_memory: bool = False, print_fn=None) -> Path:
    """The store in ``folder`` (default: :func:`stores_dir`) that holds ``source`` tokenized
    by ``tokenizer``, prepared now unless it was from these very files (see the module
    docstring).

    Args:
      source: a file or folder :func:`effijax.sources.prepare` reads.
      tokenizer: the run's model's tokenizer (None: bytes, for the byte GPT), its chat template
        applied when ``chat_template`` is given.
      chat_template: the ``--chat-template`` file the model's tokenizer renders chat with.
      data_format, text_column: as for :func:`effijax.sources.prepare`.
      processes: tokenizing processes (default: every core).
      folder: where the stores lie (default: :func:`stores_dir`).
      like_memory: prepare text or JSONL files as training reads them in memory, under their
        identity (:func:`effijax.sources.prepare`'s ``like_memory``): another store than the
        one of the same files read by their suffixes.
      print_fn: progress lines (None: quiet).

    Raises:
      ConfigError: as :func:`effijax.sources.prepare` (a missing column names the file, the
        columns it has and ``--text-column``).

    Example:
      >>> import pathlib, tempfile
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> _ = (d / "a.txt").write_text("hello world " * 20)
      >>> store = cached_store(d / "a.txt", None, folder=d / "stores")
      >>> store.name.startswith("a-"), cached_store(d / "a.txt", None, folder=d / "stores") == store
      (True, True)
    """
    source = Path(source)
    say = print_fn or (lambda line: None)
    folder = stores_dir() if folder is None else Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError("data", str(source), f"is prepared into a token store in {folder}, "
                          f"which cannot be created ({e.strerror}); set XDG_CACHE_HOME to a "
                          "writable folder, or prepare it yourself: effijax data prepare "
                          f"{source} --out STORE --from MODEL") from None
    # Chat or text, from the columns (a second; before any file is read whole). A template
    # renders chat only: a text run's --chat-template is for its --chat generation.
    kind = resolve_format(str(source), data_format) if like_memory else None
    fmt = check_columns(_sources(source, kind), kind or data_format, text_column)
    chat_template = chat_template if fmt == "chat" else None
    name = source.resolve().name.split(".")[0] or "data"
    column = None if like_memory else text_column
    store = folder / f"{name}-{_key(source, tokenizer, fmt, column, like_memory)}.store"
    stamp_file = store.with_name(store.name + ".files.json")
    if _stamped(store, stamp_file, _stamp(_sources(source, kind))):
        say(f"{source}: its files are unchanged since {store} was prepared from them")
        return store
    with waiting_lock(store.with_name(store.name + ".lock"), print_fn=say):
        # after the wait: another process may have prepared it
        stamp = _stamp(_sources(source, kind))
        if _stamped(store, stamp_file, stamp):
            return store
        started = time.monotonic()
        say(f"preparing {source} into {store} (once; later runs on the same files reuse it)")
        manifest = prepare(source, store, tokenizer=tokenizer, chat_template=chat_template,
                           data_format=data_format, text_column=text_column,
                           val_fraction=VAL_FRACTION, processes=processes,
                           like_memory=like_memory, print_fn=say)
        atomic.write_text(stamp_file, json.dumps({"files": stamp,
                                                  "sha256": manifest["sha256"]}))
        say(f"prepared {manifest['tokens']:,} tokens in {time.monotonic() - started:.1f} s; "
            f"sha256 {manifest['sha256'][:16]}..")
    return store


def _raw_parts(data: str | None) -> list[str]:
    """The paths of ``--data`` that a run prepares into stores."""
    if data is None:
        return []
    parts = mixture_spec(data)
    if parts is None:
        return [data] if needs_preparing(data) else []
    return [path for path, _ in parts if not is_store(path)]


def check_sources(data: str | None, data_format: str = "auto", text_column: str = "text") -> None:
    """The columns of every source ``--data`` prepares (:func:`training_data`), read from
    their schemas alone: a missing ``--text-column`` is refused before processes join, a
    model is read or anything is tokenized.

    Raises:
      ConfigError: a table without the column (its file, the columns it has, the flag to use).

    Example:
      >>> check_sources("notes.txt"), check_sources(None)
      (None, None)
    """
    for path in _raw_parts(data):
        check_columns(find_sources(path), data_format, text_column)


def in_memory(data: str | None, tokenizer, data_format: str = "auto", *,
              memory_bytes: int | None = None) -> bool:
    """Whether ``--data data`` is read in memory (:func:`effijax.sources.load_dataset`) rather
    than from a store prepared in the cache: the standard library (None), a store, a mixture,
    Parquet / Arrow data (:func:`needs_preparing`), anything the in-memory reading refuses (it
    says why), and text or JSONL files of at most ``memory_bytes`` together (None:
    :data:`MEMORY_BYTES`).

    Example:
      >>> import pathlib, tempfile
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> _ = (d / "notes.txt").write_text("hello " * 100)
      >>> in_memory(str(d), None), in_memory(str(d), None, memory_bytes=500), in_memory(None, None)
      (True, False, True)
    """
    if data is None or is_store(data) or mixture_spec(data) is not None or needs_preparing(data):
        return True
    try:
        fmt = resolve_format(data, data_format)
        if fmt == "chat" and (Path(data).is_dir() or getattr(tokenizer, "chat_template",
                                                               None) is None):
            return True  # refused by load_dataset, in its words
        size = sum(s.size for s in _sources(Path(data), fmt))
    except ConfigError:
        return True  # a missing path, an empty folder: said by load_dataset
    return size <= (MEMORY_BYTES if memory_bytes is None else memory_bytes)


def training_data(data: str | None, tokenizer, *, chat_template: str | None = None,
                  data_format: str = "auto", text_column: str = "text",
                  memory_bytes: int | None = None, print_fn=None) -> str | None:
    """``--data`` as the run reads it: a raw Parquet / Arrow / ``datasets`` source replaced by
    its :func:`cached_store`, and every part of a mixture that is not a store too; text or
    JSONL files of more than ``memory_bytes`` together (None: :data:`MEMORY_BYTES`,
    :func:`in_memory`) by the store of them read as in memory (``like_memory``: the same
    batches, the same identity); anything else unchanged.

    Example:
      >>> training_data("notes.txt", None), training_data(None, None)
      ('notes.txt', None)
    """
    def store_of(path: str, like_memory: bool = False) -> str:
        return str(cached_store(path, tokenizer, chat_template=chat_template,
                                data_format=data_format, text_column=text_column,
                                like_memory=like_memory, print_fn=print_fn))

    raw = _raw_parts(data)
    if not raw:
        if in_memory(data, tokenizer, data_format, memory_bytes=memory_bytes):
            return data
        return store_of(data, like_memory=True)
    parts = mixture_spec(data)
    if parts is None:
        return store_of(data)
    return ",".join(f"{store_of(path) if path in raw else path}:{weight!r}"
                    for path, weight in parts)
