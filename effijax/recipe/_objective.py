"""What a training objective provides, and the first one: next-token cross-entropy (``sft``).

The step (:func:`~effijax.step.make_sharded_step`) is generic over ``loss(params, batch,
rng)``; an :class:`Objective` says the rest of what a run needs from its objective: the loss
and its metrics from the model (and the LoRA spec, whose frozen base rides in the batch as
``"base"``; a full fine-tune's reference copy rides as ``"reference"``), how its data is read,
how a training batch is drawn from it, its fixed evaluation batches, and how their losses
average. :func:`~effijax.recipe.plan_job` takes one (default :data:`SFT`);
``TrainConfig.objective`` names one of
:data:`effijax.recipe._objectives.OBJECTIVES`. Adding an objective is one module defining its
:class:`Objective` and one line in that registry; the preference objectives (``dpo``,
``simpo``, ``orpo``) share their pair data (:mod:`effijax.recipe._pairs`); ``grpo`` samples its
batches from the policy in the loop (:mod:`effijax.recipe._grpo`). An objective's settings may
make another of it (:attr:`Objective.configure`, what ``plan_job`` plans with), which may
prepare its data once before the first step (:attr:`Objective.prepare`): DPO with
``--precompute-reference`` (:mod:`effijax.recipe._dpo`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from effijax import lora as lora_lib
from effijax.data import batch_at, eval_batches

__all__ = ["Objective", "SFT", "ROLLOUT_METRICS", "ROLLOUT_SAMPLES", "COMPLETIONS",
           "with_reference"]

# Where a sampled batch (Objective.rollout) carries its rollout's host-side statistics: never an
# input of the step; the loop adds them to the step's metrics.
ROLLOUT_METRICS = "rollout_metrics"
# Where those statistics carry a few of the rollout's rows (one JSON-ready record with its
# ``step``): never a metric; the loop appends it to the run directory's COMPLETIONS file.
ROLLOUT_SAMPLES = "rollout_samples"
COMPLETIONS = "completions.jsonl"


class Objective(NamedTuple):
    """A training objective (see the module docstring).

    Attributes:
      name: its ``--objective`` name.
      loss: ``loss(model, lora, *, sequence_parallel, **settings) -> fn(params, batch, rng) ->
        (value, metrics)``: with ``lora``, ``params`` are the adapters and the frozen base is
        ``batch["base"]`` (:func:`effijax.lora.freeze_base`).
      batch: ``batch(data, *, seed, step, batch_size, seq_len, process_index, process_count)
        -> dict``: this process' rows of the training batch of ``step`` (a pure function of
        ``(seed, step)``), as :func:`effijax.data.batch_at`.
      eval_batches: ``eval_batches(data, *, batch_size, seq_len, num_batches, process_index,
        process_count) -> Sequence[dict]``: fixed validation batches, as
        :func:`effijax.data.eval_batches`.
      load: ``load(path, model) -> Dataset``: the run's training and validation data from
        ``--data`` (:func:`effijax.recipe._pairs.load_pairs`); None: text or chat data as
        :func:`effijax.sources.load_dataset` reads it.
      metric: the name of the unmultiplied loss among the step's metrics (None: only the
        step's ``loss``).
      token_mean: the validation loss of masked rows weights each batch by its trained tokens
        (a per-token loss); False: each batch alike (a per-pair loss).
      reference: the loss compares the policy with a frozen reference model (``dpo``): under
        LoRA the base with the adapters off (no copy), in full training a frozen copy of the
        starting weights that rides in every batch as ``batch["reference"]`` (see
        :func:`~effijax.recipe.plan_job`); the others need none.
      eval_metrics: the loss's metrics that evaluation averages over the validation batches
        besides the loss (recorded as ``eval_<name>``; TRL's ``eval_rewards/accuracies``, ...).
      rollout: for an objective that samples its batches from the policy (``grpo``):
        ``rollout(model, lora, *, policy, **settings) -> draw``, where ``draw(data, *, params,
        frozen, seed, step, batch_size, process_index, process_count) -> dict`` builds step
        ``step``'s rows from the train state's current ``params`` (and the job's frozen tree);
        it replaces ``batch``, and :func:`~effijax.recipe.batch_fn` then needs the parameters
        (nothing can be built ahead of the step before). A draw that keeps rows across steps
        also has ``carried(step) -> {name: {key: array}}`` (saved with a checkpoint after
        ``step``) and ``resume(extra, *, seed, step, batch_size, where)`` (given them back on
        resume): GRPO's :class:`~effijax.recipe._grpo.Draw`. None: batches are data alone.
      row_values: the names of the f32 ``[B]`` arrays its batches carry besides the tokens
        (GRPO's ``advantages``), sharded by rows.
      token_values: the names of the f32 ``[B, S]`` arrays its batches carry, a value per
        position of each row (GRPO's ``old_logps`` when a rollout serves several updates),
        sharded by rows.
      load_settings: the settings ``load`` takes besides the path and the model (GRPO's
        ``max_completion_length``, which bounds its prompts).
      check: ``check(**settings)`` raises a :class:`~effijax.errors.ConfigError` for what only
        the library can check (GRPO's rewards: their modules imported), before the run reads
        any weights or data; None: the config's checks are all.
      data_settings: ``data_settings(dataset) -> dict``: settings of its loss that its data
        decides, added to the user's (the pair losses' ``window``: the longest span of a row's
        trained positions, all the head needs to score); None: none.
      configure: ``configure(objective, settings) -> Objective``: ``objective`` (this one) as
        these settings make it, which :func:`~effijax.recipe.plan_job` plans with (DPO with
        ``precompute_reference``: no reference held, its log-probabilities a row value of the
        batches), built from the objective it is given (so that a registry entry's own
        replacements, e.g. a test's slower batches, carry over); None: itself.
      prepare: ``prepare(job, data, *, params, frozen, out, resumed) -> Dataset``: what the
        run does to its data once, before its first step, with the job's starting ``params``
        and ``frozen`` tree (DPO with ``precompute_reference``: the reference's log-probability
        of every row, stored in the run directory ``out`` and read back when ``resumed``);
        None: nothing.

    ``reference`` may also be a function of the objective's settings (GRPO holds a reference
    only for a KL penalty, ``beta > 0``); ``eval_batches`` None: the objective has no
    validation loss (the run evaluates nothing).
    """

    name: str
    loss: Callable[..., Callable]
    batch: Callable[..., dict] = batch_at
    eval_batches: Callable[..., Any] = eval_batches
    load: Callable[..., Any] | None = None
    metric: str | None = None
    token_mean: bool = True
    reference: bool | Callable[[dict], bool] = False
    eval_metrics: tuple[str, ...] = ()
    rollout: Callable[..., Callable] | None = None
    row_values: tuple[str, ...] = ()
    token_values: tuple[str, ...] = ()
    load_settings: tuple[str, ...] = ()
    check: Callable[..., None] | None = None
    data_settings: Callable[[Any], dict] | None = None
    configure: Callable[[dict], Objective] | None = None
    prepare: Callable[..., Any] | None = None

    def configured(self, settings: dict | None = None) -> Objective:
        """The objective as ``settings`` make it (:attr:`configure`; itself without one).

        Example:
          >>> SFT.configured({}) is SFT
          True
        """
        return self if self.configure is None else self.configure(self, dict(settings or {}))

    def needs_reference(self, settings: dict | None = None) -> bool:
        """Whether a full fine-tune with these settings holds a reference copy."""
        if callable(self.reference):
            return bool(self.reference(dict(settings or {})))
        return bool(self.reference)


def _sft_loss(model, lora, *, sequence_parallel: bool = True):
    """The model's masked mean cross-entropy (``lm_loss``) and its ``accuracy``."""
    if lora is None:
        return model.loss_fn(sequence_parallel=sequence_parallel)
    return lora_lib.freeze_base(model.loss_fn(lora, sequence_parallel=sequence_parallel,
                                              frozen_base=True))


def with_reference(body: Callable, lora, *, needed: bool = True) -> Callable:
    """``loss(params, batch, rng=None)`` of an objective that compares the policy with a
    reference (DPO; GRPO's KL penalty), from ``body(params, batch, rng, reference)``: in full
    training ``reference`` is the frozen copy of the starting weights the batch carries
    (``batch["reference"]``); under LoRA (``lora``: its spec) the same frozen base with the
    adapters zeroed, through the same function (their products are exact zeros), so the
    reference's arithmetic is the policy's own base arithmetic (on a CPU, a 16-bit base's kept
    bits) and policy == reference at the adapters' init (B = 0) bit for bit, with no second
    copy of the base; None when not ``needed``. The body runs the reference without dropout
    and without gradient; under LoRA the loss is :func:`effijax.lora.freeze_base`'s.
    """
    if lora is None:
        def full_loss(params, batch, rng=None):
            return body(params, batch, rng, batch["reference"] if needed else None)

        return full_loss

    def loss(params, batch, rng=None):
        off = None if not needed else {
            "base": params["base"],
            "adapters": jax.tree.map(jnp.zeros_like, params["adapters"])}
        return body(params, batch, rng, off)

    return lora_lib.freeze_base(loss)


# Next-token cross-entropy over the data's tokens (the trained positions of masked rows).
SFT = Objective("sft", _sft_loss, metric="lm_loss")
