"""The output head: the final hidden states' logits, and the head fused with its cross-entropy.

A language model's last matmul makes ``B·S·V`` logits: 4 bytes each in f32, 400 MB for
SmolLM2's 49,152 classes at 4 x 512 tokens, 2.1 GB for Gemma 3's 262,144. Computed whole, the
training step writes them, reduces them twice (the maximum, the sum of exponentials), keeps them
for the backward, reads them again to form ``d logits`` and multiplies that by the kernel: the
largest activation of the step and several passes over memory.

:func:`head_cross_entropy` computes the loss and the accuracy in chunks of the sequence (all of
the batch's rows, so a batch split over devices stays split), in a scan. When the loss is
differentiated, each chunk also forms ``d logits = (softmax - onehot) · d nll`` while its logits
are still at hand and multiplies it out at once: ``dx`` of the chunk (the hidden states' size),
and the kernel's gradient summed over the chunks when the kernel is trained. The loss is a
masked mean, so ``d nll`` is known up to the loss's cotangent, a scalar: the forward forms the
gradients for a cotangent of 1 and the backward scales them (exactly, for 1 and for a power of
two such as a loss scale). Only ``dx`` is kept for the backward; the logits of one chunk are the
largest temporary (:func:`~effijax.precision.loss_chunk_positions`).

Numbers: each position's logits, loss, hit and ``d logits`` are :func:`head_logits` and
:func:`~effijax.precision.cross_entropy_and_accuracy`'s arithmetic, so the loss, the accuracy
and ``dx`` are those of the unfused path; the kernel's gradient is summed chunk by chunk (in
f32), in another order than one matmul over all tokens.

The unfused path stays where fusing cannot hold those numbers or has nothing to fuse: an f16
compute dtype (its 16-bit ``d logits`` needs the loss scale applied before rounding, and the
forward runs before the scale reaches it), a quantized head, and a call that asks for logits
(:meth:`~effijax.models._decoder.Decoder.head`).

Shape suffixes: ``B`` batch, ``S`` sequence, ``C`` the chunk's positions, ``D`` model width,
``V`` vocabulary, ``N`` flattened tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from effijax.models._dense import Kept, materialize, unkeep
from effijax.models._layers import _dense
from effijax.precision import (
    cross_entropy_and_accuracy,
    dot,
    is_quantized,
    loss_chunk_positions,
    masked_mean,
    token_nll,
    token_nll_grad,
)


def soft_cap(logits: jax.Array, cap: float | None) -> jax.Array:
    """``cap · tanh(logits / cap)`` in f32, in ``logits``' dtype (Gemma's logit soft-capping);
    ``logits`` themselves when ``cap`` is None.

    Example:
      >>> import jax.numpy as jnp
      >>> [round(v, 3) for v in soft_cap(jnp.array([0.0, 100.0]), 30.0).tolist()]
      [0.0, 29.924]
    """
    if cap is None:
        return logits
    return (cap * jnp.tanh(logits.astype(jnp.float32) / cap)).astype(logits.dtype)


def head_logits(x_BSD: jax.Array, kernel, *, transposed: bool = False, cap: float | None = None,
                output_dtype=jnp.float32) -> jax.Array:
    """The logits of the final (normed) hidden states: ``x @ kernel`` (``x @ kernelᵀ`` with
    ``transposed``, a tied embedding stored ``(V, D)``), in ``output_dtype``, soft-capped when
    ``cap`` is given. ``kernel`` may be an array, a frozen kernel's bits or a quantized kernel
    (see :func:`~effijax.models._layers._dense`).

    Example:
      >>> import jax.numpy as jnp
      >>> head_logits(jnp.ones((1, 2, 3)), jnp.ones((4, 3)), transposed=True).shape
      (1, 2, 4)
    """
    logits_BSV = _dense(x_BSD, kernel, None, transposed=transposed)
    return soft_cap(logits_BSV.astype(output_dtype), cap)


def head_cross_entropy(x_BSD: jax.Array, kernel, targets_BS: jax.Array,
                       where_BS: jax.Array | None = None, *, transposed: bool = False,
                       cap: float | None = None, output_dtype=jnp.float32
                       ) -> tuple[jax.Array, jax.Array]:
    """``cross_entropy_and_accuracy(head_logits(x, kernel, ...), targets, where)``: the mean
    f32 cross-entropy and top-1 accuracy over the positions ``where_BS`` marks (all when None),
    computed in chunks of the sequence with the gradients formed chunk by chunk (see the module
    docstring). Differentiable in ``x_BSD`` and ``kernel``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x, e = jax.random.normal(jax.random.key(0), (2, 4, 3)), jnp.eye(5, 3)
      >>> t = jnp.array([[0, 1, 2, 3], [4, 0, 1, 2]])
      >>> loss, acc = head_cross_entropy(x, e, t, transposed=True)
      >>> plain = cross_entropy_and_accuracy(head_logits(x, e, transposed=True), t)
      >>> bool(loss == plain[0]), bool(acc == plain[1])
      (True, True)
    """
    if (not jnp.issubdtype(targets_BS.dtype, jnp.integer)
            or targets_BS.shape != x_BSD.shape[:-1]):
        # A plain ValueError, as cross_entropy's: wrong targets are a bug in the calling code.
        raise ValueError(f"head_cross_entropy: targets must be integer class ids of shape "
                         f"{x_BSD.shape[:-1]}, got {targets_BS.dtype}{list(targets_BS.shape)}")
    if is_quantized(kernel) or jnp.dtype(x_BSD.dtype) == jnp.float16:
        logits_BSV = head_logits(x_BSD, kernel, transposed=transposed, cap=cap,
                                 output_dtype=output_dtype)
        return cross_entropy_and_accuracy(logits_BSV, targets_BS, where=where_BS)
    if isinstance(kernel, Kept):  # a frozen head's bits (freeze_kernels): no gradient
        kernel = unkeep(kernel)
    # A policy override may keep the kernel in another dtype: the activations meet it.
    return _fused(x_BSD.astype(kernel.dtype), kernel, targets_BS, where_BS,
                  (transposed, cap, jnp.dtype(output_dtype).name,
                   jnp.dtype(kernel.dtype).name))


# (loss, accuracy) of the fused head. The forward, when differentiated, forms the gradients for
# a loss cotangent of 1; the backward scales them by the cotangent. ``static``: (transposed,
# cap, the output's and the kernel's dtype names).
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused(x_BSD, kernel, targets_BS, where_BS, static):
    nll_BS, hits_BS, _, _ = _chunks(x_BSD, kernel, targets_BS, None, static, dkernel=False)
    return masked_mean(nll_BS, where_BS), masked_mean(hits_BS, where_BS)


def _fused_fwd(x_BSD, kernel, targets_BS, where_BS, static):
    x, k = x_BSD.value, kernel.value
    where = None if where_BS is None else where_BS.value
    # d loss / d nll for a cotangent of 1: the masked mean's own autodiff, so the products
    # are the unfused path's.
    dnll_BS = jax.grad(lambda nll: masked_mean(nll, where))(
        jnp.zeros(targets_BS.value.shape, jnp.float32))
    nll_BS, hits_BS, dx_BSD, dkernel = _chunks(
        x, k, targets_BS.value, dnll_BS if x_BSD.perturbed or kernel.perturbed else None,
        static, dkernel=kernel.perturbed)
    residuals = (dx_BSD if x_BSD.perturbed else None, dkernel)
    return (masked_mean(nll_BS, where), masked_mean(hits_BS, where)), residuals


def _fused_bwd(static, residuals, cotangents):
    dx_BSD, dkernel = residuals
    dtype = jnp.dtype(static[3])  # x's and the kernel's
    g = cotangents[0]  # the loss's; the accuracy has no gradient
    if isinstance(g, SymbolicZero):
        return None, None, None, None
    dx = None if dx_BSD is None else (dx_BSD.astype(jnp.float32) * g).astype(dtype)
    dk = None if dkernel is None else (dkernel * g).astype(dtype)
    return dx, dk, None, None


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)


def _chunks(x_BSD, kernel, targets_BS, dnll_BS, static, *, dkernel: bool):
    """``(nll_BS, hits_BS, dx_BSD, dkernel)`` over chunks of the sequence; the gradients (for
    the per-position cotangents ``dnll_BS``) only when ``dnll_BS`` is given, the kernel's only
    with ``dkernel`` (f32, in the kernel's layout)."""
    b, s, d = x_BSD.shape
    c = loss_chunk_positions(b, s)
    grads = dnll_BS is not None

    def chunk(acc, inputs):
        x_BCD, t_BC, dnll_BC = inputs
        nll, hits, dx, dk = _chunk(x_BCD.reshape(-1, d), kernel, t_BC.reshape(-1),
                                   None if dnll_BC is None else dnll_BC.reshape(-1), static,
                                   dkernel=dkernel)
        outs = (nll.reshape(b, -1), hits.reshape(b, -1),
                None if dx is None else dx.reshape(b, -1, d))
        if dk is not None and acc is not None:  # the scan's running sum (one chunk has none)
            dk = acc + dk
        return dk, outs

    # The kernel's gradient is summed as (D, V), the layout its dot writes, and transposed
    # once at the end for a tied head.
    transposed = static[0]

    def out(dk_DV):
        return dk_DV.T if dk_DV is not None and transposed else dk_DV

    if c == s:  # one chunk: no scan
        dk, (nll, hits, dx) = chunk(None, (x_BSD, targets_BS, dnll_BS if grads else None))
        return nll, hits, dx, out(dk)

    def split(a):  # [B, S, ...] -> [S / C, B, C, ...]: the scan's axis first, rows kept whole
        return jnp.moveaxis(a.reshape(b, s // c, c, *a.shape[2:]), 1, 0)

    def join(a):
        return None if a is None else jnp.moveaxis(a, 0, 1).reshape(b, s, *a.shape[3:])

    xs = (split(x_BSD), split(targets_BS), split(dnll_BS) if grads else None)
    zero = jnp.zeros((d, kernel.shape[0 if transposed else 1]), jnp.float32) if dkernel else None
    dk, (nll, hits, dx) = jax.lax.scan(chunk, zero, xs)
    return join(nll), join(hits), join(dx), out(dk)


def _chunk(x_ND, kernel, t_N, dnll_N, static, *, dkernel: bool):
    """One chunk's ``(nll, hits, dx, dkernel_DV)`` (the last two None unless asked for)."""
    transposed, cap, output_dtype, _ = static
    logits_NV = dot("nd,vd->nv" if transposed else "nd,dv->nv", x_ND, kernel)
    logits_NV = logits_NV.astype(jnp.dtype(output_dtype))
    capped_NV = soft_cap(logits_NV, cap)
    nll_N, hits_N, lse = token_nll(capped_NV, t_N)
    if dnll_N is None:
        return nll_N, hits_N, None, None
    dlogits_NV = token_nll_grad(capped_NV, t_N, lse, dnll_N)
    if cap is not None:  # d tanh(u) = 1 - tanh(u)²
        y_NV = capped_NV.astype(jnp.float32) / cap
        dlogits_NV = (dlogits_NV.astype(jnp.float32) * (1.0 - y_NV * y_NV)).astype(
            logits_NV.dtype)
    dlogits_NV = dlogits_NV.astype(x_ND.dtype)
    # Both dots in the layout XLA:CPU's 16-bit GEMM takes (see effijax.models._dense): dx
    # contracts dlogits' last axis; the kernel's gradient reads xᵀ as its own buffer.
    dx_ND = dot("nv,vd->nd" if transposed else "nv,dv->nd", dlogits_NV, kernel)
    dk_DV = None
    if dkernel:
        dk_DV = jnp.einsum("dn,nv->dv", materialize(x_ND.T), dlogits_NV,
                           preferred_element_type=jnp.float32)
    return nll_N, hits_N, dx_ND, dk_DV
