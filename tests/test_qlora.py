"""Quantized frozen bases (QLoRA): NF4/int8 codes, their scales, and LoRA training on them.

The quantizer's contract first (code book, exact round trips, error bounds, packing, bytes,
shardings), on small arrays; then the model: the adapters' gradients on a quantized base equal
those on its dequantized copy, a LoRA job trains on it (one device and FSDP on 8 give the same
loss), and the compiled step's arguments are exactly the estimated bytes.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from effijax import lora
from effijax.errors import ConfigError
from effijax.memory import GB, frozen_base_bytes, measure, model_states, plan, tree_bytes
from effijax.models import abstract_split, llama_config, make_loss_fn
from effijax.precision import (
    NF4_CODES,
    Quantized,
    ScaleCodes,
    dequantize,
    dequantize_kernels,
    is_quantized,
    quantize,
    quantize_kernels,
    quantized_bytes,
    quantized_sharding,
)
from effijax.sharding import make_mesh

# NF4 as printed in the QLoRA paper's appendix (Dettmers et al. 2023, "NormalFloat 4-bit").
PUBLISHED_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                 -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]


def test_nf4_code_book_is_the_normal_quantiles_of_qlora():
    np.testing.assert_allclose(NF4_CODES, PUBLISHED_NF4, rtol=0, atol=2e-6)
    assert NF4_CODES.dtype == np.float32 and len(set(NF4_CODES.tolist())) == 16
    assert (NF4_CODES[0], NF4_CODES[7], NF4_CODES[15]) == (-1.0, 0.0, 1.0)


@pytest.mark.parametrize("double_quant", [False, True])
def test_values_on_the_code_book_times_the_scale_round_trip_exactly(double_quant):
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 16, (2, 8, 128))
    idx[..., ::64] = 15  # every block of 64 holds its absmax, the code 1.0
    scale = np.float32(1.5) if double_quant else rng.uniform(0.5, 2, (2, 8, 2, 1)).astype("f4")
    w = (NF4_CODES[idx].reshape(2, 8, 2, 64) * scale).reshape(2, 8, 128)
    q = quantize(jnp.asarray(w), "nf4", double_quant=double_quant)
    assert isinstance(q.scales, ScaleCodes) == double_quant
    np.testing.assert_array_equal(np.asarray(dequantize(q)), w)


def test_int8_codes_times_the_scale_round_trip_exactly():
    rng = np.random.default_rng(1)
    k = rng.integers(-127, 128, (4, 128)).astype(np.float32)
    k[:, ::64] = 127
    step = 2.0 ** -rng.integers(3, 8, (4, 2, 1)).astype(np.float32)  # absmax / 127 exactly
    w = (k.reshape(4, 2, 64) * step).reshape(4, 128)
    q = quantize(jnp.asarray(w), "int8", double_quant=False)
    assert q.codes.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(dequantize(q)), w)


@jax.jit
def _round_trip_errors(w):
    """Per format: the plain and double-quantized errors, and the double-quantized scales'."""
    out = {}
    for fmt in ("nf4", "int8"):
        q = quantize(w, fmt)
        dq_scales = dequantize(Quantized(jnp.full((*q.codes.shape[:-1], q.scales.codes.shape[-1]),
                                                  127, jnp.int8), q.scales)) / 127
        out[fmt] = (dequantize(quantize(w, fmt, double_quant=False)) - w, dequantize(q) - w,
                    dq_scales, jnp.repeat(q.scales.steps, w.shape[-2], axis=-2))
    return out


def test_round_trip_error_is_within_half_a_code_gap_of_each_blocks_absmax():
    w = np.asarray(jax.random.normal(jax.random.key(0), (3, 32, 256), jnp.float32))
    blocks = lambda x: np.abs(np.asarray(x)).reshape(3, 32, 4, 64)  # noqa: E731
    absmax = blocks(w).max(axis=-1)
    half_gap = float(np.max(np.diff(NF4_CODES))) / 2
    errors = _round_trip_errors(w)
    for fmt, largest_code, scale in [("nf4", 1.0, absmax), ("int8", 127.0, absmax / 127)]:
        plain, dq, dq_scales, step = errors[fmt]
        bound = (half_gap if fmt == "nf4" else 0.5) * scale
        assert np.all(blocks(plain) <= bound[..., None] * 1.0001), fmt
        # Double quantization: each scale within half its group's int8 step, and the weights
        # off by at most the largest code times that.
        scale_err = np.abs(np.asarray(dq_scales) - scale)
        assert np.all(scale_err <= np.asarray(step) / 2 * 1.0001 + 1e-7), fmt
        assert np.all(blocks(dq) <= (bound + largest_code * scale_err)[..., None] * 1.0001), fmt


def test_packing_puts_even_columns_in_the_low_nibble_and_unpacks_exactly():
    idx = np.random.default_rng(2).integers(0, 16, (5, 64)).astype(np.uint8)
    packed = idx[:, 0::2] | (idx[:, 1::2] << 4)
    q = Quantized(jnp.asarray(packed), jnp.ones((5, 1), jnp.float32))
    assert (q.format, q.shape, q.block) == ("nf4", (5, 64), 64)
    np.testing.assert_array_equal(np.asarray(dequantize(q)), NF4_CODES[idx])
    w = jnp.asarray(NF4_CODES[idx])
    np.testing.assert_array_equal(np.asarray(quantize(w, "nf4", double_quant=False).codes), packed)


@pytest.mark.parametrize("shape", [(2, 64, 32), (3, 512, 256), (96, 6), (4, 7, 130)])
@pytest.mark.parametrize("fmt", ["nf4", "int8"])
@pytest.mark.parametrize("double_quant", [False, True])
def test_quantized_bytes_are_the_arrays_nbytes(shape, fmt, double_quant):
    q = jax.eval_shape(lambda w: quantize(w, fmt, double_quant=double_quant),
                       jax.ShapeDtypeStruct(shape, jnp.float32))
    nbytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(q))
    assert quantized_bytes(shape, fmt, double_quant=double_quant) == nbytes


def test_four_bit_base_is_at_most_0_30_of_bf16_scales_included():
    # Llama-2-70B's kernel shapes: QLoRA's 4.127 bits per weight.
    for shape in [(80, 8192, 8192), (80, 8192, 1024), (80, 8192, 28672), (80, 28672, 8192)]:
        ratio = quantized_bytes(shape, "nf4") / (2 * math.prod(shape))
        assert 0.2579 < ratio < 0.2580, (shape, ratio)
    assert quantized_bytes((8192, 8192), "nf4", double_quant=False) / (2 * 8192**2) == 4.5 / 16


def test_frozen_base_bytes_equal_the_quantized_trees_nbytes():
    config = llama_config("llama-tiny", seq_len=16)
    _, abstract = abstract_split(config)
    for fmt in ("nf4", "int8"):
        base = jax.eval_shape(lambda p, f=fmt: quantize_kernels(p, f), abstract)
        assert frozen_base_bytes(abstract, fmt, dtype=jnp.float32) == tree_bytes(base)
    assert frozen_base_bytes(abstract, "bf16") == tree_bytes(abstract) // 2


def test_model_states_count_the_scales_and_take_exact_bytes():
    ms = model_states("70B", lora_fraction=0.01, frozen_dtype="nf4")
    assert ms.frozen_bytes == math.ceil(70e9 * (4 + 8 / 64 + 32 / (64 * 256)) / 8)
    exact = model_states("70B", lora_fraction=0.01, frozen_dtype="nf4", frozen_bytes=36 * GB,
                         zero_stage=3, devices=8)
    assert (exact.frozen_bytes, exact.frozen_params) == (36 * GB // 8, 70 * 10**9)


def test_planner_proposes_an_nf4_base_only_when_it_is_what_fits():
    assert not plan("70B", devices=1, device_memory="80GB").fits
    p = plan("70B", devices=1, device_memory="80GB", quantized_base="nf4")
    assert (p.fits, p.lora, p.frozen_dtype, p.zero_stage) == (True, True, "nf4", 0)
    assert "LoRA (0.01 adapters, bf16 frozen base): model states do not fit" in p.explain()
    assert plan("7B", devices=1, device_memory="80GB", quantized_base="nf4").frozen_dtype == "bf16"
    assert plan("1B", devices=1, device_memory="80GB", quantized_base="nf4").frozen_dtype is None
    with pytest.raises(ConfigError, match="quantized_base='nf3'"):
        plan("7B", devices=1, device_memory="80GB", quantized_base="nf3")


def test_quantized_kernels_survive_jit_and_keep_their_format():
    p = {"layers": {"kernel": jnp.ones((2, 8, 64))}, "embed": jnp.ones((4, 8))}
    q = quantize_kernels(p, "nf4")
    out = jax.jit(lambda t: t)(q)
    chex.assert_trees_all_equal(out, q)
    k = out["layers"]["kernel"]
    assert is_quantized(k) and (k.format, k.shape, k.block) == ("nf4", (2, 8, 64), 64)
    assert not is_quantized(out["embed"])


def test_quantized_leaves_shard_like_their_kernel():
    mesh = make_mesh()  # fsdp = 8
    q = quantize(jax.random.normal(jax.random.key(0), (2, 64, 1024)), "nf4")
    sh = quantized_sharding(NamedSharding(mesh, P(None, None, "fsdp")), q)
    assert (sh.codes.spec, sh.scales.codes.spec) == (P(None, None, "fsdp"), P(None, None, "fsdp"))
    assert sh.scales.offset.spec == P(None, None, None)  # one mean per layer: replicated
    placed = jax.device_put(q, sh)
    assert placed.codes.addressable_shards[0].data.shape == (2, 64, 64)
    np.testing.assert_array_equal(np.asarray(dequantize(placed)), np.asarray(dequantize(q)))


@pytest.mark.parametrize(("call", "match"), [
    (lambda: quantize(jnp.ones((4, 7)), "nf4"), r"last axis \(7\) must be even"),
    (lambda: quantize(jnp.ones(8), "nf4"), "rank >= 2"),
    (lambda: quantize(jnp.ones((4, 8)), "fp4"), "format='fp4': choose one of nf4, int8"),
])
def test_bad_inputs_say_what_to_do(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


# The model ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    config = llama_config("llama-tiny", seq_len=16)
    graphdef, abstract = abstract_split(config)
    rng = np.random.default_rng(0)  # host random numbers: nothing to compile
    params = jax.tree.map(lambda a: jnp.asarray(0.05 * rng.standard_normal(a.shape), a.dtype),
                          abstract)
    spec = lora.LoraSpec(rank=4, targets=config.lora_targets)
    adapters = jax.tree.map(  # b != 0: the adapters matter
        lambda a: jnp.asarray(0.05 * rng.standard_normal(a.shape), a.dtype),
        jax.eval_shape(lambda: lora.init(jax.random.key(1), params, spec)))
    tokens = jnp.asarray(rng.integers(0, 256, (2, 17)), jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    return config, graphdef, params, spec, adapters, batch


def test_adapter_gradients_on_a_quantized_base_equal_those_on_its_dequantized_copy(tiny):
    config, graphdef, params, spec, adapters, batch = tiny
    loss = jax.jit(jax.value_and_grad(
        lambda a, base: make_loss_fn(graphdef, spec)({"base": base, "adapters": a}, batch)[0]))
    # Both formats in one base (one compilation): NF4 attention, int8 MLP.
    q = quantize_kernels(params, "nf4")
    q["layers"]["mlp"] = quantize_kernels(params["layers"]["mlp"], "int8")
    assert q["layers"]["mlp"]["up_proj"]["kernel"].format == "int8"
    copy = dequantize_kernels(q)
    (l_q, g_q), (l_c, g_c), (l_f, _) = loss(adapters, q), loss(adapters, copy), loss(adapters,
                                                                                     params)
    np.testing.assert_allclose(l_q, l_c, rtol=1e-6)
    chex.assert_trees_all_close(g_q, g_c, rtol=1e-5, atol=1e-7)
    assert abs(float(l_q) - float(l_f)) / float(l_f) < 0.01  # 4-bit error in the frozen weights


@pytest.fixture(scope="module")
def qlora_jobs():
    from effijax.recipe import batch_fn, init_frozen, init_state, plan_job
    config = llama_config("llama-tiny", seq_len=16)
    spec = lora.LoraSpec(rank=4, targets=config.lora_targets)
    tokens = np.tile(np.arange(48, dtype=np.int32), 100)  # learnable in a few steps
    runs = {}
    for name, frozen, mesh, strategy in [("f32", None, None, "ddp"),
                                         ("nf4", "nf4", None, "ddp"),
                                         ("nf4-fsdp", "nf4", make_mesh(), "fsdp")]:
        job = plan_job(config, "fp32", optax.adam(1e-2), batch_size=8, lora=spec,
                       frozen_dtype=frozen, mesh=mesh, strategy=strategy)
        base = init_frozen(job)
        state, batches, losses = init_state(job), batch_fn(job, tokens, base), []
        for i in range(6):
            state, metrics = job.step(state, batches(i))
            losses.append(float(metrics["lm_loss"]))
        runs[name] = (job, base, state, losses)
    return runs


def test_lora_trains_on_a_quantized_base_close_to_the_f32_base(qlora_jobs):
    _, _, state, f32 = qlora_jobs["f32"]
    job, base, state_q, nf4 = qlora_jobs["nf4"]
    assert all(is_quantized(base["layers"][g][k]["kernel"])
               for g, ks in [("attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                             ("mlp", ("gate_proj", "up_proj", "down_proj"))] for k in ks)
    assert base["embed"]["embedding"].dtype == jnp.float32  # the policy's dtype
    # Only the adapters are trained: the state holds them and nothing of the base.
    assert set(lora.pairs(state_q.params)) == set(lora.pairs(state.params))
    assert nf4[-1] < nf4[0] - 0.05
    np.testing.assert_allclose(nf4, f32, rtol=0.01)


def test_fsdp_on_8_devices_equals_one_device_on_the_quantized_base(qlora_jobs):
    job, base, _, losses = qlora_jobs["nf4-fsdp"]
    codes = base["layers"]["mlp"]["up_proj"]["kernel"].codes
    assert len({s.data.shape for s in codes.addressable_shards}) == 1
    assert codes.addressable_shards[0].data.size * 8 == codes.size  # split, not replicated
    np.testing.assert_allclose(losses, qlora_jobs["nf4"][3], rtol=2e-5)


def test_compiled_step_arguments_are_the_estimated_bytes(qlora_jobs):
    from effijax.recipe import abstract_batch

    job, base, state, _ = qlora_jobs["nf4"]
    _, abstract = abstract_split(job.model)
    estimate = frozen_base_bytes(abstract, "nf4", dtype=jnp.float32)
    assert tree_bytes(base) == estimate
    batch = abstract_batch(job)
    m = measure(job.step.lower(state, batch).compile())
    assert m.argument_bytes == tree_bytes(state) + tree_bytes(batch)
    assert tree_bytes(batch["base"]) == estimate
    # No full-precision copy of the base among the temporaries: each layer's kernels are
    # dequantized where used (at most one layer's f32 kernels more than on the f32 base).
    f32_job, f32_base, f32_state, _ = qlora_jobs["f32"]
    m_f32 = measure(f32_job.step.lower(f32_state, abstract_batch(f32_job)).compile())
    one_layer = tree_bytes(f32_base["layers"]) // job.model.n_layers
    print(f"temporaries: nf4 base {m.temp_bytes:,} B, f32 base {m_f32.temp_bytes:,} B, "
          f"one layer's f32 weights {one_layer:,} B")
    assert m.temp_bytes <= m_f32.temp_bytes + one_layer


def test_generation_with_adapters_on_a_quantized_base_is_that_of_its_dequantized_copy(tiny):
    from effijax.generate import generate

    config, _, params, spec, adapters, _ = tiny
    q = quantize_kernels(params, "nf4")
    outs = [generate(config, {"base": base, "adapters": adapters}, [[1, 2, 3], [7, 8]],
                     max_new_tokens=6, lora=spec).tokens
            for base in (q, dequantize_kernels(q))]
    np.testing.assert_array_equal(outs[0], outs[1])
