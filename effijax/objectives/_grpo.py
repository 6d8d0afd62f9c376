"""GRPO with TRL's semantics: group-relative advantages and the clipped policy-gradient loss.

Each prompt is answered ``G`` times (a *group*); each completion's reward, less its group's
mean (and divided by its group's standard deviation, unless scaling is off as in Dr. GRPO), is
its *advantage* (:func:`group_advantages`). The loss (:func:`grpo_loss`) weighs each completion
token by the policy's probability ratio to the sampling policy, ``r = exp(log π - log π_old)``,
clipped PPO-style: ``-min(r A, clip(r, 1 - ε_low, 1 + ε_high) A)``, plus ``β`` times the k3
estimate of the KL divergence to a reference, ``exp(ref - log π) - (ref - log π) - 1``, and
reduces the tokens as TRL's ``loss_type`` says:

* ``grpo``: each completion's mean over its tokens, then the mean over completions.
* ``bnpo``: the mean over all of the batch's completion tokens.
* ``dr_grpo``: the sum over tokens divided by ``completions x max_completion_length``.
* ``dapo`` (TRL's default): the sum divided by the token count of the whole generation batch
  (``num_items``; the batch's own count when not given), the same however the batch is split.

The formulas are TRL 1.16's (``trl/trainer/grpo_trainer.py``: ``GRPOTrainer._compute_loss``
and the advantages of ``_generate_and_score_completions``, ``multi_objective_aggregation=
"sum_then_normalize"``), and tests/test_grpo.py runs TRL's own ``_compute_loss`` on the same
numbers. The metrics carry TRL's names (``clip_ratio/low_mean``, ``kl``, ``reward``, ...).

Shape suffixes: ``N`` completions (prompts x ``G``), ``T`` completion tokens.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp

from effijax.errors import ConfigError

__all__ = ["GRPO_LOSS_TYPES", "SCALE_REWARDS", "check_grpo_settings", "group_advantages",
           "grpo_loss"]

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
"""TRL's clipped-ratio loss types, by how the tokens' losses are reduced (module docstring)."""

SCALE_REWARDS = ("group", "batch", "none")
"""TRL's ``scale_rewards``: divide the advantages by their group's standard deviation, the
whole batch's, or by nothing (Dr. GRPO)."""

_STD_EPS = 1e-4  # added to the standard deviation before dividing, as TRL adds it


def _nanstd(x: jax.Array, axis=None) -> jax.Array:
    """The standard deviation of the non-NaN values with Bessel's correction (``ddof=1``), NaN
    where fewer than two are given: TRL's ``nanstd``."""
    mean = jnp.nanmean(x, axis=axis, keepdims=True)
    count = jnp.sum(~jnp.isnan(x), axis=axis, keepdims=True).astype(x.dtype)
    variance = jnp.nanmean((x - mean) ** 2, axis=axis, keepdims=True)
    variance = jnp.where(count > 1, variance * count / jnp.maximum(count - 1, 1.0), jnp.nan)
    std = jnp.sqrt(variance)
    return std.squeeze(axis) if axis is not None else std.reshape(())


def group_advantages(rewards_N: jax.Array, num_generations: int, *,
                     scale_rewards: str = "group") -> tuple[jax.Array, dict[str, jax.Array]]:
    """Each completion's advantage: its reward less its group's mean, divided by the standard
    deviation (plus ``1e-4``) of its group (``scale_rewards="group"``, TRL's default), of the
    batch (``"batch"``) or not at all (``"none"``, Dr. GRPO). The standard deviations are TRL's:
    Bessel-corrected (``ddof=1``), 0 for a group of one. A NaN reward (a completion no reward
    function scored) is left out of its group's mean and deviation and gets advantage 0.

    Args:
      rewards_N: f32 ``[N]``, the combined reward of each completion, the ``G`` completions of
        a prompt next to each other (``N = prompts x G``;
        :func:`effijax.objectives.score_completions`).
      num_generations: ``G``, completions per prompt.
      scale_rewards: one of :data:`SCALE_REWARDS`.

    Returns:
      ``(advantages_N, metrics)``: f32 ``[N]``, and TRL's ``reward`` (the mean reward),
      ``reward_std`` (its deviation over the batch) and ``frac_reward_zero_std`` (the fraction
      of completions whose scaling deviation is 0: their group's rewards all equal, for
      ``"group"``).

    Raises:
      ConfigError: an unknown ``scale_rewards``, ``num_generations`` < 1, or a reward count
        that is not a multiple of it.

    Example:
      >>> import jax.numpy as jnp
      >>> adv, metrics = group_advantages(jnp.array([1.0, 0.0, 1.0, 1.0]), 2)
      >>> [round(a, 3) for a in adv.tolist()], float(metrics["frac_reward_zero_std"])
      ([0.707, -0.707, 0.0, 0.0], 0.5)
      >>> group_advantages(jnp.array([1.0, 0.0, 3.0, 1.0]), 2, scale_rewards="none")[0].tolist()
      [0.5, -0.5, 1.0, -1.0]
    """
    if not isinstance(scale_rewards, str) or scale_rewards not in SCALE_REWARDS:
        raise ConfigError("scale_rewards", scale_rewards,
                          f"choose one of {', '.join(repr(s) for s in SCALE_REWARDS)}")
    if isinstance(num_generations, bool) or not isinstance(num_generations, numbers.Integral) \
            or num_generations < 1:
        raise ConfigError("num_generations", num_generations, "must be an int >= 1: the "
                          "completions sampled per prompt")
    rewards_N = jnp.asarray(rewards_N)
    if rewards_N.ndim != 1 or not jnp.issubdtype(rewards_N.dtype, jnp.floating):
        raise ValueError(f"group_advantages: rewards must be floating [completions], got "
                         f"{rewards_N.dtype}{list(rewards_N.shape)}")
    n = rewards_N.shape[0]
    if n % num_generations:
        raise ConfigError("num_generations", num_generations,
                          f"{n} rewards are not whole groups of {num_generations} completions")
    return _advantages(rewards_N, int(num_generations), scale_rewards)


# One program per (shape, settings): called eagerly, a few dozen small operations would each
# compile on their own.
@functools.partial(jax.jit, static_argnums=(1, 2))
def _advantages(rewards_N, num_generations, scale_rewards):
    n = rewards_N.shape[0]
    grouped = rewards_N.reshape(-1, num_generations)
    mean_N = jnp.repeat(jnp.nanmean(grouped, axis=1), num_generations)
    if scale_rewards == "batch":
        std_N = jnp.broadcast_to(_nanstd(rewards_N) if n > 1 else jnp.zeros((), rewards_N.dtype),
                                 (n,))
    elif num_generations > 1:
        std_N = jnp.repeat(_nanstd(grouped, axis=1), num_generations)
    else:
        std_N = jnp.zeros_like(rewards_N)
    advantages_N = rewards_N - mean_N
    if scale_rewards != "none":
        advantages_N = advantages_N / (std_N + _STD_EPS)
    # torch.isclose(std, 0): |std| <= 1e-8.
    zero_std = (jnp.abs(std_N) <= 1e-8).astype(jnp.float32)
    metrics = {"reward": jnp.nanmean(rewards_N), "reward_std": _nanstd(rewards_N),
               "frac_reward_zero_std": jnp.mean(zero_std)}
    return jnp.nan_to_num(advantages_N, nan=0.0), metrics


def grpo_loss(token_logps_NT: jax.Array, advantages_N: jax.Array, mask_NT: jax.Array, *,
              old_token_logps_NT: jax.Array | None = None,
              ref_token_logps_NT: jax.Array | None = None, beta: float = 0.0,
              epsilon: float = 0.2, epsilon_high: float | None = None,
              loss_type: str = "dapo", max_completion_length: int | None = None,
              num_items: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO's clipped policy-gradient loss over ``N`` completions of ``T`` tokens and TRL's
    metrics (``GRPOTrainer`` of TRL 1.x with ``importance_sampling_level="token"``; the
    formulas are in the module docstring).

    Args:
      token_logps_NT: the policy's log-probability of each completion token, f32 ``[N, T]``
        (differentiated; :func:`effijax.models.make_token_logps`).
      advantages_N: each completion's advantage ``[N]`` (:func:`group_advantages`).
      mask_NT: the completion's tokens, up to and including its end-of-sequence ``[N, T]``
        (bool or 0/1).
      old_token_logps_NT: the sampling policy's log-probabilities ``[N, T]``; None: the
        policy's own without gradient (TRL's shortcut for one update per rollout: the ratio is
        1 and only its gradient acts).
      ref_token_logps_NT: the reference model's ``[N, T]``, required when ``beta`` is not 0.
      beta: the KL penalty's weight ``>= 0`` (TRL's default 0: no reference needed).
      epsilon: the lower clipping range ``ε_low``, in ``(0, 1)`` (TRL's default 0.2).
      epsilon_high: the upper range ``ε_high > 0``; None: ``epsilon`` (DAPO recommends 0.28).
      loss_type: one of :data:`GRPO_LOSS_TYPES` (TRL's default ``dapo``).
      max_completion_length: ``dr_grpo``'s constant (TRL's ``max_completion_length``),
        required there, unused otherwise.
      num_items: ``dapo``'s normaliser: the completion tokens of the whole generation batch
        when this batch is a part of it (accumulated micro-batches); None: this batch's.

    Returns:
      ``(loss, metrics)``: the f32 loss and TRL's ``clip_ratio/low_mean``,
      ``clip_ratio/high_mean``, ``clip_ratio/region_mean`` (fractions of the tokens clipped
      below, above, either), ``clip_ratio/low_min``, ``clip_ratio/high_max`` (the extremes of
      the completions' fractions) and, when ``beta`` is not 0, ``kl`` (the tokens' mean k3).

    Raises:
      ConfigError: an unknown ``loss_type``, ``beta < 0``, ``epsilon`` outside ``(0, 1)``,
        ``epsilon_high <= 0``, ``dr_grpo`` without ``max_completion_length``, ``beta`` without
        reference log-probabilities.

    Example:
      >>> import jax.numpy as jnp
      >>> logps = jnp.log(jnp.array([[0.5, 0.5], [0.25, 0.5]]))
      >>> old = jnp.log(jnp.array([[0.25, 0.5], [0.5, 0.5]]))
      >>> mask = jnp.array([[1, 1], [1, 0]])
      >>> loss, metrics = grpo_loss(logps, jnp.array([1.0, -1.0]), mask,
      ...                           old_token_logps_NT=old, loss_type="bnpo")
      >>> round(float(loss), 4), round(float(metrics["clip_ratio/high_mean"]), 4)
      (-0.4667, 0.3333)
      >>> grpo_loss(logps, jnp.array([1.0, -1.0]), mask, loss_type="dr_grpo")
      Traceback (most recent call last):
      effijax.errors.ConfigError: max_completion_length=None: loss_type='dr_grpo' divides ...
    """
    epsilon_high = check_grpo_settings(beta=beta, epsilon=epsilon, epsilon_high=epsilon_high,
                                       loss_type=loss_type,
                                       max_completion_length=max_completion_length)
    if beta != 0 and ref_token_logps_NT is None:
        raise ConfigError("ref_token_logps_NT", None, f"beta={beta} penalises the KL divergence "
                          "to a reference: pass the reference's per-token log-probabilities, "
                          "or beta=0")
    logps_NT = _token_array("token_logps_NT", token_logps_NT, None)
    shape = logps_NT.shape
    mask_NT = _token_array("mask_NT", mask_NT, shape, floating=False).astype(logps_NT.dtype)
    advantages_N = jnp.asarray(advantages_N)
    if advantages_N.shape != shape[:1]:
        raise ValueError(f"advantages_N: expected one advantage per completion, shape "
                         f"{list(shape[:1])}, got {list(advantages_N.shape)}")
    old_NT = None if old_token_logps_NT is None else _token_array(
        "old_token_logps_NT", old_token_logps_NT, shape)
    ref_NT = None if beta == 0 else _token_array("ref_token_logps_NT", ref_token_logps_NT,
                                                   shape)
    items = None if num_items is None or loss_type != "dapo" else jnp.asarray(
        num_items, jnp.float32)
    return _loss(logps_NT, advantages_N, mask_NT, old_NT, ref_NT, items,
                 (float(beta), float(epsilon), float(epsilon_high), loss_type,
                  max_completion_length))


def _loss(logps_NT, advantages_N, mask_NT, old_NT, ref_NT, num_items, settings):
    beta, epsilon, epsilon_high, loss_type, max_completion_length = settings
    shape = logps_NT.shape
    stop = jax.lax.stop_gradient
    old_NT = stop(logps_NT) if old_NT is None else stop(old_NT)
    advantages_N1 = stop(advantages_N.astype(logps_NT.dtype))[:, None]

    ratio_NT = jnp.exp(logps_NT - old_NT)
    clipped_NT = jnp.clip(ratio_NT, 1 - epsilon, 1 + epsilon_high)
    token_loss_NT = -jnp.minimum(ratio_NT * advantages_N1, clipped_NT * advantages_N1)
    metrics = {}
    if beta != 0:
        ref_NT = stop(ref_NT)
        kl_NT = jnp.exp(ref_NT - logps_NT) - (ref_NT - logps_NT) - 1
        token_loss_NT = token_loss_NT + beta * kl_NT
        metrics["kl"] = stop(_masked_mean(kl_NT, mask_NT))

    masked_NT = token_loss_NT * mask_NT
    counts_N = jnp.sum(mask_NT, axis=1)
    if loss_type == "grpo":
        loss = jnp.mean(jnp.sum(masked_NT, axis=1) / jnp.maximum(counts_N, 1.0))
    elif loss_type == "bnpo":
        loss = jnp.sum(masked_NT) / jnp.maximum(jnp.sum(mask_NT), 1.0)
    elif loss_type == "dr_grpo":
        loss = jnp.sum(masked_NT) / (shape[0] * max_completion_length)
    else:  # dapo
        items = jnp.sum(mask_NT) if num_items is None else num_items
        loss = jnp.sum(masked_NT) / jnp.maximum(items, 1.0)

    ratio_NT = stop(ratio_NT)
    low_NT = ((ratio_NT < 1 - epsilon) & (advantages_N1 < 0)).astype(logps_NT.dtype)
    high_NT = ((ratio_NT > 1 + epsilon_high) & (advantages_N1 > 0)).astype(logps_NT.dtype)
    region_NT = jnp.maximum(low_NT, high_NT)
    metrics.update({
        "clip_ratio/low_mean": _masked_mean(low_NT, mask_NT),
        "clip_ratio/high_mean": _masked_mean(high_NT, mask_NT),
        "clip_ratio/region_mean": _masked_mean(region_NT, mask_NT),
        # Per completion (NaN for one without tokens, which nanmin and nanmax skip).
        "clip_ratio/low_min": jnp.nanmin(jnp.sum(low_NT * mask_NT, 1) / counts_N),
        "clip_ratio/high_max": jnp.nanmax(jnp.sum(high_NT * mask_NT, 1) / counts_N),
    })
    return loss, metrics


def _masked_mean(x_NT: jax.Array, mask_NT: jax.Array) -> jax.Array:
    return jnp.sum(x_NT * mask_NT) / jnp.maximum(jnp.sum(mask_NT), 1.0)


def check_grpo_settings(*, beta: float = 0.0, epsilon: float = 0.2,
                        epsilon_high: float | None = None, loss_type: str = "dapo",
                        max_completion_length: int | None = None) -> float:
    """Checks :func:`grpo_loss`'s settings before anything is traced; returns the upper
    clipping range (``epsilon_high``, or ``epsilon`` when None).

    Example:
      >>> check_grpo_settings(epsilon=0.2, epsilon_high=0.28)
      0.28
      >>> check_grpo_settings(loss_type="ppo")
      Traceback (most recent call last):
      effijax.errors.ConfigError: loss_type='ppo': not a GRPO loss type; choose one of ...
    """
    if not isinstance(loss_type, str) or loss_type not in GRPO_LOSS_TYPES:
        choices = ", ".join(repr(t) for t in GRPO_LOSS_TYPES)
        raise ConfigError("loss_type", loss_type, f"not a GRPO loss type; choose one of {choices}")
    _check_number("beta", beta)
    if not beta >= 0:
        raise ConfigError("beta", beta, "must be >= 0 (the KL penalty's weight; TRL's default "
                          "is 0, DeepSeek-R1 used 0.001)")
    _check_number("epsilon", epsilon)
    if not 0 < epsilon < 1:
        raise ConfigError("epsilon", epsilon, "must lie in (0, 1): the ratio is clipped below "
                          "at 1 - epsilon (TRL's default is 0.2)")
    if epsilon_high is None:
        epsilon_high = epsilon
    _check_number("epsilon_high", epsilon_high)
    if not epsilon_high > 0:
        raise ConfigError("epsilon_high", epsilon_high, "must be > 0: the ratio is clipped "
                          "above at 1 + epsilon_high (DAPO recommends 0.28)")
    if loss_type == "dr_grpo":
        if (isinstance(max_completion_length, bool)
                or not isinstance(max_completion_length, numbers.Integral)
                or max_completion_length < 1):
            raise ConfigError("max_completion_length", max_completion_length,
                              "loss_type='dr_grpo' divides the summed token losses by "
                              "completions x max_completion_length: pass the rollout's maximum "
                              "completion length (an int >= 1)")
    return epsilon_high


def _check_number(name: str, value) -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ConfigError(name, value, "must be a Python number (a setting, not an array)")


def _token_array(name: str, a, shape, *, floating: bool = True) -> jax.Array:
    """``a`` as an array, checked ``[N, T]`` (of ``shape`` when given), floating if asked."""
    a = jnp.asarray(a)
    if a.ndim != 2 or (shape is not None and a.shape != shape) or (
            floating and not jnp.issubdtype(a.dtype, jnp.floating)):
        # A ValueError, not a ConfigError: wrong arrays are a bug in the calling code.
        want = "floating " if floating else ""
        raise ValueError(f"{name}: expected {want}[completions, tokens] values"
                         f"{'' if shape is None else f' of shape {list(shape)}'}, got "
                         f"{a.dtype}{list(a.shape)}")
    return a
