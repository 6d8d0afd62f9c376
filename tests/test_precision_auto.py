"""``precision="auto"``: bf16 on a GPU/TPU and, for a model wide enough, on a CPU with native
bf16 matmuls; fp32 elsewhere; a run directory's own precision kept on resume. The CPU's
flags are patched in (the rule must not depend on the machine the tests run on)."""

import json

import pytest

from effijax.models import gpt_config, preset
from effijax.precision import (
    AUTO_BF16_MIN_WIDTH,
    AutoPrecision,
    auto_precision,
    cpu_flags,
    native_bf16,
)
from effijax.recipe import TrainConfig, _train, train

TINY = dict(model="tiny", seq_len=16, batch_size=2, eval_batches=1, progress=False)
AVX512_BF16 = frozenset({"avx2", "avx512f", "avx512_bf16"})


@pytest.mark.parametrize("backend, width, flags, expected", [
    ("gpu", 64, (), AutoPrecision("bf16", "auto: gpu")),
    ("tpu", 64, (), AutoPrecision("bf16", "auto: tpu")),
    ("cpu", 576, {"avx2", "avx512f"}, AutoPrecision("fp32", "auto: CPU without native bf16")),
    ("cpu", 576, AVX512_BF16, AutoPrecision("bf16", "auto: CPU with AVX512_BF16, width 576")),
    ("cpu", AUTO_BF16_MIN_WIDTH, {"amx_bf16", "avx512_bf16"},
     AutoPrecision("bf16", f"auto: CPU with AMX_BF16, width {AUTO_BF16_MIN_WIDTH}")),
    ("cpu", AUTO_BF16_MIN_WIDTH - 1, AVX512_BF16,
     AutoPrecision("fp32", f"auto: width {AUTO_BF16_MIN_WIDTH - 1} < {AUTO_BF16_MIN_WIDTH} on "
                           "a CPU")),
])
def test_the_rule(backend, width, flags, expected):
    assert auto_precision(backend, width, flags) == expected


def test_cpu_flags_reads_the_first_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu AVX2 avx512_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "avx2", "avx512_bf16"}
    assert native_bf16(cpu_flags(str(info))) == "AVX512_BF16"
    info.write_text("processor\t: 0\n")  # no flags line (not an x86 kernel's format)
    assert cpu_flags(str(info)) == frozenset()
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def _decide(config, model):
    """``decide_precision`` of ``config``'s sections it reads."""
    return _train.decide_precision(config.sections.precision, config.sections.output, model)


@pytest.fixture
def cpu(monkeypatch):
    """Sets the CPU's flags ``decide_precision`` sees."""
    def have(flags):
        monkeypatch.setattr(_train, "cpu_flags", lambda: frozenset(flags))
    return have


def test_the_recipe_decides_from_the_model_width_and_the_cpu(cpu, tmp_path):
    smollm2 = preset("smollm2-135m")  # an architecture only: no weights are read
    config = TrainConfig(**TINY, out=str(tmp_path / "run"))
    cpu(AVX512_BF16)
    assert _decide(config, smollm2) == AutoPrecision(
        "bf16", "auto: CPU with AVX512_BF16, width 576")
    assert _decide(config, gpt_config("tiny")).precision == "fp32"
    lora = TrainConfig(**TINY, lora_rank=8, lora_random_base=True, out=str(tmp_path / "run"))
    assert _decide(lora, smollm2).precision == "bf16"  # LoRA or not
    cpu({"avx2"})
    assert _decide(config, smollm2).precision == "fp32"
    # Asked for by name: no decision, nothing to say.
    named = TrainConfig(**TINY, precision="bf16", out=str(tmp_path / "run"))
    assert _decide(named, gpt_config("tiny")) == AutoPrecision("bf16", "")


def test_auto_picks_bf16_says_why_and_a_resume_elsewhere_keeps_it(cpu, monkeypatch, tmp_path,
                                                                     capsys):
    # The tiny GPT stands in for a wide model: the width rule's bound lowered to its width.
    monkeypatch.setattr("effijax.precision._auto.AUTO_BF16_MIN_WIDTH", 64)
    out = tmp_path / "run"
    cpu(AVX512_BF16)
    assert train(TrainConfig(**TINY, steps=2, out=str(out))).status == "done"
    assert "precision bf16 (auto: CPU with AVX512_BF16, width 64), 1 device" in \
        capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["precision"] == "bf16"

    # Resumed on a machine without native bf16: the run goes on as it began.
    cpu({"avx2"})
    result = train(TrainConfig(**TINY, steps=4, allow_changes="steps", out=str(out)))
    assert result.status == "done" and result.config.precision == "bf16"
    said = capsys.readouterr().out
    assert "resuming from step 2" in said and "precision bf16 (auto: the run's own)" in said

    # A new run there (another directory) decides afresh; so does one without checkpoints.
    fresh = _decide(TrainConfig(**TINY, out=str(tmp_path / "new")),
                                    gpt_config("tiny"))
    assert fresh == AutoPrecision("fp32", "auto: CPU without native bf16")
    unsaved = TrainConfig(**TINY, checkpoints=False, out=str(out))
    assert _decide(unsaved, gpt_config("tiny")).precision == "fp32"


def test_an_unreadable_run_config_leaves_the_decision_to_the_cpu(cpu, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text('{"precision": ')  # cut short; opening the run reports it
    cpu(AVX512_BF16)
    decided = _decide(TrainConfig(**TINY, out=str(out)), preset("smollm2-135m"))
    assert decided.precision == "bf16" and "the run's own" not in decided.reason


@pytest.mark.parametrize("rows, expected", [
    # Process 1's CPU has no native bf16: one program for both, so fp32.
    ([[-1, 1], [-1, 0]], AutoPrecision("fp32", "auto: CPU without native bf16")),
    ([[-1, 1], [-1, 1]], AutoPrecision("bf16", "auto: CPU with AVX512_BF16, width 576")),
    # Process 0 found the run's config.json (bf16, index 1): every process keeps it.
    ([[1, 0], [-1, 0]], AutoPrecision("bf16", "auto: the run's own")),
])
def test_processes_agree_on_what_auto_decides(cpu, monkeypatch, tmp_path, rows, expected):
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    cpu(AVX512_BF16)
    sent = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather",
                        lambda x: sent.append(np.asarray(x).tolist()) or np.asarray(rows))
    config = TrainConfig(**TINY, out=str(tmp_path / "run"))
    assert _decide(config, preset("smollm2-135m")) == expected
    assert sent == [[-1, 1]]  # this process (0): no run there, native bf16
