"""`effijax train --data docs.parquet`: a raw Parquet / Arrow / `datasets` source prepared into a
token store in effijax's cache by the run itself, once, and reused while its files are unchanged;
column errors before anything runs; mixtures of raw sources and stores; one prepare however many
processes ask; a killed prepare continued by the next run."""

import os
import threading

import pytest

from effijax.data import open_store
from effijax.errors import ConfigError
from effijax.models import gpt_config
from effijax.recipe import TrainConfig
from effijax.recipe._train import load_data
from effijax.sources import _prepare, _prepared, load_dataset, load_eval_data, prepare

pa = pytest.importorskip("pyarrow", reason="Parquet/Arrow sources need pyarrow (the data extra)")
pq = pytest.importorskip("pyarrow.parquet", reason="Parquet sources need pyarrow")

SEQ = 16
BYTES = gpt_config("tiny", seq_len=SEQ)


def _documents(n=12, salt=""):
    return [f"document {i}{salt}: " + " ".join(f"the {j * i % 17}" for j in range(60 + i))
            for i in range(n)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """effijax's cache in the test's folder (the stores effijax train prepares lie there)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "effijax" / "stores"


@pytest.fixture
def docs(tmp_path):
    """Documents in a Parquet file's 'body' column (two row groups), beside an 'id' column."""
    path = tmp_path / "docs.parquet"
    docs = _documents()
    pq.write_table(pa.table({"id": list(range(len(docs))), "body": docs}), path,
                   row_group_size=6)
    return path


def _config(data, **kw):
    return TrainConfig(model="tiny", seq_len=SEQ, data=str(data), **kw)


def _data(data, **kw):
    """The data section (what ``load_data`` reads) of such a config."""
    return _config(data, **kw).sections.data


def test_a_parquet_source_trains_from_the_store_prepare_writes(docs, tmp_path, cache):
    lines = []
    data = _prepared.training_data(str(docs), None, text_column="body", print_fn=lines.append)
    (store,) = cache.glob("docs-*.store")
    assert data == str(store) and lines[0].startswith(f"preparing {docs} into {store}")
    assert lines[-1].startswith("prepared ") and "sha256" in lines[-1]
    own = prepare(docs, tmp_path / "own.store", text_column="body", processes=1)
    read = load_data(_data(docs, text_column="body"), BYTES)
    assert read.fingerprint == "store:" + own["sha256"]  # the store `effijax data prepare` writes
    assert read.tokens == own["tokens"] == sum(len(d.encode()) for d in _documents())
    assert read.note.startswith(f"bytes store {store}")


def test_unchanged_files_reuse_the_store_without_reading_them(docs, cache, monkeypatch):
    first = load_data(_data(docs, text_column="body"), BYTES)

    def no_prepare(*args, **kwargs):
        raise AssertionError("prepare ran again for unchanged files")

    with monkeypatch.context() as m:
        m.setattr(_prepared, "prepare", no_prepare)
        again = load_data(_data(docs, text_column="body"), BYTES)
    assert again.fingerprint == first.fingerprint
    # New content (the same size): prepared again, into the same store name.
    docs.unlink()
    pq.write_table(pa.table({"id": list(range(12)), "body": _documents(salt="!")}), docs,
                   row_group_size=6)
    changed = load_data(_data(docs, text_column="body"), BYTES)
    assert changed.fingerprint != first.fingerprint
    assert changed.tokens == first.tokens + 12 and len(list(cache.glob("*.store"))) == 1
    # Another column (or tokenizer, format) is another store beside it.
    table = pq.read_table(docs).append_column("text", pa.array(_documents(4) * 3))
    pq.write_table(table, docs)
    other = load_data(_data(docs), BYTES)
    assert other.fingerprint != changed.fingerprint and len(list(cache.glob("*.store"))) == 2


def test_a_missing_column_is_refused_before_anything_is_created(docs, tmp_path, cache):
    from effijax.recipe import train

    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"docs\.parquet: no column 'text' \(columns: id, "
                                          r"body\): use --text-column body$"):
        train(_config(docs, out=str(out), steps=2, batch_size=2))
    assert not out.exists() and not cache.exists()
    with pytest.raises(ConfigError, match="text_column=' ': expected a column name"):
        _config(docs, text_column=" ")


def test_the_flag_and_the_library_refusals(docs):
    from effijax.cli import build_parser
    from effijax.cli._train import config_from_args

    args = build_parser().parse_args(["train", "--data", str(docs), "--text-column", "body"])
    assert config_from_args(args).text_column == "body"
    assert TrainConfig().text_column == "text"
    # The library's load_dataset reads no table: it names both ways to a store.
    with pytest.raises(ConfigError, match=r"holds Parquet/Arrow data \(docs\.parquet\), which is "
                                          r"read from a token store: effijax train --data "
                                          r"prepares one .*effijax data prepare .*--out "):
        load_dataset(str(docs), BYTES)
    with pytest.raises(ConfigError, match="effijax eval reads text or chat JSONL files"):
        load_eval_data(str(docs), BYTES)


def test_a_mixture_prepares_its_raw_parts(docs, tmp_path, cache):
    (tmp_path / "b.txt").write_bytes(b"b" * 4000)
    prepare(tmp_path / "b.txt", tmp_path / "b.store", processes=1)
    data = load_data(_data(f"{docs}:0.25,{tmp_path / 'b.store'}:0.75",
                             text_column="body"), BYTES)
    assert data.train.weights == (0.25, 0.75) and data.fingerprint.startswith("mix:")
    (store,) = cache.glob("docs-*.store")
    same = load_dataset(f"{store}:0.25,{tmp_path / 'b.store'}:0.75", BYTES)
    assert same.fingerprint == data.fingerprint
    # A text file in a mixture is prepared too (alone, it is read in memory as before).
    text = load_data(_data(f"{tmp_path / 'b.txt'}:1,{tmp_path / 'b.store'}:1"), BYTES)
    assert len(list(cache.glob("b-*.store"))) == 1 and text.tokens == 8000


def test_processes_asking_at_once_prepare_once(docs, cache, monkeypatch):
    """Threads stand in for the processes of a run on one machine: the lock is per open file,
    so they exclude each other as processes do."""
    calls, real = [], _prepared.prepare
    started = threading.Event()

    def slow_prepare(*args, **kwargs):
        calls.append(1)
        started.set()
        threading.Event().wait(0.5)  # the others arrive while the store is being prepared
        return real(*args, **kwargs)

    monkeypatch.setattr(_prepared, "prepare", slow_prepare)
    stores, lines = [None] * 3, []

    def ask(i):
        if i:
            started.wait(10)
        stores[i] = _prepared.cached_store(docs, None, text_column="body",
                                           print_fn=lines.append)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(calls) == 1 and len(set(stores)) == 1 and stores[0].exists()
    assert sum(line.startswith("waiting for another process preparing") for line in lines) == 2


def test_a_killed_prepare_is_continued_by_the_next_run(tmp_path, cache, monkeypatch):
    path = tmp_path / "many.parquet"
    pq.write_table(pa.table({"text": _documents(40) * 200}), path, row_group_size=400)
    real_commit = _prepare.commit_documents
    commits = []

    def dies_after_two(*args, **kwargs):
        if len(commits) == 2:
            raise KeyboardInterrupt  # Ctrl-C between two shards
        commits.append(args[1])
        return real_commit(*args, **kwargs)

    monkeypatch.setattr(_prepared, "prepare", lambda *a, **kw: _prepare.prepare(
        *a, **{**kw, "processes": 1}))
    monkeypatch.setattr(_prepare, "commit_documents", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        load_data(_data(path), BYTES)
    assert not list(cache.glob("*.files.json")) and len(commits) == 2
    monkeypatch.setattr(_prepare, "commit_documents", real_commit)
    lines = []
    store = _prepared.cached_store(path, None, print_fn=lines.append)
    assert any("2 already committed by an earlier run" in line for line in lines)
    clean = prepare(path, tmp_path / "clean.store", processes=1)
    assert open_store(store).manifest["sha256"] == clean["sha256"]
    assert os.path.exists(str(store) + ".files.json")
