"""Preference pairs from Parquet and Arrow tables (the JSONL pairs' columns, plain or in TRL's
conversational form), and TRL's ``truncation_mode`` for a side longer than a row: which tokens
survive, checked against the tokens themselves."""

import dataclasses
import json

import numpy as np
import pytest
from _llama_files import chat_tokenizer
from _pairs import write_pairs

from effijax.errors import ConfigError, FileError
from effijax.models import llama_config
from effijax.recipe._pairs import Pair, load_pairs, pair_rows, read_pairs

pa = pytest.importorskip("pyarrow", reason="Parquet and Arrow pairs are read with pyarrow")
pq = pytest.importorskip("pyarrow.parquet", reason="Parquet pairs are read with pyarrow")

CHAT = chat_tokenizer()
PLAIN = dataclasses.replace(CHAT, chat_template=None)  # [prompt][completion][EOS]
SEQ = 32
MODEL = dataclasses.replace(llama_config("llama-tiny", vocab_size=264, seq_len=SEQ),
                            tokenizer=CHAT)


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _ids(text):
    return CHAT.backend.encode(text, add_special_tokens=False).ids


def test_parquet_and_arrow_pairs_are_the_jsonl_pairs(tmp_path):
    write_pairs(tmp_path / "pairs.jsonl")
    table = pa.Table.from_pylist(_records(tmp_path / "pairs.jsonl"))
    pq.write_table(table, tmp_path / "pairs.parquet", row_group_size=7)
    with pa.OSFile(str(tmp_path / "pairs.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    want = load_pairs(str(tmp_path / "pairs.jsonl"), MODEL)
    for name in ("pairs.parquet", "pairs.arrow"):
        got = load_pairs(str(tmp_path / name), MODEL)
        # Each row reads as the line json.dumps writes: the same held-out pairs and fingerprint.
        assert got.fingerprint == want.fingerprint, name
        for split in ("train", "val"):
            np.testing.assert_array_equal(getattr(got, split).tokens_NW,
                                          getattr(want, split).tokens_NW)
            np.testing.assert_array_equal(getattr(got, split).mask_NW,
                                          getattr(want, split).mask_NW)
    assert read_pairs(str(tmp_path / "pairs.parquet"))[3].source.endswith("pairs.parquet:3")


def test_a_table_without_the_columns_names_them(tmp_path):
    pq.write_table(pa.table({"prompt": ["a"], "chosen": ["b"], "answer": ["c"]}),
                   tmp_path / "p.parquet")
    with pytest.raises(FileError, match=r"p.parquet: no column 'rejected' \(columns: prompt, "
                       r"chosen, answer\)"):
        read_pairs(str(tmp_path / "p.parquet"))
    pq.write_table(pa.table({"prompt": ["a"], "chosen": [" "], "rejected": ["c"]}),
                   tmp_path / "e.parquet")
    with pytest.raises(ConfigError, match=r"e.parquet:0': the chosen completion is empty"):
        read_pairs(str(tmp_path / "e.parquet"))


def _chat_pair(prompt, chosen, rejected):
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}


def test_conversational_pairs_train_on_the_completion_only(tmp_path):
    one = [{"role": "user", "content": "ab"}]
    turns = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"},
             {"role": "user", "content": "fg"}]
    records = [_chat_pair(one, "xy", "z"), _chat_pair(turns, "xy", "z")]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "chat.parquet")
    pairs = read_pairs(str(tmp_path / "chat.parquet"))
    assert pairs[1].prompt == turns  # read back as messages
    rows = pair_rows(CHAT, pairs, 64)
    # A one-turn conversation is the string pair rendered with the template, token for token.
    plain = pair_rows(CHAT, [Pair("ab", "xy", "z", "s", "")], 64)
    np.testing.assert_array_equal(rows.tokens_NW[:2], plain.tokens_NW)
    np.testing.assert_array_equal(rows.mask_NW[:2], plain.mask_NW)
    # Three turns: the earlier reply "cd" is context, only the completion is trained.
    tokens, mask = rows.tokens_NW[2], rows.mask_NW[2]
    assert CHAT.decode(tokens[mask == 1]) == "xy<|im_end|>"
    assert CHAT.decode(tokens[:mask.argmax()]) == (
        "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\ncd<|im_end|>\n"
        "<|im_start|>user\nfg<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ConfigError, match="conversational pairs are rendered with a chat "
                       "template"):
        pair_rows(PLAIN, pairs, 64)


@pytest.mark.parametrize("record, problem", [
    ({"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": "c"},
     "all strings or all conversations (lists of messages), but 'prompt' is a str"),
    (_chat_pair([{"role": "user"}], "b", "c"), "is not a {\"role\": str, \"content\": str}"),
    ({**_chat_pair([], "b", "c"), "chosen": [{"role": "user", "content": "b"}]},
     "the chosen completion holds a message that is not the assistant's"),
    (_chat_pair([], "b", " "), "the rejected completion is empty"),
])
def test_a_bad_conversational_pair_is_one_line(tmp_path, record, problem):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(ConfigError) as e:
        read_pairs(str(path))
    assert problem in str(e.value) and f"{path}:1" in str(e.value)


# Plain text: the prompt's tokens, the completion's, then EOS (2). "abcdefg": 7 byte tokens.
LONG = Pair("abcdefg", "xyz", "vw", "p.jsonl:1", "")


def test_a_side_longer_than_a_row_is_refused_without_a_truncation_mode():
    with pytest.raises(ConfigError, match=r"p.jsonl:1': the chosen side is 11 tokens, over the "
                       r"8 of a row \(seq_len \+ 1\); .* --truncation-mode keep_start or "
                       "keep_end"):
        pair_rows(PLAIN, [LONG], 7)


def test_keep_start_keeps_each_sides_first_tokens():
    rows = pair_rows(PLAIN, [LONG], 7, truncation_mode="keep_start")
    assert rows.tokens_NW[0].tolist() == _ids("abcdefgx")  # chosen: 11 tokens -> the first 8
    assert rows.mask_NW[0].tolist() == [0] * 7 + [1]
    assert rows.tokens_NW[1].tolist() == _ids("abcdefgv")  # rejected: 10 tokens
    assert rows.mask_NW[1].tolist() == [0] * 7 + [1]
    assert rows.truncated == 2 and rows.examples == 2
    # A side that fits is untouched (padded, never cut).
    short = pair_rows(PLAIN, [Pair("ab", "x", "y", "s", "")], 7, truncation_mode="keep_start")
    assert short.tokens_NW[0].tolist() == _ids("abx") + [2] + [2] * 4
    assert short.mask_NW[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0] and short.truncated == 0


def test_keep_end_keeps_each_sides_last_tokens():
    rows = pair_rows(PLAIN, [LONG], 7, truncation_mode="keep_end")
    assert rows.tokens_NW[0].tolist() == _ids("defgxyz") + [2]  # the last 8 of 11
    assert rows.mask_NW[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert rows.tokens_NW[1].tolist() == _ids("cdefgvw") + [2]
    assert rows.mask_NW[1].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]


def test_keep_start_drops_a_pair_whose_prompt_fills_the_row_as_trl_does():
    # TRL drops an example whose prompt alone is max_length tokens or more (keep_start only):
    # here 8 prompt tokens in a row of 8.
    full = Pair("abcdefgj", "x", "y", "p.jsonl:2", "")
    rows = pair_rows(PLAIN, [LONG, full], 7, truncation_mode="keep_start")
    assert rows.examples == 2 and rows.tokens_NW.shape == (2, 8)
    assert rows.tokens_NW[0].tolist() == _ids("abcdefgx")
    kept = pair_rows(PLAIN, [full], 7, truncation_mode="keep_end")
    assert kept.tokens_NW[0].tolist() == _ids("cdefgjx") + [2]  # the last 8 of 10
    assert kept.mask_NW[0].tolist() == [0] * 6 + [1, 1]
    with pytest.raises(ConfigError, match="truncation_mode='keep_middle': choose keep_start or "
                       "keep_end"):
        pair_rows(PLAIN, [LONG], 7, truncation_mode="keep_middle")


def test_a_truncation_mode_is_part_of_the_datas_fingerprint(tmp_path):
    write_pairs(tmp_path / "pairs.jsonl")
    path = str(tmp_path / "pairs.jsonl")
    plain = load_pairs(path, MODEL)
    cut = load_pairs(path, MODEL, truncation_mode="keep_end")
    assert cut.fingerprint == f"{plain.fingerprint}:keep_end"  # no side is cut here
    np.testing.assert_array_equal(cut.train.tokens_NW, plain.train.tokens_NW)
    assert "0 sides cut (keep_end)" in cut.note


def test_the_runs_truncation_mode_reaches_its_pairs(tmp_path):
    from effijax.recipe import TrainConfig
    from effijax.recipe._train import load_data

    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"prompt": "abcdefg" * 5 + str(i), "chosen": "xy",
                                        "rejected": "z"}) + "\n" for i in range(20)))
    config = TrainConfig(objective="dpo", data=str(path), truncation_mode="keep_end")
    data = load_data(config.sections.data, MODEL, objective="dpo",
                     settings=config.objective_settings)
    rows = data.train
    assert rows.truncated == len(rows) and rows.tokens_NW.shape == (2 * 19, 33)  # every side cut
    # Each row keeps its last 33 tokens: the prompt's end, the completion, the template's end.
    for row, completion in ((0, "xy"), (1, "z")):
        text = CHAT.decode(rows.tokens_NW[row])
        assert not text.startswith("<|im_start|>user")
        assert text.endswith(f"<|im_end|>\n<|im_start|>assistant\n{completion}<|im_end|>\n")
        assert "abcdefgabcdefg" in text
        assert CHAT.decode(rows.tokens_NW[row][rows.mask_NW[row] == 1]) == \
            f"{completion}<|im_end|>"
    with pytest.raises(ConfigError, match="the chosen side is"):
        load_data(dataclasses.replace(config, truncation_mode=None).sections.data, MODEL,
                  objective="dpo", settings=config.objective_settings)
    with pytest.raises(ConfigError, match="truncation_mode='keep_end': only applies to the "
                       "preference objectives' pairs"):
        TrainConfig(data=str(path), truncation_mode="keep_end")
