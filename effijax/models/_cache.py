"""The key/value cache for autoregressive decoding, shared by the model families.

A :class:`KVCache` holds each layer's keys and values in one of two stacks, each stacked along
``L`` like the layers' parameters. Global layers keep ``T`` slots, the cache's fixed ``max_len``
(``k_LBTGK``, ``v_LBTGK``): a cached pass runs ``S`` new tokens at slots ``start .. start + S -
1``, writes their keys there and its queries attend to the slots ``<=`` their own
(:func:`cached_attend`). A local layer (a sliding window ``w < T``: every Mistral layer, five of
Gemma 3's six) only ever reads its last ``w`` keys, so it keeps a ring of ``W`` slots (the
largest such window; ``k_LBWGK``, ``v_LBWGK``) holding slot ``t``'s key at ring index ``t mod
W``. Its queries attend to the ring as it was before the pass together with the pass's own keys
(:func:`ring_attend`: ``W + S`` keys, each labelled by its slot), then the last ``min(S, W)``
new keys are written (:func:`write_ring`), so a prompt longer than the window is prefilled in one
pass and leaves the ring holding its last ``W`` keys. Every query still sees exactly the keys
``t - w < u <= t``: the logits are the full pass's. The same program serves a prompt (the
prefill) and each generated token (``S = 1``); every shape is fixed by ``max_len``, so decoding N
tokens compiles one step. Slots not yet written are never attended to.

Why two stacks: a scan needs one shape per stacked array, so one stack of ``T`` slots for every
layer (the earlier layout, still accepted: :func:`init_cache` without windows, the windows then
masks) saves nothing, while two stacks do: Gemma 3 270M at ``max_len`` 4096 keeps 3·4096 +
15·512 = 19,968 slots per row instead of 73,728, Mistral (all local) ``L·W`` instead of
``L·T``. :func:`run_layers_cached` runs the layers as a nested scan whose carry is the cache:
the layers' kinds repeat with a period (Gemma 3: five local, one global), an outer scan goes over
the periods and, inside it, one scan per run of equal layers reads its own stack at the layer's
index and updates it in place, so one body is compiled per kind and a local layer reads ``W``
slots, not ``T``. (One body choosing its stack by ``lax.cond`` copied the stacks at every layer
under XLA:CPU; one body reading both read ``T`` slots in every layer.)

Prompts of different lengths share a batch left-padded: ``pad_B`` holds each row's padding
slots, so row ``b``'s first real token is at slot ``pad_B[b]`` and the token at slot ``t`` is at
position ``t - pad_B[b]`` of its sequence (:func:`row_positions`: what the rotary or learned
position embeddings see), and its queries never attend to the padding slots. A padded row thus
computes what its prompt alone computes, and every row decodes at the same slot; so the rings
are indexed by slot (one write for the whole batch): the distance between two slots of a row,
which a window bounds, is the distance between their positions.

Shape suffixes: ``L`` layers, ``B`` batch, ``S`` new tokens, ``T`` cached positions, ``W`` ring
slots, ``H`` query heads, ``G`` key/value heads, ``K`` head width.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from effijax.errors import NO_VALUE, ConfigError, whole_number
from effijax.lora import LoraSpec
from effijax.models._layers import _constrain, _lora_hooks, _split_lora_params
from effijax.precision import dot, softmax

__all__ = ["KVCache", "LayerCache", "LayerSlot", "attend_layer", "cache_slots", "cached_attend",
           "check_windows", "init_cache", "layer_slots", "ring_attend", "row_positions",
           "write_cache", "write_ring"]

class KVCache(NamedTuple):
    """Keys and values of the global layers for ``T`` positions (``k_LBTGK``, ``v_LBTGK``),
    ``pad_B`` (int32 ``[B]``), the left-padding slots of each row (None: no padding), and the
    local layers' rings of ``W`` slots (``k_LBWGK``, ``v_LBWGK``; None without local layers).
    A model whose layers are all local has ``L = 0`` full-length layers (it still says ``T``)."""

    k_LBTGK: jax.Array
    v_LBTGK: jax.Array
    pad_B: jax.Array | None = None
    k_LBWGK: jax.Array | None = None
    v_LBWGK: jax.Array | None = None

    @property
    def max_len(self) -> int:
        """``T``: how many positions the cache holds."""
        return self.k_LBTGK.shape[2]

    @property
    def ring_len(self) -> int | None:
        """``W``: the rings' slots (None without rings)."""
        return None if self.k_LBWGK is None else self.k_LBWGK.shape[2]


class LayerSlot(NamedTuple):
    """Where one layer's keys live: in the rings (``ring``) or the full-length stack, at
    ``index`` of that stack; ``window``: the layer's sliding window (None: global)."""

    ring: bool
    index: int
    window: int | None


def check_windows(windows, layers: int) -> tuple[int | None, ...]:
    """``windows`` as a tuple, one int ``>= 1`` or None per layer, or a
    :class:`~effijax.errors.ConfigError` that says which.

    Example:
      >>> check_windows([4, None], 2)
      (4, None)
      >>> check_windows((4,), 2)
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: layer_windows=(4,): expected one window per layer (2), None ...
    """
    windows = tuple(windows)
    if len(windows) != layers:
        raise ConfigError("layer_windows", windows, f"expected one window per layer ({layers}), "
                          "None for a global layer")
    for window in windows:
        whole_number("layer_windows", window, none=True)
    return windows


def layer_slots(windows: tuple[int | None, ...], max_len: int,
                rings: bool = True) -> tuple[LayerSlot, ...]:
    """Each layer's place in a cache of ``max_len`` slots: with ``rings``, a layer whose window
    is shorter than ``max_len`` in the rings, every other layer in the full-length stack;
    indices count within each stack.

    Example:
      >>> [tuple(s) for s in layer_slots((4, 4, None, 4), 16)]
      [(True, 0, 4), (True, 1, 4), (False, 0, None), (True, 2, 4)]
      >>> [s.ring for s in layer_slots((4, 4, None, 4), 16, rings=False)]
      [False, False, False, False]
    """
    counts, slots = [0, 0], []
    for window in windows:
        ring = rings and window is not None and window < max_len
        slots.append(LayerSlot(ring, counts[ring], window))
        counts[ring] += 1
    return tuple(slots)


def init_cache(layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
               dtype: Any = jnp.float32, windows: tuple[int | None, ...] | None = None
               ) -> KVCache:
    """An empty (zero) cache without padding (set ``pad_B`` with ``_replace`` for left-padded
    prompts); its dtype is the model's compute dtype. ``windows`` (one per layer, None for a
    global layer) gives the layers whose window is shorter than ``max_len`` a ring of the
    largest such window's slots; without it every layer keeps ``max_len`` slots.

    Example:
      >>> cache = init_cache(2, 1, 16, 2, 8)
      >>> cache.k_LBTGK.shape, cache.pad_B.tolist(), cache.k_LBWGK
      ((2, 1, 16, 2, 8), [0], None)
      >>> cache = init_cache(3, 1, 16, 2, 8, windows=(4, 4, None))
      >>> cache.k_LBTGK.shape, cache.k_LBWGK.shape
      ((1, 1, 16, 2, 8), (2, 1, 4, 2, 8))
    """
    windows = check_windows((None,) * layers if windows is None else windows, layers)
    local = [slot.window for slot in layer_slots(windows, max_len) if slot.ring]
    full = (layers - len(local), batch, max_len, kv_heads, head_dim)
    ring = (len(local), batch, max(local, default=0), kv_heads, head_dim)
    return KVCache(jnp.zeros(full, dtype), jnp.zeros(full, dtype),
                   jnp.zeros((batch,), jnp.int32),
                   jnp.zeros(ring, dtype) if local else None,
                   jnp.zeros(ring, dtype) if local else None)


def cache_slots(cache: KVCache, windows: tuple[int | None, ...]) -> tuple[LayerSlot, ...]:
    """The layers' places in ``cache`` (:func:`layer_slots`), or a
    :class:`~effijax.errors.ConfigError` when the cache was made for other layers. A cache
    without rings (every layer ``max_len`` slots, the windows then masks) is accepted too.

    Example:
      >>> [s.ring for s in cache_slots(init_cache(2, 1, 16, 1, 4, windows=(4, None)), (4, None))]
      [True, False]
      >>> cache_slots(init_cache(2, 1, 16, 1, 4), (4, 4, 4))
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: cache: holds 2 full-length layers and no rings; layers of ...
    """
    slots = layer_slots(windows, cache.max_len, rings=cache.k_LBWGK is not None)
    have = _layout(cache.k_LBTGK.shape[0],
                   [] if cache.k_LBWGK is None else [cache.ring_len] * cache.k_LBWGK.shape[0])
    want = _layout(len(slots) - sum(s.ring for s in slots), [s.window for s in slots if s.ring])
    if have != want:
        rolling = layer_slots(windows, cache.max_len)
        ring_windows = [s.window for s in rolling if s.ring]
        layouts = [_layout(len(windows) - len(ring_windows), ring_windows)]
        if ring_windows:
            layouts.append(_layout(len(windows), []))
        raise ConfigError("cache", NO_VALUE, f"holds {have}; layers of windows {windows} take "
                          f"{' or '.join(layouts)} at max_len {cache.max_len}: make it with "
                          "the model's init_cache(batch, max_len)")
    return slots


def _layout(full: int, ring_windows: list[int]) -> str:
    """A cache's layout in words: its full-length layers and rings (of the largest window)."""
    rings = (f"{len(ring_windows)} rings of {max(ring_windows)} slots" if ring_windows
             else "no rings")
    return f"{full} full-length layers and {rings}"


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


def write_cache(cache_LBTGK: jax.Array, new_BSGK: jax.Array, layer: int | jax.Array,
                start: jax.Array) -> jax.Array:
    """The stack with ``new``'s ``S`` rows written into layer ``layer`` at slots ``start ..
    start + S - 1`` (in place under jit when the stack is not read afterwards).

    Example:
      >>> import jax.numpy as jnp
      >>> out = write_cache(jnp.zeros((2, 1, 4, 1, 1)), jnp.ones((1, 2, 1, 1)), 1, jnp.int32(1))
      >>> out[:, 0, :, 0, 0].tolist()
      [[0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]]
    """
    zero = jnp.zeros((), jnp.int32)
    return jax.lax.dynamic_update_slice(
        cache_LBTGK, new_BSGK[None].astype(cache_LBTGK.dtype),
        (jnp.asarray(layer, jnp.int32), zero, jnp.asarray(start, jnp.int32), zero, zero))


def ring_slots(w: int, start: jax.Array) -> jax.Array:
    """int32 ``[W]``: the slot whose key ring index ``j`` holds before a pass at ``start``, the
    latest ``u < start`` with ``u = j (mod W)``; negative: not written yet.

    Example:
      >>> import jax.numpy as jnp
      >>> ring_slots(4, jnp.int32(6)).tolist(), ring_slots(4, jnp.int32(2)).tolist()
      ([4, 5, 2, 3], [0, 1, -2, -1])
    """
    last = jnp.asarray(start, jnp.int32) - 1
    return last - jnp.mod(last - jnp.arange(w, dtype=jnp.int32), w)


def write_ring(ring_BWGK: jax.Array, new_BSGK: jax.Array, start: jax.Array) -> jax.Array:
    """The ring with the keys (or values) of slots ``start .. start + S - 1`` written at their
    indices ``slot mod W``: the last ``min(S, W)`` of them (earlier ones would be overwritten).

    Example:
      >>> import jax.numpy as jnp
      >>> new = jnp.arange(1.0, 7.0).reshape(1, 6, 1, 1)  # slots 2 .. 7 into a ring of 4
      >>> write_ring(jnp.zeros((1, 4, 1, 1)), new, jnp.int32(2))[0, :, 0, 0].tolist()
      [3.0, 4.0, 5.0, 6.0]
    """
    w, s = ring_BWGK.shape[1], new_BSGK.shape[1]
    n = min(s, w)
    index_N = jnp.mod(jnp.asarray(start, jnp.int32) + (s - n) + jnp.arange(n, dtype=jnp.int32),
                      w)
    return ring_BWGK.at[:, index_N].set(new_BSGK[:, s - n:].astype(ring_BWGK.dtype),
                                        unique_indices=True)


def _slot_attend(q_BSHK, k_BTGK, v_BTGK, slots_S, slots_T, pad_B, window) -> jax.Array:
    """Attention of queries at ``slots_S`` to keys labelled by ``slots_T`` (negative: empty):
    causal, within the ``window``, real keys only (a padding query sees itself)."""
    groups = q_BSHK.shape[2] // k_BTGK.shape[2]
    if groups > 1:
        k_BTGK = jnp.repeat(k_BTGK, groups, axis=2)
        v_BTGK = jnp.repeat(v_BTGK, groups, axis=2)
    q_BSHK = q_BSHK * jnp.asarray(1.0 / math.sqrt(q_BSHK.shape[-1]), q_BSHK.dtype)
    scores_BHST = dot("bshk,bthk->bhst", q_BSHK, k_BTGK)
    mask_BST = ((slots_T[None, :] <= slots_S[:, None]) & (slots_T[None, :] >= 0))[None]
    if window is not None:
        mask_BST = mask_BST & (slots_T[None, :] > slots_S[:, None]
                               - jnp.asarray(window, jnp.int32))[None]
    if pad_B is not None:
        real_BT = slots_T[None, :] >= pad_B[:, None]
        mask_BST = mask_BST & (real_BT[:, None, :] | (slots_T[None, :] == slots_S[:, None]))
    probs_BHST = softmax(scores_BHST, axis=-1, where=mask_BST[:, None])
    return dot("bhst,bthk->bshk", probs_BHST, v_BTGK)


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

    Example (compiled, as a decode step runs it: one program per call, not one per operation):

      >>> import jax, jax.numpy as jnp
      >>> from effijax.models import attend
      >>> cached = jax.jit(cached_attend)
      >>> full_pass = jax.jit(attend, static_argnames="window")
      >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 5, 4, 8))
      >>> full = full_pass(q, k[:, :, :2], v[:, :, :2])
      >>> last = cached(q[:, 4:], k[:, :, :2], v[:, :, :2], jnp.int32(4))
      >>> bool(jnp.allclose(last, full[:, 4:], atol=1e-6))
      True

      Left-padded by one slot (``pad_B``), the rows attend as if unpadded:

      >>> q, k = jax.random.normal(jax.random.key(1), (2, 2, 3, 2, 8))  # batch 2, 3 tokens
      >>> padded = jnp.concatenate([jnp.zeros_like(k[:, :1]), k], axis=1)
      >>> out = cached(q, padded, padded, jnp.int32(1), jnp.array([1, 1]))
      >>> bool(jnp.allclose(out, full_pass(q, k, k), atol=1e-6))
      True

      With a window of 2 keys, the last query as in the windowed full pass:

      >>> out = cached(q[:, 2:], k, k, jnp.int32(2), window=2)
      >>> bool(jnp.allclose(out, full_pass(q, k, k, window=2)[:, 2:], atol=1e-6))
      True
    """
    slots_S = jnp.asarray(start, jnp.int32) + jnp.arange(q_BSHK.shape[1], dtype=jnp.int32)
    slots_T = jnp.arange(k_BTGK.shape[1], dtype=jnp.int32)
    return _slot_attend(q_BSHK, k_BTGK, v_BTGK, slots_S, slots_T, pad_B, window)


def ring_attend(q_BSHK: jax.Array, k_BWGK: jax.Array, v_BWGK: jax.Array, k_BSGK: jax.Array,
                v_BSGK: jax.Array, start: jax.Array, pad_B: jax.Array | None = None,
                window: int | jax.Array | None = None) -> jax.Array:
    """Attention of ``S`` queries at slots ``start + i`` to a ring's ``W`` keys (as they were
    before this pass: :func:`ring_slots`) and to the pass's own ``S`` keys.

    The masks of :func:`cached_attend` over the slots the keys belong to: query ``i`` sees the
    keys at slots ``start + i - window < u <= start + i`` (``window <= W``, so the ring holds
    every earlier one it needs), in row ``b`` from ``pad_B[b]`` on. The new keys are cast to
    the ring's dtype first, as a cache stores them.

    Example (compiled, as a decode step runs it):

      >>> import jax, jax.numpy as jnp
      >>> from effijax.models import attend
      >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 9, 2, 8))
      >>> full = jax.jit(attend, static_argnames="window")(q, k, v, window=3)  # 9 tokens
      >>> ring_k = write_ring(jnp.zeros((1, 3, 2, 8)), k[:, :6], jnp.int32(0))  # prefill 6
      >>> ring_v = write_ring(jnp.zeros((1, 3, 2, 8)), v[:, :6], jnp.int32(0))
      >>> out = jax.jit(ring_attend)(q[:, 6:], ring_k, ring_v, k[:, 6:], v[:, 6:],
      ...                            jnp.int32(6), window=3)
      >>> bool(jnp.allclose(out, full[:, 6:], atol=1e-6))
      True
    """
    s = q_BSHK.shape[1]
    slots_S = jnp.asarray(start, jnp.int32) + jnp.arange(s, dtype=jnp.int32)
    slots_T = jnp.concatenate([ring_slots(k_BWGK.shape[1], start), slots_S])
    k_BTGK = jnp.concatenate([k_BWGK, k_BSGK.astype(k_BWGK.dtype)], axis=1)
    v_BTGK = jnp.concatenate([v_BWGK, v_BSGK.astype(v_BWGK.dtype)], axis=1)
    return _slot_attend(q_BSHK, k_BTGK, v_BTGK, slots_S, slots_T, pad_B, window)


class LayerCache(NamedTuple):
    """What one layer's attention gets when decoding: the whole ``cache``, whether the layer's
    keys are in the rings (``ring``, static), its ``index`` in that stack (an int, or traced in
    a scan) and the pass's first slot ``start``."""

    cache: KVCache
    ring: bool
    index: int | jax.Array
    start: jax.Array


def attend_layer(layer: LayerCache, q_BSHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array,
                 window: int | jax.Array | None) -> tuple[jax.Array, KVCache]:
    """A layer's cached attention: ``(out_BSHK, cache)`` with this pass's keys and values
    written into the layer's ring (:func:`ring_attend`, :func:`write_ring`) or its full-length
    slots (:func:`write_cache`, :func:`cached_attend`).

    Example (compiled, as a decode step runs it; the ring flag and the window are static):

      >>> import jax, jax.numpy as jnp
      >>> from effijax.models import attend
      >>> @jax.jit
      ... def first_layer(cache, q, k, v):  # layer 0 of the rings, window 2, from slot 0
      ...     return attend_layer(LayerCache(cache, True, 0, jnp.int32(0)), q, k, v, 2)
      >>> cache = init_cache(2, 1, 8, 1, 4, windows=(2, None))
      >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 5, 1, 4))
      >>> out, cache = first_layer(cache, q, k, v)
      >>> bool(jnp.allclose(out, jax.jit(attend)(q, k, v, window=2), atol=1e-6))
      True
      >>> cache.k_LBWGK[0, 0, :, 0, 0].tolist() == k[0, 3:5, 0, 0][::-1].tolist()  # slots 4, 3
      True
    """
    cache, index, start = layer.cache, layer.index, jnp.asarray(layer.start, jnp.int32)
    if layer.ring:
        k_BWGK, v_BWGK = (jax.lax.dynamic_index_in_dim(stack, index, keepdims=False)
                          for stack in (cache.k_LBWGK, cache.v_LBWGK))
        out_BSHK = ring_attend(q_BSHK, k_BWGK, v_BWGK, k_BSGK, v_BSGK, start, cache.pad_B,
                               window)
        k_LBWGK, v_LBWGK = (
            jax.lax.dynamic_update_index_in_dim(stack, write_ring(ring, new, start), index, 0)
            for stack, ring, new in ((cache.k_LBWGK, k_BWGK, k_BSGK),
                                     (cache.v_LBWGK, v_BWGK, v_BSGK)))
        return out_BSHK, cache._replace(k_LBWGK=k_LBWGK, v_LBWGK=v_LBWGK)
    k_LBTGK = write_cache(cache.k_LBTGK, k_BSGK, index, start)
    v_LBTGK = write_cache(cache.v_LBTGK, v_BSGK, index, start)
    out_BSHK = cached_attend(q_BSHK, jax.lax.dynamic_index_in_dim(k_LBTGK, index, keepdims=False),
                             jax.lax.dynamic_index_in_dim(v_LBTGK, index, keepdims=False),
                             start, cache.pad_B, window)
    return out_BSHK, cache._replace(k_LBTGK=k_LBTGK, v_LBTGK=v_LBTGK)


class _Run(NamedTuple):
    """Consecutive layers of one kind in a period: the first's ``offset`` in the period, how
    many, their stack (``ring``) and ``window``, the layers of that stack ``before`` them in
    the period and ``per_period``."""

    offset: int
    length: int
    ring: bool
    window: int | None
    before: int
    per_period: int


def _schedule(slots: tuple[LayerSlot, ...]) -> tuple[int, int, list[_Run], list[_Run]]:
    """``(period, repeats, runs of a period, runs of the remaining layers)``: the layers' kinds
    repeat every ``period`` layers, ``repeats`` times, then the first ``L % period`` again."""
    kinds = [(slot.ring, slot.window) for slot in slots]
    n = len(kinds)
    period = next(p for p in range(1, n + 1) if all(kinds[i] == kinds[i % p] for i in range(n)))

    def runs(part):
        out, i = [], 0
        while i < len(part):
            j = i
            while j < len(part) and part[j] == part[i]:
                j += 1
            ring = part[i][0]
            out.append(_Run(i, j - i, ring, part[i][1], sum(k[0] == ring for k in part[:i]),
                            sum(k[0] == ring for k in kinds[:period])))
            i = j
        return out

    return period, n // period, runs(kinds[:period]), runs(kinds[:n % period])


def _at(tree, i: int | jax.Array):
    """Every leaf's entry ``i`` of its leading (layer) axis."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def run_layers_cached(x_BSD: jax.Array, stacked, cache: KVCache, start: jax.Array,
                      adapters=None, consts=(), *, graphdef: nnx.GraphDef,
                      lora: LoraSpec | None, path: str,
                      layers: tuple | None = None,
                      windows: tuple[int | None, ...] | None = None
                      ) -> tuple[jax.Array, KVCache]:
    """Runs the layers over new tokens, each layer reading and writing its part of the cache.

    The cached counterpart of :func:`~effijax.models._layers._run_layers`: the layer module is
    called as ``layer(x_BSD, None, hooks, *consts, cache=LayerCache(...), window=w)`` (no
    ``window`` for a global layer) and returns ``(x_BSD, cache)`` (its attention calls
    :func:`attend_layer`). No dropout, no remat (inference). ``windows`` holds each layer's
    sliding window (None: global; default: none); :func:`cache_slots` places the layers in the
    cache, whose shapes must match them.

    The layers run as the module docstring says: an outer scan over the periods of the layers'
    kinds, a scan per run of equal layers inside, the cache as the carry. With ``layers``
    (:func:`split_layers` of the stack: one buffer per layer) the loop is unrolled over them
    instead: inside a scan XLA:CPU copies each layer's slice of a stacked weight before its
    matmul, which for one token (a matrix-vector product, bound by reading the weights) doubles
    the memory traffic.
    """
    n = jax.tree.leaves(stacked)[0].shape[0]
    slots = cache_slots(cache, (None,) * n if windows is None else tuple(windows))

    def call(carry, layer, ring, index, window, layer_state=None):
        x_BSD, cache = carry
        layer_state = _at(stacked, layer) if layer_state is None else layer_state
        layer_adapters = None if adapters is None else _at(adapters, layer)
        hooks = None if layer_adapters is None else _lora_hooks(layer_adapters, lora, None, path)
        x_BSD, cache = nnx.merge(graphdef, layer_state)(
            x_BSD, None, hooks, *consts, cache=LayerCache(cache, ring, index, start),
            **({} if window is None else {"window": window}))
        return _constrain(x_BSD), cache

    carry = (x_BSD, cache)
    if layers is not None:
        for i, slot in enumerate(slots):
            carry = call(carry, i, slot.ring, slot.index, slot.window, layers[i])
        return carry

    period, repeats, runs, rest = _schedule(slots)

    def run(carry, g, r: _Run):
        def one(carry, j):
            return call(carry, g * period + r.offset + j, r.ring,
                        g * r.per_period + r.before + j, r.window), None

        if r.length == 1:
            return one(carry, 0)[0]
        return jax.lax.scan(one, carry, jnp.arange(r.length, dtype=jnp.int32))[0]

    def group(carry, g):
        for r in runs:
            carry = run(carry, g, r)
        return carry, None

    if repeats == 1:
        carry = group(carry, 0)[0]
    else:
        carry = jax.lax.scan(group, carry, jnp.arange(repeats, dtype=jnp.int32))[0]
    for r in rest:
        carry = run(carry, repeats, r)
    return carry


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
