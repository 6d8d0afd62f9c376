"""SimPO as a training objective: TRL's ``CPOTrainer`` with ``loss_type="simpo"``, under LoRA or
in full fine-tuning.

It trains on preference pairs (:mod:`effijax.recipe._pairs`, the data DPO reads) and needs no
reference model: the loss (:func:`effijax.objectives.simpo_loss`) compares the policy's
length-normalised log-probabilities of the chosen and rejected completions (each summed over
its completion's tokens and divided by their count, TRL's ``average_log_prob=True``), with
``β`` and the target margin ``γ``, plus ``cpo_alpha`` times the NLL of the chosen completions'
tokens (TRL's CPO-SimPO; ``cpo_alpha = 0`` is SimPO as published). The settings and their
defaults are TRL's ``CPOConfig``'s: ``beta`` 0.1, ``simpo_gamma`` 0.5, ``cpo_alpha`` 1.0,
``label_smoothing`` 0. The metrics are TRL's (``rewards/*``, ``logps/*`` of the averages,
``nll_loss``), less ``logits/chosen`` and ``logits/rejected`` (means of ``[B, S, V]`` logits,
padding included, that the fused head never forms).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from effijax.models import gpt_config
  >>> model = gpt_config("tiny")
  >>> tokens = jnp.arange(32, dtype=jnp.int32).reshape(4, 8)  # 2 pairs: chosen, rejected, ...
  >>> batch = {"inputs": tokens, "targets": tokens + 1,
  ...          "mask": jnp.broadcast_to(jnp.arange(8) >= 5, (4, 8))}  # the completions
  >>> loss = SIMPO.loss(model, None, beta=2.0, gamma=1.0)  # cpo_alpha: TRL's 1.0
  >>> value, metrics = loss(model.init_params(jax.random.key(0)), batch)
  >>> sorted(metrics)[:3], bool(value > metrics["nll_loss"])  # + the NLL of the chosen
  (['logps/chosen', 'logps/rejected', 'nll_loss'], True)
"""

from __future__ import annotations

import functools

from effijax import lora as lora_lib
from effijax.objectives import simpo_loss
from effijax.recipe._objective import Objective
from effijax.recipe._pairs import (
    PAIR_METRICS,
    check_pair_loss,
    completion_window,
    load_pairs,
    pair_batch,
    pair_eval_batches,
    policy_logps,
)

__all__ = ["SIMPO"]


def _simpo_loss(model, lora, *, sequence_parallel: bool = True, window: int | None = None,
                **settings):
    """SimPO's loss of interleaved pair rows (``settings``: :func:`simpo_loss`'s ``beta``,
    ``gamma``, ``label_smoothing``, ``cpo_alpha``; ``window``:
    :func:`~effijax.recipe._pairs.completion_window`): the policy alone, no reference."""
    pair_loss = functools.partial(simpo_loss, **settings)
    check_pair_loss(pair_loss)
    policy = policy_logps(model, lora, sequence_parallel=sequence_parallel, window=window)

    def loss(params, batch, rng=None):
        logps_B, counts_B = policy(params, batch, rng)
        return pair_loss(logps_B[0::2], logps_B[1::2], counts_B[0::2], counts_B[1::2])

    return loss if lora is None else lora_lib.freeze_base(loss)


SIMPO = Objective("simpo", _simpo_loss, batch=pair_batch, eval_batches=pair_eval_batches,
                  load=load_pairs, metric=None, token_mean=False, eval_metrics=PAIR_METRICS,
                  data_settings=completion_window)
