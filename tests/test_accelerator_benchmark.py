"""``benchmarks/accelerator.py``: the MFU arithmetic on a hand-computed case, sections that fail or
overrun without stopping the others, and the ``--dry-run`` end to end (every section measured,
finite positive numbers, RESULTS.md left alone without ``--write``)."""

import dataclasses
import json
import math
import time

import pytest
from _benchmarks import private_results, run_examples, script_fixture

from effijax.models import GPTConfig

# Examples that compile a train step: run by the dry-run test, after the run compiled it.
COMPILING_EXAMPLES = ("train_variant", "hand_written_fp16_variant", "profile_step")


accelerator = script_fixture("accelerator")


def test_mfu_by_hand(accelerator):
    # One layer, D=8, two heads of 4, S=4, V=10: 6,192 FLOPs per token (tests/test_mfu_benchmark).
    config = GPTConfig(vocab_size=10, seq_len=4, d_model=8, n_layers=1, n_heads=2)
    row = accelerator.mfu_row(config, tokens=1000, step_s=0.5, device_kind="NVIDIA H100 80GB HBM3",
                              matmul_flops_per_s=24.768e6)
    assert row["flops_per_s"] == pytest.approx(6192 * 1000 / 0.5)
    assert row["tokens_per_s"] == 2000
    assert row["spec_peak"] == 989.4e12
    assert row["mfu_vs_spec"] == pytest.approx(12.384e6 / 989.4e12)
    assert row["mfu_vs_matmul"] == pytest.approx(0.5)
    cpu = accelerator.mfu_row(config, 1000, 0.5, "cpu", 24.768e6)
    assert cpu["spec_peak"] is None and cpu["mfu_vs_spec"] is None
    pcie = accelerator.mfu_row(config, 1000, 0.5, "NVIDIA H100 PCIe", 1.0)
    assert pcie["mfu_vs_spec"] == pytest.approx(12.384e6 / 756e12)


def test_examples_that_compile_nothing(accelerator):
    names = {n for n in dir(accelerator) if callable(getattr(accelerator, n))
             and not n.startswith("_")} - set(COMPILING_EXAMPLES)
    assert run_examples(accelerator, names) >= 5


def test_a_failing_or_overrunning_section_does_not_stop_the_others(accelerator, capsys):
    Section, Context = accelerator.Section, accelerator.Context
    sizes = dataclasses.replace(accelerator.DRY_RUN, budgets_s={"slow": 0.2})

    def boom(ctx):
        raise ValueError("bad thing\nsecond line")

    def slow(ctx):
        for _ in range(200):  # interrupted by the section's alarm at its budget + grace
            time.sleep(0.05)
        return {"never": True}

    snapshots = []
    sections = [Section("boom", boom, str), Section("fine", lambda ctx: {"x": 1.5}, str),
                Section("slow", slow, str), Section("after", lambda ctx: {"y": 2}, str)]
    results = accelerator.run_sections(
        sections, Context(sizes, True, 0.0), time_limit=600, grace_s=0.2,
        after_each=lambda r: snapshots.append({k: v["status"] for k, v in r.items()}))
    assert snapshots == [
        {"boom": "failed"},
        {"boom": "failed", "fine": "ok"},
        {"boom": "failed", "fine": "ok", "slow": "failed"},
        {"boom": "failed", "fine": "ok", "slow": "failed", "after": "ok"},
    ]
    assert results["boom"]["error"] == "ValueError: bad thing"
    assert results["fine"]["result"] == {"x": 1.5}
    assert results["slow"]["error"] == "SectionTimeout: over its time budget"
    assert 0.4 <= results["slow"]["seconds"] < 5  # stopped, not the 10 s it asked for
    # A section that would start after the run's time limit is skipped, and said so.
    late = accelerator.run_sections([Section("late", lambda ctx: {}, str)],
                                    Context(sizes, True, 0.0), time_limit=0, grace_s=0.2,
                                    after_each=lambda r: None)
    assert late["late"]["status"] == "skipped"
    assert late["late"]["error"] == "the run's 0 s were used up"
    out, err = capsys.readouterr()
    assert "section boom failed: ValueError: bad thing\n" in out
    assert "Traceback" in err and "second line" in err
    text = accelerator.render(results, sections, device="cpu", dry_run=True, total_s=1.0)
    assert "Not measured (failed: ValueError: bad thing)" in text
    assert "### fine\n\n{'x': 1.5}" in text


@pytest.mark.slow  # every section on tiny sizes, and a child process: 40-60 s on 2 cores
def test_dry_run_measures_every_section_and_leaves_results_alone(accelerator, tmp_path,
                                                                  monkeypatch, capsys):
    results_md = private_results(monkeypatch, tmp_path)
    before = results_md.read_text()
    out_dir = tmp_path / "out"
    accelerator.main(["--dry-run", "--out-dir", str(out_dir)])
    assert results_md.read_text() == before  # no --write: printed only

    report = json.loads((out_dir / "accelerator.json").read_text())
    sections = report["sections"]
    assert list(sections) == [s.name for s in accelerator.SECTIONS]
    assert {n: s["status"] for n, s in sections.items()} == dict.fromkeys(sections, "ok")

    def positive(*xs):
        return all(isinstance(x, int | float) and math.isfinite(x) and x > 0 for x in xs)

    m = sections["memory"]["result"]
    assert positive(m["estimate"], m["compiled_total"], m["activations_formula"])
    assert m["estimate"] == (m["params_and_optimizer"] + m["grads"] + m["compute_copy"]
                             + m["activations_formula"] + m["batch_and_counters"])
    assert m["device_peak"] is None and "memory_stats" in m["device_peak_missing"]
    precision = sections["precision"]["result"]["rows"]
    assert [r["precision"] for r in precision] == ["fp32", "bf16", "fp16 + dynamic loss scaling"]
    assert all(positive(r["step_s"], r["tokens_per_s"], r["speedup_vs_fp32"]) for r in precision)
    assert precision[0]["speedup_vs_fp32"] == 1.0
    scaling = sections["loss scaling"]["result"]["rows"]
    assert len(scaling) == 3 and all(positive(r["step_s"], r["vs_hand_written"]) for r in scaling)
    mfu = sections["MFU"]["result"]
    assert len(mfu["rows"]) == len(accelerator.DRY_RUN.ladder) and mfu["spec_peak"] is None
    for r in mfu["rows"]:
        assert positive(r["flops_per_s"], r["mfu_vs_matmul"], r["matmul_peak"])
        assert r["mfu_vs_matmul"] == pytest.approx(r["flops_per_s"] / mfu["matmul_peak"])
        assert r["mfu_vs_spec"] is None  # no data-sheet peak for a CPU
    profile = sections["profile"]["result"]
    assert [m["model"].split()[0] for m in profile["models"]] == ["GPT", "Llama"]
    for m in profile["models"]:
        kinds = {c["category"]: c for c in m["categories"]}
        assert {"matmuls", "attention", "head and loss", "optimizer update", "idle"} <= set(kinds)
        assert positive(m["step_s"], m["model_flops"], kinds["matmuls"]["flops"],
                        kinds["attention"]["flops"], kinds["optimizer update"]["seconds"])
        assert m["counted_flops"] == sum(c["flops"] for c in m["categories"])
        assert m["mfu"] is None and "| matmuls |" in m["table"]  # no data-sheet peak: a CPU
    attention = sections["attention"]["result"]["rows"]
    assert {r["impl"] for r in attention} == set(accelerator.ATTENTION_IMPLS)
    assert all(positive(r["fwd_bwd_s"], r["temp_bytes"]) for r in attention)
    det = sections["determinism"]["result"]
    assert [r["flag"] for r in det["rows"]] == ["(none)", accelerator.DETERMINISM_FLAG]
    assert det["rows"][1]["xla_flags"].endswith(accelerator.DETERMINISM_FLAG)
    assert all(r["bitwise_equal"] for r in det["rows"])  # XLA:CPU is deterministic
    assert positive(det["cost"], *(r["step_s"] for r in det["rows"]))

    md = (out_dir / "accelerator.md").read_text()
    assert md.startswith("Command: `python benchmarks/accelerator.py --dry-run --out-dir ")
    assert all(f"### {name}\n" in md for name in sections)
    assert "(printed only; add --write" in capsys.readouterr().out
    # The step-building examples reuse the steps the run compiled.
    assert run_examples(accelerator, COMPILING_EXAMPLES) >= 5
