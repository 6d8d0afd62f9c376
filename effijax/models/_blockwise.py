"""Blockwise (flash) attention: online softmax over key blocks, memory linear in sequence length.

The forward pass walks the keys one block of ``block_k`` at a time for each block of ``block_q``
queries, keeping per query row the running max ``m``, the running denominator ``l`` and the
unnormalised output ``o`` (all f32), rescaled by ``exp(m_old - m_new)`` whenever the max grows:
the online softmax of Milakov & Gimelshein (2018) extended to ``o`` (as derived in the lecture
notes "LLM Training Acceleration", "From Online Softmax To Flash Attention"). Only
``[block_q, block_k]`` scores exist at any time.

The backward pass is FlashAttention-2's (Dao 2023, algorithm 2): a :func:`jax.custom_vjp` saves
``q, k, v``, the output ``o`` and the log-sum-exp ``lse = m + log l`` (f32, one per query row
and head), and recomputes each block's probabilities as ``exp(s - lse)``. With
``D = rowsum(dO * O)``: ``dV += Pᵀ dO``, ``dP = dO Vᵀ``, ``dS = P * (dP - D)``,
``dQ += dS K``, ``dK += dSᵀ Q``; the ``s x s`` matrix is never stored. Under causal masking the
blocks entirely above the diagonal are skipped (the loops' bounds depend on the block index),
not just masked.

Sequence lengths that do not divide by the block sizes are padded up to a multiple (padded keys
are masked, padded query rows are sliced off); blocks never exceed the sequence, so short
sequences use one block. Scores, softmax statistics and accumulators are f32, and the output
comes back in the inputs' dtype. bf16 inputs multiply in bf16 (FlashAttention-2's arithmetic:
``P`` and ``dS`` are rounded to bf16 before their matmuls, every sum is f32); f32 and f16
inputs multiply in f32 (f16's range is too narrow for ``dS``). On a CPU every bf16 tile matmul
takes the layout XLA:CPU multiplies natively (the left operand contracting its last axis; ``dK``
and ``dV`` are summed transposed from ``Qᵀ`` and ``dOᵀ``): SmolLM2's heads at 4 x 512 tokens,
forward + backward, 68 -> 48 ms against the f32 tiles of before (f32 inputs: unchanged, bit
for bit).

Dropout (on the probabilities, as :func:`~effijax.models.attend` does) is supported: each
``(query block, key block)`` tile draws its mask from ``fold_in(dropout_key, tile index)``, so
the backward pass regenerates it instead of storing ``s x s`` bits. The masks depend on the block
sizes and differ from :func:`~effijax.models.attend`'s (same distribution, other draws).

Packed rows: ``segments_BS`` (int ``[B, S]``, self-attention only) restricts every query to the
keys of its own segment (``seg_q == seg_k``, on top of the causal mask): the examples packed
into one row do not see each other. The segment mask is applied inside each tile, in the forward
and in the recomputation of the backward pass, so the gradient is that of the masked softmax.
Every query sees at least itself, so no row is empty. Without segments the kernel is unchanged
(the tile mask is the ``[Q, C]`` causal one).

Sliding window (Mistral, Gemma 3's local layers): with ``window=w`` query ``i`` sees keys
``i - w < j <= i`` (``w`` keys, itself included: Hugging Face's ``sliding_window``). The loops
start at the first key block the window reaches (forward) and stop at the last query block that
reaches a key block (backward), so whole tiles outside the window are skipped, not masked: about
``S / block_q · (w / block_k + 2)`` tiles instead of ``S² / (2 · block_q · block_k)``, compute
``O(S·w)``; the partial tiles on the window's edge are masked. ``w`` is an int or a traced int32
scalar (a per-layer window scanned with the layers): it is a loop bound, not a shape.

Grouped-query attention: ``k`` and ``v`` may have fewer heads than ``q`` (``H_kv`` dividing
``H``; query head ``h`` reads kv head ``h // (H // H_kv)``, Hugging Face Llama's ``repeat_kv``).
The kv heads are never repeated: the kernel works in the layout ``q [B, H_kv, S, G, K]``,
``k, v [B, H_kv, T, K]`` (``G = H / H_kv``; one transpose in and out), and a tile stacks the
``G`` heads of a query block's rows, ``[Q·G, K]`` against ``[C, K]`` per kv head, so the
group's ``dk, dv`` are summed inside the tile's own contraction.

Tiles that need no mask (every key before every query of the block, inside every row's window,
no padded keys, no segments) run in their own loop without one; only the tiles on the diagonal,
the window's edge or the padding build and apply the mask. Measured on XLA:CPU (2 cores, f32,
SmolLM2's 9 heads over 3 kv heads of 64, 4 x 512 tokens, forward + backward): 145 ms with this
layout and 64 x 64 blocks against 279 ms for the kernel that repeated the kv heads and masked
every tile with 128 x 128 blocks, and 119 ms for ``torch``'s ``scaled_dot_product_attention``;
475 vs 796 ms (``torch`` 339) at 1,024 tokens.

Block sizes default to :func:`default_block_size` of each length: 64 below 1,024 tokens, 256
from there (``benchmarks/attention.py --blocks``: on XLA:CPU tiles of 256 ran the forward +
backward 1.3-1.9x faster than tiles of 64 from 1,024 tokens).

On a GPU, bf16/f16 inputs without dropout, segments or a traced window go to
``jax.nn.dot_product_attention(..., implementation="cudnn")`` (cuDNN's fused flash attention,
grouped heads and a static window included) unless ``implementation="jax"``.

Shape suffixes: ``B`` batch, ``S`` queries, ``T`` keys, ``H`` heads, ``K`` head width,
``Q``/``C`` a query/key block, ``N`` kv heads, ``G`` query heads per kv head, ``R`` a tile's
``Q·G`` rows.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from effijax.errors import ConfigError, whole_number
from effijax.models._backend import target_backend
from effijax.models._dense import keep, materialize, unkeep

__all__ = ["IMPLEMENTATIONS", "REMAT_POLICIES", "blockwise_attend", "check_qkv",
           "cudnn_unusable_reason", "default_block_size", "tiles_visited"]

# ``implementation=`` values: None picks cuDNN where it applies, else the pure-JAX kernel.
IMPLEMENTATIONS = (None, "jax", "cudnn")

# Finite "minus infinity": exp(_MASKED - m) underflows to 0 for any real m, and unlike -inf it
# never produces inf - inf = nan in the running max of a row that has seen only masked keys.
_MASKED = -1e30

# ``jax.checkpoint`` policies for blocks with blockwise attention (entries for the GPT's
# ``REMAT``). Its residuals are linear in s, so saving its output and log-sum-exp (named
# "attention_out", "attention_lse" below) across the remat boundary keeps the attention forward
# out of the backward pass's recomputation for O(s·h) bytes per layer; "block_save_attention"
# is "block" plus those two, "dots_save_attention" is "dots" plus those two.
REMAT_POLICIES = {
    "block_save_attention": jax.checkpoint_policies.save_only_these_names(
        "attention_out", "attention_lse"
    ),
    "dots_save_attention": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("attention_out", "attention_lse"),
    ),
}


# default_block_size's rule: blocks of SHORT tokens below LONG tokens, of LONG_BLOCK from there
# (benchmarks/attention.py --blocks measures it).
SHORT, LONG_BLOCK, LONG = 64, 256, 1024


def default_block_size(length: int) -> int:
    """The query (or key) block size :func:`blockwise_attend` takes for ``length`` queries (or
    keys) when none is given: 64 below 1,024 (the whole sequence when shorter), 256 from there.

    Measured on XLA:CPU (2 cores, f32, forward + backward, SmolLM2's and Gemma 3's head shapes;
    ``benchmarks/attention.py --blocks``): from 1,024 tokens tiles of 256 ran 1.3-1.9x faster
    than tiles of 64 (their matmuls are larger; the upper triangle's skipped share stays large),
    1.4-1.5x under Gemma 3's sliding window of 512, and a SmolLM2 LoRA train step of 2 x 1,024
    tokens took 15.4 s instead of 21.2 (medians of 3 interleaved steps). Below 1,024 no size won
    at every shape: one tile or 128 ran the op up to 1.5x faster at 4 rows of 128-512 tokens, but
    64 was the fastest at 8 rows of 512, so 64 stays there until whole steps are measured.

    Example:
      >>> [default_block_size(n) for n in (16, 64, 512, 1023, 1024, 8192)]
      [16, 64, 64, 64, 256, 256]
    """
    length = whole_number("length", length)
    return min(length, SHORT) if length < LONG else LONG_BLOCK


def _block_size(name: str, block: int | None, length: int) -> int:
    """Argument ``name``'s block size for ``length`` positions: ``block`` checked, or
    :func:`default_block_size` when None; capped at ``length``."""
    return min(default_block_size(length) if block is None else whole_number(name, block), length)


class _Spec(NamedTuple):
    """Static description of one padded problem (hashable: a ``custom_vjp`` nondiff argument)."""

    causal: bool
    block_q: int
    block_k: int
    seq_q: int  # real (unpadded) query length
    seq_k: int  # real (unpadded) key length
    dropout_rate: float
    windowed: bool = False  # a sliding window (its size is an int32 argument: it may be traced)


def blockwise_attend(q_BSHK: jax.Array, k_BTHK: jax.Array, v_BTHK: jax.Array, *,
                     causal: bool = True, block_q: int | None = None,
                     block_k: int | None = None,
                     dropout_rate: float = 0.0, dropout_key: jax.Array | None = None,
                     implementation: str | None = None,
                     segments_BS: jax.Array | None = None,
                     window: int | jax.Array | None = None) -> jax.Array:
    """Multi-head attention in blocks, with the semantics of :func:`~effijax.models.attend`.

    Memory is ``O(B·H·(S + T)·K)``: no ``[S, T]`` scores are kept for the backward pass (a
    custom VJP recomputes them block by block from ``q, k, v``, the output and the per-row
    log-sum-exp).

    Args:
      q_BSHK: queries ``[B, S, H, K]``. k_BTHK, v_BTHK: keys and values ``[B, T, H_kv, K]``,
        the queries' dtype; ``H_kv`` divides ``H`` (grouped-query attention when smaller).
      causal: query ``i`` sees keys ``0..i`` (needs ``S == T``); blocks above the diagonal are
        skipped.
      block_q, block_k: query and key block sizes (capped at ``S`` and ``T``); lengths that do not
        divide are padded up to a multiple. None (the default): :func:`default_block_size` of
        ``S`` and of ``T``.
      dropout_rate: probability of dropping an attention probability (inverted dropout).
      dropout_key: PRNG key for the dropout masks; ``None`` disables dropout (as in ``attend``).
      implementation: ``None`` (cuDNN flash attention on a GPU for bf16/f16 without dropout
        or segments, else the pure-JAX blockwise kernel), ``"jax"`` (always the pure-JAX
        kernel) or ``"cudnn"`` (always cuDNN; raises where it does not apply).
      segments_BS: optional int ``[B, S]`` segment ids of a packed row (needs ``S == T``):
        queries attend only to keys with the same id.
      window: sliding window (needs ``causal``): query ``i`` sees keys ``i - window < j <= i``;
        an int or a traced int32 scalar; None: all earlier keys. Tiles outside it are skipped.

    Returns:
      ``[B, S, H, K]`` outputs in the queries' dtype.

    Raises:
      ValueError: before tracing, for mismatched shapes or dtypes, ``H`` not a multiple of
        ``H_kv``, ``causal`` with ``S != T``, bad block sizes, a dropout rate outside
        ``[0, 1)``, an unknown ``implementation``, segments that are not ``[B, S]``
        integers, or a window that is not a positive integer (or one without ``causal``).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from effijax.models import attend
      >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 100, 2, 8))
      >>> out = blockwise_attend(q, k, v, block_q=32, block_k=32)  # 100 = 3 x 32 + 4: padded
      >>> out.shape, bool(jnp.allclose(out, attend(q, k, v), atol=1e-5))
      ((1, 100, 2, 8), True)
      >>> seg = jnp.array([[1] * 60 + [2] * 40])  # two examples packed in one row
      >>> out = blockwise_attend(q, k, v, block_q=32, block_k=32, segments_BS=seg)
      >>> bool(jnp.allclose(out[:, 60:], attend(q[:, 60:], k[:, 60:], v[:, 60:]), atol=1e-5))
      True
      >>> out = blockwise_attend(q, k, v, block_q=32, block_k=32, window=20)
      >>> bool(jnp.allclose(out, attend(q, k, v, window=20), atol=1e-5))
      True
    """
    groups = check_qkv("blockwise_attend", q_BSHK, k_BTHK, v_BTHK, causal=causal,
                       segments_BS=segments_BS, window=window)
    s, t = q_BSHK.shape[1], k_BTHK.shape[1]
    block_q, block_k = _block_size("block_q", block_q, s), _block_size("block_k", block_k, t)
    if not isinstance(dropout_rate, int | float) or not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate: expected a rate in [0, 1), got {dropout_rate!r}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation: unknown {implementation!r}; choose one of {IMPLEMENTATIONS}"
        )
    dropout = dropout_key is not None and dropout_rate > 0.0
    segmented = segments_BS is not None

    auto_cudnn = (implementation is None and cudnn_unusable_reason(
        q_BSHK, dropout, segments=segmented, window=window) is None)
    if implementation == "cudnn" or auto_cudnn:
        if dropout or segmented or is_traced_window(window):
            missing = ("dropout" if dropout else "segment ids" if segmented
                       else "traced (per-layer) window")
            raise ValueError(
                f"blockwise_attend(implementation='cudnn') has no {missing}; use "
                "implementation='jax'" + (" or dropout_rate=0" if dropout else "")
            )
        return jax.nn.dot_product_attention(
            q_BSHK, k_BTHK, v_BTHK, is_causal=causal, implementation="cudnn",
            local_window_size=None if window is None else (int(window) - 1, 0)
        )

    spec = _Spec(causal, block_q, block_k, s, t, float(dropout_rate) if dropout else 0.0,
                 window is not None)
    pad_s, pad_t = -s % block_q, -t % block_k
    q_pad = jnp.pad(q_BSHK, ((0, 0), (0, pad_s), (0, 0), (0, 0))) if pad_s else q_BSHK
    if pad_t:
        k_BTHK = jnp.pad(k_BTHK, ((0, 0), (0, pad_t), (0, 0), (0, 0)))
        v_BTHK = jnp.pad(v_BTHK, ((0, 0), (0, pad_t), (0, 0), (0, 0)))
    key = dropout_key if dropout else None
    if segmented:  # padded queries and keys get id -1 (padded keys are masked anyway)
        segments_BS = segments_BS.astype(jnp.int32)
        seg_q_BS = jnp.pad(segments_BS, ((0, 0), (0, pad_s)), constant_values=-1)
        seg_k_BT = jnp.pad(segments_BS, ((0, 0), (0, pad_t)), constant_values=-1)
        segments = (seg_q_BS, seg_k_BT)
    else:
        segments = None
    # A window of T or more keys is no window; clamping keeps the loop bounds' sums in int32.
    win = None if window is None else jnp.minimum(jnp.asarray(window, jnp.int32), t)
    # The kernel's layout: kv heads ahead of the sequence, each query row's group of heads
    # (those sharing a kv head) next to it, so a tile is one batched [Q·G, C] product per kv head.
    b, s_pad, h, d = q_pad.shape
    n = h // groups
    q_BNSGK = q_pad.reshape(b, s_pad, n, groups, d).transpose(0, 2, 1, 3, 4)
    out_BNSGK = _flash(spec, q_BNSGK, k_BTHK.transpose(0, 2, 1, 3), v_BTHK.transpose(0, 2, 1, 3),
                       key, segments, win)
    out_BSHK = out_BNSGK.transpose(0, 2, 1, 3, 4).reshape(b, s_pad, h, d)
    return out_BSHK[:, :s] if pad_s else out_BSHK


def check_qkv(name: str, q_BSHK, k_BTHK, v_BTHK, *, causal: bool, segments_BS=None,
              window=None) -> int:
    """Validates attention inputs before tracing; returns the group size ``H // H_kv``.

    ``segments_BS`` (optional) must be integer ``[B, S]`` ids of a self-attention (``S == T``).
    ``window`` (optional) is a causal sliding window: a whole number >= 1, or an integer scalar
    array (traced: a per-layer window; its value is not checked).

    Shared by every implementation of :data:`~effijax.models.ATTENTION` so that they refuse the
    same inputs with the same messages, each naming the function (``name``).

    Example:
      >>> import jax.numpy as jnp
      >>> q, kv = jnp.ones((1, 4, 4, 8)), jnp.ones((1, 4, 2, 8))
      >>> check_qkv("attend", q, kv, kv, causal=True)
      2
      >>> check_qkv("attend", q, jnp.ones((1, 4, 3, 8)), jnp.ones((1, 4, 3, 8)), causal=True)
      Traceback (most recent call last):
      ...
      ValueError: attend: q has H=4 heads, k and v have H_kv=3; grouped-query attention ...
      >>> check_qkv("attend", q, kv, kv, causal=False, window=2)
      Traceback (most recent call last):
      ...
      ValueError: attend: window=2 needs causal=True (query i sees keys i - window < j <= i)
    """
    if q_BSHK.ndim != 4 or k_BTHK.ndim != 4 or v_BTHK.ndim != 4:
        raise ValueError(
            f"{name}: expected q [B, S, H, K], k and v [B, T, H_kv, K]; got shapes "
            f"{q_BSHK.shape}, {k_BTHK.shape}, {v_BTHK.shape}"
        )
    b, s, h, d = q_BSHK.shape
    t, h_kv = k_BTHK.shape[1], k_BTHK.shape[2]
    if k_BTHK.shape != (b, t, h_kv, d) or v_BTHK.shape != k_BTHK.shape:
        raise ValueError(
            f"{name}: k and v must be [B={b}, T, H_kv, K={d}] and equal; got "
            f"{k_BTHK.shape} and {v_BTHK.shape}"
        )
    if h % h_kv:
        raise ValueError(
            f"{name}: q has H={h} heads, k and v have H_kv={h_kv}; grouped-query attention "
            "needs H to be a multiple of H_kv (query head h reads kv head h // (H // H_kv))"
        )
    if not (q_BSHK.dtype == k_BTHK.dtype == v_BTHK.dtype):
        raise ValueError(
            f"{name}: q, k, v dtypes differ ({q_BSHK.dtype}, {k_BTHK.dtype}, "
            f"{v_BTHK.dtype}); cast them to one compute dtype"
        )
    if causal and s != t:
        raise ValueError(f"{name}(causal=True) needs S == T, got S={s}, T={t}")
    if segments_BS is not None:
        shape, dtype = tuple(segments_BS.shape), jnp.dtype(segments_BS.dtype)
        if shape != (b, s) or s != t or not jnp.issubdtype(dtype, jnp.integer):
            raise ValueError(
                f"{name}: segments_BS must be integer ids [B={b}, S={s}] of a self-attention "
                f"(S == T, got T={t}); got {dtype.name}{list(shape)}"
            )
    if window is not None:
        _check_window(name, window, causal)
    return h // h_kv


def _check_window(name: str, window, causal: bool) -> None:
    if is_traced_window(window):
        if window.shape != () or not jnp.issubdtype(window.dtype, jnp.integer):
            raise ValueError(f"{name}: window must be an integer scalar; got "
                             f"{jnp.dtype(window.dtype).name}{list(window.shape)}")
    else:
        try:
            whole_number("window", window)
        except ConfigError as e:
            raise ValueError(f"{name}: {e}; window=None attends to every earlier key") from None
    if not causal:
        raise ValueError(f"{name}: window={window} needs causal=True (query i sees keys "
                         "i - window < j <= i)")


def is_traced_window(window) -> bool:
    """Whether ``window`` is an array (a per-layer window scanned with the layers), whose value
    is unknown when tracing, rather than a Python integer (or None).

    Example:
      >>> import jax.numpy as jnp
      >>> is_traced_window(4), is_traced_window(None), is_traced_window(jnp.int32(4))
      (False, False, True)
    """
    return isinstance(window, jax.Array)


def cudnn_unusable_reason(q_BSHK, dropout: bool, backend: str | None = None, *,
                          segments: bool = False, window=None) -> str | None:
    """Why cuDNN's fused attention cannot run these queries here, or None when it can.

    It needs a GPU, bf16/f16 inputs, a head width that is a multiple of 8 and at most 128 (the
    limit before Hopper; cuDNN allows 256 from sm90, not relied on here), no dropout, no
    segment ids (``jax.nn.dot_product_attention``'s cuDNN path takes only lengths, not the
    segments of packed rows) and a sliding ``window`` that is a Python int or None (cuDNN's
    ``sliding_window_length`` is static; a traced per-layer window is not).
    ``q_BSHK`` may be an array or a ``jax.ShapeDtypeStruct``; ``backend`` defaults to
    :func:`target_backend` (``jax.default_backend()`` outside :func:`attention_backend`).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> q = jax.ShapeDtypeStruct((1, 8, 2, 64), jnp.bfloat16)
      >>> cudnn_unusable_reason(q, dropout=False, backend="gpu") is None
      True
      >>> cudnn_unusable_reason(q, dropout=False, backend="cpu")
      'no GPU (backend cpu)'
    """
    backend = target_backend() if backend is None else backend
    head_dim = q_BSHK.shape[-1]
    if backend != "gpu":
        return f"no GPU (backend {backend})"
    if q_BSHK.dtype not in (jnp.bfloat16, jnp.float16):
        return f"{jnp.dtype(q_BSHK.dtype).name} inputs (cuDNN needs bf16 or f16)"
    if head_dim % 8 or head_dim > 128:
        return f"head width {head_dim} (cuDNN needs a multiple of 8, at most 128)"
    if dropout:
        return "attention dropout (cuDNN's kernel here has none)"
    if segments:
        return "segment ids of packed rows (cuDNN's kernel here takes none)"
    if is_traced_window(window):
        return "a traced (per-layer) sliding window (cuDNN's window is static)"
    return None


# ----------------------------------------------------------------------------------------------
# The kernel: padded inputs, static spec.


def _tile_mask(spec: _Spec, i, j, groups: int, segments=None, win=None) -> jax.Array:
    """Which (query, key) pairs of tile (i, j) take part: ``[Q·G, C]`` bool (row ``q·G + g`` is
    query ``q``'s head ``g`` of its group), or with ``segments`` (the padded
    ``(seg_q_BS, seg_k_BT)``) ``[B, 1, Q·G, C]``, broadcasting over kv heads. ``win``: the
    sliding window (int32 scalar) when ``spec.windowed``."""
    rows = i * spec.block_q + jnp.arange(spec.block_q)
    cols = j * spec.block_k + jnp.arange(spec.block_k)
    mask_QC = cols[None, :] < spec.seq_k  # padded keys never count
    if spec.causal:
        mask_QC = mask_QC & (cols[None, :] <= rows[:, None])
    if spec.windowed:
        mask_QC = mask_QC & (cols[None, :] > rows[:, None] - win)
    if segments is not None:
        seg_q_BS, seg_k_BT = segments
        seg_BQ = _slice(seg_q_BS, i * spec.block_q, spec.block_q)
        seg_BC = _slice(seg_k_BT, j * spec.block_k, spec.block_k)
        mask_QC = (mask_QC[None] & (seg_BQ[:, :, None] == seg_BC[:, None, :]))[:, None]
    if groups > 1 and mask_QC.shape[-2] > 1:  # a [1, C] mask (no causal rows) broadcasts
        mask_QC = jnp.repeat(mask_QC, groups, axis=-2)
    return mask_QC


def _keep_mask(spec: _Spec, key, i, j, num_k_blocks: int, shape_BNRC, groups: int) -> jax.Array:
    """The tile's dropout keep-mask ``[B, N, Q·G, C]``, regenerated identically in the forward
    and backward pass. Drawn as ``[B, H, Q, C]`` (``H = N·G``), so the draws do not depend on
    how the kernel lays the heads out."""
    b, n, _, c = shape_BNRC
    tile_key = jax.random.fold_in(key, i * num_k_blocks + j)
    keep_BHQC = jax.random.bernoulli(tile_key, 1.0 - spec.dropout_rate,
                                     (b, n * groups, spec.block_q, c))
    keep = keep_BHQC.reshape(b, n, groups, spec.block_q, c).transpose(0, 1, 3, 2, 4)
    return keep.reshape(shape_BNRC)


def _unmasked_k_blocks(spec: _Spec, i, num_k_blocks: int, win):
    """Key blocks whose tile with query block ``i`` needs no mask (every pair visible):
    ``[first, end)``, where every key precedes every query (causal), lies inside every row's
    window and is a real key (not padding)."""
    end = (i * spec.block_q + 1) // spec.block_k if spec.causal else num_k_blocks
    end = jnp.minimum(end, spec.seq_k // spec.block_k)
    if not spec.windowed:
        return 0, end
    first = -(-((i + 1) * spec.block_q - win) // spec.block_k)  # ceil: the window's first
    return jnp.maximum(first, 0), end


def _unmasked_q_blocks(spec: _Spec, j, num_q_blocks: int, win):
    """Query blocks whose tile with key block ``j`` needs no mask: ``[first, end)`` (empty
    when the key block holds padding)."""
    first = -(-((j + 1) * spec.block_k - 1) // spec.block_q) if spec.causal else 0
    end = (j * spec.block_k + win) // spec.block_q if spec.windowed else num_q_blocks
    return first, jnp.where((j + 1) * spec.block_k <= spec.seq_k, end, 0)


def _num_k_blocks_for(spec: _Spec, i, num_k_blocks: int):
    """Key blocks query block ``i`` needs: all of them, or up to the diagonal when causal."""
    if not spec.causal:
        return num_k_blocks
    return jnp.minimum(((i + 1) * spec.block_q - 1) // spec.block_k + 1, num_k_blocks)


def _first_k_block_for(spec: _Spec, i, win):
    """First key block query block ``i`` needs: 0, or with a window the block of the earliest
    key its first row sees, ``i·Q - win + 1``."""
    if not spec.windowed:
        return 0
    return jnp.maximum(i * spec.block_q - win + 1, 0) // spec.block_k


def _first_q_block_for(spec: _Spec, j):
    """First query block that sees key block ``j`` (0 unless causal)."""
    if not spec.causal:
        return 0
    return (j * spec.block_k) // spec.block_q


def _q_blocks_end_for(spec: _Spec, j, num_q_blocks: int, win):
    """One past the last query block that sees key block ``j``: all of them, or with a window
    the block of the last row that sees its last key, ``(j + 1)·C - 1 + win - 1``."""
    if not spec.windowed:
        return num_q_blocks
    return jnp.minimum(((j + 1) * spec.block_k + win - 2) // spec.block_q + 1, num_q_blocks)


def tiles_visited(s: int, *, block_q: int | None = None, block_k: int | None = None,
                  window: int | None = None) -> tuple[int, int]:
    """How many ``(query block, key block)`` tiles the causal kernel computes for ``S = T = s``:
    ``(forward, backward)``, from the loop bounds the kernel itself uses (block sizes as
    :func:`blockwise_attend` takes them: None is :func:`default_block_size`).

    Example:
      >>> tiles_visited(1024, block_q=64, block_k=64)  # 16 x 17 / 2: the lower triangle
      (136, 136)
      >>> tiles_visited(1024, block_q=64, block_k=64, window=64)  # two per query block
      (31, 31)
      >>> tiles_visited(1024)  # the default blocks from 1,024 tokens, 256: 4 x 5 / 2
      (10, 10)
    """
    block_q, block_k = _block_size("block_q", block_q, s), _block_size("block_k", block_k, s)
    spec = _Spec(True, block_q, block_k, s, s, 0.0, window is not None)
    nq, nk = -(-s // block_q), -(-s // block_k)
    win = None if window is None else min(window, s)
    forward = sum(int(_num_k_blocks_for(spec, i, nk)) - int(_first_k_block_for(spec, i, win))
                  for i in range(nq))
    backward = sum(int(_q_blocks_end_for(spec, j, nq, win)) - int(_first_q_block_for(spec, j))
                   for j in range(nk))
    return forward, backward


def _slice(x, start, size, axis=1):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _tile_loops(body, lo, hi, free, *, lead: bool, trail: bool, masked_only: bool, init):
    """Runs ``body(j, acc, masked)`` for ``j`` in ``[lo, hi)``, cut into ``[lo, a)``,
    ``[a, b)``, ``[b, hi)``: ``[a, b)`` is the part of ``free`` (a ``(first, end)`` range,
    possibly empty) inside it, run without a mask, the others with it. ``lead``/``trail``:
    whether masked tiles can precede/follow the free ones (static; a loop that is always empty
    is not traced). ``masked_only``: one masked loop (segments: every tile needs its mask)."""
    def run(start, stop, masked, acc):
        return jax.lax.fori_loop(start, stop, lambda j, a: body(j, a, masked), acc)

    if masked_only:
        return run(lo, hi, True, init)
    a = jnp.clip(free[0], lo, hi) if lead else lo
    b = jnp.clip(free[1], a, hi) if trail else hi
    acc = run(lo, a, True, init) if lead else init
    acc = run(a, b, False, acc)
    return run(b, hi, True, acc) if trail else acc


def _rows(x_BNSGK, i, size):
    """Query block ``i`` as ``[B, N, Q·G, K]`` rows (``q·G + g``), or ``[B, N, Q·G]``."""
    block = _slice(x_BNSGK, i * size, size, axis=2)
    return block.reshape(block.shape[:2] + (-1,) + block.shape[4:])


def _add_xt_y(acc, x_BNRC, y_BNRK, yT_BNKR):
    """``acc + xᵀ y`` summed over a tile's rows in f32 (``dV += Pᵀ dO``, ``dK += dSᵀ Q``).

    With ``yT_BNKR`` (``y`` transposed, as 16-bit tiles on a CPU take it) ``acc`` is held
    transposed, ``[B, N, K, C]``, and gains ``yᵀ x``: XLA:CPU multiplies 16-bit operands natively
    only when the left one contracts its last axis, and ``xᵀ y`` itself (a view, or a copy,
    of ``xᵀ``) was upcast to f32 (3x slower on a bf16 tile of 192 x 64 rows). Otherwise one
    matmul in ``[B, N, C, K]`` (f32 tiles: the same bits as before)."""
    if yT_BNKR is None:
        return acc + _mm("bnrc,bnrk->bnck", x_BNRC.astype(y_BNRK.dtype), y_BNRK)
    return acc + _mm("bnkr,bnrc->bnkc", yT_BNKR, x_BNRC)


def _tile_dtype(dtype) -> jnp.dtype:
    """The dtype a tile's matmuls take their operands in: bf16 for bf16 inputs (FlashAttention-2's
    choice: ``P`` and ``dS`` are rounded to bf16 before their matmuls, every sum is f32), f32
    otherwise (f16's range is too narrow for ``dS``)."""
    return jnp.dtype(jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.float32)


def _mm(equation: str, a, b):
    """A tile's matmul: operands in one dtype, the sum in f32."""
    return jnp.einsum(equation, a, b.astype(a.dtype), preferred_element_type=jnp.float32)


def _query_rows(q_BNSGK, i, size, td, scale):
    """Query block ``i``'s rows for the tiles' matmuls: in f32 pre-scaled by ``1/√K`` (the scores
    then need no scaling), in bf16 unscaled (the f32 scores and sums are scaled instead: no
    extra bf16 rounding)."""
    rows = _rows(q_BNSGK, i, size)
    return rows.astype(jnp.float32) * scale if td == jnp.float32 else rows.astype(td)


def _forward(spec: _Spec, q_BNSGK, k_BNTK, v_BNTK, key, segments=None, win=None,
             out_dtype=None):
    """Returns the output ``[B, N, S, G, K]`` (in ``out_dtype``, default the input dtype) and the
    row log-sum-exp ``[B, N, S, G]`` (f32). Each query block's ``Q·G`` rows (the ``G`` query
    heads sharing a kv head) meet each key block in one ``[Q·G, C]`` tile. Ring attention
    (``_ring.py``) asks for f32 outputs, which it merges across key chunks by their
    log-sum-exp."""
    b, n, s_pad, g, d = q_BNSGK.shape
    nq, nk = s_pad // spec.block_q, k_BNTK.shape[2] // spec.block_k
    bq, bk = spec.block_q, spec.block_k
    scale = jnp.float32(1.0 / math.sqrt(d))
    keep = 1.0 - spec.dropout_rate

    td = _tile_dtype(q_BNSGK.dtype)
    # Kᵀ once: each tile's Q Kᵀ then contracts its left operand's last axis and its right
    # operand's first, the layout XLA:CPU's fast (bf16) GEMM takes.
    kT_BNKT = jnp.swapaxes(k_BNTK, 2, 3).astype(td)
    after = 1.0 if td == jnp.float32 else scale  # see _query_rows

    def query_block(i, carry):
        out_BNSGK, lse_BNSG = carry
        q_BNRK = _query_rows(q_BNSGK, i, bq, td, scale)

        def key_block(j, acc, masked):
            m_BNR, l_BNR, o_BNRK = acc
            v_BNCK = _slice(v_BNTK, j * bk, bk, axis=2).astype(td)
            s_BNRC = _mm("bnrk,bnkc->bnrc", q_BNRK, _slice(kT_BNKT, j * bk, bk, axis=3)) * after
            if masked:
                mask_RC = _tile_mask(spec, i, j, g, segments, win)  # [B, 1, R, C] with segments
                s_BNRC = jnp.where(mask_RC, s_BNRC, _MASKED)
            m_new_BNR = jnp.maximum(m_BNR, jnp.max(s_BNRC, axis=-1))
            p_BNRC = jnp.exp(s_BNRC - m_new_BNR[..., None])
            if masked:
                p_BNRC = jnp.where(mask_RC, p_BNRC, 0.0)
            alpha_BNR = jnp.exp(m_BNR - m_new_BNR)
            l_BNR = alpha_BNR * l_BNR + jnp.sum(p_BNRC, axis=-1)
            if key is not None:  # the denominator uses the undropped probabilities
                drop = _keep_mask(spec, key, i, j, nk, p_BNRC.shape, g)
                p_BNRC = jnp.where(drop, p_BNRC / keep, 0.0)
            o_BNRK = alpha_BNR[..., None] * o_BNRK + _mm("bnrc,bnck->bnrk",
                                                           p_BNRC.astype(td), v_BNCK)
            return m_new_BNR, l_BNR, o_BNRK

        rows = bq * g
        init = (jnp.full((b, n, rows), _MASKED, jnp.float32), jnp.zeros((b, n, rows), jnp.float32),
                jnp.zeros((b, n, rows, d), jnp.float32))
        m_BNR, l_BNR, o_BNRK = _tile_loops(
            key_block, _first_k_block_for(spec, i, win), _num_k_blocks_for(spec, i, nk),
            _unmasked_k_blocks(spec, i, nk, win), lead=spec.windowed,
            trail=spec.causal or spec.seq_k % bk != 0, masked_only=segments is not None,
            init=init)
        # Padded query rows may see no key at all (l = 0); they are sliced off, keep them finite.
        l_BNR = jnp.where(l_BNR > 0.0, l_BNR, 1.0)
        o_BNQGK = (o_BNRK / l_BNR[..., None]).reshape(b, n, bq, g, d).astype(out_BNSGK.dtype)
        out_BNSGK = jax.lax.dynamic_update_slice_in_dim(out_BNSGK, o_BNQGK, i * bq, axis=2)
        lse_BNSG = jax.lax.dynamic_update_slice_in_dim(
            lse_BNSG, (m_BNR + jnp.log(l_BNR)).reshape(b, n, bq, g), i * bq, axis=2
        )
        return out_BNSGK, lse_BNSG

    init = (jnp.zeros(q_BNSGK.shape, q_BNSGK.dtype if out_dtype is None else out_dtype),
            jnp.zeros((b, n, s_pad, g), jnp.float32))
    return jax.lax.fori_loop(0, nq, query_block, init)


def _backward(spec: _Spec, q_BNSGK, k_BNTK, v_BNTK, key, segments, win, out_BNSGK, lse_BNSG,
              dout_BNSGK):
    """FlashAttention-2's backward: loops over key blocks, then over the query blocks that see
    them, recomputing ``P = exp(S - lse)`` per tile; returns f32 ``dq, dk, dv``. The gradients
    of the ``G`` query heads sharing a kv head are summed inside the tile's contraction."""
    b, n, s_pad, g, d = q_BNSGK.shape
    t_pad = k_BNTK.shape[2]
    nq, nk = s_pad // spec.block_q, t_pad // spec.block_k
    bq, bk = spec.block_q, spec.block_k
    scale = jnp.float32(1.0 / math.sqrt(d))
    keep = 1.0 - spec.dropout_rate
    # D_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij (also with dropout: O uses the dropped P).
    delta_BNSG = jnp.einsum(
        "bnsgk,bnsgk->bnsg", dout_BNSGK.astype(jnp.float32), out_BNSGK.astype(jnp.float32)
    )

    td = _tile_dtype(q_BNSGK.dtype)
    after = 1.0 if td == jnp.float32 else scale  # see _query_rows
    # 16-bit tiles on a CPU: dK and dV are summed transposed from Qᵀ and dOᵀ (see _add_xt_y),
    # transposed once here (rows r = s·G + g, as _rows makes them), as their own buffers: XLA
    # would fold a transpose back into the matmul, which XLA:CPU then fails to run in 16 bits.
    flip = td != jnp.float32 and target_backend() == "cpu"
    if flip:
        qT_BNKR, doT_BNKR = (
            materialize(jnp.swapaxes(x.reshape(b, n, s_pad * g, d).astype(td), 2, 3))
            for x in (q_BNSGK, dout_BNSGK))

    def key_block(j, carry):
        dq_BNSGK, dk_BNTK, dv_BNTK = carry
        k_BNCK = _slice(k_BNTK, j * bk, bk, axis=2).astype(td)
        # Q Kᵀ and dO Vᵀ contract their left operand's last axis and their right operand's
        # first (XLA:CPU's fast GEMM layout): Kᵀ and Vᵀ once per key block.
        kT_BNKC = jnp.swapaxes(k_BNCK, 2, 3)
        vT_BNKC = jnp.swapaxes(_slice(v_BNTK, j * bk, bk, axis=2).astype(td), 2, 3)

        def query_block(i, acc, masked):
            dq_BNSGK, dk_BNCK, dv_BNCK = acc
            q_BNRK = _query_rows(q_BNSGK, i, bq, td, scale)
            do_BNRK = _rows(dout_BNSGK, i, bq).astype(td)
            qT_rows, doT_rows = ((_slice(x, i * bq * g, bq * g, axis=3)
                                  for x in (qT_BNKR, doT_BNKR)) if flip else (None, None))
            lse_BNR = _rows(lse_BNSG, i, bq)
            delta_BNR = _rows(delta_BNSG, i, bq)
            s_BNRC = _mm("bnrk,bnkc->bnrc", q_BNRK, kT_BNKC) * after
            p_BNRC = jnp.exp(s_BNRC - lse_BNR[..., None])
            if masked:
                p_BNRC = jnp.where(_tile_mask(spec, i, j, g, segments, win), p_BNRC, 0.0)
            dp_BNRC = _mm("bnrk,bnkc->bnrc", do_BNRK, vT_BNKC)
            if key is not None:
                drop = _keep_mask(spec, key, i, j, nk, p_BNRC.shape, g)
                pd_BNRC = jnp.where(drop, p_BNRC / keep, 0.0)
                dp_BNRC = jnp.where(drop, dp_BNRC / keep, 0.0)
            else:
                pd_BNRC = p_BNRC
            dv_BNCK = _add_xt_y(dv_BNCK, pd_BNRC, do_BNRK, doT_rows)
            ds_BNRC = p_BNRC * (dp_BNRC - delta_BNR[..., None])
            dk_BNCK = _add_xt_y(dk_BNCK, ds_BNRC, q_BNRK, qT_rows)
            dq_BNQGK = (_mm("bnrc,bnck->bnrk", ds_BNRC.astype(td), k_BNCK) * scale).reshape(
                b, n, bq, g, d)
            dq_BNSGK = jax.lax.dynamic_update_slice_in_dim(
                dq_BNSGK, _slice(dq_BNSGK, i * bq, bq, axis=2) + dq_BNQGK, i * bq, axis=2
            )
            return dq_BNSGK, dk_BNCK, dv_BNCK

        # dK and dV of the key block, [B, N, C, K] (held [B, N, K, C] while flipped)
        zeros = jnp.zeros((b, n, d, bk) if flip else (b, n, bk, d), jnp.float32)
        dq_BNSGK, dk_BNCK, dv_BNCK = _tile_loops(
            query_block, _first_q_block_for(spec, j), _q_blocks_end_for(spec, j, nq, win),
            _unmasked_q_blocks(spec, j, nq, win), lead=spec.causal,
            trail=spec.windowed or spec.seq_k % bk != 0, masked_only=segments is not None,
            init=(dq_BNSGK, zeros, zeros))
        if flip:  # own buffers first: XLA could fold this transpose into the last tile's
            # matmul (seen with ring attention's one-tile chunks), which XLA:CPU fails to run
            dk_BNCK, dv_BNCK = (jnp.swapaxes(materialize(x), 2, 3) for x in (dk_BNCK, dv_BNCK))
        dk_BNTK = jax.lax.dynamic_update_slice_in_dim(dk_BNTK, dk_BNCK * after, j * bk, axis=2)
        dv_BNTK = jax.lax.dynamic_update_slice_in_dim(dv_BNTK, dv_BNCK, j * bk, axis=2)
        return dq_BNSGK, dk_BNTK, dv_BNTK

    init = (
        jnp.zeros((b, n, s_pad, g, d), jnp.float32),
        jnp.zeros((b, n, t_pad, d), jnp.float32),
        jnp.zeros((b, n, t_pad, d), jnp.float32),
    )
    return jax.lax.fori_loop(0, nk, key_block, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(spec: _Spec, q_BNSGK, k_BNTK, v_BNTK, key, segments=None, win=None):
    out_BNSGK, _ = _forward(spec, q_BNSGK, k_BNTK, v_BNTK, key, segments, win)
    return out_BNSGK


def _flash_fwd(spec: _Spec, q_BNSGK, k_BNTK, v_BNTK, key, segments=None, win=None):
    out_BNSGK, lse_BNSG = _forward(spec, q_BNSGK, k_BNTK, v_BNTK, key, segments, win)
    # Named so that a remat policy (REMAT_POLICIES) can keep them across a checkpoint boundary.
    out_BNSGK = checkpoint_name(out_BNSGK, "attention_out")
    lse_BNSG = checkpoint_name(lse_BNSG, "attention_lse")
    # 16-bit residuals cross the layers' scan as their bits on a CPU (models._dense.keep):
    # XLA:CPU stacked them through f32 (SmolLM2's bf16 LoRA step at 4 x 512 tokens: 9.05 s,
    # 8.56 s with the bits).
    return out_BNSGK, (keep(q_BNSGK), keep(k_BNTK), keep(v_BNTK), key, segments, win,
                       keep(out_BNSGK), lse_BNSG)


def _flash_bwd(spec: _Spec, residuals, dout_BNSGK):
    q_BNSGK, k_BNTK, v_BNTK, key, segments, win, out_BNSGK, lse_BNSG = (
        unkeep(r) for r in residuals)
    dq, dk, dv = _backward(spec, q_BNSGK, k_BNTK, v_BNTK, key, segments, win, out_BNSGK,
                           lse_BNSG, dout_BNSGK)
    no_segments = None if segments is None else (None, None)
    return (dq.astype(q_BNSGK.dtype), dk.astype(k_BNTK.dtype), dv.astype(v_BNTK.dtype), None,
            no_segments, None)


_flash.defvjp(_flash_fwd, _flash_bwd)
