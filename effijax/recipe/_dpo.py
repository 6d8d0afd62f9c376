"""DPO (direct preference optimisation) as a training objective, under LoRA or in full.

It trains on preference pairs (:mod:`effijax.recipe._pairs`: ``{"prompt", "chosen",
"rejected"}`` JSONL, a pair's chosen row at ``2i`` and its rejected at ``2i + 1``). The loss
(:func:`effijax.objectives.dpo_loss`, TRL's) compares the policy's summed log-probabilities of
each completion (:func:`effijax.models.make_sequence_logps`) with the reference's, under
``stop_gradient``:

* under LoRA the policy is the base with the adapters, the reference the same base with the
  adapters off (zeroed: the policy's own base arithmetic, exactly), so no second copy of the
  base exists;
* in full training the reference is a frozen copy of the starting weights (in the compute
  dtype, or ``--frozen-dtype``), which the job holds and every batch carries as
  ``batch["reference"]`` (:func:`effijax.recipe.plan_job`): TRL's ``ref_model``, made from the
  same weights as the policy when none is given.

Its metrics are TRL's (``rewards/chosen``, ..., ``logps/rejected``). SimPO and ORPO
(:mod:`effijax.recipe._simpo`, :mod:`effijax.recipe._orpo`) train on the same pairs without a
reference.
"""

from __future__ import annotations

import jax

from effijax.objectives import dpo_loss
from effijax.recipe._objective import Objective, with_reference
from effijax.recipe._pairs import (
    PAIR_METRICS,
    check_pair_loss,
    completion_window,
    load_pairs,
    pair_batch,
    pair_eval_batches,
    policy_logps,
)

__all__ = ["DPO"]


def _dpo_loss(model, lora, *, sequence_parallel: bool = True, beta: float = 0.1,
              loss_type: str = "sigmoid", label_smoothing: float = 0.0,
              window: int | None = None):
    """DPO's loss of interleaved pair rows against the reference (see the module docstring;
    ``window``: :func:`~effijax.recipe._pairs.completion_window`)."""
    settings = {"beta": beta, "loss_type": loss_type, "label_smoothing": label_smoothing}
    check_pair_loss(lambda c, r, nc, nr: dpo_loss(c, r, c, r, chosen_counts=nc,
                                                  rejected_counts=nr, **settings))
    policy = policy_logps(model, lora, sequence_parallel=sequence_parallel, window=window)

    def body(params, batch, rng, reference):
        rows = {k: v for k, v in batch.items() if k != "reference"}
        logps_B, counts_B = policy(params, rows, rng)
        ref_B = jax.lax.stop_gradient(policy(reference, rows)[0])  # no dropout
        return dpo_loss(logps_B[0::2], logps_B[1::2], ref_B[0::2], ref_B[1::2],
                        chosen_counts=counts_B[0::2], rejected_counts=counts_B[1::2], **settings)

    return with_reference(body, lora)


DPO = Objective("dpo", _dpo_loss, batch=pair_batch, eval_batches=pair_eval_batches,
                load=load_pairs, metric=None, token_mean=False, reference=True,
                eval_metrics=PAIR_METRICS, data_settings=completion_window)
