"""16-bit arrays crossing the layers' scan as integer bits on the CPU (effijax.models._dense:
``keep``, ``freeze_kernels``): the same numbers, without XLA:CPU's f32 copies of stacked
buffers.

XLA:CPU slices a stacked bf16 array, and updates one in place, through f32: a frozen bf16 base
was converted whole to f32 at every step, and every residual the scan stacks for the backward
was rewritten whole at every layer. The tests compare programs traced for the CPU with the same
programs traced for a GPU (:func:`~effijax.models.attention_backend`; no bits there), both
compiled and run here.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from effijax import lora
from effijax.models import attention_backend, blockwise_attend, llama_config
from effijax.models._dense import Kept, freeze_kernels
from effijax.precision import get_policy

SEQ, BATCH = 16, 2
CONFIG = llama_config("llama-tiny", attention="naive").with_seq_len(SEQ)  # no cuDNN here
SPEC = lora.LoraSpec(rank=4, targets=CONFIG.lora_targets)


def _inputs():
    policy = get_policy("bf16")
    params = CONFIG.init_params(jax.random.key(0), policy)
    adapters = jax.tree.map(lambda x: x + 0.01, lora.init(jax.random.key(1), params, SPEC))
    keys = jax.random.split(jax.random.key(5))
    batch = {name: jax.random.randint(k, (BATCH, SEQ), 0, CONFIG.vocab_size)
             for name, k in zip(("inputs", "targets"), keys, strict=True)}
    return adapters, {**batch, "base": policy.cast_to_compute(params)}


def _step(frozen_base: bool):
    loss_fn = lora.freeze_base(CONFIG.loss_fn(SPEC, frozen_base=frozen_base))
    policy = get_policy("bf16")
    return jax.jit(jax.value_and_grad(lambda a, b: loss_fn(policy.cast_to_compute(a), b)[0]))


@functools.cache
def _compiled(frozen_base: bool, backend: str):
    with attention_backend(backend):
        return _step(frozen_base).lower(*_inputs()).compile()


def _kernel_shapes() -> list[str]:
    """The stacked kernels' shapes as HLO spells them, e.g. ``[2,64,128]``."""
    base = _inputs()[1]["base"]["layers"]
    return sorted({"[" + ",".join(map(str, x.shape)) + "]"
                   for path, x in jax.tree_util.tree_leaves_with_path(base)
                   if jax.tree_util.keystr(path).endswith("['kernel']")})


def _f32_copies(hlo: str, shapes) -> int:
    """How many instructions produce an f32 array of one of ``shapes``."""
    return sum(len(re.findall(rf"= f32{re.escape(s)}\{{", hlo)) for s in shapes)


def _stack_conversions(hlo: str) -> int:
    """Conversions to f32 of whole arrays stacked along the layers (leading axis n_layers)."""
    return len(re.findall(rf"= f32\[{CONFIG.n_layers},[\d,]+\]\{{[\d,]+\}} convert\(", hlo))


def test_a_frozen_base_gives_the_same_loss_and_gradients_from_its_bits():
    inputs = _inputs()
    loss, grads = _compiled(True, "cpu")(*inputs)
    want_loss, want = _compiled(False, "cpu")(*inputs)
    assert np.array_equal(loss, want_loss)
    for path, got in jax.tree_util.tree_leaves_with_path(grads):
        assert np.array_equal(got, dict(jax.tree_util.tree_leaves_with_path(want))[path]), \
            jax.tree_util.keystr(path)


def test_the_frozen_base_is_never_copied_to_f32():
    shapes = _kernel_shapes()
    assert shapes  # the check below can find something
    frozen = _compiled(True, "cpu").as_text()
    assert _f32_copies(frozen, shapes) == 0
    # Without the bits, XLA:CPU makes f32 copies of the bf16 kernels it slices.
    assert _f32_copies(_compiled(False, "cpu").as_text(), shapes) > 0


def test_scan_residuals_are_not_converted_whole_at_each_layer():
    # The program traced for a GPU (plain residuals, compiled here) converts stacked residual
    # buffers to f32; the CPU's keeps their bits.
    cpu = _stack_conversions(_compiled(False, "cpu").as_text())
    plain = _stack_conversions(_compiled(False, "cuda").as_text())
    assert cpu < plain


def test_frozen_base_means_no_gradient_reaches_it():
    adapters, batch = _inputs()
    base = batch.pop("base")
    loss_fn = CONFIG.loss_fn(SPEC, frozen_base=True)
    grads = jax.grad(lambda p: loss_fn(p, batch)[0])({"base": base, "adapters": adapters})
    assert all(not np.any(np.asarray(g, np.float32)) for g in jax.tree.leaves(grads["base"]))
    assert any(np.any(np.asarray(g, np.float32)) for g in jax.tree.leaves(grads["adapters"]))


def test_freeze_kernels_holds_16_bit_kernels_as_bits_on_the_cpu_only():
    base = {"q": {"kernel": jnp.full((2, 3), 1.5, jnp.bfloat16)},
            "f": {"kernel": jnp.ones((2, 3))}, "n": {"scale": jnp.ones(3, jnp.bfloat16)}}
    frozen = freeze_kernels(base)
    assert isinstance(frozen["q"]["kernel"], Kept)
    assert frozen["q"]["kernel"].bits.dtype == jnp.uint16
    assert frozen["f"]["kernel"].dtype == jnp.float32  # f32 has no such detour
    assert frozen["n"]["scale"].dtype == jnp.bfloat16  # only kernels (matmul operands)
    with attention_backend("cuda"):
        assert freeze_kernels(base)["q"]["kernel"].dtype == jnp.bfloat16


@pytest.mark.parametrize("transposed", [False, True])
def test_a_kept_kernel_matmul_is_the_kernels(transposed):
    from effijax.models._dense import keep, matmul

    x = jax.random.normal(jax.random.key(0), (8, 16)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (32, 16) if transposed else (16, 32))
    w = w.astype(jnp.bfloat16)

    def loss(x, kernel):
        return jnp.sum(matmul(x, kernel, transposed=transposed).astype(jnp.float32) ** 2)

    got, dx = jax.value_and_grad(loss)(x, keep(w))
    want, want_dx = jax.value_and_grad(loss)(x, jax.lax.stop_gradient(w))
    assert np.array_equal(got, want) and np.array_equal(dx, want_dx)


def test_blockwise_attention_residuals_cross_the_scan_as_bits():
    # The blockwise kernel's own backward saves q, k, v and the output: bf16 residuals that a
    # scan of layers stacks. Kept as bits, no stacked buffer is converted to f32.
    layers, shape = 3, (BATCH, SEQ, 2, 8)
    x = jax.random.normal(jax.random.key(0), shape).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (layers, 8, 8)).astype(jnp.bfloat16)

    def loss(w, x):
        def body(x, w):
            q = jnp.einsum("bshk,kj->bshj", x, w)
            return blockwise_attend(q, x, x, block_q=8, block_k=8), None

        return jnp.sum(jax.lax.scan(body, x, w)[0].astype(jnp.float32) ** 2)

    hlo = jax.jit(jax.grad(loss)).lower(w, x).compile().as_text()
    # The kernel's layouts, stacked: q and the output [L, B, N, S, G, K], k and v [L, B, N, T, K].
    shapes = [f"[{layers},{BATCH},2,{SEQ},1,8]", f"[{layers},{BATCH},2,{SEQ},8]"]
    assert all(f"u16{s}" in hlo for s in shapes)  # stacked as bits
    assert not any(re.search(rf"= f32{re.escape(s)}\{{[\d,]+\}} (convert|fusion)\(", hlo)
                   for s in shapes)
