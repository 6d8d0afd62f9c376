"""DPO (direct preference optimisation) as a training objective, under LoRA.

It trains on preference pairs (:mod:`effijax.recipe._pairs`: ``{"prompt", "chosen",
"rejected"}`` JSONL, a pair's chosen row at ``2i`` and its rejected at ``2i + 1``). The loss
(:func:`effijax.objectives.dpo_loss`, TRL's) compares the policy's summed log-probabilities of
each completion (the base with the adapters, :func:`effijax.models.make_sequence_logps`) with
the reference's: the same base with the adapters off (zeroed: the policy's own base
arithmetic, exactly), under ``stop_gradient``, so no second copy of the base exists. Its
metrics are TRL's (``rewards/chosen``, ..., ``logps/rejected``). SimPO and ORPO
(:mod:`effijax.recipe._simpo`, :mod:`effijax.recipe._orpo`) train on the same pairs without a
reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from effijax import lora as lora_lib
from effijax.errors import ConfigError
from effijax.objectives import dpo_loss
from effijax.recipe._objective import Objective
from effijax.recipe._pairs import (
    check_pair_loss,
    load_pairs,
    pair_batch,
    pair_eval_batches,
    policy_logps,
)

__all__ = ["DPO"]


def _dpo_loss(model, lora, *, sequence_parallel: bool = True, beta: float = 0.1,
              loss_type: str = "sigmoid", label_smoothing: float = 0.0):
    """DPO's loss of interleaved pair rows: the policy is the base with the adapters, the
    reference the same base without them (no gradient)."""
    if lora is None:
        raise ConfigError("objective", "dpo", "trains LoRA adapters against the base with the "
                          "adapters off; pass lora= (--lora-rank R)")
    settings = {"beta": beta, "loss_type": loss_type, "label_smoothing": label_smoothing}
    check_pair_loss(lambda c, r, nc, nr: dpo_loss(c, r, c, r, chosen_counts=nc,
                                                  rejected_counts=nr, **settings))
    policy = policy_logps(model, lora, sequence_parallel=sequence_parallel)

    def loss(params, batch, rng=None):
        logps_B, counts_B = policy(params, batch, rng)
        # The adapters off: the same frozen base through the same function with zero adapters
        # (their products are exact zeros), so the reference's arithmetic is the policy's own
        # base arithmetic (on a CPU, a 16-bit base's kept bits) and policy == reference at
        # the adapters' init (B = 0) bit for bit; no dropout (rng None), no gradient.
        off = {"base": params["base"],
               "adapters": jax.tree.map(jnp.zeros_like, params["adapters"])}
        ref_B = jax.lax.stop_gradient(policy(off, batch)[0])
        return dpo_loss(logps_B[0::2], logps_B[1::2], ref_B[0::2], ref_B[1::2],
                        chosen_counts=counts_B[0::2], rejected_counts=counts_B[1::2], **settings)

    return lora_lib.freeze_base(loss)


DPO = Objective("dpo", _dpo_loss, batch=pair_batch, eval_batches=pair_eval_batches,
                load=load_pairs, metric=None, token_mean=False, needs_lora=True)
