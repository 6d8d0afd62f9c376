"""GRPO's pieces: the loss and advantages against TRL's, the rewards, the per-token head and the
rollout.

* :func:`grpo_loss` for each loss type, with and without the KL penalty and ``epsilon_high``,
  on random per-token log-probabilities: its value, gradient and metrics equal a plain
  reference written from TRL 1.16's ``GRPOTrainer._compute_loss`` (fast), and TRL's own
  ``_compute_loss`` run on the same numbers with a stand-in ``self`` (slow: importing TRL's
  trainer takes about 15 s here). :func:`group_advantages` against TRL's advantage code
  (its ``nanstd``) likewise.
* The rewards: TRL's weighted ``nansum`` with None entries, dotted-path resolution, and one
  named error for a reward that raises or returns the wrong count or type.
* :func:`effijax.models.head_token_logps` (fused, chunked) against autodiff of the plain
  logits, values and gradients.
* :func:`effijax.generate.rollout` on a tiny Llama: reproducible from its seed, TRL's
  completion mask, and its teacher-forced scoring equals the model's own logits (and a greedy
  rollout picks their argmax: the sampler and the scorer agree); composed by hand into twelve
  GRPO steps, the mean of a learnable reward rises (slow: the sampler compiles for about 5 s).
"""

import functools
import types
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from effijax.errors import ConfigError
from effijax.generate import make_completion_logps, rollout, rollout_batch, rollout_metrics
from effijax.models import abstract_split, head_token_logps, llama_config, make_apply
from effijax.models._head import head_logits
from effijax.objectives import (
    GRPO_LOSS_TYPES,
    RewardError,
    exact_match,
    extract_answer,
    format_reward,
    group_advantages,
    grpo_loss,
    resolve_reward,
    score_completions,
)

N, T, MAX_LEN = 6, 7, 9
SETTINGS = [(loss_type, beta, eps_high) for loss_type in GRPO_LOSS_TYPES
            for beta in (0.0, 0.04) for eps_high in (None, 0.28)]


def _inputs(seed=0):
    """Random per-token log-probabilities, advantages and a mask (one completion empty)."""
    rng = np.random.default_rng(seed)
    logps = np.log(rng.uniform(0.05, 1.0, (N, T))).astype(np.float32)
    old = (logps + rng.normal(0, 0.3, (N, T))).astype(np.float32)
    ref = (logps + rng.normal(0, 0.5, (N, T))).astype(np.float32)
    adv = rng.normal(0, 1, N).astype(np.float32)
    lengths = np.array([T, 3, 0, 5, 1, 6])
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int64)
    return logps, old, ref, adv, mask


def _reference(logps, old, ref, adv, mask, *, loss_type, beta, eps_high, eps=0.2):
    """The loss, written straight from TRL's ``_compute_loss`` (token level, one process, no
    accumulation), in jnp: what autodiff of the plain formula gives."""
    eps_high = eps if eps_high is None else eps_high
    mask = mask.astype(jnp.float32)
    coef_1 = jnp.exp(logps - old)
    coef_2 = jnp.clip(coef_1, 1 - eps, 1 + eps_high)
    per_token = -jnp.minimum(coef_1 * adv[:, None], coef_2 * adv[:, None])
    if beta:
        per_token = per_token + beta * (jnp.exp(ref - logps) - (ref - logps) - 1)
    if loss_type == "grpo":
        return jnp.mean((per_token * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0))
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.shape[0] * MAX_LEN)
    return (per_token * mask).sum() / jnp.maximum(mask.sum(), 1.0)  # bnpo, dapo


@pytest.mark.parametrize("loss_type,beta,eps_high", SETTINGS)
def test_loss_and_gradient_equal_the_plain_formula(loss_type, beta, eps_high):
    logps, old, ref, adv, mask = _inputs()
    settings = {"loss_type": loss_type, "beta": beta, "epsilon_high": eps_high,
                "max_completion_length": MAX_LEN}

    def ours(x):
        return grpo_loss(x, adv, mask, old_token_logps_NT=old, ref_token_logps_NT=ref,
                         **settings)

    (loss, metrics), grad = jax.value_and_grad(ours, has_aux=True)(logps)
    want, want_grad = jax.value_and_grad(functools.partial(
        _reference, old=old, ref=ref, adv=adv, mask=mask, loss_type=loss_type, beta=beta,
        eps_high=eps_high))(logps)
    np.testing.assert_allclose(loss, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-8)
    assert np.all(np.isfinite(grad)) and np.all(grad[mask == 0] == 0)
    assert ("kl" in metrics) == (beta != 0)


def test_without_old_logps_the_ratio_is_one_and_only_its_gradient_acts():
    logps, _, _, adv, mask = _inputs(1)
    loss, metrics = grpo_loss(logps, adv, mask, loss_type="grpo")
    grad = jax.grad(lambda x: grpo_loss(x, adv, mask, loss_type="grpo")[0])(logps)
    counts = mask.sum(1)
    np.testing.assert_allclose(loss, np.mean(-adv * (counts > 0)), rtol=1e-6)
    # d/dx of -exp(x - stop(x)) A / |o| / N is -A / |o| / N on each token.
    want = np.where(mask, -adv[:, None] / np.maximum(counts, 1)[:, None] / N, 0.0)
    np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-9)
    assert float(metrics["clip_ratio/region_mean"]) == 0.0


def test_clip_metrics_count_the_clipped_tokens():
    logps = np.log(np.array([[0.5, 0.5], [0.25, 0.5]], np.float32))
    old = np.log(np.array([[0.25, 0.5], [0.5, 0.5]], np.float32))
    mask = np.array([[1, 1], [1, 0]])
    loss, m = grpo_loss(logps, np.array([1.0, -1.0], np.float32), mask,
                        old_token_logps_NT=old, loss_type="dapo", epsilon_high=1.5)
    # Ratios 2, 1 | 0.5: the 2 is within 1 + 1.5, the 0.5 below 1 - 0.2 with A < 0.
    assert float(m["clip_ratio/high_mean"]) == 0.0
    np.testing.assert_allclose(float(m["clip_ratio/low_mean"]), 1 / 3, rtol=1e-6)
    assert float(m["clip_ratio/low_min"]) == 0.0 and float(m["clip_ratio/high_max"]) == 0.0
    np.testing.assert_allclose(float(loss), (-2.0 - 1.0 + 0.8) / 3, rtol=1e-6)


def test_dapo_normalises_by_the_generation_batchs_tokens():
    logps, old, _, adv, mask = _inputs(2)
    here, _ = grpo_loss(logps, adv, mask, old_token_logps_NT=old, loss_type="dapo")
    bnpo, _ = grpo_loss(logps, adv, mask, old_token_logps_NT=old, loss_type="bnpo")
    # This batch is half of a generation batch with twice its tokens.
    half, _ = grpo_loss(logps, adv, mask, old_token_logps_NT=old, loss_type="dapo",
                        num_items=2 * int(mask.sum()))
    assert float(here) == float(bnpo)
    np.testing.assert_allclose(float(half), float(here) / 2, rtol=1e-6)


def test_settings_are_checked_before_tracing():
    logps, old, ref, adv, mask = _inputs()
    with pytest.raises(ConfigError, match="loss_type='cispo'"):
        grpo_loss(logps, adv, mask, loss_type="cispo")
    with pytest.raises(ConfigError, match="max_completion_length=None"):
        grpo_loss(logps, adv, mask, loss_type="dr_grpo")
    with pytest.raises(ConfigError, match="beta=-0.1"):
        grpo_loss(logps, adv, mask, beta=-0.1)
    with pytest.raises(ConfigError, match="ref_token_logps_NT"):
        grpo_loss(logps, adv, mask, beta=0.1)
    with pytest.raises(ConfigError, match="epsilon=1.0"):
        grpo_loss(logps, adv, mask, epsilon=1.0)
    with pytest.raises(ConfigError, match="epsilon_high=0"):
        grpo_loss(logps, adv, mask, epsilon_high=0)
    with pytest.raises(ValueError, match=r"advantages_N: .* \[6\]"):
        grpo_loss(logps, adv[:3], mask)
    with pytest.raises(ValueError, match="mask_NT"):
        grpo_loss(logps, adv, mask[:, :3])
    with pytest.raises(ConfigError, match="scale_rewards='std'"):
        group_advantages(jnp.zeros(4), 2, scale_rewards="std")
    with pytest.raises(ConfigError, match="not whole groups"):
        group_advantages(jnp.zeros(5), 2)


def _trl_advantages(rewards, g, scale):
    """TRL 1.16's advantages (``_generate_and_score_completions``, ``sum_then_normalize``),
    with its own ``nanstd``."""
    import torch
    from trl.trainer.utils import nanstd

    rewards = torch.tensor(rewards)
    mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
    if scale in ("group", "none"):
        std = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
    else:
        std = nanstd(rewards).expand_as(rewards)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    zero = torch.isclose(std, torch.zeros_like(std)).float().mean()
    return (torch.nan_to_num(adv, nan=0.0).numpy(), float(torch.nanmean(rewards)),
            float(nanstd(rewards)), float(zero))


def _rewards():
    rng = np.random.default_rng(3)
    r = rng.normal(0, 2, 12).astype(np.float32)
    r[4:8] = 1.0  # a group whose rewards all equal: std 0
    r[9] = np.nan  # a completion no reward scored
    return r


def test_advantages_by_hand():
    r = _rewards()
    adv, m = group_advantages(jnp.asarray(r), 4, scale_rewards="group")
    g = r[:4]
    np.testing.assert_allclose(adv[:4], (g - g.mean()) / (g.std(ddof=1) + 1e-4), rtol=1e-5)
    assert np.all(np.asarray(adv[4:8]) == 0) and float(adv[9]) == 0.0
    np.testing.assert_allclose(float(m["frac_reward_zero_std"]), 4 / 12)
    unscaled, _ = group_advantages(jnp.asarray(r), 4, scale_rewards="none")
    np.testing.assert_allclose(unscaled[:4], g - g.mean(), rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # importing TRL's utilities pulls in transformers (about 11 s)
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trl(scale):
    pytest.importorskip("trl", minversion="1.16", reason="TRL is the reference (interop extra)")
    r = _rewards()
    adv, m = group_advantages(jnp.asarray(r), 4, scale_rewards=scale)
    want, reward, reward_std, zero = _trl_advantages(r, 4, scale)
    np.testing.assert_allclose(adv, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose([float(m["reward"]), float(m["reward_std"]),
                                float(m["frac_reward_zero_std"])], [reward, reward_std, zero],
                               rtol=1e-6)


def _trl_loss(logps, old, ref, adv, mask, *, loss_type, beta, eps_high):
    """TRL's own ``GRPOTrainer._compute_loss`` on these numbers: a stand-in ``self`` whose
    model returns ``logps`` (a leaf, for the gradient), one process, no accumulation."""
    import torch
    from trl.trainer.grpo_trainer import GRPOTrainer

    x = torch.tensor(logps, requires_grad=True)
    identity = lambda t, **_: t  # noqa: E731 -- one process: gather and reduce are identities
    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (x, torch.zeros_like(x), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=beta, loss_type=loss_type, epsilon_low=0.2,
        epsilon_high=0.2 if eps_high is None else eps_high, use_vllm=False,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None,
                                   steps_per_generation=1),
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=MAX_LEN, _entropy_bonus_enabled=False,
        accelerator=types.SimpleNamespace(num_processes=1, gather=identity, reduce=identity,
                                          gather_for_metrics=identity),
        _metrics={"train": defaultdict(list)})
    mask_t = torch.tensor(mask)
    inputs = {"prompt_ids": torch.zeros((N, 2), dtype=torch.long),
              "prompt_mask": torch.ones((N, 2), dtype=torch.long),
              "completion_ids": torch.zeros((N, T), dtype=torch.long),
              "completion_mask": mask_t, "advantages": torch.tensor(adv),
              "old_per_token_logps": torch.tensor(old), "ref_per_token_logps": torch.tensor(ref),
              "num_items_in_batch": mask_t.sum()}
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss.detach()), x.grad.numpy(), metrics


@pytest.mark.slow  # importing TRL's trainer takes about 15 s
def test_loss_gradient_and_metrics_equal_trls_own_code():
    pytest.importorskip("trl", minversion="1.16", reason="TRL is the reference (interop extra)")
    logps, old, ref, adv, mask = _inputs()
    for loss_type, beta, eps_high in SETTINGS:
        settings = {"loss_type": loss_type, "beta": beta, "epsilon_high": eps_high}
        want, want_grad, want_metrics = _trl_loss(logps, old, ref, adv, mask,
                                                  loss_type=loss_type, beta=beta,
                                                  eps_high=eps_high)

        def ours(x, settings=settings):
            return grpo_loss(x, adv, mask, old_token_logps_NT=old, ref_token_logps_NT=ref,
                             max_completion_length=MAX_LEN, **settings)

        (loss, metrics), grad = jax.value_and_grad(ours, has_aux=True)(logps)
        np.testing.assert_allclose(loss, want, rtol=1e-6, atol=1e-7, err_msg=str(settings))
        np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-8, err_msg=str(settings))
        want_metrics.pop("entropy")  # effijax's head does not compute entropies
        assert set(metrics) == set(want_metrics), settings
        for name, value in want_metrics.items():
            np.testing.assert_allclose(float(metrics[name]), value, rtol=1e-6, atol=1e-7,
                                       err_msg=f"{name} {settings}")


# Rewards ------------------------------------------------------------------------------------


def test_rewards_combine_as_trl_with_weights_and_none():
    def half(prompts, completions, **kw):
        return [0.5 if i % 2 else None for i in range(len(completions))]

    def length(prompts, completions, **kw):
        return [float(len(c)) for c in completions]

    scores = score_completions([half, length, "exact_match"], ["q"] * 4, ["1", "22", "3", "x"],
                               weights=[2.0, 0.25, 1.0], columns={"answer": ["1", "2", None, "x"]})
    # Completion 2: half None, exact_match None; completion 0: half None.
    np.testing.assert_allclose(scores.rewards, [0.25 + 1, 1 + 0.5 + 0, 0.25, 1 + 0.25 + 1])
    assert scores.names == ("half", "length", "exact_match")
    np.testing.assert_allclose(scores.metrics["rewards/half/mean"], 0.5)
    np.testing.assert_allclose(scores.metrics["rewards/length/std"], np.std([1, 2, 1, 1], ddof=1),
                               rtol=1e-6)
    none = score_completions([half], ["q"] * 2, ["a", "b"])
    assert np.isnan(none.rewards[0]) and none.rewards[1] == 0.5


def test_a_failing_reward_is_one_error_naming_it():
    def broken(prompts, completions, **kw):
        raise KeyError("score")

    with pytest.raises(RewardError, match=r"reward 'broken': raised KeyError: 'score' "
                       r"\(called with prompts, completions, answer\)"):
        score_completions([broken], ["q"], ["a"], columns={"answer": ["a"]})
    with pytest.raises(RewardError, match="'exact_match': raised TypeError: .*answer"):
        score_completions(["exact_match"], ["q"], ["a"])  # no answer column
    with pytest.raises(RewardError, match="'short': returned 1 rewards for 2 completions"):
        score_completions([_named("short", lambda **kw: [1.0])], ["q"] * 2, ["a", "b"])
    with pytest.raises(RewardError, match="'texty': returned a str"):
        score_completions([_named("texty", lambda **kw: "1.0")], ["q"], ["a"])
    with pytest.raises(RewardError, match="'stringy': returned a str .* for completion 1"):
        score_completions([_named("stringy", lambda **kw: [1.0, "2"])], ["q"] * 2, ["a", "b"])
    with pytest.raises(RewardError, match="'infinite': returned inf"):
        score_completions([_named("infinite", lambda **kw: [float("inf")])], ["q"], ["a"])
    with pytest.raises(ConfigError, match="reward_weights"):
        score_completions(["exact_match"], ["q"], ["a"], weights=[1.0, 2.0])


def _named(name, fn):
    fn.__name__ = name
    return fn


def test_rewards_resolve_from_dotted_paths_never_eval():
    assert resolve_reward("exact_match") is exact_match
    assert resolve_reward("effijax.objectives._rewards:exact_match") is exact_match
    assert resolve_reward("effijax.objectives._rewards.exact_match") is exact_match
    assert resolve_reward(exact_match) is exact_match
    with pytest.raises(ConfigError, match="module 'no_such_package_x' does not import"):
        resolve_reward("no_such_package_x:f")
    with pytest.raises(ConfigError, match="has no 'nope'"):
        resolve_reward("effijax.objectives._rewards:nope")
    with pytest.raises(ConfigError, match="not a callable"):
        resolve_reward("effijax.objectives._rewards:REWARDS")
    with pytest.raises(ConfigError, match="Python identifiers"):
        resolve_reward("os:system('x')")
    with pytest.raises(ConfigError, match="not a built-in reward"):
        resolve_reward("exactmatch")


def test_builtin_rewards():
    assert extract_answer("so \\boxed{42} it is") == "42"
    assert extract_answer("<answer>a</answer> then <answer> b </answer>") == "b"
    assert exact_match(["q"] * 4, ["<answer>1,000</answer>", "1000.0", "the answer is 7",
                                   [{"role": "assistant", "content": "Paris"}]],
                       answer=["1000", "1000", "8", "paris"]) == [1.0, 1.0, 0.0, 1.0]
    fmt = resolve_reward("answer_format")
    assert fmt(prompts=["q"] * 3, completions=["x <answer>1</answer>", "<answer>1</answer> y",
                                               "<answer></answer>"]) == [1.0, 0.0, 0.0]
    with pytest.raises(ConfigError, match="pattern"):
        format_reward("(")


# The per-token head ----------------------------------------------------------------------------


@pytest.mark.parametrize("cap,temperature", [(None, 1.0), (30.0, 0.7)])
def test_token_logps_head_equals_autodiff_of_the_logits(cap, temperature):
    # 2 x 512 tokens: the fused head runs in two chunks of 256 positions (a scan).
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 512, 8)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(8, 96)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 96, (2, 512)), jnp.int32)
    where = jnp.asarray(rng.uniform(size=(2, 512)) < 0.7)
    g = jnp.asarray(rng.normal(size=(2, 512)), jnp.float32)

    def fused(x, kernel):
        logps = head_token_logps(x, kernel, targets, where, cap=cap, temperature=temperature)
        return jnp.sum(g * logps), logps

    def plain(x, kernel):
        logits = head_logits(x, kernel, cap=cap) / temperature
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
        logps = jnp.where(where, picked, 0.0)
        return jnp.sum(g * logps), logps

    (_, ours), grads = jax.jit(jax.value_and_grad(fused, (0, 1), has_aux=True))(x, kernel)
    (_, want), want_grads = jax.jit(jax.value_and_grad(plain, (0, 1), has_aux=True))(x, kernel)
    np.testing.assert_allclose(ours, want, rtol=2e-6, atol=2e-6)
    assert np.all(np.asarray(ours)[~np.asarray(where)] == 0)
    for a, b in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # two compiles of the model (about 5 s on 2 cores)
def test_token_logps_sum_to_the_sequence_logps_under_lora():
    from effijax import lora
    from effijax.models import make_sequence_logps, make_token_logps

    model = llama_config("llama-tiny")
    graphdef, _ = abstract_split(model)
    base = model.init_params(jax.random.key(0))
    spec = lora.LoraSpec(rank=2, alpha=8.0, targets=model.lora_targets)
    rng = np.random.default_rng(0)
    adapters = jax.tree.map(lambda x: x + jnp.asarray(rng.normal(0, 0.1, x.shape), x.dtype),
                            lora.init(jax.random.key(1), base, spec))  # B != 0: they act
    params = {"base": base, "adapters": adapters}
    tokens = jnp.asarray(rng.integers(0, 256, (2, 16)), jnp.int32)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1),
             "mask": jnp.asarray(np.arange(16)[None] >= np.array([[4], [9]]))}

    def both(params):
        return (make_token_logps(graphdef, spec)(params, batch),
                make_sequence_logps(graphdef, spec)(params, batch)[0])

    tokens_logps, sequence_logps = jax.jit(both)(params)
    np.testing.assert_allclose(tokens_logps.sum(1), sequence_logps, rtol=1e-5)
    assert np.all(np.asarray(tokens_logps)[~np.asarray(batch["mask"])] == 0)


# Rollouts ------------------------------------------------------------------------------------

MODEL = llama_config("llama-tiny")
# The rollout fixture compiles the sampler's two programs (about 5 s on 2 cores, more than a
# fast-tier test may take): whichever test builds it would break the rule, so all are slow.
slow = pytest.mark.slow
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
EOS = list(range(0, 256, 5))  # many end-of-sequence ids: some completions stop early


@pytest.mark.parametrize("kwargs,field", [
    ({"num_generations": 0}, "num_generations"),
    ({"temperature": 0.0}, "temperature"),
    ({"max_completion_length": 1000}, "max_completion_length"),
    ({"eos_id": -1}, "eos_id"),
])
def test_bad_rollout_settings_fail_before_anything_runs(kwargs, field):
    settings = {"num_generations": 2, "max_completion_length": 8, **kwargs}
    with pytest.raises(ConfigError) as e:
        rollout(MODEL, None, PROMPTS, **settings)  # no parameters needed to refuse
    assert e.value.field == field


@pytest.fixture(scope="module")
def sampled():
    params = MODEL.init_params(jax.random.key(0))
    out = rollout(MODEL, params, PROMPTS, num_generations=2, max_completion_length=8,
                  temperature=1.0, seed=0, eos_id=EOS,
                  decode=lambda ids: " ".join(map(str, ids)))
    return params, out


@slow
def test_rollout_is_reproducible_from_its_seed(sampled):
    params, out = sampled
    again = rollout(MODEL, params, PROMPTS, num_generations=2, max_completion_length=8,
                    temperature=1.0, seed=0, eos_id=EOS)
    other = rollout(MODEL, params, PROMPTS, num_generations=2, max_completion_length=8,
                    temperature=1.0, seed=1, eos_id=EOS)
    np.testing.assert_array_equal(again.completion_ids, out.completion_ids)
    np.testing.assert_array_equal(again.completion_mask, out.completion_mask)
    assert (other.completion_ids != out.completion_ids).any()
    assert (out.completion_ids[0::2] != out.completion_ids[1::2]).any()  # a group's rows differ


@slow
def test_rollout_mask_ends_at_the_first_eos_inclusive(sampled):
    _, out = sampled
    assert out.completion_ids.shape == (6, 8) and out.prompt_lengths.tolist() == [3, 3, 7, 7, 1, 1]
    is_eos = np.isin(out.completion_ids, EOS) & out.completion_mask
    assert is_eos.any() and not is_eos.all(axis=1).all()  # the seed stops some rows, not all
    for ids, mask, finished, text in zip(out.completion_ids, out.completion_mask, out.finished,
                                         out.completions, strict=True):
        stops = np.flatnonzero(np.isin(ids, EOS))
        end = stops[0] + 1 if stops.size else len(ids)
        assert mask.tolist() == [True] * end + [False] * (len(ids) - end)
        assert text == " ".join(map(str, ids[:stops[0] if stops.size else len(ids)]))
        assert finished == bool(stops.size)
    metrics = rollout_metrics(out)
    lengths = out.completion_mask.sum(1)
    assert metrics["completions/mean_length"] == lengths.mean()
    assert metrics["completions/clipped_ratio"] == 1 - out.finished.mean()
    assert metrics["completions/max_terminated_length"] == lengths[out.finished].max()


@slow
def test_teacher_forced_logps_equal_the_models_logits_and_greedy_picks_their_argmax(sampled):
    params, out = sampled
    graphdef, _ = abstract_split(MODEL)
    batch = {k: jnp.asarray(v) for k, v in rollout_batch(out).items()}
    logps = jax.jit(make_completion_logps(graphdef))(params, batch)
    logits = jax.jit(make_apply(graphdef))(params, batch["inputs"],
                                           segments_BS=batch["segments"])
    p = out.prompt_ids.shape[1]
    window = jax.nn.log_softmax(logits.astype(jnp.float32))[:, p - 1:p - 1 + 8]
    picked = jnp.take_along_axis(window, jnp.asarray(out.completion_ids)[..., None], -1)[..., 0]
    want = np.where(out.completion_mask, picked, 0.0)
    np.testing.assert_allclose(logps, want, rtol=1e-6, atol=1e-6)
    # A greedy rollout of the same shapes (no new compile: the temperature is traced) picks
    # each position's argmax of the teacher-forced logits: the cached sampler and the scorer
    # see the same distribution, left padding and all.
    greedy = rollout(MODEL, params, PROMPTS, num_generations=2, max_completion_length=8,
                     temperature=1e-6, seed=0)
    forced = rollout_batch(greedy)
    logits = jax.jit(make_apply(graphdef))(params, jnp.asarray(forced["inputs"]),
                                           segments_BS=jnp.asarray(forced["segments"]))
    argmax = np.asarray(jnp.argmax(logits[:, p - 1:p - 1 + 8], -1))
    np.testing.assert_array_equal(greedy.completion_ids, argmax)


def _low_half(prompts, completions, completion_ids, **columns):
    """A reward a tiny model learns in a few steps: the fraction of tokens in the vocabulary's
    lower half."""
    return [float(np.mean(np.asarray(ids) < 128)) for ids in completion_ids]


@slow
def test_grpo_steps_on_the_rollouts_of_the_trained_params_raise_the_mean_reward(sampled):
    # The pieces composed by hand as a training loop will: each step samples on the current
    # parameters (the fixture's shapes: no new sampler compile), scores, forms advantages and
    # takes one clipped policy-gradient step (one update per rollout: old = the policy).
    import optax

    from effijax.optimizers import optax_promotion

    params, _ = sampled
    completion_logps = make_completion_logps(abstract_split(MODEL)[0])
    tx = optax.adam(3e-2)
    with optax_promotion():
        opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch, advantages):
        def loss(p):
            return grpo_loss(completion_logps(p, batch), advantages, batch["completion_mask"])[0]

        grads = jax.grad(loss)(params)
        with optax_promotion():
            updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    means = []
    for i in range(12):
        out = rollout(MODEL, params, PROMPTS, num_generations=2, max_completion_length=8,
                      temperature=1.0, seed=100 + i)
        scores = score_completions([_low_half], [0] * 6, [""] * 6,
                                   completion_ids=out.completion_ids)
        advantages, metrics = group_advantages(jnp.asarray(scores.rewards), 2)
        means.append(float(metrics["reward"]))
        batch = {k: jnp.asarray(v) for k, v in rollout_batch(out).items()}
        params, opt_state = step(params, opt_state, batch, advantages)
    first, last = np.mean(means[:3]), np.mean(means[-3:])
    assert last >= first + 0.25 and last >= 0.85, means
