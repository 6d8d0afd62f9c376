"""Every model family computes bit for bit what it computed before the shared decoder skeleton.

Each case runs one tiny model with fixed seeds (a precision policy, LoRA or not, dropout or not,
packed rows or not) and digests the exact bytes of its loss, its gradients, its logits and a
KV-cached prefill plus one decoded token (left-padded rows). The digests were recorded on the
code before :mod:`effijax.models._decoder` existed; any change of a single bit fails here.
Recompute them with ``python tests/test_decoder.py`` (only when a change of the numbers is
intended, and say so in the commit). Changed since: the GPT's bf16 LoRA gradients, when the
16-bit backward moved to XLA:CPU's bf16 GEMM (:mod:`effijax.models._dense`: its dx and dW are
the same products summed in another order; f32 is unchanged), and again when ``_dense`` moved
its bias add after the reshape back to ``[B, S, F]`` (for sequence parallelism's
reduce-scatter; XLA:CPU fuses the bf16 backward differently; f32 and every loss, logits and
decode digest unchanged), and the grouped-query blockwise case's gradients when the blockwise
kernel stopped repeating kv heads (:mod:`effijax.models._blockwise`; every other digest
unchanged). Digests are kept per host (``EXPECTED``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from effijax import lora
from effijax.errors import ConfigError
from effijax.models import (
    GPT,
    Llama,
    LlamaConfig,
    abstract_split,
    gpt_config,
    llama_config,
    make_apply,
)
from effijax.models._decoder import (
    AttentionSpec,
    PreNormBlock,
)
from effijax.models._gpt import _MLP as _GeluMLP
from effijax.models._gpt import _LayerNorm as _GPTLayerNorm
from effijax.models._rotary import RotaryAttention
from effijax.precision import get_policy


@dataclasses.dataclass(frozen=True)
class Case:
    """One model run: the architecture, the policy, LoRA (with its dropout) and the batch."""

    model: object
    policy: str = "fp32"
    lora_dropout: float | None = None  # None: no LoRA
    packed: bool = False
    dropout_rng: bool = False  # pass a key to the loss (dropout on where the model has it)


_GPT = gpt_config("tiny", seq_len=16, n_layers=2, attention="naive")  # the recorded default
_LLAMA = llama_config("llama-tiny", seq_len=16, attention="naive")  # the recorded default

CASES = {
    "gpt-fp32": Case(_GPT),
    "gpt-fp32-dropout-packed": Case(dataclasses.replace(_GPT, dropout=0.1), packed=True,
                                    dropout_rng=True),
    "gpt-bf16-lora": Case(_GPT, "bf16", lora_dropout=0.0),
    "gpt-bf16-dropout-lora-dropout": Case(dataclasses.replace(_GPT, dropout=0.1), "bf16",
                                          lora_dropout=0.1, dropout_rng=True),
    "gpt-blockwise-remat-unrolled": Case(dataclasses.replace(
        _GPT, attention="blockwise", remat="block", unroll_layers=True), packed=True),
    "llama-fp32": Case(_LLAMA),
    "llama-fp32-packed": Case(_LLAMA, packed=True),
    "llama-bf16-lora-dropout": Case(_LLAMA, "bf16", lora_dropout=0.1, dropout_rng=True),
    "llama-tied-blockwise-remat": Case(dataclasses.replace(
        _LLAMA, tie_embeddings=True, attention="blockwise", remat="dots"), "pure_bf16",
        lora_dropout=0.0, packed=True),
}


def _batch(model, packed: bool) -> dict:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.vocab_size, (4, model.seq_len + 1))
    batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
             "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
             "mask": jnp.asarray(rng.random((4, model.seq_len)) < 0.8, jnp.int32)}
    if packed:
        cut = rng.integers(1, model.seq_len, (4, 1))
        batch["segments"] = jnp.asarray(1 + (np.arange(model.seq_len)[None] >= cut), jnp.int32)
    return batch


def _adapters(model, params, dropout: float):
    """Adapters on every target, with nonzero ``b`` so that they change the numbers."""
    spec = lora.LoraSpec(rank=4, alpha=8.0, targets=model.lora_targets, dropout=dropout)
    adapters = lora.init(jax.random.key(1), params, spec)
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    leaves = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys,
                                                                                 strict=True)]
    return spec, jax.tree.unflatten(treedef, leaves)


def _digest(tree) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        leaf = np.asarray(leaf)
        h.update(f"{leaf.dtype}{leaf.shape}".encode())
        h.update(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8).tobytes())
    return h.hexdigest()[:24]


def run(case: Case) -> dict[str, str]:
    """The digests of one case: loss and accuracy, gradients, logits, cached decode."""
    model, policy = case.model, get_policy(case.policy)
    params = model.init_params(jax.random.key(0), policy)
    spec = None
    if case.lora_dropout is not None:
        spec, adapters = _adapters(model, params, case.lora_dropout)
        params = {"base": params, "adapters": adapters}
    batch = _batch(model, case.packed)
    rng = jax.random.key(3) if case.dropout_rng else None
    compute = policy.cast_to_compute(params)
    loss_fn = model.loss_fn(spec)
    (loss, aux), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(compute, batch, rng)
    logits = jax.jit(model.logits_fn(spec))(compute, batch["inputs"], batch.get("segments"))
    cache = model.init_cache(4, model.seq_len, policy.compute_dtype)
    cache = cache._replace(pad_B=jnp.asarray([0, 2, 1, 0], jnp.int32))
    decode = jax.jit(model.decode_fn(spec))
    prompt = batch["inputs"][:, : model.seq_len - 2]
    prefill, cache = decode(compute, cache, prompt, jnp.int32(0))
    step, cache = decode(compute, cache, batch["inputs"][:, -2:-1], jnp.int32(prompt.shape[1]),
                         jnp.int32(0))
    return {"loss": _digest((loss, aux)), "grads": _digest(grads), "logits": _digest(logits),
            "decode": _digest((prefill, step, cache))}


# Per host (see machine()): XLA:CPU's bits depend on the instruction set.
# AMD EPYC AVX-512: gradients re-recorded when the loss got its own backward
# (precision.cross_entropy_and_accuracy: the same products, summed in another order; every loss,
# logit and decode unchanged) and 16-bit residuals crossed the scan as bits (models._dense.keep).
# None: a digest the code has changed since and that host has not recorded again. The blockwise
# kernel's grouped-query layout (models._blockwise: a group's dk and dv are summed inside the
# tile's contraction, not after a repeat) changed llama-tied-blockwise-remat's gradients on the
# AVX2 host (every other digest there unchanged). AVX2 and the Intel Xeon (AVX-512): recorded
# after that change; the AMD AVX-512 host's two blockwise gradients (GPT's too, there) were
# recorded again later, every other digest there unchanged. The kernel's bf16 tiles then
# multiplied in bf16 (P and dS rounded to bf16 before their matmuls, as FlashAttention-2 does;
# f32 tiles unchanged): llama-tied-blockwise-remat's loss, gradients and logits recorded again
# on the AMD AVX-512 host (every other digest there unchanged), None on the other two.
EXPECTED = {
    "AMD EPYC avx512f jax 0.10.2": {
        'gpt-bf16-dropout-lora-dropout': {
            'loss': 'a69bab3a62f6dcccefca5e2b',
            'grads': 'f132ef839a8581daacb133dd',
            'logits': 'f23c9090a40719859cf921be',
            'decode': '433cc73fabfd2cfc587cad84',
        },
        'gpt-bf16-lora': {
            'loss': 'de9c011684594e30cee3d98b',
            'grads': 'ef7457684fc222e32ba90d37',
            'logits': 'f23c9090a40719859cf921be',
            'decode': '433cc73fabfd2cfc587cad84',
        },
        'gpt-blockwise-remat-unrolled': {
            'loss': '7c3c245227b9f9332be0327e',
            'grads': '6b50ee52e3640556f35d9476',
            'logits': 'd67106a2850884d3e1beafe5',
            'decode': '849a7f88119cf4c96aae395e',
        },
        'gpt-fp32': {
            'loss': '2c00be35d7f8936b3206b797',
            'grads': 'de3b893623564d049f788079',
            'logits': '14b4502eb7a947b63f6c5c67',
            'decode': '849a7f88119cf4c96aae395e',
        },
        'gpt-fp32-dropout-packed': {
            'loss': 'a6bccf64c2dc0ac93ecf41ab',
            'grads': '0a71c71bf95b5000dbaa15b5',
            'logits': '26b887d935addfb50167a24c',
            'decode': '849a7f88119cf4c96aae395e',
        },
        'llama-bf16-lora-dropout': {
            'loss': '8fb29b138f982a79a7ed5abe',
            'grads': 'c7a9ddad9c982c542ff3bae8',
            'logits': '2bfece67b729e5b258c9b16f',
            'decode': 'e5a3a5b78e4b9091baa3336b',
        },
        'llama-fp32': {
            'loss': 'c5fb32c7ecff7e3b8c786323',
            'grads': '2190a44f4a42599f51ae3fd1',
            'logits': '385279b4209f8605ecbb34bb',
            'decode': 'a53dc96fe7a4df5ff5f480f4',
        },
        'llama-fp32-packed': {
            'loss': '708d594056b593386e4b5949',
            'grads': '9e1ceebcb3f120248cb7cc7e',
            'logits': 'c7a6a19dfe88ae4f1b73cfd2',
            'decode': 'a53dc96fe7a4df5ff5f480f4',
        },
        'llama-tied-blockwise-remat': {
            'loss': 'c99378f78d8295ed47af7dc2',
            'grads': '3a641cf99bd5d0a100031550',
            'logits': '10f0e093472f868243868fbe',
            'decode': '99aa4bc794e9e4a5fc3d2442',
        },
    },
    "Intel(R) Xeon(R) Processor @ 2.50GHz avx512f jax 0.10.2": {
        'gpt-bf16-dropout-lora-dropout': {
            'loss': 'a69bab3a62f6dcccefca5e2b',
            'grads': 'f132ef839a8581daacb133dd',
            'logits': 'f23c9090a40719859cf921be',
            'decode': '433cc73fabfd2cfc587cad84',
        },
        'gpt-bf16-lora': {
            'loss': 'de9c011684594e30cee3d98b',
            'grads': 'ef7457684fc222e32ba90d37',
            'logits': 'f23c9090a40719859cf921be',
            'decode': '433cc73fabfd2cfc587cad84',
        },
        'gpt-blockwise-remat-unrolled': {
            'loss': '7c3c245227b9f9332be0327e',
            'grads': '7978e4ec19ddf9273be45f70',
            'logits': '17bf7faf681f866a4d0d947e',
            'decode': 'c31338fc8e20cf4a1fab04c9',
        },
        'gpt-fp32': {
            'loss': '2c00be35d7f8936b3206b797',
            'grads': 'e09207d3c0de413cad5646f0',
            'logits': '1ff3a097c5b0588da93df0db',
            'decode': 'c31338fc8e20cf4a1fab04c9',
        },
        'gpt-fp32-dropout-packed': {
            'loss': 'a6bccf64c2dc0ac93ecf41ab',
            'grads': '243b1f4e87e8a593f91d4b0e',
            'logits': 'c2a415caebdc564c0a43ac31',
            'decode': 'c31338fc8e20cf4a1fab04c9',
        },
        'llama-bf16-lora-dropout': {
            'loss': 'daf704bc8e64b89314b6f78b',
            'grads': '43f5317b27f41c285ca55fb5',
            'logits': '2bfece67b729e5b258c9b16f',
            'decode': 'e5a3a5b78e4b9091baa3336b',
        },
        'llama-fp32': {
            'loss': 'c7dcf36409e14e5b92de9fd5',
            'grads': '1a139b6b88ed13f44c4895ec',
            'logits': 'd89d52250d37b40a42a2039b',
            'decode': '346cb08665e1b532e8a8e35b',
        },
        'llama-fp32-packed': {
            'loss': '708d594056b593386e4b5949',
            'grads': '5c169a927091fa2e0c74449b',
            'logits': '5709a9022eca1470c89ffc32',
            'decode': '346cb08665e1b532e8a8e35b',
        },
        'llama-tied-blockwise-remat': {
            'loss': None,
            'grads': None,
            'logits': None,
            'decode': '99aa4bc794e9e4a5fc3d2442',
        },
    },
    "AMD EPYC avx2 jax 0.10.2": {
        'gpt-bf16-dropout-lora-dropout': {
            'loss': 'a69bab3a62f6dcccefca5e2b',
            'grads': 'f132ef839a8581daacb133dd',
            'logits': 'f23c9090a40719859cf921be',
            'decode': '433cc73fabfd2cfc587cad84',
        },
        'gpt-bf16-lora': {
            'loss': 'de9c011684594e30cee3d98b',
            'grads': 'ef7457684fc222e32ba90d37',
            'logits': 'f23c9090a40719859cf921be',
            'decode': '433cc73fabfd2cfc587cad84',
        },
        'gpt-blockwise-remat-unrolled': {
            'loss': '7c3c245227b9f9332be0327e',
            'grads': 'eb9ca6acd1f5ad21b00ca3ec',
            'logits': 'c211d2006b2c53705cf44b18',
            'decode': '846c170f2fa2a6b8c6458253',
        },
        'gpt-fp32': {
            'loss': '2c00be35d7f8936b3206b797',
            'grads': '60432ff4649664940dcae906',
            'logits': '488fa7a9064c830170fa369b',
            'decode': '846c170f2fa2a6b8c6458253',
        },
        'gpt-fp32-dropout-packed': {
            'loss': 'a6bccf64c2dc0ac93ecf41ab',
            'grads': 'c4cc0b5786b8a962a7453147',
            'logits': 'e099f26ee30a0470180a3f09',
            'decode': '846c170f2fa2a6b8c6458253',
        },
        'llama-bf16-lora-dropout': {
            'loss': '8fb29b138f982a79a7ed5abe',
            'grads': 'c7a9ddad9c982c542ff3bae8',
            'logits': '2bfece67b729e5b258c9b16f',
            'decode': 'e5a3a5b78e4b9091baa3336b',
        },
        'llama-fp32': {
            'loss': 'c7dcf36409e14e5b92de9fd5',
            'grads': 'f19327b20ff6cc750e5fe255',
            'logits': 'fa5b9987f0c10debb9999622',
            'decode': '2a1a30b3756b9ecd28efaabe',
        },
        'llama-fp32-packed': {
            'loss': '708d594056b593386e4b5949',
            'grads': 'cab1539c655ca411a9affc66',
            'logits': '0115aa9993c2240d7ffbe175',
            'decode': '2a1a30b3756b9ecd28efaabe',
        },
        'llama-tied-blockwise-remat': {
            'loss': None,
            'grads': None,
            'logits': None,
            'decode': '99aa4bc794e9e4a5fc3d2442',
        },
    },
}


def machine() -> str:
    """What the digests depend on besides the code: XLA:CPU compiles for the host's instruction
    set (vector width changes the order of a reduction), and the library versions."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                     if line.startswith("model name")), "?")
        flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
    except OSError:
        name = "?"
    isa = "avx512f" if " avx512f" in flags else "avx2" if " avx2" in flags else "other"
    return f"{name} {isa} jax {jax.__version__}"


@pytest.mark.slow  # 9 models compiled three ways each: ~2 min on 2 cores
@pytest.mark.optimized  # the bits of a user's build
@pytest.mark.parametrize("name", sorted(CASES))
def test_bit_identical_to_the_recorded_run(name):
    if machine() not in EXPECTED:
        pytest.skip(f"the digests were recorded on {sorted(EXPECTED)}, this is {machine()!r}: "
                    "XLA:CPU's bits depend on the host; record them here with "
                    "`python tests/test_decoder.py` before a refactor, then compare after")
    expected = EXPECTED[machine()][name]
    got = run(CASES[name])
    assert {k: v for k, v in got.items() if expected[k] is not None} == {
        k: v for k, v in expected.items() if v is not None}


# --------------------------------------------------------------------------------------------
# The skeleton's contract: one error type, and a family is its hooks.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model, field", [(_GPT, "seq_len"), (_LLAMA, "max_position")])
def test_inputs_are_checked_before_tracing_with_config_errors(model, field):
    graphdef, params = abstract_split(model)
    apply = make_apply(graphdef)
    too_long = jnp.zeros((1, model.max_context + 1), jnp.int32)
    with pytest.raises(ConfigError, match=f"exceeds config.{field}={model.max_context}"):
        jax.eval_shape(apply, params, too_long)
    with pytest.raises(ConfigError, match="^tokens_BS: expected integer ids"):
        jax.eval_shape(apply, params, jnp.zeros((1, 4)))
    spec = lora.LoraSpec(dropout=0.1, targets=model.lora_targets)
    adapters = jax.eval_shape(lambda p: lora.init(jax.random.key(1), p, spec), params)
    with pytest.raises(ConfigError, match="^rngs: dropout is on .* no rngs"):
        jax.eval_shape(functools.partial(make_apply(graphdef, spec), deterministic=False),
                       {"base": params, "adapters": adapters}, jnp.zeros((1, 4), jnp.int32))
    cache = model.init_cache(1, model.max_context)
    with pytest.raises(ConfigError, match=f"^cache: .* need tokens <= cache <= config.{field}"):
        jax.eval_shape(model.decode_fn(), params, cache,
                       jnp.zeros((1, model.max_context + 1), jnp.int32), jnp.int32(0))


def test_a_module_refuses_another_familys_config():
    with pytest.raises(TypeError, match="expected the config of a GPT, got LlamaConfig"):
        GPT(_LLAMA, rngs=nnx.Rngs(0))


@dataclasses.dataclass(frozen=True, kw_only=True)
class _BiasedConfig(LlamaConfig):
    """A third family for the test: the Llama's config and module with a layer of its own
    (Qwen2's q/k/v biases, the GPT's LayerNorm and GELU MLP)."""

    family: ClassVar[str] = "biased"


class _BiasedLayer(PreNormBlock):
    norm_names = ("pre_attn", "pre_mlp")

    @staticmethod
    def norm(config, *, stack):
        return _GPTLayerNorm(config.d_model, eps=config.rms_eps, stack=stack)

    def __init__(self, config, *, stack, rngs):
        spec = AttentionSpec(config.d_model, config.n_heads, config.n_kv_heads, config.head_dim,
                             config.attention, names=("q_proj", "k_proj", "v_proj", "o_proj"),
                             bias=(True, True, True, False))
        self.build_norms(config, stack)
        self.attn = RotaryAttention(spec, std=0.02, out_std=0.01, stack=stack, rngs=rngs)
        self.mlp = _GeluMLP(config, out_std=0.01, stack=stack, rngs=rngs)


class _Biased(Llama):
    layer_type = _BiasedLayer


_BiasedConfig.decoder = _Biased


@pytest.mark.slow  # a model of its own, trained and decoded: ~10 s
def test_a_new_family_is_its_hooks():
    model = _BiasedConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, seq_len=16)
    params = model.init_params(jax.random.key(0))
    assert params["layers"]["attn"]["q_proj"]["bias"].shape == (2, 32)
    assert "bias" not in params["layers"]["attn"]["o_proj"]
    assert params["layers"]["pre_mlp"]["bias"].shape == (2, 32)  # a LayerNorm
    assert params["layers"]["attn"]["k_proj"]["kernel"].shape == (2, 32, 16)  # 2 kv heads
    batch = _batch(model, packed=True)
    (loss, _), grads = jax.value_and_grad(model.loss_fn(), has_aux=True)(params, batch)
    assert np.isfinite(loss) and float(jnp.abs(grads["layers"]["attn"]["q_proj"]["bias"]).sum())
    # The cached decode of a prompt, then of one token, gives the full pass's logits.
    tokens = batch["inputs"][:, :9]
    full = model.logits_fn()(params, tokens)
    decode = model.decode_fn()
    prefill, cache = decode(params, model.init_cache(4, 16), tokens[:, :8], jnp.int32(0))
    step, _ = decode(params, cache, tokens[:, 8:], jnp.int32(8))
    np.testing.assert_allclose(prefill, full[:, :8], atol=1e-5)
    np.testing.assert_allclose(step, full[:, 8:], atol=1e-5)


if __name__ == "__main__":
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    print(f"EXPECTED[{machine()!r}] = {{")
    for name in sorted(CASES):
        print(f"    {name!r}: {run(CASES[name])!r},")
