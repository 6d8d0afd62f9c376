"""Training objectives beyond next-token cross-entropy, as pure functions of log-probabilities.

Preference tuning compares a completion the data prefers (``chosen``) with one it does not
(``rejected``) through each sequence's summed log-probability, which
:func:`effijax.models.make_sequence_logps` computes from the fused head (with its token count).
:func:`dpo_loss` is DPO with TRL's loss types (``sigmoid``, ``ipo``, ``hinge``, ``robust``)
against a reference model's log-probabilities; :func:`simpo_loss` (TRL's CPO trainer with
``loss_type="simpo"``) and :func:`orpo_loss` (TRL's ORPO trainer) need no reference. Each
returns the loss, averaged over pairs as TRL averages it, and the metrics under TRL's names
(``rewards/chosen``, ``rewards/accuracies``, ``logps/chosen``, ...), and checks its settings
before anything is traced. :func:`grpo_loss` is GRPO's clipped policy-gradient loss over
per-token log-probabilities (:func:`effijax.models.make_token_logps`) with TRL's loss types,
:func:`group_advantages` its group-relative advantages, and :func:`score_completions` scores
completions with reward functions (TRL's signature) and combines them as TRL does.

Example:
  >>> import jax.numpy as jnp
  >>> from effijax import objectives
  >>> loss, metrics = objectives.dpo_loss(jnp.array([-5.0]), jnp.array([-9.0]),
  ...                                     jnp.array([-6.0]), jnp.array([-8.0]))
  >>> round(float(loss), 4), float(metrics["rewards/accuracies"])
  (0.5981, 1.0)
"""

from effijax._lazy import attach

# Each name is imported from its module on first use (the package convention, see
# effijax/_lazy.py): importing the package costs only what is used.
__getattr__, __dir__, __all__ = attach(__name__, {
    "effijax.objectives._preference": ("DPO_LOSS_TYPES", "dpo_loss", "orpo_loss",
        "simpo_loss"),
    "effijax.objectives._grpo": ("GRPO_LOSS_TYPES", "SCALE_REWARDS", "check_grpo_settings",
        "group_advantages", "grpo_loss"),
    "effijax.objectives._rewards": ("REWARDS", "RewardError", "Scores", "answer_format",
        "exact_match", "extract_answer", "format_reward", "resolve_reward", "reward_name",
        "score_completions"),
})
