"""Gradient accumulation that survives a non-finite micro-step.

``optax.MultiSteps`` (0.2.8) clears its accumulator with ``(1 - emit) * acc``; after an inf or
NaN micro-gradient that product is NaN (``0 * inf``), so the accumulator never recovers and a
loss-scaled run skips every later step. :func:`accumulate` is ``MultiSteps`` with that one
repair: at each effective-step boundary the accumulator is reset with ``jnp.where``. The state is
optax's own ``MultiStepsState``, so every tool that understands it (``loss_scale_of``,
checkpoints, sharding rules) keeps working.

Compose it *outside* the loss scaler: ``accumulate(dynamic_loss_scale(adamw), k)``. The scale is
then constant across the k micro-steps (only the effective step updates it), and one finiteness
check over the accumulated gradient decides the whole effective step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from effijax.errors import whole_number

__all__ = ["accumulate"]


def accumulate(inner: optax.GradientTransformation, every_k: int
               ) -> optax.GradientTransformationExtraArgs:
    """``optax.MultiSteps(inner, every_k)`` whose accumulator is reset even after an overflow.

    Args:
      inner: the transformation applied once per effective step (typically a loss-scaled
        optimizer).
      every_k: micro-steps per effective step (>= 1).

    Returns:
      A transformation whose state is an ``optax.MultiStepsState``. Updates are zero on the
      micro-steps and the inner update on every k-th.

    Raises:
      ConfigError: ``every_k`` is not an int >= 1.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from effijax.precision import dynamic_loss_scale
      >>> tx = accumulate(dynamic_loss_scale(optax.sgd(1.0), init_scale=1.0), 2)
      >>> s = tx.init({"w": jnp.zeros(1)})
      >>> _, s = tx.update({"w": jnp.array([jnp.inf])}, s)   # micro-step 1 overflows
      >>> u, s = tx.update({"w": jnp.array([1.0])}, s)        # the effective step is skipped
      >>> float(u["w"][0]), float(s.acc_grads["w"][0])        # and the accumulator is clean
      (0.0, 0.0)
      >>> _, s = tx.update({"w": jnp.array([1.0])}, s)
      >>> u, s = tx.update({"w": jnp.array([3.0])}, s)        # the next one applies
      >>> float(u["w"][0])
      -2.0
    """
    every_k = whole_number("every_k", every_k)  # micro-steps per step; 1 applies every step
    multi = optax.MultiSteps(inner, every_k_schedule=every_k)

    # optax's MultiSteps mixes f32 with int32 and int32 with bool, which strict dtype promotion
    # rejects; it runs under standard promotion, our repair does not need it.
    def init(params):
        with jax.numpy_dtype_promotion("standard"):
            return multi.init(params)

    def update(updates, state, params=None, **extra):
        with jax.numpy_dtype_promotion("standard"):
            updates, state = multi.update(updates, state, params, **extra)
        boundary = state.mini_step == 0
        acc = jax.tree.map(lambda a: jnp.where(boundary, jnp.zeros_like(a), a), state.acc_grads)
        return updates, state._replace(acc_grads=acc)

    return optax.GradientTransformationExtraArgs(init, update)
