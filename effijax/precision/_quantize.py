"""Quantized frozen kernels (QLoRA): NF4 or int8 codes with blockwise absmax scales.

A frozen base's kernel ``w`` (``[..., D, F]``, leading stack axes allowed) is stored as a
:class:`Quantized` pytree: 4-bit NF4 codes packed two to a byte (``uint8 [..., D, F/2]``) or int8
codes (``int8 [..., D, F]``), and one absmax scale per block of ``block`` (64, as in QLoRA)
consecutive outputs (``[..., D, F/block]``). Double quantization (QLoRA's, on by default) stores
those scales as int8 codes too, after subtracting the kernel's mean scale, with one f32 step per
256 scales along ``D`` (:class:`ScaleCodes`): 4 + 8/64 + 32/(64·256) = 4.127 bits per weight.
Every leaf keeps the kernel's rank, so a scan over the stacked layer axis slices one layer's
quantized kernel, :func:`dequantize` turns it into the compute dtype inside the step (no
full-precision copy of the base exists), and :func:`quantized_sharding` lays each leaf out like
its kernel under FSDP. The format is read from the leaves' dtypes, never stored as a flag.

The NF4 code book is computed, not copied (:data:`NF4_CODES`): QLoRA's 16 quantiles of N(0, 1),
8 for the positive half and 7 for the negative half plus an exact zero, normalized to [-1, 1].

Why not a library: Qwix (0.1.8) quantizes by intercepting Flax modules (its own model surgery
and ``QArray`` types) and aqtp (0.9.0) by injecting quantized dot_generals; neither gives a
plain pytree of packed NF4 codes with a standalone dequantize that the scanned layer stack, the
FSDP shardings and the adapter-only checkpoints can carry as an ordinary frozen input.
"""

from __future__ import annotations

import functools
import math
import statistics
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from effijax.errors import ConfigError
from effijax.paths import map_with_path
from effijax.precision._ggml import GGMLBlocks, dequantize_blocks, ggml_sharding

__all__ = ["NF4_CODES", "QUANTIZED_FORMATS", "Quantized", "ScaleCodes", "dequantize",
           "dequantize_kernels", "dequantized_shapes",
           "is_quantized", "quantize", "quantize_kernels", "quantized_bytes",
           "quantized_sharding", "is_quantizable"]

QUANTIZED_FORMATS = ("nf4", "int8")
BLOCK = 64  # weights per absmax scale (QLoRA)
SCALE_BLOCK = 256  # scales per f32 step under double quantization (QLoRA)


def _nf4_codes() -> np.ndarray:
    """QLoRA's NF4: equal-probability quantiles of N(0, 1), 8 positive, 7 negative and zero.

    The outermost quantile sits midway between the 1 - 1/(2·15) and 1 - 1/(2·16) probabilities
    of the two halves' grids, so that neither half's extreme is infinite.
    """
    normal = statistics.NormalDist()
    top = 0.5 * ((1 - 1 / 30) + (1 - 1 / 32))
    positive = [normal.inv_cdf(p) for p in np.linspace(top, 0.5, 9)[:-1]]
    negative = [-normal.inv_cdf(p) for p in np.linspace(top, 0.5, 8)[:-1]]
    codes = np.sort(np.array(positive + negative + [0.0]))
    return (codes / codes.max()).astype(np.float32)


NF4_CODES: np.ndarray = _nf4_codes()
# Decision boundaries between neighbouring codes: a value maps to the nearest code.
_NF4_MIDPOINTS = ((NF4_CODES[1:] + NF4_CODES[:-1]) / 2).astype(np.float32)


class ScaleCodes(NamedTuple):
    """Double-quantized absmax scales: ``offset + codes · steps`` (f32).

    ``codes`` int8 ``[..., D, F/block]``; ``steps`` f32 ``[..., D/b, F/block]`` (one per ``b``
    scales along ``D``, ``b = gcd(D, 256)``); ``offset`` f32 ``[..., 1, 1]``, the mean scale.
    """

    codes: jax.Array
    steps: jax.Array
    offset: jax.Array


class Quantized(NamedTuple):
    """A quantized kernel ``[..., D, F]``: the format and block follow from the leaves.

    ``codes``: ``uint8 [..., D, F/2]`` for NF4 (column ``2j`` in the low nibble, ``2j + 1`` in
    the high one) or ``int8 [..., D, F]`` for int8. ``scales``: f32 ``[..., D, F/block]`` (each
    block's absmax; int8's divided by 127) or their :class:`ScaleCodes`.
    """

    codes: jax.Array
    scales: Any

    @property
    def format(self) -> str:
        return "nf4" if self.codes.dtype == jnp.uint8 else "int8"

    @property
    def shape(self) -> tuple[int, ...]:
        width = self.codes.shape[-1] * (2 if self.format == "nf4" else 1)
        return (*self.codes.shape[:-1], width)

    @property
    def block(self) -> int:
        blocks = (self.scales.codes if isinstance(self.scales, ScaleCodes) else self.scales)
        return self.shape[-1] // blocks.shape[-1]


def is_quantized(x: Any) -> bool:
    """True for a quantized kernel (a pytree node, not an array): a :class:`Quantized` or a
    GGUF file's blocks kept as they are (:class:`~effijax.precision.GGMLBlocks`).

    Example:
      >>> import jax.numpy as jnp
      >>> is_quantized(quantize(jnp.ones((4, 64)), "nf4")), is_quantized(jnp.ones(2))
      (True, False)
    """
    return isinstance(x, (Quantized, GGMLBlocks))


def _check(shape: tuple[int, ...], fmt: str, path: str) -> None:
    if fmt not in QUANTIZED_FORMATS:
        raise ConfigError("format", fmt, f"choose one of {', '.join(QUANTIZED_FORMATS)}")
    if len(shape) < 2:
        raise ConfigError(path, tuple(shape), "only kernels of rank >= 2 ([..., D, F]) are "
                          "quantized; keep this one in a floating dtype")
    if fmt == "nf4" and shape[-1] % 2:
        raise ConfigError(path, tuple(shape), f"NF4 packs two columns a byte: the last axis "
                          f"({shape[-1]}) must be even; use int8 or a floating dtype")


def _blocks(x: jax.Array, block: int) -> jax.Array:
    """``x [..., F]`` as ``[..., F/block, block]``."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _double_quantize(scales: jax.Array) -> ScaleCodes:
    d = scales.shape[-2]
    b = math.gcd(d, SCALE_BLOCK)
    offset = jnp.mean(scales, axis=(-2, -1), keepdims=True)
    centred = (scales - offset).reshape(*scales.shape[:-2], d // b, b, scales.shape[-1])
    steps = jnp.max(jnp.abs(centred), axis=-2) / 127
    safe = jnp.where(steps == 0, 1.0, steps)
    codes = jnp.clip(jnp.round(centred / safe[..., None, :]), -127, 127).astype(jnp.int8)
    return ScaleCodes(codes.reshape(scales.shape), steps, offset)


def _scales_f32(scales) -> jax.Array:
    if not isinstance(scales, ScaleCodes):
        return scales
    d, n = scales.codes.shape[-2:]
    b = d // scales.steps.shape[-2]
    codes = scales.codes.reshape(*scales.codes.shape[:-2], d // b, b, n).astype(jnp.float32)
    return (scales.offset[..., None] + codes * scales.steps[..., None, :]).reshape(
        scales.codes.shape)


# Jitted: eagerly, each of the dozen small ops would compile on its own; inside a jit, inlined.
@functools.partial(jax.jit, static_argnames=("fmt", "block", "double_quant", "path"))
def quantize(w: jax.Array, fmt: str, *, block: int = BLOCK, double_quant: bool = True,
             path: str = "w") -> Quantized:
    """``w [..., D, F]`` quantized blockwise along ``F`` (block ``gcd(F, block)``).

    Args:
      w: a floating kernel (any leading stack axes).
      fmt: ``"nf4"`` (NF4 codes times each block's absmax) or ``"int8"`` (symmetric).
      block: weights per scale; a last axis it does not divide uses ``gcd(F, block)``.
      double_quant: store the scales as :class:`ScaleCodes` (QLoRA's double quantization).
      path: the parameter's path, for errors.

    Example:
      >>> import jax.numpy as jnp
      >>> w = jnp.asarray(NF4_CODES).reshape(1, 16) * 3.0  # on the code book, times a scale
      >>> q = quantize(w, "nf4", double_quant=False)
      >>> q.codes.dtype, q.codes.shape, q.scales.shape, bool(jnp.all(dequantize(q) == w))
      (dtype('uint8'), (1, 8), (1, 1), True)
    """
    _check(tuple(w.shape), fmt, path)
    block = math.gcd(w.shape[-1], block)
    x = _blocks(w.astype(jnp.float32), block)
    absmax = jnp.max(jnp.abs(x), axis=-1)
    safe = jnp.where(absmax == 0, 1.0, absmax)[..., None]
    if fmt == "nf4":
        idx = jnp.searchsorted(jnp.asarray(_NF4_MIDPOINTS), x / safe).astype(jnp.uint8)
        idx = idx.reshape(*w.shape[:-1], w.shape[-1] // 2, 2)
        codes, scales = idx[..., 0] | (idx[..., 1] << 4), absmax
    else:
        codes = jnp.clip(jnp.round(x / safe * 127), -127, 127).astype(jnp.int8)
        codes, scales = codes.reshape(w.shape), absmax / 127
    return Quantized(codes, _double_quantize(scales) if double_quant else scales)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize(q: Quantized | GGMLBlocks, dtype: Any = jnp.float32) -> jax.Array:
    """The kernel ``[..., D, F]`` a :class:`Quantized` (or a GGUF file's
    :class:`~effijax.precision.GGMLBlocks`) stands for, in ``dtype``.

    Example:
      >>> import jax.numpy as jnp
      >>> w = jnp.linspace(-1.0, 1.0, 128).reshape(2, 64)
      >>> q = quantize(w, "int8")
      >>> back = dequantize(q, jnp.bfloat16)
      >>> back.dtype, back.shape, bool(jnp.max(jnp.abs(back.astype(w.dtype) - w)) < 0.01)
      (dtype(bfloat16), (2, 64), True)
    """
    if isinstance(q, GGMLBlocks):
        return dequantize_blocks(q, dtype)
    shape = q.shape
    if q.format == "nf4":
        idx = jnp.stack([q.codes & 0xF, q.codes >> 4], axis=-1).reshape(shape)
        values = jnp.take(jnp.asarray(NF4_CODES), idx.astype(jnp.int32))
    else:
        values = q.codes.astype(jnp.float32)
    scales = _scales_f32(q.scales)
    return (_blocks(values, q.block) * scales[..., None]).reshape(shape).astype(dtype)


def is_quantizable(path: str, leaf: Any) -> bool:
    """The leaves :func:`quantize_kernels` quantizes: the layer stack's kernels.

    A leaf named ``kernel`` with a leading stack axis (rank >= 3): every matmul of the scanned
    layers. Embeddings, norms, biases and the (unstacked) output head stay floating.

    Example:
      >>> import jax
      >>> is_quantizable("layers/mlp/up_proj/kernel", jax.ShapeDtypeStruct((2, 8, 16), "f4"))
      True
      >>> is_quantizable("lm_head/kernel", jax.ShapeDtypeStruct((8, 16), "f4"))
      False
    """
    return path.rsplit("/", 1)[-1] == "kernel" and len(leaf.shape) >= 3


def quantize_kernels(params, fmt: str, *, double_quant: bool = True):
    """``params`` with every :func:`is_quantizable` leaf quantized; the rest unchanged.

    Example:
      >>> import jax.numpy as jnp
      >>> p = {"layers": {"kernel": jnp.ones((2, 4, 64))}, "norm": {"scale": jnp.ones(4)}}
      >>> q = quantize_kernels(p, "nf4")
      >>> is_quantized(q["layers"]["kernel"]), q["norm"]["scale"].dtype
      (True, dtype('float32'))
    """
    return map_with_path(lambda path, x: quantize(x, fmt, double_quant=double_quant, path=path)
                         if is_quantizable(path, x) else x, params)


def dequantize_kernels(params, dtype: Any = jnp.float32):
    """``params`` with every quantized kernel dequantized to ``dtype`` (e.g. to merge
    adapters into a quantized base for export); the rest unchanged.

    Example:
      >>> import jax.numpy as jnp
      >>> q = quantize_kernels({"layers": {"kernel": jnp.ones((2, 4, 64))}}, "nf4")
      >>> float(dequantize_kernels(q)["layers"]["kernel"].sum())
      512.0
    """
    return jax.tree.map(lambda x: dequantize(x, dtype) if is_quantized(x) else x, params,
                        is_leaf=is_quantized)


def dequantized_shapes(params):
    """``params`` with every quantized kernel as the ``jax.ShapeDtypeStruct`` (f32) of
    the kernel it stands for: what shape checks and parameter counts read.

    Example:
      >>> import jax.numpy as jnp
      >>> dequantized_shapes({"w": quantize(jnp.ones((4, 64)), "nf4")})["w"].shape
      (4, 64)
    """
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32)
                        if is_quantized(x) else x, params, is_leaf=is_quantized)


def quantized_bytes(shape: tuple[int, ...], fmt: str, *, block: int = BLOCK,
                    double_quant: bool = True) -> int:
    """Exact bytes of :func:`quantize`'s output for a kernel of ``shape`` (codes + scales).

    Example:
      >>> quantized_bytes((8192, 8192), "nf4") * 8 / 8192**2  # bits per weight
      4.126953601837158
      >>> quantized_bytes((8192, 8192), "nf4", double_quant=False) * 8 / 8192**2
      4.5
    """
    shape = tuple(shape)
    _check(shape, fmt, "shape")
    *lead, d, f = shape
    stack = math.prod(lead)
    codes = stack * d * (f // 2 if fmt == "nf4" else f)
    n = f // math.gcd(f, block)
    if not double_quant:
        return codes + 4 * stack * d * n
    return codes + stack * (d * n + 4 * (d // math.gcd(d, SCALE_BLOCK)) * n + 4)


def quantized_sharding(sharding: NamedSharding, q) -> Quantized:
    """Shardings of ``q``'s leaves from its kernel's: each axis split as the kernel's is,
    where the leaf's length divides (else that axis is replicated); a GGUF file's blocks as
    :func:`~effijax.precision.ggml_sharding` lays them out.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("fsdp",), (jax.sharding.AxisType.Auto,))
      >>> q = quantize(jnp.ones((2, 64, 128)), "nf4")
      >>> sh = quantized_sharding(NamedSharding(mesh, P(None, "fsdp")), q)
      >>> sh.codes.spec, sh.scales.steps.spec
      (P(None, 'fsdp'), P(None, None))
    """
    if isinstance(q, GGMLBlocks):
        return ggml_sharding(sharding, q)
    spec, sizes = tuple(sharding.spec), dict(sharding.mesh.shape)

    def split(entry) -> int:
        return math.prod(sizes[a] for a in (entry if isinstance(entry, tuple) else (entry,)))

    def leaf(x) -> NamedSharding:
        entries = [e if e is not None and x.shape[i] % split(e) == 0 else None
                   for i, e in enumerate(spec[:len(x.shape)])]
        return NamedSharding(sharding.mesh, P(*entries))

    return jax.tree.map(leaf, q)
