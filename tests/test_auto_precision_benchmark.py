"""``benchmarks/auto_precision.py``: its rows and text from given timings, and a smoke run."""

import pytest
from _benchmarks import script_fixture

bench = script_fixture("auto_precision", "bench")


def test_rows_mark_what_auto_picks_and_the_text_says_whether_it_was_right(bench):
    models = {n: bench.model_of(n, 1, 8) for n in ("mini", "smollm2")}
    timing = {"mini fp32": {"median_s": 1.0}, "mini bf16": {"median_s": 1.0 / 0.95},
              "smollm2 fp32": {"median_s": 1.0}, "smollm2 bf16": {"median_s": 0.5}}
    rows = bench.rows_of(models, timing, 64, {"avx512_bf16"})
    assert [(r["model"], r["width"], r["auto"]) for r in rows] == [
        ("mini", 128, "fp32"), ("smollm2", 576, "bf16")]
    assert rows[1]["bf16 / fp32"] == pytest.approx(2.0) and rows[1]["fp32"] == 64.0
    text = bench.render(rows, layers=1, batch_size=2, seq_len=8, rounds=1, load="0 before")
    assert "| smollm2 | 576 | 64 | 128 | 2.00x | bf16 |" in text
    assert text.endswith("exactly where bf16 is faster.")
    # Without native bf16, auto keeps fp32, and smollm2's 2x says the rule missed it.
    rows = bench.rows_of(models, timing, 64, {"avx2"})
    assert {r["auto"] for r in rows} == {"fp32"}
    assert "where bf16 is not faster" in bench.render(rows, layers=1, batch_size=2, seq_len=8,
                                                      rounds=1, load="0 before")


@pytest.mark.slow  # compiles four tiny steps
def test_a_smoke_run_prints_the_table_and_writes_nothing(bench, capsys):
    bench.main(["--models", "tiny,small", "--layers", "1", "--batch-size", "2", "--seq-len",
                "16", "--rounds", "1", "--steps-per-round", "1"])
    out = capsys.readouterr().out
    assert "auto precision on the CPU: bf16 / fp32 by model width" in out
    assert "| tiny | 64 |" in out and "| small | 384 |" in out
    with pytest.raises(SystemExit):
        bench.main(["--models", "tiny,huge"])
    assert "--models: unknown huge" in capsys.readouterr().err
