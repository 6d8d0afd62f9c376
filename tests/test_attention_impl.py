"""The attention implementations of ``ATTENTION`` agree, with grouped-query attention too.

Reference: ``attend`` on kv heads gathered explicitly with the Hugging Face convention (query head
``h`` reads kv head ``h // (H // H_kv)``), so the convention itself is checked, not only that the
implementations repeat heads the same way.

Tolerances: f32 values and gradients within 1e-5 absolute (O(1) inputs; observed <= 2e-6).
bf16 inputs are compared with the f32 reference on the same bf16-rounded inputs: within 2^-6 of
the reference's largest magnitude. bf16 keeps 8 significant bits, so one rounding of the output
is up to 2^-8 relative; naive attention also rounds the scores and the probabilities to bf16
before the second matmul (and ``xla``'s forward the probabilities), which compounds to a few
ulps: observed <= 0.0075 (just under 2^-7) over outputs and the q, k, v gradients.
"""

import dataclasses
import functools
import warnings

import chex
import jax
import jax.numpy as jnp
import pytest

from effijax.errors import ConfigError
from effijax.models import (
    ATTENTION,
    AttentionChoice,
    AttentionFallbackWarning,
    GPTConfig,
    _attention,
    abstract_split,
    attend,
    blockwise_attend,
    choose_attention,
    gpt_config,
    init_params,
    make_loss_fn,
    xla_attend,
)
from effijax.models._attention import CPU_ATTENTION

# Small blocks so that S=40 runs several (padded) query and key blocks.
IMPLS = {"naive": attend,
         "blockwise": functools.partial(blockwise_attend, block_q=16, block_k=16),
         "xla": xla_attend}


def _reference(q, k, v, causal):
    heads_H = jnp.arange(q.shape[2]) // (q.shape[2] // k.shape[2])
    return attend(q, jnp.take(k, heads_H, axis=2), jnp.take(v, heads_H, axis=2), causal=causal)


def _inputs(h_kv, dtype, *, b=2, s=40, h=4, k=8):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, s, h, k)).astype(dtype)
    kk = jax.random.normal(keys[1], (b, s, h_kv, k)).astype(dtype)
    v = jax.random.normal(keys[2], (b, s, h_kv, k)).astype(dtype)
    w = jax.random.normal(keys[3], (2, b, s, h, k))  # cotangent weights, causal and not
    return q, kk, v, w


@functools.cache
def _values_and_grads(name: str):
    """``name``'s jitted (out, (dq, dk, dv)), causal and not stacked; one per name, so the
    reference's compilation is shared by the f32 and bf16 tests."""
    fn = {**IMPLS, "reference": _reference}[name]

    def loss(q, k, v, w):
        out = jnp.stack([fn(q, k, v, causal=True), fn(q, k, v, causal=False)])
        return jnp.sum(out.astype(jnp.float32) * w), out

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    return jax.jit(lambda q, k, v, w: (lambda r: (r[0][1], r[1]))(grad(q, k, v, w)))


@pytest.mark.parametrize("h_kv", [4, 2, 1])  # multi-head, grouped (2 per kv head), multi-query
def test_f32_values_and_grads_match(h_kv):
    q, k, v, w = _inputs(h_kv, jnp.float32)
    ref_out, ref_grads = _values_and_grads("reference")(q, k, v, w)
    assert ref_grads[1].shape == k.shape
    for name in IMPLS:
        out, grads = _values_and_grads(name)(q, k, v, w)
        assert out.dtype == jnp.float32, name
        chex.assert_trees_all_close(out, ref_out, atol=1e-5, rtol=0, custom_message=name)
        chex.assert_trees_all_close(grads, ref_grads, atol=1e-5, rtol=0, custom_message=name)


# bf16 rounding does not depend on the grouping beyond summing a group's gradients: H_kv = 2
# (2 query heads per kv head) covers that; the f32 test covers the head ratios.
def test_bf16_values_and_grads_match_the_f32_reference():
    q, k, v, w = _inputs(2, jnp.bfloat16)
    up = lambda x: x.astype(jnp.float32)
    ref = _values_and_grads("reference")(up(q), up(k), up(v), w)
    for name in IMPLS:
        got = _values_and_grads(name)(q, k, v, w)
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(got)), name
        for what, a, r in zip(("out", "dq", "dk", "dv"), jax.tree.leaves(got),
                              jax.tree.leaves(ref), strict=True):
            err = float(jnp.max(jnp.abs(up(a) - r)))
            assert err <= 2.0**-6 * float(jnp.max(jnp.abs(r))), (name, what, err)


@pytest.mark.parametrize("name", list(ATTENTION))
def test_bad_head_ratio_raises_before_tracing(name):
    q, k, v = jnp.ones((1, 8, 4, 8)), jnp.ones((1, 8, 3, 8)), jnp.ones((1, 8, 3, 8))
    with pytest.raises(ValueError, match=r"H=4 heads, k and v have H_kv=3; grouped-query"):
        ATTENTION[name](q, k, v)


def test_xla_refuses_dropout_and_the_config_names_the_field():
    q = jnp.ones((1, 8, 2, 8))
    with pytest.raises(ValueError, match="xla_attend: .* no dropout.*GPTConfig.dropout"):
        xla_attend(q, q, q, dropout_rate=0.1, dropout_key=jax.random.key(0))
    with pytest.raises(ConfigError, match=r"^attention='xla': .* no attention dropout"):
        GPTConfig(seq_len=8, d_model=16, n_layers=1, n_heads=2, attention="xla", dropout=0.1)
    with pytest.raises(ConfigError, match=r"^attention='flash': unknown .*'naive', 'blockwise', "
                                          r"'xla', 'auto'"):
        GPTConfig(seq_len=8, d_model=16, n_layers=1, n_heads=2, attention="flash")


def test_auto_on_cpu_is_the_documented_choice_and_silent():
    q = jax.ShapeDtypeStruct((16, 128, 4, 32), jnp.float32)
    assert jax.default_backend() == "cpu"
    assert CPU_ATTENTION == "blockwise"  # the measured choice (benchmarks/attention.py)
    for dropout in (False, True):  # blockwise has dropout: no second fallback
        assert choose_attention(q, dropout=dropout) == AttentionChoice("blockwise", False, None)
    x = jnp.ones((1, 8, 2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning on a CPU
        ATTENTION["auto"](x, x, x)
    # With dropout too: the same masks as blockwise_attend's.
    key = jax.random.key(3)
    q, k, v, _ = _inputs(2, jnp.float32)
    got, want = jax.jit(lambda q, k, v: (
        ATTENTION["auto"](q, k, v, dropout_rate=0.2, dropout_key=key),
        blockwise_attend(q, k, v, dropout_rate=0.2, dropout_key=key)))(q, k, v)
    chex.assert_trees_all_close(got, want, atol=0, rtol=0)


def test_auto_on_a_gpu_picks_cudnn_or_says_why_once(monkeypatch):
    half = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
    assert choose_attention(half, dropout=False, backend="gpu") == ("xla", True, None)
    cases = [
        (half, True, "naive", "attention dropout"),
        (jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.float32), False, "xla", "float32 inputs"),
        (jax.ShapeDtypeStruct((2, 128, 4, 12), jnp.float16), False, "xla", "head width 12"),
        (jax.ShapeDtypeStruct((2, 128, 4, 256), jnp.bfloat16), False, "xla", "head width 256"),
    ]
    for q, dropout, name, why in cases:
        choice = choose_attention(q, dropout=dropout, backend="gpu")
        assert choice.name == name and not choice.fused
        assert choice.reason.startswith(f"attention='auto': {why}"), choice.reason
    # The warning, once per reason: pretend to be a GPU (f32 inputs never reach cuDNN).
    monkeypatch.setattr(_attention, "_warned", set())
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    x = jnp.ones((1, 8, 2, 8))
    with pytest.warns(AttentionFallbackWarning, match="float32 inputs .* using 'xla'"):
        ATTENTION["auto"](x, x, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ATTENTION["auto"](x, x, x)


def test_gpt_with_xla_and_auto_matches_naive():
    config = gpt_config("tiny", seq_len=40)
    batch = {"inputs": jax.random.randint(jax.random.key(1), (2, 40), 0, 256),
             "targets": jax.random.randint(jax.random.key(2), (2, 40), 0, 256)}
    params = jax.jit(init_params, static_argnums=(0, 1))(config, None, jax.random.key(0))
    loss_fns = [make_loss_fn(abstract_split(dataclasses.replace(config, attention=a))[0])
                for a in ("naive", "xla", "auto")]
    grads = jax.jit(lambda p, b: [jax.value_and_grad(lambda q, f=f: f(q, b)[0])(p)
                                  for f in loss_fns])  # one compilation
    (ref_loss, ref_grads), *others = grads(params, batch)
    for loss, g in others:
        assert abs(float(loss) - float(ref_loss)) < 1e-5
        chex.assert_trees_all_close(g, ref_grads, atol=1e-5, rtol=1e-4)
