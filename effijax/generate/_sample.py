"""Choosing the next token from logits: greedy, temperature and nucleus (top-p) sampling.

A pure function of the logits, a ``jax.random`` key and two scalars, so it compiles into the
decoding step; the scalars are traced (changing them does not recompile). Temperature 0 is
greedy (argmax, no randomness). Otherwise the logits are divided by the temperature and, with
``top_p < 1``, restricted to the smallest set of most likely tokens whose probabilities sum to at
least ``top_p`` (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"); the most
likely token is always kept, so a tiny ``top_p`` is greedy.

Shape suffixes: ``B`` batch, ``V`` vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["sample", "top_p_mask"]


def top_p_mask(logits_BV: jax.Array, top_p: jax.Array) -> jax.Array:
    """The tokens nucleus sampling keeps: the smallest most-likely set with mass ``>= top_p``.

    A token is kept when the probability mass of the tokens ranked strictly above it is below
    ``top_p`` (ties in rank broken by id, as ``jnp.argsort`` does), so the top token always is.

    Example:
      >>> import jax.numpy as jnp
      >>> logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
      >>> top_p_mask(logits, jnp.float32(0.7)).tolist()
      [[True, True, False, False]]
      >>> top_p_mask(logits, jnp.float32(1e-6)).tolist()
      [[True, False, False, False]]
    """
    probs_BV = jax.nn.softmax(logits_BV.astype(jnp.float32), axis=-1)
    order_BV = jnp.argsort(-probs_BV, axis=-1, stable=True)
    sorted_BV = jnp.take_along_axis(probs_BV, order_BV, axis=-1)
    above_BV = jnp.cumsum(sorted_BV, axis=-1) - sorted_BV  # mass ranked strictly above
    keep_sorted_BV = above_BV < top_p
    keep_sorted_BV = keep_sorted_BV.at[:, 0].set(True)
    ranks_BV = jnp.argsort(order_BV, axis=-1)
    return jnp.take_along_axis(keep_sorted_BV, ranks_BV, axis=-1)


def sample(logits_BV: jax.Array, key: jax.Array, temperature: jax.Array,
           top_p: jax.Array) -> jax.Array:
    """The next token of each row (int32 ``[B]``).

    Args:
      logits_BV: next-token logits, any float dtype (computed in f32).
      key: a ``jax.random`` key (unused when greedy).
      temperature: 0 for greedy, else the softmax temperature (f32 scalar).
      top_p: nucleus mass in ``(0, 1]``; 1 keeps every token.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> logits = jnp.array([[0.0, 2.0, 1.0]])
      >>> sample(logits, jax.random.key(0), jnp.float32(0.0), jnp.float32(1.0)).tolist()
      [1]
      >>> sample(logits, jax.random.key(0), jnp.float32(1.0), jnp.float32(1e-6)).tolist()
      [1]
    """
    logits_BV = logits_BV.astype(jnp.float32)
    greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

    def draw(_):
        scaled_BV = logits_BV / jnp.maximum(temperature, jnp.float32(1e-6))
        kept_BV = jnp.where(top_p_mask(scaled_BV, top_p), scaled_BV, -jnp.inf)
        return jax.random.categorical(key, kept_BV, axis=-1).astype(jnp.int32)

    return jax.lax.cond(temperature > 0, draw, lambda _: greedy_B, None)
