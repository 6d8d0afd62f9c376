"""LoRA under FSDP on the 8 CPU devices reproduces the single-device run.

A tiny GPT with rank-4 adapters on attention q, v and the MLP (fc_in, fc_out). The frozen base
travels in the batch dict (``effijax.lora.freeze_base``), laid out as the fsdp strategy lays out
parameters (``param_shardings``); each adapter's sharding is derived from its base kernel's
(:func:`effijax.lora.adapter_rules`), and the adapters' optimizer state follows them
(``state_shardings``).
Four steps of adapter-only training with ``make_optimizer(..., loss_scale="dynamic")``.

Tolerance: fp32 losses and final adapters match the single-device run within rtol 1e-5, atol
1e-6 (test_sharding's tolerance). Sharding reorders the batch reductions (per-device partial
sums, then a cross-device sum), so bitwise equality is not expected; Adam divides by the root of
small second moments, which amplifies the last-bit differences of the gradients (measured: the
losses agree to 1e-7 relative; the worst adapter entry is off by 7e-7 absolute, 4e-5
relative, so rtol alone would not hold).
The bf16-base variant is checked loosely against the fp32 run (bf16 rounding).
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from effijax import lora
from effijax.data import batch_at, load_corpus
from effijax.models import abstract_params, abstract_split, gpt_config, init_params, make_loss_fn
from effijax.paths import named_leaves
from effijax.sharding import (
    assert_sharded_like_params,
    batch_sharding,
    check_batch,
    constraints,
    init_sharded,
    jit_sharded,
    make_mesh,
    param_shardings,
    partition_specs,
)
from effijax.step import init_train_state, make_optimizer, make_train_step

TINY = gpt_config("tiny", seq_len=32)  # d=64, F=256, L=2
SPEC = lora.LoraSpec(rank=4, alpha=8.0, targets=r"attn/(q|v)/kernel|mlp/fc_(in|out)/kernel")
N_STEPS, BATCH = 4, 8
RTOL, ATOL = 1e-5, 1e-6
# These tests check numbers, not speed: LLVM optimisation level 0 compiles 2-3x faster on CPU.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _batches():
    tokens = load_corpus(max_bytes=200_000)
    return [batch_at(tokens, seed=0, step=i, batch_size=BATCH, seq_len=TINY.seq_len)
            for i in range(N_STEPS)]


def _loss_fn():
    graphdef, _ = abstract_split(TINY)
    return lora.freeze_base(make_loss_fn(graphdef, lora=SPEC))


def _init_fn(tx):
    abstract_base = abstract_params(TINY)  # lora.init reads shapes only
    return lambda key: init_train_state(lora.init(key, abstract_base, SPEC), tx, key)


def _run_single(base, policy):
    tx = make_optimizer(1e-2, 100, loss_scale="dynamic")
    step = jax.jit(make_train_step(_loss_fn(), tx, policy, has_aux=True), donate_argnums=0,
                   compiler_options=FAST_COMPILE)
    state = jax.jit(_init_fn(tx))(jax.random.key(1))
    initial = jax.tree.map(np.asarray, state.params)
    metrics = []
    for b in _batches():
        state, m = step(state, {**b, "base": base})
        metrics.append(jax.device_get(m))
    return initial, state, metrics


def _run_fsdp(base, policy):
    mesh = make_mesh()  # fsdp = 8
    tx = make_optimizer(1e-2, 100, loss_scale="dynamic")
    base_sh = param_shardings(base, mesh, "fsdp")
    base = jax.device_put(base, base_sh)
    init = _init_fn(tx)
    rules = lora.adapter_rules(base_sh, jax.eval_shape(init, jax.random.key(1)).params)
    state, state_sh = init_sharded(init, jax.random.key(1), mesh=mesh, strategy="fsdp",
                                   rules=rules)
    initial = jax.tree.map(np.asarray, state.params)
    cp, cg = constraints(mesh, "fsdp", partition_specs(state.params, mesh, rules=rules))
    step = jit_sharded(
        make_train_step(_loss_fn(), tx, policy, has_aux=True, constrain_params=cp,
                        constrain_grads=cg),
        mesh, state_sh,
        batch={"inputs": batch_sharding(mesh), "targets": batch_sharding(mesh), "base": base_sh},
    )
    frozen = jax.tree.map(np.array, base)
    batches = []
    for b in _batches():
        check_batch(b, mesh)  # the token rows split over the 8 devices (the base is not batched)
        batches.append({**b, "base": base})
    compiled = step.lower(state, batches[0]).compile(FAST_COMPILE)
    metrics = []
    for b in batches:
        with jax.set_mesh(mesh):  # what ShardedStep does around each call
            state, m = compiled(state, b)
        metrics.append(jax.device_get(m))
    return dict(initial=initial, state=state, metrics=metrics, shardings=state_sh, base=base,
                base_sh=base_sh, frozen=frozen)


@pytest.fixture(scope="module")
def base():
    return init_params(TINY, None, jax.random.key(0))


@pytest.fixture(scope="module")
def single(base):
    return _run_single(base, "fp32")


@pytest.fixture(scope="module")
def fsdp(base):
    return _run_fsdp(base, "fp32")


def test_adapter_shardings_are_derived_from_their_base_kernels(fsdp):
    specs = {path: s.spec for path, s in named_leaves(
        fsdp["shardings"].params, is_leaf=lambda x: isinstance(x, NamedSharding))}
    kernels = {path: s.spec for path, s in named_leaves(
        fsdp["base_sh"], is_leaf=lambda x: isinstance(x, NamedSharding))}
    # The fsdp strategy's automatic rule splits each kernel along its largest divisible dim.
    assert kernels["blocks/attn/q/kernel"] == P(None, "fsdp")  # (2, 64, 64): d_in on a tie
    assert kernels["blocks/mlp/fc_in/kernel"] == P(None, None, "fsdp")  # (2, 64, 256): d_out
    assert kernels["blocks/mlp/fc_out/kernel"] == P(None, "fsdp")  # (2, 256, 64): d_in
    replicated = P(None, None, None)
    assert specs == {
        "blocks/attn/q/kernel/a": P(None, "fsdp", None), "blocks/attn/q/kernel/b": replicated,
        "blocks/attn/v/kernel/a": P(None, "fsdp", None), "blocks/attn/v/kernel/b": replicated,
        "blocks/mlp/fc_in/kernel/a": replicated, "blocks/mlp/fc_in/kernel/b": P(None, None,
                                                                                 "fsdp"),
        "blocks/mlp/fc_out/kernel/a": P(None, "fsdp", None), "blocks/mlp/fc_out/kernel/b":
            replicated,
    }
    # Adam's moments follow the adapters; the state kept every layout across the steps.
    assert_sharded_like_params(fsdp["state"], fsdp["shardings"])
    a = fsdp["state"].params["blocks"]["attn"]["q"]["kernel"]["a"]
    assert a.addressable_shards[0].data.shape == (2, 8, 4)
    emb = fsdp["base"]["embed"]["embedding"]
    assert emb.addressable_shards[0].data.shape == (32, 64)  # the base really is sharded


def test_fsdp_lora_matches_single_device(single, fsdp):
    initial, state, metrics = single
    # Born sharded, the adapters start bitwise equal to the single-device init.
    jax.tree.map(np.testing.assert_array_equal, fsdp["initial"], initial)
    losses = np.array([m["loss"] for m in metrics])
    np.testing.assert_allclose([m["loss"] for m in fsdp["metrics"]], losses, rtol=RTOL)
    assert [float(m["loss_scale"]) for m in fsdp["metrics"]] == [
        float(m["loss_scale"]) for m in metrics]
    assert not any(bool(m["skipped"]) for m in metrics + fsdp["metrics"])
    assert losses[-1] < losses[0]  # the adapters learned something in 4 steps
    final = jax.tree.map(np.asarray, fsdp["state"].params)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=RTOL, atol=ATOL),
                 final, jax.tree.map(np.asarray, state.params))
    b = final["blocks"]["attn"]["q"]["kernel"]["b"]
    assert float(np.max(np.abs(b))) > 1e-3  # b moved off zero: the comparison is not vacuous


def test_frozen_base_is_bitwise_unchanged_and_keeps_its_shardings(fsdp):
    for (path, leaf), (_, before), (_, sharding) in zip(
            named_leaves(fsdp["base"]), named_leaves(fsdp["frozen"]),
            named_leaves(fsdp["base_sh"], is_leaf=lambda x: isinstance(x, NamedSharding)),
            strict=True):
        assert not leaf.is_deleted(), path  # the base is an input, never donated
        np.testing.assert_array_equal(np.asarray(leaf).view(np.uint32),
                                      before.view(np.uint32), err_msg=path)
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), path


def test_bf16_frozen_base_runs_under_fsdp(base, fsdp):
    base16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), base)
    run = _run_fsdp(base16, "bf16")
    losses = np.array([m["loss"] for m in run["metrics"]])
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    # bf16 rounding of the base and of the compute: close to the fp32 run, not equal.
    np.testing.assert_allclose(losses, [m["loss"] for m in fsdp["metrics"]], rtol=2e-2)
    assert {x.dtype for x in jax.tree.leaves(run["base"])} == {np.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(run["state"].params)} == {np.dtype(jnp.float32)}
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), y), run["base"],
                 run["frozen"])
    assert_sharded_like_params(run["state"], run["shardings"])
