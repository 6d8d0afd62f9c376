"""The models' matmul on the CPU (effijax.models._dense): 16-bit backward dots in the form
XLA:CPU's bf16 GEMM takes, f32 and other backends' programs unchanged.

The reference is the plain ``dot_general`` path, which a trace made for another backend
(:func:`~effijax.models.attention_backend`) takes; the models' attention is named ("naive"), so
nothing else in those traces depends on the backend.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from effijax import lora
from effijax.models import attention_backend, gpt_config, llama_config
from effijax.models._dense import cpu_layout, matmul
from effijax.precision import dot, get_policy

SEQ, BATCH = 16, 2
# GPT: LayerNorm, GELU, tied head (the transposed kernel); Llama: RMSNorm, SwiGLU, own head.
MODELS = {"gpt": gpt_config("tiny", attention="naive").with_seq_len(SEQ),
          "llama": llama_config("llama-tiny", attention="naive").with_seq_len(SEQ)}


def _batch(config):
    keys = jax.random.split(jax.random.key(5))
    return {name: jax.random.randint(k, (BATCH, SEQ), 0, config.vocab_size)
            for name, k in zip(("inputs", "targets"), keys, strict=True)}


def _loss(config, precision: str, adapted: bool):
    """``(params, batch) -> loss`` of every parameter (full fine-tuning), or of the adapters
    only with the base frozen in the batch (LoRA)."""
    policy = get_policy(precision)
    if not adapted:
        loss_fn = config.loss_fn()
        return lambda p, b: loss_fn(policy.cast_to_compute(p), b)[0]
    frozen = lora.freeze_base(config.loss_fn(lora.LoraSpec(rank=4, targets=config.lora_targets)))
    return lambda a, b: frozen(policy.cast_to_compute(a), b)[0]


def _grad_fn(config, precision: str, adapted: bool):
    """jitted ``(params, batch) -> (loss, grads)``."""
    return jax.jit(jax.value_and_grad(_loss(config, precision, adapted)))


def _inputs(config, precision: str, adapted: bool):
    params = config.init_params(jax.random.key(0), get_policy(precision))
    batch = _batch(config)
    if not adapted:
        return params, batch
    spec = lora.LoraSpec(rank=4, targets=config.lora_targets)
    adapters = lora.init(jax.random.key(1), params, spec)
    # b != 0, so the adapters' gradients flow through the whole stack.
    adapters = jax.tree.map(lambda x: x + 0.01, adapters)
    base = get_policy(precision).cast_to_compute(params)
    return adapters, {**batch, "base": base}


@functools.cache
def _run(model, precision, adapted, backend):
    """Loss and gradients of ``MODELS[model]``, traced for ``backend`` and run here (once per
    session: the f32 runs serve both tests)."""
    config = MODELS[model]
    with attention_backend(backend):
        return _grad_fn(config, precision, adapted)(*_inputs(config, precision, adapted))


def _jaxpr_text(model, precision, adapted, backend) -> str:
    config = MODELS[model]
    with attention_backend(backend):
        fn = _loss(config, precision, adapted)
        return str(jax.make_jaxpr(fn)(*_inputs(config, precision, adapted)))


# Full fine-tuning of the tied GPT (dx and dw, the transposed head) and LoRA on the Llama (dx
# only: the frozen base's kernels are not differentiated).
CASES = [pytest.param("gpt", False, id="gpt-full"), pytest.param("llama", True, id="llama-lora")]


@pytest.mark.slow  # two compiled train steps per case
@pytest.mark.parametrize(("model", "adapted"), CASES)
def test_f32_loss_and_gradients_are_bit_identical_to_the_plain_dot(model, adapted):
    loss, grads = _run(model, "fp32", adapted, "cpu")
    want_loss, want = _run(model, "fp32", adapted, "cuda")
    assert np.array_equal(loss, want_loss)
    for path, got in jax.tree_util.tree_leaves_with_path(grads):
        ref = dict(jax.tree_util.tree_leaves_with_path(want))[path]
        assert np.array_equal(got, ref), jax.tree_util.keystr(path)


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree.leaves(tree)])


@pytest.mark.slow  # two compiled train steps per case
@pytest.mark.parametrize(("model", "adapted"), CASES)
def test_bf16_gradients_are_as_close_to_f32_as_the_plain_dots(model, adapted):
    loss, grads = _run(model, "bf16", adapted, "cpu")
    want_loss, want = _run(model, "bf16", adapted, "cuda")
    _, exact = _run(model, "fp32", adapted, "cpu")
    # The forward's dots are the plain path's: the loss is the same number.
    assert np.array_equal(loss, want_loss)
    got, plain, f32 = _flat(grads), _flat(want), _flat(exact)
    # Not vacuous: the CPU backward is in the program (the plain one has none).
    assert "name=_cpu_matmul" in _jaxpr_text(model, "bf16", adapted, "cpu")
    assert "name=_cpu_matmul" not in _jaxpr_text(model, "bf16", adapted, "cuda")
    # Each side is an f32 sum rounded once to bf16, in another order: apart by bf16 rounding,
    # and no further from the f32 gradients than the plain path is.
    assert np.linalg.norm(got - plain) / np.linalg.norm(plain) < 2**-7
    assert np.linalg.norm(got - f32) <= 1.25 * np.linalg.norm(plain - f32)


# A compiled dot's operands: the parameters of its fused computation (YNNPACK's GEMM runs as a
# custom fusion) or the operands of a plain ``dot`` (XLA's own loops).
_HEADER = re.compile(r"^\s*%?\S+ \((.*)\) -> \S+ \{$")
_TYPE = re.compile(r": (\w+)\[([\d,]*)\]")


def _matmul_operand_dtypes(hlo: str) -> list[tuple[str, ...]]:
    """The operand element types of every 2-D matmul in a compiled module; ``("generic",)`` for
    a dot left to XLA's own emitter. Batched (attention) dots are left out."""
    out, params = [], []
    for line in hlo.splitlines():
        if (m := _HEADER.match(line)) is not None:
            params = _TYPE.findall(m.group(1))
        if " dot(" not in line or "batch_dims" in line:
            continue
        if line.lstrip().startswith("ROOT") and len(params) == 2:
            out.append(tuple(dtype for dtype, _ in params))
        else:
            out.append(("generic",))
    return out


def _compiled_text(config, backend):
    with attention_backend(backend):
        fn = _grad_fn(config, "bf16", adapted=False)
        return fn.lower(*_inputs(config, "bf16", False)).compile().as_text()


@pytest.mark.slow  # two compiled train steps per case
@pytest.mark.parametrize("model", ["llama", "gpt"])
def test_bf16_backward_dots_run_on_the_bf16_gemm(model):
    got = _matmul_operand_dtypes(_compiled_text(MODELS[model], "cpu"))
    plain = _matmul_operand_dtypes(_compiled_text(MODELS[model], "cuda"))
    # Every layer dot (forward, dx, dw) and the head's dx read bf16 operands on the GEMM. Two
    # do not: the head's weight gradient, outside the layers' scan, is converted to f32 (see
    # effijax.models._dense), and at these tiny widths XLA fuses the head's forward into its
    # consumer and emits its own loop (at SmolLM2's it is a bf16 GEMM).
    assert len(got) == len(plain)
    assert sum(pair == ("bf16", "bf16") for pair in got) == len(got) - 2
    # The plain program converts most backward dots to f32 (or leaves them to XLA's loops).
    assert sum(pair == ("bf16", "bf16") for pair in plain) <= len(plain) // 2


def _module(fn, *args, platform):
    with attention_backend(platform):
        return export.export(jax.jit(fn), platforms=[platform])(*args).mlir_module()


def _program(text: str) -> str:
    """The module without source locations."""
    return re.sub(r"loc\(#loc\d*\)", "", "\n".join(
        line for line in text.splitlines() if not line.startswith("#loc")))


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("transposed", [False, True], ids=["kernel", "tied"])
def test_accelerator_exports_carry_the_plain_dot(platform, transposed):
    x = jax.ShapeDtypeStruct((8, 16), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((32, 16) if transposed else (16, 32), jnp.bfloat16)
    eq = "nd,fd->nf" if transposed else "nd,df->nf"

    def loss(op):
        return jax.grad(lambda x, w: jnp.sum(op(x, w).astype(jnp.float32) ** 2), (0, 1))

    ours = _module(loss(lambda x, w: matmul(x, w, transposed=transposed)), x, w,
                   platform=platform)
    plain = _module(loss(lambda x, w: dot(eq, x, w)), x, w, platform=platform)
    assert _program(ours) == _program(plain)
    assert "optimization_barrier" not in ours
    # The same function traced for the CPU is another program (the test can fail).
    assert cpu_layout(jnp.bfloat16)
    cpu = _module(loss(lambda x, w: matmul(x, w, transposed=transposed)), x, w,
                  platform="cpu")
    assert "optimization_barrier" in cpu
