"""``benchmarks/lm_eval_requests.py``: its table and text from made-up passes, its flag checks,
and the requests both workers build (its timing needs the bundled model, torch and minutes)."""

import pytest
from _benchmarks import script_fixture

bench = script_fixture("lm_eval_requests", "bench")


def _timing(seconds):
    return {"median_s": seconds[1], "p10_s": seconds[0], "p90_s": seconds[2], "n": 3}


def _built(n, answers, digest="d1"):
    return {"requests": n, "digest": digest, "first_s": 7.5, "answers": answers}


def test_the_table_compares_the_same_requests_and_says_whether_the_goal_was_met(bench):
    timing = {"effijax loglikelihood": _timing([1.9, 2.0, 2.4]),
              "hf loglikelihood": _timing([4.5, 5.0, 6.0]),
              "effijax generate_until": _timing([3.0, 4.0, 4.4]),
              "hf generate_until": _timing([5.0, 5.2, 5.9])}
    built = {"effijax loglikelihood": _built(64, [[-1.0, True], [-7.25, False]]),
             "hf loglikelihood": _built(64, [[-1.00003, True], [-7.25, False]]),
             "effijax generate_until": _built(16, ["a", "b"]),
             "hf generate_until": _built(16, ["a", "c"])}
    rows = bench.rows_of(timing, built, ["loglikelihood", "generate_until"])
    assert [(r["kind"], r["task"], r["requests"]) for r in rows] == [
        ("loglikelihood", "effijax_qa_choice", 64), ("generate_until", "effijax_qa_exact", 16)]
    assert rows[0]["ratio"] == pytest.approx(2.5) and rows[0]["effijax_rps"] == 32.0
    assert rows[1]["ratio"] == pytest.approx(1.3) and rows[1]["hf_rps"] == pytest.approx(16 / 5.2)
    meta = {"host": "AMD EPYC (2 cores)", "date": "2026-01-01", "load": "1.00 before",
            "batch_size": 8, "max_length": 2048, "limit": 16, "threads": 2,
            "versions": "lm_eval 0.4.13", "rounds": 3, "passes": 1,
            "load_s": {"effijax": 11.0, "hf": 30.5}}
    text = bench.render(rows, meta)
    assert ("| loglikelihood | effijax_qa_choice | 64 | effijax | 3 | 2.00 | 1.90-2.40 | 32.0 | "
            "**2.50x** | 7.5 | logp differs by at most 3.0e-05, greedy flags equal |") in text
    assert ("| loglikelihood | effijax_qa_choice | 64 | hf | 3 | 5.00 | 4.50-6.00 | 12.8 | - | "
            "7.5 |  |") in text
    assert "| generate_until | effijax_qa_exact | 16 | effijax | 3 | 4.00 |" in text
    assert "1 of 2 the same text" in text
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == 6 and {line.count("|") for line in table} == {12}  # no cell splits
    assert "- loglikelihood: effijax requests/s / hf's: **2.50x** (met: goal >= 1.5x)" in text
    assert "- generate_until: effijax requests/s / hf's: **1.30x** (MISSED: goal >= 1.5x)" in text
    assert "On AMD EPYC (2 cores); 2026-01-01; load average 1.00 before." in text
    assert "batch size 8, max_length 2048" in text and "effijax 11.0 s, hf 30.5 s" in text


def test_workers_that_built_different_requests_are_not_compared(bench):
    timing = {"effijax loglikelihood": _timing([1, 2, 3]), "hf loglikelihood": _timing([1, 2, 3])}
    built = {"effijax loglikelihood": _built(4, [[-1.0, True]]),
             "hf loglikelihood": _built(4, [[-1.0, True]], digest="d2")}
    with pytest.raises(RuntimeError, match="loglikelihood: the two workers built different"):
        bench.rows_of(timing, built, ["loglikelihood"])


@pytest.mark.parametrize("argv, says", [
    (["--kinds", "rolling"], "--kinds: rolling not among loglikelihood, generate_until"),
    (["--kinds", ","], "--kinds: (none) not among"),
    (["--limit", "0"], "--limit: 0; give at least 1"),
    (["--batch-size", "0"], "--batch-size: 0; give at least 1"),
    (["--threads", "0"], "--threads: 0; give 1 to"),
])
def test_bad_flags_are_refused_before_anything_loads(bench, capsys, argv, says):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert says in capsys.readouterr().err


def test_smoke_is_small_and_never_writes(bench):
    args = bench.parse_args(["--smoke", "--write", "--kinds", "generate_until"])
    assert (args.limit, args.rounds, args.passes, args.write) == (2, 1, 1, False)
    assert args.kinds == ["generate_until"]
    default = bench.parse_args([])
    assert (default.limit, default.batch_size, default.kinds) == (
        16, 8, ["loglikelihood", "generate_until"])


def test_a_worker_starts_without_jax(bench):
    # In a fresh interpreter, as a worker starts: its flags parsed, harness (JAX) not imported.
    import subprocess
    import sys

    script = (f"import sys; sys.path.insert(0, {str(bench.ROOT / 'benchmarks')!r})\n"
              "import lm_eval_requests as m\n"
              "args = m.parse_args(['--worker', 'hf', '--limit', '2'])\n"
              "assert (args.worker, args.limit, args.write) == ('hf', 2, False), args\n"
              "print([n for n in ('jax', 'harness', 'effijax', 'torch') if n in sys.modules])")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_the_workers_build_the_harness_requests_of_the_shipped_tasks(bench):
    pytest.importorskip("lm_eval", reason="the requests are built by lm-evaluation-harness")
    choice = bench.build_requests("loglikelihood", 2)
    assert [r.request_type for r in choice] == ["loglikelihood"] * 8  # 4 choices a question
    context, continuation = choice[0].args
    assert context.startswith("Question: ") and context.endswith("Answer:")
    assert continuation.startswith(" ")
    exact = bench.build_requests("generate_until", 2)
    assert [r.request_type for r in exact] == ["generate_until"] * 2
    assert exact[0].args[1]["until"] == ["\n"] and exact[0].args[1]["max_gen_toks"] == 48
    assert bench._digest(choice) != bench._digest(choice[:7]) != bench._digest(exact)
