"""One way in for data (issue #51) for `effijax eval`: DATA is read by the reader training reads
it with. Text and JSONL files larger than MEMORY_BYTES are scored from the token store training
prepares of them in the cache, a store prepared by `effijax data prepare` is scored whole, and
either gives the rows, and so the loss to the bit, of the file read in memory (text windows,
BOS-led windows, chat records packed in order); the rows of a store are built a batch at a time,
so the host memory of an evaluation does not grow with its data."""

import dataclasses
import os
import pathlib

import jax
import numpy as np
import pytest
from _llama_files import VOCAB_SIZE, chat_tokenizer, write_gguf, write_qa
from test_data_memory import peak_rss, write_text_folder

from effijax.cli import main
from effijax.data import open_store
from effijax.errors import ConfigError
from effijax.models import gpt_config, llama_config
from effijax.recipe import TrainConfig, evaluate_model, train
from effijax.sources import _prepared, load_eval_data, prepare, text_rows
from effijax.sources._data import _text_windows

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEQ = 32
TINY = llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=SEQ)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A text file of a few thousand tokens, 40 chat records, and llama-tiny with the tiny
    tokenizer and its chat template as a GGUF file."""
    d = tmp_path_factory.mktemp("eval")
    (d / "notes.txt").write_text("".join(f"line {i}: the {i * 7 % 13} in the thin\n"
                                         for i in range(120)))
    write_qa(d / "qa.jsonl")
    write_gguf(d / "tiny.gguf", TINY, jax.jit(TINY.init_params)(jax.random.key(0)))
    return d


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """effijax's cache in the test's folder; its prepares on one process (a pool's spawned
    workers take seconds to start)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    real = _prepared.prepare
    monkeypatch.setattr(_prepared, "prepare", lambda *a, **kw: real(*a, **{**kw,
                                                                          "processes": 1}))
    return tmp_path / "cache" / "effijax" / "stores"


def _spec_rows(stream, seq_len, first):
    """The rows text_rows gives, as a plain loop over the stream: a row is ``first`` and the
    next ``seq_len`` tokens (a document's own ``first`` leading a row is read, untrained, and
    the ``seq_len`` after it), or without ``first`` a window of ``seq_len + 1``."""
    rows, at = [], 0
    while at < len(stream) - (first is None):
        if first is None:
            body = list(stream[at:at + seq_len + 1])
            rows.append((body, [0] + [1] * (len(body) - 1)))
            at += seq_len
            continue
        own = int(stream[at] == first)
        body = list(stream[at + own:at + own + seq_len])
        if body:
            rows.append(([first, *body], [0] + [1] * len(body)))
        at += own + seq_len
    return rows


def test_windows_built_a_batch_at_a_time_are_the_rows_of_the_whole(tmp_path):
    """The lazy rows of a memory-mapped stream (any order of rows asked) equal text_rows' and
    the plain loop's, with and without a BOS, BOS at row starts and within rows."""
    rng = np.random.default_rng(0)
    mapped = tmp_path / "stream.bin"
    for trial in range(300):
        stream = rng.integers(0, 5, int(rng.integers(2, 70))).astype(np.uint16)
        seq_len, first = int(rng.integers(1, 9)), None if trial % 3 == 0 else 2
        stream.tofile(mapped)
        lazy = _text_windows(np.memmap(mapped, np.uint16, "r"), seq_len, pad_id=7, first=first)
        whole = text_rows(stream, seq_len, pad_id=7, first=first)
        spec = _spec_rows(stream.tolist(), seq_len, first)
        assert len(lazy) == len(whole) == len(spec) and lazy.filled == whole.filled == len(stream)
        want = np.full((len(spec), seq_len + 1), 7)
        mask = np.zeros_like(want)
        for r, (row, m) in enumerate(spec):
            want[r, :len(row)], mask[r, :len(m)] = row, m
        order = rng.permutation(len(spec))
        np.testing.assert_array_equal(whole.tokens_NW, want)
        np.testing.assert_array_equal(whole.mask_NW, mask)
        np.testing.assert_array_equal(lazy.tokens_NW[order], want[order])
        np.testing.assert_array_equal(lazy.mask_NW[order], mask[order])
        assert lazy.tokens_NW[order].dtype == np.int32


def _rows_equal(a, b):
    index = np.arange(len(a))
    for field in ("tokens_NW", "mask_NW", "segments_NW"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None), field
        if x is not None:
            np.testing.assert_array_equal(x[index], y[index], err_msg=field)
    assert (len(a), a.filled, a.examples) == (len(b), b.filled, b.examples)


def test_a_store_gives_the_rows_of_its_file(files, tmp_path):
    """load_eval_data of a store prepared from a file (bytes, text, BOS-led text, chat) gives
    the file's rows in memory: every row, in order."""
    tok = chat_tokenizer()
    llama = dataclasses.replace(TINY, tokenizer=tok)
    bos = dataclasses.replace(llama, tokenizer=dataclasses.replace(tok, add_bos=True))
    cases = {"bytes": (gpt_config("tiny", seq_len=SEQ), "notes.txt"),
             "text": (llama, "notes.txt"), "bos": (bos, "notes.txt"), "chat": (llama, "qa.jsonl")}
    for name, (model, file) in cases.items():
        store = tmp_path / f"{name}.store"
        prepare(files / file, store, tokenizer=getattr(model, "tokenizer", None), processes=1)
        raw, raw_print, raw_format = load_eval_data(str(files / file), model)
        mapped, fingerprint, fmt = load_eval_data(str(store), model)
        assert fmt == raw_format == ("text" if name == "bos" else name), name
        assert fingerprint == f"store:{open_store(store).manifest['sha256']}" != raw_print
        _rows_equal(raw, mapped)
        assert len(raw) > 4 and (name != "bos" or (raw.tokens_NW[:, 0] == 1).all())


@pytest.mark.parametrize("name", ["notes.txt", "qa.jsonl"])
def test_eval_of_a_store_or_of_large_data_is_the_eval_of_the_file(name, files, cache, tmp_path,
                                                                 monkeypatch):
    """The loss to the bit: `effijax eval` of the file read in memory, of the store `effijax
    data prepare` wrote of it, and of the file as data larger than MEMORY_BYTES (scored from
    the store training prepares in the cache, under the file's identity)."""
    gguf, data = str(files / "tiny.gguf"), str(files / name)
    raw = evaluate_model(gguf, data, batch_size=3, seq_len=SEQ)
    assert raw.rows > 8 and raw.rows % 3  # batches, the last one filled with unscored rows
    store = tmp_path / "prepared.store"
    assert main(["data", "prepare", data, "--out", str(store), "--from", gguf,
                 "--processes", "1"]) == 0
    prepared = evaluate_model(gguf, str(store), batch_size=3, seq_len=SEQ)
    same = ("loss", "perplexity", "tokens", "rows", "seq_len", "format", "precision")
    assert [getattr(prepared, k) for k in same] == [getattr(raw, k) for k in same]
    assert prepared.fingerprint.startswith("store:")
    assert not cache.exists()  # small data is read in memory, as training reads it
    monkeypatch.setattr(_prepared, "MEMORY_BYTES", 0)
    lines = []
    large = evaluate_model(gguf, data, batch_size=3, seq_len=SEQ, say=lines.append)
    assert large == raw  # the file's fingerprint too
    cached = list(cache.glob("*.store"))
    assert len(cached) == 1 and any(line.startswith(f"preparing {data} into {cached[0]}")
                                    for line in lines), lines
    assert open_store(cached[0]).manifest["content"] == raw.fingerprint


def test_eval_refuses_parquet_and_names_the_prepare(tmp_path):
    (tmp_path / "docs.parquet").write_bytes(b"PAR1")
    with pytest.raises(ConfigError, match=r"holds Parquet/Arrow data \(docs\.parquet\); effijax "
                                        r"eval reads text or chat JSONL files, or a token "
                                        r"store: prepare one first \(effijax data prepare "):
        load_eval_data(str(tmp_path / "docs.parquet"), gpt_config("tiny", seq_len=SEQ))


# Host memory ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_host_memory_of_an_eval_does_not_grow_with_its_text(tmp_path):
    """`effijax eval --from RUN DIR` on 256 MiB of text files (one of them 96 MiB) peaks within
    150 MB of the same evaluation on 2 MiB (read whole, the text windows alone were 8 bytes a
    token: 2 GB)."""
    run = tmp_path / "run"
    train(TrainConfig(model="tiny", seq_len=64, steps=1, batch_size=2, eval_batches=0,
                      progress=False, out=str(run)))
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XDG_CACHE_HOME": str(cache)}
    peaks = {}
    for name, size, big in (("small", 2 * 2**20, 0), ("large", 256 * 2**20, 96 * 2**20)):
        write_text_folder(tmp_path / name, size, big=big)
        peaks[name], out = peak_rss(["eval", "--from", str(run), str(tmp_path / name),
                                     "--max-batches", "2", "--json"], env)
        assert '"format": "bytes"' in out and '"rows": 16' in out, out
        assert len(list(cache.glob("effijax/stores/*.store"))) == (name == "large")
    assert peaks["large"] - peaks["small"] < 150 * 2**20, peaks
