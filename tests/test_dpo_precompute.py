"""DPO with the reference's log-probabilities precomputed (`--precompute-reference`, TRL's
`precompute_ref_log_probs`): the same losses as against the reference model (full fine-tuning's
copy, LoRA's base with the adapters off) to f32 rounding, no reference copy in a full
fine-tune's compiled step or in `effijax memory`, the values stored with the run so a resumed
run trains against the same numbers, and the objectives without a reference refusing it."""

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest
from _llama_files import VOCAB_SIZE, chat_tokenizer
from _pairs import write_model_and_pairs

from effijax.cli import main as cli_main
from effijax.errors import ConfigError
from effijax.lora import LoraSpec
from effijax.lora import init as lora_init
from effijax.models import llama_config
from effijax.recipe import TrainConfig, init_frozen, init_state, plan_job
from effijax.recipe._dpo import REFERENCE_FILE, precompute_reference
from effijax.recipe._objectives import get_objective
from effijax.recipe._pairs import REFERENCE_LOGPS, ScoredPairs, load_pairs, pair_batch
from effijax.run import read_metrics

SEQ = 32
TINY = llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=SEQ)
DPO = get_objective("dpo")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_model_and_pairs(tmp_path_factory.mktemp("dpo_precompute"), TINY)


@pytest.fixture(scope="module")
def setup(files):
    model = dataclasses.replace(TINY, tokenizer=chat_tokenizer())
    data = load_pairs(str(files / "pairs.jsonl"), model)
    return model, data


def _moved(params, scale=0.02, seed=5):
    """``params`` moved off the start (a policy a few steps in)."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return treedef.unflatten([x + scale * jax.random.normal(k, x.shape, x.dtype)
                              for x, k in zip(leaves, keys, strict=True)])


def _job(model, *, lora=None, precompute):
    settings = {"window": 16, **({"precompute_reference": True} if precompute else {})}
    return plan_job(model, "fp32", optax.sgd(0.0), batch_size=4, lora=lora, masked=True,
                    segmented=False, objective=DPO, objective_settings=settings)


def test_full_dpo_precomputed_is_dpo_against_the_copy_and_holds_none(setup):
    model, data = setup
    copy, flagged = _job(model, precompute=False), _job(model, precompute=True)
    assert flagged.frozen is None and copy.frozen is not None
    start = init_state(flagged).params
    found = precompute_reference(flagged, data.train, params=start, window=16)
    assert found.shape == (len(data.train),) and found.dtype == np.float32
    assert np.all(found < 0)  # summed log-probabilities of real completions
    rows = pair_batch(data.train, seed=0, step=3, batch_size=4, seq_len=SEQ)
    scored = pair_batch(ScoredPairs(data.train, found), seed=0, step=3, batch_size=4,
                        seq_len=SEQ)
    np.testing.assert_array_equal(scored["inputs"], rows["inputs"])
    policy = _moved(start)
    want, wanted = copy.eval_step(policy, {**rows, "reference": init_frozen(copy, start)})
    got, metrics = flagged.eval_step(policy, scored)
    assert abs(float(wanted["rewards/margins"])) > 1e-4  # the policy did move
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    for name, value in wanted.items():
        np.testing.assert_allclose(float(metrics[name]), float(value), rtol=1e-5, atol=1e-6,
                                   err_msg=name)


def test_lora_dpo_precomputed_is_dpo_against_the_base_with_adapters_off(setup):
    model, data = setup
    spec = LoraSpec(rank=2, alpha=8.0, targets=model.lora_targets)
    plain, flagged = (_job(model, lora=spec, precompute=p) for p in (False, True))
    base = init_frozen(plain)
    adapters = _moved(lora_init(jax.random.key(1), base, spec), scale=0.1)
    # The trained adapters given: the reference has them off, whatever their values.
    found = precompute_reference(flagged, data.val, params=adapters, frozen=base, window=16)
    rows = pair_batch(data.val, seed=0, step=1, batch_size=4, seq_len=SEQ)
    scored = pair_batch(ScoredPairs(data.val, found), seed=0, step=1, batch_size=4,
                        seq_len=SEQ)
    assert scored[REFERENCE_LOGPS].shape == (4,)
    want, wanted = plain.eval_step(adapters, {**rows, "base": base})
    got, _ = flagged.eval_step(adapters, {**scored, "base": base})
    assert abs(float(wanted["rewards/margins"])) > 1e-4
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)


def _argv(files, out, steps, *extra):
    return ["train", "--objective", "dpo", "--from", str(files / "tiny.gguf"), "--data",
            str(files / "pairs.jsonl"), "--steps", str(steps), "--batch-size", "4", "--seq-len",
            str(SEQ), "--eval-batches", "1", "--checkpoint-every", "2", "--lr", "1e-3",
            "--no-progress", "--out", str(out), *extra]


@pytest.mark.slow  # four runs of effijax train (about 14 s)
def test_a_precomputed_run_trains_as_against_the_copy_resumed_and_holds_none(files, tmp_path,
                                                                            capsys):
    # Full fine-tuning, 4 steps against the copy; 2 steps with the reference precomputed, then
    # resumed to 4 (the stored values read back): the same losses to f32 rounding.
    assert cli_main(_argv(files, tmp_path / "copy", 4)) == 0
    pre = tmp_path / "pre"
    assert cli_main(_argv(files, pre, 2, "--precompute-reference")) == 0
    out = capsys.readouterr().out
    assert f"80 rows precomputed into {REFERENCE_FILE}" in out  # 38 + 2 pairs, 2 rows each
    assert cli_main([*_argv(files, pre, 4, "--precompute-reference"), "--allow-changes",
                     "steps"]) == 0
    assert f"rows read from {REFERENCE_FILE}" in capsys.readouterr().out
    copy, flagged = read_metrics(tmp_path / "copy"), read_metrics(pre)
    assert [r["step"] for r in flagged] == [1, 2, 3, 4]
    assert flagged[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)  # policy == reference
    assert flagged[-1]["rewards/margins"] != 0.0
    for name in ("loss", "rewards/margins", "rewards/chosen", "logps/chosen"):
        np.testing.assert_allclose([r[name] for r in flagged], [r[name] for r in copy],
                                   rtol=1e-5, atol=1e-6, err_msg=name)
    summary = {d: json.loads((tmp_path / d / "summary.json").read_text())
               for d in ("copy", "pre")}
    for name in ("eval_loss", "eval_rewards/margins"):
        np.testing.assert_allclose(summary["pre"][name], summary["copy"][name], rtol=1e-5,
                                   atol=1e-6, err_msg=name)
    stored = np.load(pre / REFERENCE_FILE, allow_pickle=False)
    assert stored["train"].shape == (38 * 2,) and np.all(stored["train"] < 0)
    # The compiled step's arguments: the copy's bytes (107,840 float32 parameters) lighter,
    # plus the batch's 4 rows of float32 reference log-probabilities.
    copy_bytes, rows_bytes = 107_840 * 4, 4 * 4
    assert (summary["copy"]["memory"]["arguments"] - summary["pre"]["memory"]["arguments"]
            == copy_bytes - rows_bytes)
    # A run started without the flag stored nothing to resume against.
    assert cli_main([*_argv(files, tmp_path / "copy", 6, "--precompute-reference"),
                     "--allow-changes", "steps"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--precompute-reference=True: the run in" in err and "resume it without" in err


@pytest.mark.parametrize("objective, why", [
    ("simpo", "simpo compares the policy with no reference model"),
    ("orpo", "orpo compares the policy with no reference model"),
    ("sft", "sft compares the policy with no reference model"),
    ("grpo", "grpo's reference scores the completions sampled at each step"),
])
def test_objectives_without_a_precomputable_reference_refuse_it(objective, why):
    with pytest.raises(ConfigError) as e:
        TrainConfig(objective=objective, data="p.jsonl", precompute_reference=True,
                    **({"rewards": "exact_match"} if objective == "grpo" else {}))
    assert str(e.value).startswith("precompute_reference=True: only applies to --objective "
                                   f"dpo: {why}")


def test_a_full_fine_tune_with_it_has_no_copy_to_give_a_dtype():
    with pytest.raises(ConfigError, match="frozen_dtype='bf16': a full fine-tune with "
                       "--precompute-reference holds no reference copy"):
        TrainConfig(objective="dpo", data="p.jsonl", precompute_reference=True,
                    frozen_dtype="bf16")
    TrainConfig(objective="dpo", data="p.jsonl", model_from="x.gguf", lora_rank=2,
                precompute_reference=True, frozen_dtype="nf4")  # LoRA's base: its storage


def test_effijax_memory_counts_no_copy_when_precomputed(capsys):
    argv = ["memory", "--model", "tiny", "--objective", "dpo", "--precision", "fp32", "--json"]
    assert cli_main(argv) == 0
    held = json.loads(capsys.readouterr().out)
    assert cli_main([*argv, "--precompute-reference"]) == 0
    none = json.loads(capsys.readouterr().out)
    assert held["frozen_bytes"] > 0 and none["frozen_bytes"] == 0
    assert held["total_bytes"] - none["total_bytes"] == held["frozen_bytes"]
    assert cli_main(["memory", "--model", "tiny", "--objective", "simpo",
                     "--precompute-reference"]) == 2
    assert "--precompute-reference" in capsys.readouterr().err


@pytest.mark.slow  # a 3-step effijax train run with its exports (about 5 s)
def test_a_lora_dpo_runs_peft_export_holds_its_adapters(files, tmp_path):
    # LoRA, the reference (the base with the adapters off) precomputed: step 1 is ln 2, and the
    # run's PEFT export (the SFT export path) holds exactly its trained adapters.
    from safetensors.numpy import load_file

    from effijax.interop import peft_module
    from effijax.lora import load_adapters
    from effijax.paths import named_leaves

    out = tmp_path / "lora"
    assert cli_main(["train", "--objective", "dpo", "--from", str(files / "tiny.gguf"),
                     "--lora-rank", "2", "--data", str(files / "pairs.jsonl"), "--steps", "3",
                     "--batch-size", "4", "--seq-len", str(SEQ), "--eval-batches", "1",
                     "--lr", "1e-2", "--precompute-reference", "--no-checkpoints",
                     "--no-progress", "--out", str(out)]) == 0
    assert read_metrics(out)[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)
    adapters, spec = load_adapters(out / "adapters.safetensors")
    peft = load_file(str(out / "peft" / "adapter_model.safetensors"))
    config = json.loads((out / "peft" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (2, spec.alpha)
    assert config["base_model_name_or_path"] == str(files / "tiny.gguf")
    seen, moved = set(), 0.0
    for path, leaf in named_leaves(adapters):
        kernel, side = path.rsplit("/", 1)
        for layer in range(TINY.n_layers):
            name = (f"base_model.model.{peft_module(kernel, layer)}."
                    f"lora_{'A' if side == 'a' else 'B'}.weight")
            np.testing.assert_array_equal(peft[name], np.asarray(leaf[layer]).T, err_msg=name)
            seen.add(name)
        if side == "b":
            moved = max(moved, float(np.max(np.abs(leaf))))
    assert seen == set(peft) and moved > 1e-4  # every tensor, and DPO moved B off zero
