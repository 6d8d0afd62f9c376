"""GRPO's ``num_iterations`` (TRL's mu): a rollout serves N consecutive policy updates, each
taking its ratio to the log-probabilities of the sampling pass, so that from the second update
on the ratio leaves 1 and the clipping acts. Checked on a tiny full fine-tune through the job
the recipe plans (:func:`effijax.recipe.plan_job`, :func:`effijax.recipe.batch_fn`, the jitted
step) against the same loss computed by hand with :func:`effijax.objectives.grpo_loss`; with
one update per rollout the batches carry nothing new and the loss is TRL's ratio-1 shortcut."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _llama_files import VOCAB_SIZE, chat_tokenizer

from effijax import lora as lora_lib
from effijax.errors import ConfigError
from effijax.generate import make_completion_logps
from effijax.models import abstract_split, llama_config
from effijax.objectives import grpo_loss
from effijax.recipe import (
    TrainConfig,
    abstract_batch,
    batch_fn,
    init_state,
    plan_job,
)
from effijax.recipe._grpo import GRPO, load_prompts
from effijax.recipe._identity import identity
from effijax.recipe._objective import ROLLOUT_METRICS, ROLLOUT_SAMPLES

SEQ, T, G, BATCH = 32, 8, 4, 8  # seq_len, max completion length, generations, completions
MODEL = dataclasses.replace(llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=SEQ),
                            tokenizer=chat_tokenizer())
SETTINGS = {"num_generations": G, "max_completion_length": T, "epsilon": 0.2,
            "rewards": "_grpo_rewards:low_ids"}
ROWS = ("inputs", "targets", "mask", "segments", "advantages")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("grpo_iterations") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1"}) + "\n" for i in range(8)))
    return load_prompts(str(path), MODEL, max_completion_length=T).train


def _job(num_iterations: int, lora=None):
    # SGD at a high rate: one update moves the ratio well past 1 +- epsilon.
    return plan_job(MODEL, "fp32", optax.sgd(3.0), batch_size=BATCH, objective=GRPO,
                    masked=True, segmented=True, lora=lora,
                    objective_settings={**SETTINGS, "num_iterations": num_iterations})


_logps = jax.jit(make_completion_logps(abstract_split(MODEL)[0], sequence_parallel=False))


def _by_hand(params, batch, old=None):
    """The step's loss and metrics from ``params`` as grpo_loss computes them (dapo, beta 0)."""
    rows = {k: jnp.asarray(batch[k]) for k in ("inputs", "targets", "mask", "segments")}
    rows["completion_mask"] = rows["mask"][:, -T - 1:-1] != 0
    logps = _logps(params, rows)
    return logps, grpo_loss(logps, batch["advantages"], rows["completion_mask"],
                            old_token_logps_NT=old, epsilon=0.2)


def _train(job, prompts, steps: int):
    """``steps`` steps as the recipe's loop takes them: each batch drawn on the state's current
    parameters; returns the batches (host copies), the parameters each step started from and
    the steps' metrics."""
    state = init_state(job)
    draw = batch_fn(job, prompts, params=lambda: state.params)
    batches, starts, metrics = [], [], []
    for k in range(steps):
        batch = draw(k)
        batches.append({k: (v if k == ROLLOUT_METRICS else np.asarray(v))
                        for k, v in batch.items()})
        starts.append(jax.tree.map(np.asarray, state.params))  # the step donates the state
        state, m = job.step(state, {k: v for k, v in batch.items() if k != ROLLOUT_METRICS})
        metrics.append({k: float(v) for k, v in m.items()})
    return batches, starts, metrics


@pytest.fixture(scope="module")
def reused(prompts):
    return _train(_job(2), prompts, 3)


def test_a_rollout_serves_num_iterations_updates(reused):
    batches, _, _ = reused
    first, second, third = batches
    # Step 1 reuses step 0's rollout, rows and stored log-probabilities alike; its batch carries
    # no statistics (they rode with the step that sampled). Step 2 samples anew.
    for name in (*ROWS, "old_logps"):
        np.testing.assert_array_equal(second[name], first[name], err_msg=name)
    assert second[ROLLOUT_METRICS] == {}
    assert "reward" in first[ROLLOUT_METRICS] and "reward" in third[ROLLOUT_METRICS]
    assert first[ROLLOUT_METRICS][ROLLOUT_SAMPLES]["step"] == 1
    assert third[ROLLOUT_METRICS][ROLLOUT_SAMPLES]["step"] == 3
    assert not np.array_equal(third["inputs"], first["inputs"])


def test_old_logps_are_the_sampling_pass_and_the_second_update_clips(reused):
    batches, starts, metrics = reused
    old_BS = batches[0]["old_logps"]
    # The sampling pass's: the completion tokens' log-probabilities under the parameters that
    # sampled them, at the completion's target positions, 0 elsewhere.
    logps0, (loss0, _) = _by_hand(starts[0], batches[0])
    np.testing.assert_allclose(old_BS[:, -T - 1:-1], logps0, rtol=0, atol=1e-6)
    assert not old_BS[:, :-T - 1].any() and not old_BS[:, -1].any()
    old = jnp.asarray(old_BS[:, -T - 1:-1])
    # Update 1: the ratio is 1 to f32 rounding, nothing clipped.
    _, (hand0, clip0) = _by_hand(starts[0], batches[0], old)
    assert metrics[0]["loss"] == pytest.approx(float(hand0), abs=1e-6)
    assert metrics[0]["clip_ratio/region_mean"] == float(clip0["clip_ratio/region_mean"]) == 0
    # Update 2, on the same rollout: the policy has moved, the ratio to the stored logps is
    # far from 1 and the clipped loss is the step's.
    logps1, (hand1, clip1) = _by_hand(starts[1], batches[1], old)
    mask = np.asarray(batches[1]["mask"][:, -T - 1:-1] != 0)
    ratio = np.exp(np.asarray(logps1) - np.asarray(old))[mask]
    assert np.abs(ratio - 1).max() > 0.2
    assert metrics[1]["loss"] == pytest.approx(float(hand1), rel=1e-5, abs=1e-6)
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert metrics[1][name] == pytest.approx(float(clip1[name]), abs=1e-6), name
    assert metrics[1]["clip_ratio/region_mean"] > 0
    # Without the stored logps (ratio 1) the second update's loss would be another number.
    _, (unclipped, _) = _by_hand(starts[1], batches[1])
    assert abs(float(unclipped) - metrics[1]["loss"]) > 1e-3


@pytest.mark.slow  # compiles the LoRA sampler and scorer: 4 to 7 s on 2 busy cores
def test_under_lora_the_sampling_pass_scores_with_the_adapters_on(prompts, reused):
    spec = lora_lib.LoraSpec(rank=2, targets=MODEL.lora_targets)
    job = _job(2, spec)
    frozen = reused[1][0]  # the full job's starting parameters, as the base (fp32)
    # Adapters away from their init (B = 0), so that they change the log-probabilities.
    adapters = jax.tree.map(lambda x: x + 0.5, lora_lib.init(jax.random.key(1), frozen, spec))
    batch = job.rollout(prompts, params=adapters, frozen=frozen, seed=0, step=0,
                        batch_size=BATCH)
    # The factored product's log-probabilities, to f32 rounding those of the merged weights
    # (the full model's, whose program the other tests compiled).
    on, _ = _by_hand(lora_lib.merge(frozen, adapters, spec), batch)
    off, _ = _by_hand(frozen, batch)
    np.testing.assert_allclose(batch["old_logps"][:, -T - 1:-1], on, rtol=0, atol=2e-5)
    assert np.abs(np.asarray(on) - np.asarray(off)).max() > 1e-2


def test_one_update_per_rollout_carries_nothing_new(prompts):
    job = _job(1)
    assert set(abstract_batch(job)) == set(ROWS)
    batches, starts, metrics = _train(job, prompts, 2)
    for batch, start, m in zip(batches, starts, metrics, strict=True):
        assert set(batch) == {*ROWS, ROLLOUT_METRICS} and "reward" in batch[ROLLOUT_METRICS]
        # TRL's shortcut: the ratio is exactly 1, the loss -sum(A mask) / tokens.
        _, (hand, _) = _by_hand(start, batch)
        mask = batch["mask"][:, -T - 1:-1] != 0
        assert m["loss"] == float(hand) == pytest.approx(
            -(batch["advantages"][:, None] * mask).sum() / mask.sum(), abs=1e-6)
        assert m["clip_ratio/region_mean"] == 0
    assert not np.array_equal(batches[1]["inputs"], batches[0]["inputs"])  # sampled each step


def test_num_iterations_is_checked_and_part_of_the_runs_identity():
    kw = {"objective": "grpo", "data": "p.jsonl", "rewards": "exact_match"}
    assert TrainConfig(**kw, num_iterations=4).sections.objective.settings["num_iterations"] == 4
    with pytest.raises(ConfigError, match="num_iterations=0: must be >= 1"):
        TrainConfig(**kw, num_iterations=0)
    with pytest.raises(ConfigError, match="num_iterations=2: only applies to --objective grpo"):
        TrainConfig(num_iterations=2)
    with pytest.raises(ConfigError, match="num_iterations"):
        _job(0)
    # A run recorded before the setting existed did one update per rollout.
    run = {"seed": 0, "objective": "grpo", "run": {}}
    assert identity(run)["objective"] == identity({**run, "num_iterations": 1})["objective"]
    assert identity(run)["objective"] != identity({**run, "num_iterations": 2})["objective"]
