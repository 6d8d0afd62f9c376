"""`effijax train --from RUN_DIR [--lora-rank R ...]`: fine-tuning an earlier run's model.

One tiny pretraining run (corpus A) is shared; the fine-tunes train on corpus B from it, with
relative paths (orbax wants absolute ones: the library resolves them).
"""

import json
import math

import numpy as np
import pytest
from safetensors.numpy import load_file

from effijax import lora
from effijax.checkpoint import open_checkpoints
from effijax.cli import main
from effijax.paths import named_leaves

TINY = ["--batch-size", "4", "--eval-batches", "2", "--no-progress"]
RANK = 4
D, F, L = 64, 256, 2  # the tiny preset: d_model, MLP width, layers


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    a = root / "a.txt"
    a.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(400)))
    b = root / "b.txt"
    b.write_text("".join(f"The {i}th line of prose, quite unlike code.\n" for i in range(400)))
    return str(a), str(b)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, corpora):
    out = tmp_path_factory.mktemp("runs") / "base"
    assert main(["train", "--model", "tiny", "--seq-len", "32", "--steps", "12", "--data",
                 corpora[0], "--out", str(out), "--checkpoint-every", "6", *TINY]) == 0
    return out


def _read(out):
    return (json.loads((out / "config.json").read_text()),
            json.loads((out / "summary.json").read_text()))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, pretrained, corpora):
    root = tmp_path_factory.mktemp("ft")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)  # a relative --out
        assert main(["train", "--from", str(pretrained), "--lora-rank", str(RANK),
                     "--lora-alpha", "16", "--steps", "12", "--lr", "1e-2", "--data", corpora[1],
                     "--out", "lora", "--checkpoint-every", "6", *TINY]) == 0
    return root / "lora"


def test_lora_run_trains_only_the_adapters_of_the_pretrained_model(lora_run, pretrained):
    config, summary = _read(lora_run)
    base_config, _ = _read(pretrained)
    # The run's model (seq_len 32).
    assert config["run"]["model_config"] == base_config["run"]["model_config"]
    assert (config["lora_rank"], config["lora_alpha"]) == (RANK, 16.0)
    # r·(d_in + d_out) per adapted matrix: q, k, v, o (D x D), fc_in (D x F), fc_out (F x D).
    assert config["run"]["trainable_params"] == L * RANK * (4 * 2 * D + 2 * (D + F))
    assert config["run"]["num_params"] == base_config["run"]["num_params"]
    assert config["run"]["init_from_checkpoint"]["step"] == 12
    # It learned corpus B (B moved off zero), starting from the base model's loss on it.
    assert summary["eval_loss"] < summary["eval_loss_start"]
    # The checkpoint holds the adapters and their optimizer state only.
    with open_checkpoints(lora_run / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [6, 12]
    adapters, spec = lora.load_adapters(lora_run / "adapters.safetensors")
    assert spec.rank == RANK and spec.alpha == 16.0
    paths = [p for p, _ in named_leaves(adapters)]
    assert len(paths) == 12 and all(p.endswith(("/a", "/b")) for p in paths)
    b = adapters["blocks"]["attn"]["q"]["kernel"]["b"]
    assert b.shape == (L, RANK, D) and float(np.max(np.abs(b))) > 1e-4
    # PEFT export: one module per layer, torch (out, in) layout.
    peft = load_file(str(lora_run / "peft" / "adapter_model.safetensors"))
    a0 = peft["base_model.model.blocks.0.mlp.fc_in.lora_A.weight"]
    np.testing.assert_array_equal(a0, np.asarray(adapters["blocks"]["mlp"]["fc_in"]["kernel"]
                                                 ["a"][0]).T)
    assert json.loads((lora_run / "peft" / "adapter_config.json").read_text())["r"] == RANK


def test_full_fine_tune_starts_from_the_same_model(tmp_path, lora_run, pretrained, corpora,
                                                  capsys):
    out = tmp_path / "full"
    assert main(["train", "--from", str(pretrained), "--steps", "6", "--lr", "1e-3",
                 "--data", corpora[1], "--out", str(out), "--no-checkpoints", *TINY]) == 0
    config, _ = _read(out)
    assert config["model_from"] == str(pretrained)
    _, full = _read(out)
    _, low_rank = _read(lora_run)
    # Both evaluate the pretrained parameters on corpus B before training (b = 0: LoRA adds an
    # exact zero), so the two starting losses agree; then each learns.
    assert full["eval_loss_start"] == pytest.approx(low_rank["eval_loss_start"], rel=1e-6)
    assert full["eval_loss"] < full["eval_loss_start"]


def test_lora_run_resumes_and_checks_its_base(tmp_path, lora_run, pretrained, corpora, capsys):
    args = ["train", "--from", str(pretrained), "--lora-rank", str(RANK), "--lora-alpha",
            "16", "--lr", "1e-2", "--data", corpora[1], "--checkpoint-every", "6", *TINY]
    # More steps on the same --out: resumes from the LoRA run's step 12.
    start = json.loads((lora_run / "summary.json").read_text())["eval_loss_start"]
    assert main([*args, "--steps", "18", "--out", str(lora_run), "--allow-changes",
                 "steps"]) == 0
    out = capsys.readouterr().out
    assert "resuming from step 12" in out
    records = [json.loads(x) for x in (lora_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 19))
    # The summary describes the whole run: its start's loss is kept, not measured again.
    assert json.loads((lora_run / "summary.json").read_text())["eval_loss_start"] == start
    # Another base under the same --out is refused before anything trains.
    other = tmp_path / "other-base"
    assert main(["train", "--model", "tiny", "--seq-len", "32", "--steps", "2", "--data",
                 corpora[0], "--out", str(other), "--checkpoint-every", "2", *TINY]) == 0
    capsys.readouterr()
    assert main([*args, "--steps", "24", "--from", str(other), "--out",
                 str(lora_run)]) == 2
    assert "continues a run that started from" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora-rank", "100"], "--lora-rank=100: larger than min(d_in, d_out) = 64"),
        (["--lora-rank", "4", "--lora-targets", "nothing"], "--lora-targets='nothing': regex "
         "matched 0 of"),
        (["--lora-rank", "4", "--lora-targets", "("], "--lora-targets='(': not a valid regex"),
        (["--lora-rank", "0"], "--lora-rank=0: must be an integer >= 1"),
        (["--lora-alpha", "4"], "--lora-alpha=4.0: only applies to LoRA; give the adapters' "
         "rank too (--lora-rank R)"),
        (["--lora-rank", "4", "--lora-dropout", "1.5"], "--lora-dropout=1.5: must be in [0, 1)"),
        (["--model", "small"], "--model='small': the model_from run trained 'tiny'"),
        (["--seq-len", "64"], "--seq-len=64: the model_from run's model has 32 positions"),
    ],
)
def test_bad_fine_tune_flags_are_clear_errors(tmp_path, pretrained, corpora, capsys, flags,
                                              message):
    assert main(["train", "--from", str(pretrained), "--data", corpora[1], "--out",
                 str(tmp_path / "x"), *TINY, *flags]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_bad_init_from_runs_are_clear_errors(tmp_path, lora_run, pretrained, capsys):
    cases = [
        (tmp_path / "missing", "no such run directory"),
        (lora_run, "is a LoRA run"),
        (tmp_path, "has no config.json"),
    ]
    for run_dir, message in cases:
        assert main(["train", "--from", str(run_dir), "--out", str(tmp_path / "y")]) == 2
        err = capsys.readouterr().err
        assert f"effijax train: error: --from='{run_dir}': " in err and message in err, err
    assert main(["train", "--from", str(pretrained), "--out", str(pretrained)]) == 2
    assert "is the model_from run itself" in capsys.readouterr().err


def test_eval_and_generate_take_the_run_with_from(pretrained, corpora, capsys):
    evaluate = [corpora[1], "--seq-len", "32", "--max-batches", "2", "--json"]
    assert main(["eval", "--from", str(pretrained), *evaluate]) == 0
    scored = capsys.readouterr()
    assert scored.err == ""
    report = json.loads(scored.out)
    assert math.isfinite(report["loss"]) and report["perplexity"] == pytest.approx(
        math.exp(report["loss"]), rel=1e-6)
    # A precision that is no policy is refused under the flag that gave it, before loading.
    assert main(["eval", "--from", str(pretrained), *evaluate[:-1], "--precision", "bogus"]) == 2
    assert capsys.readouterr().err.startswith("effijax eval: error: --precision='bogus': "
                                              "unknown precision policy")
    generate = ["--prompt", "def", "--max-new-tokens", "4", "--no-stream"]
    assert main(["generate", "--from", str(pretrained), *generate]) == 0
    said = capsys.readouterr()
    # The continuation alone (the prompt is not echoed), then the count on stderr.
    assert said.out.endswith("\n") and len(said.out) > 1, said.out
    assert "effijax generate: 4 tokens (stopped at --max-new-tokens 4)" in said.err, said.err


def test_eval_scores_a_run_in_the_precision_it_trained_in(tmp_path, pretrained, corpora,
                                                          capsys):
    """``--precision auto`` (eval's default) keeps a run's own precision, as a resume does; the
    result line and its JSON say which precision scored."""
    bf16 = tmp_path / "bf16"
    assert main(["train", "--model", "tiny", "--seq-len", "32", "--steps", "2", "--data",
                 corpora[0], "--out", str(bf16), "--precision", "bf16", *TINY]) == 0
    capsys.readouterr()
    evaluate = [corpora[1], "--seq-len", "32", "--max-batches", "1"]
    scored = {}
    for run, flags in ((bf16, ()), (bf16, ("--precision", "fp32")), (pretrained, ())):
        assert main(["eval", "--from", str(run), *evaluate, *flags, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        scored[run.name, flags] = report["precision"], report["precision_reason"]
    assert scored == {("bf16", ()): ("bf16", "auto: the run's own"),
                      ("bf16", ("--precision", "fp32")): ("fp32", ""),
                      (pretrained.name, ()): ("fp32", "auto: the run's own")}
    assert main(["eval", "--from", str(bf16), *evaluate]) == 0
    assert ", in bf16): loss " in capsys.readouterr().out
