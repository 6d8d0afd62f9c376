"""The optimizer a :class:`~effijax.recipe.TrainConfig`'s sections choose.

One function, below everything that builds a state from a config: the run's own plan and the
abstract state of an ``model_from`` run's checkpoints both call it.
"""

from __future__ import annotations

from effijax.optimizers import make_optimizer
from effijax.recipe._sections import OptimizerSection, PrecisionSection, TrainingSection

__all__ = ["optimizer_for"]


def optimizer_for(training: TrainingSection, optimizer: OptimizerSection,
                  precision: PrecisionSection):
    """The optimizer a config's sections choose: ``optimizer``'s, with ``training``'s
    learning rate, warm-up, clipping and accumulation over its steps, and ``precision``'s loss
    scaling (:func:`effijax.optimizers.make_optimizer`).

    Example:
      >>> import jax.numpy as jnp
      >>> from effijax.recipe import TrainConfig
      >>> s = TrainConfig(model="tiny", steps=10).sections
      >>> opt = optimizer_for(s.training, s.optimizer, s.precision)
      >>> _ = opt.init({"w": jnp.zeros(2)})
    """
    k = training.accumulate
    scale = None if precision.loss_scale_mode == "none" else precision.loss_scale_mode
    return make_optimizer(training.lr, training.steps // k, optimizer=optimizer.optimizer,
                          schedule=optimizer.schedule, warmup_steps=training.warmup_steps // k,
                          lr_end=optimizer.lr_end, decay_fraction=optimizer.decay_fraction,
                          weight_decay=training.weight_decay, no_decay=optimizer.no_decay,
                          clip_norm=training.clip or None, **optimizer.hyperparameters,
                          loss_scale=scale, accumulate=k)
