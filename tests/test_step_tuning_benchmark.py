"""benchmarks/step_tuning.py: its dry run measures every section (tokens a step, remat, XLA
flags in a child process), writes its report where it is asked, and leaves RESULTS.md alone
without --write. The GPU's numbers come from a GPU; this checks that the command it runs works."""

import json
import math

import pytest
from _benchmarks import private_results, script_fixture

tuning = script_fixture("step_tuning", "tuning")


@pytest.mark.slow  # a child process and a dozen tiny compilations
def test_dry_run_measures_every_section_and_leaves_results_alone(tuning, tmp_path, monkeypatch,
                                                                 capsys):
    results_md = private_results(monkeypatch, tmp_path)
    before = results_md.read_text()
    out_dir = tmp_path / "out"
    tuning.main(["--dry-run", "--out-dir", str(out_dir)])
    assert results_md.read_text() == before  # no --write: printed only

    sections = json.loads((out_dir / "step_tuning.json").read_text())["sections"]
    assert list(sections) == [s.name for s in tuning.SECTIONS] == ["XLA flags", "tokens",
                                                                   "remat"]
    assert {n: s["status"] for n, s in sections.items()} == dict.fromkeys(sections, "ok")

    def positive(*xs):
        return all(isinstance(x, int | float) and math.isfinite(x) and x > 0 for x in xs)

    tokens = sections["tokens"]["result"]["rows"]
    assert [(r["batch"], r["seq_len"]) for r in tokens] == list(tuning.TUNING_DRY_RUN.shapes)
    for r in tokens:
        assert r["tokens"] == r["batch"] * r["seq_len"]
        assert positive(r["step_s"], r["flops_per_s"], r["estimate"]) and r["mfu"] is None
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_s"])
    remat = sections["remat"]["result"]["rows"]
    assert [r["remat"] for r in remat] == ["none", "dots", "block"]
    assert all(positive(r["step_s"], r["temp_bytes"]) for r in remat)
    flags = sections["XLA flags"]["result"]["rows"]
    assert [r["flag"] for r in flags] == ["", *tuning.TUNING_DRY_RUN.flags]
    assert all(positive(r["step_s"], r["process_s"]) for r in flags)
    # Every flag the GPU run adds is one XLA knows (an unknown flag aborts the child).
    assert all(f.startswith("--xla_gpu_") for f in tuning.TUNING_GPU.flags)

    md = (out_dir / "step_tuning.md").read_text()
    assert md.startswith("Command: `python benchmarks/step_tuning.py --dry-run --out-dir ")
    assert all(f"### {name}\n" in md for name in sections)
    assert "(printed only; add --write" in capsys.readouterr().out
