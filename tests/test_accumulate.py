"""effijax.precision.accumulate: MultiSteps semantics, plus recovery after an overflow."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from effijax.errors import ConfigError
from effijax.precision import accumulate, dynamic_loss_scale, loss_scale_of, skipped_steps_of

STANDARD = jax.numpy_dtype_promotion("standard")  # optax's MultiSteps mixes f32/int32/bool


def _grads(seq):
    return [{"w": jnp.asarray(g, jnp.float32)} for g in seq]


def test_equals_optax_multisteps_on_finite_gradients():
    k = 3
    ours = accumulate(optax.adam(0.1), k)
    ref = optax.MultiSteps(optax.adam(0.1), every_k_schedule=k)
    params = {"w": jnp.zeros(2)}
    rng = np.random.default_rng(0)
    with STANDARD:
        s1, s2 = ours.init(params), ref.init(params)
        for _ in range(4 * k):
            g = {"w": jnp.asarray(rng.normal(size=2), jnp.float32)}
            u1, s1 = jax.jit(ours.update)(g, s1, params)
            u2, s2 = jax.jit(ref.update)(g, s2, params)
            np.testing.assert_array_equal(u1["w"], u2["w"])
    jax.tree.map(np.testing.assert_array_equal, s1, s2)


def test_overflowing_micro_step_skips_one_effective_step_then_recovers():
    k = 2
    tx = accumulate(dynamic_loss_scale(optax.sgd(1.0), init_scale=8.0), k)
    params = {"w": jnp.zeros(2)}
    update = jax.jit(tx.update)
    with STANDARD:
        state = tx.init(params)
        scales, applied = [], []
        seq = [[1, 1], [np.inf, 1], [1, 1], [2, 2], [4, 4], [2, 0], [1, 1]]
        for g in seq:
            scales.append(float(loss_scale_of(state)))
            u, state = update({"w": jnp.asarray(g, jnp.float32)}, state, params)
            applied.append(np.asarray(u["w"]).tolist())
    # The scale is constant across the micro-steps of an effective step and changes only at its
    # end: backed off after the effective step that contained the inf.
    assert scales == [8.0, 8.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    # Micro-steps apply nothing; step 2 (with the inf) is skipped; later ones apply the mean of
    # their two micro-gradients divided by the scale that multiplied them.
    assert applied[:2] == [[0.0, 0.0], [0.0, 0.0]]
    assert applied[3] == [-(1 + 2) / 2 / 4.0] * 2
    assert applied[5] == [-(4 + 2) / 2 / 4.0, -(4 + 0) / 2 / 4.0]
    assert int(skipped_steps_of(state)) == 1
    assert bool(jnp.all(jnp.isfinite(state.acc_grads["w"])))


def test_plain_multisteps_is_poisoned_where_accumulate_is_not():
    # The upstream behaviour accumulate repairs: with optax.MultiSteps the NaN stays forever.
    params = {"w": jnp.zeros(1)}
    with STANDARD:
        for tx, expect_clean in (
            (optax.MultiSteps(dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0), 2), False),
            (accumulate(dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0), 2), True),
        ):
            state = tx.init(params)
            for g in ([np.inf], [1.0], [1.0], [1.0]):
                _, state = tx.update({"w": jnp.asarray(g, jnp.float32)}, state, params)
            assert bool(jnp.all(jnp.isfinite(state.acc_grads["w"]))) == expect_clean


def test_every_k_validation():
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ConfigError, match=f"^every_k={bad!r}: must be an integer >= 1") as e:
            accumulate(optax.sgd(0.1), bad)
        assert (e.value.field, e.value.value) == ("every_k", bad)
