"""The key/value cache for autoregressive decoding, shared by the model families.

A :class:`KVCache` holds every layer's keys and values for ``T`` positions (the cache's fixed
``max_len``), stacked along ``L`` like the layers' parameters: ``k_LBTGK``, ``v_LBTGK``. A cached
forward pass runs ``S`` new tokens at slots ``start .. start + S - 1``: each layer writes
their keys and values into its slice at ``start`` and its queries attend to the cache's keys at
slots ``<= `` their own (:func:`cached_attend`). The same program serves a prompt (``S`` = the
padded prompt, the prefill) and each generated token (``S = 1``); every shape is fixed by
``max_len``, so decoding N tokens compiles one step. Slots past the ones written hold stale
values; they are never attended to (a query only sees keys at slots up to its own, and each
slot is written before a query at it runs).

Prompts of different lengths share a batch left-padded: ``pad_B`` holds each row's padding
slots, so row ``b``'s first real token is at slot ``pad_B[b]`` and the token at slot ``t`` is at
position ``t - pad_B[b]`` of its sequence (:func:`row_positions`: what the rotary or learned
position embeddings see), and its queries never attend to the padding slots. A padded row thus
computes what its prompt alone computes, and every row decodes at the same slot.

Sliding windows (Mistral, Gemma 3's local layers) are honoured by the mask, not by the buffer: a
layer with window ``w`` has its query at slot ``t`` attend to the slots ``t - w < u <= t`` (the
distance between slots is the distance between positions, padding or not), so decoding past
the window gives the full forward pass's logits. The cache still holds ``max_len`` slots for
every layer (one stacked buffer for local and global layers alike); a rolling buffer of ``w``
slots for the local layers would save memory and is not built.

Shape suffixes: ``L`` layers, ``B`` batch, ``S`` new tokens, ``T`` cached positions, ``H`` query
heads, ``G`` key/value heads, ``K`` head width.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from effijax.lora import LoraSpec
from effijax.models._layers import _constrain, _lora_hooks, _split_lora_params
from effijax.precision import dot, softmax

__all__ = ["KVCache", "init_cache", "cached_attend", "write_cache", "row_positions"]


class KVCache(NamedTuple):
    """Keys and values of every layer for ``T`` positions: ``k_LBTGK``, ``v_LBTGK``; and
    ``pad_B`` (int32 ``[B]``), the left-padding slots of each row (None: no padding)."""

    k_LBTGK: jax.Array
    v_LBTGK: jax.Array
    pad_B: jax.Array | None = None

    @property
    def max_len(self) -> int:
        """``T``: how many positions the cache holds."""
        return self.k_LBTGK.shape[2]


def init_cache(layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
               dtype: Any = jnp.float32) -> KVCache:
    """An empty (zero) cache without padding (set ``pad_B`` with ``_replace`` for
    left-padded prompts); its dtype is the model's compute dtype.

    Example:
      >>> cache = init_cache(2, 1, 16, 2, 8)
      >>> cache.k_LBTGK.shape, cache.pad_B.tolist()
      ((2, 1, 16, 2, 8), [0])
    """
    shape = (layers, batch, max_len, kv_heads, head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                   jnp.zeros((batch,), jnp.int32))


def row_positions(cache: KVCache, start: jax.Array, s: int) -> jax.Array:
    """Positions ``[B, S]`` (or ``[1, S]`` without padding) of ``S`` tokens at slots ``start ..
    start + S - 1``: each row counts from its first real token (padding slots get 0).

    Example:
      >>> import jax.numpy as jnp
      >>> cache = init_cache(1, 2, 8, 1, 4)._replace(pad_B=jnp.array([0, 3], jnp.int32))
      >>> row_positions(cache, jnp.int32(2), 3).tolist()
      [[2, 3, 4], [0, 0, 1]]
    """
    slots_S = jnp.asarray(start, jnp.int32) + jnp.arange(s, dtype=jnp.int32)
    pad_B = jnp.zeros((1,), jnp.int32) if cache.pad_B is None else cache.pad_B
    return jnp.maximum(slots_S[None, :] - pad_B[:, None], 0)


def write_cache(cache_BTGK: jax.Array, new_BSGK: jax.Array, start: jax.Array) -> jax.Array:
    """``cache`` with ``new``'s ``S`` rows written at positions ``start .. start + S - 1``.

    Example:
      >>> import jax.numpy as jnp
      >>> out = write_cache(jnp.zeros((1, 4, 1, 1)), jnp.ones((1, 2, 1, 1)), jnp.int32(1))
      >>> out[0, :, 0, 0].tolist()
      [0.0, 1.0, 1.0, 0.0]
    """
    zero = jnp.zeros((), jnp.int32)
    return jax.lax.dynamic_update_slice(cache_BTGK, new_BSGK.astype(cache_BTGK.dtype),
                                        (zero, jnp.asarray(start, jnp.int32), zero, zero))


def cached_attend(q_BSHK: jax.Array, k_BTGK: jax.Array, v_BTGK: jax.Array,
                  start: jax.Array, pad_B: jax.Array | None = None,
                  window: int | jax.Array | None = None) -> jax.Array:
    """Attention of ``S`` queries at slots ``start + i`` to the cache's ``T`` keys.

    Query ``i`` sees the keys at slots ``0 .. start + i``, in row ``b`` only from ``pad_B[b]``
    on (its left padding masked out; a padding query sees itself alone, so that every softmax
    is over some key), and with a sliding ``window`` (an int or an int32 scalar) only the
    slots ``start + i - window < u``; query head ``h`` reads key/value head ``h // (H // G)``.
    The math of
    :func:`~effijax.models.attend` (queries scaled by ``1/sqrt(K)``, f32 accumulation, f32
    softmax with masked entries exactly 0), so a cached forward pass gives the full forward
    pass's values.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from effijax.models import attend
      >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 5, 4, 8))
      >>> full = attend(q, k[:, :, :2], v[:, :, :2])
      >>> last = cached_attend(q[:, 4:], k[:, :, :2], v[:, :, :2], jnp.int32(4))
      >>> bool(jnp.allclose(last, full[:, 4:], atol=1e-6))
      True

      Left-padded by one slot (``pad_B``), the rows attend as if unpadded:

      >>> q, k = jax.random.normal(jax.random.key(1), (2, 2, 3, 2, 8))  # batch 2, 3 tokens
      >>> padded = jnp.concatenate([jnp.zeros_like(k[:, :1]), k], axis=1)
      >>> out = cached_attend(q, padded, padded, jnp.int32(1), jnp.array([1, 1]))
      >>> bool(jnp.allclose(out, attend(q, k, k), atol=1e-6))
      True

      With a window of 2 keys, the last query as in the windowed full pass:

      >>> out = cached_attend(q[:, 2:], k, k, jnp.int32(2), window=2)
      >>> bool(jnp.allclose(out, attend(q, k, k, window=2)[:, 2:], atol=1e-6))
      True
    """
    groups = q_BSHK.shape[2] // k_BTGK.shape[2]
    if groups > 1:
        k_BTGK = jnp.repeat(k_BTGK, groups, axis=2)
        v_BTGK = jnp.repeat(v_BTGK, groups, axis=2)
    s, t = q_BSHK.shape[1], k_BTGK.shape[1]
    q_BSHK = q_BSHK * jnp.asarray(1.0 / math.sqrt(q_BSHK.shape[-1]), q_BSHK.dtype)
    scores_BHST = dot("bshk,bthk->bhst", q_BSHK, k_BTGK)
    slots_S = jnp.asarray(start, jnp.int32) + jnp.arange(s, dtype=jnp.int32)
    slots_T = jnp.arange(t, dtype=jnp.int32)
    mask_BST = (slots_T[None, :] <= slots_S[:, None])[None]
    if window is not None:
        mask_BST = mask_BST & (slots_T[None, :] > slots_S[:, None]
                               - jnp.asarray(window, jnp.int32))[None]
    if pad_B is not None:
        real_BT = slots_T[None, :] >= pad_B[:, None]
        mask_BST = mask_BST & (real_BT[:, None, :] | (slots_T[None, :] == slots_S[:, None]))
    probs_BHST = softmax(scores_BHST, axis=-1, where=mask_BST[:, None])
    return dot("bhst,bthk->bshk", probs_BHST, v_BTGK)


def run_layers_cached(x_BSD: jax.Array, stacked, cache: KVCache, start: jax.Array,
                      adapters=None, consts=(), *, graphdef: nnx.GraphDef,
                      lora: LoraSpec | None, path: str,
                      layers: tuple | None = None,
                      windows_L: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """Runs the layers over new tokens, each layer reading and writing its cache slice.

    The cached counterpart of :func:`~effijax.models._layers._run_layers`: the layer module is
    called as ``layer(x_BSD, None, hooks, *consts, cache=(k_BTGK, v_BTGK, start, pad_B))``
    (``pad_B``: the cache's left padding per row, or None) and returns
    ``(x_BSD, (k_BTGK, v_BTGK))``. No dropout, no remat (inference). ``windows_L`` (int32
    ``[L]``, layers of different sliding windows) gives each layer its window as ``window=``,
    as :func:`~effijax.models._layers._run_layers` does.

    The stacked layers are scanned. With ``layers`` (:func:`split_layers` of the stack: one
    buffer per layer) the loop is unrolled over them instead: inside a scan XLA:CPU copies
    each layer's slice of a stacked weight before its matmul, which for one token (a
    matrix-vector product, bound by reading the weights) doubles the memory traffic.
    """
    if layers is not None:
        k_L, v_L = [], []
        for i, layer_state in enumerate(layers):
            layer_adapters = None if adapters is None else jax.tree.map(
                lambda a, i=i: a[i], adapters)
            hooks = None if layer_adapters is None else _lora_hooks(layer_adapters, lora, None,
                                                                    path)
            x_BSD, (k_BTGK, v_BTGK) = nnx.merge(graphdef, layer_state)(
                x_BSD, None, hooks, *consts,
                cache=(cache.k_LBTGK[i], cache.v_LBTGK[i], start, cache.pad_B),
                **_window_of(windows_L, i))
            x_BSD = _constrain(x_BSD)
            k_L.append(k_BTGK)
            v_L.append(v_BTGK)
        return x_BSD, KVCache(jnp.stack(k_L), jnp.stack(v_L), cache.pad_B)

    def body(x_BSD, layer):
        layer_state, k_BTGK, v_BTGK, layer_adapters, window = layer
        hooks = None if layer_adapters is None else _lora_hooks(layer_adapters, lora, None, path)
        x_BSD, (k_BTGK, v_BTGK) = nnx.merge(graphdef, layer_state)(
            x_BSD, None, hooks, *consts, cache=(k_BTGK, v_BTGK, start, cache.pad_B),
            **({} if window is None else {"window": window}))
        return _constrain(x_BSD), (k_BTGK, v_BTGK)

    x_BSD, (k_LBTGK, v_LBTGK) = jax.lax.scan(
        body, x_BSD, (stacked, cache.k_LBTGK, cache.v_LBTGK, adapters, windows_L))
    return x_BSD, KVCache(k_LBTGK, v_LBTGK, cache.pad_B)


def _window_of(windows_L: jax.Array | None, i: int) -> dict:
    """Layer ``i``'s ``window=`` keyword argument (none without per-layer windows)."""
    return {} if windows_L is None else {"window": windows_L[i]}


def split_layers(stacked) -> tuple:
    """A stacked layer tree (``params["layers"]``) as one tree per layer: separate buffers.

    Example:
      >>> import jax.numpy as jnp
      >>> [x["w"].shape for x in split_layers({"w": jnp.zeros((3, 4, 5))})]
      [(4, 5), (4, 5), (4, 5)]
    """
    n = jax.tree.leaves(stacked)[0].shape[0]
    return tuple(jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(n))


def make_decode(graphdef: nnx.GraphDef, lora: LoraSpec | None = None, stack: str = "layers"):
    """Returns ``decode(params, cache, tokens_BS, start, last=None, layers=None) ->
    (logits, cache)``.

    ``params`` as in :func:`~effijax.models.make_apply` (with ``lora``, ``{"base": params,
    "adapters": adapters}``: the adapters are applied factored, never merged). ``tokens_BS`` are
    at slots ``start .. start + S - 1`` of the cache (an int32 scalar, traced; ``start + S``
    must not exceed the cache's ``max_len``); with the cache's ``pad_B`` (left-padded prompts of
    different lengths) row ``b``'s token at slot ``t`` is at position ``t - pad_B[b]``. The
    logits are ``[B, S, V]``, or with ``last`` (an int32 index into ``S``) ``[B, 1, V]`` at that
    slot only: a padded prompt's last real token, without the output head's cost at the
    others. ``layers`` optionally holds the base
    parameters' layer stack (``params[stack]``) split per layer (``decode.split_layers(params)``,
    :func:`split_layers`): the same values, read in place by each layer's matmuls (faster for
    single tokens; the program is unrolled over the layers). Any effijax model whose module has
    a ``decode`` method works here.
    """
    if lora is not None and not isinstance(lora, LoraSpec):
        raise TypeError(f"lora: expected a LoraSpec or None, got {type(lora).__name__}")

    def decode(params, cache, tokens_BS, start, last=None, layers=None):
        if lora is None:
            return nnx.merge(graphdef, params).decode(tokens_BS, cache, start, last=last,
                                                      layers=layers)
        base, adapters = _split_lora_params(params)
        return nnx.merge(graphdef, base).decode(tokens_BS, cache, start, last=last,
                                                adapters=adapters, lora=lora, layers=layers)

    def split(params):
        base = params if lora is None else _split_lora_params(params)[0]
        return split_layers(base[stack])

    decode.split_layers = split
    return decode


def select_last(x_BSD: jax.Array, last: jax.Array | None) -> jax.Array:
    """``x`` at index ``last`` of the sequence axis (``[B, 1, D]``), or all of it for None."""
    if last is None:
        return x_BSD
    return jax.lax.dynamic_slice_in_dim(x_BSD, jnp.asarray(last, jnp.int32), 1, axis=1)
