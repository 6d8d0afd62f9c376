"""A GGUF file's quantized blocks kept as they are: the frozen base of ``--frozen-dtype gguf``.

llama.cpp stores a weight ``W`` (torch's ``(out, in)`` layout) row by row, each row of ``in``
values cut into blocks of 32 (``Q4_0`` ... ``Q8_0``) or 256 (the K-quants) with their own
scales. :class:`GGMLBlocks` holds those rows byte for byte (``uint8 [..., F, R]``: one row per
output ``F``, ``R`` bytes each) and stands for the kernel ``[..., D, F]`` they encode (``D``
inputs). :func:`dequantize_blocks` decodes them inside the step, one layer at a time in the
layer scan, so a LoRA base trains on the very weights the file holds: no requantization error
and no full-precision copy of the base.

A Q4_K_M file mixes types within one role (Gemma 3 270M's ``ffn_down`` is Q6_K in half its
layers and Q4_K in the others). Stacked layers must share one array, so each row is padded to
the widest type's bytes and ``kinds`` (``int32 [...]``, one per stacked kernel) indexes
``types``; inside the scan, ``lax.switch`` decodes a layer with its own type. The padding is
the price (Gemma 3 270M: 3.6 MB, 5.0% of its kept kernels' 71.7 MB).

The decoders follow ggml's block layouts (``ggml-common.h``), checked bit for bit against the
``gguf`` package's numpy dequantization in the tests: a scale ``d`` (f16) per block, a minimum
(f16) for the ``_1`` types, the high bits of 5-bit codes (``qh``) apart from the low nibbles,
and for the K-quants 6-bit (Q4_K, Q5_K) or int8 (Q6_K) sub-block scales under an f16 scale.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from effijax.errors import ConfigError

__all__ = ["GGML_BLOCKS", "GGMLBlocks", "dequantize_blocks", "ggml_blocks", "ggml_blocks_bytes",
           "ggml_row_bytes", "ggml_sharding"]

# ggml type -> (weights per block, bytes per block)
GGML_BLOCKS: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}


@functools.partial(jax.tree_util.register_dataclass, data_fields=("rows", "kinds"),
                   meta_fields=("types", "in_features"))
@dataclasses.dataclass(frozen=True)
class GGMLBlocks:
    """A kernel ``[..., D, F]`` as a GGUF file's quantized rows (a pytree: ``rows``, ``kinds``).

    Attributes:
      rows: ``uint8 [..., F, R]``: output ``f``'s row of blocks over the ``D`` inputs, padded
        with zeros to the widest of ``types``.
      kinds: ``int32 [...]``: each stacked kernel's type, an index into ``types``.
      types: the ggml type names present (static), e.g. ``("Q4_K", "Q6_K")``.
      in_features: ``D`` (static).
    """

    rows: Any
    kinds: Any
    types: tuple[str, ...]
    in_features: int

    @property
    def format(self) -> str:
        return "gguf"

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, f, _ = self.rows.shape
        return (*lead, self.in_features, f)


def ggml_row_bytes(kind: str, in_features: int) -> int:
    """Bytes of one row of ``kind`` blocks over ``in_features`` inputs (a multiple of the
    type's block).

    Example:
      >>> ggml_row_bytes("Q4_K", 2048), ggml_row_bytes("Q6_K", 2048)
      (1152, 1680)
    """
    block, size = GGML_BLOCKS[kind]
    return in_features // block * size


def ggml_blocks_bytes(kinds: list[str], in_features: int, out_features: int) -> int:
    """Bytes of :func:`ggml_blocks`' result for layers of types ``kinds`` (one per layer): every
    row padded to the widest type's, and one int32 type index per layer.

    Example:
      >>> ggml_blocks_bytes(["Q4_K", "Q6_K"], 2048, 640)  # 2 x (640 rows x 1680 B + 4)
      2150408
    """
    width = max(ggml_row_bytes(kind, in_features) for kind in kinds)
    return len(kinds) * (out_features * width + 4)


def ggml_blocks(layers: list[tuple[str, np.ndarray]], in_features: int,
                path: str = "kernel") -> GGMLBlocks:
    """One :class:`GGMLBlocks` from the rows of each layer's tensor, stacked (host arrays).

    Args:
      layers: ``(ggml type name, uint8 rows [F, R])`` per layer, as the file holds them; one
        entry for a kernel without a layer axis.
      in_features: ``D``, the inputs each row encodes.
      path: the parameter's path, for errors.

    Example:
      >>> import numpy as np
      >>> zero = np.zeros((4, 34), np.uint8)  # 4 rows of one Q8_0 block (32 inputs)
      >>> b = ggml_blocks([("Q8_0", zero), ("Q8_0", zero)], 32)
      >>> b.shape, b.rows.shape, b.types
      ((2, 32, 4), (2, 4, 34), ('Q8_0',))
    """
    types = tuple(sorted({kind for kind, _ in layers}))
    for kind, rows in layers:
        if kind not in GGML_BLOCKS:
            raise ConfigError(path, kind, f"is not a block type kept as it is; those are "
                              f"{', '.join(GGML_BLOCKS)} (use --frozen-dtype nf4 or int8)")
        block = GGML_BLOCKS[kind][0]
        if in_features % block or rows.shape[-1] != ggml_row_bytes(kind, in_features):
            raise ConfigError(path, tuple(rows.shape), f"{kind} rows of {in_features} inputs "
                              f"take {ggml_row_bytes(kind, in_features)} bytes")
    width = max(ggml_row_bytes(kind, in_features) for kind in types)
    f = layers[0][1].shape[0]
    out = np.zeros((len(layers), f, width), np.uint8)
    for i, (_, rows) in enumerate(layers):
        out[i, :, :rows.shape[-1]] = rows
    kinds = np.array([types.index(kind) for kind, _ in layers], np.int32)
    return GGMLBlocks(out, kinds, types, in_features)


def _f16(b: jax.Array) -> jax.Array:
    """``uint8 [..., 2]`` (little-endian) as the f16 they store, in f32: ``[...]``."""
    return lax.bitcast_convert_type(lax.bitcast_convert_type(b, jnp.uint16),
                                    jnp.float16).astype(jnp.float32)


def _nibbles(qs: jax.Array) -> jax.Array:
    """``uint8 [..., n]`` as ``[..., 2n]``: the low nibbles, then the high ones."""
    return jnp.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _bits(b: jax.Array, shifts, mask: int) -> jax.Array:
    """``uint8 [..., n]`` as ``[..., len(shifts), n]``: ``(b >> s) & mask`` per shift."""
    return (b[..., None, :] >> jnp.asarray(shifts, jnp.uint8)[:, None]) & jnp.uint8(mask)


def _q8_0(x):
    q = lax.bitcast_convert_type(x[..., 2:], jnp.int8).astype(jnp.float32)
    return q * _f16(x[..., 0:2])[..., None]


def _q4_0(x):
    q = _nibbles(x[..., 2:]).astype(jnp.int8) - jnp.int8(8)
    return _f16(x[..., 0:2])[..., None] * q.astype(jnp.float32)


def _q4_1(x):
    q = _nibbles(x[..., 4:]).astype(jnp.float32)
    return _f16(x[..., 0:2])[..., None] * q + _f16(x[..., 2:4])[..., None]


def _high_bits(qh: jax.Array) -> jax.Array:
    """The 32 high bits of a ``_0``/``_1`` 5-bit block (``uint8 [..., 4]``, little-endian)."""
    return _bits(qh, range(8), 1).swapaxes(-1, -2).reshape(*qh.shape[:-1], 32)


def _q5_0(x):
    q = (_nibbles(x[..., 6:]) | (_high_bits(x[..., 2:6]) << 4)).astype(jnp.int8) - jnp.int8(16)
    return _f16(x[..., 0:2])[..., None] * q.astype(jnp.float32)


def _q5_1(x):
    q = (_nibbles(x[..., 8:]) | (_high_bits(x[..., 4:8]) << 4)).astype(jnp.float32)
    return _f16(x[..., 0:2])[..., None] * q + _f16(x[..., 2:4])[..., None]


def _k_scales(x):
    """A Q4_K/Q5_K super-block's 8 sub-block scales and minimums, times its f16 scales."""
    s = x[..., 4:16]
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([d & 0x3F, (md & 0xF) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return (_f16(x[..., 0:2])[..., None] * sc.astype(jnp.float32),
            _f16(x[..., 2:4])[..., None] * mn.astype(jnp.float32))


def _k_low(qs):
    """128 bytes of 4-bit codes as ``[..., 8, 32]``: each 32-byte chunk's low, then high."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return _bits(chunks, (0, 4), 0xF).reshape(*qs.shape[:-1], 8, 32)


def _q4_k(x):
    d, dm = _k_scales(x)
    q = _k_low(x[..., 16:]).astype(jnp.float32)
    return (d[..., None] * q - dm[..., None]).reshape(*x.shape[:-1], 256)


def _q5_k(x):
    d, dm = _k_scales(x)
    q = (_k_low(x[..., 48:]) | (_bits(x[..., 16:48], range(8), 1) << 4)).astype(jnp.float32)
    return (d[..., None] * q - dm[..., None]).reshape(*x.shape[:-1], 256)


def _q6_k(x):
    lead = x.shape[:-1]
    ql = _bits(x[..., 0:128].reshape(*lead, 2, 64), (0, 4), 0xF).reshape(*lead, 8, 32)
    qh = _bits(x[..., 128:192].reshape(*lead, 2, 32), (0, 2, 4, 6), 3).reshape(*lead, 8, 32)
    q = ((ql | (qh << 4)).astype(jnp.int8) - jnp.int8(32)).reshape(*lead, 16, 16)
    scales = lax.bitcast_convert_type(x[..., 192:208], jnp.int8).astype(jnp.float32)
    d = _f16(x[..., 208:210])[..., None] * scales
    return (d[..., None] * q.astype(jnp.float32)).reshape(*lead, 256)


_DECODE: dict[str, Callable[[jax.Array], jax.Array]] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}


def _decode_rows(kind: str, d: int, rows: jax.Array) -> jax.Array:
    """``uint8 [F, R]`` rows of ``kind`` (padded) as the f32 weights ``[F, D]``."""
    block, size = GGML_BLOCKS[kind]
    x = rows[:, :ggml_row_bytes(kind, d)].reshape(rows.shape[0], d // block, size)
    return _DECODE[kind](x).reshape(rows.shape[0], d)


def _decode_one(b: GGMLBlocks, rows: jax.Array, kind: jax.Array) -> jax.Array:
    """One unstacked kernel: ``[F, D]`` f32, its type chosen by ``kind`` when there are several."""
    branches = [functools.partial(_decode_rows, t, b.in_features) for t in b.types]
    if len(branches) == 1:
        return branches[0](rows)
    return lax.switch(kind, branches, rows)


def dequantize_blocks(b: GGMLBlocks, dtype: Any = jnp.float32) -> jax.Array:
    """The kernel ``[..., D, F]`` that ``b``'s rows encode, in ``dtype`` (decoded in f32, bit for
    bit what the ``gguf`` package's numpy dequantization gives).

    Example:
      >>> import numpy as np
      >>> block = np.zeros((1, 34), np.uint8)
      >>> block[0, :2] = np.array([0.5], np.float16).view(np.uint8)  # the block's scale d
      >>> block[0, 2:] = np.arange(32, dtype=np.int8).view(np.uint8)  # the codes q
      >>> w = dequantize_blocks(ggml_blocks([("Q8_0", block)], 32))  # w = d * q
      >>> w.shape, [float(v) for v in w[0, :4, 0]]
      ((1, 32, 1), [0.0, 0.5, 1.0, 1.5])
    """
    lead, (f, width) = b.rows.shape[:-2], b.rows.shape[-2:]
    if not lead:  # one layer's kernel, as the layer scan slices it: a real branch on its type
        return _decode_one(b, b.rows, b.kinds).T.astype(dtype)
    w = jax.vmap(functools.partial(_decode_one, b))(b.rows.reshape(-1, f, width),
                                                    jnp.reshape(b.kinds, (-1,)))
    return jnp.swapaxes(w, -1, -2).reshape(*lead, b.in_features, f).astype(dtype)


def ggml_sharding(sharding: NamedSharding, b: GGMLBlocks) -> GGMLBlocks:
    """Shardings of ``b``'s leaves from its kernel's (``[..., D, F]``): the stack axes as the
    kernel's; the rows split along ``F`` by the kernel's split of ``F``, else of ``D`` (a row's
    bytes stay whole: one row is every block of one output), where it divides; ``kinds`` as the
    stack axes.

    Example:
      >>> import jax, numpy as np
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("fsdp",), (jax.sharding.AxisType.Auto,))
      >>> b = ggml_blocks([("Q8_0", np.zeros((16, 34), np.uint8))] * 2, 32)
      >>> sh = ggml_sharding(NamedSharding(mesh, P(None, "fsdp", None)), b)
      >>> sh.rows.spec, sh.kinds.spec
      (P(None, 'fsdp', None), P(None,))
    """
    spec = tuple(sharding.spec) + (None,) * (len(b.shape) - len(tuple(sharding.spec)))
    sizes = dict(sharding.mesh.shape)
    lead, (split_d, split_f) = spec[:-2], spec[-2:]
    f = b.rows.shape[-2]

    def divides(entry) -> bool:
        axes = entry if isinstance(entry, tuple) else (entry,)
        return entry is not None and f % math.prod(sizes[a] for a in axes) == 0

    rows_f = split_f if divides(split_f) else split_d if divides(split_d) else None
    return GGMLBlocks(NamedSharding(sharding.mesh, P(*lead, rows_f, None)),
                      NamedSharding(sharding.mesh, P(*lead)), b.types, b.in_features)
