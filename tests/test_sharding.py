"""Tests for effijax.sharding: meshes, strategies, partition rules, born-sharded init, the guard.

All on the 8 CPU devices forced by conftest. The model is a hand-written 3-layer MLP regression
(no dependency on effijax.models), trained with ``dynamic_loss_scale(adamw)``; every strategy
(ddp, zero1, zero2, fsdp, and hybrid data=2 x fsdp=4) must reproduce the single-device run,
including a step whose batch holds an inf and is skipped. Compiled steps are built once per
module (compile time dominates on small CPUs).
"""

import doctest
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from effijax.errors import ConfigError
from effijax.paths import named_leaves
from effijax.precision import dynamic_loss_scale, skipped_steps_of
from effijax.sharding import (
    ReplicatedParameterWarning,
    _mesh,
    _rules,
    _strategy,
    assert_sharded_like_params,
    batch_sharding,
    check_batch,
    constrain_batch,
    constraints,
    get_strategy,
    init_sharded,
    jit_sharded,
    make_mesh,
    param_shardings,
    parse_mesh,
    partition_specs,
    state_shardings,
)
from effijax.step import init_train_state, make_train_step

N_STEPS = 5
BAD_STEP = 2  # this step's batch holds an inf: the update must be skipped
# fp32 equivalence with the single-device run. Sharding changes the order of the batch
# reductions (per-shard partial sums, then a cross-device sum), so bitwise equality is not
# guaranteed; the tolerance is the one the brief states.
RTOL, ATOL = 1e-5, 1e-6


def standard_promotion_optimizer(tx: optax.GradientTransformation):
    """Runs ``tx`` under standard dtype promotion: a commented exception to the strict default.

    optax 0.2.8's Adam computes ``decay ** count`` (Python float ** int32), which strict
    promotion rejects. Only the optimizer is exempt: the model and effijax's own code stay strict.
    """

    def init(params):
        with jax.numpy_dtype_promotion("standard"):
            return tx.init(params)

    def update(updates, state, params=None):
        with jax.numpy_dtype_promotion("standard"):
            return tx.update(updates, state, params)

    return optax.GradientTransformation(init, update)


def make_optimizer():
    return dynamic_loss_scale(standard_promotion_optimizer(optax.adamw(3e-2, weight_decay=0.1)))


def init_params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "w1": jax.random.normal(k1, (16, 64), jnp.float32) / 4.0,
        "b1": jnp.zeros((64,), jnp.float32),
        "w2": jax.random.normal(k2, (64, 32), jnp.float32) / 8.0,
        "b2": jnp.zeros((32,), jnp.float32),
        "w3": jax.random.normal(k3, (32, 8), jnp.float32) / 6.0,
    }


def loss_fn(p, batch, rng):
    del rng
    dt = p["w1"].dtype
    h = constrain_batch(jnp.tanh(batch["x"].astype(dt) @ p["w1"] + p["b1"]))
    h = constrain_batch(jnp.tanh(h @ p["w2"] + p["b2"]))
    y = constrain_batch(h @ p["w3"])
    return jnp.mean(jnp.square(y.astype(jnp.float32) - batch["y"]))


def make_batches(n=N_STEPS, batch=16):
    rng = np.random.default_rng(0)
    w_true = rng.normal(size=(16, 8)).astype(np.float32)
    out = []
    for i in range(n):
        x = rng.normal(size=(batch, 16)).astype(np.float32)
        y = np.tanh(x @ w_true).astype(np.float32)
        if i == BAD_STEP:
            x[3, 5] = np.inf
        out.append({"x": x, "y": y})
    return out


def init_state(key):
    return init_train_state(init_params(key), make_optimizer(), key)


def run_reference():
    step = jax.jit(make_train_step(loss_fn, make_optimizer(), "fp32"))
    state = jax.jit(init_state)(jax.random.key(0))
    metrics = []
    for b in make_batches():
        state, m = step(state, b)
        metrics.append(m)
    return state, metrics


def build_sharded(strategy, mesh, *, min_shard_size=0, policy="fp32", rules=None):
    """init_sharded + constraints + make_train_step + jit_sharded: the composition train.py
    will provide (the sharding package sits below effijax.step, so it cannot import it)."""
    kw = {"rules": rules, "min_shard_size": min_shard_size}
    state, sh = init_sharded(init_state, jax.random.key(0), mesh=mesh, strategy=strategy, **kw)
    cp, cg = constraints(mesh, strategy, partition_specs(state.params, mesh, **kw))
    step = make_train_step(loss_fn, make_optimizer(), policy, constrain_params=cp,
                           constrain_grads=cg)
    return state, sh, jit_sharded(step, mesh, sh)


CONFIGS = {
    "ddp": ("ddp", {}),
    "zero1": ("zero1", {}),
    "zero2": ("zero2", {}),
    "fsdp": ("fsdp", {}),
    "hybrid-fsdp": ("fsdp", {"data": 2}),
}


@pytest.fixture(scope="module")
def reference():
    return run_reference()


@pytest.fixture(scope="module")
def runs():
    """Per config: (initial per-device bytes, shardings, final state, metrics)."""
    out = {}
    for name, (strategy, mesh_kw) in CONFIGS.items():
        mesh = make_mesh(**mesh_kw)
        state, sh, step = build_sharded(strategy, mesh)
        init_bytes = {path: (leaf.addressable_shards[0].data.nbytes, leaf.nbytes)
                      for path, leaf in named_leaves(state) if hasattr(leaf, "nbytes")}
        metrics = []
        for b in make_batches():
            check_batch(b, mesh)
            state, m = step(state, b)
            metrics.append(m)
        out[name] = (mesh, init_bytes, sh, state, metrics)
    return out


# --------------------------------------------------------------------------------------------
# Equivalence with the single-device run.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS))
def test_strategy_matches_single_device(config, runs, reference):
    ref_state, ref_metrics = reference
    _, _, _, state, metrics = runs[config]
    for i, (m, r) in enumerate(zip(metrics, ref_metrics, strict=True)):
        assert bool(m["skipped"]) == (i == BAD_STEP), f"step {i}"
        if i != BAD_STEP:
            np.testing.assert_allclose(m["loss"], r["loss"], rtol=RTOL, atol=ATOL)
    assert int(skipped_steps_of(state.opt_state)) == 1
    assert int(state.step) == N_STEPS
    chex.assert_trees_all_close(jax.device_get(state.params), jax.device_get(ref_state.params),
                                rtol=RTOL, atol=ATOL)
    chex.assert_trees_all_close(jax.device_get(state.opt_state),
                                jax.device_get(ref_state.opt_state), rtol=RTOL, atol=ATOL)


def test_strategies_on_one_mesh_agree_bitwise(runs):
    # The strategy changes only where state lives and which collectives run, not the arithmetic:
    # on the same 8-device mesh all four produce identical bits (verified on jax 0.10.2, CPU).
    base = runs["ddp"][3]
    for name in ("zero1", "zero2", "fsdp"):
        state = runs[name][3]
        chex.assert_trees_all_equal(jax.device_get(state.params), jax.device_get(base.params))
        chex.assert_trees_all_equal(jax.device_get(state.opt_state),
                                    jax.device_get(base.opt_state))


def test_reference_run_learns_and_skips_the_bad_step(reference):
    state, metrics = reference
    losses = [float(m["loss"]) for i, m in enumerate(metrics) if i != BAD_STEP]
    assert losses[-1] < losses[0]
    # tanh saturates the inf in the forward pass; its gradient (inf * 0) is NaN.
    assert not bool(metrics[BAD_STEP]["grads_finite"]) and bool(metrics[BAD_STEP]["skipped"])
    assert not math.isfinite(float(metrics[BAD_STEP]["grad_norm"]))
    assert float(metrics[BAD_STEP + 1]["loss_scale"]) == 0.5 * float(metrics[0]["loss_scale"])
    assert int(state.opt_state.inner_state[0].count) == N_STEPS - 1  # Adam skipped one step


@pytest.mark.parametrize("config", list(CONFIGS))
def test_state_keeps_its_shardings_across_steps(config, runs):
    _, _, sh, state, _ = runs[config]
    assert_sharded_like_params(state, sh)
    for (path, leaf), (_, s) in zip(named_leaves(state), named_leaves(sh), strict=True):
        assert leaf.sharding.is_equivalent_to(s, leaf.ndim), path


# --------------------------------------------------------------------------------------------
# Per-device bytes: total / N exactly for the sharded groups.
# --------------------------------------------------------------------------------------------


def _group_bytes(init_bytes, prefix, *, param_shaped_only=False, param_shapes=()):
    per_device = total = 0
    for path, (dev, tot) in init_bytes.items():
        if not path.startswith(prefix + "/"):
            continue
        if param_shaped_only and not any(path.endswith("/" + p) for p in param_shapes):
            continue
        per_device += dev
        total += tot
    return per_device, total


@pytest.mark.parametrize(
    "config, n_params, n_opt",
    [("ddp", 1, 1), ("zero1", 1, 8), ("zero2", 1, 8), ("fsdp", 8, 8), ("hybrid-fsdp", 4, 4)],
)
def test_per_device_bytes_are_total_over_n(config, n_params, n_opt, runs):
    _, init_bytes, _, _, _ = runs[config]
    names = ["w1", "b1", "w2", "b2", "w3"]
    dev, total = _group_bytes(init_bytes, "params")
    assert total == 4 * (16 * 64 + 64 + 64 * 32 + 32 + 32 * 8)
    assert dev * n_params == total
    # Adam's mu and nu, the parameter-shaped optimizer leaves (count and loss scale are scalars).
    dev, total = _group_bytes(init_bytes, "opt_state", param_shaped_only=True,
                              param_shapes=names)
    assert total == 2 * 4 * (16 * 64 + 64 + 64 * 32 + 32 + 32 * 8)
    assert dev * n_opt == total


def test_every_leaf_has_an_explicit_mesh_sharding(runs):
    mesh, _, sh, state, _ = runs["fsdp"]
    for path, s in named_leaves(sh):
        assert isinstance(s, NamedSharding) and s.mesh == mesh, path
    assert sh.step.spec == P() and sh.rng.spec == P()
    assert sh.params["w2"].spec == P("fsdp")  # (64, 32): the largest divisible dimension
    inner = sh.opt_state.inner_state
    assert inner[0].count.spec == P() and sh.opt_state.scale.spec == P()
    assert inner[0].mu["w1"].spec == P(None, "fsdp") and inner[0].nu["b1"].spec == P("fsdp")


# --------------------------------------------------------------------------------------------
# The guard: a replicated optimizer state is caught and named.
# --------------------------------------------------------------------------------------------


def test_guard_catches_replicated_optimizer_state_from_plain_jit_init(runs):
    mesh, _, sh, state, _ = runs["fsdp"]
    tx = make_optimizer()
    # The pitfall: nothing tells jit how to lay the state out. On jax 0.10.2 the state even
    # lands on a single device (its zeros do not depend on the sharded parameters' values).
    plain = jax.jit(tx.init)(state.params)
    with pytest.raises(ValueError, match=r"opt_state/inner_state/0/mu/w1 \(parameter 'w1'\) "
                                         r"lives on 1 device\(s\), not the mesh's 8, expected "
                                         r"P\(None, 'fsdp'\)"):
        assert_sharded_like_params(state._replace(opt_state=plain), sh)
    replicated = jax.jit(tx.init, out_shardings=NamedSharding(mesh, P()))(state.params)
    with pytest.raises(ValueError, match=r"^10 state leaves .*: opt_state/inner_state/0/mu/b1 "
                                         r"\(parameter 'b1'\) is replicated, expected "
                                         r"P\('fsdp',\);"):
        assert_sharded_like_params(state._replace(opt_state=replicated), sh)
    assert_sharded_like_params(state, sh)


def test_guard_works_on_abstract_states_with_shardings(runs):
    _, _, sh, state, _ = runs["fsdp"]
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            state, sh)
    assert_sharded_like_params(abstract, sh)
    no_sharding = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    with pytest.raises(ValueError, match=r"params/b1 \(parameter 'b1'\) has no sharding"):
        assert_sharded_like_params(no_sharding, sh)


# --------------------------------------------------------------------------------------------
# State shardings matched by tree path: MultiSteps, loss-scale inner states.
# --------------------------------------------------------------------------------------------


def test_state_shardings_follow_params_through_multisteps_and_loss_scale():
    mesh = make_mesh()
    tx = optax.MultiSteps(dynamic_loss_scale(optax.adam(1e-3)), every_k_schedule=2)
    params = {"blocks": {"w": jnp.zeros((64, 32)), "b": jnp.zeros((8,))}, "w": jnp.zeros((4, 64))}

    def init(key):
        return init_train_state(params, tx, key)

    abstract = jax.eval_shape(init, jax.random.key(0))
    sh = state_shardings(abstract, mesh, "zero1", min_shard_size=0)
    named = dict(named_leaves(sh))
    assert named["opt_state/acc_grads/blocks/w"].spec == P("fsdp")
    assert named["opt_state/acc_grads/w"].spec == P(None, "fsdp")
    assert named["opt_state/inner_opt_state/inner_state/0/mu/blocks/w"].spec == P("fsdp")
    # "w" is a suffix of "blocks/w", but the longest matching parameter path wins.
    assert named["opt_state/inner_opt_state/inner_state/0/nu/w"].spec == P(None, "fsdp")
    assert named["opt_state/inner_opt_state/inner_state/0/mu/blocks/b"].spec == P("fsdp")
    assert named["opt_state/inner_opt_state/scale"].spec == P()
    assert named["params/blocks/w"].spec == P()  # zero1: parameters replicated
    assert named["step"].spec == P() and named["rng"].spec == P()
    ddp = dict(named_leaves(state_shardings(abstract, mesh, "ddp", min_shard_size=0)))
    assert all(s.spec == P() for s in ddp.values())


# --------------------------------------------------------------------------------------------
# Partition rules.
# --------------------------------------------------------------------------------------------


def _abstract(**shapes):
    return {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in shapes.items()}


def test_auto_rule_picks_largest_divisible_dimension_and_skips_small_leaves():
    mesh = make_mesh(data=2)  # fsdp = 4
    specs = partition_specs(_abstract(a=(8, 1024), b=(1024, 6), c=(2000,), small=(4, 8)), mesh)
    assert specs == {"a": P(None, "fsdp"), "b": P("fsdp"), "c": P("fsdp"), "small": P()}
    assert partition_specs(_abstract(t=(64, 64)), mesh)["t"] == P("fsdp")  # ties: first dim
    one = make_mesh(data=8, fsdp=1)
    assert partition_specs(_abstract(a=(8, 1024)), one)["a"] == P()


def test_auto_rule_replicates_indivisible_leaf_with_warning_naming_path_and_shape():
    mesh = make_mesh(data=2)
    with pytest.warns(ReplicatedParameterWarning, match=r"'tok/emb' of shape \(50257, 6\)"):
        specs = partition_specs({"tok": _abstract(emb=(50257, 6))}, mesh)
    assert specs["tok"]["emb"] == P()


def test_explicit_rules_with_logical_names_and_partition_specs():
    mesh = make_mesh(data=2)
    params = {"blocks": _abstract(kernel=(2, 64, 128), bias=(2, 128)), "head": _abstract(w=(64, 8))}
    rules = [
        ("blocks/.*kernel", ("layers", "embed", "mlp")),
        ("bias", None),
        ("head/w", P(None, ("data", "fsdp"))),
    ]
    specs = partition_specs(params, mesh, rules=rules)
    assert specs["blocks"]["kernel"] == P(None, "fsdp", None)
    assert specs["blocks"]["bias"] == P()
    assert specs["head"]["w"] == P(None, ("data", "fsdp"))
    table = {"layers": None, "embed": None, "mlp": "fsdp"}
    specs = partition_specs(params, mesh, rules=rules[:1], logical_axes=table)
    assert specs["blocks"]["kernel"] == P(None, None, "fsdp")
    # first match wins
    specs = partition_specs(params, mesh, rules=[("blocks", None), ("kernel", P("fsdp"))])
    assert specs["blocks"]["kernel"] == P()


@pytest.mark.parametrize(
    "rules, match",
    [
        ([("attn/q", P("fsdp"))], r"rules\[0\]='attn/q': matched 0 of 2 parameters; the first "
                                  r"paths are: 'blocks/kernel', 'emb'"),
        ([("kernel", P(None, None, None, "fsdp"))],
         r"rules\[0\]='kernel': spec .* has 4 entries but parameter 'blocks/kernel' has shape "
         r"\(2, 64, 128\) \(rank 3\)"),
        ([("emb", P("model"))], r"rules\[0\]=.*unknown mesh axis 'model'"),
        ([("emb", ("vocab", "hidden"))], r"rules\[0\]=.*unknown logical axis 'hidden'"),
        ([("emb", P("fsdp"))], r"rules\[0\]='emb': parameter 'emb' of shape \(50257, 16\): "
                               r"dimension 0 \(50257\) is not divisible by fsdp = 4"),
        ([("emb", P("fsdp", "fsdp"))], r"mesh axis 'fsdp' is used twice"),
        ([("(", None)], r"rules\[0\]: invalid regex"),
        (["emb"], r"rules\[0\]=.*expected \(path_regex, spec\)"),
    ],
    ids=["no-match", "too-long", "unknown-axis", "unknown-logical", "indivisible", "twice",
         "bad-regex", "not-a-pair"],
)
def test_bad_rules_are_config_errors_naming_rule_path_and_shape(rules, match):
    mesh = make_mesh(data=2)
    params = {"blocks": _abstract(kernel=(2, 64, 128)), "emb": jax.ShapeDtypeStruct(
        (50257, 16), jnp.float32)}
    with pytest.raises(ValueError, match=match):
        partition_specs(params, mesh, rules=rules)


def test_uneven_vocabulary_embedding_trains_on_fsdp4():
    mesh = make_mesh(data=2)  # fsdp = 4
    tx = standard_promotion_optimizer(optax.adam(1e-2))

    def init(key):
        params = {"emb": jax.random.normal(key, (50257, 16)) * 0.02,
                  "tiny": jax.random.normal(key, (50257, 6)) * 0.02}
        return init_train_state(params, tx, key)

    def lm_loss(p, batch, rng):
        h = constrain_batch(p["emb"][batch["ids"]])  # (B, 16)
        t = constrain_batch(p["tiny"][batch["ids"]])  # (B, 6)
        return jnp.mean(jnp.square(h)) + jnp.mean(jnp.square(t - 1.0))

    with pytest.warns(ReplicatedParameterWarning, match=r"'tiny' of shape \(50257, 6\)"):
        state, sh = init_sharded(init, jax.random.key(1), mesh=mesh, strategy="fsdp")
    assert sh.params["emb"].spec == P(None, "fsdp") and sh.params["tiny"].spec == P()
    assert state.params["emb"].addressable_shards[0].data.shape == (50257, 4)
    with pytest.warns(ReplicatedParameterWarning):
        specs = partition_specs(state.params, mesh)
    cp, cg = constraints(mesh, "fsdp", specs)
    step = jit_sharded(make_train_step(lm_loss, tx, "fp32", constrain_params=cp,
                                       constrain_grads=cg), mesh, sh)
    batch = {"ids": jnp.arange(16, dtype=jnp.int32) * 3000}
    losses = []
    for _ in range(3):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[2] < losses[0]
    assert state.params["emb"].sharding.spec == P(None, "fsdp")


# --------------------------------------------------------------------------------------------
# Born-sharded init.
# --------------------------------------------------------------------------------------------


def test_init_sharded_never_builds_the_whole_model_on_one_device():
    mesh = make_mesh()
    big = (1024, 256)  # 1 MiB in f32
    seen = {}

    def init(key):
        params = {"w": jax.random.normal(key, big)}
        return {"params": params, "opt_state": optax.sgd(0.1, momentum=0.9).init(params)}

    state, sh = init_sharded(init, jax.random.key(0), mesh=mesh, strategy="fsdp")
    seen["w"] = state["params"]["w"]
    assert all(s.data.shape == (128, 256) for s in seen["w"].addressable_shards)
    compiled = jax.jit(init, out_shardings=sh).lower(jax.random.key(0)).compile()
    # The init program's temporaries stay far below one whole parameter (1 MiB).
    ma = compiled.memory_analysis()
    shard = 1024 * 256 * 4 // 8
    assert 2 * shard <= ma.output_size_in_bytes < 2 * shard + 256  # w + momentum shards
    assert ma.temp_size_in_bytes < 4 * shard
    np.testing.assert_array_equal(
        np.asarray(seen["w"]), np.asarray(jax.random.normal(jax.random.key(0), big)))


# --------------------------------------------------------------------------------------------
# Meshes, strategies, batches: bad input is a ConfigError naming the field, before compiling.
# --------------------------------------------------------------------------------------------


def test_make_mesh_axes_and_sizes():
    mesh = make_mesh(data=2, fsdp=4)
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert dict(make_mesh().shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert dict(make_mesh(fsdp=2, data=-1).shape) == {"data": 4, "fsdp": 2, "tensor": 1}
    assert make_mesh(devices=jax.devices()[:4]).shape["fsdp"] == 4
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"data": 3, "fsdp": 2}, r"mesh='data=3, fsdp=2, tensor=1': the axis sizes multiply to 6 "
                                 r"but there are 8 devices"),
        ({"data": -1, "fsdp": -1}, r"at most one axis may be -1"),
        ({"data": 3}, r"the other axes multiply to 3, which does not divide the 8 devices"),
        ({"data": 0}, r"data=0: mesh axis sizes must be positive"),
        ({"tensor": 2.0}, r"tensor=2.0"),
    ],
)
def test_make_mesh_rejects_sizes_that_do_not_match_the_devices(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        make_mesh(**kwargs)


def test_parse_mesh():
    assert parse_mesh("data=2,fsdp=4") == {"data": 2, "fsdp": 4}
    assert make_mesh(**parse_mesh("fsdp=2, data=-1")).shape["data"] == 4
    for bad, match in [("data=2,model=4", "unknown axis 'model'"), ("data", "not 'axis=size'"),
                       ("data=two", "must be an int"), ("data=2,data=4", "given twice"),
                       ("", "expected 'axis=size"), ("fsdp=0", ">= 1 or -1")]:
        with pytest.raises(ConfigError, match=match):
            parse_mesh(bad)


def test_get_strategy_names_and_error():
    assert [get_strategy(n).name for n in ("ddp", "zero1", "zero2", "fsdp", "zero3", "FSDP")] \
        == ["ddp", "zero1", "zero2", "fsdp", "fsdp", "fsdp"]
    with pytest.raises(ConfigError, match=r"strategy='zero4': unknown strategy; accepted: ddp, "
                                          r"zero1, zero2, fsdp, zero3"):
        get_strategy("zero4")
    with pytest.raises(ConfigError, match="strategy"):
        param_shardings({"w": jnp.zeros(4)}, make_mesh(), "deepspeed")


def test_check_batch_names_the_size_and_the_mesh():
    mesh = make_mesh(data=2)
    check_batch(16, mesh)
    check_batch({"x": np.zeros((8, 3)), "y": np.zeros((8,))}, mesh)
    with pytest.raises(ConfigError, match=r"batch_size=12: must be divisible by data\*fsdp = 8 "
                                          r"\(data=2, fsdp=4\): e.g. 8 or 16$"):
        check_batch(12, mesh)
    with pytest.raises(ConfigError, match=r"batch_size=2: .*: e.g. 8$"):  # the one that works
        check_batch(2, mesh)
    with pytest.raises(ConfigError, match=r"batch\[y\] batch_size=6: .*leaf shape \(6,\)"):
        check_batch({"x": np.zeros((8, 3)), "y": np.zeros((6,))}, mesh)
    assert batch_sharding(mesh).spec == P(("data", "fsdp"))


def test_constrain_batch_is_identity_without_a_mesh_and_pins_the_batch_under_one():
    mesh = make_mesh()
    x = jnp.arange(32.0).reshape(16, 2)
    assert constrain_batch(x) is x
    with jax.set_mesh(mesh):
        y = jax.jit(lambda a: constrain_batch(a * 2.0))(x)
        assert y.sharding.is_equivalent_to(batch_sharding(mesh), 2)
        assert not y.sharding.is_fully_replicated
        with pytest.raises(ValueError, match=r"shape \(12, 2\) is not divisible by "
                                             r"data\*fsdp = 8"):
            jax.jit(constrain_batch)(jnp.ones((12, 2)))
    np.testing.assert_array_equal(y, x * 2.0)


def test_sharding_does_not_import_precision_or_lora():
    import ast
    import pathlib

    root = pathlib.Path(_strategy.__file__).parent
    for f in root.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for n in names:
                assert not n.startswith(("effijax.precision", "effijax.lora", "effijax.step",
                                         "effijax.models")), (f.name, n)


@pytest.mark.parametrize("module", [_mesh, _rules, _strategy], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.failed == 0 and result.attempted > 0
