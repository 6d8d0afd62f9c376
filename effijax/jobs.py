"""A ready-to-run language-model job in one call, assembled from :mod:`effijax.recipe`'s pieces.

:func:`build_lm_job` is the convenience the experiments and notebooks use when they drive
:func:`effijax.run.train_loop` themselves: it plans the job (:func:`effijax.recipe.plan_job`),
creates its state and frozen base, and binds the batches and the evaluation to token arrays.
Everything here is a thin composition; the logic lives in :mod:`effijax.recipe._job`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import optax

from effijax.errors import ConfigError
from effijax.lora import LoraSpec
from effijax.models import LanguageModel
from effijax.precision import Policy
from effijax.recipe import (
    CompiledStep,
    abstract_state,
    batch_fn,
    compile_job,
    evaluate,
    init_frozen,
    init_state,
    plan_job,
)
from effijax.train import TrainState

__all__ = ["LMJob", "CompiledStep", "build_lm_job", "abstract_lm_state"]

abstract_lm_state = abstract_state  # the name this module used first


class LMJob(NamedTuple):
    """A ready-to-run training job (see :func:`build_lm_job`).

    Attributes:
      state: the initial ``TrainState`` (donated by the first ``step``).
      step: ``step(state, batch) -> (state, metrics)``, jitted, donating the state.
      batch: ``batch(step_no)``: the global batch of that step.
      evaluate: ``evaluate(params) -> float``: mean loss over the fixed validation batches.
      tokens_per_step: tokens in one global batch.
      num_params: parameters of the model.
      shardings: the ``NamedSharding`` of every state leaf.
      mesh: the mesh (a 1-device mesh when none was given).
      strategy: the strategy's name (None when no mesh was given).
      compile: ``compile(census=True) -> CompiledStep``.
      trainable_params: parameters that get gradients (``num_params`` without LoRA).
      lora: the job's :class:`~effijax.lora.LoraSpec` (None: full training).
      frozen: with LoRA, the frozen base parameters (what ``batch(step)["base"]`` holds).
    """

    state: TrainState
    step: Callable[[TrainState, Any], tuple[TrainState, dict]]
    batch: Callable[[int], dict]
    evaluate: Callable[[Any], float]
    tokens_per_step: int
    num_params: int
    shardings: Any = None
    mesh: Any = None
    strategy: str | None = None
    compile: Callable[..., CompiledStep] | None = None
    trainable_params: int = 0
    lora: LoraSpec | None = None
    frozen: Any = None


def build_lm_job(
    model: LanguageModel,
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
    mesh=None,
    strategy: str = "ddp",
    rules: Sequence[tuple] | None = None,
    lora: LoraSpec | None = None,
    base_params: Any = None,
    frozen_dtype: Any = None,
) -> LMJob:
    """Plans, initialises and binds a training job for any :class:`~effijax.models.LanguageModel`.

    Arguments are :func:`effijax.recipe.plan_job`'s, plus the token arrays
    (:func:`effijax.data.split_corpus`), ``num_eval_batches`` fixed validation batches, and
    ``base_params`` (with ``lora``: the frozen base, e.g. an earlier run's parameters; None
    initialises it from ``seed``).

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
    if lora is None and base_params is not None:
        raise ConfigError("base_params", "given", "belongs to LoRA jobs; pass lora=, or start a "
                          "full job from parameters with effijax.recipe.init_state(job, params)")
    job = plan_job(model, policy, optimizer, batch_size=batch_size, mesh=mesh,
                   strategy=strategy, rules=rules, lora=lora, frozen_dtype=frozen_dtype,
                   seed=seed, loss_multiplier=loss_multiplier,
                   allow_unscaled_fp16=allow_unscaled_fp16)
    frozen = init_frozen(job, base_params)

    def evaluate_params(params) -> float:
        if not num_eval_batches:
            raise ValueError("this job was built with num_eval_batches=0: nothing to evaluate")
        return evaluate(job, params, val_tokens, num_batches=num_eval_batches, frozen=frozen)

    return LMJob(init_state(job), job.step, batch_fn(job, train_tokens, frozen), evaluate_params,
                 job.tokens_per_step, job.num_params, shardings=job.shardings, mesh=job.mesh,
                 strategy=None if mesh is None else job.strategy.name,
                 compile=lambda census=True: compile_job(job, census=census),
                 trainable_params=job.trainable_params, lora=lora, frozen=frozen)
