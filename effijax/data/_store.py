"""A tokenized store: a corpus tokenized once, memory-mapped by every run that trains on it.

A store is a folder of flat little-endian arrays and a ``manifest.json``:

* ``tokens.bin``: every token, documents (or chat examples) one after the other, as ``uint8``
  (bytes), ``uint16`` (a vocabulary that fits) or ``uint32``;
* ``offsets.bin``: ``int64[documents + 1]``, where each document starts;
* chat only: ``mask.bin`` (``uint8`` per token, 1 on the assistant's tokens, rendered and masked
  when the store was prepared) and ``val.bin`` (``uint8`` per example, 1 = validation);
* ``manifest.json``: the format version, the tokenizer's fingerprint, each source file with its
  SHA-256, the token and document counts, the split, each array file's size and SHA-256, and the
  store's own ``sha256`` (of the manifest without it, so of everything); for a store prepared
  from text or JSONL files as ``effijax train --data`` reads them, ``content``: the fingerprint
  of those files read in memory, the identity of a run on the store (:attr:`Store.fingerprint`).

Why flat arrays and not ArrayRecord or Grain: training draws random windows anywhere in a token
stream (a window crosses documents, as in pretraining), which a flat array serves with one
slice of a memory map and no per-record decoding; ArrayRecord stores records, so a window would
gather and decode several of them. ``np.memmap`` needs nothing beyond numpy, opens in constant
time whatever the size, and the page cache shares it between the processes of a host. The
batches stay a pure function of ``(seed, step)`` (:func:`~effijax.data.batch_at`), which is
what Grain's sampler state would otherwise hold.

Trust: :func:`open_store` checks what costs nothing at every open: the manifest's fields
(every wrong one named at once) and its own hash, each array file's size, the offsets (from 0,
never decreasing, ending at the token count). :func:`verify_store` checks the content: each
array file hashed against the manifest, its largest id and its mask counted in the same pass (a
run refuses ids beyond its model's vocabulary, and a chat store that trains on nothing). A run
verifies at every start, resumes included, but hashes a file only on its first use and once it
changed: the store's ``.verified.json`` records each file hashed with its size, times, inode
and device (a same-size rewrite changes its times), so start-up does not grow with the corpus.
A file changed within 2 s of its hashing is hashed again next time (git's "racily clean" files:
one clock tick can hide a second write); a store effijax cannot write into is hashed at every
start.
A batch's reads unmap what they mapped (:func:`release_pages`), so a long run's RSS stays one
batch's, not every page it ever read.
Text stores train on windows of the stream (:func:`store_split`: the last ``val_fraction`` of
the tokens is validation, as for in-memory corpora); chat stores on their examples packed into
rows when read (:func:`store_rows`), the same rows :func:`~effijax.data.pack_examples` packs,
built for the rows a batch draws only. Writing a store: :func:`commit_shard` (one piece
tokenized, committed whole) and :func:`assemble` (the shards joined into the store, written to
a temporary folder and renamed into place).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from effijax import atomic
from effijax.data._chat import Packed
from effijax.data._corpus import val_count
from effijax.data._files import read_json, regular_size
from effijax.errors import NO_VALUE, ConfigError, FileError, all_of

__all__ = ["STORE_FORMAT", "STORE_VERSION", "Store", "Contents", "token_dtype", "is_store",
           "open_store", "verify_store", "store_split", "store_rows", "commit_shard",
           "commit_documents", "committed_shard", "assemble", "remove_work", "release_pages"]

STORE_FORMAT = "effijax-token-store"
STORE_VERSION = 1
_MANIFEST = "manifest.json"
# Copy and hash in pieces of this many bytes: a store's size never sets the memory used.
_CHUNK = 16 * 2**20


class Store(NamedTuple):
    """An opened store: its ``manifest`` and memory-mapped arrays (``mask`` and ``val`` for
    chat only)."""

    path: Path
    manifest: dict
    tokens: np.ndarray
    offsets: np.ndarray
    mask: np.ndarray | None = None
    val: np.ndarray | None = None

    @property
    def format(self) -> str:
        """``"bytes"``, ``"text"`` or ``"chat"``."""
        return self.manifest["data_format"]

    @property
    def fingerprint(self) -> str:
        """What a run records as its data's identity: ``"store:<sha256>"``, or for a store
        ``effijax train`` prepared from text or JSONL files itself, the manifest's
        ``content``: the fingerprint of the files read in memory, so that a run's identity is
        its data's whichever way it was read."""
        return self.manifest.get("content") or f"store:{self.manifest['sha256']}"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype holding ids below ``vocab_size``.

    Example:
      >>> token_dtype(256).name, token_dtype(49152).name, token_dtype(128256).name
      ('uint8', 'uint16', 'uint32')
    """
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ConfigError("vocab_size", vocab_size, "over 2**32 ids")


def is_store(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is a folder holding a store's ``manifest.json``.

    Example:
      >>> is_store("/nonexistent"), is_store(None)
      (False, False)
    """
    if path is None:
        return False
    manifest = Path(path) / _MANIFEST
    if not manifest.is_file():
        return False
    try:
        return read_json(manifest).get("format") == STORE_FORMAT
    except FileError:
        return False


_DTYPES = ("uint8", "uint16", "uint32")
_FORMATS = ("bytes", "text", "chat")
_SPLIT = {"chat": ("train_examples", "val_examples", "train_trained_tokens",
                   "val_trained_tokens"),
          "text": ("train_tokens", "val_tokens")}
_HEX = frozenset("0123456789abcdef")


def _array_files(data_format: str, dtype: str, tokens: int, documents: int) -> dict:
    """Each array file a store of this shape holds: ``{name: (dtype, count)}``."""
    files = {"tokens.bin": (dtype, tokens), "offsets.bin": ("int64", documents + 1)}
    if data_format == "chat":
        files |= {"mask.bin": ("uint8", tokens), "val.bin": ("uint8", documents)}
    return files


def _is_sha256(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX


def _is_count(value) -> bool:
    return type(value) is int and value >= 0  # JSON's true is no count


def _is_content(value) -> bool:
    """Whether ``value`` is a fingerprint of files read in memory: ``"<count>:<16 hex>"``."""
    if not isinstance(value, str):
        return False
    count, _, digest = value.partition(":")
    return count.isdigit() and count.isascii() and len(digest) == 16 and set(digest) <= _HEX


def _is_tokenizer(value) -> bool:
    """Whether ``value`` is a manifest's record of a tokenizer (null: bytes)."""
    if value is None:
        return True
    if not isinstance(value, dict) or not _is_sha256(value.get("sha256")):
        return False
    template = value.get("chat_template_sha256")
    return (_is_count(value.get("vocab_size")) and value["vocab_size"] >= 1
            and (template is None or _is_sha256(template)))


def _is_entry(value, size: int) -> bool:
    """Whether ``value`` is a manifest's record of an array file of ``size`` bytes."""
    return isinstance(value, dict) and value.get("bytes") == size and _is_sha256(
        value.get("sha256"))


def _manifest_errors(manifest: dict) -> list[ConfigError]:
    """Every field of a store's manifest (of this version) that is missing, of the wrong type
    or range, or inconsistent with another: one :class:`~effijax.errors.ConfigError` each,
    naming the field (``[]``: none).

    Example:
      >>> [str(e) for e in _manifest_errors({"tokens": "12", "data_format": "text",
      ...                                   "dtype": "int8"})][:3]
      ["tokens='12': must be an integer >= 0", 'documents: is missing', "dtype='int8': \
is not one of uint8, uint16, uint32"]
    """
    errors = []

    def field(name, ok, expected, within=manifest, prefix=""):
        """``within[name]`` when it is there and ``ok``; else None, and the error noted."""
        if name not in within:
            errors.append(ConfigError(prefix + name, NO_VALUE, "is missing"))
        elif not ok(within[name]):
            errors.append(ConfigError(prefix + name, within[name], expected))
        else:
            return within[name]
        return None

    count = "must be an integer >= 0"
    tokens = field("tokens", _is_count, count)
    documents = field("documents", _is_count, count)
    fmt = field("data_format", _FORMATS.__contains__, f"is not one of {', '.join(_FORMATS)}")
    dtype = field("dtype", _DTYPES.__contains__, f"is not one of {', '.join(_DTYPES)}")
    tokenizer = field("tokenizer", _is_tokenizer, 'expected null (bytes) or {"sha256": 64 hex '
                      'digits, "vocab_size": an integer >= 1}')
    field("sha256", _is_sha256, "expected 64 hex digits")
    if "content" in manifest:
        field("content", _is_content, 'expected "<count>:<16 hex digits>" (the fingerprint '
              "of the files read in memory)")
    split = field("split", lambda v: isinstance(v, dict), "expected an object of counts")
    files = field("files", lambda v: isinstance(v, dict), "expected an object of array files")
    if tokenizer and dtype and tokenizer["vocab_size"] > np.iinfo(dtype).max + 1:
        errors.append(ConfigError("dtype", dtype, f"cannot hold the tokenizer's "
                                  f"{tokenizer['vocab_size']:,} ids"))
    if split is not None and fmt is not None:
        names = _SPLIT["chat" if fmt == "chat" else "text"]
        counts = [field(name, _is_count, count, split, "split.") for name in names]
        total, what = (documents, "documents") if fmt == "chat" else (tokens, "tokens")
        if None not in counts and total is not None and counts[0] + counts[1] != total:
            errors.append(ConfigError("split", split, f"{names[0]} + {names[1]} is not the "
                                      f"{total:,} {what}"))
    if files is not None and None not in (fmt, dtype, tokens, documents):
        want = _array_files(fmt, dtype, tokens, documents)
        if set(files) != set(want):
            errors.append(ConfigError("files", sorted(files), f"expected {sorted(want)} (a "
                                      f"{fmt} store's)"))
        for name, (kind, n) in want.items():
            size = n * np.dtype(kind).itemsize
            if name in files and not _is_entry(files[name], size):
                errors.append(ConfigError(f"files.{name}", files[name], f'expected {{"bytes": '
                                          f'{size}, "sha256": 64 hex digits}}'))
    return errors


def _map(path: Path, dtype, count: int) -> np.ndarray:
    size, want = regular_size(path), count * np.dtype(dtype).itemsize
    if size != want:
        raise FileError(path, "file", f"is {size:,} bytes; the manifest says {want:,} ({count:,} x "
                        f"{np.dtype(dtype)}): the store is damaged; prepare it again")
    if not count:
        return np.zeros(0, dtype)
    try:
        array = np.memmap(path, dtype=dtype, mode="r", shape=(count,))
    except OSError as e:
        raise FileError(path, "file", f"cannot be read ({e.strerror})") from None
    # Training reads windows at random places: no read-ahead (megabytes per fault on some
    # disks) for pages that are not in the page cache yet.
    with contextlib.suppress(OSError, ValueError):
        array.base.madvise(mmap.MADV_RANDOM)
    return array


# Offsets read this many at a time (8 MiB): a store's size never sets the memory used.
_OFFSETS_CHUNK = 2**20


def _check_offsets(path: Path, offsets: np.ndarray, tokens: int) -> None:
    """Each document's start: from 0, never decreasing, the last at ``tokens`` (so no slice
    reaches past ``tokens.bin``)."""
    if int(offsets[0]) != 0 or int(offsets[-1]) != tokens:
        raise FileError(path, "offsets", f"run from {int(offsets[0]):,} to "
                        f"{int(offsets[-1]):,}; expected 0 to the {tokens:,} tokens: the store "
                        "is damaged; prepare it again")
    for at in range(0, len(offsets) - 1, _OFFSETS_CHUNK):
        piece = np.asarray(offsets[at:at + _OFFSETS_CHUNK + 1])  # one shared with the next
        steps = np.diff(piece)
        if (steps < 0).any():
            i = at + int(np.argmax(steps < 0))
            raise FileError(path, f"offset {i + 1:,}", f"{int(offsets[i + 1]):,} is below the "
                            f"one before it ({int(offsets[i]):,}): the store is damaged; "
                            "prepare it again")
    release_pages(offsets)


def open_store(path: str | os.PathLike) -> Store:
    """The store at ``path``, its arrays memory-mapped: nothing read but the manifest and the
    offsets (see the module docstring: :func:`verify_store` reads the rest).

    Raises:
      FileError: no manifest, another format or version, a field of the manifest missing or
        wrong (every such field named at once), a manifest changed since it was written, an
        array file of the wrong size, offsets out of order or past the tokens.

    Example:
      >>> import numpy as np, tempfile, pathlib
      >>> work = pathlib.Path(tempfile.mkdtemp())
      >>> commit_shard(work, 0, "p", np.arange(100, dtype=np.uint8), np.array([60, 40]))
      >>> head = {"data_format": "bytes", "dtype": "uint8", "tokenizer": None, "val_fraction": 0.1}
      >>> store = open_store(assemble(work, work / "s", 1, head))
      >>> store.offsets.tolist()
      [0, 60, 100]
      >>> _ = (work / "s" / "offsets.bin").write_bytes(np.array([0, 60, 101]).tobytes())
      >>> open_store(work / "s")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      effijax.errors.FileError: .../s/offsets.bin: offsets: run from 0 to 101; expected 0 to \
the 100 tokens: the store is damaged; prepare it again
    """
    path = Path(path)
    where = path / _MANIFEST
    manifest = read_json(where)
    if manifest.get("format") != STORE_FORMAT:
        raise FileError(where, "format", f"{manifest.get('format')!r}; expected "
                        f"{STORE_FORMAT!r} (a folder written by effijax data prepare)")
    if manifest.get("version") != STORE_VERSION or isinstance(manifest.get("version"), bool):
        raise FileError(where, "version", f"{manifest.get('version')!r}; this "
                        f"effijax reads version {STORE_VERSION}: prepare the store again")
    errors = _manifest_errors(manifest)
    if errors:
        raise FileError.of(where, all_of(errors))
    if _manifest_digest(manifest) != manifest["sha256"]:
        raise FileError(where, "sha256", "differs from the manifest's content: the manifest "
                        "was changed after it was prepared; prepare the store again")
    n, docs = manifest["tokens"], manifest["documents"]
    arrays = {name: _map(path / name, kind, count) for name, (kind, count) in _array_files(
        manifest["data_format"], manifest["dtype"], n, docs).items()}
    _check_offsets(path / "offsets.bin", arrays["offsets.bin"], n)
    return Store(path, manifest, arrays["tokens.bin"], arrays["offsets.bin"],
                 arrays.get("mask.bin"), arrays.get("val.bin"))


def release_pages(array) -> None:
    """Unmaps the pages a mapped store's array has touched (they stay in the page cache, and
    the next read maps them again at the cost of a minor fault): the process keeps one batch's
    windows mapped, not every page it ever read, so its RSS does not grow with the corpus.
    Anything but a memory map is left alone.

    Example:
      >>> import numpy as np
      >>> release_pages(np.arange(3))  # not mapped: nothing to do
    """
    while isinstance(array, np.ndarray):  # views of a memory map lead to it through .base
        array = array.base
    if isinstance(array, mmap.mmap):
        with contextlib.suppress(OSError, ValueError):
            array.madvise(mmap.MADV_DONTNEED)


def _manifest_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


class Contents(NamedTuple):
    """What :func:`verify_store` found in a store's arrays: the store's ``sha256`` (its
    manifest's), the largest token id ``max_id`` (-1: no token) and the ``trained`` tokens
    (chat: those its mask marks; text: every token)."""

    sha256: str
    max_id: int
    trained: int


# Where a store records the files it verified (see the module docstring).
_STAMP = ".verified.json"
# A file changed this close to its hashing is hashed again: a second write within one tick
# of the file system's clock (or a skewed network clock) may leave its times as they were.
_RACY_NS = 2 * 10**9
# The files whose bytes are flags (0 or 1): their 1s are counted while they are hashed.
_FLAGS = ("mask.bin", "val.bin")


def _identity(path: Path) -> list[int]:
    """What changes whenever a file's content may have: size, modification and change times
    (the latter set by the kernel on every write, never by ``touch``), inode and device."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise FileError(path, "file", f"cannot be read ({e.strerror})") from None
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _scan(path: Path, dtype: str) -> dict:
    """One pass over an array file: its sha256, its largest value and (flags) its 1s."""
    digest, top, ones = hashlib.sha256(), -1, 0
    width = np.dtype(dtype).itemsize
    buffer = bytearray(_CHUNK)  # one buffer, read into again and again: 16 MiB of memory
    try:
        with open(path, "rb") as f:
            while n := f.readinto(buffer):
                digest.update(memoryview(buffer)[:n])
                values = np.frombuffer(buffer, dtype, n // width)
                if values.size:
                    top = max(top, int(values.max()))
                    if path.name in _FLAGS:
                        ones += int(np.count_nonzero(values == 1))
    except OSError as e:
        raise FileError(path, "file", f"cannot be read ({e.strerror})") from None
    return {"sha256": digest.hexdigest(), "max": top, "ones": ones}


def _trusted(record, sha256: str, identity: list[int]) -> dict | None:
    """The stamp's ``record`` of a file, if it is of this ``identity`` and hash and was taken
    long enough after the file last changed (None: hash the file)."""
    try:
        if (record["identity"] == identity and record["sha256"] == sha256
                and record["at"] - max(identity[1], identity[2]) >= _RACY_NS
                and all(type(record[k]) is int for k in ("max", "ones"))):
            return record
    except (KeyError, TypeError):
        pass
    return None


def verify_store(path: str | os.PathLike | Store, *, again: bool = False) -> Contents:
    """The content of a store checked against its manifest: each array file hashed (on its
    first use, and again once it changed: see the module docstring; every time with
    ``again``), its largest id and its flags counted in the same pass.

    Raises:
      FileError: what :func:`open_store` raises; an array file whose sha256 is not the
        manifest's (naming it), a mask that trains on nothing or holds other values than 0
        and 1, validation flags that are not the manifest's split.

    Example:
      >>> import numpy as np, tempfile, pathlib
      >>> work = pathlib.Path(tempfile.mkdtemp())
      >>> commit_shard(work, 0, "p", np.arange(100, dtype=np.uint8), np.array([100]))
      >>> head = {"data_format": "bytes", "dtype": "uint8", "tokenizer": None, "val_fraction": 0.1}
      >>> contents = verify_store(assemble(work, work / "s", 1, head))
      >>> contents.max_id, contents.trained, (work / "s" / ".verified.json").is_file()
      (99, 100, True)
      >>> _ = (work / "s" / "tokens.bin").write_bytes(bytes(100))  # same size, other bytes
      >>> verify_store(work / "s")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      effijax.errors.FileError: .../s/tokens.bin: sha256: differs from the manifest: the \
store was changed after it was prepared; prepare it again
    """
    store = path if isinstance(path, Store) else open_store(path)
    manifest = store.manifest
    try:
        stamp = {} if again else read_json(store.path / _STAMP)
    except FileError:  # none yet, or unreadable: every file is hashed
        stamp = {}
    records, fresh = {}, False
    for name, (dtype, _) in _array_files(manifest["data_format"], manifest["dtype"],
                                         manifest["tokens"], manifest["documents"]).items():
        file, want = store.path / name, manifest["files"][name]["sha256"]
        at, identity = time.time_ns(), _identity(file)
        record = _trusted(stamp.get(name), want, identity)
        if record is None:
            record, fresh = {**_scan(file, dtype), "identity": identity, "at": at}, True
            if record["sha256"] != want:
                raise FileError(file, "sha256", "differs from the manifest: the store was "
                                "changed after it was prepared; prepare it again")
        records[name] = record
    trained = _check_flags(store, records)
    if fresh:
        with contextlib.suppress(OSError):  # a store effijax cannot write: hashed every time
            atomic.write_text(store.path / _STAMP, json.dumps(records, sort_keys=True))
    return Contents(manifest["sha256"], records["tokens.bin"]["max"], trained)


def _check_flags(store: Store, records: dict) -> int:
    """The trained tokens, after the chat flags are checked: a mask of 0s and 1s that marks
    some token, a validation flag per example (0 or 1) as many as the split says."""
    if store.format != "chat":
        return store.manifest["tokens"]
    mask, val, split = records["mask.bin"], records["val.bin"], store.manifest["split"]
    if mask["max"] > 1:
        raise FileError(store.path / "mask.bin", "mask", f"holds the value {mask['max']}; a "
                        "mask is 0 or 1 per token: the store is damaged; prepare it again")
    if not mask["ones"]:
        raise FileError(store.path / "mask.bin", "mask", "marks no token to train on (every "
                        "byte is 0): nothing would be trained; prepare it again from records "
                        "with assistant turns")
    if val["max"] > 1 or val["ones"] != split["val_examples"]:
        raise FileError(store.path / "val.bin", "val", f"flags {val['ones']:,} validation "
                        f"examples (largest flag {val['max']}); the manifest's split says "
                        f"{split['val_examples']:,} (flags are 0 or 1): the store is damaged; "
                        "prepare it again")
    return mask["ones"]


def store_split(store: Store) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)`` token streams of a text (or bytes) store: views of its memory map.

    Example:
      >>> import numpy as np, tempfile, pathlib
      >>> work = pathlib.Path(tempfile.mkdtemp())
      >>> commit_shard(work, 0, "p", np.arange(100, dtype=np.uint8), np.array([100]))
      >>> head = {"data_format": "bytes", "dtype": "uint8", "tokenizer": None, "val_fraction": 0.1}
      >>> store = open_store(assemble(work, work / "s", 1, head))
      >>> [len(part) for part in store_split(store)], isinstance(store.tokens, np.memmap)
      ([90, 10], True)
    """
    n_train = store.manifest["split"]["train_tokens"]
    return store.tokens[:n_train], store.tokens[n_train:]


class _Layout(NamedTuple):
    """Chat examples packed next-fit into rows of ``width`` (what ``pack_examples`` does), as
    index arrays: row ``r`` holds examples ``order[first[r]:first[r + 1]]``."""

    store: Store
    order: np.ndarray
    first: np.ndarray
    width: int
    pad_id: int


def _layout(store: Store, order: np.ndarray, width: int, pad_id: int) -> _Layout:
    lengths = np.minimum(np.diff(store.offsets)[order], width)
    first, used = [], width
    for i, n in enumerate(lengths.tolist()):  # next-fit is sequential; ints only
        if used + n > width:
            first.append(i)
            used = 0
        used += n
    first.append(len(order))
    return _Layout(store, order, np.asarray(first, np.int64), width, pad_id)


class _Rows:
    """One array of packed rows (``tokens``, ``mask`` or ``segments``), built for the rows
    asked: ``rows[index]`` is ``int32[len(index), width]``; ``shape`` and ``len`` as an array's.
    """

    def __init__(self, layout: _Layout, field: str):
        self.layout, self.field = layout, field
        self.shape = (len(layout.first) - 1, layout.width)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> np.ndarray:
        lay, store = self.layout, self.layout.store
        index = np.asarray(index, np.int64).reshape(-1)
        fill = lay.pad_id if self.field == "tokens" else 0
        out = np.full((len(index), lay.width), fill, np.int32)
        for b, r in enumerate(index.tolist()):
            at = 0
            for number, e in enumerate(lay.order[lay.first[r]:lay.first[r + 1]].tolist(), 1):
                start = int(store.offsets[e])
                n = min(int(store.offsets[e + 1]) - start, lay.width)
                if self.field == "segments":
                    out[b, at:at + n] = number
                else:
                    source = store.tokens if self.field == "tokens" else store.mask
                    out[b, at:at + n] = source[start:start + n]
                at += n
        for array in (store.tokens, store.mask, store.offsets):
            release_pages(array)
        return out


def store_rows(store: Store, *, val: bool | None, seq_len: int, pad_id: int) -> Packed:
    """A chat store's training (or validation; ``val=None``: every one, in order) examples as
    :class:`~effijax.data.Packed` rows of ``seq_len + 1``: the rows ``pack_examples`` packs from
    the same examples, each row built when a batch draws it. Only the row layout (one int per
    example) is held in memory.

    ``filled``, ``examples`` and ``truncated`` are exact; the rows' arrays are not arrays (so
    :attr:`~effijax.data.Packed.trained_tokens` is not available: the manifest counts them).
    """
    order = (np.arange(len(store.offsets) - 1) if val is None
             else np.flatnonzero(np.asarray(store.val) == (1 if val else 0)))
    width = seq_len + 1
    layout = _layout(store, order, width, pad_id)
    lengths = np.diff(store.offsets)[order]
    return Packed(_Rows(layout, "tokens"), _Rows(layout, "mask"), _Rows(layout, "segments"),
                  examples=len(order), truncated=int(np.count_nonzero(lengths > width)),
                  filled=int(np.minimum(lengths, width).sum()))


# Writing ----------------------------------------------------------------------------------------

def _shard(work: Path, index: int, suffix: str) -> Path:
    return work / f"{index:06d}.{suffix}"


def commit_shard(work: Path, index: int, plan: str, tokens: np.ndarray, lengths: np.ndarray,
                 mask: np.ndarray | None = None, keys: bytes | None = None,
                 trained: np.ndarray | None = None) -> None:
    """Writes shard ``index`` of a prepare (its arrays, then its ``.json``, which commits it);
    ``plan`` identifies the prepare it belongs to (:func:`committed_shard`)."""
    arrays = {"tokens": np.ascontiguousarray(tokens).tobytes(),
              "lengths": np.asarray(lengths, np.int64).tobytes()}
    if mask is not None:
        arrays |= {"mask": np.asarray(mask, np.uint8).tobytes(), "keys": keys,
                   "trained": np.asarray(trained, np.int64).tobytes()}
    for suffix, data in arrays.items():
        atomic.write_bytes(_shard(work, index, suffix), data)
    atomic.write_text(_shard(work, index, "json"), json.dumps(
        {"plan": plan, "tokens": int(len(tokens)), "documents": int(len(lengths))}))


def commit_documents(work: Path, index: int, plan: str,
                     documents: Iterable[Iterable[np.ndarray]], dtype) -> int:
    """Writes shard ``index`` of a prepare from ``documents``, each the consecutive arrays of
    its ids, written as ``dtype`` as they come (a document is never held whole), and commits
    it as :func:`commit_shard` does; returns its tokens.

    Example:
      >>> import numpy as np, tempfile, pathlib
      >>> work = pathlib.Path(tempfile.mkdtemp())
      >>> docs = [[np.arange(3), np.arange(2)], [np.arange(4)]]
      >>> commit_documents(work, 0, "p", docs, np.uint8), committed_shard(work, 0, "p")
      (9, True)
      >>> np.fromfile(work / "000000.lengths", np.int64).tolist()
      [5, 4]
    """
    dtype, lengths = np.dtype(dtype), []

    def fill(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            for document in documents:
                n = 0
                for ids in document:
                    f.write(np.asarray(ids).astype(dtype).tobytes())
                    n += len(ids)
                lengths.append(n)

    atomic.write_with(_shard(work, index, "tokens"), fill)
    atomic.write_bytes(_shard(work, index, "lengths"), np.asarray(lengths, np.int64).tobytes())
    atomic.write_text(_shard(work, index, "json"), json.dumps(
        {"plan": plan, "tokens": int(sum(lengths)), "documents": len(lengths)}))
    return int(sum(lengths))


def committed_shard(work: Path, index: int, plan: str) -> bool:
    """Whether shard ``index`` of the prepare ``plan`` was committed (a killed prepare keeps
    the shards it committed)."""
    try:
        record = json.loads(_shard(work, index, "json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("plan") == plan


class _Writer:
    """One array file of the store, appended in pieces and hashed as it is written."""

    def __init__(self, path: Path):
        self.path, self.file = path, open(path, "wb")  # noqa: SIM115 (closed in close())
        self.digest, self.size = hashlib.sha256(), 0

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.digest.update(data)
        self.size += len(data)

    def copy(self, source: Path) -> None:
        with open(source, "rb") as f:
            while chunk := f.read(_CHUNK):
                self.write(chunk)

    def close(self) -> dict:
        self.file.close()
        return {"bytes": self.size, "sha256": self.digest.hexdigest()}


def _chat_split(work: Path, shards: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Each example's validation flag (the ``val_count`` examples with the smallest SHA-256 of
    their record, as :func:`~effijax.data.split_records` chooses) and trained-token count."""
    keys = b"".join(_shard(work, i, "keys").read_bytes() for i in range(shards))
    trained = np.concatenate([np.fromfile(_shard(work, i, "trained"), np.int64)
                              for i in range(shards)])
    digests = np.frombuffer(keys, "S32")
    if len(digests) < 2:
        raise ConfigError("data", len(digests), "records: at least 2 are needed (one is held "
                          "out for validation)")
    val = np.zeros(len(digests), np.uint8)
    val[np.argsort(digests, kind="stable")[:val_count(len(digests), val_fraction)]] = 1
    return val, trained


def assemble(work: Path, out: Path, shards: int, head: dict) -> Path:
    """Joins the committed shards ``0..shards-1`` of ``work`` into the store ``out``: written
    under a temporary name and renamed into place (:func:`effijax.atomic.replace_dir`), so
    ``out`` is the old store or the new one, never half of one. ``head`` is the manifest's
    description (data_format, dtype, tokenizer, sources, val_fraction, ...).

    Returns:
      ``out``.
    """
    tmp = atomic.fresh_dir(out)
    files, tokens, docs = {}, 0, 0
    offsets = _Writer(tmp / "offsets.bin")
    offsets.write(np.zeros(1, np.int64).tobytes())
    writers = {"tokens.bin": _Writer(tmp / "tokens.bin")}
    if head["data_format"] == "chat":
        writers["mask.bin"] = _Writer(tmp / "mask.bin")
    for i in range(shards):
        writers["tokens.bin"].copy(_shard(work, i, "tokens"))
        if "mask.bin" in writers:
            writers["mask.bin"].copy(_shard(work, i, "mask"))
        lengths = np.fromfile(_shard(work, i, "lengths"), np.int64)
        offsets.write((tokens + np.cumsum(lengths)).astype(np.int64).tobytes())
        tokens, docs = tokens + int(lengths.sum()), docs + len(lengths)
    files["offsets.bin"] = offsets.close()
    files |= {name: w.close() for name, w in writers.items()}
    fraction = head["val_fraction"]
    if head["data_format"] == "chat":
        val, trained = _chat_split(work, shards, fraction)
        flags = _Writer(tmp / "val.bin")
        flags.write(val.tobytes())
        files["val.bin"] = flags.close()
        split = {"val_fraction": fraction, "train_examples": int(len(val) - val.sum()),
                 "val_examples": int(val.sum()),
                 "train_trained_tokens": int(trained[val == 0].sum()),
                 "val_trained_tokens": int(trained[val == 1].sum())}
    else:
        if tokens < 2:
            raise ConfigError("data", tokens, "tokens: at least 2 are needed (one is held out "
                              "for validation)")
        n_val = val_count(tokens, fraction)
        split = {"val_fraction": fraction, "train_tokens": tokens - n_val, "val_tokens": n_val}
    manifest = {**head, "format": STORE_FORMAT, "version": STORE_VERSION, "tokens": tokens,
                "documents": docs, "split": split, "files": dict(sorted(files.items()))}
    manifest["sha256"] = _manifest_digest(manifest)
    atomic.write_text(tmp / _MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    atomic.replace_dir(tmp, out)
    return out


def remove_work(work: Path) -> None:
    """Removes a finished prepare's shards."""
    shutil.rmtree(work, ignore_errors=True)
