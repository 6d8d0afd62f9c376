"""Precision policies, casting that touches only floats, and the fp32 islands."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from effijax.errors import ConfigError
from effijax.precision import (
    PRESET_ALIASES,
    PRESETS,
    Policy,
    cast_floating,
    cross_entropy,
    cross_entropy_and_accuracy,
    dot,
    get_policy,
    layer_norm,
    log_softmax,
    softmax,
)

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
        ("p=fp32,c=half,o=full", (F32, F16, F32)),
        ("params=bf16,compute=bf16", (BF16, BF16, F32)),
        ("C=F16", (F32, F16, F32)),
        ("bf16", (F32, BF16, F32)),
        ("pure_bf16", (BF16, BF16, F32)),
    ],
)
def test_from_string(spec, expected):
    p = Policy.from_string(spec)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == expected


def test_presets_and_round_trip():
    assert get_policy("fp32") == Policy()
    assert get_policy("bf16") == Policy(F32, BF16, F32)
    assert get_policy("fp16") == Policy(F32, F16, F32)
    assert get_policy("pure_bf16") == Policy(BF16, BF16, F32)
    for name in ("fp32", "bf16", "fp16", "pure_bf16"):
        p = get_policy(name)
        assert Policy.from_string(str(p)) == p
    assert get_policy("fp16").needs_loss_scaling and not get_policy("bf16").needs_loss_scaling
    assert get_policy("half") == get_policy("fp16")
    for alias, name in PRESET_ALIASES.items():
        assert name in PRESETS and get_policy(alias.upper()) == get_policy(name)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("params=f32,compute=int8", r"compute_dtype='int8': unknown dtype name; accepted: bf16"),
        ("params=f32,weights=bf16", "unknown field 'weights'; accepted: "),
        ("p=f32,p=bf16", "param_dtype given twice"),
        ("p=f32,bf16", "item 'bf16' is not 'name=dtype'"),
        ("p=f32;c=bf16", r"param_dtype='f32;c=bf16': unknown dtype name"),
        ("", "expected a non-empty str"),
        ("fp8", r"unknown precision policy; presets: fp32, bf16, fp16, pure_bf16"),
    ],
)
def test_from_string_errors(spec, message):
    with pytest.raises(ConfigError, match=message) as e:
        Policy.from_string(spec)
    assert (e.value.field, e.value.value) == ("spec", spec)


def test_get_policy_errors_name_the_argument():
    with pytest.raises(ConfigError, match=r"^name='fp8': unknown precision policy; presets: "
                       r"fp32, bf16, fp16, pure_bf16 \(aliases: f32, float32"):
        get_policy("fp8")
    with pytest.raises(ConfigError, match=r"^name='p=f32,c=int8': compute_dtype='int8': "
                       "unknown dtype name"):
        get_policy("p=f32,c=int8")
    with pytest.raises(ConfigError, match=r"^name=3: expected a preset name"):
        get_policy(3)


def test_policy_rejects_non_float_and_bad_overrides():
    with pytest.raises(ConfigError,
                       match=r"^param_dtype=dtype\('int32'\): not supported; use float32"):
        Policy(param_dtype=jnp.int32)
    with pytest.raises(ConfigError, match=r"^overrides\[0\]=\('ln\(', 'f32'\): invalid regex"):
        Policy(overrides=(("ln(", "f32"),))
    with pytest.raises(ConfigError,
                       match=r"^overrides\[0\]='ln': expected a \(path_regex, dtype\) pair"):
        Policy(overrides=("ln",))
    with pytest.raises(ConfigError, match=r"^overrides\[0\]=\('ln', 'f8'\): dtype 'f8': unknown "
                       "dtype name"):
        Policy(overrides=(("ln", "f8"),))
    with pytest.raises(ConfigError, match=r"^overrides='ln': expected a tuple of"):
        Policy(overrides="ln")
    with pytest.raises(ConfigError, match=r"^overrides\[0\]=\('\(', 'f32'\): invalid regex"):
        cast_floating({"w": jnp.ones(2)}, jnp.float32, overrides=[("(", "f32")])


def test_policy_is_frozen_and_replaceable():
    p = get_policy("bf16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.compute_dtype = F16
    assert dataclasses.replace(p, compute_dtype="f16") == get_policy("fp16")


def test_cast_touches_only_floats():
    tree = {
        "w": jnp.ones((2, 3)),
        "half": jnp.ones(2, jnp.float16),
        "ids": jnp.arange(3),
        "mask": jnp.array([True, False]),
        "key": jax.random.key(0),
        "raw_key": jax.random.PRNGKey(0),
        "count": jnp.int32(4),
    }
    out = cast_floating(tree, jnp.bfloat16)
    assert out["w"].dtype == BF16 and out["half"].dtype == BF16
    for k in ("ids", "mask", "key", "raw_key", "count"):
        assert out[k] is tree[k], k  # untouched, not even copied
    np.testing.assert_array_equal(jax.random.key_data(out["key"]), jax.random.key_data(tree["key"]))


def test_cast_overrides_first_match_wins_and_abstract_leaves():
    tree = {"ln1": {"scale": jnp.ones(2)}, "embed": jnp.ones(2), "dense": jnp.ones(2)}
    out = cast_floating(tree, jnp.bfloat16, overrides=[("ln", "f32"), (".*", "f16")])
    assert out["ln1"]["scale"].dtype == F32
    assert out["embed"].dtype == F16 and out["dense"].dtype == F16
    abstract = jax.eval_shape(lambda: tree)
    out = cast_floating(abstract, jnp.bfloat16, overrides=[("embed", "f32")])
    assert isinstance(out["dense"], jax.ShapeDtypeStruct)
    assert out["dense"].dtype == BF16 and out["embed"].dtype == F32
    p = Policy("bf16", "bf16", "f32", overrides=(("ln", "f32"),))
    assert p.cast_to_param(tree)["ln1"]["scale"].dtype == F32
    assert p.cast_to_compute(tree)["dense"].dtype == BF16


def test_cross_entropy_bf16_logits_is_an_f32_island():
    key = jax.random.key(1)
    logits = (jax.random.normal(key, (4, 16, 256)) * 4.0).astype(jnp.bfloat16)
    labels = jax.random.randint(jax.random.key(2), (4, 16), 0, 256)
    ce = cross_entropy(logits, labels)
    assert ce.dtype == F32
    ref = cross_entropy(logits.astype(jnp.float32), labels)
    np.testing.assert_allclose(float(ce), float(ref), rtol=1e-6)
    # The same computation left in bf16 is visibly off: the island is what keeps it exact.
    naive = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1))
    assert abs(float(naive) - float(ref)) / float(ref) > 1e-4
    # Masked mean.
    where = jnp.arange(16)[None, :] < 8
    masked = cross_entropy(logits, labels, where=jnp.broadcast_to(where, (4, 16)))
    np.testing.assert_allclose(
        float(masked), float(cross_entropy(logits[:, :8], labels[:, :8])), rtol=1e-6
    )


def test_cross_entropy_errors():
    # Wrong operands are bugs in the calling code, not settings: plain ValueErrors.
    with pytest.raises(ValueError, match="labels must be integer") as e:
        cross_entropy(jnp.zeros((2, 4)), jnp.zeros(2))
    assert not isinstance(e.value, ConfigError)
    with pytest.raises(ValueError, match="does not match logits") as e:
        cross_entropy(jnp.zeros((2, 4)), jnp.zeros(3, jnp.int32))
    assert not isinstance(e.value, ConfigError)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cross_entropy_backward_and_accuracy_are_autodiffs_and_argmaxs(dtype):
    # The hand-written backward against autodiff of log_softmax + pick; the accuracy against
    # jnp.argmax, with ties (bf16 logits rounded to few values) and a mask.
    logits = (jax.random.normal(jax.random.key(0), (4, 16, 64)) * 2).round().astype(dtype)
    labels = jax.random.randint(jax.random.key(1), (4, 16), 0, 64)
    where = jax.random.bernoulli(jax.random.key(2), 0.7, (4, 16))

    def autodiff(x):
        nll = -jnp.take_along_axis(log_softmax(x), labels[..., None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(where, nll, 0.0)) / jnp.sum(where).astype(jnp.float32)

    def ours(x):
        return cross_entropy_and_accuracy(x, labels, where=where)[0]

    want, want_grad = jax.value_and_grad(autodiff)(logits)
    got, grad = jax.value_and_grad(ours)(logits)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    assert grad.dtype == dtype
    np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(want_grad, np.float32),
                               rtol=1e-6, atol=1e-9)
    assert float(jnp.abs(grad).sum()) > 0
    ties = jnp.sum(logits == jnp.max(logits, axis=-1, keepdims=True), axis=-1)
    assert int(jnp.max(ties)) > 1  # the case argmax's first-index rule decides
    hits = (jnp.argmax(logits, axis=-1) == labels) & where
    acc = cross_entropy_and_accuracy(logits, labels, where=where)[1]
    assert float(acc) == float(jnp.sum(hits)) / float(jnp.sum(where))
    # A label that is the argmax counts; one tied with an earlier maximum does not.
    tied = jnp.zeros((1, 3))
    assert float(cross_entropy_and_accuracy(tied, jnp.array([0]))[1]) == 1.0
    assert float(cross_entropy_and_accuracy(tied, jnp.array([2]))[1]) == 0.0


def test_the_accuracy_of_a_large_vocabulary_takes_jnp_argmaxs_first_maximum():
    # 4096 classes: the argmax is taken in chunks of 512 (_first_argmax). Ties across and
    # inside chunks, a row of -inf but one class, and rows whose maximum sits in the last chunk.
    logits = (jax.random.normal(jax.random.key(0), (3, 40, 4096)) * 1.5).round()
    logits = logits.at[0, 0].set(-jnp.inf).at[0, 0, 4000].set(0.0)
    logits = logits.at[1, :, 4095].set(9.0).at[1, :5, 1500].set(9.0)  # tie across chunks
    labels = jnp.where(jnp.arange(40) % 2 == 0, jnp.argmax(logits, axis=-1), 1500)
    hits = jnp.argmax(logits, axis=-1) == labels
    assert 0 < int(hits.sum()) < hits.size
    where = jnp.broadcast_to(jnp.arange(40) % 3 != 0, hits.shape)
    assert float(cross_entropy_and_accuracy(logits, labels)[1]) == float(np.mean(hits))
    want = float(np.float32(np.sum(hits & where)) / np.float32(np.sum(where)))
    assert float(cross_entropy_and_accuracy(logits, labels, where=where)[1]) == want
    # Logits that are not all finite take jnp.argmax itself: a NaN is its maximum.
    nan = logits.at[2, 7, 3000].set(jnp.nan)
    acc = cross_entropy_and_accuracy(nan, jnp.full((3, 40), 3000))[1]
    assert float(acc) == float(jnp.mean(jnp.argmax(nan, axis=-1) == 3000)) == np.float32(1 / 120)


def test_layer_norm_statistics_in_f32():
    # A large mean with a small spread: bf16 statistics would lose the spread entirely.
    x = (256.0 + jnp.linspace(-1.0, 1.0, 64)).astype(jnp.bfloat16)[None]
    y = layer_norm(x, jnp.ones(64), jnp.zeros(64))
    assert y.dtype == BF16
    x32 = x.astype(jnp.float32)
    ref = (x32 - x32.mean()) / jnp.sqrt(x32.var() + 1e-5)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref), atol=2e-2)
    assert float(jnp.std(y.astype(jnp.float32))) > 0.9


def test_softmax_and_dot_dtypes_and_values():
    x = jax.random.normal(jax.random.key(0), (3, 40)).astype(jnp.float16)
    s = softmax(x)
    assert s.dtype == F16
    np.testing.assert_allclose(np.asarray(s, np.float32).sum(-1), 1.0, atol=2e-3)
    assert log_softmax(x).dtype == F32
    a = jax.random.normal(jax.random.key(1), (8, 512)).astype(jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (512, 4)).astype(jnp.bfloat16)
    out = dot("ik,kj->ij", a, b)
    assert out.dtype == BF16
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    # f32 accumulation: only the final rounding to bf16 (8 bits of mantissa) remains.
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=1e-2, atol=0.1)
    with pytest.raises(ValueError, match="operand dtypes differ") as e:
        dot("ik,kj->ij", a, b.astype(jnp.float32))
    assert not isinstance(e.value, ConfigError)
