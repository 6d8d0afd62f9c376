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

:func:`head_sequence_logps` is the same head summed per row instead of averaged: each
sequence's log-probability of its targets over the positions a mask marks (a completion's
tokens) and their count, what preference objectives compare (DPO, SimPO, ORPO:
:mod:`effijax.objectives`). Its cotangent is one number per row, so the forward forms ``dx``
for a cotangent of 1 per row and the backward scales each row; the kernel's gradient sums the
rows' products and needs their cotangents, so when the kernel is trained the backward runs the
chunks again. :func:`make_sequence_logps` is the model-level entry: ``(params, batch) ->
(logps_B, counts_B)``, with or without LoRA, as :func:`~effijax.models.make_loss_fn`. The
log-probabilities are the unfused path's per position (summed in another order); ``dx``, scaled
per row after the dot rather than before it, differs from autodiff's by rounding: about 1e-7
of a row's largest entry in f32, one bf16 rounding of it in bf16. :func:`head_token_logps`
(:func:`make_token_logps`) keeps each position's log-probability instead of the row's sum, what
a policy-gradient loss weighs token by token; its cotangent is one number per position, so its
backward runs the chunks again.

The unfused path stays where fusing cannot hold those numbers or has nothing to fuse: an f16
compute dtype (its 16-bit ``d logits`` needs the loss scale applied before rounding, and the
forward runs before the scale reaches it), a quantized head, and a call that asks for logits
(:meth:`~effijax.models._decoder.Decoder.head`).

Shape suffixes: ``B`` batch, ``S`` sequence, ``C`` the chunk's positions, ``D`` model width,
``V`` vocabulary, ``N`` flattened tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from effijax.models._dense import Kept, materialize, unkeep
from effijax.models._layers import _check_lora, _dense, _merge, check_lm_batch
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
    _check_targets("head_cross_entropy", x_BSD, targets_BS)
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


def _checked_where(name: str, x_BSD, targets_BS, where_BS):
    """The targets checked, and the marked positions as bool ``[B, S]`` (all when None)."""
    _check_targets(name, x_BSD, targets_BS)
    if where_BS is None:
        return jnp.ones(targets_BS.shape, jnp.bool_)
    if where_BS.shape != targets_BS.shape:
        raise ValueError(f"{name}: where_BS must have the targets' shape "
                         f"{list(targets_BS.shape)}, got {list(where_BS.shape)}")
    return where_BS.astype(jnp.bool_)


def _check_targets(name: str, x_BSD: jax.Array, targets_BS: jax.Array) -> None:
    if (not jnp.issubdtype(targets_BS.dtype, jnp.integer)
            or targets_BS.shape != x_BSD.shape[:-1]):
        # A plain ValueError, as cross_entropy's: wrong targets are a bug in the calling code.
        raise ValueError(f"{name}: targets must be integer class ids of shape "
                         f"{x_BSD.shape[:-1]}, got {targets_BS.dtype}{list(targets_BS.shape)}")


def head_sequence_logps(x_BSD: jax.Array, kernel, targets_BS: jax.Array,
                        where_BS: jax.Array | None = None, *, transposed: bool = False,
                        cap: float | None = None, output_dtype=jnp.float32,
                        greedy: bool = False) -> tuple[jax.Array, ...]:
    """Each row's log-probability of its targets: ``(logps_B, counts_B)``, the f32 sum of
    ``log_softmax(head_logits(x, kernel, ...))`` at the targets over the positions ``where_BS``
    marks (all when None) and the int32 count of those positions, computed in chunks of the
    sequence as :func:`head_cross_entropy` (no ``[B, S, V]`` logits). Differentiable in
    ``x_BSD`` and ``kernel``; the targets of unmarked positions are never read. With
    ``greedy`` (for scoring, not differentiated), a third result ``greedy_B``: whether every
    marked target is its position's first argmax (what greedy decoding would have produced).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x, e = jax.random.normal(jax.random.key(0), (2, 4, 3)), jnp.eye(5, 3)
      >>> t = jnp.array([[0, 1, 2, 3], [4, 0, 1, 2]])
      >>> where = jnp.array([[False, True, True, True], [False, False, True, False]])
      >>> logps, counts = head_sequence_logps(x, e, t, where, transposed=True)
      >>> token_logps = jax.nn.log_softmax(head_logits(x, e, transposed=True))
      >>> plain = jnp.sum(jnp.where(where, jnp.take_along_axis(token_logps, t[..., None], -1)[
      ...     ..., 0], 0.0), axis=1)
      >>> bool(jnp.allclose(logps, plain)), counts.tolist()
      (True, [3, 1])
    """
    where_BS = _checked_where("head_sequence_logps", x_BSD, targets_BS, where_BS)
    counts_B = jnp.sum(where_BS, axis=1, dtype=jnp.int32)
    # An unmarked position may hold any id (TRL's -100, a pad): it picks class 0 instead, and
    # its log-probability is dropped.
    targets_BS = jnp.where(where_BS, targets_BS, jnp.zeros((), targets_BS.dtype))
    if is_quantized(kernel) or jnp.dtype(x_BSD.dtype) == jnp.float16:
        logits_BSV = head_logits(x_BSD, kernel, transposed=transposed, cap=cap,
                                 output_dtype=output_dtype)
        nll_BS, hits_BS, _ = token_nll(logits_BSV, targets_BS)
        return (_row_logps(nll_BS, where_BS), counts_B) + (
            (jnp.all(hits_BS | ~where_BS, axis=1),) if greedy else ())
    if isinstance(kernel, Kept):  # a frozen head's bits (freeze_kernels): no gradient
        kernel = unkeep(kernel)
    static = (transposed, cap, jnp.dtype(output_dtype).name, jnp.dtype(kernel.dtype).name)
    x_BSD = x_BSD.astype(kernel.dtype)
    if greedy:  # the forward of _fused_logps, with the hits it computes anyway
        nll_BS, hits_BS = _chunks(x_BSD, kernel, targets_BS, None, static, dkernel=False)[:2]
        return (_row_logps(nll_BS, where_BS), counts_B,
                jnp.all(hits_BS | ~where_BS, axis=1))
    return _fused_logps(x_BSD, kernel, targets_BS, where_BS, static), counts_B


def make_sequence_logps(graphdef, lora=None, *, sequence_parallel: bool = True,
                        frozen_base: bool = False, greedy: bool = False,
                        window: int | None = None
                        ) -> Callable[..., tuple[jax.Array, ...]]:
    """Returns ``sequence_logps(params, batch, rng=None) -> (logps_B, counts_B)``: each row's
    summed f32 log-probability of ``batch["targets"]`` over the positions ``batch["mask"]``
    marks (every position without a mask) and the int32 count of those positions, from the
    model's trunk and its head fused with the sum (:func:`head_sequence_logps`).

    The batch, ``params``, ``rng``, ``lora``, ``sequence_parallel`` and ``frozen_base`` are
    :func:`~effijax.models.make_loss_fn`'s: ``{"inputs", "targets"}`` and optionally
    ``"mask"`` and ``"segments"``; with ``lora`` (a :class:`~effijax.lora.LoraSpec`) ``params``
    is ``{"base": ..., "adapters": ...}``, and the same base without ``lora`` gives the model
    with the adapters off (a DPO reference under LoRA: no second copy of the base). A caller
    holding a model gets the graphdef from ``effijax.models.abstract_split(model)``. With
    ``greedy``, a third result: each row's ``greedy_B`` (:func:`head_sequence_logps`).

    ``window``: the head scores only each row's ``window`` positions from its first marked
    one (a completion's span: a preference pair's row marks a few dozen of its hundreds of
    positions, and the head's matmul over the vocabulary is most of the rest of the step's
    work past the trunk); the same log-probabilities, summed in another order. A row whose
    marked positions reach past its window gets a NaN log-probability, never a silently
    shorter sum: give the data's longest span (first to last marked position, plus one).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from effijax.models import abstract_split, gpt_config
      >>> model = gpt_config("tiny")
      >>> graphdef, _ = abstract_split(model)
      >>> params = model.init_params(jax.random.key(0))
      >>> tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 256)
      >>> batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1),
      ...          "mask": jnp.arange(8) >= jnp.array([[3], [5]])}  # the completions' tokens
      >>> logps, counts = jax.jit(make_sequence_logps(graphdef))(params, batch)
      >>> logps.shape, counts.tolist()
      ((2,), [5, 3])
      >>> near, _ = jax.jit(make_sequence_logps(graphdef, window=5))(params, batch)
      >>> bool(jnp.allclose(near, logps, rtol=1e-6))
      True
    """
    _check_lora(lora)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"make_sequence_logps: window must be an int >= 1, got {window!r}")

    def sequence_logps(params, batch, rng=None):
        model, x_BSD, kernel, transposed = _head_inputs(graphdef, lora, frozen_base,
                                                        sequence_parallel, params, batch, rng)
        targets_BS, mask_BS = batch["targets"], batch.get("mask")
        if window is not None and mask_BS is not None and window < targets_BS.shape[1]:
            x_BWD, targets_BW, where_BW, counts_B = _completion_window(x_BSD, targets_BS,
                                                                       mask_BS, window)
            logps_B, scored_B, *greedy_B = head_sequence_logps(
                x_BWD, kernel, targets_BW, where_BW, transposed=transposed,
                cap=model.logit_cap, output_dtype=model.policy.output_dtype, greedy=greedy)
            return (jnp.where(scored_B == counts_B, logps_B, jnp.nan), counts_B, *greedy_B)
        return head_sequence_logps(x_BSD, kernel, targets_BS, mask_BS,
                                   transposed=transposed, cap=model.logit_cap,
                                   output_dtype=model.policy.output_dtype, greedy=greedy)

    return sequence_logps


def _completion_window(x_BSD, targets_BS, mask_BS, window: int):
    """Each row's ``window`` positions from its first marked one: ``(x_BWD, targets_BW,
    where_BW, counts_B)``, ``counts_B`` the row's marked positions in all (those the window
    holds are fewer where one lies past it)."""
    s = targets_BS.shape[1]
    marked_BS = mask_BS.astype(jnp.bool_)
    first_B = jnp.argmax(marked_BS, axis=1)  # 0 for a row with none (nothing to lose)
    at_BW = first_B[:, None] + jnp.arange(window)[None, :]
    inside_BW = at_BW < s
    at_BW = jnp.minimum(at_BW, s - 1)
    where_BW = jnp.take_along_axis(marked_BS, at_BW, axis=1) & inside_BW
    x_BWD = jnp.take_along_axis(x_BSD, at_BW[:, :, None], axis=1)
    return (x_BWD, jnp.take_along_axis(targets_BS, at_BW, axis=1), where_BW,
            jnp.sum(marked_BS, axis=1, dtype=jnp.int32))


def _head_inputs(graphdef, lora, frozen_base, sequence_parallel, params, batch, rng):
    """The model of ``params``, its final (normed) hidden states of ``batch["inputs"]`` and
    its head's kernel: what the fused heads take."""
    check_lm_batch(batch)
    model, adapted = _merge(graphdef, params, lora, frozen_base)
    x_BSD = model._trunk(batch["inputs"], rng is None, rng, adapted.get("adapters"),
                         adapted.get("lora"), batch.get("segments"), sequence_parallel)
    x_BSD = getattr(model, model.names.final_norm)(x_BSD)
    kernel, transposed = model._head_kernel()
    return model, x_BSD, kernel, transposed


def head_token_logps(x_BSD: jax.Array, kernel, targets_BS: jax.Array,
                     where_BS: jax.Array | None = None, *, transposed: bool = False,
                     cap: float | None = None, output_dtype=jnp.float32,
                     temperature: float = 1.0) -> jax.Array:
    """Each position's log-probability of its target, f32 ``[B, S]`` (0 where ``where_BS`` is
    False): ``log_softmax(head_logits(x, kernel, ...) / temperature)`` at the targets, computed
    in chunks of the sequence as :func:`head_sequence_logps` (no ``[B, S, V]`` logits), what
    a policy-gradient loss weighs token by token (GRPO: :func:`effijax.objectives.grpo_loss`).
    Differentiable in ``x_BSD`` and ``kernel``: the backward runs the chunks again with each
    position's cotangent. A ``temperature`` other than 1 divides the hidden states and the
    soft cap by it (``cap·tanh(z/cap)/T = (cap/T)·tanh((z/T)/(cap/T))``), one rounding of
    ``x / T`` in ``x``'s dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x, e = jax.random.normal(jax.random.key(0), (2, 4, 3)), jnp.eye(5, 3)
      >>> t = jnp.array([[0, 1, 2, 3], [4, 0, 1, 2]])
      >>> where = jnp.array([[False, True, True, True], [False, False, True, False]])
      >>> logps = head_token_logps(x, e, t, where, transposed=True)
      >>> seq, _ = head_sequence_logps(x, e, t, where, transposed=True)
      >>> bool(jnp.allclose(logps.sum(1), seq)), bool(logps[0, 0] == 0)
      (True, True)
    """
    where_BS = _checked_where("head_token_logps", x_BSD, targets_BS, where_BS)
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) \
            or not temperature > 0:
        raise ValueError(f"head_token_logps: temperature must be a Python number > 0, got "
                         f"{temperature!r}")
    targets_BS = jnp.where(where_BS, targets_BS, jnp.zeros((), targets_BS.dtype))
    if temperature != 1:
        x_BSD = (x_BSD.astype(jnp.float32) / temperature).astype(x_BSD.dtype)
        cap = None if cap is None else cap / temperature
    if is_quantized(kernel) or jnp.dtype(x_BSD.dtype) == jnp.float16:
        logits_BSV = head_logits(x_BSD, kernel, transposed=transposed, cap=cap,
                                 output_dtype=output_dtype)
        return jnp.where(where_BS, -token_nll(logits_BSV, targets_BS)[0], 0.0)
    if isinstance(kernel, Kept):  # a frozen head's bits (freeze_kernels): no gradient
        kernel = unkeep(kernel)
    static = (transposed, cap, jnp.dtype(output_dtype).name, jnp.dtype(kernel.dtype).name)
    return _fused_token_logps(x_BSD.astype(kernel.dtype), kernel, targets_BS, where_BS, static)


def make_token_logps(graphdef, lora=None, *, sequence_parallel: bool = True,
                     frozen_base: bool = False, temperature: float = 1.0
                     ) -> Callable[..., jax.Array]:
    """Returns ``token_logps(params, batch, rng=None) -> logps_BS``: each position's f32
    log-probability of ``batch["targets"]`` (0 where ``batch["mask"]`` is False), from the
    model's trunk and its fused head (:func:`head_token_logps`, at ``temperature``): the
    per-token sibling of :func:`make_sequence_logps`, with its batch and arguments.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from effijax.models import abstract_split, gpt_config
      >>> model = gpt_config("tiny")
      >>> graphdef, abstract = abstract_split(model)  # shapes only: nothing is computed
      >>> tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
      >>> batch = {"inputs": tokens, "targets": tokens,
      ...          "mask": jax.ShapeDtypeStruct((2, 8), jnp.bool_)}
      >>> jax.eval_shape(make_token_logps(graphdef), abstract, batch)
      ShapeDtypeStruct(shape=(2, 8), dtype=float32)
    """
    _check_lora(lora)

    def token_logps(params, batch, rng=None):
        model, x_BSD, kernel, transposed = _head_inputs(graphdef, lora, frozen_base,
                                                        sequence_parallel, params, batch, rng)
        return head_token_logps(x_BSD, kernel, batch["targets"], batch.get("mask"),
                                transposed=transposed, cap=model.logit_cap,
                                output_dtype=model.policy.output_dtype,
                                temperature=temperature)

    return token_logps


def _row_logps(nll_BS: jax.Array, where_BS: jax.Array) -> jax.Array:
    """Each row's summed log-probability over the marked positions, f32 ``[B]``."""
    return -jnp.sum(jnp.where(where_BS, nll_BS.astype(jnp.float32), 0.0), axis=1)


# Each row's summed log-probability from the fused head. Without the kernel's gradient, the
# forward forms ``dx`` for a cotangent of 1 in every row and the backward scales each row by
# its own (as the loss's scalar, see _fused); the kernel's gradient sums every row's product,
# so it needs the cotangents themselves: then the backward runs the chunks again with them.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused_logps(x_BSD, kernel, targets_BS, where_BS, static):
    return _row_logps(_chunks(x_BSD, kernel, targets_BS, None, static, dkernel=False)[0],
                      where_BS)


def _fused_logps_fwd(x_BSD, kernel, targets_BS, where_BS, static):
    x, k, t, where = x_BSD.value, kernel.value, targets_BS.value, where_BS.value
    if kernel.perturbed:
        nll_BS = _chunks(x, k, t, None, static, dkernel=False)[0]
        return _row_logps(nll_BS, where), (x, k, t, where, None)
    # d logps_B / d nll_BS for a cotangent of 1 per row: the row sum's own autodiff.
    dnll_BS = jnp.where(where, -1.0, 0.0) if x_BSD.perturbed else None
    nll_BS, _, dx_BSD, _ = _chunks(x, k, t, dnll_BS, static, dkernel=False)
    return _row_logps(nll_BS, where), (None, None, None, None, dx_BSD)


def _fused_logps_bwd(static, residuals, g_B):
    x_BSD, kernel, targets_BS, where_BS, dx1_BSD = residuals
    if isinstance(g_B, SymbolicZero):
        return None, None, None, None
    dtype = jnp.dtype(static[3])  # x's and the kernel's
    if x_BSD is None:  # the kernel is not trained: scale each row's dx
        dx = None if dx1_BSD is None else (
            dx1_BSD.astype(jnp.float32) * g_B[:, None, None]).astype(dtype)
        return dx, None, None, None
    dnll_BS = jnp.where(where_BS, -g_B[:, None], 0.0)
    _, _, dx_BSD, dkernel = _chunks(x_BSD, kernel, targets_BS, dnll_BS, static, dkernel=True)
    return dx_BSD.astype(dtype), dkernel.astype(dtype), None, None


_fused_logps.defvjp(_fused_logps_fwd, _fused_logps_bwd, symbolic_zeros=True)


# Each position's log-probability from the fused head. Its cotangent is one number per
# position, known only in the backward: the backward runs the chunks again with it (the
# kernel's gradient only when the kernel is trained).
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused_token_logps(x_BSD, kernel, targets_BS, where_BS, static):
    nll_BS = _chunks(x_BSD, kernel, targets_BS, None, static, dkernel=False)[0]
    return jnp.where(where_BS, -nll_BS.astype(jnp.float32), 0.0)


def _fused_token_logps_fwd(x_BSD, kernel, targets_BS, where_BS, static):
    x, k, t, where = x_BSD.value, kernel.value, targets_BS.value, where_BS.value
    nll_BS = _chunks(x, k, t, None, static, dkernel=False)[0]
    trains_kernel = jnp.zeros((), jnp.bool_) if kernel.perturbed else None
    return (jnp.where(where, -nll_BS.astype(jnp.float32), 0.0),
            (x, k, t, where, trains_kernel))


def _fused_token_logps_bwd(static, residuals, g_BS):
    x_BSD, kernel, targets_BS, where_BS, trains_kernel = residuals
    if isinstance(g_BS, SymbolicZero):
        return None, None, None, None
    dtype = jnp.dtype(static[3])  # x's and the kernel's
    dnll_BS = jnp.where(where_BS, -g_BS, 0.0)
    _, _, dx_BSD, dkernel = _chunks(x_BSD, kernel, targets_BS, dnll_BS, static,
                                    dkernel=trains_kernel is not None)
    return (dx_BSD.astype(dtype), None if dkernel is None else dkernel.astype(dtype), None,
            None)


_fused_token_logps.defvjp(_fused_token_logps_fwd, _fused_token_logps_bwd, symbolic_zeros=True)


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
