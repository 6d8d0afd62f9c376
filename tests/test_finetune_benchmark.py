"""``benchmarks/finetune.py``'s f32 ceiling (XLA's FLOP count of the step against a hand count,
and the lines it prints) and its workers' protocol (finetune.py's timing itself needs the
bundled model and torch)."""

import json
import subprocess
import sys

import pytest
from _benchmarks import script_fixture

from effijax.models import LlamaConfig

# Wide enough that the matmuls are nearly all of the step's FLOPs.
B, S, D, L, H, F, V = 2, 64, 128, 2, 4, 512, 512
MODEL = LlamaConfig(vocab_size=V, d_model=D, n_layers=L, n_heads=H, d_ff=F, seq_len=S,
                    attention="naive")


finetune = script_fixture("finetune")


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


def test_a_worker_answers_each_request_with_its_steps_loss(finetune, monkeypatch, capsys):
    """The worker's protocol (``_serve``): a build runs the variant's first step, a run one
    more, each answered by one reply line with that step's loss."""
    import io

    import effijax.interop

    built = []

    def runner(name, gguf, batch, rank, loaded, precision):
        built.append((name, precision, rank))
        losses = iter([3.5, 3.25, 3.0])
        return lambda: next(losses)

    monkeypatch.setattr(finetune, "_gguf", lambda model: "model.gguf")
    monkeypatch.setattr(effijax.interop, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(finetune, "_batch", lambda tokenizer, b, s: ("inputs", "targets"))
    monkeypatch.setattr(finetune, "_runner", runner)
    requests = [{"build": "peft LoRA bf16", "name": "peft LoRA", "precision": "bf16"},
                {"run": "peft LoRA bf16"}, {"run": "peft LoRA bf16"}]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{json.dumps(r)}\n"
                                                         for r in requests)))
    finetune._serve("smollm2", 4, 128, 8)
    replies = [json.loads(line.removeprefix(finetune._REPLY))
               for line in capsys.readouterr().out.splitlines()]
    assert replies == [{"loss": 3.5}, {"loss": 3.25}, {"loss": 3.0}]
    assert built == [("peft LoRA", "bf16", 8)]  # built once, then stepped


def test_torch_runs_without_the_huge_page_tunable_effijax_adds(finetune, monkeypatch):
    from effijax.cli import SWITCH, TUNABLE

    monkeypatch.setenv("GLIBC_TUNABLES", f"glibc.malloc.arena_max=2:{TUNABLE}")
    torch_env, effijax_env = finetune._environ("torch"), finetune._environ("effijax")
    assert torch_env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"  # the user's kept
    assert torch_env[SWITCH] == "0"  # and its worker does not re-execute itself with it
    assert effijax_env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TUNABLE}"
    monkeypatch.setenv("GLIBC_TUNABLES", TUNABLE)
    assert "GLIBC_TUNABLES" not in finetune._environ("torch")


def _fake_worker(finetune, code: str):
    worker = object.__new__(finetune._Worker)
    worker.framework = "torch"
    worker.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
    return worker


def test_a_worker_passes_its_libraries_lines_on_and_returns_the_reply(finetune, capsys):
    worker = _fake_worker(finetune, (
        "import json, sys\n"
        "for line in sys.stdin:\n"
        "    print('a library talks', flush=True)\n"
        f"    print({finetune._REPLY!r} + json.dumps({{'loss': len(line)}}), flush=True)\n"))
    assert worker.ask({"run": "x"}) == len(json.dumps({"run": "x"})) + 1
    assert worker.ask({"run": "xy"}) == len(json.dumps({"run": "xy"})) + 1
    worker.close()
    assert worker.proc.returncode == 0
    assert capsys.readouterr().out == "a library talks\n" * 2


def test_a_worker_that_dies_is_an_error_naming_it(finetune):
    worker = _fake_worker(finetune, "import sys; sys.stdin.readline(); sys.exit(3)")
    with pytest.raises(RuntimeError, match=r"the torch worker exited \(status 3\) during "
                                           r"\{'run': 'x'\}"):
        worker.ask({"run": "x"})
    worker.close()
