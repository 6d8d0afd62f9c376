"""``benchmarks/mfu.py``: the FLOP formula on hand-computed cases, the peak table, a smoke run."""

import pytest
from _benchmarks import script_fixture

from effijax.models import GPTConfig, gpt_config

mfu = script_fixture("mfu")


def test_flop_formula_by_hand(mfu):
    # tiny: V=256, S=64, D=64, L=2, H=4, K=16, F=256.
    per_layer_matmuls = 4 * 64 * 64 + 2 * 64 * 256  # q, k, v, o; fc_in, fc_out
    per_layer_small = 4 * 64 + 256 + 64 + 2 * 2 * 64  # biases of q k v o, fc_in, fc_out; 2 LNs
    n = 2 * (per_layer_matmuls + per_layer_small) + 2 * 64 + 256 * 64  # + final LN + tied head
    assert n == 116_480
    assert mfu.model_flops_per_token(gpt_config("tiny")) == 6 * n + 12 * 2 * 4 * 16 * 64
    # One layer, D=8, two heads of 4, F=32, S=4, V=10: 1,000 parameters, 32 of them the
    # position embedding.
    config = GPTConfig(vocab_size=10, seq_len=4, d_model=8, n_layers=1, n_heads=2)
    n = (4 * 8 * 8 + 2 * 8 * 32) + (4 * 8 + 32 + 8 + 2 * 2 * 8) + 2 * 8 + 10 * 8
    assert n == 968
    assert mfu.model_flops_per_token(config) == 6 * 968 + 12 * 1 * 2 * 4 * 4 == 6_192


def test_peak_table(mfu):
    assert mfu.peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert mfu.peak_flops("NVIDIA H100 80GB HBM3", "tf32") == 494.7e12
    assert mfu.peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert mfu.peak_flops("TFRT_CPU_0", "fp32") is None
    assert mfu.matmul_dtype("fp32") == "fp32" and mfu.matmul_dtype("bf16") == "bf16"


@pytest.mark.slow  # ~5 s on an idle 2-core CPU (compiling the tiny step), 14 s under load
def test_quick_run_on_the_tiny_preset(mfu):
    rows, peaks = mfu.quick()
    (row,) = rows
    assert (row["model"], row["precision"], row["dtype"]) == ("tiny", "fp32", "fp32")
    assert row["flops_per_token"] == 797_184 and row["tokens"] == 4 * 64
    assert row["step_s"] > 0 and peaks["fp32"] > 0 and row["mfu"] is None  # no CPU peak
    assert row["vs_f32_matmul"] == pytest.approx(row["flops_per_s"] / peaks["fp32"])
    text = mfu.render(rows, peaks, matmul_n=256, batch_size=4)
    assert "6·N + 12·L·H·K·S" in text and "not measured in this run" in text
