"""``benchmarks/dpo.py``: its table and text from made-up steps, and its flag checks (its timing
needs the bundled model, torch and TRL, and minutes)."""

import pytest
from _benchmarks import script_fixture

dpo = script_fixture("dpo")


def _steps(seconds, others=0.0, cpu=3.0):
    return [{"s": s, "cpu_s": cpu, "others": others, "loss": 0.69} for s in seconds]


def test_the_table_compares_like_with_like_and_says_whether_the_goal_was_met(dpo):
    steps = {"effijax fp32": _steps([2.0, 2.0, 2.2]),
             "TRL fp32": _steps([3.0, 3.2, 9.0], others=0.1)[:2] + _steps([9.0], others=0.8),
             "effijax bf16": _steps([1.0, 1.1, 1.2]),
             "TRL bf16": _steps([1.2, 1.3, 1.4])}
    rows = dpo.rows_of(steps, 8 * 64, ["fp32", "bf16"])
    assert [(r["system"], r["precision"]) for r in rows] == [
        ("effijax", "fp32"), ("TRL", "fp32"), ("effijax", "bf16"), ("TRL", "bf16")]
    assert rows[0]["ratio"] == pytest.approx(3.2 / 2.0)  # medians: TRL's / effijax's s/step
    assert rows[0]["quiet_ratio"] == pytest.approx(3.1 / 2.0)  # TRL's 9 s step was not quiet
    assert rows[1]["quiet_n"] == 2 and rows[1]["ratio"] is None
    warm = {"effijax fp32": {"setup_s": 9.8, "compile_s": 7.4, "first_s": 4.0, "loss": 0.6931},
            "TRL fp32": {"setup_s": 25.2, "first_s": 30.0, "loss": 0.6931}}
    meta = {"host": "AMD EPYC (2 cores, avx512_bf16)", "date": "2026-01-01",
            "load": "1.00 / 1.00 / 1.00 before", "batch_size": 8, "seq_len": 64, "threads": 2,
            "cores": 2, "pair_tokens": 50.1, "versions": "trl 1.16.0",
            "settle": 1, "rounds": 3, "steps_per_round": 2}
    text = dpo.render(rows, warm, meta)
    assert "| effijax | fp32 | 3 | 2.00 | 2.00-2.20 | 256 | **1.60x** | 3.00 | 0% |" in text
    assert "| TRL | fp32 | 3 | 3.20 | 3.00-9.00 | 160 | - | 3.00 | 10% | 2, 3.10 | - |" in text
    assert "| effijax | fp32 | 9.8 | 7.4 | 4.00 | 0.6931 |" in text
    assert "| TRL | fp32 | 25.2 | - | 30.00 | 0.6931 |" in text
    assert ("- fp32: effijax DPO tokens/s / TRL's: **1.60x** (met: goal >= 1.3x); over the "
            "quiet steps only: 1.55x") in text
    assert "- bf16: effijax DPO tokens/s / TRL's: **1.18x** (MISSED: goal >= 1.3x)" in text
    assert "8 rows (4 pairs) x 64 positions = 512 tokens a step" in text
    assert "AMD EPYC (2 cores, avx512_bf16); 2026-01-01; load average 1.00" in text


def test_a_precision_without_both_systems_has_no_ratio(dpo):
    rows = dpo.rows_of({"effijax fp32": _steps([2.0])}, 128, ["fp32"])
    assert rows[0]["ratio"] is None and rows[0]["quiet_ratio"] is None


@pytest.mark.parametrize("argv, says", [
    (["--batch-size", "3"], "--batch-size: 3 rows; give an even number"),
    (["--precision", "fp16"], "--precision: fp16 not among fp32, bf16"),
    (["--steps", "0"], "--steps: 0; give at least 1"),
])
def test_bad_flags_are_refused_before_anything_loads(dpo, capsys, argv, says):
    with pytest.raises(SystemExit):
        dpo.main(argv)
    assert says in capsys.readouterr().err


def test_the_pairs_are_the_docs_sums(dpo, tmp_path):
    import json

    path = tmp_path / "pairs.jsonl"
    assert dpo.write_pairs(path) == 200
    first = json.loads(path.read_text().splitlines()[0])
    assert first == {"prompt": "What is 1 + 1?", "chosen": "1 + 1 = 2.",
                     "rejected": "1 + 1 = 3."}
