"""A GGUF file's layout, checked before anything trusts it.

A GGUF file is a header (magic, version, tensor and key/value counts), the key/value metadata,
one record per tensor (name, dimensions, type, offset) and, aligned, the tensor data. Every
count, length and offset in it is a number a damaged or forged file can set to anything; a
reader that believes them loops or allocates without bound (a 437 KB file declaring 10^9 of
something). :func:`check_gguf` walks the layout with each number bounded by the bytes that are
actually left and by sane limits, and checks that every tensor's bytes lie inside the file,
aligned and apart from the others, before anything reads it. A failure is one
:class:`~effijax.errors.FileError` naming the file, the field or byte offset and what was
expected.

:func:`read_gguf` is the same walk keeping what it reads: the metadata as Python values and each
tensor as a view into the memory-mapped file (the layout ``gguf.GGUFReader`` gives: F32, F16,
F64 and integer tensors as their numbers, block types as their bytes). It replaces the reader,
which builds a numpy view per metadata item: 27 s for Gemma 3's 262,144-token vocabulary, where
this walk takes about a second.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections import Counter
from typing import Any, NamedTuple

import numpy as np

from effijax.errors import FileError

__all__ = ["check_gguf", "read_gguf", "gguf_value", "GgufTensor", "GgufArray", "GgufFile",
           "MAX_STRING", "MAX_ITEMS", "MAX_TENSORS"]

#: The longest string a GGUF may hold (a chat template is tens of KB; a key far less).
MAX_STRING = 16 * 2**20
#: The most entries of one metadata array (vocabularies are < 10^6 tokens).
MAX_ITEMS = 2**24
#: The most tensors and key/value pairs in one file.
MAX_TENSORS = 2**20
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
_MAX_DEPTH = 2  # an array of arrays at most

# GGUF's value types: struct format of the fixed-size ones; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9


class GgufTensor(NamedTuple):
    """One tensor record: ``shape`` in ggml order (fastest dimension first), ``start`` and
    ``nbytes`` of its data, absolute in the file."""

    name: str
    shape: tuple[int, ...]
    type: int
    start: int
    nbytes: int


class GgufArray(NamedTuple):
    """One tensor of a :class:`GgufFile`: ``shape`` in ggml order (fastest dimension first),
    its ``tensor_type`` (a ``gguf.GGMLQuantizationType``) and ``data``, a read-only view into
    the memory-mapped file: the numbers (F32, F16, F64, I8-I64) in torch's order, or the blocks'
    bytes, one row per output row."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any
    data: np.ndarray


class GgufFile(NamedTuple):
    """A GGUF file read by :func:`read_gguf`: ``metadata`` (key: Python value; arrays are lists)
    and ``tensors`` (:class:`GgufArray`, in the file's order)."""

    metadata: dict
    tensors: list[GgufArray]


# The numbers a tensor of these ggml types holds; every other type is read as its bytes.
_NUMBERS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
            "I16": np.int16, "I32": np.int32, "I64": np.int64}


class _Cursor:
    """Reads little- or big-endian numbers and strings from a buffer, each bounded by what is
    left of it; every failure names the file and what was being read."""

    def __init__(self, buffer, path: str, endian: str):
        self.buffer, self.path, self.endian, self.at = buffer, path, endian, 0

    def fail(self, where: str, problem: str):
        raise FileError(self.path, where, problem)

    def need(self, n: int, what: str) -> None:
        left = len(self.buffer) - self.at
        if n > left:
            self.fail(f"byte {self.at:,}", f"{what} needs {n:,} bytes but only {left:,} are "
                      "left (the file is truncated or the field is forged)")

    def number(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        self.need(size, what)
        value = struct.unpack_from(self.endian + fmt, self.buffer, self.at)[0]
        self.at += size
        return value

    def count(self, what: str, minimum_size: int, maximum: int) -> int:
        """A uint64 count of items of at least ``minimum_size`` bytes each, which must fit in
        what is left of the file and stay under ``maximum``."""
        at = self.at
        n = self.number("Q", what)
        fits = (len(self.buffer) - self.at) // max(minimum_size, 1)
        if n > min(maximum, fits):
            self.fail(f"byte {at:,}", f"{what} is {n:,}; expected at most "
                      f"{min(maximum, fits):,} (the limit is {maximum:,}, and the "
                      f"{len(self.buffer) - self.at:,} bytes left hold at most {fits:,})")
        return n

    def string(self, what: str) -> str:
        at = self.at
        n = self.count(f"the length of {what}", 1, MAX_STRING)
        raw = bytes(self.buffer[self.at:self.at + n])
        self.at += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"byte {at:,}", f"{what} is not UTF-8 text")

    def value(self, kind: int, what: str, depth: int = 0):
        """One metadata value of GGUF type ``kind``, as Python reads it (an array: a list)."""
        if kind in _SCALARS:
            return self.number(_SCALARS[kind], what)
        if kind == _STRING:
            return self.string(what)
        if kind == _ARRAY and depth < _MAX_DEPTH:
            item, n = self.array(what)
            if item not in _SCALARS:
                return [self.value(item, f"{what}[{k}]", depth + 1) for k in range(n)]
            dtype = np.dtype(self.endian + _SCALARS[item])  # one read for the whole array
            values = np.frombuffer(self.buffer, dtype, n, self.at).tolist()
            self.at += n * dtype.itemsize
            return values
        self.unknown(what, kind)

    def array(self, what: str) -> tuple[int, int]:
        """An array's item type and length; the bytes of an array of numbers checked to be
        there."""
        item = self.number("I", f"the item type of {what}")
        if item not in _SCALARS and item not in (_STRING, _ARRAY):
            self.fail(what, f"unknown array item type {item}; expected one of 0-12")
        size = struct.calcsize(_SCALARS[item]) if item in _SCALARS else 8
        n = self.count(f"the length of {what}", size, MAX_ITEMS)
        if item in _SCALARS:
            self.need(n * size, what)
        return item, n

    def unknown(self, what: str, kind: int):
        self.fail(what, f"unknown value type {kind}; expected one of 0-12 (arrays nested at "
                  f"most {_MAX_DEPTH} deep)")

    def skip_value(self, kind: int, what: str, depth: int = 0) -> None:
        """Steps over one metadata value of GGUF type ``kind``."""
        if kind in _SCALARS:
            self.need(struct.calcsize(_SCALARS[kind]), what)
            self.at += struct.calcsize(_SCALARS[kind])
        elif kind == _STRING:  # stepped over: its length checked, its text not decoded
            n = self.count(f"the length of {what}", 1, MAX_STRING)
            self.at += n
        elif kind == _ARRAY and depth < _MAX_DEPTH:
            item, n = self.array(what)
            if item in _SCALARS:
                self.at += n * struct.calcsize(_SCALARS[item])
            else:
                for k in range(n):
                    self.skip_value(item, f"{what}[{k}]", depth + 1)
        else:
            self.unknown(what, kind)


def _tensor_bytes(path: str, name: str, shape: tuple[int, ...], kind: int) -> int:
    """The bytes of a tensor of ggml type ``kind``: its type must be known and its first
    dimension a whole number of the type's blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        known = sorted(t.value for t in GGML_QUANT_SIZES)
        raise FileError(path, f"tensor {name!r}", f"unknown ggml type {kind}; expected one of "
                        f"the {len(known)} types from {known[0]} (F32) to {known[-1]}") from None
    if shape[0] % block:
        raise FileError(path, f"tensor {name!r}", f"first dimension {shape[0]} is not a "
                        f"multiple of the {GGMLQuantizationType(kind).name} block ({block})")
    return math.prod(shape) // block * size


def _tensor(cursor: _Cursor, k: int) -> tuple[str, tuple[int, ...], int, int]:
    """One tensor record: ``(name, shape in ggml order, type, offset)``."""
    name = cursor.string(f"the name of tensor {k}")
    n_dims = cursor.number("I", f"the dimension count of tensor {name!r}")
    if not 1 <= n_dims <= _MAX_DIMS:
        cursor.fail(f"tensor {name!r}", f"{n_dims} dimensions; expected 1 to {_MAX_DIMS}")
    shape = tuple(cursor.number("Q", f"a dimension of tensor {name!r}") for _ in range(n_dims))
    if not all(1 <= n <= 2**40 for n in shape):
        cursor.fail(f"tensor {name!r}", f"shape {list(shape)}; expected dimensions from 1 "
                    "to 2^40")
    kind = cursor.number("I", f"the type of tensor {name!r}")
    offset = cursor.number("Q", f"the offset of tensor {name!r}")
    return name, shape, kind, offset


def _header(cursor: _Cursor) -> tuple[int, int]:
    """The endianness (set on ``cursor``) and ``(tensor count, key/value count)``."""
    cursor.need(4, "the magic")
    if bytes(cursor.buffer[:4]) != b"GGUF":
        cursor.fail("byte 0", f"starts with {bytes(cursor.buffer[:4])!r}; expected b'GGUF'")
    cursor.at = 4
    version = cursor.number("I", "the version")
    if version & 0xFFFF == 0:  # written on a big-endian machine: the bytes are swapped
        cursor.endian, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in (2, 3):
        cursor.fail("version", f"{version}; effijax reads GGUF versions 2 and 3")
    # A tensor record is at least 32 bytes, a key/value pair at least 13.
    tensors = cursor.count("tensor_count", 32, MAX_TENSORS)
    kvs = cursor.count("kv_count", 13, MAX_TENSORS)
    return tensors, kvs


def _metadata(cursor: _Cursor, kvs: int, values: dict | None = None) -> int:
    """Walks the key/value pairs, keeping each in ``values`` (when given); returns
    ``general.alignment`` (32 when absent)."""
    keys, alignment = set(), 32
    for k in range(kvs):
        key = cursor.string(f"the key of metadata entry {k}")
        if key in keys:
            cursor.fail(key, "appears twice in the metadata")
        keys.add(key)
        kind = cursor.number("I", f"the type of {key}")
        if key == "general.alignment":
            if kind != 4:
                cursor.fail(key, f"has value type {kind}; expected 4 (uint32)")
            alignment = cursor.number("I", key)
            if alignment < 1 or alignment & (alignment - 1) or alignment > 2**16:
                cursor.fail(key, f"{alignment}; expected a power of two up to 65536")
            if values is not None:
                values[key] = alignment
        elif values is not None:
            values[key] = cursor.value(kind, key)
        else:
            cursor.skip_value(kind, key)
    return alignment


def _check_data(cursor: _Cursor, records, alignment: int) -> list[GgufTensor]:
    """Each tensor's bytes inside the file, aligned, and apart from every other's."""
    start = -(-cursor.at // alignment) * alignment
    size = len(cursor.buffer)
    out = []
    for name, shape, kind, offset in records:
        nbytes = _tensor_bytes(cursor.path, name, shape, kind)
        if offset % alignment:
            cursor.fail(f"tensor {name!r}", f"offset {offset:,} is not a multiple of the "
                        f"alignment ({alignment})")
        if start + offset + nbytes > size:
            cursor.fail(f"tensor {name!r}", f"its {nbytes:,} bytes at {start + offset:,} end "
                        f"past the end of the file ({size:,} bytes)")
        out.append(GgufTensor(name, shape, kind, start + offset, nbytes))
    ordered = sorted(out, key=lambda t: t.start)
    for a, b in zip(ordered, ordered[1:], strict=False):
        if a.start + a.nbytes > b.start:
            cursor.fail(f"tensor {b.name!r}", f"its data at {b.start:,} overlaps tensor "
                        f"{a.name!r} ({a.start:,} to {a.start + a.nbytes:,})")
    return out


def _walk(path: str, buffer, values: dict | None) -> tuple[list[GgufTensor], str]:
    """The checked tensor records and the byte order (``<`` or ``>``)."""
    cursor = _Cursor(buffer, path, "<")
    tensors, kvs = _header(cursor)
    alignment = _metadata(cursor, kvs, values)
    records = [_tensor(cursor, k) for k in range(tensors)]
    twice = [n for n, seen in Counter(r[0] for r in records).items() if seen > 1]
    if twice:
        raise FileError(path, f"tensor {twice[0]!r}", "appears twice")
    return _check_data(cursor, records, alignment), cursor.endian


def _open(path: str):
    f = open(path, "rb")  # noqa: SIM115 (closed by the caller's with block)
    if os.fstat(f.fileno()).st_size == 0:
        f.close()
        raise FileError(path, "byte 0", "the file is empty; expected a GGUF header")
    return f


def check_gguf(path: str | os.PathLike) -> list[GgufTensor]:
    """Checks a GGUF file's layout (see the module docstring); returns its tensor records.

    Raises:
      FileError: the first thing wrong, naming the file, the field or byte offset, and what
        was expected.

    Example:
      >>> import tempfile, os
      >>> path = os.path.join(tempfile.mkdtemp(), "x.gguf")
      >>> with open(path, "wb") as f:  # a header declaring 2^40 tensors in 24 bytes
      ...     _ = f.write(b"GGUF" + (3).to_bytes(4, "little") + (2**40).to_bytes(8, "little")
      ...                 + bytes(8))
      >>> check_gguf(path)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      effijax.errors.FileError: .../x.gguf: byte 8: tensor_count is 1,099,511,627,776; expected...
    """
    path = os.fspath(path)
    with _open(path) as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        return _walk(path, buffer, None)[0]


def _array(data: np.ndarray, record: GgufTensor, endian: str) -> GgufArray:
    """A tensor's bytes in ``data`` (the file) as :class:`GgufArray` (a view, nothing copied)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    kind = GGMLQuantizationType(record.type)
    shape = tuple(reversed(record.shape))
    raw = data[record.start:record.start + record.nbytes]
    if kind.name in _NUMBERS:
        values = raw.view(np.dtype(_NUMBERS[kind.name]).newbyteorder(endian)).reshape(shape)
    else:
        values = raw.reshape(quant_shape_to_byte_shape(shape, kind))
    return GgufArray(record.name, record.shape, kind, values)


def gguf_value(path: str | os.PathLike, key: str, default=None):
    """One metadata value of a GGUF file, read without the rest: the other values are stepped
    over (a 262,144-token vocabulary in a fraction of a second), no tensor is read.

    Raises:
      FileError: the header or a value before ``key`` is malformed.

    Example:
      >>> import os, tempfile, gguf
      >>> path = os.path.join(tempfile.mkdtemp(), "x.gguf")
      >>> w = gguf.GGUFWriter(path, "llama")
      >>> w.add_array("tokenizer.ggml.tokens", ["a", "b"]); w.add_string("note", "hi")
      >>> w.write_header_to_file(); w.write_kv_data_to_file(); w.close()
      >>> gguf_value(path, "note"), gguf_value(path, "tokenizer.chat_template")
      ('hi', None)
    """
    path = os.fspath(path)
    with _open(path) as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        cursor = _Cursor(buffer, path, "<")
        _, kvs = _header(cursor)
        for k in range(kvs):
            name = cursor.string(f"the key of metadata entry {k}")
            kind = cursor.number("I", f"the type of {name}")
            if name == key:
                return cursor.value(kind, name)
            cursor.skip_value(kind, name)
    return default


def read_gguf(path: str | os.PathLike) -> GgufFile:
    """A GGUF file's metadata and tensors, its layout checked as :func:`check_gguf` checks it
    (see the module docstring); the tensors' data stay in the file, memory-mapped.

    Raises:
      FileError: as :func:`check_gguf`.

    Example:
      >>> import os, tempfile, gguf, numpy as np
      >>> path = os.path.join(tempfile.mkdtemp(), "x.gguf")
      >>> w = gguf.GGUFWriter(path, "llama")
      >>> w.add_array("tokenizer.ggml.scores", [0.5, -1.0])
      >>> w.add_tensor("w", np.arange(6, dtype=np.float32).reshape(2, 3))
      >>> w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
      >>> f = read_gguf(path)
      >>> f.metadata["general.architecture"], f.metadata["tokenizer.ggml.scores"]
      ('llama', [0.5, -1.0])
      >>> t = f.tensors[0]; t.name, t.shape, t.tensor_type.name, t.data.tolist()
      ('w', (3, 2), 'F32', [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
    """
    path = os.fspath(path)
    metadata: dict = {}
    with _open(path) as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        records, endian = _walk(path, buffer, metadata)
    data = np.memmap(path, np.uint8, mode="r")
    return GgufFile(metadata, [_array(data, r, endian) for r in records])
