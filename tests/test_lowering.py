"""Accelerator lowering without an accelerator: the sharded train step of every strategy,
precision and model family, exported for cuda and tpu on the 8 forced CPU devices.

``jax.export.export(step, platforms=...)`` traces and lowers the step the recipe builds
(:func:`~effijax.recipe.plan_job`) to StableHLO without compiling it, so a program a GPU or TPU
could not lower fails here. The strategy x precision x family matrix lowers once for both
platforms (``platforms=["cuda", "tpu"]``: every primitive through each platform's rule); LoRA
and attention lower for one platform at a time. What the module must say is asserted, not just
that it exists: the platforms and device count; the state's shardings on the way in and out;
where the strategy pins gradients and gathered weights (the sharding constraints XLA's
partitioner turns into an all-reduce, a reduce-scatter or an all-gather when it compiles for
the device; the collectives only exist after that compilation, which needs the device); the
parameters' dtype and the matmuls' half precision; the loss scale's per-gradient finiteness
check. A family registered in :data:`~effijax.models.FAMILIES` joins the matrix with its
smallest preset.

Attention picks its implementation by the backend when it is traced; exports run under
:func:`~effijax.models.attention_backend` so that a cuda module carries the GPU's choice.
cuDNN's fused kernel is the one thing that cannot be traced without it (jax asks the installed
cuDNN for its version while tracing): a test asserts that error.
"""

import dataclasses
import importlib.util
import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax import export

from effijax.lora import LoraSpec
from effijax.models import FAMILIES, AttentionFallbackWarning, attention_backend
from effijax.optimizers import make_optimizer
from effijax.precision import PRESETS as PRECISIONS
from effijax.recipe import abstract_batch, plan_job
from effijax.sharding import STRATEGIES, make_mesh

PLATFORMS = ("cuda", "tpu")
SEQ, BATCH = 16, 8
# Two of the family x strategy x precision combinations stay in the fast tier; the rest is slow.
FAST = {("gpt", "fsdp", "bf16"), ("llama", "zero2", "fp16")}
# MLIR element types of the policies' dtypes.
ELEMENT = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.bfloat16): "bf16",
           jnp.dtype(jnp.float16): "f16"}

_CONSTRAINT = re.compile(r"sdy\.sharding_constraint %\S+ <@mesh, \[(.*?)\]> : "
                         r"tensor<(?:[\dx]*x)?(\w+)>")
_DOT = re.compile(r"stablehlo\.dot_general .*: \(tensor<(?:[\dx]*x)?(\w+)>, "
                  r"tensor<(?:[\dx]*x)?(\w+)>\)")
# is_finite on an array (not a scalar): the loss scale's check of every gradient.
_ARRAY_IS_FINITE = re.compile(r"stablehlo\.is_finite %\S+ : \(tensor<\d")
# Location entries name the source file of each op; the paths of the attention kernels.
_BLOCKWISE_SOURCE = "effijax/models/_blockwise.py"
_LOCATION = re.compile(r"#loc\d+")


def _tiny(family: str, **fields):
    """The family's smallest preset on SEQ-token windows, with ``fields`` replaced."""
    model = min(FAMILIES[family].presets.values(), key=lambda m: m.shape().num_params)
    return dataclasses.replace(model.with_seq_len(SEQ), **fields)


def _optimizer(precision: str):
    """The recipe's optimizer (AdamW, clipping, a schedule) with dynamic loss scaling where
    the policy needs it."""
    scale = "dynamic" if PRECISIONS[precision].needs_loss_scaling else None
    return make_optimizer(1e-3, 10, loss_scale=scale)


def _plan(mesh, family, strategy, precision, *, lora=None, segmented=False, **fields):
    """The recipe's job (abstract: nothing traced yet) for the family's tiny model."""
    return plan_job(_tiny(family, **fields), precision, _optimizer(precision),
                    batch_size=BATCH, mesh=mesh, strategy=strategy, lora=lora,
                    masked=segmented, segmented=segmented)


def _export(job, *platforms: str, backend: str | None = None) -> export.Exported:
    """``jax.export`` of the job's step for ``platforms``, traced with ``backend``'s attention
    choice (default: the first platform's; a GPU's fallback warns once per reason, and the
    tests check the module instead)."""
    with attention_backend(backend or platforms[0]), jax.set_mesh(job.mesh), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", AttentionFallbackWarning)
        return export.export(job.step.jitted, platforms=platforms)(job.state,
                                                                   abstract_batch(job))


@pytest.fixture(scope="module")
def mesh():
    return make_mesh()


def _matrix():
    for family in sorted(FAMILIES):
        for strategy in STRATEGIES:
            for precision in PRECISIONS:
                key = (family, strategy, precision)
                yield pytest.param(*key, id="-".join(key),
                                   marks=() if key in FAST else (pytest.mark.slow,))


# The sharding of an input the step never reads (jax leaves it out of the module: e.g. the
# learning rate inject_hyperparams stores, which the schedule recomputes from the count).
UNUSED = "unused"


def _shardings(exp, mesh, which: str):
    """The exported module's shardings as ``((state, batch), kwargs)`` ("in") or ``(state,
    metrics)`` ("out"), :data:`UNUSED` for an input left out of the module."""
    tree, flat = ((exp.in_tree, exp.in_shardings_jax(mesh)) if which == "in"
                  else (exp.out_tree, exp.out_shardings_jax(mesh)))
    return jax.tree.unflatten(tree, [UNUSED if s is None else s for s in flat])


def _sharded(tree) -> bool:
    return any(s != UNUSED and not s.is_fully_replicated for s in jax.tree.leaves(tree))


def _same_layout(exported_tree, abstract_tree) -> bool:
    """Every leaf of the module has the sharding its abstract value carries."""
    return all(jax.tree.leaves(jax.tree.map(
        lambda got, want: got == UNUSED or got.is_equivalent_to(want.sharding, len(want.shape)),
        exported_tree, abstract_tree)))


def _facts(exp, mesh) -> dict:
    """What an exported train step says about its strategy and precision."""
    text = exp.mlir_module()
    (state_in, _), _ = _shardings(exp, mesh, "in")
    (avals_in, _), _ = jax.tree.unflatten(exp.in_tree, exp.in_avals)
    dots = {dtype for pair in _DOT.findall(text) for dtype in pair}
    return {
        "parameter dtypes": sorted({ELEMENT[x.dtype] for x in jax.tree.leaves(avals_in.params)}),
        "parameters sharded": _sharded(state_in.params),
        "optimizer state sharded": _sharded(state_in.opt_state),
        # Values pinned to the parameters' shards, by element type. ("data", "fsdp") is the
        # batch's layout, not this.
        "pinned to shards": sorted({dtype for dims, dtype in _CONSTRAINT.findall(text)
                                    if '{"fsdp"}' in dims}),
        "half-precision matmuls": sorted(dots & {"bf16", "f16"}),
        "every gradient checked for inf/nan": bool(_ARRAY_IS_FINITE.search(text)),
    }


def _expected(strategy: str, precision: str) -> dict:
    """:func:`_facts` of a correct step: the strategy table (effijax.sharding) and the policy."""
    plan, policy = STRATEGIES[strategy], PRECISIONS[precision]
    param, compute = (ELEMENT[jnp.dtype(d)] for d in (policy.param_dtype, policy.compute_dtype))
    # zero2/fsdp pin the gradients (param dtype) to the shards: a reduce-scatter, where
    # ddp/zero1 all-reduce them; FSDP pins the weights right after the cast to the compute
    # dtype, so its all-gather moves compute-dtype bytes.
    pinned = set()
    if plan.shard_grads:
        pinned.add(param)
    if plan.shard_params:
        pinned.add(compute)
    return {
        "parameter dtypes": [param],
        "parameters sharded": plan.shard_params,
        "optimizer state sharded": plan.shard_opt_state,
        "pinned to shards": sorted(pinned),
        "half-precision matmuls": [] if compute == "f32" else [compute],
        # Dynamic loss scaling checks each gradient; otherwise only the scalar norm is checked
        # (the grads_finite metric).
        "every gradient checked for inf/nan": policy.needs_loss_scaling,
    }


@pytest.mark.parametrize(("family", "strategy", "precision"), list(_matrix()))
def test_sharded_step_lowers(mesh, family, strategy, precision):
    # One lowering for both accelerators: each primitive is lowered by each platform's rule
    # (a rule missing or failing on either fails the export), at the cost of one lowering.
    # The models run naive attention here, the same program on every backend (the
    # backend-dependent choices of the Llama family's default "auto" are the attention tests'
    # below; cuDNN's kernel cannot be traced without cuDNN).
    job = _plan(mesh, family, strategy, precision, attention="naive")
    exp = _export(job, *PLATFORMS)
    assert exp.platforms == PLATFORMS and exp.nr_devices == mesh.size == 8
    assert _facts(exp, mesh) == _expected(strategy, precision)
    # The state keeps its layout through the step (ZeRO-1/2 all-gather the new parameters
    # back to replicated; FSDP keeps them sharded).
    (state_in, _), _ = _shardings(exp, mesh, "in")
    state_out, _ = _shardings(exp, mesh, "out")
    assert UNUSED not in jax.tree.leaves(state_out)
    assert _same_layout(state_in, job.state) and _same_layout(state_out, job.state)


@pytest.mark.parametrize("platform", ["cuda", pytest.param("tpu", marks=pytest.mark.slow)])
def test_lora_step_lowers_with_the_frozen_base_as_an_input(mesh, platform):
    targets = FAMILIES["llama"].lora_targets  # the family's default: every block kernel
    job = _plan(mesh, "llama", "fsdp", "bf16", lora=LoraSpec(rank=4, targets=targets),
                attention="naive")  # "auto" would pick cuDNN's kernel: not traceable here
    exp = _export(job, platform)
    assert exp.platforms == (platform,)
    (state_in, batch_in), _ = jax.tree.unflatten(exp.in_tree, exp.in_avals)
    (_, batch_sh), _ = _shardings(exp, mesh, "in")
    # The base comes in with every batch, in the compute dtype, laid out like FSDP parameters.
    assert jax.tree.structure(batch_in["base"]) == jax.tree.structure(job.frozen)
    assert {x.dtype for x in jax.tree.leaves(batch_in["base"])} == {jnp.dtype(jnp.bfloat16)}
    assert _sharded(batch_sh["base"]) and _same_layout(batch_sh["base"], job.frozen)
    # Only the adapters are trained: the new state holds adapters, never a base kernel.
    state_out, _metrics = jax.tree.unflatten(exp.out_tree, exp.out_avals)
    base_shapes = {x.shape for x in jax.tree.leaves(job.frozen) if x.ndim >= 2}
    out_shapes = {x.shape for x in jax.tree.leaves(state_out.params)}
    assert out_shapes and not out_shapes & base_shapes
    assert jax.tree.structure(state_out.params) == jax.tree.structure(job.state.params)
    assert jax.tree.structure(state_in.params) == jax.tree.structure(job.state.params)


# ``attention="auto"`` on each platform, and the implementation named explicitly that must give
# the same program: a GPU without cuDNN's kernel (f32; packed rows, whose segment ids cuDNN's
# kernel here does not take) falls back to XLA's attention, a TPU runs the blockwise kernel.
AUTO_CHOICES = [
    pytest.param("cuda", "fp32", False, "xla", id="cuda-fp32"),
    pytest.param("cuda", "bf16", True, "xla", id="cuda-bf16-packed", marks=pytest.mark.slow),
    pytest.param("tpu", "bf16", False, "blockwise", id="tpu-bf16", marks=pytest.mark.slow),
]


def _attention_module(mesh, platform, precision, segmented, attention, *, backend):
    job = _plan(mesh, "gpt", "ddp", precision, segmented=segmented, attention=attention)
    return _export(job, platform, backend=backend).mlir_module()


def _program(text: str) -> str:
    """The module without its source locations (line numbers of the callers differ)."""
    return _LOCATION.sub("#loc", "\n".join(line for line in text.splitlines()
                                       if not line.startswith("#loc")))


@pytest.mark.parametrize(("platform", "precision", "segmented", "same_as"), AUTO_CHOICES)
def test_auto_attention_exports_the_target_platforms_choice(mesh, platform, precision,
                                                            segmented, same_as):
    auto = _attention_module(mesh, platform, precision, segmented, "auto", backend=platform)
    # The same program as the implementation "auto" picks on that platform, named explicitly
    # (traced for the platform too: the models' 16-bit matmuls take another backward on the
    # CPU, effijax.models._dense).
    named = _attention_module(mesh, platform, precision, segmented, same_as, backend=platform)
    assert _program(auto) == _program(named), f"'auto' on {platform} is not {same_as!r}"
    # Traced for this CPU's choice instead, "auto" would be the blockwise kernel everywhere.
    assert (_BLOCKWISE_SOURCE in auto) == (same_as == "blockwise")


# jax finds cuDNN through its CUDA plugin (jax._src.lib.cuda_versions); with it, the fused
# kernel traces on any host, and its lowering is the device run's to check.
CUDNN_INSTALLED = any(importlib.util.find_spec(name) is not None
                      for name in ("jax_cuda13_plugin", "jax_cuda12_plugin"))


@pytest.mark.skipif(CUDNN_INSTALLED, reason="jax's CUDA plugin (cuDNN) is installed here")
@pytest.mark.parametrize("attention", ["auto", "xla", "blockwise"])
def test_cudnn_attention_needs_the_device_to_trace(mesh, attention):
    """bf16 attention on a GPU is cuDNN's fused kernel (``jax.nn.dot_product_attention(...,
    implementation="cudnn")``); jax checks the installed cuDNN's version while tracing it, so
    on a host without cuDNN the cuda export stops there. If this starts passing, jax traces
    cuDNN attention without the device: assert the module instead."""
    job = _plan(mesh, "gpt", "ddp", "bf16", attention=attention)
    with pytest.raises(RuntimeError, match="cuDNN is not detected"):
        _export(job, "cuda")
