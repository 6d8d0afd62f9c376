"""What a data source holds, read in pieces: text files, JSONL, Parquet, Arrow, a ``datasets``
``save_to_disk`` folder.

:func:`find_sources` lists a source's files (a folder is walked in sorted order of relative
paths, as the text corpora are; a Hugging Face ``save_to_disk`` folder is its ``.arrow`` files in
the order its ``state.json`` gives). :func:`check_columns` decides, before anything is
tokenized, whether the data is ``text`` (a column or key holding documents) or ``chat``
(``messages``, or ``prompt``/``response``), and names the file and the columns it has when the
expected one is missing. :func:`plan_pieces` cuts each file into pieces of about
``target_bytes`` (a text file is one document, so one piece; JSONL by byte ranges, a line
belonging to the piece where it starts; Parquet and Arrow by row ranges), and
:func:`read_piece` reads one piece: documents (``bytes``) for text, :class:`~effijax.data.Record`
s for chat. Pieces are independent, so they can be read by several processes.

``pyarrow`` reads Parquet and Arrow (the ``data`` extra); it is imported on first use, and a
missing ``pyarrow`` is one line saying what to install.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import NamedTuple

from effijax.data._chat import parse_line, table_record
from effijax.data._corpus import _folder_files, _is_binary, document_files
from effijax.data._files import (
    MAX_JSON_BYTES,
    MAX_RECORD_BYTES,
    bounded_lines,
    read_json,
    regular_path,
)
from effijax.errors import ConfigError, FileError

__all__ = ["Source", "TABLE_SUFFIXES", "find_sources", "check_columns", "plan_pieces",
           "read_piece", "table_rows", "content_fingerprint"]

#: File suffixes read as tables (never as text): what ``--data`` must not read as bytes.
TABLE_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow"}
_CHAT_COLUMNS = ({"messages"}, {"prompt", "response"})


class Source(NamedTuple):
    """One file of a source: its ``path``, its ``name`` (relative to the source, what a store
    records), its ``kind`` (``text``, ``jsonl``, ``parquet``, ``arrow``) and ``size`` in bytes."""

    path: Path
    name: str
    kind: str
    size: int


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    return TABLE_SUFFIXES.get(suffix) or ("jsonl" if suffix == ".jsonl" else "text")


def _pyarrow():
    try:
        import pyarrow  # noqa: F401
        import pyarrow.parquet
    except ImportError:
        raise ConfigError("data", "parquet/arrow", "reading Parquet or Arrow files needs "
                          "pyarrow: pip install 'effijax[data]' (or pip install pyarrow)") \
            from None
    return pyarrow


def _saved_dataset(root: Path) -> list[Path] | None:
    """The ``.arrow`` files of a ``datasets`` ``save_to_disk`` folder, in its order; None for
    another folder."""
    if (root / "dataset_dict.json").is_file():
        splits = read_json(root / "dataset_dict.json", limit=MAX_JSON_BYTES).get("splits", [])
        first = splits[0] if splits else "train"
        raise ConfigError("data", str(root), f"is a DatasetDict (splits: {', '.join(splits)}); "
                          f"give one split's folder, e.g. {root / first}")
    if not (root / "state.json").is_file():
        return None
    files = read_json(root / "state.json").get("_data_files")
    if not isinstance(files, list) or not all(isinstance(f, dict) and isinstance(
            f.get("filename"), str) for f in files):
        raise FileError(root / "state.json", "_data_files", "expected a list of "
                        '{"filename": ...}, as datasets\' save_to_disk writes')
    return [root / f["filename"] for f in files]


def find_sources(path: str | os.PathLike, *, kind: str | None = None) -> list[Source]:
    """The files of ``path``: the file itself, a folder's files (hidden, ``__pycache__`` and
    binary files other than Parquet and Arrow skipped, as for text corpora), or a ``datasets``
    ``save_to_disk`` folder's ``.arrow`` files.

    Args:
      path: a file or folder.
      kind: read every file as this kind whatever its suffix, as ``effijax train --data``
        reads files in memory: ``"text"``, the files of
        :func:`~effijax.data.document_files` (a folder's binary files skipped), each one
        document (a ``.jsonl`` file too); ``"jsonl"``, records. None: by suffix.

    Raises:
      ConfigError: ``field="data"``: the path does not exist, is a pipe or device, or holds no
        readable file; a ``DatasetDict`` folder (name one split).

    Example:
      >>> import pathlib, tempfile
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> _ = (d / "b.txt").write_text("hi"); _ = (d / "a.jsonl").write_text("{}")
      >>> [(s.name, s.kind) for s in find_sources(d)]
      [('a.jsonl', 'jsonl'), ('b.txt', 'text')]
      >>> [(s.name, s.kind) for s in find_sources(d, kind="text")]
      [('a.jsonl', 'text'), ('b.txt', 'text')]
    """
    if kind is not None:
        if kind not in ("text", "jsonl"):
            raise ConfigError("kind", kind, "choose text, jsonl or None (by suffix)")
        try:
            files = document_files(path)
        except ConfigError as e:
            raise ConfigError("data", e.value, e.problem) from None
        root = Path(path)
        return [Source(f, f.name if f == root else f.relative_to(root).as_posix(), kind,
                       f.stat().st_size) for f in files]
    root = regular_path(path, "data")
    if not root.exists():
        raise ConfigError("data", str(root), "no such file or folder")
    if root.is_file():
        return [Source(root, root.name, _kind(root), root.stat().st_size)]
    files = _saved_dataset(root)
    if files is None:
        files = [f for f in _folder_files(root)
                 if f.suffix.lower() in TABLE_SUFFIXES or not _is_binary(f)]
    if not files:
        raise ConfigError("data", str(root), "the folder holds no readable file (text, JSONL, "
                          "Parquet or Arrow; hidden and __pycache__ files are skipped)")
    return [Source(f, f.relative_to(root).as_posix(), _kind(f), f.stat().st_size)
            for f in files]


def _columns(source: Source) -> list[str] | None:
    """A table's column names (the first record's keys for JSONL); None for a text file."""
    if source.kind == "text":
        return None
    if source.kind == "jsonl":
        with open(source.path, "rb") as f:
            for number, line in enumerate(iter(lambda: f.readline(MAX_RECORD_BYTES + 1), b""),
                                          start=1):
                if line.strip():
                    try:
                        obj = json.loads(line)
                    except (ValueError, RecursionError):
                        raise FileError(source.path, f"line {number}", "not a JSON object; "
                                        "expected one JSON object per line") from None
                    if not isinstance(obj, dict):
                        raise FileError(source.path, f"line {number}", "not a JSON object; "
                                        "expected one JSON object per line")
                    return list(obj)
        raise FileError(source.path, "file", "holds no record (one JSON object per line)")
    pa = _pyarrow()
    try:
        if source.kind == "parquet":
            return list(pa.parquet.read_schema(source.path).names)
        with pa.memory_map(str(source.path)) as f:
            return list(_arrow_reader(pa, f).schema.names)
    except (pa.ArrowInvalid, OSError) as e:
        raise FileError(source.path, "file", f"not a readable {source.kind} file "
                        f"({str(e).splitlines()[0]})") from None


def _arrow_reader(pa, f):
    """An Arrow IPC reader: the stream format ``datasets`` writes, or the file format."""
    try:
        return pa.ipc.open_stream(f)
    except pa.ArrowInvalid:
        f.seek(0)
        return pa.ipc.open_file(f)


def _chat_columns(columns: list[str]) -> set[str] | None:
    found = set(columns)
    if "messages" in found:
        return {"messages"}
    if {"prompt", "response"} <= found:
        return {"prompt", "response"} | ({"system"} & found)
    return None


def check_columns(sources: list[Source], data_format: str = "auto",
                  text_column: str = "text") -> str:
    """``"text"`` or ``"chat"``: what ``sources`` hold, each file checked for its columns.

    ``auto`` is ``chat`` when the first table (JSONL, Parquet, Arrow) has ``messages`` or
    ``prompt`` and ``response``, else ``text``. Text files are documents whatever the format
    (chat needs records).

    Raises:
      FileError: a table without the column the format needs, naming the file, the columns it
        has and the flag to use.
      ConfigError: ``data_format`` is not auto, text or chat; chat data with text files.

    Example:
      >>> import pathlib, tempfile
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> _ = (d / "docs.jsonl").write_text('{"id": 1, "body": "hi"}')
      >>> check_columns(find_sources(d))  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      effijax.errors.FileError: .../docs.jsonl: no column 'text' (columns: id, body): use \
--text-column body
    """
    if data_format not in ("auto", "text", "chat"):
        raise ConfigError("data_format", data_format, "choose one of auto, text, chat")
    columns = {s.path: _columns(s) for s in sources}
    fmt = data_format
    if fmt == "auto":
        first = next((c for c in columns.values() if c is not None), None)
        fmt = "chat" if first is not None and _chat_columns(first) else "text"
    for s in sources:
        have = columns[s.path]
        if have is None:
            if fmt == "chat":
                raise ConfigError("data", str(s.path), "a text file in chat data; chat records "
                                  "come from JSONL, Parquet or Arrow tables")
            continue
        shown = ", ".join(have)
        if fmt == "chat" and _chat_columns(have) is None:
            raise FileError(s.path, f"no column 'messages' (or 'prompt' and 'response') "
                            f"(columns: {shown})", "chat data needs them; for documents use "
                            "--format text")
        if fmt == "text" and text_column not in have:
            hint = next((c for c in have if c not in ("id", "idx", "index")), None)
            use = f"use --text-column {hint}" if hint else "use --text-column NAME"
            raise FileError(s.path, f"no column {text_column!r} (columns: {shown})", use)
    return fmt


def plan_pieces(source: Source, target_bytes: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``source``: bytes of a JSONL file, rows of a Parquet or
    Arrow file, the whole of a text file (one document).

    Example:
      >>> import pathlib, tempfile
      >>> f = pathlib.Path(tempfile.mkdtemp()) / "a.jsonl"
      >>> _ = f.write_text('{"text": "a"}\\n' * 10)
      >>> plan_pieces(find_sources(f)[0], 50)
      [(0, 50), (50, 100), (100, 140)]
    """
    if source.kind == "text":
        return [(0, source.size)]
    if source.kind == "jsonl":
        return [(a, min(a + target_bytes, source.size))
                for a in range(0, max(source.size, 1), target_bytes)]
    pa = _pyarrow()
    pieces, at = [], 0
    if source.kind == "parquet":
        meta = pa.parquet.ParquetFile(source.path).metadata
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            rows, parts = group.num_rows, max(1, -(-group.total_byte_size // target_bytes))
            step = max(1, -(-rows // parts))
            pieces += [(at + a, at + min(a + step, rows)) for a in range(0, rows, step)]
            at += rows
        return pieces
    with pa.memory_map(str(source.path)) as f:
        start, size = 0, 0
        for batch in _arrow_reader(pa, f):
            at, size = at + batch.num_rows, size + batch.nbytes
            if size >= target_bytes:
                pieces.append((start, at))
                start, size = at, 0
        if at > start:
            pieces.append((start, at))
    return pieces


def _jsonl_lines(path: Path, start: int, stop: int):
    """``(number, line)`` of the lines that start in ``[start, stop)`` bytes of ``path``;
    ``number`` counts from the piece's first line (0) for messages."""
    with open(path, "rb") as f:
        if start:
            f.seek(start - 1)
            if f.read(1) != b"\n":
                f.readline(MAX_RECORD_BYTES + 1)  # the line that began in the piece before
        while f.tell() < stop:
            at = f.tell()
            line = f.readline(MAX_RECORD_BYTES + 1)
            if not line:
                break
            if len(line) > MAX_RECORD_BYTES and not line.endswith(b"\n"):
                raise FileError(path, f"byte {at:,}", f"a line longer than "
                                f"{MAX_RECORD_BYTES:,} bytes; shorten or split it")
            yield at, line


def _rows(source: Source, start: int, stop: int, columns: list[str]):
    """The rows ``[start, stop)`` of a Parquet or Arrow file, as dicts of ``columns``."""
    pa = _pyarrow()
    if source.kind == "parquet":
        parquet = pa.parquet.ParquetFile(source.path)
        meta, at = parquet.metadata, 0
        for g in range(meta.num_row_groups):
            rows = meta.row_group(g).num_rows
            if at + rows > start and at < stop:
                table = parquet.read_row_group(g, columns=columns)
                yield from table.slice(max(0, start - at), min(stop, at + rows)
                                       - max(start, at)).to_pylist()
            at += rows
        return
    with pa.memory_map(str(source.path)) as f:
        at = 0
        for batch in _arrow_reader(pa, f):
            if at + batch.num_rows > start and at < stop:
                part = batch.select(columns).slice(max(0, start - at),
                                                   min(stop, at + batch.num_rows) - max(start, at))
                yield from part.to_pylist()
            at += batch.num_rows
            if at >= stop:
                break


def table_rows(source: Source, columns: list[str]):
    """Every row of a Parquet or Arrow file, in order, as a dict of ``columns``.

    Raises:
      FileError: the file lacks one of ``columns`` (naming the columns it has).

    Example:
      >>> import pathlib, tempfile, pyarrow as pa, pyarrow.parquet as pq
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "t.parquet"
      >>> pq.write_table(pa.table({"a": [1, 2], "b": ["x", "y"]}), path)
      >>> list(table_rows(find_sources(path)[0], ["b"]))
      [{'b': 'x'}, {'b': 'y'}]
    """
    have = _columns(source) or []
    missing = [c for c in columns if c not in have]
    if missing:
        raise FileError(source.path, f"no column {', '.join(map(repr, missing))} (columns: "
                        f"{', '.join(have)})", f"expected the columns {', '.join(columns)}")
    return _rows(source, 0, 2**63 - 1, columns)


def read_piece(source: Source, start: int, stop: int, data_format: str,
               text_column: str = "text") -> list:
    """The documents (``bytes``, text) or :class:`~effijax.data.Record` s (chat) of one piece.

    A table row whose text is null or not a string is an error naming the file and the row.

    Example:
      >>> import pathlib, tempfile
      >>> f = pathlib.Path(tempfile.mkdtemp()) / "a.jsonl"
      >>> _ = f.write_text('{"text": "one"}\\n{"text": "two"}\\n')
      >>> read_piece(find_sources(f)[0], 5, 32, "text")
      [b'two']
    """
    if source.kind == "text":
        with open(source.path, "rb") as f:
            return [f.read()]
    if source.kind == "jsonl":
        out = []
        for at, line in _jsonl_lines(source.path, start, stop):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                raise FileError(source.path, f"byte {at:,}", "a line that is not UTF-8; save "
                                "the file as UTF-8") from None
            if not text.strip():
                continue
            where = f"{source.path}@{at}"
            if data_format == "chat":
                out.append(parse_line(text, where))
            else:
                out.append(_text(json.loads(text), text_column, source.path, f"byte {at:,}"))
        return out
    if data_format == "chat":
        columns = sorted(_chat_columns(_columns(source)))
        return [table_record(row, f"{source.path}:{start + i}")
                for i, row in enumerate(_rows(source, start, stop, columns))]
    return [_text(row, text_column, source.path, f"row {start + i}")
            for i, row in enumerate(_rows(source, start, stop, [text_column]))]


def _text(row, column: str, path: Path, where: str) -> bytes:
    value = row.get(column) if isinstance(row, dict) else None
    if not isinstance(value, str):
        raise FileError(path, where, f"column {column!r} is "
                        f"{'missing' if value is None else type(value).__name__}; expected a "
                        "string")
    return value.encode("utf-8")


# Read and hashed in blocks of this many bytes: a source's size never sets the memory used.
_BLOCK = 16 * 2**20


def content_fingerprint(sources: list[Source], data_format: str) -> str:
    """The fingerprint of ``sources`` that their in-memory reading gives, computed a block at
    a time: ``"bytes"``, :func:`~effijax.data.corpus_fingerprint` of the files one after the
    other; ``"text"``, :func:`~effijax.data.documents_fingerprint` of the files as documents;
    ``"chat"``, :func:`~effijax.data.records_fingerprint` of the records of the JSONL files.
    What a run records as its data's identity whichever way its data was read (in memory, or
    from a token store it was prepared into).

    Raises:
      FileError: a file that changed size while it was read.
      ConfigError: a JSONL line that is too long or not UTF-8 (``data``, ``"file:line"``).

    Example:
      >>> import pathlib, tempfile
      >>> from effijax.data import documents_fingerprint
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> _ = (d / "a.txt").write_text("hello"); _ = (d / "b.txt").write_text("hi")
      >>> content_fingerprint(find_sources(d), "text") == documents_fingerprint([b"hello", b"hi"])
      True
    """
    digest, size = hashlib.sha256(), 0
    if data_format == "chat":
        count = 0
        for s in sources:
            for _, line in bounded_lines(s.path, "data"):
                if line.strip():
                    digest.update(line.strip().encode("utf-8") + b"\n")
                    count += 1
        return f"{count}:{digest.hexdigest()[:16]}"
    if data_format not in ("bytes", "text"):
        raise ConfigError("data_format", data_format, "choose bytes, text or chat")
    for s in sources:
        with open(s.path, "rb") as f:
            length = os.fstat(f.fileno()).st_size
            if data_format == "text":
                digest.update(length.to_bytes(8, "little"))
            read = 0
            while block := f.read(_BLOCK):
                digest.update(block)
                read += len(block)
        if read != length:
            raise FileError(s.path, "file", f"changed while it was read ({length:,} bytes, then "
                            f"{read:,}); read it again when it is no longer written")
        size += read
    return f"{size}:{digest.hexdigest()[:16]}"
