"""Ring attention: self-attention with the sequence split over a mesh axis (context parallelism).

Each device of the axis (size ``n``) holds its shard of the sequence: its queries, keys, values
and, for packed rows, their segment ids. In the ``"ring"`` variant the keys and values (with
their segment ids) travel around the axis with ``ppermute``: at step ``r`` device ``i`` holds
device ``i - r``'s, so after ``n - 1`` hops every query has met every key while no device ever
holds more than two shards' K/V (Liu et al. 2023, "Ring Attention with Blockwise Transformers").
The ``"all_gather"`` variant gathers the whole K/V once (Levanter's way, MaxText's fastest at
short axes): the same local work, one collective instead of ``n - 1``, and the full sequence's
K/V on every device for the duration of the layer. :data:`DEFAULT_CONTEXT_VARIANT` is
``"ring"``: the memory split is what context parallelism is for; choose ``"all_gather"`` when
the whole sequence's K/V of one layer fits a device.

The local work is the blockwise kernel's (:mod:`effijax.models._blockwise`): each (query chunk,
key chunk) pair is one call of its forward, with its tiles, masks, GQA layout and skipped tiles,
returning the pair's output and row log-sum-exp in f32; pairs merge by their log-sum-exp
(the online softmax, one level up: ``lse = logaddexp(lse₁, lse₂)``, ``o = o₁·e^(lse₁-lse) +
o₂·e^(lse₂-lse)``). A pair on the diagonal runs the causal kernel; a pair below it (keys
``δ = (a - b)·c`` positions earlier) runs the kernel without the causal mask and, with a sliding
window ``w``, with the window ``w - δ`` (query ``i`` of the pair sees key ``j`` iff
``j > i - (w - δ)``); a pair entirely in the causal future, entirely outside the window, or whose
segment ids cannot meet (their ``[min, max]`` ranges are disjoint in every row: packed rows have
non-decreasing ids, so only a segment spanning the chunk boundary meets) is skipped with
``lax.cond``: never computed, rather than computed and masked.

Load balancing: with a causal mask and contiguous shards, the device holding the sequence's
end would compute ``n`` chunk pairs and the first device one. With ``load_balanced=True`` the
sequence is cut into ``2n`` chunks and device ``i`` holds chunks ``i`` and ``2n - 1 - i``
(MaxText's and torchtitan's layout), so every device computes ``2n + 1`` of the ``n(2n + 1)``
causal pairs. :func:`to_load_balanced` and :func:`from_load_balanced` permute a sequence into
and out of that order; everything
position-wise (norms, MLPs, the loss over permuted targets) runs on the permuted order
unchanged, and positions (rotary angles, packed rows' restarting positions) are computed in
the natural order and permuted with the tokens.

The backward pass is a :func:`jax.custom_vjp`, not autodiff through the loop of hops: autodiff
would keep every step's received K/V (the whole sequence's, on every device) and each
pair's residuals. The forward saves only the local ``q, k, v``, the merged output (f32) and
log-sum-exp; the backward rotates the K/V around the ring again together with their ``dK, dV``
accumulators, runs the kernel's FlashAttention-2 backward for each visible pair with the
*global* output and log-sum-exp (so ``P = exp(S - lse)`` is the true probability and
``D = rowsum(dO·O)`` the true one: exact, not an approximation), and one last hop brings each
shard's ``dK, dV`` home. Memory per device: the residuals are ``O((S/n)·H·K)`` (``q, k, v``
in their dtype, the output in f32, one f32 log-sum-exp per query row and head); the backward
adds the travelling K/V shard and its f32 ``dK, dV``. The all-gather variant's backward holds
the gathered K/V and f32 ``dK, dV`` for the whole sequence, summed over the devices and handed
back with one ``psum_scatter``.

Dtypes follow the kernel: bf16 inputs multiply in bf16 tiles with f32 sums, the merge is f32,
the output and gradients come back in the inputs' dtype. Attention dropout is not offered here
(the kernel's per-tile masks would need the chunk's global tile index; not built yet).

Shape suffixes: ``B`` batch, ``S`` sequence (``T`` keys), ``H`` heads, ``N`` kv heads, ``G``
query heads per kv head, ``K`` head width, ``M`` a device's chunks (2 when load-balanced), ``C``
a chunk's (padded) positions.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from effijax.models._blockwise import _MASKED, _backward, _block_size, _forward, _Spec, check_qkv

__all__ = ["CONTEXT_VARIANTS", "DEFAULT_CONTEXT_VARIANT", "context_attend", "to_load_balanced",
           "from_load_balanced"]

#: How the keys and values reach every query: passed around the axis (``"ring"``) or gathered
#: whole (``"all_gather"``).
CONTEXT_VARIANTS = ("ring", "all_gather")
#: The variant :func:`context_attend` uses unless told: the ring, whose K/V per device stay
#: ``2/n`` of the sequence's (the all-gather's hold all of it).
DEFAULT_CONTEXT_VARIANT = "ring"


class _Ring(NamedTuple):
    """Static description of one sharded problem (hashable: a ``custom_vjp`` nondiff argument)."""

    axis: str
    size: int  # n, the axis' devices
    parts: int  # M, chunks per device: 2 load-balanced, 1 contiguous
    chunk: int  # c, real positions per chunk
    causal: bool
    windowed: bool
    variant: str
    block_q: int
    block_k: int


def _order(n: int, length: int) -> np.ndarray:
    """The load-balanced order of ``length`` positions over ``n`` devices: chunk ``i`` and
    ``2n - 1 - i`` for device ``i``, as positions (static)."""
    chunk = length // (2 * n)
    chunks = [c for i in range(n) for c in (i, 2 * n - 1 - i)]
    return (np.asarray(chunks)[:, None] * chunk + np.arange(chunk)[None, :]).reshape(-1)


def _check_balance(name: str, n, length: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name}: n must be a positive int (the context axis' size), got {n!r}")
    if length % (2 * n):
        raise ValueError(f"{name}: the sequence of {length} positions does not split into "
                         f"2 x n = {2 * n} equal chunks; pad or pack it to a multiple of {2 * n}")


def to_load_balanced(x: jax.Array, n: int, *, axis: int = 1) -> jax.Array:
    """Permutes the sequence axis of ``x`` into ring attention's load-balanced order for ``n``
    devices: cut into ``2n`` chunks, device ``i``'s shard is chunk ``i`` then chunk
    ``2n - 1 - i``. :func:`from_load_balanced` undoes it.

    Example:
      >>> import jax.numpy as jnp
      >>> to_load_balanced(jnp.arange(8)[None], 2, axis=1).tolist()  # chunks 0, 3 | 1, 2
      [[0, 1, 6, 7, 2, 3, 4, 5]]
    """
    _check_balance("to_load_balanced", n, x.shape[axis])
    return jnp.take(x, _order(n, x.shape[axis]), axis=axis)


def from_load_balanced(x: jax.Array, n: int, *, axis: int = 1) -> jax.Array:
    """Undoes :func:`to_load_balanced`: the sequence axis back in its natural order.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.arange(12)[None]
      >>> bool((from_load_balanced(to_load_balanced(x, 3), 3) == x).all())
      True
    """
    _check_balance("from_load_balanced", n, x.shape[axis])
    return jnp.take(x, np.argsort(_order(n, x.shape[axis])), axis=axis)


def context_attend(q_BSHK: jax.Array, k_BSHK: jax.Array, v_BSHK: jax.Array, *,
                axis: str = "context", mesh=None, causal: bool = True,
                segments_BS: jax.Array | None = None, window: int | jax.Array | None = None,
                variant: str = DEFAULT_CONTEXT_VARIANT, load_balanced: bool = True,
                block_q: int | None = None, block_k: int | None = None) -> jax.Array:
    """Self-attention with the sequence split over the mesh axis ``axis``, with
    :func:`~effijax.models.attend`'s semantics (segments, sliding window, grouped-query heads).

    The arrays are global (``jax.shard_map`` splits their sequence axis over ``axis``; the
    mesh's other axes stay automatic). With ``load_balanced`` the sequence is expected in
    :func:`to_load_balanced` order (and the output comes back in it), so a model permutes its
    tokens once, not per layer.

    Args:
      q_BSHK: queries ``[B, S, H, K]``. k_BSHK, v_BSHK: keys and values ``[B, S, H_kv, K]``.
      axis: the mesh axis that splits the sequence.
      mesh: a ``jax.sharding.Mesh`` with ``axis``; None: the mesh set by ``jax.set_mesh``.
      causal: query ``i`` sees keys ``0..i``.
      segments_BS: optional int ``[B, S]`` segment ids of packed rows (in the same order as
        the queries): attention only within a segment; pairs of chunks whose ids cannot meet
        are skipped.
      window: sliding window (needs ``causal``): query ``i`` sees keys ``i - window < j <= i``;
        an int or a traced int32 scalar. Chunk pairs outside it are skipped.
      variant: one of :data:`CONTEXT_VARIANTS`; default :data:`DEFAULT_CONTEXT_VARIANT`.
      load_balanced: the sequence is in :func:`to_load_balanced` order (``2n`` chunks); False:
        device ``i`` holds the ``i``-th of ``n`` contiguous chunks.
      block_q, block_k: the kernel's tile sizes within a chunk (None:
        :func:`~effijax.models.default_block_size` of the chunk).

    Returns:
      ``[B, S, H, K]`` outputs in the queries' dtype, in the inputs' order.

    Raises:
      ValueError: before tracing, for what :func:`~effijax.models.attend` refuses, an unknown
        ``variant``, a mesh without ``axis`` (or no mesh), or a sequence that does not split
        into ``2n`` (load-balanced) or ``n`` equal chunks.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from effijax.models import attend
      >>> mesh = jax.make_mesh((4,), ("context",), devices=jax.devices()[:4],
      ...                      axis_types=(jax.sharding.AxisType.Auto,))
      >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 32, 4, 8))
      >>> seg = jnp.array([[1] * 20 + [2] * 12] * 2)
      >>> ring = jax.jit(lambda q, k, v, seg: context_attend(q, k, v, mesh=mesh, window=6,
      ...                                                    segments_BS=seg))
      >>> out = ring(*(to_load_balanced(x, 4) for x in (q, k, v, seg)))
      >>> ref = attend(q, k, v, window=6, segments_BS=seg)
      >>> bool(jnp.allclose(from_load_balanced(out, 4), ref, atol=1e-5))
      True
    """
    ring, mesh = _plan("context_attend", q_BSHK, k_BSHK, v_BSHK, axis=axis, mesh=mesh,
                       causal=causal, segments_BS=segments_BS, window=window, variant=variant,
                       load_balanced=load_balanced, block_q=block_q, block_k=block_k)
    return _sharded(ring, mesh, counting=False)(q_BSHK, k_BSHK, v_BSHK, segments_BS,
                                                _window(window, q_BSHK.shape[1]))


def _plan(name, q_BSHK, k_BSHK, v_BSHK, *, axis, mesh, causal, segments_BS, window, variant,
          load_balanced, block_q, block_k):
    """Checks everything before tracing; returns the static :class:`_Ring` and the mesh."""
    check_qkv(name, q_BSHK, k_BSHK, v_BSHK, causal=causal, segments_BS=segments_BS,
              window=window)
    if q_BSHK.shape[1] != k_BSHK.shape[1]:
        raise ValueError(f"{name}: self-attention only (S == T), got S={q_BSHK.shape[1]}, "
                         f"T={k_BSHK.shape[1]}")
    if variant not in CONTEXT_VARIANTS:
        raise ValueError(f"{name}: variant: unknown {variant!r}; choose one of "
                         f"{CONTEXT_VARIANTS} (default {DEFAULT_CONTEXT_VARIANT!r})")
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError(f"{name}: no mesh: pass mesh= or call it under jax.set_mesh(mesh)")
    if axis not in mesh.axis_names:
        raise ValueError(f"{name}: axis {axis!r} is not an axis of the mesh "
                         f"{dict(mesh.shape)}; pass axis= one of {tuple(mesh.axis_names)}")
    n, s = mesh.shape[axis], q_BSHK.shape[1]
    parts = 2 if load_balanced else 1
    if s % (n * parts):
        how = (f"2 x {axis}={n} = {2 * n} equal chunks (load_balanced)" if load_balanced
               else f"{axis}={n} equal chunks")
        raise ValueError(f"{name}: the sequence of {s} positions does not split into {how}; "
                         f"pad or pack it to a multiple of {n * parts}")
    chunk = s // (n * parts)
    ring = _Ring(axis, n, parts, chunk, bool(causal), window is not None, variant,
                 _block_size("block_q", block_q, chunk), _block_size("block_k", block_k, chunk))
    return ring, mesh


def _window(window, s: int):
    """The window as an int32 scalar, at most ``s`` (a window of ``S`` or more keys is no
    window; capping keeps the chunk arithmetic's sums in int32)."""
    return None if window is None else jnp.minimum(jnp.asarray(window, jnp.int32), s)


def _sharded(ring: _Ring, mesh, *, counting: bool):
    """The global function: ``shard_map`` over ``ring.axis`` of the per-device work. With
    ``counting`` it returns, per device, how many chunk pairs the forward computed (``[n]``;
    the skipped ones are not counted) instead of the output."""
    seq, rep = P(None, ring.axis), P()

    def local(q_BSHK, k_BSHK, v_BSHK, seg_BS, win):
        b, s, h, d = q_BSHK.shape
        groups = h // k_BSHK.shape[2]
        q = _chunked(q_BSHK, ring, groups)
        k, v = _chunked(k_BSHK, ring, None), _chunked(v_BSHK, ring, None)
        seg_q = seg_k = None
        if seg_BS is not None:
            seg_q, seg_k = (_chunked_ids(seg_BS, ring, block) for block in
                            (ring.block_q, ring.block_k))
        if counting:
            return _ring_forward(ring, q, k, v, seg_q, seg_k, win)[2].reshape(1)
        out = _ring(ring, q, k, v, seg_q, seg_k, win)
        return _unchunked(out, ring, b, s, h, d)

    # check_vma=False: the kernel's loops start from constants (replicated) and carry values
    # that vary over the axis; the backward is our own (custom_vjp), so jax's varying-ness
    # bookkeeping, which exists to transpose collectives under autodiff, has nothing to do.
    return jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, seq, seq, rep),
                         out_specs=P(ring.axis) if counting else seq,
                         axis_names=frozenset({ring.axis}), check_vma=False)


def _padded(length: int, block: int) -> int:
    return -(-length // block) * block


def _chunked(x_BSHK, ring: _Ring, groups: int | None):
    """A device's shard ``[B, M·c, H, K]`` as its chunks in the kernel's layout, each padded to
    a multiple of the block: queries ``[M, B, N, C, G, K]`` (``groups``), keys and values
    ``[M, B, N, C, K]`` (``groups`` None)."""
    b, _, h, d = x_BSHK.shape
    m, c = ring.parts, ring.chunk
    block = ring.block_k if groups is None else ring.block_q
    pad = _padded(c, block) - c
    if groups is None:
        x = x_BSHK.reshape(b, m, c, h, d).transpose(1, 0, 3, 2, 4)
        return jnp.pad(x, ((0, 0),) * 3 + ((0, pad), (0, 0))) if pad else x
    x = x_BSHK.reshape(b, m, c, h // groups, groups, d).transpose(1, 0, 3, 2, 4, 5)
    return jnp.pad(x, ((0, 0),) * 3 + ((0, pad), (0, 0), (0, 0))) if pad else x


def _chunked_ids(seg_BS, ring: _Ring, block: int):
    """Segment ids ``[B, M·c]`` as ``[M, B, C]`` chunks; padding gets id -1 (as the kernel's)."""
    b = seg_BS.shape[0]
    m, c = ring.parts, ring.chunk
    ids = seg_BS.astype(jnp.int32).reshape(b, m, c).transpose(1, 0, 2)
    pad = _padded(c, block) - c
    return jnp.pad(ids, ((0, 0), (0, 0), (0, pad)), constant_values=-1) if pad else ids


def _unchunked(out_MBNCGK, ring: _Ring, b, s, h, d):
    """The inverse of :func:`_chunked` for the output: ``[B, M·c, H, K]``."""
    out = out_MBNCGK[:, :, :, :ring.chunk]
    return out.transpose(1, 0, 3, 2, 4, 5).reshape(b, s, h, d)


def _chunk_index(ring: _Ring, device, part):
    """The global chunk index of ``device``'s chunk ``part`` (0, or 1 when load-balanced)."""
    return jnp.where(part == 0, device, 2 * ring.size - 1 - device)


def _meets(ring: _Ring, qa, kb, seg_q_BC, seg_k_BC, win):
    """Whether query chunk ``qa`` sees anything of another key chunk ``kb``: not itself (the
    diagonal is computed apart), not entirely in the causal future, not entirely outside the
    window, and (with segments) some row where the chunks' id ranges overlap. A traced bool."""
    c = ring.chunk
    ok = (kb < qa) if ring.causal else (kb != qa)
    if ring.windowed:  # the last key is seen by the first query iff c - 1 > -(w - (qa - kb)·c)
        ok = ok & (win - (qa - kb) * c + c - 1 > 0)
    if seg_q_BC is not None:
        q_real, k_real = seg_q_BC[:, :c], seg_k_BC[:, :c]
        overlap_B = ((q_real.min(axis=1) <= k_real.max(axis=1))
                     & (k_real.min(axis=1) <= q_real.max(axis=1)))
        ok = ok & overlap_B.any()
    return ok


def _pair_spec(ring: _Ring, diagonal: bool) -> _Spec:
    """The kernel's spec for a pair: causal on the diagonal, unmasked below it (keys earlier
    than every query), windowed in both when there is a window."""
    return _Spec(ring.causal and diagonal, ring.block_q, ring.block_k, ring.chunk, ring.chunk,
                 0.0, ring.windowed)


def _pair_window(ring: _Ring, qa, kb, win):
    """The kernel's window for a pair: ``w - (qa - kb)·c`` (``w`` on the diagonal), capped at
    the chunk (a window of ``c`` or more sees the whole chunk)."""
    if not ring.windowed:
        return None
    return jnp.minimum(win - (qa - kb) * ring.chunk, ring.chunk)


def _at(x, i):
    """Chunk ``i`` (traced) of ``[M, ...]`` chunks, or None for absent segments."""
    return None if x is None else jax.lax.dynamic_index_in_dim(x, i, keepdims=False)


def _put(x, i, value):
    """``x`` with chunk ``i`` (traced) replaced by ``value`` (a dynamic-update-slice)."""
    return jax.lax.dynamic_update_index_in_dim(x, value, i, 0)


def _add(x, i, value):
    return _put(x, i, _at(x, i) + value)


def _segments(seg_q, seg_k):
    return None if seg_q is None else (seg_q, seg_k)


def _merge(o1, lse1, o2, lse2):
    """Two partial softmax outputs over disjoint keys, merged by their log-sum-exp."""
    lse = jnp.logaddexp(lse1, lse2)
    return (o1 * jnp.exp(lse1 - lse)[..., None] + o2 * jnp.exp(lse2 - lse)[..., None]), lse


def _ring_perm(n: int):
    return [(i, (i + 1) % n) for i in range(n)]


def _passer(ring: _Ring, kv):
    """``following(held, r)``: the K/V (with their ids) of step ``r + 1``, device
    ``me - r - 1``'s, given step ``r``'s: passed on to the neighbour (ring; ``n - 1`` hops, the
    step after the last skipped under a ``lax.cond`` that every device takes alike), or indexed
    out of the K/V gathered once (all-gather). The hop does not depend on the step's work, so
    XLA may overlap the two."""
    n = ring.size
    if ring.variant == "ring":
        def following(held, r):
            return jax.lax.cond(r + 1 < n, lambda: jax.lax.ppermute(
                held, ring.axis, _ring_perm(n)), lambda: held)
        return following
    gathered = jax.lax.all_gather(kv, ring.axis)  # each leaf [n, ...]
    me = jax.lax.axis_index(ring.axis)
    return lambda held, r: jax.tree.map(lambda g: _at(g, (me - r - 1) % n), gathered)


def _steps(ring: _Ring, body, carry, kv):
    """Runs ``body(r, carry, held, src)`` for the ring's steps ``r = 0..n-1``, ``held`` being
    the K/V of device ``src = me - r`` (``kv``, the device's own, at step 0); returns
    ``carry``. One loop, so the pairs' kernels are traced (and compiled) once."""
    me = jax.lax.axis_index(ring.axis)
    following = _passer(ring, kv)

    def step(r, state):
        carry, held = state
        return body(r, carry, held, (me - r) % ring.size), following(held, r)

    return _loop(ring.size, step, (carry, kv))[0]


def _loop(n: int, body, init):
    """``fori_loop(0, n, body, init)`` as a ``while_loop``, for the forward's loops. A
    ``fori_loop`` of static length is a ``scan``; differentiated inside the layers' ``scan``,
    JAX splits the ring's forward into what depends on the layer's inputs and what does not,
    and a ``scan`` saves the part that does not for every iteration: the pair kernel's f32
    initial values, stacked per (step, chunk pair), ``m·s·b·H·K`` f32 per device for each,
    hoisted out of the layers (the custom VJP's own residuals are not). A ``while_loop``
    saves nothing per iteration: the split runs the whole loop again, and the forward here is
    never differentiated (its backward is :func:`_ring_backward`)."""
    def step(state):
        i, carry = state
        return i + 1, body(i, carry)

    return jax.lax.while_loop(lambda state: state[0] < n, step, (jnp.int32(0), init))[1]


def _ring_forward(ring: _Ring, q, k, v, seg_q, seg_k, win):
    """The per-device forward: ``(o [M, B, N, C, G, K] f32, lse [M, B, N, C, G], computed)``,
    ``computed`` the chunk pairs whose kernel ran (the skipped ones are not counted)."""
    me = jax.lax.axis_index(ring.axis)
    m = ring.parts

    def diagonal(a, state):  # each local query chunk with its own keys: the causal kernel
        o, lse, count = state
        qa = _chunk_index(ring, me, a)
        o_a, lse_a = _forward(_pair_spec(ring, True), _at(q, a), _at(k, a), _at(v, a), None,
                              _segments(_at(seg_q, a), _at(seg_k, a)),
                              _pair_window(ring, qa, qa, win), out_dtype=jnp.float32)
        return _put(o, a, o_a), _put(lse, a, lse_a), count + 1

    def visit(r, state, held, src):  # every other visible pair of local queries and held keys
        k, v, seg_k = held
        below = _pair_spec(ring, False)

        def pair(p, state):
            o, lse, count = state
            a, b = p // m, p % m
            qa, kb = _chunk_index(ring, me, a), _chunk_index(ring, src, b)
            q_a, seg_q_a, seg_k_b = _at(q, a), _at(seg_q, a), _at(seg_k, b)

            def run():
                o_ab, lse_ab = _forward(below, q_a, _at(k, b), _at(v, b), None,
                                        _segments(seg_q_a, seg_k_b),
                                        _pair_window(ring, qa, kb, win), out_dtype=jnp.float32)
                o_a, lse_a = _merge(_at(o, a), _at(lse, a), o_ab, lse_ab)
                return _put(o, a, o_a), _put(lse, a, lse_a), count + 1

            return jax.lax.cond(_meets(ring, qa, kb, seg_q_a, seg_k_b, win), run,
                                lambda: state)

        return jax.lax.fori_loop(0, m * m, pair, state)

    state = (jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:-1], _MASKED, jnp.float32),
             jnp.int32(0))
    return _steps(ring, visit, _loop(m, diagonal, state), (k, v, seg_k))


def _ring_backward(ring: _Ring, q, k, v, seg_q, seg_k, win, o, lse, do):
    """The per-device backward: f32 ``dq`` of the local queries and ``dk, dv`` of the local
    keys and values, after every device's queries have met them. Each pair is the kernel's
    backward with the global output and log-sum-exp of its queries."""
    me = jax.lax.axis_index(ring.axis)
    m, n = ring.parts, ring.size

    def pair_grads(spec, a, b, held, qa, kb):
        k, v, seg_k = held
        return _backward(spec, _at(q, a), _at(k, b), _at(v, b), None,
                         _segments(_at(seg_q, a), _at(seg_k, b)),
                         _pair_window(ring, qa, kb, win), _at(o, a), _at(lse, a), _at(do, a))

    def diagonal(a, grads):
        dq, dk, dv = grads
        qa = _chunk_index(ring, me, a)
        dq_a, dk_a, dv_a = pair_grads(_pair_spec(ring, True), a, a, (k, v, seg_k), qa, qa)
        return _add(dq, a, dq_a), _add(dk, a, dk_a), _add(dv, a, dv_a)

    def visit(dq, held, dkv, src):  # dq of the local queries; dk, dv of the held K/V
        below = _pair_spec(ring, False)

        def pair(p, grads):
            dq, dk, dv = grads
            a, b = p // m, p % m
            qa, kb = _chunk_index(ring, me, a), _chunk_index(ring, src, b)

            def run():
                dq_a, dk_b, dv_b = pair_grads(below, a, b, held, qa, kb)
                return _add(dq, a, dq_a), _add(dk, b, dk_b), _add(dv, b, dv_b)

            return jax.lax.cond(_meets(ring, qa, kb, _at(seg_q, a), _at(held[2], b), win),
                                run, lambda: grads)

        dq, *dkv = jax.lax.fori_loop(0, m * m, pair, (dq, *dkv))
        return dq, tuple(dkv)

    zeros_kv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    dq, *own = jax.lax.fori_loop(0, m, diagonal, (jnp.zeros(q.shape, jnp.float32), *zeros_kv))
    held, perm = (k, v, seg_k), _ring_perm(n)
    if ring.variant == "ring":  # the gradients follow their K/V; the n-th hop brings them home
        def step(r, carry, held, src):
            dq, dkv = carry
            dq, dkv = visit(dq, held, dkv, src)
            return dq, jax.lax.ppermute(dkv, ring.axis, perm)

        dq, (dk, dv) = _steps(ring, step, (dq, tuple(own)), held)
        return dq, dk, dv

    # all-gather: this device's gradients for every device's K/V, summed and scattered once
    def gather_step(r, carry, held, src):
        dq, dkv_all = carry
        dq, dkv = visit(dq, held, zeros_kv, src)
        return dq, tuple(_add(acc, src, x) for acc, x in zip(dkv_all, dkv, strict=True))

    dkv_all = tuple(jnp.zeros((n, *x.shape), x.dtype) for x in zeros_kv)
    dq, dkv_all = _steps(ring, gather_step, (dq, dkv_all), held)
    dk, dv = (mine + jax.lax.psum_scatter(x, ring.axis, scatter_dimension=0)
              for mine, x in zip(own, dkv_all, strict=True))
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: _Ring, q, k, v, seg_q, seg_k, win):
    o, _, _ = _ring_forward(ring, q, k, v, seg_q, seg_k, win)
    return o.astype(q.dtype)


def _ring_fwd(ring: _Ring, q, k, v, seg_q, seg_k, win):
    o, lse, _ = _ring_forward(ring, q, k, v, seg_q, seg_k, win)
    return o.astype(q.dtype), (q, k, v, seg_q, seg_k, win, o, lse)


def _ring_bwd(ring: _Ring, residuals, do):
    q, k, v, seg_q, seg_k, win, o, lse = residuals
    dq, dk, dv = _ring_backward(ring, q, k, v, seg_q, seg_k, win, o, lse, do)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)
