"""Sliding-window (local causal) attention: every implementation, the decoder, the KV cache.

Convention (Hugging Face's ``sliding_window``, Mistral and Gemma 3): query ``i`` attends to keys
``i - w < j <= i``. The reference below writes that mask out by hand, independently of
effijax's masks, and computes values and gradients in float64 NumPy (nothing to compile); the
implementations (f32) must match it within 1e-5 (tests/test_attention_impl.py's f32 tolerance):
with grouped-query heads,
packed rows, static (Python int) and traced (int32 array, what a scanned per-layer window is)
windows. A window that is not a multiple of the blocks and one smaller than a block exercise the
blockwise kernel's partial tiles and skipped tiles.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from effijax.errors import ConfigError
from effijax.memory import tree_bytes
from effijax.models import (
    Llama,
    attend,
    blockwise_attend,
    gemma3_config,
    llama_config,
    mistral_config,
    xla_attend,
)
from effijax.models._attention import auto_attend, choose_attention
from effijax.models._blockwise import tiles_visited
from effijax.models._cache import init_cache, split_layers
from effijax.models._decoder import LayerInputs

ATOL = 1e-5
IMPLS = {"naive": attend,
         "blockwise": functools.partial(blockwise_attend, block_q=16, block_k=8),
         "xla": xla_attend}
S, H, H_KV, K = 40, 4, 2, 8
SEGMENTS = jnp.array([[1] * 25 + [2] * 15, [1] * 10 + [2] * 28 + [0] * 2])


def _mask(s, window, segments=None):
    """``[B or 1, S, S]``: causal, inside the window, same segment; written out by hand."""
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    mask = ((j <= i) & (j > i - window))[None]
    if segments is not None:
        segments = np.asarray(segments)
        mask = mask & (segments[:, :, None] == segments[:, None, :])
    return mask


def _reference(q, k, v, window, segments=None, dout=None):
    """Windowed causal attention in float64 NumPy (no compilation), and with ``dout`` its
    gradients by the softmax's backward written out; query head h reads kv head h // (H // H_kv).
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    kk, vv = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    scale = 1.0 / np.sqrt(q.shape[-1])
    mask = _mask(q.shape[1], window, segments)[:, None]
    scores = np.where(mask, np.einsum("bshk,bthk->bhst", q, kk) * scale, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bhst,bthk->bshk", probs, vv)
    if dout is None:
        return out
    dout = np.asarray(dout, np.float64)
    dprobs = np.einsum("bshk,bthk->bhst", dout, vv)
    dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdims=True))
    dq = np.einsum("bhst,bthk->bshk", dscores, kk) * scale
    dk = np.einsum("bhst,bshk->bthk", dscores, q) * scale
    dv = np.einsum("bhst,bshk->bthk", probs, dout)
    fold = lambda g: g.reshape(*g.shape[:2], k.shape[2], groups, g.shape[-1]).sum(3)
    return out, (dq, fold(dk), fold(dv))


def _inputs(h_kv=H_KV):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (2, S, H, K))
    k = jax.random.normal(keys[1], (2, S, h_kv, K))
    v = jax.random.normal(keys[2], (2, S, h_kv, K))
    w = jax.random.normal(keys[3], (3, 2, S, H, K))  # cotangent weights, one per case
    return q, k, v, w


# (static window, segments): smaller than a key block; a traced window with packed rows; a
# static window, not a multiple of the blocks, with packed rows.
CASES = ((5, None), ("traced", SEGMENTS), (17, SEGMENTS))
TRACED = 11


@functools.cache
def _values_and_grads(name: str):
    """``name``'s jitted (outputs, grads) of the three CASES stacked, one compilation."""
    fn = IMPLS[name]

    def loss(q, k, v, w, traced):
        out = jnp.stack([fn(q, k, v, window=traced if window == "traced" else window,
                            segments_BS=segments) for window, segments in CASES])
        return jnp.sum(out * w), out

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    return jax.jit(lambda q, k, v, w, traced: (lambda r: (r[0][1], r[1]))(
        grad(q, k, v, w, traced)))


@pytest.mark.parametrize("name", ["naive", "blockwise", "xla"])
def test_values_and_grads_match_reference(name):
    q, k, v, w = _inputs()
    out, grads = _values_and_grads(name)(q, k, v, w, jnp.int32(TRACED))
    ref_grads = [np.zeros(x.shape) for x in (q, k, v)]
    for n, (window, segments) in enumerate(CASES):
        ref_out, case_grads = _reference(q, k, v, TRACED if window == "traced" else window,
                                         segments, dout=w[n])
        np.testing.assert_allclose(out[n], ref_out, atol=ATOL, rtol=0)
        ref_grads = [a + b for a, b in zip(ref_grads, case_grads, strict=True)]
    for g, ref_g in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, ref_g, atol=ATOL, rtol=0)
    # The window matters: plain causal attention differs from it.
    assert float(np.abs(_reference(q, k, v, S) - out[0]).max()) > 0.1


@pytest.mark.parametrize("name", ["naive", "blockwise", "xla"])
def test_window_of_the_whole_sequence_is_plain_causal(name):
    q, k, v, _ = _inputs(h_kv=H)
    fn = IMPLS[name]
    plain = fn(q, k, v)
    for window in (S, S + 7):
        np.testing.assert_array_equal(fn(q, k, v, window=window), plain)


def test_blockwise_tiles_grow_linearly_at_a_fixed_window():
    causal = [tiles_visited(s, block_q=64, block_k=64) for s in (1024, 2048, 4096)]
    local = [tiles_visited(s, block_q=64, block_k=64, window=128) for s in (1024, 2048, 4096)]
    assert causal[0] == (136, 136) and causal[2][0] == 64 * 65 // 2  # the lower triangle
    # Query block i (rows 64 i .. 64 i + 63) needs key blocks i - 2 .. i: at most 3 per block.
    assert local == [(16 * 3 - 3, 16 * 3 - 3), (32 * 3 - 3, 32 * 3 - 3), (64 * 3 - 3, 64 * 3 - 3)]
    # A window that is not a multiple of the blocks reaches one partial tile more at most.
    assert tiles_visited(4096, block_q=64, block_k=64, window=100)[0] <= 64 * 3


def test_bad_windows_are_refused_before_tracing():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="window=0: must be an integer >= 1"):
        attend(q, k, v, window=0)
    with pytest.raises(ValueError, match="needs causal=True"):
        blockwise_attend(q, k, v, causal=False, window=4)
    with pytest.raises(ValueError, match="integer scalar"):
        xla_attend(q, k, v, window=jnp.float32(4))


def test_auto_passes_the_window_on():
    q, k, v, _ = _inputs()
    np.testing.assert_allclose(auto_attend(q, k, v, window=5), _reference(q, k, v, 5),
                               atol=ATOL, rtol=0)
    q16 = jax.ShapeDtypeStruct((1, 128, 4, 32), jnp.bfloat16)
    assert choose_attention(q16, dropout=False, backend="gpu", window=64).fused
    traced = choose_attention(q16, dropout=False, backend="gpu", window=jnp.int32(64))
    assert traced.name == "xla" and "traced (per-layer) sliding window" in traced.reason


# ----------------------------------------------------------------------------------------------
# The decoder and its cache.

WINDOW = 6


class _Alternating(Llama):
    """Gemma 3's pattern on the Llama: a local layer, then a global one."""


class _AlternatingConfig(type(llama_config("llama-tiny"))):
    @property
    def layer_windows(self):
        return (WINDOW, None)


_AlternatingConfig.decoder = _Alternating


def _model(kind: str):
    """llama-tiny (2 layers, GQA) with every layer local ("uniform") or alternating."""
    base = llama_config("llama-tiny", seq_len=24)
    if kind == "uniform":
        return dataclasses.replace(base, sliding_window=WINDOW)
    return _AlternatingConfig(**{f.name: getattr(base, f.name)
                                 for f in dataclasses.fields(base) if f.init})


@functools.cache
def _params():
    return _model("uniform").init_params(jax.random.key(1))


@functools.cache
def _logits_fn(kind: str):
    """One compiled forward pass per kind, shared by the tests."""
    return jax.jit(_model(kind).logits_fn())


def _tokens():
    return jax.random.randint(jax.random.key(2), (2, 21), 0, 256)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _layer_by_layer(config, params, tokens, windows):
    """The forward pass with each layer called on its own, with a static window."""
    graphdef = nnx.split(config.decoder(config, rngs=nnx.Rngs(0)), nnx.Param)[0]
    model = nnx.merge(graphdef, params)
    x, positions = model.embed_positions(model._embed(tokens), None, tokens.shape[1])
    layer_def = nnx.split(model.layers)[0]
    for layer_params, window in zip(split_layers(params["layers"]), windows, strict=True):
        x = nnx.merge(layer_def, layer_params)(x, None, None, LayerInputs(positions, None, window))
    return model.head(x)


@pytest.mark.parametrize("kind", ["uniform", "alternating"])
def test_decoder_windows_per_layer(kind):
    config, params, tokens = _model(kind), _params(), _tokens()
    logits = _logits_fn(kind)(params, tokens)
    windows = (WINDOW, WINDOW) if kind == "uniform" else (WINDOW, None)
    # The reference calls each layer with its static window: a window that did not reach the
    # layers would give the unwindowed logits, which differ from it by more than 1e-3.
    expected = _layer_by_layer(config, params, tokens, windows)
    np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=0)


def _masked_cache(config, batch, max_len):
    """The layout before rolling caches: every layer keeps ``max_len`` slots, windows masked."""
    shape = config.shape()
    return init_cache(shape.layers, batch, max_len, shape.kv_heads, shape.head_dim)


@functools.cache
def _decoded(kind: str, layout: str):
    """Logits ``[3, 21, V]`` of three rows decoded into a ``layout`` cache: a prompt of 7, 6 and
    4 tokens (longer than, equal to and shorter than the window, left-padded by 0, 1 and 3
    slots), prefilled at once, then one token per step well past the window; each row's tokens
    are the first row's, shifted. Also the unrolled step's logits at the last slot."""
    config, params, tokens = _model(kind), _params(), _tokens()
    pad = jnp.array([0, 1, 3], jnp.int32)
    rows = jnp.stack([jnp.concatenate([jnp.zeros(p, jnp.int32), tokens[0, :21 - p]])
                      for p in (0, 1, 3)])
    cache = (config.init_cache(3, 24) if layout == "ring" else _masked_cache(config, 3, 24))
    decode = jax.jit(config.decode_fn())
    logits, cache = decode(params, cache._replace(pad_B=pad), rows[:, :7], jnp.int32(0))
    steps = [logits]
    for slot in range(7, 20):
        logits, cache = decode(params, cache, rows[:, slot:slot + 1], jnp.int32(slot))
        steps.append(logits)
    unrolled, _ = decode(params, cache, rows[:, 20:], jnp.int32(20),
                         layers=config.decode_fn().split_layers(params))
    last, cache = decode(params, cache, rows[:, 20:], jnp.int32(20))
    return jnp.concatenate([*steps, last], axis=1), unrolled, cache


@pytest.mark.parametrize("kind", ["uniform", "alternating"])
def test_cached_decode_past_the_window_equals_the_full_pass(kind):
    full = _logits_fn(kind)(_params(), _tokens())
    cached, unrolled, cache = _decoded(kind, "ring")
    # The local layers keep a ring of WINDOW slots, the global one (alternating) 24.
    assert cache.ring_len == WINDOW and cache.k_LBWGK.shape[0] == (2 if kind == "uniform" else 1)
    assert cache.k_LBTGK.shape[:3] == (0 if kind == "uniform" else 1, 3, 24)
    for row, pad in enumerate((0, 1, 3)):
        np.testing.assert_allclose(cached[row, pad:], full[0, :21 - pad], atol=1e-4, rtol=0)
    # The unrolled layers (one buffer each) read and write the same cache.
    np.testing.assert_allclose(unrolled, cached[:, 20:], atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["uniform", "alternating"])
def test_rolling_cache_gives_the_masked_caches_logits(kind):
    ring, _, _ = _decoded(kind, "ring")
    masked, _, cache = _decoded(kind, "masked")
    assert cache.k_LBWGK is None and cache.k_LBTGK.shape[:3] == (2, 3, 24)
    # Not bitwise: a ring query sums its softmax over the keys in ring order, the masked cache in
    # slot order (and over 24 + 1 entries, most of them exactly 0); f32 rounding apart.
    # Observed: 1.8e-7 apart.
    np.testing.assert_allclose(ring, masked, atol=1e-5, rtol=0)


def test_cache_bytes_of_rolling_windows():
    """Shapes only (nothing compiled): Gemma 3 270M at max_len 4096 keeps 3 global layers of
    4096 slots and 15 rings of 512 instead of 18 x 4096; Mistral's layers are all local."""
    def cache_bytes(config, max_len, ring=True):
        make = config.init_cache if ring else functools.partial(_masked_cache, config)
        return tree_bytes(jax.eval_shape(lambda: make(1, max_len)))

    per_slot = 2 * 1 * 256 * 4  # keys and values, 1 kv head of 256, f32
    gemma = gemma3_config("gemma-3-270m")
    assert cache_bytes(gemma, 4096, ring=False) == 18 * 4096 * per_slot + 4  # + pad_B
    assert cache_bytes(gemma, 4096) == (3 * 4096 + 15 * 512) * per_slot + 4  # 27% of it
    assert cache_bytes(gemma, 512) == cache_bytes(gemma, 512, ring=False)  # window >= max_len
    mistral = mistral_config("mistral-tiny")  # 2 layers, 2 kv heads of 16, window 8
    assert cache_bytes(mistral, 256, ring=False) == 2 * 256 * 2 * 2 * 16 * 4 + 4
    assert cache_bytes(mistral, 256) == 2 * 8 * 2 * 2 * 16 * 4 + 4
    # A cache made for other layers is refused before tracing, with the fix.
    config = _model("alternating")
    short = _masked_cache(config, 1, 24)
    short = short._replace(k_LBTGK=short.k_LBTGK[:1], v_LBTGK=short.v_LBTGK[:1])
    with pytest.raises(ConfigError, match=r"^cache: holds 1 full-length layers and no rings; "
                       r"layers of windows \(6, None\) take 1 full-length layers and 1 rings of 6 "
                       r"slots or 2 full-length layers and no rings at max_len 24: make it with "
                       r"the model's init_cache\(batch, max_len\)"):
        jax.eval_shape(config.decode_fn(), config.abstract_params(), short,
                       jnp.zeros((1, 1), jnp.int32), jnp.int32(0))


def test_logits_match_transformers_mistral():
    """A tiny random ``MistralForCausalLM`` whose window (5) is shorter than the prompt (16)
    gives effijax's Llama-shaped model with ``sliding_window=5`` the same logits."""
    torch = pytest.importorskip("torch", reason="needs torch (effijax[interop])")
    transformers = pytest.importorskip("transformers", reason="needs transformers")
    from effijax.interop._weights import assemble_params

    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=500.0, rms_norm_eps=1e-5, sliding_window=5, tie_word_embeddings=False,
        attn_implementation="eager")).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    tokens = np.random.default_rng(0).integers(0, 96, (2, 16))
    with torch.no_grad():
        expected = hf(torch.tensor(tokens)).logits.numpy()
        unwindowed = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **{k: v for k, v in hf.config.to_dict().items() if k != "sliding_window"}))
        unwindowed.load_state_dict(hf.state_dict())
        plain = unwindowed.eval()(torch.tensor(tokens)).logits.numpy()
    config = llama_config("llama-tiny", vocab_size=96, d_model=32, head_dim=8, d_ff=64,
                          rope_theta=500.0,
                          max_position=64, seq_len=16, sliding_window=5)
    state = {name: t.numpy() for name, t in hf.state_dict().items()}
    params = assemble_params(config, state.__getitem__)
    logits = np.asarray(jax.jit(config.logits_fn())(params, jnp.asarray(tokens)))
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)
    assert np.abs(expected - plain)[:, 5:].max() > 1e-2  # the window changes transformers' too
