"""GRPO's rollouts hold no second copy of the weights: the recipe's rollout
(``job.rollout``, what ``effijax train --objective grpo`` draws each batch with) samples on
the train state's parameters themselves, under LoRA the frozen base the step reads plus the
adapters, in full training the parameters as they are (a policy whose compute dtype is the
parameters' own: ``fp32`` here).

Shown three ways, every number derived from the trees' sizes (:func:`effijax.memory.tree_bytes`):
the arrays the sampler is given are the state's (the same objects); the compiled prefill and
decode programs' argument bytes are the weights once plus the key/value cache, the prompts and
the sampling scalars; and while it decodes, the arrays alive beyond those before the rollout
are the cache and a few tokens, far below one copy of the weights. The training step, compiled
as the recipe compiles it, takes the same base once, in its batch.
"""

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest
from _llama_files import VOCAB_SIZE, chat_tokenizer

import effijax.generate._generate as generate_module
import effijax.generate._rollout as rollout_module
from effijax import lora as lora_lib
from effijax.generate import PROMPT_BUCKET
from effijax.memory import tree_bytes
from effijax.models import llama_config
from effijax.recipe import abstract_batch, compile_job, init_frozen, init_state, plan_job
from effijax.recipe._grpo import GRPO, load_prompts

SEQ, T, G, BATCH = 32, 8, 4, 8  # seq_len, max completion length, generations, completions
MODEL = dataclasses.replace(llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=SEQ),
                            tokenizer=chat_tokenizer())
KEY_BYTES = tree_bytes(jax.random.key(0))
F32, I32 = 4, 4


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("grpo_memory") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1", "answer": str(i + 1)}) + "\n"
                            for i in range(8)))
    return load_prompts(str(path), MODEL, max_completion_length=T).train


def _plan(lora):
    # As the recipe plans a GRPO run (recipe/_train.py's plan_run): masked, segmented rows.
    return plan_job(MODEL, "fp32", optax.adam(1e-3), batch_size=BATCH, lora=lora,
                    objective=GRPO, masked=True, segmented=True,
                    objective_settings={"num_generations": G, "max_completion_length": T,
                                        "rewards": "exact_match"})


class Spied:
    """What one rollout gave the sampler, the programs it ran, and the live arrays."""

    def __init__(self):
        self.params = self.generation = self.programs = None
        self.new_live = []  # per decoded step: bytes of the arrays alive beyond those before


def _spied_rollout(job, data, params, frozen) -> Spied:
    """``job.rollout`` (the recipe's draw) for step 0, watched from the outside."""
    spied = Spied()
    real_generate, real_compiled = rollout_module.generate, generate_module._compiled

    def generate(model, sampling, prompts, **kw):
        spied.params = sampling
        before = jax.live_arrays()  # held: no id of theirs is reused meanwhile
        ids = {id(a) for a in before}

        def on_tokens(_):
            spied.new_live.append(sum(a.nbytes for a in jax.live_arrays() if id(a) not in ids))

        spied.generation = real_generate(model, sampling, prompts, on_tokens=on_tokens, **kw)
        return spied.generation

    def compiled(*args):
        spied.programs = real_compiled(*args)
        return spied.programs

    compiled.cache_info = real_compiled.cache_info
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rollout_module, "generate", generate)
        patch.setattr(generate_module, "_compiled", compiled)
        batch = job.rollout(data, params=params, frozen=frozen, seed=0, step=0,
                            batch_size=BATCH)
    assert batch["inputs"].shape == (BATCH, SEQ)
    return spied


@pytest.fixture(scope="module")
def lora_run(prompts):
    job = _plan(lora_lib.LoraSpec(rank=2, targets=MODEL.lora_targets))
    state, frozen = init_state(job), init_frozen(job)
    spied = _spied_rollout(job, prompts, state.params, frozen)
    return job, state, frozen, spied, compile_job(job, census=False)  # as the recipe compiles


@pytest.fixture(scope="module")
def full_run(prompts):
    job = _plan(None)
    state = init_state(job)
    return job, state, _spied_rollout(job, prompts, state.params, None)


def _argument_bytes(program) -> int:
    return program.memory_analysis().argument_size_in_bytes


def _sampler_extras(spied: Spied) -> tuple[int, int]:
    """Bytes of the prefill's and the decode step's arguments besides the weights: the cache,
    the prompts ``[N, P]`` (prefill) or one token a row and two positions (step), the key and
    the two sampling scalars."""
    out = spied.generation
    n = out.tokens.shape[0]
    padded = -(-out.prompt_tokens // PROMPT_BUCKET) * PROMPT_BUCKET
    common = out.cache_bytes + KEY_BYTES + 2 * F32  # cache, key, temperature, top-p
    return common + n * padded * I32, common + n * I32 + 2 * I32


def _assert_weights_once_in_the_sampler(spied: Spied, weights_bytes: int):
    _, prefill, step, _ = spied.programs
    prefill_extra, step_extra = _sampler_extras(spied)
    assert _argument_bytes(prefill) == weights_bytes + prefill_extra
    assert _argument_bytes(step) == weights_bytes + step_extra
    # Not two copies: what is not the weights is far below them.
    assert prefill_extra < weights_bytes and step_extra < weights_bytes
    # While decoding, the arrays alive beyond those before the rollout: the cache, each step's
    # tokens (one int32 a row), the key and the two scalars; never a copy of the weights.
    n = spied.generation.tokens.shape[0]
    assert len(spied.new_live) == T  # no row stops early: one reading per token
    bound = spied.generation.cache_bytes + KEY_BYTES + 2 * F32 + T * n * I32
    assert all(spied.generation.cache_bytes <= b <= bound for b in spied.new_live), \
        (spied.new_live, bound)
    assert bound < weights_bytes


def test_a_lora_rollout_samples_on_the_frozen_base_and_the_adapters_themselves(lora_run):
    job, state, frozen, spied, _ = lora_run
    given = spied.params
    assert set(given) == {"base", "adapters"}
    assert all(a is b for a, b in zip(jax.tree.leaves(given["base"]), jax.tree.leaves(frozen),
                                      strict=True))
    assert all(a is b for a, b in zip(jax.tree.leaves(given["adapters"]),
                                      jax.tree.leaves(state.params), strict=True))
    base, adapters = tree_bytes(frozen), tree_bytes(state.params)
    assert base > 10 * adapters  # the base is what a copy would cost
    _assert_weights_once_in_the_sampler(spied, base + adapters)


def test_a_lora_training_step_takes_the_same_base_once(lora_run):
    job, state, frozen, _, compiled = lora_run
    rows = {k: v for k, v in abstract_batch(job).items() if k != "base"}
    # Arguments: the state (adapters, optimizer state, step, key), the rollout's rows and the
    # frozen base, once.
    assert compiled.memory.arguments == tree_bytes(job.state) + tree_bytes(rows) \
        + tree_bytes(frozen)
    assert tree_bytes(rows) == BATCH * SEQ * I32 * 4 + BATCH * F32  # 4 row arrays, advantages
    assert tree_bytes(job.state) == tree_bytes(state)


def test_a_full_rollout_samples_on_the_train_states_parameters(full_run):
    job, state, spied = full_run
    assert job.frozen is None  # beta 0: no reference copy either
    assert all(a is b for a, b in zip(jax.tree.leaves(spied.params),
                                      jax.tree.leaves(state.params), strict=True))
    _assert_weights_once_in_the_sampler(spied, tree_bytes(state.params))
    assert np.all(spied.generation.lengths <= T)
