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

With ``precompute_reference`` (``--precompute-reference``, TRL's ``precompute_ref_log_probs``)
the reference's log-probability of every training and validation row is computed once, before
the first step (:func:`precompute_reference`: the starting weights in full training, the base
with the adapters off under LoRA), and rides in the batches as the f32 row value
``batch["reference_logps"]``: a full fine-tune then holds no reference copy at all, and no step
runs the reference's forward. The values are written to the run directory
(:data:`REFERENCE_FILE`) and a resumed run reads them back rather than computing them again,
so it trains against the very same numbers (its starting weights are no longer in memory).

Its metrics are TRL's (``rewards/chosen``, ..., ``logps/rejected``). SimPO and ORPO
(:mod:`effijax.recipe._simpo`, :mod:`effijax.recipe._orpo`) train on the same pairs without a
reference.
"""

from __future__ import annotations

import functools
import io
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from effijax import atomic, distributed
from effijax.data import packed_batch
from effijax.distributed import global_batch, process_rows
from effijax.errors import ConfigError
from effijax.objectives import dpo_loss
from effijax.precision import cast_floating
from effijax.recipe._objective import Objective, with_reference
from effijax.recipe._pairs import (
    PAIR_METRICS,
    REFERENCE_LOGPS,
    ScoredPairs,
    check_pair_loss,
    completion_window,
    load_pairs,
    pair_batch,
    pair_eval_batches,
    policy_logps,
)
from effijax.sharding import ShardedStep, batch_sharding, replicated

__all__ = ["DPO", "REFERENCE_FILE", "precompute_reference"]

# Where a run with --precompute-reference keeps its reference log-probabilities (in its run
# directory): the arrays "train" and "val" (f32, one per row) and the data's "fingerprint".
REFERENCE_FILE = "reference_logps.npz"


def _dpo_loss(model, lora, *, sequence_parallel: bool = True, beta: float = 0.1,
              loss_type: str = "sigmoid", label_smoothing: float = 0.0,
              window: int | None = None, precompute_reference: bool = False):
    """DPO's loss of interleaved pair rows against the reference (see the module docstring;
    ``window``: :func:`~effijax.recipe._pairs.completion_window`; ``precompute_reference``:
    the reference's log-probabilities are the batch's ``"reference_logps"``)."""
    settings = {"beta": beta, "loss_type": loss_type, "label_smoothing": label_smoothing}
    check_pair_loss(lambda c, r, nc, nr: dpo_loss(c, r, c, r, chosen_counts=nc,
                                                  rejected_counts=nr, **settings))
    policy = policy_logps(model, lora, sequence_parallel=sequence_parallel, window=window)

    def body(params, batch, rng, reference):
        rows = {k: v for k, v in batch.items() if k not in ("reference", REFERENCE_LOGPS)}
        logps_B, counts_B = policy(params, rows, rng)
        if precompute_reference:
            ref_B = batch[REFERENCE_LOGPS]
        else:
            ref_B = jax.lax.stop_gradient(policy(reference, rows)[0])  # no dropout
        return dpo_loss(logps_B[0::2], logps_B[1::2], ref_B[0::2], ref_B[1::2],
                        chosen_counts=counts_B[0::2], rejected_counts=counts_B[1::2], **settings)

    return with_reference(body, lora, needed=not precompute_reference)


def precompute_reference(job, rows, *, params=None, frozen=None,
                         window: int | None = None) -> np.ndarray:
    """The reference's summed log-probability of each row's completion (f32 ``[N]``): DPO's
    ``--precompute-reference``, as the step would compute it against the reference.

    Args:
      job: a DPO :class:`~effijax.recipe.Job` (its model, LoRA spec, policy and mesh).
      rows: :class:`~effijax.data.Packed` pair rows (:func:`~effijax.recipe._pairs.pair_rows`).
      params: full training: the starting weights (the state's parameters before the first
        step), scored in the compute dtype as the reference copy holds them; under LoRA: the
        fresh adapters (only their shapes and dtypes count: the reference has them off).
      frozen: under LoRA, the job's frozen base.
      window: the loss's ``window`` (:func:`~effijax.recipe._pairs.completion_window`).

    The rows go through in the job's global batches (the last one padded by repeats), laid
    out as its training batches.

    Example:
      >>> import numpy as np, optax
      >>> from effijax.data import Packed
      >>> from effijax.models import gpt_config
      >>> from effijax.recipe import init_state, plan_job
      >>> model = gpt_config("tiny", seq_len=8)
      >>> job = plan_job(model, "fp32", optax.sgd(0.1), batch_size=2, masked=True,
      ...                objective=DPO)
      >>> tokens = np.arange(27, dtype=np.int32).reshape(3, 9)
      >>> rows = Packed(tokens, (np.arange(9) >= 5).astype(np.int32)[None].repeat(3, 0))
      >>> precompute_reference(job, rows, params=init_state(job).params).shape
      (3,)
    """
    policy = policy_logps(job.model, job.lora, sequence_parallel=job.sequence_parallel,
                          window=window)

    def scored(p, base, b):  # cast in the program: no compute-dtype copy is held beside p
        if job.lora is None:
            reference = cast_floating(p, job.policy.compute_dtype)
        else:
            reference = {"base": base, "adapters": jax.tree.map(
                jnp.zeros_like, job.policy.cast_to_compute(p))}
        return policy(reference, b)[0]

    sharding = batch_sharding(job.mesh)
    score = ShardedStep(jax.jit(scored, out_shardings=replicated(job.mesh)), job.mesh)
    size = job.batch_size
    index, count = process_rows(sharding, size)
    local = slice(index * size // count, (index + 1) * size // count)
    n = len(rows)
    order = np.minimum(np.arange(-(-n // size) * size), n - 1)
    found = []
    for start in range(0, len(order), size):
        picked = order[start:start + size][local]
        out = score(params, frozen, global_batch(packed_batch(rows, picked), sharding, size))
        found.append(np.asarray(out.addressable_data(0), np.float32))
    return np.concatenate(found)[:n] if found else np.zeros((0,), np.float32)


def _prepare(settings: dict, job, data, *, params, frozen, out: str, resumed: bool):
    """The run's pairs scored by the reference (:class:`ScoredPairs`): computed now and written
    to ``out``'s :data:`REFERENCE_FILE`, or read back from it when the run resumes."""
    path = Path(out) / REFERENCE_FILE
    if resumed:
        found = _read_reference(path, data)
    else:
        found = {name: precompute_reference(job, rows, params=params, frozen=frozen,
                                            window=settings.get("window"))
                 for name, rows in (("train", data.train), ("val", data.val))}
        if distributed.is_main():
            _write_reference(path, found, data.fingerprint)
    note = (f"{data.note}; the reference's log-probabilities of its "
            f"{len(data.train) + len(data.val)} rows "
            f"{'read from' if resumed else 'precomputed into'} {path.name}")
    return data._replace(train=ScoredPairs(data.train, found["train"]),
                         val=ScoredPairs(data.val, found["val"]), note=note)


def _write_reference(path: Path, found: dict, fingerprint: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    np.savez(buffer, train=found["train"], val=found["val"], fingerprint=np.str_(fingerprint))
    atomic.write_bytes(path, buffer.getvalue())  # whole or absent, never through a link


def _read_reference(path: Path, data) -> dict:
    """A resumed run's stored reference log-probabilities, checked against its data."""
    if not path.is_file():
        raise ConfigError("precompute_reference", True, f"the run in {path.parent} was "
                          f"started without it, so it stored no reference log-probabilities "
                          f"({path.name}); resume it without --precompute-reference")
    with np.load(path, allow_pickle=False) as stored:
        found = {name: stored[name] for name in ("train", "val")}
        fingerprint = str(stored["fingerprint"])
    if fingerprint != data.fingerprint or any(
            found[name].shape != (len(rows),) for name, rows in (("train", data.train),
                                                                 ("val", data.val))):
        raise ConfigError("precompute_reference", True, f"{path} holds the reference "
                          "log-probabilities of other pairs than --data's; start a new run "
                          "(another --out)")
    return found


def _configure(dpo: Objective, settings: dict) -> Objective:
    """``dpo`` as its settings make it: with ``precompute_reference``, no reference held and
    its log-probabilities a row value that :func:`_prepare` fills."""
    if not settings.get("precompute_reference"):
        return dpo
    return dpo._replace(reference=False, row_values=(REFERENCE_LOGPS,), configure=None,
                        prepare=functools.partial(_prepare, settings))


DPO = Objective("dpo", _dpo_loss, batch=pair_batch, eval_batches=pair_eval_batches,
                load=load_pairs, metric=None, token_mean=False, reference=True,
                eval_metrics=PAIR_METRICS, data_settings=completion_window,
                configure=_configure)
