"""The functional train step: exactness vs a hand-written optax step, policies, loss scaling,
skipped steps, Linen and NNX models, and the fp16-underflow scenario."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from effijax.data import split_corpus
from effijax.models import gpt_config
from effijax.precision import dynamic_loss_scale, get_policy
from effijax.recipe import build_lm_job
from effijax.step import (
    global_norm_f32,
    has_loss_scale,
    init_train_state,
    learning_rate_of,
    make_optimizer,
    make_train_step,
)


def _regression():
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (32, 8))
    y = x @ jax.random.normal(kw, (8, 2))
    params = {"w": jnp.zeros((8, 2)), "b": jnp.zeros(2)}

    def loss_fn(p, batch, rng):
        pred = batch["x"].astype(p["w"].dtype) @ p["w"] + p["b"]
        return jnp.mean((pred.astype(jnp.float32) - batch["y"]) ** 2)

    return params, {"x": x, "y": y}, loss_fn


def test_fp32_step_matches_hand_written_optax_step_bitwise():
    params, batch, loss_fn = _regression()
    tx = optax.adamw(1e-2)
    step = jax.jit(make_train_step(loss_fn, tx, "fp32"))
    state = init_train_state(params, tx, 0)

    @jax.jit
    def reference(p, s):
        loss, g = jax.value_and_grad(lambda q: loss_fn(q, batch, None))(p)
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam is not strict-clean
            u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    p_ref, s_ref = params, tx.init(params)
    for _ in range(5):
        state, m = step(state, batch)
        p_ref, s_ref, loss_ref = reference(p_ref, s_ref)
        assert float(m["loss"]) == float(loss_ref)
    jax.tree.map(np.testing.assert_array_equal, state.params, p_ref)
    assert int(state.step) == 5
    assert m["loss_scale"].dtype == jnp.float32 and float(m["loss_scale"]) == 1.0
    assert not bool(m["skipped"]) and bool(m["grads_finite"])


def test_fp16_without_loss_scaling_is_refused_at_construction():
    _, _, loss_fn = _regression()
    with pytest.raises(ValueError, match="float16 but the optimizer has no loss scaling"):
        make_train_step(loss_fn, optax.adam(1e-3), "fp16")
    make_train_step(loss_fn, optax.adam(1e-3), "fp16", allow_unscaled_fp16=True)
    make_train_step(loss_fn, dynamic_loss_scale(optax.adam(1e-3)), "fp16")
    with pytest.raises(ValueError, match="optimizer must be an optax.GradientTransformation"):
        make_train_step(loss_fn, "adam", "fp32")


def test_loss_is_scaled_and_grads_unscaled_with_the_same_scale():
    params, batch, loss_fn = _regression()
    tx = dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**12, growth_interval=1)
    step = jax.jit(make_train_step(loss_fn, tx, "fp32"))
    state = init_train_state(params, tx, 0)
    ref_tx = optax.sgd(0.1)
    ref_p, ref_s = params, ref_tx.init(params)
    for i in range(3):
        state, m = step(state, batch)
        # growth_interval=1: the scale doubles every step, so unscaling with the new scale
        # would be off by 2x. The applied update must equal plain SGD on the true gradients.
        assert float(m["loss_scale"]) == 2.0 ** (12 + i)
        g = jax.grad(lambda q: loss_fn(q, batch, None))(ref_p)
        u, ref_s = ref_tx.update(g, ref_s, ref_p)
        ref_p = optax.apply_updates(ref_p, u)
        np.testing.assert_allclose(float(m["grad_norm"]), float(global_norm_f32(g)), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), state.params, ref_p)


def test_non_finite_step_is_skipped_and_counted():
    params, batch, loss_fn = _regression()
    # 2^16 (the default) overflows this regression's fp16 backward on the first step already.
    tx = make_optimizer(1e-2, 100, warmup_steps=10,
                        loss_scale=functools.partial(dynamic_loss_scale, init_scale=2.0**8))
    step = jax.jit(make_train_step(loss_fn, tx, "fp16"))
    state = init_train_state(params, tx, 0)
    state, m = step(state, batch)
    assert not bool(m["skipped"]) and float(m["loss_scale"]) == 2.0**8
    before = jax.device_get(state._replace(rng=None))
    bad = {"x": batch["x"].at[0, 0].set(jnp.inf), "y": batch["y"]}
    state, m = step(state, bad)
    assert bool(m["skipped"]) and not bool(m["grads_finite"])
    assert int(state.step) == 2  # the data position still advances
    jax.tree.map(np.testing.assert_array_equal, state.params, before.params)
    # every optimizer leaf except the loss-scale bookkeeping is bitwise unchanged
    lr_before = float(learning_rate_of(before.opt_state))
    assert float(learning_rate_of(state.opt_state)) == lr_before
    state, m = step(state, batch)
    assert float(m["loss_scale"]) == 2.0**7  # backed off once
    assert not bool(m["skipped"])


def test_policy_casts_params_and_keeps_master_dtype():
    params, batch, loss_fn = _regression()
    seen = {}

    def spy(p, b, rng):
        seen["dtype"] = p["w"].dtype
        return loss_fn(p, b, rng)

    tx = optax.adam(1e-2)
    state = init_train_state(params, tx, 0)
    state, m = jax.jit(make_train_step(spy, tx, "bf16"))(state, batch)
    assert seen["dtype"] == jnp.bfloat16
    assert state.params["w"].dtype == jnp.float32 and m["loss"].dtype == jnp.float32
    pure = get_policy("pure_bf16")
    state = init_train_state(pure.cast_to_param(params), tx, 0)
    state, _ = jax.jit(make_train_step(spy, tx, pure))(state, batch)
    assert state.params["w"].dtype == jnp.bfloat16


def test_rng_is_a_function_of_the_step():
    keys = []

    def loss_fn(p, b, rng):
        keys.append(rng)
        return jnp.sum(p["w"] * jax.random.normal(rng, (2,)))

    tx = optax.sgd(0.0)
    step = make_train_step(loss_fn, tx)
    state = init_train_state({"w": jnp.ones(2)}, tx, 7)
    jax.jit(step)(state, None)
    state3 = state._replace(step=jnp.int32(3))
    _, m3 = jax.jit(step)(state3, None)
    _, m3b = jax.jit(step)(state3, None)
    _, m0 = jax.jit(step)(state, None)
    assert float(m3["loss"]) == float(m3b["loss"]) != float(m0["loss"])


class _LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(16)(x))
        return nn.Dense(3)(x)


def test_step_trains_a_flax_linen_model_in_bf16():
    model = _LinenMLP()
    x = jax.random.normal(jax.random.key(0), (64, 4))
    labels = (x[:, 0] > 0).astype(jnp.int32) + (x[:, 1] > 0).astype(jnp.int32)
    params = model.init(jax.random.key(1), x)

    def loss_fn(p, batch, rng):
        logits = model.apply(p, batch["x"].astype(jnp.bfloat16))
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], -1))

    tx = optax.adam(3e-2)
    step = jax.jit(make_train_step(loss_fn, tx, "bf16"), donate_argnums=0)
    state = init_train_state(params, tx, 0)
    losses = []
    for _ in range(60):
        state, m = step(state, {"x": x, "y": labels})
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.5 * losses[0]
    assert jax.tree.leaves(state.params)[0].dtype == jnp.float32


def test_make_optimizer_validation_and_structure():
    with pytest.raises(ValueError, match="learning_rate must be > 0"):
        make_optimizer(0.0, 10)
    with pytest.raises(ValueError, match="warmup_steps"):
        make_optimizer(1e-3, 10, warmup_steps=11)
    with pytest.raises(ValueError, match="loss_scale must be"):
        make_optimizer(1e-3, 10, loss_scale="auto")
    tx = make_optimizer(1e-3, 10, loss_scale="dynamic", accumulate=4)
    state = tx.init({"w": jnp.ones(2)})
    assert isinstance(state, optax.MultiStepsState) and has_loss_scale(state)
    assert not has_loss_scale(make_optimizer(1e-3, 10).init({"w": jnp.ones(2)}))


# --- the fp16-underflow scenario (issue: gradients below fp16's range) -----------------------

_TINY_TEXT = np.frombuffer(
    b"".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n".encode() for i in range(400)),
    np.uint8,
)


def _underflow_run(precision, loss_scale, steps=40):
    # loss x 2^-20: d(loss)/d(logits) is at most 1/tokens * 2^-20 = 7e-9 (at the target), below
    # half of fp16's smallest subnormal (2^-25), so every gradient rounds to zero in fp16.
    # Adam is invariant to the multiplier once eps is scaled with it.
    mult = 2.0**-20
    model = gpt_config("tiny", seq_len=32)
    train, val = split_corpus(_TINY_TEXT)
    tx = make_optimizer(3e-3, steps, warmup_steps=2, eps=1e-8 * mult, weight_decay=0.0,
                        loss_scale=loss_scale)
    job = build_lm_job(model, precision, tx, train_tokens=train, val_tokens=val, batch_size=4,
                       loss_multiplier=mult, allow_unscaled_fp16=True)
    state, losses, grads_zero = job.state, [], []
    for i in range(steps):
        state, m = job.step(state, job.batch(i))
        losses.append(float(m["lm_loss"]))
        grads_zero.append(float(m["grad_norm"]) == 0.0)
    return np.array(losses), grads_zero


@pytest.fixture(scope="module")
def underflow_runs():
    return {
        "fp32": _underflow_run("fp32", None),
        "fp16": _underflow_run("fp16", None),
        "fp16_dynamic": _underflow_run(
            "fp16", functools.partial(dynamic_loss_scale, init_scale=2.0**20)),
        "bf16": _underflow_run("bf16", None),
    }


def test_fp16_without_scaling_does_not_learn(underflow_runs):
    losses, zero = underflow_runs["fp16"]
    assert all(zero), "every gradient should underflow to exactly zero in fp16"
    assert abs(losses[-5:].mean() - losses[0]) < 0.02  # flat within noise between batches


def test_fp16_with_dynamic_scaling_matches_fp32(underflow_runs):
    ref, _ = underflow_runs["fp32"]
    scaled, zero = underflow_runs["fp16_dynamic"]
    assert ref[-5:].mean() < ref[0] - 1.0  # fp32 learns
    assert not any(zero)
    # stated tolerance: mean of the last 5 losses within 0.05 nats of fp32's
    assert abs(scaled[-5:].mean() - ref[-5:].mean()) < 0.05


def test_bf16_learns_without_scaling(underflow_runs):
    ref, _ = underflow_runs["fp32"]
    bf16, zero = underflow_runs["bf16"]
    assert not any(zero)
    assert abs(bf16[-5:].mean() - ref[-5:].mean()) < 0.1
