"""Attention implementations, chosen by name (a config's ``attention``), all with one signature.

Every entry of :data:`ATTENTION` is ``fn(q_BSHK, k_BTHK, v_BTHK, *, causal=True,
dropout_rate=0.0, dropout_key=None, segments_BS=None, window=None) -> out_BSHK`` with the same
semantics (scaled dot product, f32 softmax, causal mask ``key <= query``, inverted dropout on
the probabilities, with ``segments_BS`` (int ``[B, S]``, the ids of the examples packed into a
row) attention only between positions of the same segment, and with ``window`` a sliding window):

* ``"naive"``: :func:`attend`, the reference; materialises the ``[B, H, S, T]`` scores.
* ``"blockwise"``: :func:`~effijax.models.blockwise_attend`, flash attention in pure JAX with a
  custom VJP; memory linear in the sequence length (cuDNN on a GPU for bf16/f16).
* ``"xla"``: :func:`xla_attend`, ``jax.nn.dot_product_attention``: cuDNN's fused kernel on a GPU
  where it applies, XLA's composed attention elsewhere. No dropout.
* ``"auto"``: :func:`auto_attend`, the fused kernel where it can run, otherwise the best other
  implementation (:func:`choose_attention`; on a CPU ``"blockwise"``, measured, see
  :data:`CPU_ATTENTION`); on a GPU a fallback says why, once per reason.

The choices that depend on the device (``"auto"``, and cuDNN's kernel in ``"xla"`` and
``"blockwise"``) are made when tracing, for ``jax.default_backend()``; a step traced here for
another platform (``jax.export`` for cuda on a CPU host) is traced inside
:func:`~effijax.models.attention_backend`, which makes them for that platform.

Segments cost nothing when absent: without them every implementation runs exactly its unsegmented
code. Each query always sees itself, so no softmax row is empty (padding, with its own id, only
sees padding).

Sliding window (local attention: Mistral, Gemma 3's local layers): with ``window=w`` query ``i``
sees the keys ``i - w < j <= i``, ``w`` keys counting itself. That is Hugging Face's
``sliding_window`` convention for Mistral and Gemma 3 alike (transformers 5's
``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``); ``jax.nn.dot_product_attention``
calls it ``local_window_size=(w - 1, 0)``. ``w`` is a Python int (static: cuDNN and XLA's
window) or an int32 scalar array (traced: a per-layer window scanned with the layers, applied
as a mask; the blockwise kernel skips tiles either way). ``w >= S`` is plain causal attention.

Context parallelism: under a mesh (``jax.set_mesh``) with a ``context`` axis above 1 that
divides the sequence, every entry of :data:`ATTENTION` runs as
:func:`~effijax.models.context_attend` (ring attention, each device holding its contiguous chunk
of the sequence, the blockwise kernel for its local work); dropout is refused there. The
models' trunk (:mod:`effijax.models._decoder`) goes further where ``2 x context`` divides the
sequence: its layers run in the load-balanced order and their attention tells
:func:`~effijax.models.context_attend` so (``load_balanced=True``).

All accept grouped-query attention: ``k`` and ``v`` may have ``H_kv`` heads, ``H_kv`` dividing
``H``, query head ``h`` reading kv head ``h // (H // H_kv)`` (Hugging Face Llama's convention).

Shape suffixes: ``B`` batch, ``S`` queries, ``T`` keys, ``H`` heads, ``K`` head width.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from effijax.errors import ConfigError
from effijax.models._blockwise import (
    blockwise_attend,
    check_qkv,
    cudnn_unusable_reason,
    is_traced_window,
    target_backend,
)
from effijax.models._dense import _context_degree, cpu_layout, kept_vjp
from effijax.models._layers import _dropout
from effijax.models._ring import context_attend
from effijax.precision import dot, softmax
from effijax.sharding import CONTEXT_AXIS

__all__ = [
    "ATTENTION",
    "AttentionChoice",
    "AttentionFallbackWarning",
    "CPU_ATTENTION",
    "attend",
    "auto_attend",
    "choose_attention",
    "segment_mask",
    "window_mask",
    "xla_attend",
]


def attend(q_BSHK: jax.Array, k_BTHK: jax.Array, v_BTHK: jax.Array, *, causal: bool = True,
           dropout_rate: float = 0.0, dropout_key: jax.Array | None = None,
           segments_BS: jax.Array | None = None,
           window: int | jax.Array | None = None) -> jax.Array:
    """Naive multi-head attention: materialises the ``[B, H, S, T]`` scores.

    Scores and the weighted sum use :func:`dot` (f32 accumulation); the softmax runs in f32 and
    returns the inputs' dtype. Dropout on the probabilities is applied when ``dropout_key`` is
    given and ``dropout_rate > 0``.

    Args:
      q_BSHK: queries. k_BTHK, v_BTHK: keys and values, same dtype as the queries; they may have
        fewer heads ``H_kv`` (grouped-query attention, ``H_kv`` dividing ``H``).
      causal: mask out keys after each query (query ``i`` sees keys ``0..i``; needs ``S == T``).
      dropout_rate: probability of dropping an attention probability.
      dropout_key: PRNG key for the dropout mask; ``None`` disables dropout.
      segments_BS: optional int ``[B, S]`` segment ids (self-attention, ``S == T``): query
        ``i`` sees key ``j`` only when ``segments_BS[:, i] == segments_BS[:, j]``.
      window: sliding window (needs ``causal``): query ``i`` sees keys ``i - window < j <= i``
        (Hugging Face's ``sliding_window``); an int or an int32 scalar array; None: no window.

    Returns:
      ``[B, S, H, K]`` attention outputs in the queries' dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> attend(jnp.ones((1, 3, 2, 4)), jnp.ones((1, 3, 2, 4)), jnp.ones((1, 3, 2, 4))).shape
      (1, 3, 2, 4)
      >>> v = jnp.arange(4.0).reshape(1, 4, 1, 1)  # equal scores: the mean of the visible values
      >>> attend(jnp.ones((1, 4, 1, 1)), jnp.ones((1, 4, 1, 1)), v, window=2)[0, :, 0, 0].tolist()
      [0.0, 0.5, 1.5, 2.5]
      >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 5, 2, 4))
      >>> packed = attend(q, k, v, segments_BS=jnp.array([[1, 1, 2, 2, 2]]))
      >>> bool(jnp.allclose(packed[:, 2:], attend(q[:, 2:], k[:, 2:], v[:, 2:]), atol=1e-6))
      True
    """
    groups = check_qkv("attend", q_BSHK, k_BTHK, v_BTHK, causal=causal,
                       segments_BS=segments_BS, window=window)
    if groups > 1:  # grouped-query attention; autodiff of the repeat sums each group's gradients
        k_BTHK = jnp.repeat(k_BTHK, groups, axis=2)
        v_BTHK = jnp.repeat(v_BTHK, groups, axis=2)
    mask_ST = None
    if causal:
        s, t = q_BSHK.shape[1], k_BTHK.shape[1]
        mask_ST = jnp.tril(jnp.ones((s, t), dtype=bool))
    if window is not None:
        mask_ST = mask_ST & window_mask(window, q_BSHK.shape[1])
    if segments_BS is not None:
        mask_ST = segment_mask(segments_BS, mask_ST)  # [B, 1, S, T]
    core = functools.partial(_attend_core, dropout_rate=dropout_rate)
    if cpu_layout(q_BSHK.dtype):  # its 16-bit residuals cross the layers' scan as bits
        core = kept_vjp(core)
    return core(q_BSHK, k_BTHK, v_BTHK, mask_ST, dropout_key)


def _attend_core(q_BSHK, k_BTHK, v_BTHK, mask_ST, dropout_key, *, dropout_rate: float):
    q_BSHK = q_BSHK * jnp.asarray(1.0 / math.sqrt(q_BSHK.shape[-1]), q_BSHK.dtype)
    scores_BHST = dot("bshk,bthk->bhst", q_BSHK, k_BTHK)
    probs_BHST = softmax(scores_BHST, axis=-1, where=mask_ST)
    probs_BHST = _dropout(probs_BHST, dropout_rate, dropout_key)
    return dot("bhst,bthk->bshk", probs_BHST, v_BTHK)


def segment_mask(segments_BS: jax.Array, mask_ST: jax.Array | None = None) -> jax.Array:
    """``[B, 1, S, S]`` bool: position ``i`` may attend to ``j`` of the same segment (and where
    ``mask_ST``, e.g. the causal mask, allows it); the ``1`` broadcasts over heads.

    Example:
      >>> import jax.numpy as jnp
      >>> segment_mask(jnp.array([[1, 1, 2]]))[0, 0].astype(int).tolist()
      [[1, 1, 0], [1, 1, 0], [0, 0, 1]]
    """
    mask_BST = segments_BS[:, :, None] == segments_BS[:, None, :]
    if mask_ST is not None:
        mask_BST = mask_BST & mask_ST[None]
    return mask_BST[:, None]


def window_mask(window: int | jax.Array, s: int) -> jax.Array:
    """``[S, S]`` bool: query ``i`` may attend to key ``j`` when ``j > i - window`` (the
    window's left edge; combine it with the causal mask).

    Example:
      >>> window_mask(2, 3).astype(int).tolist()
      [[1, 1, 1], [1, 1, 1], [0, 1, 1]]
    """
    index_S = jnp.arange(s, dtype=jnp.int32)
    return index_S[None, :] > index_S[:, None] - jnp.asarray(window, jnp.int32)


def xla_attend(q_BSHK: jax.Array, k_BTHK: jax.Array, v_BTHK: jax.Array, *, causal: bool = True,
               dropout_rate: float = 0.0, dropout_key: jax.Array | None = None,
               segments_BS: jax.Array | None = None,
               window: int | jax.Array | None = None) -> jax.Array:
    """Attention by ``jax.nn.dot_product_attention``: cuDNN's fused kernel where it applies.

    On a GPU with bf16/f16 inputs, a head width that is a multiple of 8 up to 128 and no dropout
    this is ``implementation="cudnn"`` (flash attention, causal blocks skipped); everywhere else
    ``implementation="xla"`` (the scores in f32, an f32 softmax, probabilities in the inputs'
    dtype: :func:`attend`'s math, with the ``1/sqrt(K)`` scale applied to the f32 scores
    instead of the queries). Grouped-query attention is native to both. With ``segments_BS``
    the ``"xla"`` implementation runs with the segments' boolean mask (cuDNN's path here takes
    sequence lengths, not segments), even on a GPU. An int ``window`` is
    ``local_window_size=(window - 1, 0)`` (cuDNN's ``sliding_window_length=window`` under its
    causal mask); a traced one is a boolean mask on the ``"xla"`` implementation.

    Args:
      q_BSHK, k_BTHK, v_BTHK, causal, segments_BS, window: as in :func:`attend`.
      dropout_rate, dropout_key: only for the common signature: ``jax.nn.dot_product_attention``
        has no dropout, so a positive rate with a key raises.

    Returns:
      ``[B, S, H, K]`` outputs in the queries' dtype.

    Raises:
      ValueError: before tracing, for the inputs :func:`attend` refuses, and for dropout.

    Example (each compiled, as a model's forward pass runs it; an int window stays static):

      >>> import jax, jax.numpy as jnp
      >>> fused, naive = (jax.jit(f, static_argnames="window") for f in (xla_attend, attend))
      >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 6, 4, 8))
      >>> out = fused(q, k[:, :, :2], v[:, :, :2])  # 4 query heads, 2 kv heads
      >>> bool(jnp.allclose(out, naive(q, k[:, :, :2], v[:, :, :2]), atol=1e-5))
      True
      >>> bool(jnp.allclose(fused(q, k, v, window=3), naive(q, k, v, window=3), atol=1e-5))
      True
    """
    check_qkv("xla_attend", q_BSHK, k_BTHK, v_BTHK, causal=causal, segments_BS=segments_BS,
              window=window)
    if dropout_key is not None and dropout_rate > 0.0:
        raise ValueError(
            f"xla_attend: jax.nn.dot_product_attention has no dropout, got dropout_rate="
            f"{dropout_rate}; set GPTConfig.dropout=0, or use attention='auto' (falls back to "
            "an implementation with dropout), 'naive' or 'blockwise'"
        )
    segmented = segments_BS is not None
    # A static window is a static argument of jax's kernels; a traced one joins the mask.
    static = None if window is None or is_traced_window(window) else int(window)
    traced = window if is_traced_window(window) else None
    if cudnn_unusable_reason(q_BSHK, dropout=False, segments=segmented, window=window) is None:
        return _sdpa(q_BSHK, k_BTHK, v_BTHK, causal, static, "cudnn")
    if q_BSHK.dtype == jnp.float32:
        return _sdpa(q_BSHK, k_BTHK, v_BTHK, causal, static, "xla", segments_BS, traced)
    return _sdpa_half(q_BSHK, k_BTHK, v_BTHK, causal, static, segments_BS, traced)


def _sdpa(q_BSHK, k_BTHK, v_BTHK, causal: bool, window: int | None, implementation: str,
          segments_BS=None, traced_window=None) -> jax.Array:
    mask = None  # is_causal adds causality, local_window_size the static window
    if traced_window is not None:
        mask = window_mask(traced_window, q_BSHK.shape[1])[None, None]
    if segments_BS is not None:
        mask = segment_mask(segments_BS, None if mask is None else mask[0, 0])
    # jax's XLA path asks promote_types(bf16, f32) for its f32 scores, which strict promotion
    # refuses when tracing; the promotion is intended there (the output keeps the inputs' dtype).
    with jax.numpy_dtype_promotion("standard"):
        return jax.nn.dot_product_attention(
            q_BSHK, k_BTHK, v_BTHK, mask=mask, is_causal=causal, implementation=implementation,
            local_window_size=None if window is None else (window - 1, 0))


# The XLA path with bf16/f16 inputs. jax's forward is fine, but its backward cannot be compiled
# under strict dtype promotion (jax 0.10.2): the transpose of the scores' einsum is a dot with
# ``DotAlgorithmPreset.BF16_BF16_F32``, an f32 cotangent and a bf16 operand, and lowering it asks
# ``promote_types(f32, bf16)``, which strict promotion refuses (at compile time, outside any
# ``numpy_dtype_promotion`` context we could set here). So the backward is jax's own VJP of the
# same function on f32 copies of q, k, v (no algorithm preset on that path), recomputing the
# scores from the saved q, k, v (flash attention's trade: no [B, H, S, T] residual, one more
# forward); the gradients are cast back to the inputs' dtype. At least as precise as jax's own
# backward (whose BF16_BF16_F32 dots take their operands in bf16), and it only runs off cuDNN: on
# a CPU (where bf16 is emulated anyway) or for a GPU head width cuDNN refuses.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _sdpa_half(q_BSHK, k_BTHK, v_BTHK, causal: bool, window: int | None, segments_BS=None,
               traced_window=None) -> jax.Array:
    return _sdpa(q_BSHK, k_BTHK, v_BTHK, causal, window, "xla", segments_BS, traced_window)


def _sdpa_half_fwd(q_BSHK, k_BTHK, v_BTHK, causal, window, segments_BS=None, traced_window=None):
    out_BSHK = _sdpa(q_BSHK, k_BTHK, v_BTHK, causal, window, "xla", segments_BS, traced_window)
    return out_BSHK, (q_BSHK, k_BTHK, v_BTHK, segments_BS, traced_window)


def _sdpa_half_bwd(causal, window, residuals, dout_BSHK):
    *qkv, segments_BS, traced_window = residuals
    f32 = lambda x: x.astype(jnp.float32)
    _, vjp_fn = jax.vjp(
        lambda q, k, v: _sdpa(q, k, v, causal, window, "xla", segments_BS, traced_window),
        *map(f32, qkv))
    grads = tuple(g.astype(x.dtype) for g, x in zip(vjp_fn(f32(dout_BSHK)), qkv, strict=True))
    return (*grads, None, None)


_sdpa_half.defvjp(_sdpa_half_fwd, _sdpa_half_bwd)


# ----------------------------------------------------------------------------------------------
# "auto": the fused kernel where it runs, else the best fallback.

# What "auto" runs without a GPU: blockwise. Measured on XLA:CPU, fp32, the mini and small GPTs'
# train steps and their attention op alone (benchmarks/attention.py, RESULTS.md "Attention
# implementations on this device"; 2 shared cores, so noisy): blockwise was the fastest of the
# three in every column of the recorded run (small step median 6.08 s vs 6.48 xla, 6.54 naive;
# op best 192 ms vs 200, 215; mini op best 36.7 ms vs 47.9, 38.7), and within 7% of the fastest
# in three earlier runs; the three are within ~25% for the op and ~10% for the step. Its advantage
# grows with the sequence (causal tiles above the diagonal are skipped, not masked: 1 of 4 at
# S=256), its memory is linear in S, and it has dropout, so "auto" needs no second fallback.
CPU_ATTENTION = "blockwise"
# A GPU without the fused kernel: XLA's composed attention; with dropout, the naive one (the
# same math plus the mask). Neither was measured on a GPU here.
GPU_FALLBACK, GPU_FALLBACK_DROPOUT = "xla", "naive"


class AttentionFallbackWarning(UserWarning):
    """``attention="auto"`` on a GPU could not use the fused kernel; the message says why."""


class AttentionChoice(NamedTuple):
    """What ``"auto"`` runs: an :data:`ATTENTION` name, whether that is cuDNN's fused kernel,
    and, on a GPU that cannot use it, why not (None otherwise)."""

    name: str
    fused: bool
    reason: str | None


def choose_attention(q_BSHK, *, dropout: bool, backend: str | None = None,
                     segments: bool = False, window=None) -> AttentionChoice:
    """The implementation ``"auto"`` uses for these queries on ``backend``.

    A pure function of the queries' dtype and head width, whether dropout is on, whether the
    rows are packed (``segments``: cuDNN's kernel here takes no segment ids), whether the
    sliding ``window`` is traced (cuDNN's is static), and the backend
    (default :func:`~effijax.models.target_backend`: ``jax.default_backend()``, or the one
    an :func:`~effijax.models.attention_backend` block names): a GPU gets cuDNN's fused kernel
    (through :func:`xla_attend`) when
    :func:`~effijax.models._blockwise.cudnn_unusable_reason` allows it, else a fallback with
    the reason. Other backends silently get :data:`CPU_ATTENTION` (with or
    without dropout): there is no fused kernel to fall back from.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> q = jax.ShapeDtypeStruct((2, 128, 4, 32), jnp.float32)
      >>> choose_attention(q, dropout=False, backend="cpu")
      AttentionChoice(name='blockwise', fused=False, reason=None)
      >>> choose_attention(q, dropout=False, backend="gpu").reason
      "attention='auto': float32 inputs (cuDNN needs bf16 or f16); using 'xla'"
      >>> q16 = jax.ShapeDtypeStruct((2, 128, 4, 32), jnp.bfloat16)
      >>> choose_attention(q16, dropout=False, backend="gpu")
      AttentionChoice(name='xla', fused=True, reason=None)
      >>> choose_attention(q16, dropout=False, backend="gpu", segments=True).reason
      "attention='auto': segment ids of packed rows (cuDNN's kernel here takes none); using 'xla'"
    """
    backend = target_backend() if backend is None else backend
    if backend != "gpu":
        return AttentionChoice(CPU_ATTENTION, False, None)
    why = cudnn_unusable_reason(q_BSHK, dropout, backend, segments=segments, window=window)
    if why is None:
        return AttentionChoice("xla", True, None)
    name = GPU_FALLBACK_DROPOUT if dropout else GPU_FALLBACK
    return AttentionChoice(name, False, f"attention='auto': {why}; using {name!r}")


_warned: set[str] = set()


def auto_attend(q_BSHK: jax.Array, k_BTHK: jax.Array, v_BTHK: jax.Array, *, causal: bool = True,
                dropout_rate: float = 0.0, dropout_key: jax.Array | None = None,
                segments_BS: jax.Array | None = None,
                window: int | jax.Array | None = None) -> jax.Array:
    """:func:`attend`'s semantics by the implementation :func:`choose_attention` picks.

    The choice is made when tracing, from static facts (dtype, head width, dropout, backend).
    On a GPU that cannot use the fused kernel it emits one :class:`AttentionFallbackWarning` per
    distinct reason per process.

    Example:
      >>> import jax.numpy as jnp
      >>> auto_attend(jnp.ones((1, 3, 2, 4)), jnp.ones((1, 3, 1, 4)), jnp.ones((1, 3, 1, 4))).shape
      (1, 3, 2, 4)
    """
    dropout = dropout_key is not None and dropout_rate > 0.0
    choice = choose_attention(q_BSHK, dropout=dropout, segments=segments_BS is not None,
                              window=window)
    if choice.reason is not None and choice.reason not in _warned:
        _warned.add(choice.reason)
        warnings.warn(choice.reason, AttentionFallbackWarning, stacklevel=2)
    return ATTENTION[choice.name](q_BSHK, k_BTHK, v_BTHK, causal=causal,
                                  dropout_rate=dropout_rate, dropout_key=dropout_key,
                                  segments_BS=segments_BS, window=window)


def _context_parallel_attend(q_BSHK, k_BSHK, v_BSHK, *, causal=True, dropout_rate=0.0,
                            dropout_key=None, segments_BS=None, window=None,
                            load_balanced: bool) -> jax.Array:
    """Self-attention over the ``context`` axis of the mesh set by ``jax.set_mesh``:
    :func:`~effijax.models.context_attend` (ring attention), with :func:`attend`'s signature
    plus ``load_balanced`` (the sequence is in :func:`~effijax.models.to_load_balanced` order;
    False: natural order, each device holding its contiguous chunk).

    Raises:
      ValueError: dropout (``dropout_key`` given and ``dropout_rate > 0``): ring attention
        has none; and what :func:`~effijax.models.context_attend` refuses.
    """
    n = _context_degree()
    if dropout_key is not None and dropout_rate > 0.0:
        raise ValueError(f"attention over a context axis ({CONTEXT_AXIS}={n}) has no "
                         f"dropout, got dropout_rate={dropout_rate}; set the model's "
                         "dropout to 0 or train without a context axis")
    return context_attend(q_BSHK, k_BSHK, v_BSHK, axis=CONTEXT_AXIS, causal=causal,
                          segments_BS=segments_BS, window=window, load_balanced=load_balanced)


def _context_parallel(fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """``fn``, run as :func:`~effijax.models.context_attend` (ring attention over the
    ``context`` axis, each device holding its contiguous chunk of the sequence, the blockwise
    kernel for the local work) when the mesh set by ``jax.set_mesh`` has a ``context`` axis
    above 1 that divides the (self-attention) sequence; ``fn`` itself otherwise. Attention
    dropout has no context-parallel form yet: refused there."""
    @functools.wraps(fn)
    def attention(q_BSHK, k_BTHK, v_BTHK, *, causal=True, dropout_rate=0.0, dropout_key=None,
                  segments_BS=None, window=None):
        n = _context_degree()
        s = q_BSHK.shape[1]
        if n > 1 and s == k_BTHK.shape[1] and s % n == 0:
            return _context_parallel_attend(q_BSHK, k_BTHK, v_BTHK, causal=causal,
                                            dropout_rate=dropout_rate, dropout_key=dropout_key,
                                            segments_BS=segments_BS, window=window,
                                            load_balanced=False)
        return fn(q_BSHK, k_BTHK, v_BTHK, causal=causal, dropout_rate=dropout_rate,
                  dropout_key=dropout_key, segments_BS=segments_BS, window=window)

    return attention


# Attention implementations by a config's ``attention`` name, all with ``attend``'s signature;
# on a mesh with a context axis each runs as ring attention (_context_parallel).
ATTENTION: dict[str, Callable[..., jax.Array]] = {
    name: _context_parallel(fn) for name, fn in {
        "naive": attend,
        "blockwise": blockwise_attend,
        "xla": xla_attend,
        "auto": auto_attend,
    }.items()
}


def keeps_scores(attention: str, q_BSHK, *, dropout: bool, backend: str | None = None) -> bool:
    """Whether the attention setting ``attention`` stores the ``S x S`` scores for the backward
    pass with these queries on ``backend`` (default: this process's, as
    :func:`choose_attention`): what the activation formula's ``blockwise_attention`` is the
    negation of.

    ``"naive"`` stores them; ``"blockwise"`` keeps only the rows' softmax statistics;
    ``"auto"`` keeps none where :func:`choose_attention` picks the blockwise kernel (a CPU) or
    cuDNN's fused one, and stores them where it falls back to a composed attention. ``"xla"``
    named explicitly counts as storing them (XLA's composition does; a GPU may still hand it to
    cuDNN, which would not: a high estimate, never a low one).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> q = jax.ShapeDtypeStruct((1, 512, 8, 64), jnp.float32)
      >>> keeps_scores("auto", q, dropout=False, backend="cpu")
      False
      >>> keeps_scores("auto", q, dropout=False, backend="gpu")  # f32: no cuDNN, 'xla'
      True
      >>> keeps_scores("naive", q, dropout=False)
      True
    """
    if attention == "auto":
        choice = choose_attention(q_BSHK, dropout=dropout, backend=backend)
        return not (choice.fused or choice.name == "blockwise")
    if attention not in ATTENTION:
        raise ConfigError("attention", attention, f"expected one of {sorted(ATTENTION)}")
    return attention != "blockwise"
