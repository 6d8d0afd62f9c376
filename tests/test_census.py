"""Tests for effijax.sharding's collective census and memory report.

The census reads the HLO right after XLA's SPMD partitioner. On the 8 forced CPU devices, for a
3-layer MLP whose five parameters are all sharded (``min_shard_size=0``), we pin the plan each
strategy gets (verified on jax 0.10.2; a reduce-scatter appears as all-reduce + dynamic-slice on
CPU and is reported as a reduce-scatter):

* ddp: one all-reduce per parameter gradient, no all-gather;
* zero1: the same all-reduces, plus one all-gather (param dtype) per updated parameter;
* zero2: a reduce-scatter per gradient instead, plus the parameter all-gathers;
* fsdp: one all-gather per parameter in the *compute* dtype (bf16 under the bf16 policy),
  one reduce-scatter per gradient, no parameter-sized all-reduce;
* hybrid data=2 x fsdp=4: gathers over groups of 4, weight gradients reduce-scattered over the
  4 and then all-reduced (shard-sized) over the 2 data replicas.

Gradient reductions run in the dtype of the backward matmul's output: bf16 for a plain bf16
``x @ w``, f32 when the matmul accumulates in f32 (``preferred_element_type``).
"""

import doctest
import math
import os

import jax
import jax.numpy as jnp
import optax
import pytest

from effijax.precision import dynamic_loss_scale
from effijax.sharding import (
    Census,
    _census,
    collective_census,
    constrain_batch,
    constraints,
    init_sharded,
    jit_sharded,
    make_mesh,
    memory_report,
    parse_collectives,
    partition_specs,
    state_shardings,
)
from effijax.step import init_train_state, make_train_step

SHAPES = {"w1": (16, 64), "b1": (64,), "w2": (64, 32), "b2": (32,), "w3": (32, 8)}
N_ELEMENTS = sum(math.prod(s) for s in SHAPES.values())  # 3424
WEIGHTS = ("w1", "w2", "w3")
BATCH = 16


def standard_promotion_optimizer(tx):
    """optax 0.2.8's Adam is not strict-promotion clean (float ** int32 in its bias correction);
    only the optimizer runs under standard promotion, the model stays strict."""

    def init(params):
        with jax.numpy_dtype_promotion("standard"):
            return tx.init(params)

    def update(updates, state, params=None):
        with jax.numpy_dtype_promotion("standard"):
            return tx.update(updates, state, params)

    return optax.GradientTransformation(init, update)


def optimizer():
    return dynamic_loss_scale(standard_promotion_optimizer(optax.adamw(1e-2)))


def init_state(key):
    params = {k: jax.random.normal(jax.random.fold_in(key, i), s) * 0.1
              for i, (k, s) in enumerate(SHAPES.items())}
    return init_train_state(params, optimizer(), key)


def make_loss(f32_accumulation: bool):
    def mm(x, w):
        if f32_accumulation:
            return jnp.einsum("bd,df->bf", x, w, preferred_element_type=jnp.float32).astype(x.dtype)
        return x @ w

    def loss_fn(p, batch, rng):
        h = constrain_batch(jnp.tanh(mm(batch["x"].astype(p["w1"].dtype), p["w1"]) + p["b1"]))
        h = constrain_batch(jnp.tanh(mm(h, p["w2"]) + p["b2"]))
        y = constrain_batch(mm(h, p["w3"]))
        return jnp.mean(jnp.square(y.astype(jnp.float32) - batch["y"]))

    return loss_fn


ABSTRACT_BATCH = {"x": jax.ShapeDtypeStruct((BATCH, 16), jnp.float32),
                  "y": jax.ShapeDtypeStruct((BATCH, 8), jnp.float32)}


def sharded_step(strategy, mesh, policy, f32_accumulation=False):
    abstract = jax.eval_shape(init_state, jax.random.key(0))
    sh = state_shardings(abstract, mesh, strategy, min_shard_size=0)
    cp, cg = constraints(mesh, strategy, partition_specs(abstract.params, mesh, min_shard_size=0))
    step = make_train_step(make_loss(f32_accumulation), optimizer(), policy,
                           constrain_params=cp, constrain_grads=cg)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         abstract, sh)
    return jit_sharded(step, mesh, sh), state


_CACHE = {}


@pytest.fixture(scope="module")
def census():
    """census(strategy, policy, data=1, f32_accumulation=False) -> Census, compiled once."""

    def get(strategy, policy, data=1, f32_accumulation=False):
        key = (strategy, policy, data, f32_accumulation)
        if key not in _CACHE:
            step, state = sharded_step(strategy, make_mesh(data=data), policy, f32_accumulation)
            _CACHE[key] = collective_census(step, state, ABSTRACT_BATCH)
        return _CACHE[key]

    return get


def _param_sized(ops):
    return [c for c in ops if c.shape]  # scalars are loss means, norms and finiteness flags


def _sorted_sizes(ops):
    return sorted(math.prod(c.shape) for c in ops)


PARAM_SIZES = sorted(math.prod(s) for s in SHAPES.values())


def test_fsdp_gathers_weights_in_the_compute_dtype_and_reduce_scatters_gradients(census):
    c = census("fsdp", "bf16")
    gathers = c.of("all-gather")
    assert len(gathers) == len(SHAPES)  # gathered once, kept for the backward pass
    assert {g.dtype for g in gathers} == {"bf16"}
    assert _sorted_sizes(gathers) == PARAM_SIZES
    assert c.bytes("all-gather") == 2 * N_ELEMENTS
    assert all(g.group_size == 8 for g in gathers)
    scatters = c.of("reduce-scatter")
    assert len(scatters) == len(SHAPES) and {s.dtype for s in scatters} == {"bf16"}
    assert _sorted_sizes(scatters) == PARAM_SIZES
    assert {s.lowered_as for s in scatters} == {"all-reduce+dynamic-slice"}
    assert _param_sized(c.of("all-reduce")) == []
    # ring bytes per device: (N-1)/N of the gathered and of the reduced tensors
    assert c.summary()["all-gather"]["wire_bytes"] == pytest.approx(7 / 8 * 2 * N_ELEMENTS)


def test_fsdp_fp32_moves_f32(census):
    c = census("fsdp", "fp32")
    assert {g.dtype for g in c.of("all-gather")} == {"f32"}
    assert c.bytes("all-gather") == 4 * N_ELEMENTS == c.bytes("reduce-scatter")


def test_reduction_dtype_follows_the_backward_matmul_accumulation(census):
    c = census("fsdp", "bf16", f32_accumulation=True)
    forward = [g for g in c.of("all-gather") if "transpose(" not in g.op_name]
    assert _sorted_sizes(forward) == PARAM_SIZES and {g.dtype for g in forward} == {"bf16"}
    # A cost of f32 accumulation found here: the backward's input-gradient matmul multiplies the
    # f32 cotangent by the weight converted to f32, and XLA converts the *shard* and gathers it
    # again in f32 (for w2 and w3; w1's input gradient is not needed).
    backward = [g for g in c.of("all-gather") if "transpose(" in g.op_name]
    assert _sorted_sizes(backward) == sorted(math.prod(SHAPES[w]) for w in ("w2", "w3"))
    assert {g.dtype for g in backward} == {"f32"}
    by_size = {math.prod(s.shape): s.dtype for s in c.of("reduce-scatter")}
    assert {by_size[math.prod(SHAPES[w])] for w in WEIGHTS} == {"f32"}
    # bias gradients are batch sums of the bf16 activations' cotangents
    assert by_size[64] == by_size[32] == "bf16"


def test_ddp_all_reduces_gradients_and_gathers_nothing(census):
    c = census("ddp", "bf16")
    assert c.count("all-gather") == 0 and c.count("reduce-scatter") == 0
    reduces = _param_sized(c.of("all-reduce"))
    assert _sorted_sizes(reduces) == PARAM_SIZES
    assert {r.dtype for r in reduces} == {"bf16"}
    assert sum(r.bytes for r in reduces) == 2 * N_ELEMENTS
    assert all(r.wire_bytes == pytest.approx(2 * 7 / 8 * r.bytes) for r in reduces)


def test_zero1_all_reduces_then_gathers_updated_params_in_param_dtype(census):
    c = census("zero1", "bf16")
    reduces = _param_sized(c.of("all-reduce"))
    assert _sorted_sizes(reduces) == PARAM_SIZES and {r.dtype for r in reduces} == {"bf16"}
    assert c.count("reduce-scatter") == 0
    gathers = c.of("all-gather")
    assert _sorted_sizes(gathers) == PARAM_SIZES and {g.dtype for g in gathers} == {"f32"}
    assert c.bytes("all-gather") == 4 * N_ELEMENTS


def test_zero2_reduce_scatters_then_gathers_updated_params(census):
    c = census("zero2", "bf16")
    assert _param_sized(c.of("all-reduce")) == []
    scatters = c.of("reduce-scatter")
    assert _sorted_sizes(scatters) == PARAM_SIZES and {s.dtype for s in scatters} == {"bf16"}
    gathers = c.of("all-gather")
    assert _sorted_sizes(gathers) == PARAM_SIZES and {g.dtype for g in gathers} == {"f32"}


def test_hybrid_shards_within_fsdp_groups_and_all_reduces_across_data(census):
    c = census("fsdp", "fp32", data=2)
    gathers = c.of("all-gather")
    assert _sorted_sizes(gathers) == PARAM_SIZES and {g.group_size for g in gathers} == {4}
    weight_sizes = sorted(math.prod(SHAPES[w]) for w in WEIGHTS)
    scatters = [s for s in c.of("reduce-scatter") if s.group_size == 4]
    assert _sorted_sizes(scatters) == weight_sizes
    across_data = [r for r in _param_sized(c.of("all-reduce")) if r.group_size == 2]
    assert _sorted_sizes(across_data) == [n // 4 for n in weight_sizes]  # shard-sized


# --------------------------------------------------------------------------------------------
# The parser on hand-written HLO (formats seen after partitioning, and the GPU/TPU forms).
# --------------------------------------------------------------------------------------------

HLO = """
ENTRY %main (p: f32[8,32]) -> f32[8,32] {
  %p = f32[8,32]{1,0} parameter(0)
  %ag = bf16[64,32]{1,0} all-gather(%p), replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}
  %ar = f32[32,64]{1,0} all-reduce(%dot), replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %used = f32[32,64]{1,0} add(%ar, %ar)
  %ar2 = f32[16]{0} all-reduce(%x), replica_groups=[2,4]<=[8], to_apply=%add
  %cv = bf16[16]{0} convert(%ar2)
  %ds = bf16[4]{0} dynamic-slice(%cv, %i), dynamic_slice_sizes={4}
  %rs = bf16[4,8]{1,0} reduce-scatter(%y), replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
  %a2a = f32[8,8]{1,0} all-to-all(%z), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %cp = f32[2,2]{1,0} collective-permute(%w), source_target_pairs={{0,1},{1,0}}
  %t = (f32[4]{0}, f32[2]{0}) all-reduce(%u, %v), replica_groups={}, to_apply=%add
}
"""  # noqa: E501


def test_parse_collectives_formats_and_reduce_scatter_pattern():
    shapes = {"%dot": "f32[32,64]", "%x": "f32[16]", "%y": "bf16[32,8]", "%z": "f32[8,8]",
              "%w": "f32[2,2]", "%u": "f32[4]", "%v": "f32[2]"}
    defs = "".join(f"  {k} = {v}{{0}} parameter(0)\n" for k, v in shapes.items())
    ops = parse_collectives(defs + HLO, num_devices=8)
    got = [(c.kind, c.dtype, c.shape, c.bytes, c.group_size, c.lowered_as) for c in ops]
    assert got == [
        ("all-gather", "bf16", (64, 32), 4096, 4, "all-gather"),
        ("all-reduce", "f32", (32, 64), 8192, 2, "all-reduce"),  # result used whole
        ("reduce-scatter", "f32", (16,), 64, 4, "all-reduce+dynamic-slice"),
        ("reduce-scatter", "bf16", (32, 8), 512, 8, "reduce-scatter"),
        ("all-to-all", "f32", (8, 8), 256, 8, "all-to-all"),
        ("collective-permute", "f32", (2, 2), 16, 8, "collective-permute"),
        ("all-reduce", "f32", (), 24, 8, "all-reduce"),  # a tuple: both operands' bytes
    ]
    assert ops[0].wire_bytes == pytest.approx(3 / 4 * 4096)
    assert ops[1].wire_bytes == pytest.approx(8192.0)  # 2 (g-1)/g with g = 2
    assert ops[5].wire_bytes == 16
    census = Census(ops=ops)
    assert census.count("reduce-scatter") == 2 and census.count("all-reduce", min_bytes=100) == 1
    assert census.summary()["reduce-scatter"]["dtypes"] == ["bf16", "f32"]
    with pytest.raises(ValueError, match="kind must be one of"):
        census.of("allgather")


def test_single_device_program_has_no_collectives():
    c = collective_census(lambda x: x * 2.0, jnp.ones(4))
    assert c.ops == () and c.summary() == {}


# --------------------------------------------------------------------------------------------
# Memory report.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy, params_n", [("fsdp", 8), ("zero2", 1)])
def test_memory_report_per_device_bytes(strategy, params_n):
    mesh = make_mesh()
    state, sh = init_sharded(init_state, jax.random.key(0), mesh=mesh, strategy=strategy,
                             min_shard_size=0)
    step, abstract = sharded_step(strategy, mesh, "fp32")
    compiled = step.lower(state, ABSTRACT_BATCH).compile()
    # zero2 and fsdp keep gradients sharded like the optimizer's first moment
    r = memory_report(compiled, state, grad_shardings=sh.opt_state.inner_state[0].mu)
    total = 4 * N_ELEMENTS
    scalars = 4 * 5 + 1  # Adam's count, the loss scale's 4 int/f32 scalars and 1 bool
    assert r.params * params_n == total
    assert r.grads * 8 == total
    assert r.opt_state == 2 * total // 8 + scalars
    assert r.other_state == 4 + 8  # step (int32) and the threefry key
    batch_shard = 4 * (16 + 8) * BATCH // 8
    assert abs(r.arguments - (r.params + r.opt_state + r.other_state + batch_shard)) <= 8
    assert r.aliased >= r.params + r.opt_state - 8  # the donated state is reused
    assert "params" in str(r)
    # the same numbers from the abstract state (shapes + shardings, no arrays)
    a = memory_report(compiled, abstract)
    assert (a.params, a.opt_state, a.other_state, a.grads) == (
        r.params, r.opt_state, r.other_state, None)


def test_docstring_examples():
    result = doctest.testmod(_census)
    assert result.failed == 0 and result.attempted > 0


def test_the_census_is_not_emptied_by_a_persistent_compilation_cache(tmp_path):
    """With JAX's persistent cache on, the first process finds the program already cached (by
    a plain compilation): the census still compiles it (XLA must run to dump the partitioned
    module), finds its gather and keeps the module beside the cache; a second process reads
    the kept module instead of compiling again (a doctored one shows it is what is read)."""
    import pathlib
    import subprocess
    import sys

    code = f"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", {str(tmp_path)!r})
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from jax.sharding import NamedSharding, PartitionSpec as P
from effijax.sharding import collective_census, make_mesh
mesh = make_mesh()
f = jax.jit(lambda w: w @ w.T, in_shardings=NamedSharding(mesh, P("fsdp")),
            out_shardings=NamedSharding(mesh, P()))
x = jax.ShapeDtypeStruct((64, 4), jnp.float32)
f.lower(x).compile()  # the cached copy, as a run's jit would leave it
print(collective_census(f, x).count("all-gather"))
"""
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}

    def count() -> int:
        return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  check=True, cwd=root, env=env).stdout.split()[-1])

    first, second = count(), count()
    assert any(tmp_path.glob("jit_*-cache")), "the persistent cache was not written"
    assert first == second >= 1
    kept = list((tmp_path / "effijax-census").iterdir())
    assert len(kept) == 1 and "all-gather" in kept[0].read_text()
    kept[0].write_text("HloModule doctored\n")
    assert count() == 0
