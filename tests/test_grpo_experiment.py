"""experiments/grpo.py: its arithmetic questions split by group, and its CI smoke preset (GRPO
under LoRA on a tiny random Llama GGUF with a chat template) end to end."""

import dataclasses
import doctest
import importlib.util
import json
import pathlib
import sys

import pytest

from effijax.errors import ConfigError
from effijax.objectives import exact_match

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def experiment():
    """experiments/grpo.py as a module, imported once (it imports the recipe and the sampler).
    "experiment_" keeps it apart from benchmarks/grpo.py in one worker."""
    spec = importlib.util.spec_from_file_location("experiment_grpo",
                                                  ROOT / "experiments" / "grpo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["experiment_grpo"] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def test_questions_split_by_group(experiment):
    # No held-out question is trained on in either order (7 * 8 and 8 * 7 are one group); the
    # split is the seed's; the answers are the operations' values.
    questions = experiment.build_questions(("+", "*", "-"), 2, 12)
    assert len(questions) == 3 * 11 * 11
    assert {q.prompt: q.answer for q in questions}["What is 7 * 8?"] == 56
    assert {q.prompt: q.answer for q in questions}["What is 3 - 9?"] == -6
    training, held = experiment.split(questions, 0.25, seed=0)
    assert len(training) + len(held) == len(questions)
    assert not {q.group for q in training} & {q.group for q in held}
    held_prompts = {q.prompt for q in held}
    for q in held:  # a commutative question's mirror is held out with it
        a, op, b = q.prompt.removeprefix("What is ").rstrip("?").split()
        if op in experiment.COMMUTATIVE:
            assert f"What is {b} {op} {a}?" in held_prompts
    groups = {q.group for q in questions}
    assert len({q.group for q in held}) == round(0.25 * len(groups))
    assert experiment.split(questions, 0.25, seed=0)[1] == held
    assert experiment.split(questions, 0.25, seed=1)[1] != held
    with pytest.raises(ConfigError, match="held_out_fraction"):
        experiment.split(questions, 1.0, seed=0)
    with pytest.raises(ConfigError, match="operations"):
        experiment.build_questions(("/",), 2, 12)
    # The module's docstring examples run and print what they say.
    assert doctest.testmod(experiment, optionflags=doctest.ELLIPSIS).failed == 0


@pytest.mark.slow
def test_grpo_smoke(tmp_path, experiment):
    # The smoke preset on the tiny chat GGUF the other experiments' smoke tests use (SmolLM2
    # takes minutes): questions, the base's answers, the GRPO run, the adapters' answers.
    import jax
    from _llama_files import VOCAB_SIZE, write_gguf

    from effijax.models import llama_config

    model = llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=256)
    gguf = tmp_path / "tiny.gguf"
    write_gguf(gguf, model, jax.jit(model.init_params)(jax.random.key(0)))
    cfg = dataclasses.replace(experiment.PRESETS["smoke"], out=str(tmp_path / "out"),
                              model_from=str(gguf))
    results = experiment.main(cfg)
    out = tmp_path / "out"

    lines = {name: [json.loads(x) for x in (out / f"prompts_{name}.jsonl").read_text()
                    .splitlines()] for name in ("train", "held_out")}
    # operands 2..5, one operation: 16 questions in 10 groups, 3 of them held out.
    assert results["questions"] == {"training": len(lines["train"]),
                                    "held_out": len(lines["held_out"]), "held_out_groups": 3}
    assert len(lines["train"]) + len(lines["held_out"]) == 16
    assert not {r["prompt"] for r in lines["train"]} & {r["prompt"] for r in lines["held_out"]}
    assert json.loads((out / "grpo" / "config.json").read_text())["objective"] == "grpo"
    assert (out / "grpo" / "adapters.safetensors").exists()

    before, after = results["before"], results["after"]
    for numbers in (before, after):
        assert 0.0 <= numbers["accuracy"] <= 1.0
        assert set(numbers["by_operation"]) == {"+"}
    # The accuracies are exact_match's over the answers recorded for each held-out question.
    held = results["held_out"]
    assert [h["prompt"] for h in held] == [r["prompt"] for r in lines["held_out"]]
    for when in ("before", "after"):
        right = exact_match(None, [h[when] for h in held], answer=[h["answer"] for h in held])
        assert results[when]["accuracy"] == sum(right) / len(held)
    assert after["accuracy"] - before["accuracy"] == pytest.approx(
        (results["fixed"] - results["broken"]) / len(held))

    # The reward curve: one point a step, from metrics.jsonl, a mean of 0/1 rewards.
    curve = results["curve"]
    assert curve["step"] == list(range(1, cfg.steps + 1))
    assert len(curve["reward"]) == len(curve["mean_length"]) == cfg.steps
    assert all(0.0 <= r <= 1.0 for r in curve["reward"])
    assert all(1 <= n <= cfg.max_completion_length for n in curve["mean_length"])
    assert results["training"]["steps"] == cfg.steps and results["wall_time_s"] > 0
    assert (out / "grpo.png").stat().st_size > 1000
    assert json.loads((out / "results.json").read_text())["curve"] == curve
