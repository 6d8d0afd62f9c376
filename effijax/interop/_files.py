"""The files of a Hugging Face model directory, checked before anything trusts them.

A model directory is read by several parsers (JSON, safetensors, the tokenizers library), each
of which fails in its own way on a damaged file, or believes a forged number: a safetensors
header may declare 2^62 bytes, an index may point at ``../../etc/passwd``, a ``config.json``
may ask for 10^9 layers. Here every file is checked first, bounded by its own size and by sane
limits, and any failure is one :class:`~effijax.errors.FileError` naming the file, the field
(or tensor, or byte) and what was expected:

* :func:`~effijax.data.read_json`: a regular file, not too large, UTF-8 JSON, an object.
* :func:`safetensors_header`: the header's length within the file and 100 MB, each tensor's
  dtype known, shape a list of whole numbers, bytes inside the data and apart from the others.
* :func:`shard_files`: ``model.safetensors.index.json``'s ``weight_map`` names files inside the
  model directory (no ``..``, no absolute path, no link out of it); :func:`model_file`: the
  directory's own files (``config.json``, ``model.safetensors``, the tokenizer files) are no
  links out of it either.
* :func:`check_size`: an architecture's sizes within :data:`LIMITS` before anything is built.
* the tokenizer files' fields are checked where they are read
  (:meth:`effijax.models.Tokenizer.load`).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from typing import Any, NamedTuple

from effijax.data import read_json, regular_size
from effijax.errors import ConfigError, FileError, whole_number

__all__ = ["LIMITS", "MAX_PARAMS", "MAX_CONFIG_BYTES", "SafetensorsTensor",
           "safetensors_header", "shard_files", "model_file", "check_finite", "check_size",
           "whole_field", "number_field", "DTYPE_BYTES", "is_gguf"]


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file that starts as a GGUF file does (``b"GGUF"``).

    Example:
      >>> import tempfile
      >>> with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
      ...     _ = f.write(b"GGUF" + bytes(20)); f.flush()
      ...     is_gguf(f.name), is_gguf(tempfile.gettempdir())
      (True, False)
    """
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"

#: The largest size of each architecture field effijax believes a file about (far above any
#: released model: Llama 3.1 405B has 126 layers, a 128,256 vocabulary and 16,384 wide layers).
LIMITS: dict[str, int] = {
    "vocab_size": 10_000_000, "d_model": 2**17, "n_layers": 1000, "n_heads": 2**12,
    "n_kv_heads": 2**12, "head_dim": 2**12, "d_ff": 2**20, "max_position": 2**24,
}
#: The most parameters a model read from a file may have (checked before anything is built).
MAX_PARAMS = 10**13

#: The largest config.json or shard index read (a real one is a few KB).
MAX_CONFIG_BYTES = 16 * 2**20
_MAX_HEADER = 100 * 2**20  # a safetensors JSON header (a real one is a few hundred KB)

#: safetensors' dtypes and their sizes in bytes.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


class SafetensorsTensor(NamedTuple):
    """One tensor of a safetensors file: its dtype name (``"F32"``) and shape."""

    dtype: str
    shape: tuple[int, ...]


def _whole(n, minimum: int = 0) -> bool:
    """A JSON whole number (not a bool, not 2.0) of at least ``minimum`` (for checks over many
    values; :func:`~effijax.errors.whole_number` is the one that raises)."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= minimum


def _header_tensor(path: str, name: str, entry, data_size: int) -> tuple[int, int]:
    """Checks one header entry; returns its ``(begin, end)`` in the data section."""
    if not isinstance(entry, dict):
        raise FileError(path, f"tensor {name!r}", "expected an object with dtype, shape and "
                        "data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise FileError(path, f"tensor {name!r}", f"dtype {dtype!r}; expected one of "
                        f"{', '.join(DTYPE_BYTES)}")
    if not isinstance(shape, list) or not all(_whole(n) and n < 2**53 for n in shape):
        raise FileError(path, f"tensor {name!r}", f"shape {shape!r}; expected a list of "
                        "whole numbers >= 0")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_whole(n) for n in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_size):
        raise FileError(path, f"tensor {name!r}", f"data_offsets {offsets!r}; expected "
                        f"[begin, end] with 0 <= begin <= end <= {data_size:,} (the data "
                        "section's size)")
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise FileError(path, f"tensor {name!r}", f"data_offsets {offsets} span "
                        f"{offsets[1] - offsets[0]:,} bytes; its shape {shape} of {dtype} "
                        f"needs {nbytes:,}")
    return offsets[0], offsets[1]


def _header_json(path: str, f, size: int) -> dict:
    """The JSON header of an open safetensors file of ``size`` bytes."""
    if size < 8:
        raise FileError(path, "byte 0", f"the file has {size} bytes; a safetensors file starts "
                        "with an 8-byte header length")
    (length,) = struct.unpack("<Q", f.read(8))
    if length > min(size - 8, _MAX_HEADER):
        raise FileError(path, "header length", f"{length:,} bytes; expected at most "
                        f"{min(size - 8, _MAX_HEADER):,} (the file's size, and 100 MB)")
    raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise FileError(path, "header", f"is not a JSON object ({e})") from None
    if not isinstance(header, dict):
        raise FileError(path, "header", f"is a {type(header).__name__}; expected a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FileError(path, "__metadata__", "expected an object of strings")
    return header


def safetensors_header(path: str | os.PathLike) -> dict[str, SafetensorsTensor]:
    """The tensors a safetensors file declares, each checked against the file (see the module
    docstring), without reading any tensor.

    Example:
      >>> import tempfile, os
      >>> import numpy as np, safetensors.numpy
      >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
      >>> safetensors.numpy.save_file({"w": np.zeros((2, 3), np.float32)}, path)
      >>> safetensors_header(path)
      {'w': SafetensorsTensor(dtype='F32', shape=(2, 3))}
    """
    path = os.fspath(path)
    size = regular_size(path)
    with open(path, "rb") as f:
        header = _header_json(path, f, size)
        data_size = size - f.tell()  # what follows the header
    spans = sorted((_header_tensor(path, name, entry, data_size), name)
                   for name, entry in header.items())
    for (a, first), (b, second) in zip(spans, spans[1:], strict=False):
        if a[1] > b[0]:
            raise FileError(path, f"tensor {second!r}", f"its bytes {list(b)} overlap tensor "
                            f"{first!r}'s {list(a)}")
    return {name: SafetensorsTensor(entry["dtype"], tuple(entry["shape"]))
            for name, entry in header.items()}


def _roots(directory: str) -> list[str]:
    """Where a model directory's files may really be: inside it, and for a snapshot of the
    Hugging Face cache (``<repo>/snapshots/<revision>``), whose files are links to
    ``<repo>/blobs/<hash>``, in that ``blobs`` folder too."""
    root = os.path.realpath(directory)
    parent = os.path.dirname(os.path.abspath(directory))
    if os.path.basename(parent) == "snapshots":
        return [root, os.path.realpath(os.path.join(parent, os.pardir, "blobs"))]
    return [root]


def _within(path: str, roots: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(os.path.commonpath([real, root]) == root for root in roots)


def model_file(directory: str | os.PathLike, name: str) -> str:
    """The path of a model directory's own file ``name`` (``config.json``, ``tokenizer.json``,
    ``model.safetensors``, ...), which, when it exists, must really be inside the directory: a
    link out of it (to ``/dev/zero``, to another model's file) is refused as a shard index's is
    (a Hugging Face cache snapshot's links into its ``blobs`` are its own).

    Example:
      >>> import os, tempfile
      >>> d = tempfile.mkdtemp()
      >>> os.symlink("/dev/zero", os.path.join(d, "model.safetensors"))
      >>> model_file(d, "config.json") == os.path.join(d, "config.json")  # absent is fine
      True
      >>> model_file(d, "model.safetensors")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      effijax.errors.FileError: .../model.safetensors: file: is a link to /dev/zero, outside ...
    """
    directory = os.fspath(directory)
    path = os.path.join(directory, name)
    if os.path.lexists(path) and not _within(path, _roots(directory)):
        raise FileError(path, "file", f"is a link to {os.path.realpath(path)}, outside the "
                        "model directory; expected a file inside it (copy the file in)")
    return path


def _inside(directory: str, roots: list[str], index: str, name: str, file) -> str:
    """The path of a shard ``file`` the index names, which must stay inside ``directory``."""
    if not isinstance(file, str) or not file:
        raise FileError(index, f"weight_map[{name!r}]", f"{file!r}; expected a file name")
    if os.path.isabs(file) or ".." in file.replace("\\", "/").split("/"):
        raise FileError(index, f"weight_map[{name!r}]", f"{file!r} leaves the model "
                        "directory; expected a file name inside it")
    path = os.path.join(directory, file)
    if not _within(path, roots):
        raise FileError(index, f"weight_map[{name!r}]", f"{file!r} is a link out of the model "
                        "directory; expected a file inside it")
    if not os.path.isfile(path):
        raise FileError(index, f"weight_map[{name!r}]", f"{file!r} does not exist in the model "
                        "directory")
    return path


def shard_files(directory: str, index: str) -> dict[str, str]:
    """``{tensor name: shard path}`` from a ``model.safetensors.index.json``, every shard
    inside ``directory``.

    Example:
      >>> import tempfile, os, json
      >>> d = tempfile.mkdtemp()
      >>> with open(os.path.join(d, "index.json"), "w") as f:
      ...     json.dump({"weight_map": {"w": "../../etc/passwd"}}, f)
      >>> shard_files(d, os.path.join(d, "index.json"))  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      effijax.errors.FileError: .../index.json: weight_map['w']: '../../etc/passwd' leaves ...
    """
    weight_map = read_json(index, limit=MAX_CONFIG_BYTES).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise FileError(index, "weight_map", "expected an object of tensor name -> file name")
    roots = _roots(directory)
    return {name: _inside(directory, roots, index, name, file)
            for name, file in weight_map.items()}


def whole_field(fields: Mapping[str, Any], key: str, limit: str, path: str, default=None) -> int:
    """``fields[key]`` as a whole number from 1 to ``LIMITS[limit]`` (``default`` when absent
    or None), else a :class:`FileError` naming ``path`` and ``key``: ``64.7`` is refused, not
    truncated.

    Example:
      >>> whole_field({"hidden_size": 64.7}, "hidden_size", "d_model", "config.json")
      Traceback (most recent call last):
      ...
      effijax.errors.FileError: config.json: hidden_size=64.7: must be an integer from 1 to 131,072
    """
    value = fields.get(key)
    if value is None:
        if default is None:
            raise FileError(path, key, "missing; expected a whole number")
        return default
    try:
        return whole_number(key, value, maximum=LIMITS[limit])
    except ConfigError as e:
        raise FileError.of(path, e) from None


def number_field(fields: Mapping[str, Any], key: str, path: str,
                 default: float | None = None) -> float:
    """``fields[key]`` as a positive finite float (``default`` when absent or None; required
    when ``default`` is None), else a :class:`FileError` naming ``path`` and ``key``.

    Example:
      >>> number_field({"rope_theta": "1e4"}, "rope_theta", "config.json", 1.0)
      Traceback (most recent call last):
      ...
      effijax.errors.FileError: config.json: rope_theta='1e4': expected a positive finite number
    """
    value = fields.get(key)
    if value is None:
        if default is None:
            raise FileError(path, key, "missing; expected a positive number")
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value <= 0:
        raise FileError(path, f"{key}={value!r}", "expected a positive finite number")
    return float(value)


def check_finite(path: str, name: str, w):
    """``w``, a tensor read from ``path``, when every entry is finite; else a
    :class:`FileError` (a damaged or forged file decodes to NaN or infinity, which no released
    weight holds).

    Example:
      >>> import numpy as np
      >>> check_finite("m.gguf", "w", np.array([1.0, np.inf]))
      Traceback (most recent call last):
      ...
      effijax.errors.FileError: m.gguf: tensor 'w': holds 1 NaN or infinite value(s)
    """
    import numpy as np

    bad = int(w.size - np.count_nonzero(np.isfinite(w)))
    if bad:
        raise FileError(path, f"tensor {name!r}", f"holds {bad:,} NaN or infinite value(s)")
    return w


def check_size(model, path: str) -> None:
    """Refuses an architecture above :data:`MAX_PARAMS` parameters, before anything is built.

    Example:
      >>> from effijax.models import llama_config
      >>> check_size(llama_config("llama-2-70b"), "config.json")  # well under the bound
    """
    if model.num_params > MAX_PARAMS:
        raise FileError(path, "architecture", f"describes {model.num_params:,} parameters; "
                        f"expected at most {MAX_PARAMS:,}")
