"""One way in for data (issue #51): text and JSONL files larger than MEMORY_BYTES train from a
token store prepared in the cache, read the way the in-memory path reads them: the same tokens,
rows and batches, under the same identity (a run resumes whichever way its data is read); a file
is tokenized in blocks (encode_file: the ids of encode_each), so host memory does not grow with
the data."""

import dataclasses
import json
import os
import pathlib
import random
import re
import subprocess
import sys

import numpy as np
import pytest
from _llama_files import VOCAB_SIZE, chat_tokenizer, write_qa

from effijax.data import (
    _documents,
    batch_at,
    content_fingerprint,
    corpus_fingerprint,
    documents_fingerprint,
    encode_each,
    encode_file,
    eval_batches,
    find_sources,
    load_corpus,
    load_documents,
    open_store,
    read_records,
    records_fingerprint,
)
from effijax.errors import ConfigError, FileError
from effijax.models import byte_level_bpe, gpt_config, llama_config
from effijax.recipe import TrainConfig, train
from effijax.sources import _prepared, load_dataset, prepare

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEQ = 32
BYTES = gpt_config("tiny", seq_len=SEQ)


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A folder of text files (one of them a .jsonl file: a document, as the in-memory path
    reads it), and 40 chat records."""
    d = tmp_path_factory.mktemp("corpus")
    (d / "txt").mkdir()
    for i in range(12):
        (d / "txt" / f"{i:02d}.txt").write_text(
            f"document {i}: " + " ".join(f"the {j * i % 17}" for j in range(40 + i)))
    (d / "txt" / "notes.jsonl").write_text('{"text": "a JSONL file among text files"}\n')
    write_qa(d / "qa.jsonl")
    return d


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """effijax's cache in the test's folder; the prepares of this module on one process (a
    pool's spawned workers take seconds to start)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    real = _prepared.prepare
    monkeypatch.setattr(_prepared, "prepare", lambda *a, **kw: real(*a, **{**kw,
                                                                          "processes": 1}))
    return tmp_path / "cache" / "effijax" / "stores"


def _models(tok):
    llama = dataclasses.replace(llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=SEQ),
                                tokenizer=tok)
    bos = dataclasses.replace(llama, tokenizer=dataclasses.replace(tok, add_bos=True))
    return {"bytes": BYTES, "text": llama, "bos": bos}


def _same_batches(a, b, steps=range(6)):
    for step in steps:
        x = batch_at(a, seed=3, step=step, batch_size=4, seq_len=SEQ)
        y = batch_at(b, seed=3, step=step, batch_size=4, seq_len=SEQ)
        assert sorted(x) == sorted(y)
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=f"step {step} {key}")


@pytest.mark.parametrize("case", ["bytes", "text", "bos", "chat", "jsonl as text"])
def test_a_store_trains_on_the_batches_and_identity_of_memory(case, corpus, cache, tok):
    """The same small data read in memory and forced through the store (memory_bytes=0)."""
    models = _models(tok)
    model = models.get(case, models["text"])
    data = corpus / ("txt" if case in models else "qa.jsonl")
    fmt = "text" if case == "jsonl as text" else "auto"
    lines = []
    memory = load_dataset(str(data), model, data_format=fmt)
    path = _prepared.training_data(str(data), getattr(model, "tokenizer", None),
                                   data_format=fmt, memory_bytes=0, print_fn=lines.append)
    assert path != str(data) and pathlib.Path(path).parent == cache, path
    assert lines[0].startswith(f"preparing {data} into {path}")
    mapped = load_dataset(path, model, data_format=fmt)
    assert (mapped.fingerprint, mapped.tokens, mapped.format) == \
        (memory.fingerprint, memory.tokens, memory.format)
    assert not mapped.fingerprint.startswith("store:")  # the files' identity, not the store's
    assert open_store(path).manifest["content"] == memory.fingerprint
    _same_batches(memory.train, mapped.train)
    for part in ("train", "val"):
        for x, y in zip(eval_batches(getattr(memory, part), batch_size=2, seq_len=SEQ,
                                     num_batches=3),
                        eval_batches(getattr(mapped, part), batch_size=2, seq_len=SEQ,
                                     num_batches=3), strict=True):
            for key in x:
                np.testing.assert_array_equal(x[key], y[key], err_msg=f"{part} {key}")
    if case != "chat":
        assert mapped.note.startswith(f"{mapped.format} data: 13 documents" if case in models
                                      else "text data: 1 documents")


def test_a_second_start_reuses_the_store_and_small_data_stays_in_memory(corpus, cache, tok,
                                                                         monkeypatch):
    data = str(corpus / "txt")
    assert _prepared.training_data(data, tok) == data  # 3 KB: read in memory
    assert not cache.exists()
    first = _prepared.training_data(data, tok, memory_bytes=100)
    monkeypatch.setattr(_prepared, "prepare", lambda *a, **kw: pytest.fail("prepared again"))
    lines = []
    assert _prepared.training_data(data, tok, memory_bytes=100, print_fn=lines.append) == first
    assert lines == [f"{data}: its files are unchanged since {first} was prepared from them"]
    # The store read by suffix (effijax data prepare's reading, where notes.jsonl is records)
    # and the one read as in memory are two stores with two names.
    assert _prepared._key(pathlib.Path(data), tok, "text", None, True) in first
    assert _prepared._key(pathlib.Path(data), tok, "text", "text") not in first


def test_what_is_read_in_memory(corpus, tmp_path, tok):
    qa, txt = str(corpus / "qa.jsonl"), str(corpus / "txt")
    base = dataclasses.replace(tok, chat_template=None)
    assert _prepared.in_memory(None, tok, memory_bytes=0)  # the standard library
    assert not _prepared.in_memory(txt, tok, memory_bytes=0)
    assert not _prepared.in_memory(qa, tok, memory_bytes=0)  # chat
    assert _prepared.in_memory(qa, base, memory_bytes=0)  # no template: refused in memory
    assert _prepared.in_memory(qa, None, memory_bytes=0)  # no tokenizer: refused in memory
    assert _prepared.in_memory(txt, tok, "chat", memory_bytes=0)  # chat from a folder: refused
    assert _prepared.in_memory(str(tmp_path / "missing"), tok, memory_bytes=0)
    assert _prepared.in_memory(f"{qa}:1,{txt}:1", tok, memory_bytes=0)  # a mixture
    size = sum(f.stat().st_size for f in (corpus / "txt").iterdir())
    assert _prepared.in_memory(txt, tok, memory_bytes=size)
    assert not _prepared.in_memory(txt, tok, memory_bytes=size - 1)


def test_the_content_fingerprint_is_the_in_memory_one(corpus):
    txt = corpus / "txt"
    assert content_fingerprint(find_sources(txt, kind="text"), "text") == \
        documents_fingerprint(load_documents(txt))
    assert content_fingerprint(find_sources(txt, kind="text"), "bytes") == \
        corpus_fingerprint(load_corpus(txt))
    assert content_fingerprint(find_sources(corpus / "qa.jsonl", kind="jsonl"), "chat") == \
        records_fingerprint(read_records(corpus / "qa.jsonl"))
    by_suffix = {s.name: s.kind for s in find_sources(txt)}
    assert by_suffix["notes.jsonl"] == "jsonl" and by_suffix["00.txt"] == "text"
    with pytest.raises(ConfigError, match=r"^data='.*missing': does not exist; pass a text"):
        find_sources(corpus / "missing", kind="text")


def test_a_forged_content_field_is_refused(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"hello store " * 50)
    manifest = prepare(tmp_path / "a.txt", tmp_path / "s", processes=1, like_memory=True)
    assert manifest["content"] == corpus_fingerprint(load_corpus(tmp_path / "a.txt"))
    plain = prepare(tmp_path / "a.txt", tmp_path / "p", processes=1)
    assert "content" not in plain and plain["sha256"] != manifest["sha256"]
    from effijax.data import _store

    forged = {**manifest, "content": "600:not hex at all"}
    forged["sha256"] = _store._manifest_digest(forged)
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(forged))
    with pytest.raises(FileError, match=r"content='600:not hex at all': expected "
                                        r"\"<count>:<16 hex digits>\""):
        open_store(tmp_path / "s")


# Tokenizing a file in blocks ------------------------------------------------------------------

WORDS = ["the", "cat", "sat.", "x", "\n", "\n\n", " ", "é", "中文", "😀", "12", ".", "\t"]


def _ids_or_error(fn):
    """The ids ``fn`` gives, or its error; the length of a stretch too long to cut read as N
    (reading a file in blocks stops at the first, with the length it has read: "more than")."""
    try:
        return np.concatenate(list(fn())).tolist()
    except ConfigError as e:
        return re.sub(r"has a stretch of (more than )?[\d,]+", "has a stretch of N", str(e))


def test_a_file_in_blocks_gives_the_ids_and_errors_of_the_whole(tmp_path, tok, monkeypatch):
    """encode_file, from blocks of 1 byte up, equals encode_each on the whole file: cut into
    the same pieces (long texts, pieces of 7 and 40 characters), UTF-16/32 after a mark, and
    the same error for bytes that are not UTF-8 (the bad bytes of the whole counted)."""
    letters = byte_level_bpe([chr(c) for c in range(97, 123)] + ["<|endoftext|>", "Ċ", ".",
                                                                  "Ġ"], [],
                             token_types=[1] * 26 + [3, 1, 1, 1])
    rng = random.Random(0)
    f = tmp_path / "a.txt"
    cut = 0
    for tokenizer in (tok, letters):
        for piece in (7, 40):
            monkeypatch.setattr(_documents, "PIECE_CHARS", piece)
            monkeypatch.setattr(_documents, "MAX_PIECE_CHARS", 4 * piece)
            for _ in range(12):
                text = "".join(rng.choice(WORDS) + rng.choice(["", " ", "\n"])
                               for _ in range(rng.randint(0, 150)))
                for encoding in ("utf-8", "utf-16", "utf-32-be"):
                    data = (("\ufeff" if encoding.endswith("be") else "") + text).encode(encoding)
                    f.write_bytes(data)
                    whole = _ids_or_error(lambda d=data, t=tokenizer: encode_each(t, [d],
                                                                                  names=["a"]))
                    cut += isinstance(whole, list) and len(text) > piece
                    for block in (1, 3, 64):
                        got = _ids_or_error(lambda b=block, t=tokenizer: encode_file(
                            t, f, "a", block_bytes=b))
                        assert got == whole, (encoding, piece, block, text)
    assert cut > 20  # most texts were cut into pieces
    for data in ("héllo".encode("utf-16") + b"x",  # a mark, then bytes that are not its text
                 "ab".encode("utf-16") + b"\x00\xd8\x41\x00" + "cd".encode("utf-16-le"),
                 "abc".encode("utf-32") + b"\xff\xff\xff\x7f", b"\xef\xbb\xbfabc\xff"):
        f.write_bytes(data)
        whole = _ids_or_error(lambda d=data: encode_each(tok, [d], names=["a"]))
        assert "byte-order mark but byte" in whole or "is not UTF-8 text: byte 7" in whole
        for block in (1, 2, 3, 5):
            assert _ids_or_error(lambda b=block: encode_file(tok, f, "a", block_bytes=b)) == whole
    monkeypatch.setattr(_documents, "PIECE_CHARS", 2**20)
    for _ in range(40):
        data = bytearray("".join(rng.choice(WORDS) for _ in range(40)).encode())
        for _ in range(rng.randint(1, 3)):
            data.insert(rng.randrange(len(data)), rng.choice([0xE9, 0x80, 0xC3, 0xF0, 0xED]))
        f.write_bytes(bytes(data))
        whole = _ids_or_error(lambda d=bytes(data): encode_each(tok, [d], names=["a"]))
        assert "is not UTF-8 text: byte" in whole
        for block in (1, 2, 5):
            assert _ids_or_error(lambda b=block: encode_file(tok, f, "a", block_bytes=b)) == whole


def test_a_stretch_too_long_to_cut_is_refused_without_reading_on(tmp_path, monkeypatch):
    letters = byte_level_bpe([chr(c) for c in range(97, 123)] + ["<|endoftext|>", "Ċ"], [],
                             token_types=[1] * 26 + [3, 1])
    monkeypatch.setattr(_documents, "PIECE_CHARS", 40)
    monkeypatch.setattr(_documents, "MAX_PIECE_CHARS", 100)
    f = tmp_path / "a.txt"
    f.write_bytes(b"ab\n" + b"x" * 10_000)
    with pytest.raises(ConfigError, match=r"^data='a': has a stretch of more than 100 "
                                          "characters without a line end to cut at"):
        list(encode_file(letters, f, "a", block_bytes=16))
    assert list(encode_file(None, f, block_bytes=4096))[1].tolist() == list(b"x" * 4096)


def test_a_prepared_long_document_is_cut_as_the_model_tokenizer_cuts_it(tmp_path, tok,
                                                                        monkeypatch):
    """A text worker's tokenizer (the tokenizers backend alone) cuts a long document into the
    pieces the model's tokenizer does (it once had no pieces at all: a document over
    PIECE_CHARS failed the prepare)."""
    monkeypatch.setattr(_documents, "PIECE_CHARS", 64)
    text = "".join(f"line {i}: the cat sat.\n" + ("\n" if i % 3 else "") for i in range(400))
    (tmp_path / "long.txt").write_text(text)
    manifest = prepare(tmp_path / "long.txt", tmp_path / "s", tokenizer=tok, processes=1)
    want = encode_each(tok, [text.encode()])[0]
    assert manifest["tokens"] == len(want) > 2000
    np.testing.assert_array_equal(open_store(tmp_path / "s").tokens, want)


# A run, end to end ----------------------------------------------------------------------------

def _losses(out):
    lines = (pathlib.Path(out) / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r and "step" in r]


@pytest.mark.slow
def test_a_run_resumes_whichever_way_its_data_is_read(corpus, cache, tmp_path, monkeypatch):
    """Two steps in memory, resumed to four from the store (MEMORY_BYTES 0): the identity
    check passes, and the last two steps' losses are those of four steps in memory."""
    def config(out, steps, **kw):  # a constant rate: the same steps whatever --steps says
        return TrainConfig(model="tiny", seq_len=16, batch_size=2, steps=steps, warmup=0,
                           schedule="constant", eval_batches=1, progress=False,
                           data=str(corpus / "txt"), out=str(tmp_path / out), **kw)

    train(config("straight", 4))
    train(config("resumed", 2))
    assert not cache.exists()
    monkeypatch.setattr(_prepared, "MEMORY_BYTES", 0)
    result = train(config("resumed", 4, allow_changes="steps"))
    assert result.status == "done" and result.summary["start_step"] == 2
    assert len(list(cache.glob("txt-*.store"))) == 1
    straight, resumed = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
    assert len(straight) == 4 and resumed[-2:] == straight[-2:]
    run = json.loads((tmp_path / "resumed" / "config.json").read_text())["run"]
    assert run["corpus_sha256"] == corpus_fingerprint(load_corpus(corpus / "txt"))  # bytes


# Host memory ----------------------------------------------------------------------------------

# Runs the effijax program and prints the peak RSS of it and of its processes (as /usr/bin/time
# does: ru_maxrss of the children, the largest of them and of theirs), in bytes.
_PEAK = """
import resource, subprocess, sys
done = subprocess.run([sys.executable, "-m", "effijax", *sys.argv[1:]], capture_output=True,
                      text=True)
sys.stderr.write(done.stdout + done.stderr)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
sys.exit(done.returncode)
"""


def peak_rss(args, env) -> tuple[int, str]:
    """``(peak RSS in bytes, output)`` of ``effijax ARGS``."""
    out = subprocess.run([sys.executable, "-c", _PEAK, *args], capture_output=True, text=True,
                         env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split()[-1]), out.stderr


def write_text_folder(folder: pathlib.Path, total: int, *, big: int = 0) -> None:
    """``total`` bytes of printable text in 1 MiB files (and one of ``big`` bytes)."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    line = rng.integers(32, 127, 2**20, np.uint8)
    line[::80] = ord("\n")
    chunk, i = line.tobytes(), 0
    if big:
        with open(folder / "big.txt", "wb") as f:
            for _ in range(big // len(chunk)):
                f.write(chunk)
    while (written := sum(p.stat().st_size for p in folder.iterdir())) < total:
        (folder / f"{i:05d}.txt").write_bytes(chunk[: total - written])
        i += 1


@pytest.mark.slow
def test_host_memory_of_a_run_does_not_grow_with_its_text(tmp_path):
    """`effijax train --model tiny --data DIR` on 256 MiB of text files (one of them 96 MiB,
    tokenized in blocks) peaks within 150 MB of the same run on 2 MiB (the in-memory reading
    held twice the text at its peak: 1.6 GB for 300 MB)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    peaks = {}
    for name, size, big in (("small", 2 * 2**20, 0), ("large", 256 * 2**20, 96 * 2**20)):
        write_text_folder(tmp_path / name, size, big=big)
        peaks[name], out = peak_rss(["train", "--model", "tiny", "--data", str(tmp_path / name),
                                     "--steps", "2", "--eval-batches", "1", "--no-checkpoints",
                                     "--no-progress", "--out", str(tmp_path / f"run-{name}")],
                                    env)
        assert ("memory-mapped" in out) == (name == "large"), out
    assert peaks["large"] - peaks["small"] < 150 * 2**20, peaks
