"""``benchmarks/attention.py --blocks``: the block-size table a run prints, on a tiny head."""

import re

from _benchmarks import script_fixture

attention = script_fixture("attention")


def test_block_size_table_marks_the_default_and_the_fastest(attention, monkeypatch):
    monkeypatch.setattr(attention, "HEAD_SHAPES", (("tiny", 2, 1, 8, None),
                                                    ("tiny, window 512", 2, 1, 8, 512)))
    text = attention.block_sizes([16, 1100], rounds=1, steps_per_round=1)
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 3, text  # the windowed shape only at 1,100 tokens
    short, long, windowed = rows
    # 16 tokens: no block below the length, so one tile, the default; 64 / default has no 64.
    assert short[1:5] == ["4 x 16", "-", "-", "-"] and short[6:8] == ["one tile", "one tile"]
    assert short[8] == "1.00" and short[9] == "- |"
    # 1,100 tokens: 2048 // 1100 = 1 row; every block size below 1,100 timed, the default 256.
    assert long[1] == "1 x 1100" and all(re.fullmatch(r"\d+\.\d", c) for c in long[2:6]), long
    assert long[6] == "256" and long[7] in ("64", "128", "256", "one tile")
    assert float(long[8]) >= 1.0 and re.fullmatch(r"\d+\.\d\d \|", long[9]), long
    # Under the window: the same default, timed with the window.
    assert windowed[0] == "| tiny, window 512" and windowed[1] == "1 x 1100", windowed
    assert windowed[6] == "256" and re.fullmatch(r"\d+\.\d\d \|", windowed[9]), windowed
