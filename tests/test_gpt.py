"""Tests of the GPT model: shapes, dtypes, causality, init, training, dropout, remat and scan."""

import dataclasses
import doctest
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _jaxprs import eqns
from flax import nnx

from effijax.errors import ConfigError
from effijax.models import (
    GPT,
    GPTConfig,
    _gpt,
    abstract_params,
    abstract_split,
    gpt_config,
    init_params,
    make_apply,
    make_loss_fn,
    param_count,
    split_params,
)
from effijax.paths import named_leaves
from effijax.precision._policy import Policy, get_policy

B, S = 2, 16
TINY = gpt_config("tiny")

# These tests check numbers, not speed: LLVM optimisation level 0 compiles 2-3x faster on CPU,
# and compile time dominates this file.
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})

EXPECTED_SHAPES = {
    "blocks/attn/k/bias": (2, 64),
    "blocks/attn/k/kernel": (2, 64, 64),
    "blocks/attn/o/bias": (2, 64),
    "blocks/attn/o/kernel": (2, 64, 64),
    "blocks/attn/q/bias": (2, 64),
    "blocks/attn/q/kernel": (2, 64, 64),
    "blocks/attn/v/bias": (2, 64),
    "blocks/attn/v/kernel": (2, 64, 64),
    "blocks/ln1/bias": (2, 64),
    "blocks/ln1/scale": (2, 64),
    "blocks/ln2/bias": (2, 64),
    "blocks/ln2/scale": (2, 64),
    "blocks/mlp/fc_in/bias": (2, 256),
    "blocks/mlp/fc_in/kernel": (2, 64, 256),
    "blocks/mlp/fc_out/bias": (2, 64),
    "blocks/mlp/fc_out/kernel": (2, 256, 64),
    "embed/embedding": (256, 64),
    "ln_f/bias": (64,),
    "ln_f/scale": (64,),
    "pos_embed/embedding": (64, 64),
}


def _tokens(seed, shape=(B, S)):
    return jax.random.randint(jax.random.key(seed), shape, 0, 256, dtype=jnp.int32)


def _batch(seed, shape=(B, S)):
    t = _tokens(seed, (shape[0], shape[1] + 1))
    return {"inputs": t[:, :-1], "targets": t[:, 1:]}


@pytest.fixture(scope="module")
def tiny():
    """graphdef, f32 params and a jitted apply for the tiny model."""
    graphdef, _ = abstract_split(TINY)
    params = init_params(TINY, None, jax.random.key(0))
    apply = _jit(make_apply(graphdef))
    return graphdef, params, apply


@pytest.fixture(scope="module")
def overfit(tiny):
    """Adam steps on one repeated batch: (losses, trained f32 params)."""
    graphdef, params, _ = tiny
    loss_fn = make_loss_fn(graphdef)
    opt = optax.adam(1e-2)

    @_jit
    def step(params, opt_state, batch):
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        # optax's bias correction raises a float to an int32 count, which strict promotion
        # rejects; the model itself is traced under strict promotion above.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    batch = _batch(1)
    opt_state = opt.init(params)
    losses = []
    for _ in range(30):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return losses, params, batch


def test_param_tree_paths_and_shapes(tiny):
    _, params, _ = tiny
    got = {path: leaf.shape for path, leaf in named_leaves(params)}
    assert got == EXPECTED_SHAPES
    assert all(type(d) is dict for d in (params, params["blocks"], params["blocks"]["attn"]))


@pytest.mark.parametrize("name", ["tiny", "mini", "small", "base"])
def test_param_count_matches_tree(name):
    config = gpt_config(name)
    tree = abstract_params(config)
    assert param_count(config) == sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def test_base_preset_is_about_100m():
    assert 95e6 < param_count(gpt_config("base")) < 105e6


def test_init_statistics(tiny):
    _, params, _ = tiny
    blocks = params["blocks"]
    np.testing.assert_allclose(np.std(blocks["attn"]["q"]["kernel"]), 0.02, rtol=0.05)
    np.testing.assert_allclose(np.std(params["embed"]["embedding"]), 0.02, rtol=0.05)
    out_std = 0.02 / math.sqrt(2 * TINY.n_layers)
    np.testing.assert_allclose(np.std(blocks["attn"]["o"]["kernel"]), out_std, rtol=0.05)
    np.testing.assert_allclose(np.std(blocks["mlp"]["fc_out"]["kernel"]), out_std, rtol=0.05)
    assert np.all(blocks["ln1"]["scale"] == 1) and np.all(params["ln_f"]["bias"] == 0)
    assert np.all(blocks["mlp"]["fc_in"]["bias"] == 0)
    # Layers are initialised independently.
    q = np.asarray(blocks["attn"]["q"]["kernel"])
    assert not np.allclose(q[0], q[1])


def test_init_is_deterministic_and_abstract_matches(tiny):
    _, params, _ = tiny
    again = init_params(TINY, None, jax.random.key(0))
    chex.assert_trees_all_equal(params, again)
    other = init_params(TINY, None, jax.random.key(1))
    assert not np.allclose(params["embed"]["embedding"], other["embed"]["embedding"])
    chex.assert_trees_all_equal_shapes_and_dtypes(params, abstract_params(TINY))


def test_merge_round_trip(tiny):
    graphdef, params, apply = tiny
    model = nnx.merge(graphdef, params)
    assert isinstance(model, GPT) and model.config == TINY
    q_kernel = params["blocks"]["attn"]["q"]["kernel"]
    np.testing.assert_array_equal(model.blocks.attn.q.kernel[...], q_kernel)
    graphdef2, params2 = split_params(model)
    assert graphdef2 == graphdef
    chex.assert_trees_all_equal(params2, params)


def test_constructor_policy_dtypes_and_overrides():
    policy = dataclasses.replace(get_policy("pure_bf16"), overrides=(("ln", "f32"),))
    model = GPT(TINY, policy=policy, rngs=nnx.Rngs(0))
    _, params = split_params(model)
    for path, leaf in named_leaves(params):
        expected = jnp.float32 if "ln" in path else jnp.bfloat16
        assert leaf.dtype == expected, path
    # Same random draw as the fp32 model, rounded.
    f32 = init_params(TINY, None, jax.random.key(0))
    bf16 = init_params(TINY, "pure_bf16", jax.random.key(0))
    np.testing.assert_array_equal(
        bf16["embed"]["embedding"], f32["embed"]["embedding"].astype(jnp.bfloat16)
    )
    assert model.policy is policy and isinstance(model.config, GPTConfig)
    # The policy and config are static: the model's only state is its parameters.
    assert len(jax.tree.leaves(nnx.state(model))) == len(EXPECTED_SHAPES)


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", "pure_bf16"])
def test_output_shapes_and_dtypes_per_policy(tiny, name):
    graphdef, _, _ = tiny
    policy = get_policy(name)
    params = init_params(TINY, policy, jax.random.key(0))
    for leaf in jax.tree.leaves(params):
        assert leaf.dtype == policy.param_dtype
    compute = policy.cast_to_compute(params)
    apply = make_apply(graphdef)
    tokens = _tokens(0)
    logits = _jit(apply)(compute, tokens)
    assert logits.shape == (B, S, 256)
    assert logits.dtype == policy.output_dtype
    assert bool(jnp.all(jnp.isfinite(logits)))
    # Every matmul of the naive attention's model runs in the compute dtype (f32 accumulation
    # is inside `dot`). The default ("auto": the blockwise kernel on a CPU) computes the scores
    # and their products in f32 inside the kernel, an f32 island: only those dots may be f32.
    naive, _ = abstract_split(dataclasses.replace(TINY, attention="naive"))
    compute_dtype, f32 = np.dtype(policy.compute_dtype), np.dtype(np.float32)
    for graph, allowed in ((naive, {compute_dtype}), (graphdef, {compute_dtype, f32})):
        jaxpr = jax.make_jaxpr(make_apply(graph))(compute, tokens)
        dots = eqns(jaxpr.jaxpr, "dot_general")
        assert len(dots) >= 8
        for eqn in dots:
            (dtype,) = {v.aval.dtype for v in eqn.invars}  # never mixed
            assert dtype in allowed
            assert eqn.params["preferred_element_type"] == np.float32


def test_causality(tiny):
    _, params, apply = tiny
    tokens = _tokens(0)
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % 256)
    a, b = apply(params, tokens), apply(params, changed)
    np.testing.assert_array_equal(a[:, :10], b[:, :10])
    assert float(jnp.max(jnp.abs(a[:, 10:] - b[:, 10:]))) > 1e-4


def test_shorter_sequences_and_errors(tiny):
    graphdef, params, _ = tiny
    apply = make_apply(graphdef)
    # Shapes and errors are decided while tracing: eval_shape compiles nothing.
    out = jax.eval_shape(apply, params, _tokens(0, (1, 3)))
    assert (out.shape, out.dtype) == ((1, 3, 256), jnp.float32)
    with pytest.raises(ValueError, match="exceeds config.seq_len=64"):
        jax.eval_shape(apply, params, _tokens(0, (1, 65)))
    with pytest.raises(ValueError, match="integer ids"):
        jax.eval_shape(apply, params, jnp.zeros((1, 4)))
    with pytest.raises(KeyError, match="targets"):
        jax.eval_shape(make_loss_fn(graphdef), params, {"inputs": _tokens(0)})


def test_loss_at_init_is_log_vocab(tiny):
    graphdef, params, _ = tiny
    loss, aux = _jit(make_loss_fn(graphdef))(params, _batch(2, (4, 64)))
    assert loss.dtype == jnp.float32 and aux["accuracy"].dtype == jnp.float32
    assert abs(float(loss) - math.log(256)) < 0.3
    assert 0.0 <= float(aux["accuracy"]) < 0.05


def test_overfit_reduces_loss(overfit):
    losses, _, _ = overfit
    assert losses[0] > 5.0
    # Measured: 5.59 -> 0.04 in 30 steps.
    assert losses[-1] < 0.3, losses


def test_bf16_compute_loss_close_to_fp32(tiny, overfit):
    graphdef, _, _ = tiny
    _, params, batch = overfit
    loss_fn = _jit(make_loss_fn(graphdef))
    bf16 = get_policy("bf16").cast_to_compute(params)
    # bf16 keeps 8 mantissa bits; with f32 accumulation, f32 softmax/LayerNorm/loss the loss
    # moves by ~1e-4 on the memorised batch (loss 0.03) and ~6e-4 relative on an unseen one
    # (loss 9.8). Tolerances: 5e-3 absolute and 5e-3 relative.
    loss32, loss16 = float(loss_fn(params, batch)[0]), float(loss_fn(bf16, batch)[0])
    assert abs(loss16 - loss32) < 5e-3, (loss16, loss32)
    assert loss16 != loss32  # bf16 was really used
    unseen = _batch(8)
    loss32, loss16 = float(loss_fn(params, unseen)[0]), float(loss_fn(bf16, unseen)[0])
    assert abs(loss16 - loss32) < 5e-3 * loss32, (loss16, loss32)


def test_dropout(tiny):
    config = dataclasses.replace(TINY, dropout=0.2)
    graphdef, _ = abstract_split(config)
    _, params, _ = tiny
    apply = _jit(make_apply(graphdef), static_argnames="deterministic")
    tokens = _tokens(0)
    k1, k2 = jax.random.key(1), jax.random.key(2)
    det1 = apply(params, tokens, rng=k1, deterministic=True)
    det2 = apply(params, tokens, rng=k2, deterministic=True)
    np.testing.assert_array_equal(det1, det2)
    drop1 = apply(params, tokens, rng=k1, deterministic=False)
    drop1_again = apply(params, tokens, rng=k1, deterministic=False)
    drop2 = apply(params, tokens, rng=k2, deterministic=False)
    np.testing.assert_array_equal(drop1, drop1_again)
    assert float(jnp.max(jnp.abs(drop1 - drop2))) > 1e-3
    assert float(jnp.max(jnp.abs(drop1 - det1))) > 1e-3
    # The loss fn turns dropout on exactly when it gets a key (checked on the jaxpr: no compile).
    loss_fn = make_loss_fn(graphdef)
    batch = _batch(3)
    n_random = lambda *args: len(eqns(jax.make_jaxpr(loss_fn)(*args).jaxpr, "random_bits"))
    assert n_random(params, batch) == 0
    assert n_random(params, batch, k1) > 0
    no_dropout_graphdef = abstract_split(TINY)[0]
    assert len(eqns(jax.make_jaxpr(make_loss_fn(no_dropout_graphdef))(params, batch, k1).jaxpr,
                    "random_bits")) == 0
    # NNX style: an nnx.Rngs works too, and dropout without any rng is an error.
    model = nnx.merge(graphdef, params)
    out = nnx.eval_shape(lambda m: m(tokens, deterministic=False, rngs=nnx.Rngs(dropout=1)), model)
    assert out.shape == (B, S, 256)
    with pytest.raises(ValueError, match="no rngs"):
        nnx.eval_shape(lambda m: m(tokens, deterministic=False), model)


@pytest.fixture(scope="module")
def none_grads(tiny):
    graphdef, params, _ = tiny
    batch = _batch(4)
    fn = _jit(jax.value_and_grad(make_loss_fn(graphdef), has_aux=True))
    (loss, _), grads = fn(params, batch)
    assert not _remat_eqns(graphdef, params, batch)
    return params, batch, loss, grads


def _remat_eqns(graphdef, params, batch):
    jaxpr = jax.make_jaxpr(make_loss_fn(graphdef))(params, batch).jaxpr
    # jax.checkpoint's primitive has been called "remat2" and "checkpoint" across versions.
    return [e for name in ("remat2", "checkpoint", "remat") for e in eqns(jaxpr, name)]


@pytest.mark.parametrize("remat", ["block", "dots"])
def test_remat_matches_none(none_grads, remat):
    params, batch, loss, grads = none_grads
    graphdef, _ = abstract_split(dataclasses.replace(TINY, remat=remat))
    fn = _jit(jax.value_and_grad(make_loss_fn(graphdef), has_aux=True))
    (loss_r, _), grads_r = fn(params, batch)
    remats = _remat_eqns(graphdef, params, batch)
    assert len(remats) == 1 and remats[0].params["policy"] is _gpt.REMAT[remat]
    np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
    chex.assert_trees_all_close(grads_r, grads, rtol=1e-6, atol=1e-6)


def test_scan_keeps_program_size_constant_in_depth():
    sizes = {}
    for n_layers in (2, 8):
        config = dataclasses.replace(TINY, n_layers=n_layers)
        graphdef, abstract = abstract_split(config)
        loss_fn = make_loss_fn(graphdef)
        batch = jax.eval_shape(lambda: _batch(0))
        grad_fn = jax.jit(jax.grad(loss_fn, has_aux=True))
        lowered = grad_fn.lower(abstract, batch)
        jaxpr = jax.make_jaxpr(grad_fn)(abstract, batch)
        sizes[n_layers] = (len(lowered.as_text()), len(str(jaxpr)))
    # Unrolled, 4x the layers would be ~4x the program; scanned, only shapes change.
    for i in range(2):
        assert sizes[8][i] < 1.05 * sizes[2][i], sizes


def test_config_validation_names_the_field():
    base = dict(seq_len=16, d_model=32, n_layers=2, n_heads=4)
    cases = [
        (dict(d_model=30), "d_model"),
        (dict(n_heads=0), "n_heads"),
        (dict(seq_len=-1), "seq_len"),
        (dict(vocab_size=2.5), "vocab_size"),
        (dict(dropout=1.0), "dropout"),
        (dict(ln_eps=0.0), "ln_eps"),
        (dict(remat="all"), "remat"),
        (dict(attention="flash"), "attention"),
    ]
    for override, field in cases:
        with pytest.raises(ConfigError, match=f"^{field}=") as e:
            GPTConfig(**{**base, **override})
        assert e.value.field == field
    with pytest.raises(ConfigError, match="presets: tiny, mini, small, base"):
        gpt_config("huge")
    with pytest.raises(ConfigError, match="GPTConfig fields"):
        gpt_config("tiny", width=3)
    assert gpt_config("tiny", n_layers=3).n_layers == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY.d_model = 8  # type: ignore[misc]


def test_policy_object_is_accepted():
    policy = Policy("bf16", "bf16", "f32")
    tree = abstract_params(TINY, policy)
    assert {leaf.dtype for leaf in jax.tree.leaves(tree)} == {np.dtype(jnp.bfloat16)}


def test_docstring_examples():
    result = doctest.testmod(_gpt, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 5 and result.failed == 0
