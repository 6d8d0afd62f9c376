"""fp32 islands: the operations that stay in float32 whatever the compute dtype.

Mixed precision is only safe when reductions are precise (Micikevicius et al. 2018; PyTorch's
autocast keeps softmax, log-softmax, norms and every loss in f32). Each function here takes
compute-dtype inputs, does its reduction in f32, and returns the dtype a caller expects:

* :func:`dot` multiplies in the inputs' dtype, accumulates in f32 (``preferred_element_type``)
  and emits the inputs' dtype;
* :func:`softmax` returns the input dtype (for attention probabilities), computed in f32;
* :func:`log_softmax`, :func:`cross_entropy` (and :func:`cross_entropy_and_accuracy`),
  :func:`masked_mean` return f32;
* :func:`layer_norm` computes mean and variance in f32 and returns the input dtype;
* :func:`rms_norm` computes the mean square in f32 and returns the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["dot", "softmax", "log_softmax", "cross_entropy", "cross_entropy_and_accuracy",
           "masked_mean", "layer_norm", "rms_norm"]


def dot(equation: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``einsum`` with f32 accumulation, returning ``x``'s dtype.

    Both operands must share a dtype (cast ``w`` with the policy first): strict dtype promotion
    would otherwise hide an unintended upcast.

    Example:
      >>> import jax.numpy as jnp
      >>> dot("bd,df->bf", jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 4), jnp.bfloat16)).dtype
      dtype(bfloat16)
    """
    if x.dtype != w.dtype:
        # A ValueError, not a ConfigError: mismatched operands are a bug in the model code, not
        # a setting a user can change.
        raise ValueError(
            f"dot({equation!r}): operand dtypes differ ({x.dtype} vs {w.dtype}); cast the "
            "parameters with Policy.cast_to_compute before applying the model"
        )
    out = jnp.einsum(equation, x, w, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def softmax(x: jax.Array, axis: int = -1, where: jax.Array | None = None) -> jax.Array:
    """Softmax computed in f32, returned in ``x``'s dtype. Masked entries (``where=False``) get 0.

    Example:
      >>> import jax.numpy as jnp
      >>> softmax(jnp.zeros(4, jnp.bfloat16))
      Array([0.25, 0.25, 0.25, 0.25], dtype=bfloat16)
    """
    return jax.nn.softmax(x.astype(jnp.float32), axis=axis, where=where).astype(x.dtype)


def log_softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """Log-softmax in f32 (returned as f32).

    Example:
      >>> import jax.numpy as jnp
      >>> log_softmax(jnp.zeros(2, jnp.float16)).dtype
      dtype('float32')
    """
    return jax.nn.log_softmax(x.astype(jnp.float32), axis=axis)


def cross_entropy(
    logits: jax.Array, labels: jax.Array, where: jax.Array | None = None
) -> jax.Array:
    """Mean token cross-entropy in f32 from logits of any float dtype and integer labels.

    Args:
      logits: ``[..., V]`` logits (bf16/f16 logits are upcast before the log-softmax: without
        the upcast a bf16 loss visibly shifts).
      labels: integer class ids, shape ``logits.shape[:-1]``.
      where: optional boolean mask of the positions to average over.

    Returns:
      A scalar f32 mean negative log-likelihood.

    Example:
      >>> import jax.numpy as jnp
      >>> float(cross_entropy(jnp.zeros((2, 4), jnp.bfloat16), jnp.array([0, 3])))  # log(4)
      1.3862943649291992
    """
    _check_labels(logits, labels)
    return masked_mean(_nll_and_hits(logits, labels)[0], where)


def cross_entropy_and_accuracy(
    logits: jax.Array, labels: jax.Array, where: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """:func:`cross_entropy` and the f32 fraction of positions whose label is the argmax of
    the logits (top-1 accuracy; of tied maxima the first counts, as ``jnp.argmax`` picks it),
    from one function: the loss's backward is a single elementwise pass (see below).

    The argmax is taken in two levels (:func:`_first_argmax`): the maximum of each chunk of
    up to 2048 classes (a plain max reduction), the first chunk holding the row's maximum, then
    the first maximum inside that chunk. ``jnp.argmax`` over the whole class axis is a
    reduction over (value, index) pairs that XLA:CPU runs far slower: 48 ms against 6.5 ms for
    SmolLM2's 49152 classes x 512 tokens, 253 ms against 27 ms for Gemma 3's 262144 (2-core
    Xeon). The index is the same, ties included; a step whose loss is not finite at some
    position (a NaN or +inf logit) takes ``jnp.argmax`` itself, since XLA:CPU's max reduction
    may skip a NaN that ``jnp.argmax`` would pick. On a GPU or TPU it is one ``jnp.argmax``.

    Example:
      >>> import jax.numpy as jnp
      >>> logits = jnp.array([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
      >>> loss, acc = cross_entropy_and_accuracy(logits, jnp.array([1, 2]))
      >>> round(float(loss), 4), float(acc)
      (1.7513, 0.5)
      >>> float(cross_entropy_and_accuracy(jnp.zeros((2, 3)), jnp.array([0, 1]))[1])  # a tie
      0.5
    """
    _check_labels(logits, labels)
    nll, hits = _nll_and_hits(logits, labels)
    return masked_mean(nll, where), masked_mean(hits, where)


def _check_labels(logits: jax.Array, labels: jax.Array) -> None:
    # Plain ValueErrors: wrong label dtypes or shapes are bugs in the calling code, not settings.
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"cross_entropy: labels must be integer class ids, got {labels.dtype}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"cross_entropy: labels shape {labels.shape} does not match logits "
            f"{logits.shape} without the class axis"
        )


# Per-position negative log-likelihood (f32) and top-1 hit, with a hand-written backward:
# d logits = (softmax - onehot(label)) · d nll, one elementwise pass. Autodiff of the label's
# pick (take_along_axis) instead zero-fills an f32 [..., V] array and scatters into it (46 ms
# of SmolLM2's step on the CPU). The forward is log_softmax's arithmetic at the label; the
# backward's products are autodiff's, so the numbers are the same.
@jax.custom_vjp
def _nll_and_hits(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _nll_fwd(logits, labels)[0]


def _nll_fwd(logits, labels):
    nll, hits, lse = token_nll(logits, labels)
    return (nll, hits), (logits, labels, lse)


def token_nll(logits: jax.Array, labels: jax.Array
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per position: the f32 negative log-likelihood of the label, whether the label is the
    first argmax (the top-1 hit), and the log-sum-exp of the shifted logits (what
    :func:`token_nll_grad` needs): the arithmetic of :func:`cross_entropy_and_accuracy`, with no
    backward of its own, for callers that form ``d logits`` themselves (the output head fused
    with its loss, :mod:`effijax.models._head`).

    Example:
      >>> import jax.numpy as jnp
      >>> nll, hits, lse = token_nll(jnp.array([[0.0, 2.0, 1.0]]), jnp.array([1]))
      >>> round(float(nll[0]), 4), bool(hits[0]), lse.shape
      (0.4076, True, (1, 1))
    """
    x = logits.astype(jnp.float32)
    top = jnp.max(x, axis=-1, keepdims=True)
    shifted = x - jax.lax.stop_gradient(top)
    lse = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
    picked = jnp.take_along_axis(shifted, labels[..., None], axis=-1)
    nll = -(picked - lse)[..., 0]
    hits = _first_argmax(x, finite=jnp.isfinite(nll).all()) == labels
    return nll, hits, lse


def token_nll_grad(logits: jax.Array, labels: jax.Array, lse: jax.Array,
                   dnll: jax.Array) -> jax.Array:
    """``d logits = (softmax - onehot(label)) · d nll`` in one elementwise pass, in ``logits``'
    dtype: the backward of :func:`token_nll`'s ``nll`` (``lse`` is its third result, ``dnll``
    the per-position cotangent). The products are autodiff's, so the numbers are the same.

    Example:
      >>> import jax.numpy as jnp
      >>> logits, labels = jnp.zeros((1, 4)), jnp.array([2])
      >>> lse = token_nll(logits, labels)[2]
      >>> token_nll_grad(logits, labels, lse, jnp.ones(1)).tolist()
      [[0.25, 0.25, -0.75, 0.25]]
    """
    x = logits.astype(jnp.float32)
    shifted = x - jnp.max(x, axis=-1, keepdims=True)
    onehot = jnp.arange(x.shape[-1], dtype=labels.dtype) == labels[..., None]
    dnll = dnll[..., None]
    dx = jnp.exp(shifted - lse) * dnll - jnp.where(onehot, dnll, 0.0)
    return dx.astype(logits.dtype)


def _chunk_width(classes: int) -> int | None:
    """The widest divisor of ``classes`` from 64 to 2048 that leaves a multiple of 8 chunks (so
    that classes sharded over a tensor axis of up to 8 devices split into whole chunks), or
    None: no such divisor, one level."""
    return next((w for w in range(min(classes // 8, 2048), 63, -1)
                 if classes % w == 0 and (classes // w) % 8 == 0), None)


def _first_argmax(x: jax.Array, finite: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)``. On a CPU, where ``finite`` (a traced bool: every row's loss
    is finite) and the classes split into chunks (:func:`_chunk_width`), in two levels: the
    first chunk whose maximum is the row's, then the first maximum in it. Other backends keep
    the one ``jnp.argmax``: their reductions need no help, and XLA:GPU may read a conditional's
    predicate back to the host."""
    classes = x.shape[-1]
    width = _chunk_width(classes)
    if width is None or jax.default_backend() != "cpu":
        return jnp.argmax(x, axis=-1)

    def two_levels(x):
        chunks = x.reshape(*x.shape[:-1], classes // width, width)
        first = jnp.argmax(jnp.max(chunks, axis=-1), axis=-1)
        inside = jnp.take_along_axis(chunks, first[..., None, None], axis=-2)[..., 0, :]
        return first * width + jnp.argmax(inside, axis=-1)

    return jax.lax.cond(finite, two_levels, lambda x: jnp.argmax(x, axis=-1), x)


def _nll_bwd(residuals, cotangents):
    logits, labels, lse = residuals
    return token_nll_grad(logits, labels, lse, cotangents[0]), None


_nll_and_hits.defvjp(_nll_fwd, _nll_bwd)


def masked_mean(x: jax.Array, where: jax.Array | None = None) -> jax.Array:
    """The f32 mean of ``x`` over the positions ``where`` marks (all when ``None``): the one
    masked mean behind the loss and the token accuracy. An empty mask gives 0, not NaN.

    Example:
      >>> import jax.numpy as jnp
      >>> float(masked_mean(jnp.array([1.0, 2.0, 6.0]), jnp.array([True, False, True])))
      3.5
      >>> float(masked_mean(jnp.array([1.0, 2.0]), jnp.array([False, False])))
      0.0
    """
    x = x.astype(jnp.float32)
    if where is None:
        return jnp.mean(x)
    w = where.astype(jnp.float32)
    return jnp.sum(x * w) / jnp.maximum(jnp.sum(w), 1.0)


def layer_norm(
    x: jax.Array, scale: jax.Array | None, bias: jax.Array | None, eps: float = 1e-5
) -> jax.Array:
    """Layer normalisation over the last axis with f32 statistics, returned in ``x``'s dtype.

    ``scale`` and ``bias`` may be kept in f32 (policy overrides); they are applied in f32 and the
    result is cast back to ``x``'s dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> y = layer_norm(jnp.array([[1.0, 3.0]], jnp.bfloat16), None, None)
      >>> y.dtype, y.tolist()
      (dtype(bfloat16), [[-1.0, 1.0]])
    """
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + jnp.float32(eps))
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def rms_norm(x: jax.Array, scale: jax.Array | None, eps: float = 1e-6) -> jax.Array:
    """Root-mean-square normalisation over the last axis in f32, returned in ``x``'s dtype.

    ``x / sqrt(mean(x²) + eps) · scale`` (Llama's RMSNorm: no mean subtraction, no bias). The
    statistic, the normalisation and the scale run in f32; Hugging Face's ``LlamaRMSNorm`` casts
    back before the scale, which differs from this only in the compute dtype's last bit.

    Example:
      >>> import jax.numpy as jnp
      >>> y = rms_norm(jnp.array([[3.0, -4.0]], jnp.bfloat16), jnp.array([1.0, 2.0]), eps=0.0)
      >>> y.dtype, y.tolist()  # rms = sqrt((9 + 16) / 2)
      (dtype(bfloat16), [[0.84765625, -2.265625]])
    """
    x32 = x.astype(jnp.float32)
    ms = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(ms + jnp.float32(eps))
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    return y.astype(x.dtype)
