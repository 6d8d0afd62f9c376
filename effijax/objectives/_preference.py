"""Preference losses with TRL's semantics: DPO (and IPO, hinge, robust), SimPO and ORPO.

Each function takes per-sequence log-probabilities, ``[P]`` f32 for ``P`` pairs (a batch's
chosen and rejected completions, summed over their tokens as
:func:`effijax.models.make_sequence_logps` returns them) and, where a loss normalises by length,
the token counts, and returns ``(loss, metrics)``: the mean over pairs, as TRL reduces, and f32
scalars named as TRL logs them. The settings are checked before anything is traced; a bad one
is a :class:`~effijax.errors.ConfigError` naming the argument and the choices.

The formulas are TRL 1.16's (``trl/trainer/dpo_trainer.py``: ``DPOTrainer._compute_loss``;
``trl/experimental/cpo/cpo_trainer.py``: ``CPOTrainer.cpo_loss`` and
``get_batch_loss_metrics``; ``trl/experimental/orpo/orpo_trainer.py``:
``ORPOTrainer.odds_ratio_loss`` and ``get_batch_loss_metrics``), and tests/test_preference.py
runs TRL's own code on the same numbers. With the log-ratio margin
``Δ = (log π(y⁺) - log π_ref(y⁺)) - (log π(y⁻) - log π_ref(y⁻))``:

* ``sigmoid``: ``-log σ(βΔ)``. Since TRL 1.0 (PR #3906) it takes no label smoothing: the
  smoothed (conservative) loss is ``robust``, and a ``label_smoothing`` given with another
  loss type is refused here rather than ignored as TRL ignores it.
* ``robust``: ``(-(1 - ε) log σ(βΔ) + ε log σ(-βΔ)) / (1 - 2ε)``, ``ε = label_smoothing``.
* ``hinge``: ``relu(1 - βΔ)``.
* ``ipo``: ``(Δ̄ - 1 / (2β))²``, each log-ratio divided by its completion's token count (at
  least 1) before the difference.

The rewards TRL logs for DPO are ``β`` times the summed log-ratios, whatever the loss type.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp

from effijax.errors import ConfigError

__all__ = ["DPO_LOSS_TYPES", "dpo_loss", "simpo_loss", "orpo_loss"]


def _sigmoid(delta, beta, smoothing):
    return -jax.nn.log_sigmoid(beta * delta)


def _robust(delta, beta, smoothing):
    clean = -(1 - smoothing) * jax.nn.log_sigmoid(beta * delta)
    flipped = -smoothing * jax.nn.log_sigmoid(-beta * delta)
    return (clean - flipped) / (1 - 2 * smoothing)


def _hinge(delta, beta, smoothing):
    return jax.nn.relu(1 - beta * delta)


def _ipo(delta_avg, beta, smoothing):
    return (delta_avg - 1 / (2 * beta)) ** 2


# loss_type -> (per-pair loss of the margin, whether the margin is length-normalised).
DPO_LOSS_TYPES: dict[str, tuple[Callable[..., jax.Array], bool]] = {
    "sigmoid": (_sigmoid, False),
    "ipo": (_ipo, True),
    "hinge": (_hinge, False),
    "robust": (_robust, False),
}


def dpo_loss(chosen_logps: jax.Array, rejected_logps: jax.Array, ref_chosen_logps: jax.Array,
             ref_rejected_logps: jax.Array, *, beta: float = 0.1, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, chosen_counts: jax.Array | None = None,
             rejected_counts: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DPO's loss over ``P`` pairs and TRL's metrics (``DPOTrainer`` of TRL 1.x; the formulas
    are in the module docstring).

    Args:
      chosen_logps, rejected_logps: the policy's summed log-probabilities of the chosen and
        rejected completions, f32 ``[P]`` (differentiated).
      ref_chosen_logps, ref_rejected_logps: the reference model's, ``[P]`` (not
        differentiated: the gradient stops there).
      beta: ``β > 0``, TRL's default 0.1 (for ``ipo``, the regulariser ``τ``).
      loss_type: one of :data:`DPO_LOSS_TYPES`: ``sigmoid`` (TRL's default), ``ipo``,
        ``hinge``, ``robust``.
      label_smoothing: ``robust``'s probability that a label is flipped, in ``[0, 0.5)``; 0
        for the other loss types.
      chosen_counts, rejected_counts: the completions' token counts ``[P]``, which ``ipo``
        divides by (required there, unused otherwise).

    Returns:
      ``(loss, metrics)``: the f32 mean over pairs, and ``rewards/chosen``,
      ``rewards/rejected`` (the means of ``β`` times the log-ratios), ``rewards/accuracies``
      (how often the chosen reward is the larger), ``rewards/margins``, ``logps/chosen``,
      ``logps/rejected`` (the means of the policy's log-probabilities).

    Raises:
      ConfigError: an unknown ``loss_type``, ``beta <= 0``, ``label_smoothing`` outside
        ``[0, 0.5)`` or given with a loss type other than ``robust``, ``ipo`` without counts.

    Example:
      >>> import jax.numpy as jnp
      >>> chosen, rejected = jnp.array([-10.0, -12.0]), jnp.array([-11.0, -11.0])
      >>> ref = jnp.array([-10.5, -11.5])
      >>> loss, metrics = dpo_loss(chosen, rejected, ref, ref)
      >>> round(float(loss), 4), float(metrics["rewards/accuracies"])
      (0.6944, 0.5)
      >>> loss, _ = dpo_loss(chosen, rejected, ref, ref, loss_type="ipo",
      ...                    chosen_counts=jnp.array([4, 5]), rejected_counts=jnp.array([6, 5]))
      >>> round(float(loss), 2)
      25.0
      >>> dpo_loss(chosen, rejected, ref, ref, loss_type="kto")
      Traceback (most recent call last):
      effijax.errors.ConfigError: loss_type='kto': not a DPO loss type; choose one of ...
    """
    _check_loss_type(loss_type)
    _check_beta(beta)
    _check_smoothing(label_smoothing, loss_type, allowed=("robust",))
    pair_loss, normalised = DPO_LOSS_TYPES[loss_type]
    if normalised and (chosen_counts is None or rejected_counts is None):
        raise ConfigError("chosen_counts", None, f"loss_type={loss_type!r} divides each "
                          "log-ratio by its completion's token count: pass chosen_counts and "
                          "rejected_counts (the counts make_sequence_logps returns)")
    chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps = _pairs(
        chosen_logps=chosen_logps, rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    chosen_ratios = chosen_logps - jax.lax.stop_gradient(ref_chosen_logps)
    rejected_ratios = rejected_logps - jax.lax.stop_gradient(ref_rejected_logps)
    if normalised:
        chosen_counts, rejected_counts = _counts(chosen_logps, chosen_counts=chosen_counts,
                                                 rejected_counts=rejected_counts)
        delta = chosen_ratios / chosen_counts - rejected_ratios / rejected_counts
    else:
        delta = chosen_ratios - rejected_ratios
    loss = jnp.mean(pair_loss(delta, beta, label_smoothing))
    return loss, _reward_metrics(beta * chosen_ratios, beta * rejected_ratios, chosen_logps,
                                 rejected_logps)


def simpo_loss(chosen_logps: jax.Array, rejected_logps: jax.Array, chosen_counts: jax.Array,
               rejected_counts: jax.Array, *, beta: float = 0.1, gamma: float = 0.5,
               label_smoothing: float = 0.0, cpo_alpha: float = 1.0
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """SimPO's loss over ``P`` pairs, reference-free (TRL's ``CPOTrainer`` with
    ``loss_type="simpo"``): with the length-normalised log-probabilities ``ℓ = logps / counts``,
    ``z = β (ℓ⁺ - ℓ⁻) - γ``, each pair's loss is ``-(1 - ε) log σ(z) - ε log σ(-z)``; the
    loss is their mean plus ``cpo_alpha`` times the NLL of the chosen completions' tokens
    (CPO's behaviour-cloning term: ``-Σ chosen_logps / Σ chosen_counts``).

    Args:
      chosen_logps, rejected_logps: summed log-probabilities of the completions, f32 ``[P]``.
      chosen_counts, rejected_counts: their token counts ``[P]`` (a count below 1 counts as 1;
        TRL divides by 0 and gets NaN).
      beta: ``β > 0``; TRL's default 0.1 (the SimPO paper uses 2 to 10).
      gamma: the target reward margin ``γ`` (TRL's ``simpo_gamma``, default 0.5).
      label_smoothing: ``ε`` in ``[0, 0.5)``, as TRL's CPO applies it.
      cpo_alpha: the NLL term's weight, ``>= 0``: TRL's ``CPOConfig`` default 1.0 (CPO-SimPO,
        what TRL's ``CPOTrainer(loss_type="simpo")`` trains unless told otherwise); 0 is SimPO
        as published (TRL's ``loss_type="alphapo"`` shortcut sets it so).

    Returns:
      ``(loss, metrics)``: ``rewards/chosen``, ``rewards/rejected`` (means of ``β ℓ``),
      ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` (means
      of ``ℓ``), and ``nll_loss`` (the chosen tokens' NLL, also when ``cpo_alpha`` is 0, where
      TRL logs 0).

    Example:
      >>> import jax.numpy as jnp
      >>> pair = jnp.array([-8.0]), jnp.array([-30.0]), jnp.array([4]), jnp.array([10])
      >>> loss, metrics = simpo_loss(*pair, beta=2.0, gamma=1.0, cpo_alpha=0.0)  # SimPO
      >>> round(float(loss), 4), float(metrics["logps/chosen"]), float(metrics["nll_loss"])
      (0.3133, -2.0, 2.0)
      >>> round(float(simpo_loss(*pair, beta=2.0, gamma=1.0)[0]), 4)  # + 1.0 x the NLL
      2.3133
    """
    _check_beta(beta)
    _check_smoothing(label_smoothing, "simpo", allowed=("simpo",))
    _check_number("gamma", gamma)
    _check_number("cpo_alpha", cpo_alpha, at_least=0.0)
    chosen_logps, rejected_logps = _pairs(chosen_logps=chosen_logps,
                                          rejected_logps=rejected_logps)
    chosen_counts, rejected_counts = _counts(chosen_logps, chosen_counts=chosen_counts,
                                             rejected_counts=rejected_counts)
    chosen_avg, rejected_avg = chosen_logps / chosen_counts, rejected_logps / rejected_counts
    z = beta * ((chosen_avg - rejected_avg) - gamma / beta)
    losses = (-jax.nn.log_sigmoid(z) * (1 - label_smoothing)
              - jax.nn.log_sigmoid(-z) * label_smoothing)
    nll = -jnp.sum(chosen_logps) / jnp.sum(chosen_counts)
    loss = jnp.mean(losses) + cpo_alpha * nll
    metrics = _reward_metrics(beta * chosen_avg, beta * rejected_avg, chosen_avg, rejected_avg)
    return loss, {**metrics, "nll_loss": jax.lax.stop_gradient(nll)}


def orpo_loss(chosen_logps: jax.Array, rejected_logps: jax.Array, chosen_counts: jax.Array,
              rejected_counts: jax.Array, *, nll: jax.Array, beta: float = 0.1
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """ORPO's loss over ``P`` pairs, reference-free (TRL's ``ORPOTrainer``): the SFT loss
    ``nll`` minus ``β`` times the mean log-sigmoid of the log odds ratio of the
    length-normalised log-probabilities ``ℓ = logps / counts``,
    ``log odds = (ℓ⁺ - ℓ⁻) - (log(1 - e^ℓ⁺) - log(1 - e^ℓ⁻))``.

    Args:
      chosen_logps, rejected_logps: summed log-probabilities of the completions, f32 ``[P]``.
      chosen_counts, rejected_counts: their token counts ``[P]`` (a count below 1 counts as 1).
      nll: the SFT term, a scalar: the chosen sequences' mean token NLL. TRL takes it over the
        chosen rows' prompt and completion tokens alike (``ORPOTrainer.concatenated_forward``),
        what :func:`effijax.models.make_loss_fn` computes on those rows with a mask of their
        real tokens; ``-Σ chosen_logps / Σ chosen_counts`` is its completion-only variant.
      beta: ``λ > 0``, the odds-ratio term's weight (TRL's ``beta``, default 0.1).

    Returns:
      ``(loss, metrics)``: ``rewards/chosen``, ``rewards/rejected`` (means of ``β ℓ``),
      ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` (means
      of ``ℓ``), ``nll_loss``, ``log_odds_ratio`` (the mean log-sigmoid of the log odds) and
      ``log_odds_chosen`` (the mean log odds), as TRL logs them.

    Example:
      >>> import jax.numpy as jnp
      >>> loss, metrics = orpo_loss(jnp.array([-2.0]), jnp.array([-6.0]), jnp.array([4]),
      ...                           jnp.array([3]), nll=jnp.float32(0.5), beta=0.1)
      >>> round(float(loss), 4), round(float(metrics["log_odds_chosen"]), 4)
      (0.5097, 2.2873)
    """
    _check_beta(beta)
    chosen_logps, rejected_logps = _pairs(chosen_logps=chosen_logps,
                                          rejected_logps=rejected_logps)
    chosen_counts, rejected_counts = _counts(chosen_logps, chosen_counts=chosen_counts,
                                             rejected_counts=rejected_counts)
    nll = jnp.asarray(nll)
    if nll.shape != () or nll.dtype != jnp.float32:
        raise ValueError(f"orpo_loss: nll must be an f32 scalar, got {nll.dtype}{list(nll.shape)}")
    chosen_avg, rejected_avg = chosen_logps / chosen_counts, rejected_logps / rejected_counts
    log_odds = (chosen_avg - rejected_avg) - (_log1mexp(chosen_avg) - _log1mexp(rejected_avg))
    ratio = jax.nn.log_sigmoid(log_odds)
    loss = nll - jnp.mean(beta * ratio)
    metrics = _reward_metrics(beta * chosen_avg, beta * rejected_avg, chosen_avg, rejected_avg)
    stop = jax.lax.stop_gradient
    return loss, {**metrics, "nll_loss": stop(nll), "log_odds_ratio": stop(jnp.mean(ratio)),
                  "log_odds_chosen": stop(jnp.mean(log_odds))}


def _log1mexp(x: jax.Array) -> jax.Array:
    """``log(1 - e^x)`` for ``x < 0``, branched at ``-ln 2`` as TRL's ``log1mexp`` (no
    cancellation on either side)."""
    return jnp.where(x < -0.6931471805599453, jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def _reward_metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps
                    ) -> dict[str, jax.Array]:
    """TRL's reward and log-probability metrics (means over the pairs), not differentiated."""
    stop = jax.lax.stop_gradient
    chosen_rewards, rejected_rewards = stop(chosen_rewards), stop(rejected_rewards)
    return {
        "rewards/chosen": jnp.mean(chosen_rewards),
        "rewards/rejected": jnp.mean(rejected_rewards),
        "rewards/accuracies": jnp.mean((chosen_rewards > rejected_rewards).astype(jnp.float32)),
        "rewards/margins": jnp.mean(chosen_rewards - rejected_rewards),
        "logps/chosen": jnp.mean(stop(chosen_logps)),
        "logps/rejected": jnp.mean(stop(rejected_logps)),
    }


# Checks, before anything is traced ----------------------------------------------------------


def _check_loss_type(loss_type) -> None:
    if not isinstance(loss_type, str) or loss_type not in DPO_LOSS_TYPES:
        choices = ", ".join(repr(t) for t in DPO_LOSS_TYPES)
        raise ConfigError("loss_type", loss_type, f"not a DPO loss type; choose one of {choices}")


def _check_number(name: str, value, *, at_least: float | None = None) -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ConfigError(name, value, "must be a Python number (a setting, not an array)")
    if at_least is not None and not value >= at_least:
        raise ConfigError(name, value, f"must be >= {at_least}")


def _check_beta(beta) -> None:
    _check_number("beta", beta)
    if not beta > 0:
        raise ConfigError("beta", beta, "must be > 0 (TRL's default is 0.1)")


def _check_smoothing(label_smoothing, loss_type: str, *, allowed: tuple[str, ...]) -> None:
    _check_number("label_smoothing", label_smoothing)
    if not 0.0 <= label_smoothing < 0.5:
        raise ConfigError("label_smoothing", label_smoothing,
                          "must lie in [0, 0.5): the probability that a preference is flipped")
    if label_smoothing > 0 and loss_type not in allowed:
        raise ConfigError("label_smoothing", label_smoothing,
                          f"loss_type={loss_type!r} takes no label smoothing (TRL 1.x ignores it "
                          "there; before 1.0 sigmoid applied it); use loss_type='robust' for the "
                          "label-smoothed DPO loss, or label_smoothing=0")


def _pairs(**arrays) -> tuple[jax.Array, ...]:
    """The log-probability arrays, checked: floating ``[P]``, one shape for all."""
    shapes = {name: jnp.shape(a) for name, a in arrays.items()}
    first = next(iter(shapes.values()))
    for name, a in arrays.items():
        if (len(shapes[name]) != 1 or shapes[name] != first
                or not jnp.issubdtype(jnp.result_type(a), jnp.floating)):
            # A ValueError, not a ConfigError: wrong arrays are a bug in the calling code.
            raise ValueError(f"{name}: expected floating log-probabilities of shape [pairs], "
                             f"one shape for all, got {dict(shapes)} "
                             f"({jnp.result_type(a)} for {name})")
    return tuple(jnp.asarray(a) for a in arrays.values())


def _counts(like: jax.Array, **counts) -> tuple[jax.Array, ...]:
    """Token counts as ``like``'s float dtype, at least 1 (TRL's IPO clamp), checked ``[P]``."""
    out = []
    for name, c in counts.items():
        if jnp.shape(c) != like.shape:
            raise ValueError(f"{name}: expected token counts of shape {list(like.shape)}, got "
                             f"{list(jnp.shape(c))}")
        out.append(jnp.maximum(jnp.asarray(c).astype(like.dtype), 1.0))
    return tuple(out)
