"""Rotary position embeddings (Hugging Face's rotate-half layout), for every rotary family.

A rotary family's :class:`~effijax.models._decoder.Decoder` computes the ``cos``/``sin`` tables
(:func:`rope_tables`, cached per shape) in its ``embed_positions`` hook, takes the rows at the
tokens' positions for packed rows and decoding, and hands them to its layers in
``LayerInputs.positions``; :class:`RotaryAttention` rotates the queries and keys with them.

Shape suffixes: ``B`` batch, ``S`` sequence, ``H`` heads, ``K`` head width.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from effijax.models._decoder import Attention

__all__ = ["RotaryAttention", "inv_freq", "rope", "rope_tables", "rope_positions"]


def inv_freq(head_dim: int, theta: float, scaling: tuple | None = None) -> np.ndarray:
    """Rotary frequencies ``[K/2]`` in f64, with Llama 3.1's ``scaling`` (``(factor,
    low_freq_factor, high_freq_factor, original_max_position)``) or linear scaling (``(factor,)``:
    every frequency divided by ``factor``, Gemma 3's global layers) when given.

    Example:
      >>> inv_freq(4, 10000.0).tolist(), inv_freq(4, 10000.0, (8.0,)).tolist()
      ([1.0, 0.01], [0.125, 0.00125])
    """
    freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return freq
    if len(scaling) == 1:
        return freq / scaling[0]
    factor, low, high, original = scaling
    # Wavelengths longer than the original context are slowed by ``factor``, shorter than
    # original / high kept, and those between interpolated (Hugging Face's llama3 rope type).
    wavelen = 2 * math.pi / freq
    scaled = np.where(wavelen > original / low, freq / factor, freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return np.where(medium, smoothed, scaled)


@functools.lru_cache(maxsize=16)
def rope_tables(head_dim: int, theta: float, scaling: tuple | None, s: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and ``sin`` tables ``[S, K]`` in f32 for positions ``0..S-1``.

    Angles are computed in f64 on the host: ``position · frequency`` in f32 is off by up to
    ``position · 2^-24`` radians, visible at long contexts. Both halves of a head share a
    frequency (Hugging Face's rotate-half layout).

    Example:
      >>> cos, sin = rope_tables(4, 10000.0, None, 3)
      >>> cos.shape, float(sin[1, 0]) == float(np.float32(np.sin(1.0)))
      ((3, 4), True)
    """
    angles_SK2 = np.arange(s, dtype=np.float64)[:, None] * inv_freq(head_dim, theta,
                                                                    scaling)[None, :]
    angles_SK = np.concatenate([angles_SK2, angles_SK2], axis=-1)
    return np.cos(angles_SK).astype(np.float32), np.sin(angles_SK).astype(np.float32)


def rope_positions(head_dim: int, theta: float, scaling: tuple | None, length: int,
                   positions_BS: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """The ``(cos, sin)`` tables a rotary family's layers take: ``[S, K]`` for positions
    ``0 .. length - 1`` shared by the rows, or, at per-row ``positions_BS`` (packed rows,
    decoding), their rows ``[B, S, K]``.

    Example:
      >>> import jax.numpy as jnp
      >>> cos, _ = rope_positions(4, 10000.0, None, 8, jnp.array([[3, 0]]))
      >>> cos.shape, float(cos[0, 1, 0])
      ((1, 2, 4), 1.0)
    """
    tables = tuple(jnp.asarray(t) for t in rope_tables(head_dim, theta, scaling, length))
    if positions_BS is not None:
        tables = tuple(jnp.take(t, positions_BS, axis=0) for t in tables)
    return tables


def rope(x_BSHK: jax.Array, cos_SK: jax.Array, sin_SK: jax.Array) -> jax.Array:
    """Rotates each head's two halves: ``x cos + rotate_half(x) sin``, in f32. The tables are
    ``[S, K]`` (shared by the rows) or ``[B, S, K]`` (per-row positions: packed rows, left-padded
    prompts).

    Example:
      >>> import jax.numpy as jnp
      >>> cos, sin = (jnp.asarray(t) for t in rope_tables(4, 10000.0, None, 2))
      >>> rope(jnp.ones((1, 2, 1, 4)), cos, sin)[0, 0, 0].tolist()  # position 0: unchanged
      [1.0, 1.0, 1.0, 1.0]
    """
    x = x_BSHK.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x * cos_SK[..., None, :] + rotated * sin_SK[..., None, :]
    return out.astype(x_BSHK.dtype)


class RotaryAttention(Attention):
    """:class:`~effijax.models._decoder.Attention` whose queries and keys are rotated by the
    ``(cos, sin)`` tables in ``LayerInputs.positions``."""

    def rotate(self, q_BSHK: jax.Array, k_BSGK: jax.Array, positions) -> tuple:
        cos_SK, sin_SK = positions
        return rope(q_BSHK, cos_SK, sin_SK), rope(k_BSGK, cos_SK, sin_SK)
