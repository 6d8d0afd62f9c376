"""The output head fused with its cross-entropy (effijax.models._head): the unfused path's loss,
accuracy and gradients, chunk by chunk, without the [B, S, V] logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from effijax.models._dense import keep
from effijax.models._head import head_cross_entropy, head_logits
from effijax.precision import cross_entropy_and_accuracy, loss_chunk_positions

D, V = 16, 96


def _inputs(b, s, dtype=jnp.float32, transposed=True, seed=0):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k1, (b, s, D), jnp.float32).astype(dtype)
    kernel = (jax.random.normal(k2, (V, D) if transposed else (D, V)) * 0.5).astype(dtype)
    targets = jax.random.randint(k3, (b, s), 0, V)
    mask = jax.random.bernoulli(k4, 0.7, (b, s))
    return x, kernel, targets, mask


def _both(x, kernel, targets, where, **kw):
    """(loss, accuracy, dx, dkernel) of the fused and of the unfused path."""
    def fused(x, k):
        return head_cross_entropy(x, k, targets, where, **kw)

    def unfused(x, k):
        return cross_entropy_and_accuracy(head_logits(x, kernel=k, **kw), targets, where=where)

    out = []
    for fn in (fused, unfused):
        (loss, acc), grads = jax.jit(jax.value_and_grad(fn, (0, 1), has_aux=True))(x, kernel)
        out.append((loss, acc, *grads))
    return out


def test_one_rule_for_the_chunks():
    assert loss_chunk_positions(4, 512) == 128  # 512 tokens of 4 rows
    assert loss_chunk_positions(1, 2048) == 512
    assert loss_chunk_positions(2, 100) == 100  # fewer tokens than a chunk: one
    assert loss_chunk_positions(4, 509) == 509  # a prime length: one chunk, not 509
    assert loss_chunk_positions(64, 128) == 8


@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("masked", [True, False])
def test_fused_equals_unfused_over_several_chunks_in_f32(transposed, masked):
    b, s = 2, 1024  # 2,048 tokens: 4 chunks of 256 positions
    assert s // loss_chunk_positions(b, s) == 4
    x, kernel, targets, mask = _inputs(b, s, transposed=transposed)
    where = mask if masked else None
    fused, unfused = _both(x, kernel, targets, where, transposed=transposed)
    # Per position the same arithmetic: the loss's mean differs at most in summation order.
    np.testing.assert_allclose(fused[0], unfused[0], rtol=2e-7)
    assert fused[1] == unfused[1]  # the accuracy counts the same hits
    np.testing.assert_allclose(fused[2], unfused[2], rtol=1e-6, atol=1e-9)  # dx
    # The kernel's gradient sums the chunks in f32, in another order than one matmul.
    np.testing.assert_allclose(fused[3], unfused[3], rtol=1e-5, atol=1e-8)
    assert float(jnp.abs(fused[2]).max()) > 0 and float(jnp.abs(fused[3]).max()) > 0


def test_fused_in_bf16_and_soft_capped():
    x, kernel, targets, mask = _inputs(4, 256, jnp.bfloat16)
    fused, unfused = _both(x, kernel, targets, mask, transposed=True, cap=3.0)
    np.testing.assert_allclose(fused[0], unfused[0], rtol=1e-6)
    assert fused[1] == unfused[1]
    for f, u in zip(fused[2:], unfused[2:], strict=True):  # bf16 gradients: to bf16 rounding
        assert f.dtype == u.dtype == jnp.bfloat16
        np.testing.assert_allclose(f.astype(jnp.float32), u.astype(jnp.float32), rtol=2e-2,
                                   atol=1e-4)
    # The cap is applied: without it, another loss.
    plain = head_cross_entropy(x, kernel, targets, mask, transposed=True)[0]
    assert abs(float(plain) - float(fused[0])) > 1e-3


def test_the_loss_cotangent_scales_the_gradients_exactly():
    # A loss scale is a power of two: the gradients the forward formed for a cotangent of 1,
    # scaled, are bit for bit those of the scaled loss.
    x, kernel, targets, mask = _inputs(2, 512)

    def loss(x, k, scale):
        return head_cross_entropy(x, k, targets, mask, transposed=True)[0] * scale

    grad = jax.jit(jax.grad(loss, (0, 1)))
    one, scaled = grad(x, kernel, 1.0), grad(x, kernel, 2.0 ** 12)
    for a, b in zip(one, scaled, strict=True):
        np.testing.assert_array_equal(np.asarray(a) * 2.0 ** 12, np.asarray(b))


def test_frozen_head_bits_and_f16_give_the_unfused_numbers():
    x, kernel, targets, _ = _inputs(2, 64, jnp.bfloat16)
    as_array = jax.jit(lambda x, k: head_cross_entropy(x, k, targets, transposed=True))
    as_bits = jax.jit(lambda x, k: head_cross_entropy(x, keep(k), targets, transposed=True))
    assert as_array(x, kernel) == as_bits(x, kernel)
    x16, k16 = x.astype(jnp.float16), kernel.astype(jnp.float16)
    fused, unfused = _both(x16, k16, targets, None, transposed=True)
    for f, u in zip(fused, unfused, strict=True):  # f16 takes the unfused path itself
        np.testing.assert_array_equal(np.asarray(f), np.asarray(u))


def test_no_step_buffer_holds_every_logit():
    # 4 x 1,024 tokens of 1,024 classes: 16 MiB of f32 logits. The fused step's temporaries
    # stay under half of that; the unfused step's hold them (the test can fail).
    b, s, v = 4, 1024, 1024
    x = jnp.zeros((b, s, D))
    kernel, targets = jnp.zeros((v, D)), jnp.zeros((b, s), jnp.int32)
    logits_bytes = 4 * b * s * v

    def temp(fn):
        step = jax.jit(jax.grad(lambda x, k: fn(x, k)[0], (0, 1)))
        return step.lower(x, kernel).compile().memory_analysis().temp_size_in_bytes

    fused = temp(lambda x, k: head_cross_entropy(x, k, targets, transposed=True))
    unfused = temp(lambda x, k: cross_entropy_and_accuracy(
        head_logits(x, k, transposed=True), targets))
    assert fused < logits_bytes / 2 <= unfused, (fused, unfused)


def test_bad_targets_are_refused():
    x, kernel, targets, _ = _inputs(2, 8)
    with pytest.raises(ValueError, match=r"targets must be integer class ids of shape \(2, 8\), "
                       r"got float32\[2, 8\]"):
        head_cross_entropy(x, kernel, targets.astype(jnp.float32), transposed=True)
    with pytest.raises(ValueError, match=r"got int32\[2, 7\]"):
        head_cross_entropy(x, kernel, targets[:, :7], transposed=True)
