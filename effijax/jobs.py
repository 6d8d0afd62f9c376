"""The language-model training job: GPT + offline corpus + policy + optimizer, assembled once.

``effijax train``, the experiments and the notebooks all train through :func:`build_lm_job`, so
a setting means the same thing everywhere. A job is a bundle of pure pieces: the initial
``TrainState``, the jitted (donating) step, ``batch(step)`` (a deterministic function of the
step) and ``evaluate(params)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from effijax.data import batch_at, eval_batches
from effijax.models import GPTConfig, abstract_split, init_params, make_apply, make_loss_fn
from effijax.precision import Policy, cross_entropy, get_policy
from effijax.train import TrainState, init_train_state, make_train_step

__all__ = ["LMJob", "build_lm_job"]


class LMJob(NamedTuple):
    """A ready-to-run training job (see :func:`build_lm_job`)."""

    state: TrainState
    step: Callable[[TrainState, Any], tuple[TrainState, dict]]
    batch: Callable[[int], dict]
    evaluate: Callable[[Any], float]
    tokens_per_step: int
    num_params: int


def build_lm_job(
    model: GPTConfig,
    policy: Policy | str,
    optimizer: optax.GradientTransformation,
    *,
    train_tokens: np.ndarray,
    val_tokens: np.ndarray,
    batch_size: int,
    seed: int = 0,
    num_eval_batches: int = 4,
    loss_multiplier: float = 1.0,
    allow_unscaled_fp16: bool = False,
) -> LMJob:
    """Assembles a GPT language-model training job on a byte corpus.

    Args:
      model: the GPT configuration (its ``seq_len`` is the training sequence length).
      policy: precision policy or preset name.
      optimizer: any optax transformation (see :func:`effijax.train.make_optimizer`).
      train_tokens, val_tokens: uint8 corpora (see :func:`effijax.data.split_corpus`).
      batch_size: global batch size (sequences per step).
      seed: seeds the parameters, the dropout keys and the batch order.
      num_eval_batches: fixed validation batches used by ``evaluate``.
      loss_multiplier: multiplies the training objective. Values far below 1 push gradients
        below fp16's range (the precision experiment uses 2^-16); the metric ``lm_loss``
        always reports the unmultiplied loss.
      allow_unscaled_fp16: see :func:`effijax.train.make_train_step`.

    Returns:
      An :class:`LMJob` whose ``step`` is jitted with the state donated.

    Example:
      >>> import numpy as np, optax
      >>> from effijax.models import gpt_config
      >>> toks = np.frombuffer(b"hello world " * 200, np.uint8)
      >>> job = build_lm_job(gpt_config("tiny", seq_len=16), "fp32", optax.adam(1e-3),
      ...                    train_tokens=toks, val_tokens=toks, batch_size=2)
      >>> state, metrics = job.step(job.state, job.batch(0))
      >>> int(state.step), bool(metrics["lm_loss"] > 4.0)
      (1, True)
    """
    policy = get_policy(policy)
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if not loss_multiplier > 0:
        raise ValueError(f"loss_multiplier must be > 0, got {loss_multiplier!r}")
    key_params, key_run = jax.random.split(jax.random.key(seed))
    params = init_params(model, policy, key_params)
    graphdef, _ = abstract_split(model, policy)
    lm_loss = make_loss_fn(graphdef)
    mult = jnp.float32(loss_multiplier)

    def loss_fn(p, batch, rng):
        loss, aux = lm_loss(p, batch, rng)
        return loss * mult, {"lm_loss": loss, **aux}

    step = jax.jit(
        make_train_step(loss_fn, optimizer, policy, has_aux=True,
                        allow_unscaled_fp16=allow_unscaled_fp16),
        donate_argnums=0,
    )
    state = init_train_state(params, optimizer, key_run)

    def batch(step_no: int) -> dict:
        return batch_at(train_tokens, seed=seed, step=step_no, batch_size=batch_size,
                        seq_len=model.seq_len)

    evals = eval_batches(val_tokens, batch_size=batch_size, seq_len=model.seq_len,
                         num_batches=num_eval_batches) if num_eval_batches else []
    apply = make_apply(graphdef)

    @jax.jit
    def eval_loss(p, b):
        logits = apply(policy.cast_to_compute(p), b["inputs"])
        return cross_entropy(logits, b["targets"])

    def evaluate(p) -> float:
        if not evals:
            raise ValueError("this job was built with num_eval_batches=0: nothing to evaluate")
        return float(np.mean([float(eval_loss(p, b)) for b in evals]))

    num_params = int(sum(x.size for x in jax.tree.leaves(params)))
    return LMJob(state, step, batch, evaluate, batch_size * model.seq_len, num_params)
