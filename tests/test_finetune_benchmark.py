"""``benchmarks/finetune.py``'s f32 ceiling: XLA's FLOP count of the step against a hand count,
and the lines it prints (finetune.py's timing itself needs the bundled model and torch)."""


import pytest
from _benchmarks import benchmark_script

from effijax.models import LlamaConfig

# Wide enough that the matmuls are nearly all of the step's FLOPs.
B, S, D, L, H, F, V = 2, 64, 128, 2, 4, 512, 512
MODEL = LlamaConfig(vocab_size=V, d_model=D, n_layers=L, n_heads=H, d_ff=F, seq_len=S,
                    attention="naive")


@pytest.fixture(scope="module")
def finetune():
    with benchmark_script("finetune") as module:
        yield module


def _matmul_flops(lora: bool) -> int:
    """Forward 2·N·T for the weights (q, k, v, o; gate, up, down; the head) plus the naive
    attention's two S x S products per head; the backward twice that with every weight trained
    (inputs' and weights' gradients), once with LoRA (the frozen weights get no gradient, and
    the embedding is frozen too: no gradient of the first layer's input through q, k and v;
    its MLP's input still carries the attention's adapters' gradient)."""
    t = B * S
    weights = L * (4 * D * D + 3 * D * F) + D * V
    forward = 2 * weights * t + L * B * 2 * (2 * S * S * D)
    if not lora:
        return 3 * forward
    return 2 * forward - 2 * t * 3 * D * D


@pytest.mark.slow  # compiles the step unrolled: ~5 s each on 2 cores
@pytest.mark.parametrize("rank", [None, 1])
def test_the_step_is_counted_as_its_matmuls(finetune, rank):
    gflop = finetune._step_gflop(MODEL, B, rank)
    by_hand = _matmul_flops(lora=rank is not None) / 1e9
    # Above: elementwise work (norms, softmax, rotary, AdamW) and the rank-1 adapters' matmuls.
    assert by_hand <= gflop <= 1.1 * by_hand, (gflop, by_hand)


def test_the_ceiling_says_whether_the_goal_is_within_reach(finetune, monkeypatch):
    monkeypatch.setattr(finetune, "_matmul_rates", lambda: {"XLA": 100.0, "torch": 120.0})
    monkeypatch.setattr(finetune, "_step_gflop", lambda model, b, rank: 200.0 if rank else 300.0)
    args = type("Args", (), {"rank": 8, "batch_size": 4})()
    timing = {"effijax LoRA": {"median_s": 3.0}, "peft LoRA": {"median_s": 2.5},
              "effijax full": {"median_s": 4.0}, "torch full": {"median_s": 3.5}}
    lora, full = finetune._ceiling_lines(None, args, timing, ["fp32"])
    assert "200.0 GFLOP" in lora and "2.00 s at XLA's own" in lora
    assert "(0.67 of that rate)" in lora
    assert "1.25x peft LoRA's tokens/s: the goal 1.3x is beyond" in lora
    assert "3.00 s at XLA's own" in full
    assert "1.17x torch full's tokens/s: the goal 1.0x is within" in full
    assert finetune._ceiling_lines(None, args, timing, ["bf16"]) == []
