"""GRPO through the recipe (`effijax train --objective grpo`, LoRA or full): prompts read from
JSONL and chat-rendered, each step's completions sampled on the state's current parameters,
scored by rewards given by name or dotted path, TRL's metrics in metrics.jsonl, a learnable
reward that rises, an exact resume, and bad settings refused before anything compiles. The
loss's own parity with TRL is tests/test_grpo.py's."""

import dataclasses
import json
import math

import jax
import numpy as np
import pytest
from _compiles import compiles
from _llama_files import VOCAB_SIZE, chat_tokenizer, write_gguf, write_sum_prompts

from effijax.cli import main as cli_main
from effijax.errors import ConfigError
from effijax.models import llama_config
from effijax.objectives import GRPO_LOSS_TYPES, SCALE_REWARDS
from effijax.recipe import TrainConfig
from effijax.recipe._grpo import load_prompts, prompt_ids
from effijax.recipe._identity import check_resume
from effijax.recipe._sections import GRPO_LOSSES
from effijax.recipe._sections import SCALE_REWARDS as CONFIG_SCALE_REWARDS

SEQ = 32
T = 8  # --max-completion-length
TINY = llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=SEQ)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo")
    write_gguf(d / "tiny.gguf", TINY, jax.jit(TINY.init_params)(jax.random.key(0)))
    write_sum_prompts(d / "prompts.jsonl")
    return d


def _argv(files, out, steps, *more):
    return ["train", "--objective", "grpo", "--from", str(files / "tiny.gguf"), "--data",
            str(files / "prompts.jsonl"), "--num-generations", "4",
            "--max-completion-length", str(T), "--seq-len", str(SEQ), "--steps", str(steps),
            "--no-progress", "--out", str(out), *more]


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def lora_run(files):
    """3 LoRA steps at TRL's default beta (0: no KL penalty, no reference) with two rewards,
    one built in and one by dotted path."""
    out = files / "lora"
    assert cli_main(_argv(files, out, 3, "--lora-rank", "2", "--batch-size",
                          "8", "--rewards", "exact_match,_grpo_rewards:low_ids",
                          "--reward-weights", "1,0.5")) == 0
    return _records(out)


def test_a_grpo_run_writes_trls_metrics(lora_run):
    assert [r["step"] for r in lora_run] == [1, 2, 3]
    for name in ("loss", "reward", "reward_std", "frac_reward_zero_std",
                 "rewards/exact_match/mean", "rewards/low_ids/mean", "rewards/low_ids/std",
                 "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                 "completions/mean_length", "completions/max_length",
                 "completions/clipped_ratio", "tokens"):
        assert all(math.isfinite(r[name]) for r in lora_run), name
    first = lora_run[0]
    # One update per rollout: the ratio is 1, nothing is clipped; beta 0: no KL.
    assert first["clip_ratio/region_mean"] == 0.0 and "kl" not in first
    # The combined reward is the weighted sum of the two (exact_match scores every completion).
    for r in lora_run:
        assert r["reward"] == pytest.approx(r["rewards/exact_match/mean"]
                                            + 0.5 * r["rewards/low_ids/mean"], abs=1e-6)
        assert 0 < r["rewards/low_ids/mean"] < 1
        assert 1 <= r["completions/mean_length"] <= T
        # Trained tokens: the completions' (8 rows of at most T).
        assert 8 <= r["tokens"] <= 8 * T
    assert "lm_loss" not in first and "eval_loss" not in first


@pytest.fixture(scope="module")
def full_runs(files):
    """Full fine-tuning with a KL penalty (against a frozen copy of the starting weights) at a
    high learning rate on the learnable reward: 10 steps in one go, and 5 steps resumed to 10."""
    args = ("--batch-size", "16", "--rewards", "_grpo_rewards:low_ids", "--lr", "2e-2",
            "--beta", "0.01",
            "--schedule", "constant", "--warmup", "0", "--checkpoint-every", "5")
    assert cli_main(_argv(files, files / "whole", 10, *args)) == 0
    assert cli_main(_argv(files, files / "split", 5, *args)) == 0
    assert cli_main([*_argv(files, files / "split", 10, *args), "--allow-changes",
                     "steps"]) == 0
    return _records(files / "whole"), _records(files / "split")


def test_a_learnable_reward_rises(full_runs):
    # The fraction of completion tokens in the vocabulary's lower half: about 0.5 for the
    # random policy; GRPO pushes it up within a few steps.
    rewards = [r["rewards/low_ids/mean"] for r in full_runs[0]]
    assert np.mean(rewards[:3]) < 0.6
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.2, rewards
    # At the start the policy is the reference copy: the KL is exactly 0, then it grows.
    kl = [r["kl"] for r in full_runs[0]]
    assert kl[0] == 0.0 and kl[-1] > 0.0 and all(math.isfinite(k) for k in kl)


def test_a_resumed_run_samples_and_trains_as_the_uninterrupted_one(full_runs):
    whole, split = full_runs
    assert [r["step"] for r in split] == list(range(1, 11))
    for name in ("loss", "reward", "completions/mean_length", "grad_norm"):
        assert [r[name] for r in split] == [r[name] for r in whole], name


def test_prompts_are_chat_rendered_with_the_generation_prompt_and_keep_their_columns(files):
    model = dataclasses.replace(TINY, tokenizer=chat_tokenizer())
    data = load_prompts(str(files / "prompts.jsonl"), model, max_completion_length=T)
    prompts = data.train
    assert len(prompts) == 16 and data.format == "prompts" and len(data.val) == 0
    assert prompts.records[1].columns == {"answer": "2"}
    text = chat_tokenizer().decode(prompts.ids[1].tolist())
    assert text == "<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n"
    # A text prompt and the same text as a user message render alike.
    assert prompts.ids[0].tolist() == prompt_ids(chat_tokenizer(), "0+1").tolist()


def _bad(files, tmp_path, *args):
    return cli_main(_argv(files, tmp_path / "run", 2, *args))


@pytest.mark.parametrize("args, message", [
    (("--rewards", "exact_match", "--batch-size", "6"),
     "--batch-size=6: counts completions, num_generations=4 of each prompt"),
    (("--rewards", "exact_match", "--batch-size", "8", "--prefetch", "4"),
     "--prefetch=4: grpo samples each step's batch from the parameters"),
    (("--batch-size", "8"), "--rewards=None: grpo scores completions with reward functions"),
    (("--rewards", "exact_match", "--batch-size", "8", "--rollout-temperature", "0"),
     "--rollout-temperature=0.0: a rollout samples: must be > 0"),
    (("--rewards", "no_such_reward", "--batch-size", "8"),
     "--rewards='no_such_reward': not a built-in reward"),
    (("--rewards", "exact_match", "--reward-weights", "1,2", "--batch-size", "8"),
     "--reward-weights='1,2': expected 1 finite numbers"),
    (("--rewards", "exact_match", "--batch-size", "8", "--beta", "-1"),
     "--beta=-1.0: must be >= 0"),
    (("--rewards", "exact_match", "--batch-size", "8", "--max-completion-length", "28"),
     "prompts.jsonl:1': the prompt is 22 tokens, over the 4 a row leaves it"),
])
def test_bad_grpo_settings_are_refused_before_compiling(files, tmp_path, capsys, args, message):
    with compiles() as compiled:
        assert _bad(files, tmp_path, *args) == 2
    assert compiled == []
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_prompt_record_without_a_prompt_is_one_line_naming_it(files, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1", "answer": "2"}\n{"question": "2+2"}\n')
    with pytest.raises(ConfigError, match=r"p.jsonl:2': no 'prompt'"):
        load_prompts(str(path), dataclasses.replace(TINY, tokenizer=chat_tokenizer()),
                     max_completion_length=T)


def test_the_config_knows_grpos_settings_and_their_identity():
    assert set(GRPO_LOSSES) == set(GRPO_LOSS_TYPES)
    assert CONFIG_SCALE_REWARDS == tuple(SCALE_REWARDS)
    cfg = TrainConfig(objective="grpo", data="p.jsonl", rewards="exact_match", batch_size=8,
                      seq_len=64, max_completion_length=16)
    # TRL's GRPOConfig defaults: beta 0 (no KL), 8 generations, the dapo loss.
    assert cfg.objective_settings["beta"] == 0.0
    assert TrainConfig(objective="dpo", data="p.jsonl").objective_settings["beta"] == 0.1
    with pytest.raises(ConfigError, match="num_generations=4: only applies to --objective grpo"):
        TrainConfig(num_generations=4)
    saved = cfg.to_dict()
    assert check_resume(saved, {**saved, "beta": 0.0}, (), where="ckpt") == {}
    with pytest.raises(ConfigError, match="objective"):
        check_resume(saved, {**saved, "rollout_temperature": 0.7}, (), where="ckpt")
