"""What a GRPO run holds besides the policy, counted where it is held: in full fine-tuning a
frozen reference copy of the starting weights, only for a KL penalty (``--beta > 0``). One
answer (:func:`effijax.recipe.holds_reference`) decides it for the config's checks,
``effijax memory``, ``effijax plan`` and :func:`effijax.recipe.plan_job`; the bytes the
estimates count are the bytes the job holds."""

import dataclasses
import json

import jax
import optax
import pytest
from _llama_files import chat_tokenizer

from effijax.cli import build_parser
from effijax.errors import ConfigError
from effijax.models import llama_config
from effijax.recipe import TrainConfig, holds_reference, plan_job
from effijax.recipe._objectives import OBJECTIVES, get_objective

# The preset `effijax memory --model llama-tiny` counts, with a tokenizer (a GRPO job samples
# with it; its vocabulary fits the preset's).
MODEL = dataclasses.replace(llama_config("llama-tiny"), tokenizer=chat_tokenizer())


def _json(argv, capsys) -> dict:
    args = build_parser().parse_args([*argv, "--json"])
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


def _held(beta: float) -> int:
    """The bytes of the frozen tree a full GRPO job holds (bf16, as memory and plan count)."""
    job = plan_job(MODEL, "bf16", optax.sgd(0.1), batch_size=2, objective=get_objective("grpo"),
                   masked=True, segmented=True,
                   objective_settings={"beta": beta, "num_generations": 2,
                                       "max_completion_length": 8, "rewards": "exact_match"})
    return 0 if job.frozen is None else sum(x.size * x.dtype.itemsize
                                            for x in jax.tree.leaves(job.frozen))


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_memory_and_plan_count_the_reference_copy_plan_job_holds(beta, capsys):
    held = _held(beta)
    assert held == (2 * MODEL.num_params if beta else 0)  # bf16: 2 bytes a parameter
    flags = ["--model", "llama-tiny", "--objective", "grpo", "--beta", str(beta)]
    memory = _json(["memory", *flags, "--max-completion-length", "8"], capsys)
    sft = _json(["memory", "--model", "llama-tiny", "--batch-size", "8"], capsys)
    assert memory["frozen_bytes"] == held
    assert memory["params_bytes"] == sft["params_bytes"] + held
    assert memory["model_state_bytes"] == sft["model_state_bytes"] + held
    plan = _json(["plan", *flags, "--devices", "1", "--device-memory", "1GB", "--no-lora"],
                 capsys)
    assert plan["strategy"] == "ddp" and plan["states"]["frozen_bytes"] == held
    assert any(("with a bf16 reference copy" in line) == bool(beta) for line in plan["explain"])


def test_grpo_without_beta_holds_no_copy_by_default(capsys):
    # TRL's default beta for grpo is 0: no reference, as sft; under LoRA never a copy.
    flags = ["memory", "--model", "llama-tiny", "--batch-size", "8"]
    grpo = ["--objective", "grpo", "--max-completion-length", "8"]

    def states(argv):  # the model states (the rollout's cache is counted apart)
        out = _json(argv, capsys)
        return {k: v for k, v in out.items() if k not in ("rollout_cache_bytes", "total_bytes")}

    assert states([*flags, *grpo]) == states(flags)
    lora = [*flags, "--lora-rank", "2"]
    assert states([*lora, *grpo, "--beta", "0.04"]) == states(lora)
    args = build_parser().parse_args([*flags, *grpo, "--beta", "0.04"])
    assert args.func(args) == 0
    assert "grpo: a bf16 reference copy" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        build_parser().parse_args([*flags, "--beta", "-1"])
    assert "argument --beta: must be in [0, inf), got -1" in capsys.readouterr().err


def test_one_answer_for_every_objective_and_beta():
    for name in OBJECTIVES:
        for beta in (None, 0.0, 0.04):
            if beta is not None and (name == "sft" or name != "grpo" and not beta > 0):
                continue  # sft takes no beta, the pair objectives refuse 0
            extra = {"rewards": "exact_match"} if name == "grpo" else {}
            settings = TrainConfig(objective=name, beta=beta, **extra,
                                   data="p.jsonl" if name != "sft" else None).sections
            want = holds_reference(name, beta)
            assert get_objective(name).needs_reference(settings.objective.settings) == want, (
                name, beta)
    assert [holds_reference("grpo", b) for b in (None, 0.0, 1e-3)] == [False, False, True]


def test_the_config_takes_the_reference_dtype_only_when_grpo_holds_a_copy():
    kw = {"objective": "grpo", "data": "p.jsonl", "frozen_dtype": "bf16",
          "rewards": "exact_match"}
    assert TrainConfig(**kw, beta=0.04).frozen_dtype == "bf16"
    with pytest.raises(ConfigError, match=r"frozen_dtype='bf16': only applies to LoRA; .* "
                       r"\(grpo holds a reference copy, whose dtype it sets, only with "
                       r"--beta > 0\)"):
        TrainConfig(**kw)
    with pytest.raises(ConfigError, match="grpo's reference copy .* is kept in a floating"):
        TrainConfig(**{**kw, "frozen_dtype": "nf4"}, beta=0.04)


def test_memory_counts_the_rollouts_cache_as_the_compiled_sampler_holds_it(capsys):
    # `effijax memory --objective grpo` counts the key/value cache of a rollout of --batch-size
    # completions whose prompts fill their rows; the sampler, compiled for such a rollout,
    # takes exactly that cache as an argument (with the weights, the prompts, the key and two
    # scalars) and gives it back (with the first tokens).
    import numpy as np

    import effijax.generate._generate as generate_module
    from effijax.generate import PROMPT_BUCKET, rollout
    from effijax.memory import tree_bytes

    seq, t, g, n = 32, 8, 4, 8
    flags = ["--model", "llama-tiny", "--seq-len", str(seq), "--batch-size", str(n),
             "--precision", "fp32", "--objective", "grpo", "--num-generations", str(g),
             "--max-completion-length", str(t)]
    out = _json(["memory", *flags], capsys)
    model = llama_config("llama-tiny", seq_len=seq)
    params = jax.jit(model.init_params)(jax.random.key(0))
    programs = []
    real = generate_module._compiled

    def compiled(*args):
        programs.append(real(*args))
        return programs[-1]

    compiled.cache_info = real.cache_info
    prompts = [np.arange(1, seq - t + 1) + i for i in range(n // g)]  # each fills its row
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(generate_module, "_compiled", compiled)
        rollout(model, params, prompts, num_generations=g, max_completion_length=t, seed=0)
    _, prefill, _, _ = programs[0]
    memory = prefill.memory_analysis()
    padded = -(-(seq - t) // PROMPT_BUCKET) * PROMPT_BUCKET  # the sampler's prompt width
    extras = n * padded * 4 + tree_bytes(jax.random.key(0)) + 2 * 4  # prompts, key, scalars
    cache = memory.argument_size_in_bytes - tree_bytes(params) - extras
    assert out["rollout_cache_bytes"] == cache
    assert cache <= memory.output_size_in_bytes < cache + tree_bytes(params)  # given back
    # Between the steps: the total is the model states and the larger of the two.
    assert out["total_bytes"] == out["model_state_bytes"] + max(out["activation_bytes"], cache)
    # Other objectives, or --params alone, count no rollout; a batch of partial groups is
    # refused as train refuses it.
    assert "rollout_cache_bytes" not in _json(["memory", *flags[:-6]], capsys)
    args = build_parser().parse_args(["memory", *flags[:4], "--batch-size", "6",
                                      *flags[6:]])
    assert args.func(args) == 2
    assert ("--batch-size=6: counts completions, --num-generations 4 of each prompt"
            in capsys.readouterr().err)
