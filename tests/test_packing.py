"""Packed rows are computed as if each example were alone.

``pack_examples`` numbers the examples of a row (``segments_NW``); the batches carry the inputs'
ids as ``"segments"``, with which every attention implementation keeps attention within an
example and the models restart positions (the GPT's learned ones, the Llama's rotary ones) at
each example's start. The reference for "alone" is each example at the start of its own row,
padded after its end, without segments: the models are causal, so padding after a token changes
nothing before it. Rotary scores depend only on the distance between positions, so for the Llama
restarting them is exact in math either way (it keeps the angles small, as each example alone
has them); the GPT's learned positions are where a missing restart shows in the logits.

Tolerances: f32 throughout. Logits of the tiny models agree within 2e-5 (observed ~1e-6: the same
math on differently shaped arrays sums in another order); attention values and gradients
within 1e-5 as in ``test_attention_impl.py``; losses within 1e-6 relative and parameter
gradients within 1e-6 absolute / 1e-4 relative (observed ~1e-8).
"""

import dataclasses
import functools
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from effijax.data import Packed, batch_at, eval_batches, pack_examples, packed_batch
from effijax.errors import ConfigError
from effijax.models import (
    ATTENTION,
    AttentionFallbackWarning,
    _attention,
    attend,
    blockwise_attend,
    choose_attention,
    gpt_config,
    llama_config,
    segment_positions,
    xla_attend,
)

SEQ = 32
MODELS = {"gpt": gpt_config("tiny", seq_len=SEQ), "llama": llama_config("llama-tiny", seq_len=SEQ)}


def _examples(seed=0, lengths=(7, 12, 9, 20, 5, 11, 3)):
    """Random ``(ids, mask)`` examples; the mask trains each example's second half."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(1, 256, n).astype(np.int32)
        mask = (np.arange(n) >= n // 2).astype(np.int32)
        out.append((ids, mask))
    return out


def _alone(examples) -> Packed:
    """Each example alone in its own row (segment 1, then padding)."""
    rows = [pack_examples([ex], SEQ, pad_id=0) for ex in examples]
    return Packed(np.concatenate([r.tokens_NW for r in rows]),
                  np.concatenate([r.mask_NW for r in rows]),
                  np.concatenate([r.segments_NW for r in rows]))


def _no_segments(batch):
    return {k: v for k, v in batch.items() if k != "segments"}


@functools.cache
def _params(family):
    return jax.jit(MODELS[family].init_params)(jax.random.key(0))


def _model(family, attention):
    return dataclasses.replace(MODELS[family], attention=attention)


# --------------------------------------------------------------------------------------------
# The data: segments, positions, the targets' mask, pure functions of (seed, step).
# --------------------------------------------------------------------------------------------


def test_pack_examples_numbers_the_examples_of_each_row():
    packed = pack_examples(_examples(), SEQ, pad_id=0)
    # next-fit in rows of 33: [7, 12, 9] [20, 5] [11, 3]
    assert packed.segments_NW.dtype == np.int32 and packed.segments_NW.shape == (3, SEQ + 1)
    want = [[1] * 7 + [2] * 12 + [3] * 9 + [0] * 5, [1] * 20 + [2] * 5 + [0] * 8,
            [1] * 11 + [2] * 3 + [0] * 19]
    assert packed.segments_NW.tolist() == want
    # Padding is exactly the zero segment (the examples' ids are never the pad id 0).
    np.testing.assert_array_equal(packed.segments_NW == 0, packed.tokens_NW == 0)


def test_batches_carry_the_inputs_segments_and_no_target_across_examples():
    examples = [(np.array([5, 6, 7], np.int32), np.array([1, 1, 1], np.int32)),
                (np.array([8, 9], np.int32), np.array([1, 1], np.int32))]
    batch = packed_batch(pack_examples(examples, 5, pad_id=0), np.array([0]))
    assert batch["inputs"].tolist() == [[5, 6, 7, 8, 9]]
    assert batch["segments"].tolist() == [[1, 1, 1, 2, 2]]
    # Targets 6, 7 (from 5, 6), not 8 (the second example's first token, from 7), then 9, pad.
    assert batch["mask"].tolist() == [[1, 1, 0, 1, 0]]
    assert pack_examples(examples, 5, pad_id=0).trained_tokens == 3


def test_segment_positions_restart_at_each_segment():
    seg = jnp.array([[1, 1, 1, 2, 2, 3, 0, 0], [1] * 8])
    assert segment_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]


def test_batch_at_segments_are_a_pure_function_of_seed_and_step_and_split_by_process():
    packed = pack_examples(_examples(lengths=tuple(range(3, 30, 2))), SEQ, pad_id=0)
    a = batch_at(packed, seed=3, step=7, batch_size=4, seq_len=SEQ)
    b = batch_at(packed, seed=3, step=7, batch_size=4, seq_len=SEQ)
    c = batch_at(packed, seed=3, step=8, batch_size=4, seq_len=SEQ)
    assert set(a) == {"inputs", "targets", "mask", "segments"}
    assert a["segments"].dtype == np.int32 and a["segments"].shape == (4, SEQ)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    assert any(not np.array_equal(a[k], c[k]) for k in a)
    # The rows' segments are those of the rows drawn: the inputs match a packed row.
    for r in range(4):
        row = next(i for i in range(len(packed))
                   if np.array_equal(packed.tokens_NW[i, :-1], a["inputs"][r]))
        np.testing.assert_array_equal(a["segments"][r], packed.segments_NW[row, :-1])
    # Two processes: their blocks of rows, concatenated, are the single-process batch.
    parts = [batch_at(packed, seed=3, step=7, batch_size=4, seq_len=SEQ, process_index=i,
                      process_count=2) for i in range(2)]
    for key in a:
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), a[key])
    evals = eval_batches(packed, batch_size=4, seq_len=SEQ, num_batches=2)
    halves = [eval_batches(packed, batch_size=4, seq_len=SEQ, num_batches=2, process_index=i,
                           process_count=2) for i in range(2)]
    for n in range(2):
        assert set(evals[n]) == set(a)
        np.testing.assert_array_equal(
            np.concatenate([h[n]["segments"] for h in halves]), evals[n]["segments"])


def test_text_windows_carry_no_segments():
    batch = batch_at(np.arange(200, dtype=np.uint8), seed=0, step=0, batch_size=2, seq_len=8)
    assert set(batch) == {"inputs", "targets"}


# --------------------------------------------------------------------------------------------
# Attention: every implementation masks across segments; blockwise equals naive.
# --------------------------------------------------------------------------------------------


def _qkvw(b, s, h, h_kv, k=8, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(keys[0], (b, s, h, k)), jax.random.normal(keys[1], (b, s, h_kv, k)),
            jax.random.normal(keys[2], (b, s, h_kv, k)), jax.random.normal(keys[3], (b, s, h, k)))


# Segments crossing 16- and 32-wide blocks; the last row is one segment then padding, the second
# a row of many short segments (single-token ones included).
_SEGMENTS = np.array([
    [1] * 13 + [2] * 30 + [3] * 20 + [0] * 7,
    [1] * 3 + [2] * 1 + [3] * 17 + [4] * 1 + [5] * 48,
    [1] * 40 + [0] * 30,
], np.int32)
_SLOW = pytest.mark.slow


@functools.cache
def _attention_grads(name, causal, h_kv):
    fn = {"naive": attend, "xla": xla_attend,
          "blockwise": functools.partial(blockwise_attend, block_q=16, block_k=32)}[name]

    def loss(q, k, v, w, seg):
        out = fn(q, k, v, causal=causal, segments_BS=seg)
        return jnp.sum(out * w), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.mark.parametrize(("causal", "h_kv"), [(True, 2), (False, 4),
                                              pytest.param(True, 4, marks=_SLOW),
                                              pytest.param(False, 2, marks=_SLOW)])
def test_blockwise_and_xla_with_segments_equal_naive_values_and_grads(causal, h_kv):
    q, k, v, w = _qkvw(3, 70, 4, h_kv)  # 70 = 4 x 16 + 6 = 2 x 32 + 6: padded blocks
    seg = jnp.asarray(_SEGMENTS)
    (_, ref), ref_grads = _attention_grads("naive", causal, h_kv)(q, k, v, w, seg)
    assert bool(jnp.all(jnp.isfinite(ref)))
    for name in ("blockwise", "xla"):
        (_, out), grads = _attention_grads(name, causal, h_kv)(q, k, v, w, seg)
        chex.assert_trees_all_close(out, ref, atol=1e-5, rtol=0)
        chex.assert_trees_all_close(grads, ref_grads, atol=1e-5, rtol=0)
    # Naive with segments is each segment attended alone (the reference's own check).
    alone = jax.jit(functools.partial(attend, causal=causal))
    for r, a, e in ((0, 13, 43), (1, 3, 4), (1, 22, 70), (2, 40, 70)):
        chex.assert_trees_all_close(ref[r:r + 1, a:e], alone(q[r:r + 1, a:e], k[r:r + 1, a:e],
                                                             v[r:r + 1, a:e]), atol=1e-5, rtol=0)
    # And segments change something: without them the rows differ after the first segment.
    (_, plain), _ = _attention_grads("naive", causal, h_kv)(q, k, v, w, jnp.ones_like(seg))
    assert float(jnp.max(jnp.abs(plain[0, 13:] - ref[0, 13:]))) > 1e-2


def test_segments_must_be_integer_ids_of_the_queries():
    x = jnp.ones((2, 8, 2, 4))
    for fn in (attend, blockwise_attend, xla_attend):
        with pytest.raises(ValueError, match="segments_BS must be integer ids"):
            fn(x, x, x, segments_BS=jnp.ones((2, 7), jnp.int32))
        with pytest.raises(ValueError, match="segments_BS must be integer ids"):
            fn(x, x, x, segments_BS=jnp.ones((2, 8), jnp.float32))
    with pytest.raises(ValueError, match="no segment ids"):
        blockwise_attend(x, x, x, implementation="cudnn", segments_BS=jnp.ones((2, 8), jnp.int32))


def test_auto_falls_back_from_cudnn_with_segments_once(monkeypatch):
    half = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
    assert choose_attention(half, dropout=False, backend="gpu").fused
    choice = choose_attention(half, dropout=False, backend="gpu", segments=True)
    assert choice.name == "xla" and not choice.fused
    assert "segment ids" in choice.reason
    assert choose_attention(half, dropout=False, backend="cpu", segments=True).name == "blockwise"
    # On a (pretended) GPU: f32 inputs fall back for their dtype first; the warning names it once.
    monkeypatch.setattr(_attention, "_warned", set())
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    x = jnp.ones((1, 8, 2, 8))
    seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]])
    with pytest.warns(AttentionFallbackWarning, match="using 'xla'"):
        out = ATTENTION["auto"](x, x, x, segments_BS=seg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ATTENTION["auto"](x, x, x, segments_BS=seg)
    chex.assert_trees_all_close(out, attend(x, x, x, segments_BS=seg), atol=1e-6, rtol=0)


# --------------------------------------------------------------------------------------------
# The models: packed logits, loss and gradients equal the examples' alone.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("family", "attention"), [
    *[("gpt", a) for a in ("naive", "blockwise", "xla")], ("llama", "blockwise"),
    # "auto" is "blockwise" on a CPU.
    *[pytest.param(f, a, marks=_SLOW) for f, a in (("gpt", "auto"), ("llama", "naive"),
                                                    ("llama", "xla"), ("llama", "auto"))]])
def test_packed_logits_equal_each_example_alone(family, attention):
    examples = _examples()
    packed = pack_examples(examples, SEQ, pad_id=0)
    alone = _alone(examples)
    model = _model(family, attention)
    logits_fn = jax.jit(model.logits_fn())
    params = _params(family)
    # As many rows as the examples alone (the packed rows repeated): one compilation of the
    # unsegmented forward pass serves both references below.
    batch = packed_batch(packed, np.arange(len(alone)) % len(packed))
    got = logits_fn(params, batch["inputs"], batch["segments"])
    want = logits_fn(params, alone.tokens_NW[:, :-1])  # no segments: one sequence per row
    e = 0
    for r in range(len(packed)):
        for sid in range(1, packed.segments_NW[r].max() + 1):
            at = np.nonzero(packed.segments_NW[r, :-1] == sid)[0]
            chex.assert_trees_all_close(got[r, at], want[e, :len(at)], atol=2e-5, rtol=0)
            e += 1
    assert e == len(examples)
    # Without the segments the later examples see the earlier ones: the logits differ.
    mixed = logits_fn(params, batch["inputs"])
    assert float(jnp.max(jnp.abs(mixed[0, 7:28] - got[0, 7:28]))) > 1e-3
    # One segment per row is the plain forward pass.
    full = jnp.ones_like(batch["segments"])
    chex.assert_trees_all_close(logits_fn(params, batch["inputs"], full), mixed, atol=2e-5,
                                rtol=0)


@pytest.mark.parametrize(("family", "attention"), [
    ("gpt", "naive"), ("llama", "blockwise"),
    pytest.param("gpt", "blockwise", marks=_SLOW), pytest.param("llama", "naive", marks=_SLOW)])
def test_packed_loss_and_grads_equal_the_examples_alone(family, attention):
    """The masked mean over a packed batch is the token-weighted mean over the examples run
    alone (the same trained tokens), so the loss and its gradient are equal."""
    examples = _examples()
    packed = pack_examples(examples, SEQ, pad_id=0)
    alone = _alone(examples)
    loss_fn = _model(family, attention).loss_fn()
    grad = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b)[0]))
    params = _params(family)
    packed_b = packed_batch(packed, np.arange(len(packed)))
    # Each example alone, in its own row (the masked mean over these rows is the mean of the
    # examples' own losses weighted by their trained tokens).
    alone_b = _no_segments(packed_batch(alone, np.arange(len(alone))))
    assert packed_b["mask"].sum() == alone_b["mask"].sum() == packed.trained_tokens
    loss, grads = grad(params, packed_b)
    want_loss, want_grads = grad(params, alone_b)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    chex.assert_trees_all_close(grads, want_grads, atol=1e-6, rtol=1e-4)


# --------------------------------------------------------------------------------------------
# The recipe: jobs shard and pass the segments; evaluation scores each example as if alone.
# --------------------------------------------------------------------------------------------


def test_a_job_refuses_batches_without_the_arrays_it_was_planned_for():
    import optax

    from effijax.recipe import batch_fn, evaluate, plan_job

    model = MODELS["gpt"]
    job = plan_job(model, "fp32", optax.adam(1e-3), batch_size=8, masked=True)
    assert job.segmented  # packed rows carry mask and segments
    packed = pack_examples(_examples(), SEQ, pad_id=0)
    unsegmented = Packed(packed.tokens_NW, packed.mask_NW)
    with pytest.raises(ConfigError, match=r"segmented=True .*'segments'"):
        batch_fn(job, unsegmented)(0)
    with pytest.raises(ConfigError, match=r"segmented=True"):
        evaluate(job, None, unsegmented, num_batches=1)
    plain = plan_job(model, "fp32", optax.adam(1e-3), batch_size=8, masked=True,
                     segmented=False)
    assert set(batch_fn(plain, unsegmented)(0)) == {"inputs", "targets", "mask"}


@pytest.mark.slow
def test_sharded_job_trains_and_evaluates_packed_rows_as_the_examples_alone():
    import optax

    from effijax.recipe import batch_fn, evaluate, init_state, plan_job
    from effijax.sharding import make_mesh

    model = MODELS["gpt"]
    examples = _examples(lengths=tuple(range(3, 30, 2)))
    packed = pack_examples(examples, SEQ, pad_id=0)
    job = plan_job(model, "fp32", optax.adam(1e-3), batch_size=8, mesh=make_mesh(),
                   masked=True)
    state = init_state(job)
    params = jax.tree.map(jnp.copy, state.params)  # the step donates the state
    batch = batch_fn(job, packed)(0)
    assert batch["segments"].sharding == batch["inputs"].sharding
    _, metrics = job.step(state, batch)
    local = batch_at(packed, seed=job.seed, step=0, batch_size=8, seq_len=SEQ)
    assert int(metrics["tokens"]) == int(local["mask"].sum())
    # The sharded step's loss is the one-device loss of the same rows with their segments (which
    # is the examples' alone, see above).
    loss_fn = jax.jit(lambda p, b: model.loss_fn()(p, b)[0])
    np.testing.assert_allclose(float(metrics["lm_loss"]), float(loss_fn(params, local)),
                               rtol=1e-5)
    got = evaluate(job, params, packed, num_batches=2)
    total = count = 0.0
    for b in eval_batches(packed, batch_size=8, seq_len=SEQ, num_batches=2):
        n = float(b["mask"].sum())
        total += float(loss_fn(params, b)) * n
        count += n
    np.testing.assert_allclose(got, total / count, rtol=1e-5)
