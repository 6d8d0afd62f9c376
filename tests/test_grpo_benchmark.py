"""``benchmarks/grpo.py``: its table and text from made-up steps, its TRL-side reward against
effijax's, and its flag checks (its timing needs the bundled model, torch and TRL, and
minutes)."""

import json

import pytest
from _benchmarks import script_fixture

from effijax.objectives import exact_match

grpo = script_fixture("grpo")


def _steps(rollout, train, completion=200, trained=600, reward=0.25):
    return [{"rollout_s": r, "train_s": t, "completion_tokens": completion,
             "trained_tokens": trained, "reward": reward} for r, t in zip(rollout, train,
                                                                          strict=True)]


def test_the_table_gives_both_phases_rates_and_effijaxs_over_trls(grpo):
    steps = {"effijax": _steps([2.0, 2.0, 6.0], [1.0, 1.0, 1.0]),
             "TRL": _steps([10.0, 10.0, 10.0], [4.0, 2.0, 3.0], completion=180, trained=540)}
    rows = grpo.rows_of(steps)
    assert [r["system"] for r in rows] == ["effijax", "TRL"]
    ours, theirs = rows
    # Rates: the steps' tokens over their seconds, summed (600 / 10 s, 540 / 30 s).
    assert ours["rollout_tokens_per_s"] == pytest.approx(60.0)
    assert theirs["rollout_tokens_per_s"] == pytest.approx(18.0)
    assert ours["rollout_ratio"] == pytest.approx(60 / 18)
    assert ours["train_tokens_per_s"] == pytest.approx(600.0)
    assert theirs["train_tokens_per_s"] == pytest.approx(180.0)
    assert ours["train_ratio"] == pytest.approx(600 / 180)
    assert theirs["rollout_ratio"] is None and theirs["train_ratio"] is None
    assert ours["rollout"]["median_s"] == 2.0 and ours["rollout"]["p90_s"] == 6.0
    warm = {"effijax": {"setup_s": 21.7, "compile_s": 11.1, "first_s": 11.53, "loss": 0.0},
            "TRL": {"setup_s": 24.0, "first_s": 60.17, "loss": 0.0}}
    meta = {"host": "AMD EPYC (2 cores, avx512_bf16)", "date": "2026-01-01",
            "load": "1.00 / 1.00 / 1.00 before", "batch_size": 8, "num_generations": 4,
            "max_completion_length": 32, "seq_len": 96, "threads": 2,
            "versions": "trl 1.16.0", "settle": 1, "rounds": 3, "steps_per_round": 1}
    text = grpo.render(rows, warm, meta)
    assert ("| effijax | 3 | 2.00 (2.00-6.00) | 60 | **3.33x** | 1.00 (1.00-1.00) | 600 | "
            "**3.33x** | 200.0 | 0.250 |") in text
    assert "| TRL | 3 | 10.00 (10.00-10.00) | 18 | - | 3.00 (2.00-4.00) | 180 | - |" in text
    assert "| effijax | 21.7 | 11.1 | 11.53 | 0.0000 |" in text
    assert "| TRL | 24.0 | - | 60.17 | 0.0000 |" in text
    assert "8 completions a step (2 prompts x 4), at most 32 tokens each" in text
    assert "AMD EPYC (2 cores, avx512_bf16); 2026-01-01; load average 1.00" in text


def test_one_system_alone_has_no_ratio(grpo):
    rows = grpo.rows_of({"effijax": _steps([1.0], [1.0])})
    assert len(rows) == 1 and rows[0]["rollout_ratio"] is None and rows[0]["train_ratio"] is None


def test_trls_reward_scores_as_effijaxs_exact_match(grpo, tmp_path):
    path = tmp_path / "p.jsonl"
    assert grpo.write_prompts(path) == 200
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records[0] == {"prompt": "What is 1 + 1?", "answer": "2"}
    texts = ["1 + 1 = 2.", "The answer is 3", "2", "two", "", "1,000 + 1 = 1,001", "-2.0"]
    answers = ["2", "2", "2", "2", "2", "1001", "-2"]
    chat = [[{"role": "assistant", "content": t}] for t in texts]
    theirs = grpo.exact_match(None, chat, answers)
    assert theirs == exact_match(None, chat, answer=answers)
    assert theirs == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize("argv, says", [
    (["--batch-size", "6"], "--batch-size: 6 completions; give a multiple of "
                            "--num-generations 4"),
    (["--num-generations", "1"], "--num-generations: 1; give at least 2"),
    (["--max-completion-length", "96"], "--max-completion-length: 96; give 1 to --seq-len - 1"),
    (["--rounds", "0"], "--rounds: give at least 1"),
])
def test_bad_flags_are_refused_before_anything_loads(grpo, capsys, argv, says):
    with pytest.raises(SystemExit):
        grpo.main(argv)
    assert says in capsys.readouterr().err
