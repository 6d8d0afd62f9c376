"""The tokenized store (`effijax data prepare`): the same tokens and batches as the in-memory
path, idempotent and resumable prepares, memory-mapped reading, Parquet / Arrow / `datasets`
sources, column errors, mixtures, and a run's identity bound to the store's hash."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from _llama_files import VOCAB_SIZE, chat_tokenizer, write_qa

from effijax.data import (
    Led,
    Mixture,
    batch_at,
    eval_batches,
    is_store,
    open_store,
    verify_store,
)
from effijax.errors import ConfigError
from effijax.models import gpt_config, llama_config
from effijax.recipe import _identity
from effijax.sources import _prepare, load_dataset, prepare

pa = pytest.importorskip("pyarrow", reason="Parquet/Arrow sources need pyarrow (the data extra)")
pq = pytest.importorskip("pyarrow.parquet", reason="Parquet sources need pyarrow")

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEQ = 32
BYTES = gpt_config("tiny", seq_len=SEQ)


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def llama(tok):
    return dataclasses.replace(llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=SEQ),
                               tokenizer=tok)


def _documents(n=12):
    return [f"document {i}: " + " ".join(f"the {j * i % 17}" for j in range(40 + i))
            for i in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The same documents as a folder of text files, a Parquet file (two row groups), an Arrow
    stream, a JSONL file; and 40 chat records as JSONL."""
    d = tmp_path_factory.mktemp("corpus")
    docs = _documents()
    (d / "txt").mkdir()
    for i, text in enumerate(docs):
        (d / "txt" / f"{i:02d}.txt").write_text(text)
    table = pa.table({"id": list(range(len(docs))), "text": docs})
    pq.write_table(table, d / "docs.parquet", row_group_size=5)
    with pa.ipc.new_stream(d / "docs.arrow", table.schema) as writer:
        for batch in table.to_batches(max_chunksize=4):
            writer.write_batch(batch)
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    write_qa(d / "qa.jsonl")
    return d


def _batches_equal(a, b, steps=range(5), batch_size=4):
    for step in steps:
        x = batch_at(a, seed=3, step=step, batch_size=batch_size, seq_len=SEQ)
        y = batch_at(b, seed=3, step=step, batch_size=batch_size, seq_len=SEQ)
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=f"step {step} {key}")


def _stream(data):
    """``(tokens, the BOS leading each window or None)`` of a text dataset's part."""
    return (data.tokens, data.first) if isinstance(data, Led) else (data, None)


def test_text_store_trains_on_the_in_memory_tokens(corpus, tmp_path, llama):
    with_bos = dataclasses.replace(llama, tokenizer=dataclasses.replace(llama.tokenizer,
                                                                        add_bos=True))
    for model, name in ((BYTES, "bytes"), (llama, "text"), (with_bos, "bos")):
        store = tmp_path / f"{name}.store"
        manifest = prepare(corpus / "txt", store, processes=1,
                           tokenizer=getattr(model, "tokenizer", None))
        assert manifest["data_format"] == {"bos": "text"}.get(name, name)
        assert manifest["documents"] == 12
        memory, mapped = load_dataset(str(corpus / "txt"), model), load_dataset(str(store), model)
        bos = llama.tokenizer.bos_id if name == "bos" else None
        for ours, theirs in ((memory.train, mapped.train), (memory.val, mapped.val)):
            np.testing.assert_array_equal(_stream(ours)[0], _stream(theirs)[0])
            assert _stream(ours)[1] == _stream(theirs)[1] == bos  # windows led by the BOS
        assert isinstance(open_store(store).tokens, np.memmap)
        train = _stream(mapped.train)[0]
        assert isinstance(train.base, np.memmap) or isinstance(train, np.memmap)
        assert mapped.format == memory.format and mapped.tokens == memory.tokens
        assert mapped.fingerprint == f"store:{manifest['sha256']}"
        _batches_equal(memory.train, mapped.train)
        for x, y in zip(eval_batches(memory.val, batch_size=2, seq_len=SEQ, num_batches=3),
                        eval_batches(mapped.val, batch_size=2, seq_len=SEQ, num_batches=3),
                        strict=True):
            np.testing.assert_array_equal(x["inputs"], y["inputs"])
    assert open_store(tmp_path / "text.store").tokens.dtype == np.uint16  # 264 ids
    bos = open_store(tmp_path / "bos.store")  # each document starts with BOS, as in memory
    assert (bos.tokens[bos.offsets[:-1]] == llama.tokenizer.bos_id).all()


def test_chat_store_packs_the_rows_pack_examples_packs(corpus, tmp_path, llama):
    store = tmp_path / "chat.store"
    manifest = prepare(corpus / "qa.jsonl", store, tokenizer=llama.tokenizer, processes=1,
                       shard_bytes=300)  # several shards
    assert manifest["data_format"] == "chat" and manifest["split"]["val_examples"] == 2
    for seq_len in (SEQ, 24):  # 24: some examples cut to one row
        memory = load_dataset(str(corpus / "qa.jsonl"), llama, seq_len=seq_len)
        mapped = load_dataset(str(store), llama, seq_len=seq_len)
        for a, b in ((memory.train, mapped.train), (memory.val, mapped.val)):
            assert (len(a), a.examples, a.truncated, a.filled) == \
                (len(b), b.examples, b.truncated, b.filled)
            np.testing.assert_array_equal(a.tokens_NW, b.tokens_NW[np.arange(len(b))])
            np.testing.assert_array_equal(a.mask_NW, b.mask_NW[np.arange(len(b))])
            np.testing.assert_array_equal(a.segments_NW, b.segments_NW[np.arange(len(b))])
        assert (memory.train.truncated > 0) == (seq_len == 24)
        for step in range(3):
            x = batch_at(memory.train, seed=1, step=step, batch_size=4, seq_len=seq_len)
            y = batch_at(mapped.train, seed=1, step=step, batch_size=4, seq_len=seq_len)
            assert sorted(x) == sorted(y) == ["inputs", "mask", "segments", "targets"]
            for key in x:
                np.testing.assert_array_equal(x[key], y[key])


def _files(store):
    """A store's files by name, but its record of what was verified (``.verified.json``:
    this copy's inodes and times, not the store's content)."""
    return {p.name: p.read_bytes() for p in sorted(pathlib.Path(store).iterdir())
            if p.name != ".verified.json"}


def _shard_count(line: str) -> int:
    """The shards prepare's first progress line announces ("1 file(s), 9 shard(s); ...")."""
    return int(line.split(", ")[1].split()[0])


def test_prepare_is_idempotent_whatever_the_shards(corpus, tmp_path, tok):
    one = prepare(corpus / "docs.jsonl", tmp_path / "a", tokenizer=tok, processes=1)
    again = prepare(corpus / "docs.jsonl", tmp_path / "a", tokenizer=tok, processes=1)
    many = prepare(corpus / "docs.jsonl", tmp_path / "b", tokenizer=tok, processes=1,
                   shard_bytes=700)
    assert one["sha256"] == again["sha256"] == many["sha256"]
    lines = []  # a third time: nothing to do
    prepare(corpus / "docs.jsonl", tmp_path / "a", tokenizer=tok, print_fn=lines.append)
    assert lines == [f"{tmp_path / 'a'} is up to date (same sources, tokenizer and settings)"]
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert verify_store(tmp_path / "b").sha256 == one["sha256"]
    assert not _prepare.work_dir(tmp_path / "a").exists()  # the shards are cleaned up
    (tmp_path / "b" / "tokens.bin").write_bytes(b"\0" * (2 * one["tokens"]))
    with pytest.raises(ConfigError, match="tokens.bin: sha256: differs from the manifest"):
        verify_store(tmp_path / "b")


def test_a_small_source_is_cut_into_shards_for_every_core(tmp_path):
    """2 MiB of documents in one Parquet row group: about SHARDS_WANTED shards by default (with
    one 8 MiB shard, a second process had nothing to do), and the store of one shard."""
    rng = np.random.default_rng(0)
    docs = ["".join(map(chr, rng.integers(97, 123, 2048))) for _ in range(1024)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "docs.parquet")  # one row group
    lines = []
    cut = prepare(tmp_path / "docs.parquet", tmp_path / "cut", processes=1,
                  print_fn=lines.append)
    whole = prepare(tmp_path / "docs.parquet", tmp_path / "whole", processes=1,
                    shard_bytes=_prepare.SHARD_BYTES)
    size = (tmp_path / "docs.parquet").stat().st_size
    assert _prepare.default_shard_bytes(size) == _prepare.MIN_SHARD_BYTES < size // 4
    shards = _shard_count(lines[0])
    assert 8 <= shards <= 2 * _prepare.SHARDS_WANTED, lines[0]
    assert cut["sha256"] == whole["sha256"] and cut["documents"] == 1024
    assert _files(tmp_path / "cut") == _files(tmp_path / "whole")


@pytest.mark.slow
def test_a_pool_of_processes_writes_the_same_store(corpus, tmp_path, tok):
    """Two worker processes (spawned: each imports the tokenizer's module, seconds on a
    loaded machine) tokenize the shards; the store is the one a single process writes."""
    one = prepare(corpus / "qa.jsonl", tmp_path / "a", tokenizer=tok, processes=1)
    two = prepare(corpus / "qa.jsonl", tmp_path / "b", tokenizer=tok, processes=2,
                  shard_bytes=400)
    assert one["sha256"] == two["sha256"] and _files(tmp_path / "a") == _files(tmp_path / "b")


def test_a_killed_prepare_continues_to_the_same_store(corpus, tmp_path, tok, monkeypatch):
    clean = prepare(corpus / "docs.jsonl", tmp_path / "clean", tokenizer=tok, processes=1,
                    shard_bytes=500)
    real_commit, real_tokenize = _prepare.commit_documents, _prepare._tokenize
    commits, tokenized = [], []

    def dies_after_three(*args, **kwargs):
        if len(commits) == 3:
            raise KeyboardInterrupt  # the process killed between two shards
        commits.append(args[1])
        return real_commit(*args, **kwargs)

    monkeypatch.setattr(_prepare, "commit_documents", dies_after_three)
    with pytest.raises(KeyboardInterrupt):
        prepare(corpus / "docs.jsonl", tmp_path / "s", tokenizer=tok, processes=1,
                shard_bytes=500)
    assert not (tmp_path / "s").exists() and len(commits) == 3
    monkeypatch.setattr(_prepare, "commit_documents", real_commit)
    monkeypatch.setattr(_prepare, "_tokenize",
                        lambda task: tokenized.append(task["index"]) or real_tokenize(task))
    lines = []
    resumed = prepare(corpus / "docs.jsonl", tmp_path / "s", tokenizer=tok, processes=1,
                      shard_bytes=500, print_fn=lines.append)
    shards = len(clean["sources"]) and _shard_count(lines[0])
    assert "3 already committed by an earlier run" in lines[0]
    assert sorted(tokenized) == list(range(3, shards))  # only the shards not committed
    assert resumed["sha256"] == clean["sha256"]
    assert _files(tmp_path / "s") == _files(tmp_path / "clean")


def test_parquet_arrow_and_jsonl_give_the_text_files_tokens(corpus, tmp_path, tok):
    want = prepare(corpus / "txt", tmp_path / "txt", tokenizer=tok, processes=1)
    stores = {name: prepare(corpus / name, tmp_path / name, tokenizer=tok, processes=1,
                            shard_bytes=400)
              for name in ("docs.parquet", "docs.arrow", "docs.jsonl")}
    tokens = open_store(tmp_path / "txt").tokens
    for name, manifest in stores.items():
        assert manifest["documents"] == 12, name
        np.testing.assert_array_equal(open_store(tmp_path / name).tokens, tokens, err_msg=name)
    assert stores["docs.parquet"]["sources"][0]["name"] == "docs.parquet"
    assert want["tokens"] == stores["docs.parquet"]["tokens"]


@pytest.mark.slow
def test_a_datasets_save_to_disk_folder_is_its_arrow_files(corpus, tmp_path, tok):
    """``datasets`` (imported in seconds) writes the folder; its rows are the documents."""
    datasets = pytest.importorskip("datasets", reason="the save_to_disk case needs datasets "
                                   "(pip install effijax[interop])")
    saved = tmp_path / "saved"
    datasets.Dataset.from_parquet(str(corpus / "docs.parquet")).save_to_disk(str(saved))
    manifest = prepare(saved, tmp_path / "saved.store", tokenizer=tok, processes=1)
    assert [s["kind"] for s in manifest["sources"]] == ["arrow"]
    want = prepare(corpus / "txt", tmp_path / "txt", tokenizer=tok, processes=1)
    assert manifest["documents"] == 12 and manifest["tokens"] == want["tokens"]
    np.testing.assert_array_equal(open_store(tmp_path / "saved.store").tokens,
                                  open_store(tmp_path / "txt").tokens)
    datasets.DatasetDict({"train": datasets.load_from_disk(str(saved))}).save_to_disk(
        str(tmp_path / "dict"))
    with pytest.raises(ConfigError, match=r"is a DatasetDict \(splits: train\); give one "
                                          r"split's folder, e.g. .*dict/train"):
        prepare(tmp_path / "dict", tmp_path / "s", tokenizer=tok)


def test_column_and_format_errors_name_the_file_before_anything_runs(corpus, tmp_path, tok):
    pq.write_table(pa.table({"id": [1, 2], "body": ["a", "b"]}), tmp_path / "docs.parquet")
    with pytest.raises(ConfigError, match=r"docs\.parquet: no column 'text' \(columns: id, "
                                          r"body\): use --text-column body$"):
        prepare(tmp_path / "docs.parquet", tmp_path / "s", tokenizer=tok)
    with pytest.raises(ConfigError, match=r"docs\.parquet: no column 'messages' .*columns: id, "
                                          "body"):
        prepare(tmp_path / "docs.parquet", tmp_path / "s", tokenizer=tok, data_format="chat")
    pq.write_table(pa.table({"text": ["fine", None]}), tmp_path / "nulls.parquet")
    with pytest.raises(ConfigError, match=r"nulls\.parquet: row 1: column 'text' is missing"):
        prepare(tmp_path / "nulls.parquet", tmp_path / "s", tokenizer=tok, processes=1)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": 1}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl@33'?: keys \['prompt'\]"):
        prepare(tmp_path / "bad.jsonl", tmp_path / "s", tokenizer=tok, processes=1)
    with pytest.raises(ConfigError, match="chat records are rendered with a model's chat "
                                          "template: name the model with --from"):
        prepare(corpus / "qa.jsonl", tmp_path / "s")
    for processes in (0, -1, 1.5):  # 0 once meant every core, silently
        with pytest.raises(ConfigError, match=rf"^processes={processes}: must be an integer"):
            prepare(corpus / "txt", tmp_path / "s", processes=processes)
    # load_dataset never reads a table as bytes: refused with the commands that prepare it
    # (effijax train prepares it itself: test_prepared_data).
    for source in (corpus / "docs.parquet", corpus / "docs.arrow", tmp_path):
        with pytest.raises(ConfigError, match=r"holds Parquet/Arrow data .*effijax train --data "
                                              rf"prepares .*effijax data prepare {source} --out "
                                              ".*--from MODEL"):
            load_dataset(str(source), BYTES)
    assert not (tmp_path / "s").exists()
    # The store is replaced whole: never a folder that is not one, never inside the source.
    with pytest.raises(ConfigError, match=r"out='.*corpus.*/txt': exists and is not a token "
                                          "store"):
        prepare(corpus / "docs.jsonl", corpus / "txt")
    with pytest.raises(ConfigError, match=r"out='.*/txt/s': is inside the source"):
        prepare(corpus / "txt", corpus / "txt" / "s")


def test_a_store_of_another_tokenizer_is_refused(corpus, tmp_path, llama):
    prepare(corpus / "txt", tmp_path / "bytes.store", processes=1)
    with pytest.raises(ConfigError, match=r"was prepared with tokenizer bytes \(no tokenizer\), "
                                          r"but Llama d64 L2 tokenizes with [0-9a-f]{12}\.\.; "
                                          "prepare it again"):
        load_dataset(str(tmp_path / "bytes.store"), llama)


def test_mixtures_are_deterministic_weighted_and_split_by_process(tmp_path):
    for name, byte in (("a", b"a"), ("b", b"b")):
        (tmp_path / f"{name}.txt").write_bytes(byte * 4000)
        prepare(tmp_path / f"{name}.txt", tmp_path / f"{name}.store", processes=1)
    spec = f"{tmp_path / 'a.store'}:0.7,{tmp_path / 'b.store'}:0.3"
    data = load_dataset(spec, BYTES)
    assert isinstance(data.train, Mixture) and data.train.weights == (0.7, 0.3)
    assert data.fingerprint.startswith("mix:") and data.tokens == 8000
    kw = {"seed": 5, "batch_size": 2000, "seq_len": 8}
    batch = batch_at(data.train, step=7, **kw)
    share = float(np.mean(batch["inputs"][:, 0] == ord("a")))
    assert 0.67 < share < 0.73  # 2000 draws: 0.7 +- 3 standard deviations
    assert set(np.unique(batch["inputs"])) == {ord("a"), ord("b")}
    assert all(len(set(row.tolist())) == 1 for row in batch["inputs"])  # one corpus per row
    np.testing.assert_array_equal(batch["inputs"], batch_at(data.train, step=7, **kw)["inputs"])
    assert not np.array_equal(batch["inputs"], batch_at(data.train, step=8, **kw)["inputs"])
    parts = [batch_at(data.train, step=7, process_index=i, process_count=4, **kw)["inputs"]
             for i in range(4)]
    np.testing.assert_array_equal(np.concatenate(parts), batch["inputs"])
    swapped = load_dataset(f"{tmp_path / 'a.store'}:0.3,{tmp_path / 'b.store'}:0.7", BYTES)
    assert swapped.fingerprint != data.fingerprint
    evals = eval_batches(data.val, batch_size=2, seq_len=8, num_batches=4)
    assert [chr(b["inputs"][0, 0]) for b in evals] == ["a", "b", "a", "b"]
    with pytest.raises(ConfigError, match="a mixture .* draws from token stores; prepare it"):
        load_dataset(f"{tmp_path / 'a.txt'}:1,{tmp_path / 'b.store'}:1", BYTES)


def test_a_resume_against_another_store_is_refused(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"first corpus " * 100)
    (tmp_path / "b.txt").write_bytes(b"other corpus " * 100)
    runs = []
    for name in ("a", "b"):
        prepare(tmp_path / f"{name}.txt", tmp_path / f"{name}.store", processes=1)
        data = load_dataset(str(tmp_path / f"{name}.store"), BYTES)
        runs.append({"seed": 0, "run": {"corpus_sha256": data.fingerprint}})
    assert _identity.check_resume(runs[0], runs[0], (), where="ckpt") == {}
    with pytest.raises(ConfigError, match=r"data 'store:[0-9a-f]{64}' -> 'store:[0-9a-f]{64}' "
                                          r"\(must match the checkpointed run\)"):
        _identity.check_resume(runs[0], runs[1], (), where="ckpt")


_RSS = """
import sys
from effijax.data import batch_at
from effijax.models import gpt_config
from effijax.sources import load_dataset
data = load_dataset(sys.argv[1], gpt_config("tiny", seq_len=64))
for step in range(200):
    batch_at(data.train, seed=0, step=step, batch_size=16, seq_len=64)
# VmHWM, the peak RSS (ru_maxrss keeps the forking parent's peak across exec): the mapped
# store's pages count while mapped (2 MiB at a time where the kernel caches the file in large
# folios), so a batch unmaps what it read (effijax.data.release_pages).
peak = next(line for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(int(peak.split()[1]) * 1024)
"""


@pytest.mark.slow
def test_host_memory_does_not_grow_with_the_store(tmp_path):
    """A 256 MiB store trains in the peak RSS of a 1 MiB one, where the in-memory path holds
    the corpus: its arrays are mapped, only the windows drawn are read, and unmapped again."""
    rng = np.random.default_rng(0)
    for name, size in (("small", 2**20), ("large", 256 * 2**20)):
        (tmp_path / f"{name}.txt").write_bytes(rng.integers(32, 127, size, np.uint8).tobytes())
        prepare(tmp_path / f"{name}.txt", tmp_path / f"{name}.store", processes=1,
                shard_bytes=64 * 2**20)
        (tmp_path / f"{name}.txt").unlink()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    rss = {}
    for name in ("small", "large"):
        out = subprocess.run([sys.executable, "-c", _RSS, str(tmp_path / f"{name}.store")],
                             capture_output=True, text=True, env=env, check=True)
        rss[name] = float(out.stdout.split()[0])
    assert rss["large"] - rss["small"] < 64 * 2**20, rss  # not the 256 MiB of the store
    # What the test can tell: the in-memory path holds the corpus (its RSS grows by it).
    (tmp_path / "big.txt").write_bytes(b"x" * 256 * 2**20)
    out = subprocess.run([sys.executable, "-c", _RSS, str(tmp_path / "big.txt")],
                         capture_output=True, text=True, env=env, check=True)
    assert float(out.stdout.split()[0]) - rss["small"] > 256 * 2**20
    assert is_store(tmp_path / "large.store")


@pytest.mark.slow
def test_training_on_a_store_gives_the_losses_of_its_files(corpus, tmp_path):
    """One compiled step of the byte GPT, three steps from the same state on the folder's and
    on the store's batches: the losses are bit for bit the same."""
    import jax
    import optax

    from effijax.recipe import batch_fn, compile_job, init_state, plan_job

    prepare(corpus / "txt", tmp_path / "a.store", processes=1)
    model = gpt_config("tiny", seq_len=16)
    job = plan_job(model, "fp32", optax.adam(1e-3), batch_size=4, seed=2)
    step = compile_job(job, census=False).step
    losses = {}
    for name, data in (("files", corpus / "txt"), ("store", tmp_path / "a.store")):
        state, fetch, losses[name] = init_state(job), batch_fn(job, load_dataset(
            str(data), model).train), []
        for i in range(3):
            state, metrics = step(state, fetch(i))
            losses[name].append(float(jax.device_get(metrics["loss"])))
    assert losses["files"] == losses["store"] and len(set(losses["files"])) == 3


# A chat template file at prepare time (effijax data prepare --chat-template) ----------------

# The tiny template with each turn ended by <|endoftext|> instead of <|im_end|>.
TURNS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n"
         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _sha256(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


def test_a_base_tokenizer_prepares_chat_with_a_template_file_that_training_repeats(
        corpus, tmp_path, llama):
    base = dataclasses.replace(llama, tokenizer=dataclasses.replace(llama.tokenizer,
                                                                    chat_template=None))
    with pytest.raises(ConfigError, match=r"has no chat template \(a base model's\); render the "
                                          "records with a template file: --chat-template FILE"):
        prepare(corpus / "qa.jsonl", tmp_path / "s", tokenizer=base.tokenizer, processes=1)
    template = tmp_path / "turns.jinja"
    template.write_text(TURNS)
    manifest = prepare(corpus / "qa.jsonl", tmp_path / "s", tokenizer=base.tokenizer,
                       chat_template=str(template), processes=1)
    assert manifest["data_format"] == "chat"
    assert manifest["tokenizer"]["chat_template_sha256"] == _sha256(TURNS)
    # The rows are the in-memory rows of a run with the same file (effijax train
    # --chat-template turns.jinja): the turns end with <|endoftext|> (id 0), trained.
    same = dataclasses.replace(base, tokenizer=dataclasses.replace(base.tokenizer,
                                                                   chat_template=TURNS))
    memory = load_dataset(str(corpus / "qa.jsonl"), same)
    mapped = load_dataset(str(tmp_path / "s"), same)
    for a, b in ((memory.train, mapped.train), (memory.val, mapped.val)):
        np.testing.assert_array_equal(a.tokens_NW, b.tokens_NW[np.arange(len(b))])
        np.testing.assert_array_equal(a.mask_NW, b.mask_NW[np.arange(len(b))])
    assert (mapped.train.tokens_NW[mapped.train.mask_NW == 1] == 0).any()
    # A run that renders chat otherwise is refused, in one line that says how to match.
    sha = _sha256(TURNS)[:12]
    own = _sha256(llama.tokenizer.chat_template)[:12]
    for model, said in ((base, "no template"), (llama, f"the template of sha256 {own}..")):
        with pytest.raises(ConfigError) as e:
            load_dataset(str(tmp_path / "s"), model)
        assert str(e.value) == (f"data={str(tmp_path / 's')!r}: its chat records were rendered "
                                f"with the template of sha256 {sha}.. (effijax data prepare "
                                f"--chat-template), but this run renders chat with {said}; "
                                "train with --chat-template and the same file, or prepare the "
                                "store again")
    # The same file again: up to date; another file: another store.
    lines = []
    prepare(corpus / "qa.jsonl", tmp_path / "s", tokenizer=base.tokenizer,
            chat_template=str(template), processes=1, print_fn=lines.append)
    assert lines == [f"{tmp_path / 's'} is up to date (same sources, tokenizer and settings)"]
    template.write_text(llama.tokenizer.chat_template)
    other = prepare(corpus / "qa.jsonl", tmp_path / "s", tokenizer=base.tokenizer,
                    chat_template=str(template), processes=1)
    assert other["sha256"] != manifest["sha256"]
    # The tokenizer's own template: the manifest records no file, as before the flag.
    own = prepare(corpus / "qa.jsonl", tmp_path / "own", tokenizer=llama.tokenizer, processes=1)
    assert set(own["tokenizer"]) == {"sha256", "vocab_size"}
    # Training through the same template (as the file gave it) on that store is accepted.
    assert load_dataset(str(tmp_path / "own"), llama).format == "chat"


def test_prepare_checks_the_template_file_before_reading_the_model(corpus, tmp_path, llama,
                                                                   capsys, monkeypatch):
    import effijax.sources
    from effijax.cli import main as cli_main

    base = tmp_path / "base-tokenizer"
    dataclasses.replace(llama.tokenizer, chat_template=None).save(base)
    missing = tmp_path / "no" / "such.jinja"
    read = []  # the model's tokenizer is not read (Gemma 3's GGUF is assembled first)
    monkeypatch.setattr(effijax.sources, "prepare_tokenizer", read.append)
    argv = ["data", "prepare", str(corpus / "qa.jsonl"), "--out", str(tmp_path / "s"),
            "--from", str(base), "--processes", "1"]
    assert cli_main([*argv, "--chat-template", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err == (f"effijax data prepare: error: --chat-template={str(missing)!r}: no such "
                   "file; give a Jinja chat template file\n")
    assert read == []
    monkeypatch.undo()
    template = tmp_path / "turns.jinja"
    template.write_text(TURNS)
    text = [*argv, "--chat-template", str(template)]
    text[2] = str(corpus / "docs.jsonl")
    assert cli_main(text) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"effijax data prepare: error: --chat-template={str(template)!r}: "
                          "the source is read as text (documents), which no template "
                          "renders; drop --chat-template, or read chat records with --format "
                          "chat"), err
    assert cli_main([*argv, "--chat-template", str(template)]) == 0
    out = capsys.readouterr().out
    assert f"train on it: effijax train --data {tmp_path / 's'} --from {base} " \
           f"--chat-template {template}" in out
    assert open_store(tmp_path / "s").manifest["tokenizer"]["chat_template_sha256"] == \
        _sha256(TURNS)


def test_a_worker_whose_tokenizer_fails_answers_each_shard_with_the_reason(monkeypatch):
    """A pool would start a worker whose initializer raises again and again, for ever: the
    failure is the worker's answer instead, raised by the prepare as one line."""
    monkeypatch.setattr(_prepare, "_worker_tokenizer", None)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # restored after (the worker sets it)
    _prepare._init_worker({"spec": "not a tokenizer", "eos_id": 0, "bos_id": None,
                           "add_bos": False}, chat=False)
    result = _prepare._tokenize({"index": 0})
    with pytest.raises(ConfigError, match=r"could not be built in a tokenizing process "
                                          r"\(Exception: .*\); effijax data prepare --processes 1"):
        _prepare._raise(result["error"])


# A store that cannot be trusted ends in one line naming its file (issue #49) ----------------

def _bytes_store(tmp_path, name="a", text=b"hello store " * 500):
    (tmp_path / f"{name}.txt").write_bytes(text)
    prepare(tmp_path / f"{name}.txt", tmp_path / f"{name}.store", processes=1)
    return tmp_path / f"{name}.store"


def _forge(store, drop=(), **fields):
    """Rewrites the manifest with ``fields`` (and without ``drop``), its own hash recomputed:
    what a hostile manifest looks like, past the check of its hash."""
    from effijax.data import _store

    manifest = json.loads((store / "manifest.json").read_text())
    manifest = {k: v for k, v in {**manifest, **fields}.items() if k not in drop}
    manifest["sha256"] = _store._manifest_digest(manifest)
    (store / "manifest.json").write_text(json.dumps(manifest))


def _resign(store, name):
    """Records ``name``'s present sha256 in the manifest (a forged store whose hashes agree)."""
    import hashlib

    manifest = json.loads((store / "manifest.json").read_text())
    files = dict(manifest["files"])
    files[name] = {**files[name], "sha256": hashlib.sha256((store / name).read_bytes()).hexdigest()}
    _forge(store, files=files)


def test_a_manifest_with_wrong_fields_is_refused_naming_each_one(tmp_path):
    from effijax.errors import FileError

    store = _bytes_store(tmp_path)
    where = store / "manifest.json"
    original = where.read_text()
    split = {"train_tokens": 5700, "val_fraction": 0.05, "val_tokens": 300}
    cases = [
        ({"drop": ("tokens", "split", "tokenizer")}, "tokens",
         "tokens: is missing; and tokenizer: is missing; and split: is missing"),
        ({"tokens": "6000"}, "tokens", "tokens='6000': must be an integer >= 0"),
        ({"dtype": "int7", "data_format": "video"}, "data_format",
         "data_format='video': is not one of bytes, text, chat; and dtype='int7': is not one "
         "of uint8, uint16, uint32"),
        ({"split": {**split, "train_tokens": -3, "val_tokens": 6003}}, "split.train_tokens",
         "split.train_tokens=-3: must be an integer >= 0"),
        ({"split": {**split, "val_tokens": 301}}, "split",
         f"split={ {**split, 'val_tokens': 301}!r}: train_tokens + val_tokens is not the 6,000 "
         "tokens"),
        ({"tokenizer": "gpt2"}, "tokenizer", "tokenizer='gpt2': expected null (bytes) or "
         '{"sha256": 64 hex digits, "vocab_size": an integer >= 1}'),
        ({"tokenizer": {"sha256": "0" * 64, "vocab_size": 70000}}, "dtype",
         "dtype='uint8': cannot hold the tokenizer's 70,000 ids"),
    ]
    for fields, field, problem in cases:
        where.write_text(original)
        _forge(store, **fields)
        with pytest.raises(FileError) as e:
            load_dataset(str(store), BYTES)
        assert (e.value.path, e.value.field) == (str(where), field)
        assert str(e.value) == f"{where}: {problem}"
    # A hand-edited manifest (its hash not recomputed): the edit itself is refused.
    where.write_text(original.replace('"text_column": "text"', '"text_column": "body"'))
    with pytest.raises(FileError) as e:
        open_store(store)
    assert str(e.value) == (f"{where}: sha256: differs from the manifest's content: the "
                            "manifest was changed after it was prepared; prepare the store again")


def test_offsets_out_of_order_or_past_the_tokens_are_refused(tmp_path):
    from effijax.errors import FileError

    (tmp_path / "docs").mkdir()
    for i in range(3):
        (tmp_path / "docs" / f"{i}.txt").write_bytes(b"document %d " % i * 20)
    prepare(tmp_path / "docs", tmp_path / "s", processes=1)
    offsets = tmp_path / "s" / "offsets.bin"
    assert np.fromfile(offsets, np.int64).tolist() == [0, 220, 440, 660]
    for values, where, problem in (
            ([0, 220, 440, 661], "offsets", "run from 0 to 661; expected 0 to the 660 tokens"),
            ([5, 220, 440, 660], "offsets", "run from 5 to 660; expected 0 to the 660 tokens"),
            ([0, 440, 220, 660], "offset 2", "220 is below the one before it (440)")):
        offsets.write_bytes(np.array(values, np.int64).tobytes())
        with pytest.raises(FileError) as e:
            open_store(tmp_path / "s")
        assert (e.value.path, e.value.where) == (str(offsets), where)
        assert str(e.value) == (f"{offsets}: {where}: {problem}: the store is damaged; "
                                "prepare it again")


def test_a_store_changed_after_it_was_prepared_is_refused_naming_the_file(tmp_path,
                                                                          monkeypatch):
    from effijax.data import _store
    from effijax.errors import FileError

    store = _bytes_store(tmp_path)
    scans = []
    real_scan = _store._scan
    monkeypatch.setattr(_store, "_scan", lambda path, dtype: scans.append(path.name) or
                        real_scan(path, dtype))
    # Just prepared: each file is hashed, and again next time (changed within 2 s of its
    # hashing, a same-size write in the same clock tick would keep its times).
    assert verify_store(store).max_id == ord("t")
    assert verify_store(store).sha256 == open_store(store).manifest["sha256"]
    assert sorted(scans) == ["offsets.bin", "offsets.bin", "tokens.bin", "tokens.bin"]
    # Files last changed long before their hashing: recorded, and not hashed again.
    monkeypatch.setattr(_store, "_RACY_NS", 0)
    for name in ("tokens.bin", "offsets.bin"):
        os.utime(store / name, ns=(10**18, 10**18))
    scans.clear()
    verify_store(store)
    assert sorted(scans) == ["offsets.bin", "tokens.bin"]
    scans.clear()
    assert load_dataset(str(store), BYTES).tokens == 6000 and scans == []
    # tokens.bin rewritten in place, same size, manifest untouched: hashed again, refused.
    with open(store / "tokens.bin", "r+b") as f:
        f.write(b"j")
    with pytest.raises(FileError) as e:
        load_dataset(str(store), BYTES)
    assert scans == ["tokens.bin"]
    assert (e.value.path, e.value.where) == (str(store / "tokens.bin"), "sha256")
    assert str(e.value) == (f"{store / 'tokens.bin'}: sha256: differs from the manifest: the "
                            "store was changed after it was prepared; prepare it again")


def test_a_resumed_run_refuses_a_store_changed_since_the_run_started(tmp_path):
    """A run loads its data on every start (before its checkpoint is opened), so a resume
    verifies the store again; the fingerprint it records (the manifest's hash) could not tell."""
    from effijax.errors import FileError
    from effijax.recipe import TrainConfig
    from effijax.recipe._train import load_data

    store = _bytes_store(tmp_path)
    config = TrainConfig(model="tiny", seq_len=SEQ, data=str(store))
    started = load_data(config.sections.data, BYTES)
    (store / "tokens.bin").write_bytes(b"HELLO STORE " * 500)  # same size
    with pytest.raises(FileError, match=r"tokens\.bin: sha256: differs from the manifest: the "
                                        "store was changed after it was prepared"):
        load_data(config.sections.data, BYTES)
    assert started.fingerprint == f"store:{open_store(store).manifest['sha256']}"  # unchanged


def test_ids_beyond_the_models_vocabulary_are_refused(tmp_path):
    from effijax.errors import FileError

    store = _bytes_store(tmp_path)
    small = gpt_config("tiny", seq_len=SEQ, vocab_size=100)
    with pytest.raises(FileError) as e:
        load_dataset(str(store), small)
    assert str(e.value) == (f"{store / 'tokens.bin'}: token id: 116 is not below the "
                            "vocabulary of GPT d64 L2 (100 ids): the store was tokenized for "
                            "another model; prepare it again with --from the model you train")
    # A forged store whose hashes agree with its ids is refused the same way.
    (store / "tokens.bin").write_bytes(bytes([7] * 5999 + [200]))
    _resign(store, "tokens.bin")
    with pytest.raises(FileError, match=r"tokens\.bin: token id: 200 is not below"):
        load_dataset(str(store), small)
    assert load_dataset(str(store), BYTES).tokens == 6000  # 256 ids: 200 is one


def test_a_chat_store_that_trains_on_nothing_is_refused(corpus, tmp_path, llama):
    from effijax.errors import FileError

    store = tmp_path / "chat.store"
    prepare(corpus / "qa.jsonl", store, tokenizer=llama.tokenizer, processes=1)
    mask = store / "mask.bin"
    assert verify_store(store).trained == int(np.fromfile(mask, np.uint8).sum()) > 0
    mask.write_bytes(bytes(mask.stat().st_size))  # every byte 0
    with pytest.raises(FileError, match=r"mask\.bin: sha256: differs from the manifest"):
        load_dataset(str(store), llama)
    _resign(store, "mask.bin")  # forged: the hashes agree, the mask still trains nothing
    with pytest.raises(FileError) as e:
        load_dataset(str(store), llama)
    assert str(e.value) == (f"{mask}: mask: marks no token to train on (every byte is 0): "
                            "nothing would be trained; prepare it again from records with "
                            "assistant turns")
    mask.write_bytes(bytes([2]) * mask.stat().st_size)  # a mask is 0 or 1
    _resign(store, "mask.bin")
    with pytest.raises(FileError, match=r"mask\.bin: mask: holds the value 2; a mask is 0 or 1 "
                                        "per token"):
        load_dataset(str(store), llama)


def test_prepare_prepares_a_changed_store_again(tmp_path):
    store = _bytes_store(tmp_path)
    clean = _files(store)
    (store / "tokens.bin").write_bytes(bytes(6000))
    lines = []
    prepare(tmp_path / "a.txt", store, processes=1, print_fn=lines.append)
    assert lines[0] == (f"{store} is damaged or was changed after it was prepared "
                        f"({store / 'tokens.bin'}: sha256); preparing it again")
    assert _files(store) == clean
    lines.clear()
    prepare(tmp_path / "a.txt", store, processes=1, print_fn=lines.append)
    assert lines == [f"{store} is up to date (same sources, tokenizer and settings)"]


def test_mixture_weights_are_ratios_whatever_their_size(tmp_path):
    a, b = _bytes_store(tmp_path, "a"), _bytes_store(tmp_path, "b", b"other store " * 500)
    data = load_dataset(f"{a}:1e308,{b}:1e308", BYTES)  # their sum overflows
    assert data.train.weights == (0.5, 0.5)
    assert batch_at(data.train, seed=0, step=0, batch_size=4, seq_len=8)["inputs"].shape == (4, 8)
    with pytest.raises(ConfigError, match=r"^data=\[1e\+308, 1e-308\]: the weight 1e-308 is 0 "
                                          "next to the largest, 1e\\+308: that corpus would "
                                          "never be drawn"):
        load_dataset(f"{a}:1e308,{b}:1e-308", BYTES)


def test_a_damaged_store_ends_the_command_in_one_line(tmp_path, capsys):
    """effijax train and effijax data prepare, each given a store they cannot trust: exit 2,
    one line on stderr, nothing compiled."""
    from _compiles import compiles

    from effijax.cli import main as cli_main

    store = _bytes_store(tmp_path)
    _forge(store, drop=("split",), dtype="float32")
    with compiles() as compiled:
        assert cli_main(["train", "--model", "tiny", "--seq-len", "16", "--data", str(store),
                         "--out", str(tmp_path / "run"), "--steps", "1"]) == 2
    assert compiled == []
    err = capsys.readouterr().err
    assert err == (f"effijax train: error: {store / 'manifest.json'}: dtype='float32': is not "
                   "one of uint8, uint16, uint32; and split: is missing\n")
    # effijax data prepare writes it again (a store is rebuilt whole from its source).
    assert cli_main(["data", "prepare", str(tmp_path / "a.txt"), "--out", str(store),
                     "--processes", "1"]) == 0
    assert "is damaged or was changed after it was prepared" in capsys.readouterr().out
    assert verify_store(store).max_id == ord("t")
