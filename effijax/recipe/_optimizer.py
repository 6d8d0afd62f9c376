"""The optimizer a :class:`~effijax.recipe.TrainConfig` chooses.

One function, below everything that builds a state from a config: the run's own plan and the
abstract state of an ``init_from`` run's checkpoints both call it.
"""

from __future__ import annotations

from effijax.optimizers import make_optimizer
from effijax.recipe._config import TrainConfig

__all__ = ["optimizer_for"]


def optimizer_for(config: TrainConfig):
    """The optimizer the config chooses, with its warm-up and schedule, clipping, loss scaling
    and accumulation (:func:`effijax.optimizers.make_optimizer`).

    Example:
      >>> import jax.numpy as jnp
      >>> opt = optimizer_for(TrainConfig(model="tiny", steps=10))
      >>> _ = opt.init({"w": jnp.zeros(2)})
    """
    k = config.accumulate
    scale = None if config.loss_scale_mode == "none" else config.loss_scale_mode
    return make_optimizer(config.lr, config.steps // k, optimizer=config.optimizer,
                          schedule=config.schedule, warmup_steps=config.warmup_steps // k,
                          lr_end=config.lr_end, decay_fraction=config.decay_fraction,
                          weight_decay=config.weight_decay, no_decay=config.no_decay,
                          clip_norm=config.clip or None, **config.hyperparameters,
                          loss_scale=scale, accumulate=k)
