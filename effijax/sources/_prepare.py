"""``effijax data prepare``: a source tokenized once into a store (:mod:`effijax.data._store`).

The source (a text file, JSONL, Parquet, Arrow, a folder of them, a ``datasets``
``save_to_disk`` folder) is checked first (its columns, :func:`effijax.data.check_columns`),
then cut into pieces (:func:`effijax.data.plan_pieces`) of :func:`default_shard_bytes` (up to
8 MiB; less for a small source, so that every core gets several) that a pool of processes
tokenizes, each committing its shard whole beside the store
(``.<store>.prepare/``). A killed prepare keeps its committed shards: the same command
continues where it stopped. The plan (the sources' hashes, the tokenizer, the settings, the
pieces) names the shards, so a changed source or tokenizer starts over. The shards are then
joined in order into the store (:func:`effijax.data.assemble`): the same input gives the same
bytes and hash, however many processes tokenized it.

Text is tokenized as training tokenizes it in memory (:func:`effijax.data.encode_each`: each
document followed by the end-of-text token; a model without a tokenizer keeps the raw bytes),
and chat records are rendered and masked with the model's chat template, or a
``--chat-template`` file's (:func:`effijax.data.render_chat`; the manifest records the file's
sha256), so a store trains on the same tokens as the files it came from. The worker processes
get plain values only (the tokenizer's fields, paths, ranges).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from effijax.data import (
    Source,
    assemble,
    check_columns,
    commit_documents,
    commit_shard,
    committed_shard,
    content_fingerprint,
    cuts_lines,
    encode_each,
    encode_file,
    find_sources,
    is_store,
    line_pieces,
    open_store,
    plan_pieces,
    read_piece,
    remove_work,
    token_dtype,
    verify_store,
)
from effijax.errors import ConfigError, FileError, whole_number
from effijax.sources._data import _chat_examples, resolve_format, template_digest
from effijax.sources._models import (
    BUNDLED,
    bundled_path,
    check_template_file,
    missing_source,
    tokenizer_with_template,
)

__all__ = ["MIN_SHARD_BYTES", "SHARD_BYTES", "SHARDS_WANTED", "default_shard_bytes", "prepare",
           "prepare_tokenizer", "work_dir"]

#: The most source bytes one shard covers: big enough that a process' start is amortised, small
#: enough that a killed prepare loses little and a worker's memory stays small.
SHARD_BYTES = 8 * 2**20
#: The fewest: a small source is cut into about :data:`SHARDS_WANTED` shards of at least this.
MIN_SHARD_BYTES = 256 * 2**10
#: Shards a source smaller than ``SHARDS_WANTED x SHARD_BYTES`` is cut into, so that a few
#: megabytes still keep every core busy to the end (an 8 MiB Parquet file was 2 shards: 2
#: processes took 15.8 s against one's 23.5 s, 1.49x; in 33 shards, 1.74x of one's tokenizing).
SHARDS_WANTED = 32


def default_shard_bytes(source_bytes: int) -> int:
    """The source bytes per shard for ``source_bytes`` in all: :data:`SHARD_BYTES` for a large
    source, about 1/:data:`SHARDS_WANTED` of a small one, never under :data:`MIN_SHARD_BYTES`.
    It depends on the source alone, not on the processes, so a killed prepare continues its
    shards under another ``processes``; the store's bytes do not depend on it at all.

    Example:
      >>> default_shard_bytes(10 * 2**30) == SHARD_BYTES, default_shard_bytes(8 * 2**20)
      (True, 262144)
    """
    return int(min(SHARD_BYTES, max(MIN_SHARD_BYTES, source_bytes // SHARDS_WANTED)))

_worker_tokenizer: Any = None


def work_dir(out: str | os.PathLike) -> Path:
    """Where a prepare keeps its committed shards until the store is assembled.

    Example:
      >>> work_dir("data/docs.store").as_posix()
      'data/.docs.store.prepare'
    """
    out = Path(out)
    return out.with_name(f".{out.name}.prepare")


def prepare_tokenizer(model_from: str | None):
    """The tokenizer of the model ``model_from`` names (a bundled name, a ``.gguf`` file, a
    Hugging Face folder), as training from it tokenizes; None (bytes) for None.

    Raises:
      ConfigError: no such model, or it has no tokenizer effijax reads.

    Example:
      >>> prepare_tokenizer(None) is None
      True
    """
    if model_from is None:
        return None
    from effijax.interop import load_tokenizer

    path = bundled_path(model_from) if model_from in BUNDLED else model_from
    if not Path(path).exists():
        raise missing_source("from", model_from)
    try:
        return load_tokenizer(path)
    except ConfigError as e:
        raise e.within("from", model_from) from None


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            digest.update(chunk)
    return digest.hexdigest()


class _TextTokenizer(NamedTuple):
    """What :func:`effijax.data.encode_file` reads of a tokenizer: a text worker builds only
    this (the ``tokenizers`` backend), not the model package, which imports JAX (seconds).
    ``splits``: whether the tokenizer takes a long text in pieces cut at line ends
    (:func:`effijax.data.cuts_lines`, decided by the model's tokenizer in the prepare's
    process)."""

    backend: Any
    eos_id: int | None
    bos_id: int | None
    add_bos: bool
    splits: bool = False

    def pieces(self, text: str, size: int) -> list[str]:
        """As :meth:`effijax.models.Tokenizer.pieces`."""
        return line_pieces(text, size) if self.splits else [text]


def _exit_with(parent: int) -> None:
    """Ends this worker with ``parent`` (the prepare's process): the pool's queues hold both
    ends of their pipes in every worker, so an orphan would wait on them for ever. On Linux the
    kernel kills it as the parent ends (before it could write a result into a broken pipe and
    print the traceback); elsewhere a thread looks five times a second."""
    if sys.platform == "linux":
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it ended before the line above
        os._exit(1)

    def watch():
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _init_worker(fields: dict | None, chat: bool, parent: int | None = None) -> None:
    """Each worker builds the tokenizer once, and runs it on one thread (the pool is the
    parallelism: threads of their own would fight over the same cores). In a pool (``parent``
    given) it leaves Ctrl-C to the prepare's process, which stops the pool, and it ends when
    that process ends (killed, or the ``effijax`` program's exit on Ctrl-C)."""
    global _worker_tokenizer
    if parent is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _exit_with(parent)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        _worker_tokenizer = _build_tokenizer(fields, chat)
    except Exception as e:  # noqa: BLE001 (a pool respawns a worker whose initializer raises,
        # for ever): the failure is each task's answer instead, raised by the prepare
        _worker_tokenizer = _Failed(f"{type(e).__name__}: {e}")


class _Failed(NamedTuple):
    """A worker whose tokenizer could not be built: what went wrong."""

    reason: str


def _build_tokenizer(fields: dict | None, chat: bool):
    if fields is None:
        return None
    if chat:  # rendering needs the whole Tokenizer (its chat template)
        from effijax.models import Tokenizer

        return Tokenizer(**fields)
    from tokenizers import Tokenizer as Backend

    return _TextTokenizer(Backend.from_str(fields["spec"]), fields["eos_id"], fields["bos_id"],
                          fields["add_bos"], fields.get("splits", False))


def _tokenize(task: dict) -> dict:
    """Tokenizes one shard's pieces and commits it; returns ``{"index", "tokens"}`` or, for a
    bad record, ``{"error": [kind, ...]}`` (exceptions are passed back as plain values)."""
    if isinstance(_worker_tokenizer, _Failed):
        return {"error": ["config", "from", "(the model's tokenizer)", "could not be built "
                          f"in a tokenizing process ({_worker_tokenizer.reason}); effijax data "
                          "prepare --processes 1 tokenizes in its own process"]}
    try:
        dtype, tok = np.dtype(task["dtype"]), _worker_tokenizer
        if task["data_format"] == "chat":
            items = []
            for path, name, kind, size, start, stop in task["pieces"]:
                items += read_piece(Source(Path(path), name, kind, size), start, stop, "chat")
            examples = _chat_examples(tok, items)
            ids = [e[0] for e in examples]
            masks = [e[1] for e in examples]
            keys = b"".join(hashlib.sha256(r.raw.encode("utf-8")).digest() for r in items)
            trained = [int(np.count_nonzero(m[1:])) for m in masks]
            commit_shard(Path(task["work"]), task["index"], task["plan"], _join(ids, dtype),
                         [len(i) for i in ids], _join(masks, np.uint8), keys, trained)
            tokens = int(sum(len(i) for i in ids))
        else:
            tokens = commit_documents(Path(task["work"]), task["index"], task["plan"],
                                      _documents(task, tok), dtype)
    except FileError as e:
        return {"error": ["file", e.path, e.where, e.problem]}
    except ConfigError as e:
        return {"error": ["config", e.field, str(e.value), e.problem]}
    return {"index": task["index"], "tokens": tokens}


def _documents(task: dict, tok):
    """The documents of a text shard, each as the consecutive arrays of its ids: a text file
    read and tokenized a block at a time (:func:`effijax.data.encode_file`), so that a file of
    any size keeps the worker's memory bounded; a JSONL or table piece's documents whole."""
    for path, name, kind, size, start, stop in task["pieces"]:
        source = Source(Path(path), name, kind, size)
        if kind == "text":
            yield encode_file(tok, source.path)
            continue
        items = read_piece(source, start, stop, "text", task["text_column"])
        if tok is None:
            yield from ([np.frombuffer(d, np.uint8)] for d in items)
        else:
            yield from ([ids] for ids in encode_each(tok, items))


def _shards(pieces: list, sources: list[Source], shard_bytes: int) -> list[list]:
    """Pieces grouped into shards: whole text files together up to ``shard_bytes`` (a folder
    of small files is not a shard per file); every other piece is a shard of its own."""
    shards, size, joinable = [], 0, False
    for i, a, b in pieces:
        text = sources[i].kind == "text"
        if not (text and joinable and size + (b - a) <= shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append((i, a, b))
        size, joinable = size + (b - a), text
    return shards


def _check_out(source: Path, out: Path) -> None:
    """``out`` is replaced whole when the store is written: it must be a store or nothing,
    and outside the source (whose next prepare would read it)."""
    if out.exists() and not is_store(out):
        raise ConfigError("out", str(out), "exists and is not a token store (it would be "
                          "replaced); choose a new folder")
    src, dst = source.resolve(), out.resolve()
    if dst == src or src in dst.parents:
        raise ConfigError("out", str(out), f"is inside the source {source}; write the store "
                          "beside it (e.g. --out " f"{source.with_suffix('.store')})")


def _same_head(manifest: dict, head: dict) -> bool:
    """Whether a store was prepared from this head (sources, tokenizer, settings)."""
    return all(manifest.get(k) == v for k, v in head.items())


def _up_to_date(out: Path, head: dict, say) -> bool:
    """Whether the store ``out`` was prepared from this head and is still what was prepared
    (:func:`effijax.data.verify_store`: hashed unless unchanged since it last was); a
    damaged or changed store is said and prepared again, never trusted."""
    try:
        store = open_store(out)
        if not _same_head(store.manifest, head):
            return False
        verify_store(store)
    except FileError as e:
        say(f"{out} is damaged or was changed after it was prepared ({e.path}: {e.where}); "
            "preparing it again")
        return False
    return True


def _join(arrays, dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)


def _raise(error: list):
    if error[0] == "file":
        raise FileError(error[1], error[2], error[3])
    raise ConfigError(error[1], error[2], error[3])


@contextlib.contextmanager
def _environ(name: str, value: str):
    """``os.environ[name]`` is ``value`` for the block, then what it was (or unset)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _single_threaded_tokenizers():
    """The in-process path runs the tokenizers on one thread too (1 process means 1 core)."""
    return _environ("TOKENIZERS_PARALLELISM", "false")


# What multiprocessing's resource tracker says when a process ended by Ctrl-C (the effijax
# program exits at once, see effijax.cli._interrupt) leaves it the pool's semaphores to
# remove: it removes them, and the warning would follow the program's one line.
_TRACKER_WARNING = "ignore::UserWarning:multiprocessing.resource_tracker"


def _quiet_tracker():
    """The resource tracker (started with the pool's first semaphore, from this environment)
    removes what it is left without a warning."""
    before = os.environ.get("PYTHONWARNINGS")
    return _environ("PYTHONWARNINGS", ",".join(filter(None, (before, _TRACKER_WARNING))))


def _run(tasks: list[dict], fields: dict | None, processes: int, report) -> None:
    if not tasks:
        return
    chat = tasks[0]["data_format"] == "chat"
    if processes == 1:
        global _worker_tokenizer
        saved = _worker_tokenizer
        with _single_threaded_tokenizers():
            _init_worker(fields, chat)
            try:
                for task in tasks:
                    result = _tokenize(task)
                    if "error" in result:
                        _raise(result["error"])
                    report(result)
            finally:
                _worker_tokenizer = saved
        return
    # spawn: a forked JAX process (the tests', a notebook's) may deadlock in its threads.
    with _quiet_tracker():
        pool = multiprocessing.get_context("spawn").Pool(
            processes, initializer=_init_worker, initargs=(fields, chat, os.getpid()))
    try:
        for result in pool.imap(_tokenize, tasks):
            if "error" in result:
                _raise(result["error"])
            report(result)
    except BaseException:
        # A bad record, Ctrl-C (KeyboardInterrupt): the workers stop now, mid-shard (a shard
        # is committed whole or not at all), rather than after every shard still queued.
        pool.terminate()
        raise
    else:
        pool.close()
    finally:
        pool.join()


def prepare(source: str | os.PathLike, out: str | os.PathLike, *, tokenizer=None,
            chat_template: str | None = None, data_format: str = "auto",
            text_column: str = "text", val_fraction: float = 0.05,
            processes: int | None = None, shard_bytes: int | None = None,
            like_memory: bool = False, print_fn=None) -> dict:
    """Tokenizes ``source`` into the store ``out`` (see the module docstring); returns its
    manifest.

    Args:
      source: a file, a folder of files, or a ``datasets`` ``save_to_disk`` folder.
      out: the store's folder (replaced whole when done).
      tokenizer: a :class:`~effijax.models.Tokenizer` (None: bytes, for the byte GPT).
      chat_template: a Jinja chat template file that renders chat records in place of the
        tokenizer's own template (a base model has none); the manifest records its sha256, and
        a run must render chat with the same template to train on the store.
      data_format: ``auto``, ``text`` or ``chat`` (see :func:`effijax.data.check_columns`).
      text_column: the column (JSONL key) holding documents.
      val_fraction: held out for validation (recorded in the manifest).
      processes: worker processes (default: the machine's cores). More than one are started
        with ``spawn`` (a forked JAX process may deadlock), which imports the calling script
        again in each worker: call ``prepare`` under ``if __name__ == "__main__":`` in a script.
      shard_bytes: source bytes per shard (None: :func:`default_shard_bytes` of the
        sources' size).
      like_memory: read ``source`` as :func:`effijax.sources.load_dataset` reads text and
        JSONL files in memory (``data_format`` as :func:`effijax.sources._data.resolve_format`
        decides it: a ``.jsonl`` file is chat, anything else text, every file one document
        whatever its suffix), and record in the manifest the fingerprint that reading gives
        (``content``, :func:`effijax.data.content_fingerprint`): the store trains on the
        batches of the files read in memory, under their identity (``effijax train --data``
        prepares large text this way, :mod:`effijax.sources._prepared`).
      print_fn: progress lines (None: quiet).

    Raises:
      ConfigError: a bad source (a missing column names the file and the columns it has), a
        bad record (its file and where), chat data without a tokenizer with a chat template, a
        ``chat_template`` file that is missing, fails, or is given for text.

    Example:
      >>> import pathlib, tempfile
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> _ = (d / "a.txt").write_text("hello world " * 20)
      >>> manifest = prepare(d / "a.txt", d / "a.store", processes=1)
      >>> manifest["data_format"], manifest["tokens"], manifest["split"]["val_tokens"]
      ('bytes', 240, 12)
    """
    if (isinstance(val_fraction, bool) or not isinstance(val_fraction, int | float)
            or not 0.0 < val_fraction < 1.0):
        raise ConfigError("val_fraction", val_fraction, "expected a fraction in (0, 1), e.g. 0.05")
    if processes is not None:  # 0 is no count of processes (it once meant "every core")
        whole_number("processes", processes)
    processes = processes or os.cpu_count() or 1
    say = print_fn or (lambda line: None)
    out = Path(out)
    _check_out(Path(source), out)
    if like_memory:
        data_format = resolve_format(str(source), data_format)
        sources = find_sources(source, kind="jsonl" if data_format == "chat" else "text")
    else:
        sources = find_sources(source)
    fmt = check_columns(sources, data_format, text_column)
    if tokenizer is None and fmt == "chat":
        raise ConfigError("data_format", "chat", "chat records are rendered with a model's chat "
                          "template: name the model with --from (e.g. --from smollm2)")
    if chat_template is not None:
        check_template_file(chat_template)
        if fmt != "chat":
            raise ConfigError("chat_template", chat_template, f"the source is read as {fmt} "
                              "(documents), which no template renders; drop --chat-template, "
                              "or read chat records with --format chat")
        tokenizer = tokenizer_with_template(tokenizer, chat_template)
    if fmt == "chat" and tokenizer.chat_template is None:
        raise ConfigError("data_format", "chat", "the model's tokenizer has no chat template "
                          "(a base model's); render the records with a template file: "
                          "--chat-template FILE")
    fmt = "bytes" if tokenizer is None else fmt
    head = {
        "data_format": fmt,
        "dtype": token_dtype(256 if tokenizer is None else tokenizer.vocab_size).name,
        "tokenizer": None if tokenizer is None else {
            "sha256": tokenizer.fingerprint(chat_template=fmt == "chat"),
            "vocab_size": tokenizer.vocab_size,
            # Recorded only when given, so that a store prepared with the tokenizer's own
            # template keeps its manifest, and its hash, as before.
            **({} if chat_template is None else {
                "chat_template_sha256": template_digest(tokenizer.chat_template)})},
        "text_column": None if fmt == "chat" or like_memory else text_column,
        "val_fraction": val_fraction,
        "sources": [{"name": s.name, "kind": s.kind, "bytes": s.size,
                     "sha256": _file_sha256(s.path)} for s in sources],
        # Recorded only for like_memory, so that the stores of effijax data prepare keep their
        # manifests, and hashes, as before.
        **({"content": content_fingerprint(sources, fmt)} if like_memory else {}),
    }
    if is_store(out) and _up_to_date(out, head, say):
        say(f"{out} is up to date (same sources, tokenizer and settings)")
        return open_store(out).manifest
    if shard_bytes is None:
        shard_bytes = default_shard_bytes(sum(s.size for s in sources))
    pieces = _shards([(i, a, b) for i, s in enumerate(sources)
                      for a, b in plan_pieces(s, shard_bytes)], sources, shard_bytes)
    plan = hashlib.sha256(json.dumps([head, pieces], sort_keys=True).encode()).hexdigest()
    work = work_dir(out)
    if (work / "plan").is_file() and (work / "plan").read_text() != plan:
        shutil.rmtree(work)  # another source, tokenizer or settings: its shards do not apply
    work.mkdir(parents=True, exist_ok=True)
    (work / "plan").write_text(plan)
    fields = None if tokenizer is None else dataclasses.asdict(tokenizer)
    if fields is not None and fmt != "chat":  # a text worker cuts long texts as this one
        fields["splits"] = cuts_lines(tokenizer)
    tasks = [{"work": str(work), "index": k, "plan": plan,
              "pieces": [(str(sources[i].path), sources[i].name, sources[i].kind,
                          sources[i].size, a, b) for i, a, b in shard],
              "data_format": "chat" if fmt == "chat" else "text",
              "text_column": text_column, "dtype": head["dtype"]}
             for k, shard in enumerate(pieces)]
    todo = [t for t in tasks if not committed_shard(work, t["index"], plan)]
    processes = min(processes, max(len(todo), 1))  # no process without a shard to tokenize
    say(f"{len(sources)} file(s), {len(tasks)} shard(s)"
        + (f", {len(tasks) - len(todo)} already committed by an earlier run"
           if len(todo) < len(tasks) else "") + f"; tokenizing on {processes} process(es)")
    started, done = time.monotonic(), [0, 0]

    def report(result):
        done[0], done[1] = done[0] + 1, done[1] + result["tokens"]
        say(f"shard {done[0]}/{len(todo)}: {done[1]:,} tokens, "
            f"{done[1] / max(time.monotonic() - started, 1e-9):,.0f} tokens/s")

    _run(todo, fields, processes, report)
    assemble(work, out, len(tasks), head)
    remove_work(work)
    return open_store(out).manifest
