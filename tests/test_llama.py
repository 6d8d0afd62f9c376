"""The Llama family: config validation and presets, the interface's contract, precision, LoRA
(factored = merged), the masked loss, and sharded training equal to one device.

Parity with Hugging Face's ``LlamaForCausalLM`` is in ``test_hf_parity.py``; loading and saving
weights in ``test_weights.py``.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _adapters import random_adapters

from effijax import lora
from effijax.errors import ConfigError
from effijax.models import (
    FAMILIES,
    LLAMA_PRESETS,
    LlamaConfig,
    byte_level_bpe,
    llama_config,
    model_from_dict,
    preset,
    preset_names,
)
from effijax.paths import named_leaves
from effijax.sharding import make_mesh
from effijax.step import init_train_state, make_sharded_training, make_train_step

TINY = llama_config("llama-tiny", seq_len=16)


def _batch(model, b=8, seed=0, mask=True):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, model.vocab_size, (b, model.seq_len + 1))
    batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
             "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}
    if mask:
        batch["mask"] = jnp.asarray(rng.random((b, model.seq_len)) < 0.7, jnp.int32)
    return batch


@pytest.fixture(scope="module")
def params():
    return TINY.init_params(jax.random.key(0))


# --------------------------------------------------------------------------------------------
# Config.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(LLAMA_PRESETS))
def test_param_count_equals_the_abstract_tree(name):
    model = llama_config(name)
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(model.abstract_params()))
    assert model.shape().num_params == count == model.num_params
    shape = model.shape()
    assert shape.gated_mlp and shape.kv_heads == model.n_kv_heads
    assert shape.head_dim == model.head_dim and shape.ffn == model.d_ff


def test_presets_match_the_published_configs():
    smol = llama_config("smollm2-135m")
    assert (smol.n_layers, smol.d_model, smol.n_heads, smol.n_kv_heads, smol.head_dim,
            smol.d_ff, smol.rope_theta, smol.rms_eps, smol.tie_embeddings, smol.vocab_size,
            smol.max_position) == (30, 576, 9, 3, 64, 1536, 1e5, 1e-5, True, 49152, 8192)
    assert smol.num_params == 134_515_008
    assert llama_config("llama-2-7b").num_params == 6_738_415_616
    assert llama_config("llama-2-70b").num_params == 68_976_648_192
    assert llama_config("llama-3.1-405b").num_params == 405_853_388_800
    assert "lm_head" not in llama_config("smollm2-135m").abstract_params()
    assert llama_config("smollm2-135m").name == "smollm2-135m"
    assert llama_config("llama-2-7b", seq_len=128, remat="block").name == "llama-2-7b"


@pytest.mark.parametrize("fields, field", [
    ({"n_kv_heads": 3}, "n_kv_heads"),
    ({"head_dim": 15}, "head_dim"),
    ({"seq_len": 1000}, "seq_len"),
    ({"rms_eps": 0.0}, "rms_eps"),
    ({"rope_theta": -1.0}, "rope_theta"),
    ({"remat": "everything"}, "remat"),
    ({"attention": "magic"}, "attention"),
    ({"d_ff": 0}, "d_ff"),
    ({"tie_embeddings": 1}, "tie_embeddings"),
    ({"rope_scaling": (8.0, 4.0, 1.0, 8192)}, "rope_scaling"),
    ({"rope_scaling": (8.0, 1.0)}, "rope_scaling"),
])
def test_bad_fields_are_config_errors_naming_the_field(fields, field):
    with pytest.raises(ConfigError) as e:
        llama_config("llama-tiny", **fields)
    assert e.value.field == field


def test_unknown_preset_and_override_are_named():
    with pytest.raises(ConfigError, match="smollm2-135m"):
        llama_config("smollm")
    with pytest.raises(ConfigError, match="hidden"):
        llama_config("llama-tiny", hidden=64)


def test_presets_are_found_by_name_alone():
    assert preset("smollm2-135m") is LLAMA_PRESETS["smollm2-135m"]
    assert preset("tiny").family == "gpt" and preset("llama-tiny").family == "llama"
    assert len(preset_names()) == len(set(preset_names()))


def test_to_dict_round_trips_through_the_family_registry():
    assert FAMILIES["llama"] is LlamaConfig
    for name in LLAMA_PRESETS:
        model = llama_config(name)
        fields = model.to_dict()
        assert fields["family"] == "llama" and "tokenizer" not in fields
        assert model_from_dict(fields) == model
    with pytest.raises(ConfigError, match="not a LlamaConfig field"):
        model_from_dict({**TINY.to_dict(), "dropout": 0.1})


def test_the_tokenizer_rides_along_but_is_not_architecture():
    tok = byte_level_bpe(["a", "b", "ab"], ["a b"])
    model = dataclasses.replace(TINY, tokenizer=tok)
    assert model == TINY and hash(model) == hash(TINY)
    assert "tokenizer" not in repr(model) and model.to_dict() == TINY.to_dict()
    assert model.encode(b"abab").tolist() == [2, 2]
    # The module keeps the architecture only: the graphdef is shared with the plain config.
    assert model.loss_fn() is not None
    np.testing.assert_array_equal(TINY.encode(b"ab"), [97, 98])  # byte vocabulary, no tokenizer
    with pytest.raises(ConfigError, match="no tokenizer"):
        llama_config("smollm2-135m").encode(b"ab")


def test_with_seq_len_is_capped_by_the_context():
    assert TINY.with_seq_len(256).seq_len == 256
    with pytest.raises(ConfigError) as e:
        TINY.with_seq_len(257)
    assert e.value.field == "seq_len"


# --------------------------------------------------------------------------------------------
# The model.
# --------------------------------------------------------------------------------------------


def test_parameter_paths_use_hugging_face_module_names(params):
    paths = {path: leaf.shape for path, leaf in named_leaves(params)}
    assert paths == {
        "embed/embedding": (256, 64),
        "layers/input_norm/scale": (2, 64),
        "layers/attn/q_proj/kernel": (2, 64, 64),
        "layers/attn/k_proj/kernel": (2, 64, 32),
        "layers/attn/v_proj/kernel": (2, 64, 32),
        "layers/attn/o_proj/kernel": (2, 64, 64),
        "layers/post_attention_norm/scale": (2, 64),
        "layers/mlp/gate_proj/kernel": (2, 64, 128),
        "layers/mlp/up_proj/kernel": (2, 64, 128),
        "layers/mlp/down_proj/kernel": (2, 128, 64),
        "norm/scale": (64,),
        "lm_head/kernel": (64, 256),
    }
    selected = lora.select(params, lora.LoraSpec(targets=TINY.lora_targets))
    assert len(selected) == 7 and all(p.startswith("layers/") for p in selected)


def test_abstract_params_match_init_for_every_policy():
    for policy in ("fp32", "bf16", "pure_bf16"):
        abstract = TINY.abstract_params(policy)
        real = jax.eval_shape(lambda k, p=policy: TINY.init_params(k, p), jax.random.key(0))
        assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == \
            jax.tree.map(lambda a: (a.shape, a.dtype), real)
    assert TINY.abstract_params("pure_bf16")["norm"]["scale"].dtype == jnp.bfloat16


def test_causal_and_position_dependent(params):
    logits_fn = jax.jit(TINY.logits_fn())
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 12)), jnp.int32)
    full = logits_fn(params, tokens)
    prefix = logits_fn(params, tokens[:, :7])
    np.testing.assert_allclose(full[:, :7], prefix, rtol=1e-5, atol=1e-5)
    # Without positions, attention is blind to the order of the keys: swapping two earlier
    # tokens would leave the last position's logits unchanged. Rotary embeddings see it.
    swapped = tokens.at[:, 2].set(tokens[:, 4]).at[:, 4].set(tokens[:, 2])
    last = logits_fn(params, swapped)[:, -1]
    assert not np.allclose(last, full[:, -1], atol=1e-4)


def test_bf16_computes_in_bf16_with_f32_loss(params):
    from effijax.precision import get_policy

    policy = get_policy("bf16")
    model = llama_config("llama-tiny", seq_len=16)
    batch = _batch(model, b=2)
    compute = policy.cast_to_compute(params)
    loss, aux = jax.jit(model.loss_fn())(compute, batch)
    ref, _ = jax.jit(model.loss_fn())(params, batch)
    assert loss.dtype == jnp.float32 and aux["accuracy"].dtype == jnp.float32
    assert abs(float(loss) - float(ref)) < 0.05
    logits = jax.jit(model.logits_fn())(compute, batch["inputs"])
    # Returned in the output dtype (f32), computed in bf16: every logit is a bf16 number.
    assert logits.dtype == jnp.float32
    assert bool(jnp.all(logits.astype(jnp.bfloat16).astype(jnp.float32) == logits))


def test_masked_loss_is_the_mean_over_trained_positions(params):
    batch = _batch(TINY, b=2)
    loss, aux = jax.jit(TINY.loss_fn())(params, batch)
    logits = jax.jit(TINY.logits_fn())(params, batch["inputs"])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    w = batch["mask"].astype(jnp.float32)
    np.testing.assert_allclose(loss, jnp.sum(nll * w) / jnp.sum(w), rtol=1e-6)
    assert 0.0 <= float(aux["accuracy"]) <= 1.0


@pytest.mark.parametrize("remat", ["block", "dots"])
def test_remat_does_not_change_gradients(params, remat):
    batch = _batch(TINY, b=2)
    grad = lambda m: jax.jit(jax.grad(lambda p: m.loss_fn()(p, batch)[0]))(params)  # noqa: E731
    plain, rematted = grad(TINY), grad(dataclasses.replace(TINY, remat=remat))
    for (path, a), (_, b) in zip(named_leaves(plain), named_leaves(rematted), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=path)


def test_rope_scaling_changes_only_low_frequencies():
    from effijax.models._rotary import inv_freq

    plain = llama_config("llama-3.1-405b", rope_scaling=None)
    scaled = llama_config("llama-3.1-405b")
    a, b = (inv_freq(m.head_dim, m.rope_theta, m.rope_scaling) for m in (plain, scaled))
    assert a[0] == b[0]  # the fastest rotation keeps its wavelength (< 8192 / 4)
    np.testing.assert_allclose(b[-1], a[-1] / 8.0)  # the slowest is slowed by the factor


@pytest.mark.parametrize("per_row", [False, True], ids=["shared-tables", "per-row-tables"])
def test_rope_bf16_backward_on_the_cpu_is_autodiffs(per_row):
    """On the CPU, bf16 queries take rope's hand-written backward: the forward is the same op,
    the gradient autodiff's to one rounding of the bf16 result (and the exact transposed
    rotation's, from float64, to half an ulp); f32, and a trace for another backend, keep
    autodiff's."""
    from effijax.models import attention_backend
    from effijax.models._rotary import rope, rope_tables

    b, s, h, k = 2, 24, 3, 16
    cos, sin = (jnp.asarray(t) for t in rope_tables(k, 10000.0, None, s))
    if per_row:  # packed rows: each row's own positions
        positions = jnp.asarray(np.random.default_rng(0).integers(0, s, (b, s)))
        cos, sin = jnp.take(cos, positions, axis=0), jnp.take(sin, positions, axis=0)
    keys = jax.random.split(jax.random.key(3))
    x, dout = (jax.random.normal(kk, (b, s, h, k), jnp.bfloat16) for kk in keys)

    def run(x, dout):
        out, vjp = jax.vjp(lambda x: rope(x, cos, sin), x)
        return out, vjp(dout)[0]

    jaxpr = lambda x: str(jax.make_jaxpr(lambda x: rope(x, cos, sin))(x))  # noqa: E731
    assert "custom_vjp" in jaxpr(x)
    assert "custom_vjp" not in jaxpr(x.astype(jnp.float32))
    with attention_backend("cuda"):
        assert "custom_vjp" not in jaxpr(x)
        out_ref, grad_ref = jax.jit(run)(x, dout)
    out, grad = jax.jit(run)(x, dout)
    assert bool(jnp.all(out == out_ref))
    grad, grad_ref = np.asarray(grad, np.float64), np.asarray(grad_ref, np.float64)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(grad_ref), 1e-30))) - 7)
    assert np.all(np.abs(grad - grad_ref) <= ulp), np.abs(grad - grad_ref).max()
    d = np.asarray(dout, np.float64)
    c, sn = (np.asarray(t, np.float64)[..., None, :] for t in (cos, sin))
    ds = d * sn
    exact = d * c + np.concatenate([ds[..., k // 2:], -ds[..., :k // 2]], axis=-1)
    assert np.all(np.abs(grad - exact) <= 0.5 * ulp + 1e-6 * np.abs(exact))
    assert not np.allclose(grad, d * c, atol=1e-2)  # the rotated half is there


# --------------------------------------------------------------------------------------------
# LoRA.
# --------------------------------------------------------------------------------------------


def test_factored_lora_equals_merged_and_is_exact_at_init(params):
    spec = lora.LoraSpec(rank=4, alpha=8.0, targets=TINY.lora_targets)
    tokens = _batch(TINY, b=2)["inputs"]
    fresh = lora.init(jax.random.key(1), params, spec)
    base_logits = TINY.logits_fn()(params, tokens)
    at_init = TINY.logits_fn(spec)({"base": params, "adapters": fresh}, tokens)
    assert bool(jnp.all(at_init == base_logits))  # b = 0 adds exact zeros
    adapters = random_adapters(params, spec, seed=1, scale=0.05)
    factored = TINY.logits_fn(spec)({"base": params, "adapters": adapters}, tokens)
    merged = TINY.logits_fn()(lora.merge(params, adapters, spec), tokens)
    np.testing.assert_allclose(factored, merged, rtol=1e-4, atol=1e-4)
    assert not np.allclose(factored, base_logits, atol=1e-3)


def test_lora_trains_only_the_adapters(params):
    spec = lora.LoraSpec(rank=2, targets=r"attn/(q_proj|v_proj)/kernel")
    adapters = random_adapters(params, spec, seed=1, scale=0.05)
    batch = {**_batch(TINY, b=2), "base": params}
    loss = lora.freeze_base(TINY.loss_fn(spec))
    grads = jax.jit(jax.grad(lambda a, b: loss(a, b)[0]))(adapters, batch)
    assert jax.tree.structure(grads) == jax.tree.structure(adapters)
    assert all(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(grads))


def test_adapters_outside_the_layers_are_refused(params):
    spec = lora.LoraSpec(rank=2, targets="lm_head/kernel")
    adapters = lora.init(jax.random.key(0), params, spec)
    with pytest.raises(ConfigError, match="layers' projections"):
        TINY.logits_fn(spec)({"base": params, "adapters": adapters}, jnp.zeros((1, 2), jnp.int32))


# --------------------------------------------------------------------------------------------
# Sharded training.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy, mesh_kw", [("ddp", {}), ("fsdp", {"data": 2, "fsdp": 4})])
def test_sharded_training_matches_one_device(strategy, mesh_kw):
    # SGD keeps parameter differences proportional to gradient differences; Adam would blow
    # the reduction-order noise of near-zero gradients (rare tokens' rows) up to a full step.
    tx = optax.sgd(0.5, momentum=0.9)

    def init(key):
        return init_train_state(TINY.init_params(key), tx, key)

    batches = [_batch(TINY, seed=s) for s in range(3)]
    state = init(jax.random.key(0))
    step = jax.jit(make_train_step(TINY.loss_fn(), tx, has_aux=True))
    reference = []
    for batch in batches:
        state, metrics = step(state, batch)
        reference.append(float(metrics["loss"]))
    run = make_sharded_training(init, jax.random.key(0), loss_fn=TINY.loss_fn(), optimizer=tx,
                                mesh=make_mesh(**mesh_kw), strategy=strategy, has_aux=True)
    sharded_state, losses = run.state, []
    for batch in batches:
        sharded_state, metrics = run.step(sharded_state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    assert losses[-1] < losses[0]
    kernel = sharded_state.params["layers"]["mlp"]["up_proj"]["kernel"]
    if strategy == "fsdp":
        assert not kernel.sharding.is_fully_replicated
    for (path, a), (_, b) in zip(named_leaves(jax.device_get(sharded_state.params)),
                                 named_leaves(jax.device_get(state.params)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=path)
