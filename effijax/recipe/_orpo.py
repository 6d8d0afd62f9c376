"""ORPO as a training objective: TRL's ``ORPOTrainer``, under LoRA or in full fine-tuning.

It trains on preference pairs (:mod:`effijax.recipe._pairs`, the data DPO reads) and needs no
reference model. The loss (:func:`effijax.objectives.orpo_loss`) is the SFT loss of the chosen
sides plus ``β`` (the paper's ``λ``, TRL's ``beta``, default 0.1) times the odds-ratio term of
the length-normalised log-probabilities (each completion's summed log-probability divided by
its token count, TRL's ``average_log_prob=True``). As in TRL, the SFT loss is the mean token
NLL over the chosen rows' prompt *and* completion (``ORPOTrainer.concatenated_forward``: every
target of the sequence), pooled over the batch: here every target of a chosen row up to its
completion's last trained token (a chat template's trailing whitespace, which the completion's
mask leaves out, is left out of both).

A pair's three sums (its chosen completion, its rejected completion, its whole chosen sequence)
come from one pass of the policy over the batch's rows and the chosen rows once more with the
sequence's mask (:func:`effijax.models.make_sequence_logps` sums one mask per row): 1.5 times
the rows of a batch (with dropout, the second copy draws its own masks). The metrics are
TRL's (``rewards/*``, ``logps/*`` of the averages, ``nll_loss``, ``log_odds_ratio``,
``log_odds_chosen``), less ``logits/chosen`` and ``logits/rejected`` (means of ``[B, S, V]``
logits, padding included, that the fused head never forms).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from effijax.models import gpt_config
  >>> mask = jnp.broadcast_to(jnp.arange(6) >= 3, (4, 6))  # each row's completion
  >>> sequence_mask(mask)[0].astype(int).tolist()  # the prompt and the completion
  [1, 1, 1, 1, 1, 1]
  >>> rows = jnp.arange(24, dtype=jnp.int32).reshape(4, 6)  # chosen, rejected, chosen, ...
  >>> model = gpt_config("tiny")
  >>> loss = ORPO.loss(model, None)
  >>> value, metrics = loss(model.init_params(jax.random.key(0)),
  ...                       {"inputs": rows, "targets": rows + 1, "mask": mask})
  >>> bool(metrics["nll_loss"] < value)  # the NLL less beta x a negative log-sigmoid
  True
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from effijax import lora as lora_lib
from effijax.objectives import orpo_loss
from effijax.recipe._objective import Objective
from effijax.recipe._pairs import (
    PAIR_METRICS,
    check_pair_loss,
    load_pairs,
    pair_batch,
    pair_eval_batches,
    policy_logps,
)

__all__ = ["ORPO", "sequence_mask"]


def sequence_mask(mask_BS: jax.Array) -> jax.Array:
    """Every target of each row up to its last trained one (the prompt and the completion, not
    the padding after them), bool ``[B, S]``.

    Example:
      >>> import jax.numpy as jnp
      >>> sequence_mask(jnp.array([[0, 0, 1, 1, 0, 0], [0, 1, 0, 1, 1, 0]])).astype(int).tolist()
      [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]
    """
    marked_BS = jnp.asarray(mask_BS).astype(jnp.bool_).astype(jnp.int32)
    return jax.lax.cummax(marked_BS, axis=1, reverse=True) > 0


def _orpo_loss(model, lora, *, sequence_parallel: bool = True, **settings):
    """ORPO's loss of interleaved pair rows (``settings``: :func:`orpo_loss`'s ``beta``): the
    policy alone, no reference."""
    pair_loss = functools.partial(orpo_loss, **settings)
    check_pair_loss(pair_loss, nll=jax.ShapeDtypeStruct((), jnp.float32))
    policy = policy_logps(model, lora, sequence_parallel=sequence_parallel)

    def loss(params, batch, rng=None):
        if "segments" in batch:  # pair rows are one sequence each
            raise ValueError("orpo: pair rows carry no segments (one sequence per row)")
        rows = batch["inputs"].shape[0]
        mask_BS = jnp.asarray(batch["mask"]).astype(jnp.bool_)
        # The rows, then the chosen rows again with their whole sequence marked: one pass.
        both = {"inputs": jnp.concatenate([batch["inputs"], batch["inputs"][0::2]]),
                "targets": jnp.concatenate([batch["targets"], batch["targets"][0::2]]),
                "mask": jnp.concatenate([mask_BS, sequence_mask(mask_BS)[0::2]])}
        logps_R, counts_R = policy(params, both, rng)
        logps_B, counts_B = logps_R[:rows], counts_R[:rows]
        # TRL's nn.CrossEntropyLoss over the chosen rows' sequences: the mean over their tokens.
        tokens = jnp.maximum(jnp.sum(counts_R[rows:]), 1).astype(jnp.float32)
        nll = -jnp.sum(logps_R[rows:]) / tokens
        return pair_loss(logps_B[0::2], logps_B[1::2], counts_B[0::2], counts_B[1::2], nll=nll)

    return loss if lora is None else lora_lib.freeze_base(loss)


ORPO = Objective("orpo", _orpo_loss, batch=pair_batch, eval_batches=pair_eval_batches,
                 load=load_pairs, metric=None, token_mean=False, eval_metrics=PAIR_METRICS)
