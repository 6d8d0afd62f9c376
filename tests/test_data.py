"""Tests of the offline corpora and deterministic batching."""

import doctest

import numpy as np
import pytest

from effijax.data import (
    DEFAULT_MAX_BYTES,
    _batches,
    _corpus,
    batch_at,
    corpus_fingerprint,
    eval_batches,
    load_corpus,
    split_corpus,
    stdlib_files,
)
from effijax.errors import ConfigError

CORPUS = np.frombuffer(bytes(range(256)) * 8, dtype=np.uint8)  # 2048 tokens, token i at i % 256


def test_default_corpus_is_capped_deterministic_python():
    tokens = load_corpus()
    assert tokens.dtype == np.uint8 and tokens.shape == (DEFAULT_MAX_BYTES,)
    again = load_corpus(max_bytes=1000)
    np.testing.assert_array_equal(again, tokens[:1000])
    assert b"def " in tokens[:200_000].tobytes() and b"import " in tokens[:200_000].tobytes()
    files = stdlib_files()
    parts = {part for f in files for part in f.parts}
    assert not parts & {"site-packages", "test", "idlelib", "__pycache__"}
    # The corpus starts with the first file in sorted order.
    first = np.frombuffer(files[0].read_bytes()[:100], np.uint8)
    np.testing.assert_array_equal(tokens[:100], first)


def test_load_file_and_folder(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"second")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "z.py").write_bytes(b"first-")
    (tmp_path / ".hidden").write_bytes(b"secret")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01binary")
    assert load_corpus(tmp_path).tobytes() == b"first-second"
    assert load_corpus(tmp_path / "b.txt").tobytes() == b"second"
    assert load_corpus(tmp_path, max_bytes=8).tobytes() == b"first-se"


def test_load_errors(tmp_path):
    def fails(match, path, **kwargs):
        with pytest.raises(ConfigError, match=match) as e:
            load_corpus(path, **kwargs)
        return e.value

    missing = tmp_path / "missing.txt"
    e = fails(r"^path='.*missing\.txt': does not exist; pass a text file", missing)
    assert (e.field, e.value) == ("path", str(missing))
    (tmp_path / "empty.txt").write_bytes(b"")
    assert fails(r"^path='.*empty\.txt': the corpus is empty",
                 tmp_path / "empty.txt").field == "path"
    (tmp_path / "short.txt").write_bytes(b"abc")
    fails(r"^path='.*short\.txt': the corpus has 3 bytes, fewer than the 65 needed",
          tmp_path / "short.txt", min_bytes=65)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "x").write_bytes(b"\x00")
    fails(r"^path='.*bin': the folder holds no readable text files", tmp_path / "bin")
    for bad in (0, -1, "5", True):
        e = fails(f"^max_bytes={bad!r}: must be an integer >= 1 \\(or None\\): None reads 8 MiB",
                  tmp_path / "short.txt", max_bytes=bad)
        assert (e.field, e.value) == ("max_bytes", bad)


def test_fingerprint():
    a = corpus_fingerprint(CORPUS)
    assert a == corpus_fingerprint(CORPUS.copy())
    assert a.startswith("2048:") and len(a) == len("2048:") + 16
    changed = CORPUS.copy()
    changed[7] ^= 1
    assert corpus_fingerprint(changed) != a


def test_split_corpus():
    train, val = split_corpus(CORPUS, 0.25)
    assert (train.size, val.size) == (1536, 512)
    np.testing.assert_array_equal(np.concatenate([train, val]), CORPUS)
    train, val = split_corpus(CORPUS)
    assert val.size == round(2048 * 0.05)
    for bad in (0.0, 1.0, -0.1, "0.1"):
        with pytest.raises(ConfigError, match=f"^val_fraction={bad!r}: expected a fraction in "
                           r"\(0, 1\)") as e:
            split_corpus(CORPUS, bad)
        assert (e.value.field, e.value.value) == ("val_fraction", bad)
    with pytest.raises(ConfigError, match=r"^tokens=\(1,\): expected a 1-D corpus of at least 2"):
        split_corpus(CORPUS[:1])


def test_batch_shapes_targets_and_windows():
    batch = batch_at(CORPUS, seed=0, step=0, batch_size=8, seq_len=32)
    assert set(batch) == {"inputs", "targets"}
    for x in batch.values():
        assert x.shape == (8, 32) and x.dtype == np.int32
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    # Windows are contiguous slices of the corpus: token i is followed by token (i + 1) % 256.
    np.testing.assert_array_equal(batch["targets"], (batch["inputs"] + 1) % 256)


def test_batch_is_a_function_of_seed_and_step():
    kw = dict(batch_size=8, seq_len=16)
    a = batch_at(CORPUS, seed=3, step=5, **kw)
    b = batch_at(CORPUS, seed=3, step=5, **kw)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["inputs"], batch_at(CORPUS, seed=3, step=6, **kw)["inputs"])
    assert not np.array_equal(a["inputs"], batch_at(CORPUS, seed=4, step=5, **kw)["inputs"])
    # Pinned values: a change of generator would silently change every run's data.
    assert a["inputs"][:, 0].tolist() == _PINNED_FIRST_TOKENS


# First tokens of batch_at(CORPUS, seed=3, step=5, batch_size=8, seq_len=16) with Philox.
_PINNED_FIRST_TOKENS = [0, 181, 113, 162, 199, 79, 234, 243]


def test_batch_covers_the_whole_corpus():
    starts = np.concatenate([
        batch_at(np.arange(100, dtype=np.int32), seed=0, step=s, batch_size=16,
                 seq_len=9)["inputs"][:, 0]
        for s in range(50)
    ])
    assert starts.min() == 0 and starts.max() == 100 - 10


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_slices_concatenate_to_global_batch(process_count):
    kw = dict(seed=11, step=7, batch_size=8, seq_len=16)
    whole = batch_at(CORPUS, **kw)
    parts = [batch_at(CORPUS, process_index=i, process_count=process_count, **kw)
             for i in range(process_count)]
    for k in whole:
        assert parts[0][k].shape == (8 // process_count, 16)
        np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), whole[k])


def test_batch_errors():
    kw = dict(seed=0, step=0, seq_len=16)
    with pytest.raises(ConfigError, match="^batch_size=8: not divisible by process_count=3"):
        batch_at(CORPUS, batch_size=8, process_count=3, **kw)
    with pytest.raises(ConfigError, match=r"^process_index=2: must be in \[0, process_count=2\)"):
        batch_at(CORPUS, batch_size=8, process_index=2, process_count=2, **kw)
    with pytest.raises(ConfigError, match=r"^seq_len=16: the corpus has 16 tokens, fewer than "
                       r"seq_len \+ 1 = 17"):
        batch_at(CORPUS[:16], batch_size=8, **kw)
    with pytest.raises(ConfigError, match=r"^tokens=\(2, 1024\): expected a 1-D corpus"):
        batch_at(CORPUS.reshape(2, -1), batch_size=8, **kw)
    with pytest.raises(ConfigError, match="^step=-1: must be an integer >= 0"):
        batch_at(CORPUS, seed=0, step=-1, batch_size=8, seq_len=16)
    with pytest.raises(ConfigError, match=r"^seed=18446744073709551616: must be an integer "
                       "from 0 to 18,446,744,073,709,551,615"):
        batch_at(CORPUS, seed=2**64, step=0, batch_size=8, seq_len=16)
    with pytest.raises(ConfigError, match="^batch_size=0: must be an integer >= 1"):
        batch_at(CORPUS, batch_size=0, **kw)


def test_eval_batches_are_fixed_and_sliced():
    kw = dict(batch_size=4, seq_len=16, num_batches=3)
    batches = eval_batches(CORPUS, **kw)
    again = eval_batches(CORPUS, **kw)
    assert len(batches) == 3
    starts = []
    for a, b in zip(batches, again, strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
        np.testing.assert_array_equal(a["targets"][:, :-1], a["inputs"][:, 1:])
        assert a["inputs"].shape == (4, 16) and a["inputs"].dtype == np.int32
        starts += a["inputs"][:, 0].tolist()
    # 12 evenly spread windows from 0 to the last start, 2048 - 17.
    expected = np.linspace(0, 2048 - 17, 12).astype(np.int64) % 256
    assert starts == expected.tolist()
    halves = [eval_batches(CORPUS, process_index=i, process_count=2, **kw) for i in range(2)]
    for j in range(3):
        np.testing.assert_array_equal(
            np.concatenate([halves[0][j]["inputs"], halves[1][j]["inputs"]]),
            batches[j]["inputs"],
        )
    with pytest.raises(ConfigError, match="^num_batches=0: must be an integer >= 1"):
        eval_batches(CORPUS, batch_size=4, seq_len=16, num_batches=0)


def test_docstring_examples():
    for module in (_corpus, _batches):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_led_windows_start_with_the_bos_and_reach_the_corpus_end():
    from effijax.data import Led

    corpus = np.arange(100, 120)
    seen_last = False
    for step in range(40):
        batch = batch_at(Led(corpus, first=2), seed=5, step=step, batch_size=4, seq_len=6)
        assert (batch["inputs"][:, 0] == 2).all()
        assert (batch["targets"][:, :-1] == batch["inputs"][:, 1:]).all()
        body = np.concatenate([batch["inputs"][:, 1:], batch["targets"][:, -1:]], axis=1)
        assert (np.diff(body, axis=1) == 1).all()  # six consecutive corpus tokens
        seen_last |= bool((body[:, -1] == corpus[-1]).any())
    assert seen_last
    again = batch_at(Led(corpus, first=2), seed=5, step=7, batch_size=4, seq_len=6)
    assert np.array_equal(again["inputs"], batch_at(Led(corpus, first=2), seed=5, step=7,
                                                    batch_size=4, seq_len=6)["inputs"])
    with pytest.raises(ConfigError, match=r"^seq_len=20: the corpus has 20 tokens, fewer"):
        batch_at(Led(corpus, first=2), seed=0, step=0, batch_size=1, seq_len=21)


def test_no_window_holds_the_bos_twice_where_the_corpus_has_its_own():
    """A BOS tokenizer's stream starts each document with the BOS: a training window, an
    evaluation batch or an evaluation row drawn at a document's start holds it once (at
    position 0, untrained), never ``BOS, BOS``; every other token stays a target of the rows."""
    from effijax.data import Led, eval_batches
    from effijax.sources._data import text_rows

    docs = [np.arange(10 + 7 * d, 10 + 7 * d + 3 + d % 4) for d in range(12)]
    stream = np.concatenate([np.concatenate([[2], doc, [1]]) for doc in docs])  # BOS doc EOT
    led = Led(stream, first=2)
    for step in range(60):
        inputs = batch_at(led, seed=3, step=step, batch_size=8, seq_len=5)["inputs"]
        assert (inputs[:, 0] == 2).all() and not (inputs[:, 1] == 2).any(), inputs
    every = eval_batches(led, batch_size=len(stream) - 5, seq_len=5, num_batches=1)[0]
    assert not (every["inputs"][:, 1] == 2).any()  # every start, the BOS ones moved on
    rows = text_rows(stream, 5, first=2)
    assert (rows.tokens_NW[:, 0] == 2).all() and not (rows.tokens_NW[:, 1] == 2).any()
    targets = rows.tokens_NW[rows.mask_NW == 1].tolist()
    # Every token a target once, in order; only BOS tokens left out (those leading a row),
    # the stream's first among them.
    left_out, j = [], 0
    for i, token in enumerate(stream.tolist()):
        if j < len(targets) and targets[j] == token:
            j += 1
        else:
            assert token == 2, (i, token)
            left_out.append(i)
    assert j == len(targets) and left_out[0] == 0
    assert rows.filled == len(stream)


def test_text_data_of_a_bos_tokenizer_is_led_by_its_bos(tmp_path):
    """Gemma's tokenizer starts every text with <bos>: so does every training and evaluation
    window of text data; a tokenizer without (SmolLM2's) draws plain windows."""
    import dataclasses

    from _sentencepiece_files import vocabulary

    from effijax.data import Led
    from effijax.models import llama_config, sentencepiece_bpe
    from effijax.sources._data import load_dataset

    tokens, scores, types = vocabulary()
    kwargs = dict(bos_id=2, eos_id=1, unk_id=3, pad_id=0, add_space_prefix=False)
    (tmp_path / "a.txt").write_text("the ab bc\n" * 200)
    model = llama_config("llama-tiny", vocab_size=len(tokens), seq_len=16)
    for adds in (True, False):
        tok = sentencepiece_bpe(tokens, scores, types, add_bos=adds, **kwargs)
        data = load_dataset(str(tmp_path / "a.txt"), dataclasses.replace(model, tokenizer=tok))
        assert isinstance(data.train, Led) == adds and isinstance(data.val, Led) == adds
        batch = batch_at(data.train, seed=0, step=0, batch_size=8, seq_len=16)
        assert ((batch["inputs"][:, 0] == 2).all()) == adds
