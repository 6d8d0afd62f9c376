"""Rotary position embeddings (Hugging Face's rotate-half layout), for every rotary family.

A rotary family's :class:`~effijax.models._decoder.Decoder` computes the ``cos``/``sin`` tables
(:func:`rope_tables`, cached per shape) in its ``embed_positions`` hook, takes the rows at the
tokens' positions for packed rows and decoding, and hands them to its layers in
``LayerInputs.positions``; :class:`RotaryAttention` rotates the queries and keys with them.
Llama 3's frequency scaling is one rule, :func:`inv_freq`'s; :func:`rope_factors` gives what it
divides each frequency by (llama.cpp stores that as a tensor) and :func:`llama3_scaling` the
scaling's numbers back from those factors.

Shape suffixes: ``B`` batch, ``S`` sequence, ``H`` heads, ``K`` head width.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from effijax.errors import NO_VALUE, ConfigError
from effijax.models._decoder import Attention
from effijax.models._dense import cpu_layout

__all__ = ["RotaryAttention", "inv_freq", "rope", "rope_factors", "llama3_scaling", "rope_tables",
           "rope_positions"]


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


def rope_factors(head_dim: int, theta: float, scaling: tuple) -> np.ndarray:
    """What ``scaling`` divides each rotary frequency by, ``[K/2]`` in f64: the unscaled
    :func:`inv_freq` over the scaled one. For Llama 3's scaling these are the values llama.cpp
    stores as the tensor ``rope_freqs.weight`` (1 for short wavelengths, ``factor`` for long
    ones, between them in between).

    Example:
      >>> rope_factors(8, 10000.0, (4.0, 1.0, 4.0, 1000)).round(4).tolist()  # wavelengths 2π·10^i
      [1.0, 1.0, 2.5133, 4.0]
    """
    return inv_freq(head_dim, theta) / inv_freq(head_dim, theta, scaling)


# How far a factor read back may sit from the one recomputed: f32 storage (2^-24), plus the few
# ulps llama.cpp's converter adds by computing the frequencies in f32 (measured: at most 4.6 ulps
# for Llama 3.1's and 3.2's shapes); a value changed by more than this is not Llama 3's.
_FACTOR_RTOL = 1e-6


def llama3_scaling(factors, head_dim: int, theta: float, *,
                   name: str = "factors") -> tuple | None:
    """Llama 3's ``(factor, low_freq_factor, high_freq_factor, original_max_position)`` whose
    :func:`rope_factors` are ``factors`` (``[K/2]``, e.g. llama.cpp's ``rope_freqs.weight``);
    None when every factor is 1 (no frequency changes).

    ``factor`` is the largest value. A value between 1 and ``factor`` is
    ``1 / ((1 - s) / factor + s)`` with ``s`` linear in the frequency, which fixes
    ``original / (high - low)`` and ``low / (high - low)``; only those two ratios matter, so
    ``low_freq_factor`` is taken as 1 and the others follow (``original`` rounded to a whole
    number, ``high`` to the fewest decimals that still reproduce ``factors``). The numbers found
    are then put through :func:`rope_factors` and must give ``factors`` back to f32 rounding.

    Raises:
      ConfigError: named ``name``: a length other than ``head_dim / 2``, a value that is not a
        positive finite number, fewer than two values between 1 and ``factor`` (the four
        numbers are then not determined), or factors that no Llama 3 scaling gives (saying
        where the closest one differs).

    Example:
      >>> llama3_scaling(rope_factors(128, 500000.0, (8.0, 1.0, 4.0, 8192)), 128, 500000.0)
      (8.0, 1.0, 4.0, 8192)
      >>> llama3_scaling(rope_factors(32, 1e3, (4.0, 2.0, 8.0, 64)), 32, 1e3)  # the same ratios
      (4.0, 1.0, 4.0, 32)
    """
    values = np.asarray(factors, np.float64)
    if values.shape != (head_dim // 2,):
        raise ConfigError(name, NO_VALUE, f"has shape {values.shape}; expected "
                          f"({head_dim // 2},): one factor per rotary frequency (head_dim "
                          f"{head_dim} / 2)")
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise ConfigError(name, NO_VALUE, "holds a value that is not a positive finite number")
    if (values == 1).all():
        return None
    factor = float(str(np.float32(values.max())))  # the shortest decimal of the f32: 8.0
    between = (values > 1) & (values < factor)
    if between.sum() < 2:
        raise ConfigError(name, NO_VALUE, f"has {int(between.sum())} value(s) between 1 and its "
                          f"factor {factor}; two are needed to determine Llama 3's scaling")
    # s = (original / wavelength - low) / (high - low): a line in 1 / wavelength.
    per_wavelength = inv_freq(head_dim, theta)[between] / (2 * math.pi)
    s = (1 / values[between] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(per_wavelength, s, 1)  # original / (high - low), -low / (...)
    best = None  # (relative error, scaling, frequency where it is largest, its factor there)
    if slope > 0 and intercept < 0:
        high, original = float(1 - 1 / intercept), int(round(slope / -intercept))
        for rounded in sorted({round(high, d) for d in range(7)} | {high},
                              key=lambda h: (len(repr(h)), h)):
            if rounded <= 1 or original < 1:
                continue
            scaling = (factor, 1.0, rounded, original)
            ours = rope_factors(head_dim, theta, scaling)
            error = np.abs(ours - values) / values
            worst = int(np.argmax(error))
            if error[worst] <= _FACTOR_RTOL:
                return scaling
            if best is None or error[worst] < best[0]:
                best = (error[worst], scaling, worst, ours[worst])
    where = ("its values between 1 and the factor do not fall on Llama 3's curve" if
             best is None else f"the closest, {best[1]}, gives {best[3]:.7g} at frequency "
             f"{best[2]} where it has {values[best[2]]:.7g}")
    raise ConfigError(name, NO_VALUE, f"is not Llama 3's rotary scaling of theta {theta:g}, "
                      f"head_dim {head_dim}: {where}")


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

    The tables get no gradient. On a CPU, 16-bit ``x``
    (:func:`~effijax.models._dense.cpu_layout`) takes a hand-written backward: the rotation's
    transpose applied to the cotangent, ``d cos - rotate_half(d sin)``, in f32 as autodiff's. The
    same products and sums, but XLA:CPU ran autodiff's form (its pads and slices of the halves)
    about 10x slower: 2.6 ms instead of 0.25 for SmolLM2's queries at 4 x 512 tokens, about
    0.15 s of a 6 s bf16 LoRA step. The forward is the same op; the gradient agrees with
    autodiff's to within one rounding of the 16-bit result (XLA may fuse a product and a sum
    into one rounding in either). f32 keeps autodiff, bit for bit.

    Example:
      >>> import jax.numpy as jnp
      >>> cos, sin = (jnp.asarray(t) for t in rope_tables(4, 10000.0, None, 2))
      >>> rope(jnp.ones((1, 2, 1, 4)), cos, sin)[0, 0, 0].tolist()  # position 0: unchanged
      [1.0, 1.0, 1.0, 1.0]
    """
    if cpu_layout(x_BSHK.dtype):
        return _rope_16(x_BSHK, cos_SK, sin_SK)
    return _rotate(x_BSHK, cos_SK, sin_SK)


def _rotate(x_BSHK: jax.Array, cos_SK: jax.Array, sin_SK: jax.Array) -> jax.Array:
    x = x_BSHK.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x * cos_SK[..., None, :] + rotated * sin_SK[..., None, :]
    return out.astype(x_BSHK.dtype)


@jax.custom_vjp
def _rope_16(x_BSHK: jax.Array, cos_SK: jax.Array, sin_SK: jax.Array) -> jax.Array:
    return _rotate(x_BSHK, cos_SK, sin_SK)


def _rope_16_fwd(x_BSHK, cos_SK, sin_SK):
    return _rotate(x_BSHK, cos_SK, sin_SK), (cos_SK, sin_SK)


def _rope_16_bwd(residuals, dout_BSHK):
    # rotate_half's transpose is -rotate_half: the first half of x reaches the second half of
    # the output (times +sin), the second half the first (times -sin).
    cos_SK, sin_SK = residuals
    d = dout_BSHK.astype(jnp.float32)
    half = d.shape[-1] // 2
    ds = d * sin_SK[..., None, :]
    dx = d * cos_SK[..., None, :] + jnp.concatenate([ds[..., half:], -ds[..., :half]], axis=-1)
    return dx.astype(dout_BSHK.dtype), None, None


_rope_16.defvjp(_rope_16_fwd, _rope_16_bwd)


class RotaryAttention(Attention):
    """:class:`~effijax.models._decoder.Attention` whose queries and keys are rotated by the
    ``(cos, sin)`` tables in ``LayerInputs.positions``."""

    def rotate(self, q_BSHK: jax.Array, k_BSGK: jax.Array, positions) -> tuple:
        cos_SK, sin_SK = positions
        return rope(q_BSHK, cos_SK, sin_SK), rope(k_BSGK, cos_SK, sin_SK)
