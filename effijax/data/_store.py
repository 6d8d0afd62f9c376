"""A tokenized store: a corpus tokenized once, memory-mapped by every run that trains on it.

A store is a folder of flat little-endian arrays and a ``manifest.json``:

* ``tokens.bin``: every token, documents (or chat examples) one after the other, as ``uint8``
  (bytes), ``uint16`` (a vocabulary that fits) or ``uint32``;
* ``offsets.bin``: ``int64[documents + 1]``, where each document starts;
* chat only: ``mask.bin`` (``uint8`` per token, 1 on the assistant's tokens, rendered and masked
  when the store was prepared) and ``val.bin`` (``uint8`` per example, 1 = validation);
* ``manifest.json``: the format version, the tokenizer's fingerprint, each source file with its
  SHA-256, the token and document counts, the split, each array file's size and SHA-256, and the
  store's own ``sha256`` (of the manifest without it, so of everything).

Why flat arrays and not ArrayRecord or Grain: training draws random windows anywhere in a token
stream (a window crosses documents, as in pretraining), which a flat array serves with one
slice of a memory map and no per-record decoding; ArrayRecord stores records, so a window would
gather and decode several of them. ``np.memmap`` needs nothing beyond numpy, opens in constant
time whatever the size, and the page cache shares it between the processes of a host. The
batches stay a pure function of ``(seed, step)`` (:func:`~effijax.data.batch_at`), which is
what Grain's sampler state would otherwise hold.

:func:`open_store` opens a store without reading its arrays (a size check against the
manifest, never a hash: start-up does not grow with the corpus; :func:`verify_store` hashes);
a batch's reads unmap what they mapped (:func:`release_pages`), so a long run's RSS stays one
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
from pathlib import Path
from typing import NamedTuple

import numpy as np

from effijax import atomic
from effijax.data._chat import Packed
from effijax.data._corpus import val_count
from effijax.data._files import read_json
from effijax.errors import ConfigError, FileError

__all__ = ["STORE_FORMAT", "STORE_VERSION", "Store", "token_dtype", "is_store", "open_store",
           "verify_store", "store_split", "store_rows", "commit_shard", "committed_shard",
           "assemble", "remove_work", "release_pages"]

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
        """``"store:<sha256>"``: what a run records as its data's identity."""
        return f"store:{self.manifest['sha256']}"


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


def _map(path: Path, dtype, count: int) -> np.ndarray:
    size = os.stat(path).st_size if path.exists() else None
    if size != count * np.dtype(dtype).itemsize:
        raise FileError(path, "file", f"is {size} bytes; the manifest says "
                        f"{count * np.dtype(dtype).itemsize:,} ({count:,} x {np.dtype(dtype)}): "
                        "the store is damaged; prepare it again")
    if not count:
        return np.zeros(0, dtype)
    array = np.memmap(path, dtype=dtype, mode="r", shape=(count,))
    # Training reads windows at random places: no read-ahead (megabytes per fault on some
    # disks) for pages that are not in the page cache yet.
    with contextlib.suppress(OSError, ValueError):
        array.base.madvise(mmap.MADV_RANDOM)
    return array


def open_store(path: str | os.PathLike) -> Store:
    """The store at ``path``, its arrays memory-mapped (nothing read but the manifest).

    Raises:
      FileError: no manifest, another format or version, an array file of the wrong size.
    """
    path = Path(path)
    manifest = read_json(path / _MANIFEST)
    if manifest.get("format") != STORE_FORMAT:
        raise FileError(path / _MANIFEST, "format", f"{manifest.get('format')!r}; expected "
                        f"{STORE_FORMAT!r} (a folder written by effijax data prepare)")
    if manifest.get("version") != STORE_VERSION:
        raise FileError(path / _MANIFEST, "version", f"{manifest.get('version')!r}; this "
                        f"effijax reads version {STORE_VERSION}: prepare the store again")
    n, docs = manifest["tokens"], manifest["documents"]
    tokens = _map(path / "tokens.bin", manifest["dtype"], n)
    offsets = _map(path / "offsets.bin", np.int64, docs + 1)
    if manifest.get("data_format") != "chat":
        return Store(path, manifest, tokens, offsets)
    return Store(path, manifest, tokens, offsets, _map(path / "mask.bin", np.uint8, n),
                 _map(path / "val.bin", np.uint8, docs))


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


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


def verify_store(path: str | os.PathLike) -> str:
    """Hashes every array of the store against its manifest; returns the store's sha256.

    Raises:
      FileError: an array or the manifest does not match its recorded hash.
    """
    store = open_store(path)
    for name, entry in store.manifest["files"].items():
        if _file_digest(store.path / name) != entry["sha256"]:
            raise FileError(store.path / name, "sha256", "differs from the manifest: the store "
                            "was changed or damaged; prepare it again")
    if _manifest_digest(store.manifest) != store.manifest["sha256"]:
        raise FileError(store.path / _MANIFEST, "sha256", "differs from the manifest's content")
    return store.manifest["sha256"]


def store_split(store: Store) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)`` token streams of a text (or bytes) store: views of its memory map.

    Example:
      >>> import numpy as np, tempfile, pathlib
      >>> work = pathlib.Path(tempfile.mkdtemp())
      >>> commit_shard(work, 0, "p", np.arange(100, dtype=np.uint8), np.array([100]))
      >>> head = {"data_format": "bytes", "dtype": "uint8", "val_fraction": 0.1}
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


def store_rows(store: Store, *, val: bool, seq_len: int, pad_id: int) -> Packed:
    """A chat store's training (or validation) examples as :class:`~effijax.data.Packed` rows
    of ``seq_len + 1``: the rows ``pack_examples`` packs from the same examples, each row built
    when a batch draws it. Only the row layout (one int per example) is held in memory.

    ``filled``, ``examples`` and ``truncated`` are exact; the rows' arrays are not arrays (so
    :attr:`~effijax.data.Packed.trained_tokens` is not available: the manifest counts them).
    """
    order = np.flatnonzero(np.asarray(store.val) == (1 if val else 0))
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
