"""The contract every optax transform effijax ships must keep, tested once over a registry.

Properties: abstract init on ``jax.ShapeDtypeStruct``; jit without retracing; updates in the
param dtype and state that keeps its dtypes and shapes; composition inside ``optax.chain`` and
``optax.MultiSteps``; sharded params on a (2, 4) mesh keep their sharding in updates and state.
Adding a transform is one line in ``REGISTRY``.
"""

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from effijax.precision import accumulate, dynamic_loss_scale, loss_scale_of, static_loss_scale


class Entry(NamedTuple):
    name: str
    factory: object  # () -> optax.GradientTransformation
    # "standard" where the wrapped optax optimizer is not clean under strict promotion
    # (optax 0.2.8's Adam computes `decay ** count`, Python float ** int32).
    promotion: str = "strict"
    # Accumulating transforms apply an update only every k-th step (zeros in between).
    emits_every: int = 1


REGISTRY = [
    Entry("dynamic_loss_scale(adam)", lambda: dynamic_loss_scale(optax.adam(1e-3)), "standard"),
    Entry(
        "dynamic_loss_scale(chain(clip, adamw), hysteresis=2)",
        lambda: dynamic_loss_scale(
            optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), hysteresis=2
        ),
        "standard",
    ),
    Entry("static_loss_scale(sgd)", lambda: static_loss_scale(optax.sgd(0.1), 2.0**8)),
    Entry("accumulate(dynamic_loss_scale(sgd), 2)",
          lambda: accumulate(dynamic_loss_scale(optax.sgd(0.1)), 2), "standard", emits_every=2),
]

parametrize_registry = pytest.mark.parametrize("entry", REGISTRY, ids=lambda e: e.name)


def _params(dtype=jnp.float32):
    return {
        "w": jnp.linspace(-1.0, 1.0, 8 * 16, dtype=jnp.float32).reshape(8, 16).astype(dtype),
        "b": jnp.linspace(0.0, 0.5, 16, dtype=jnp.float32).astype(dtype),
    }


def _grads(params, step, opt_state):
    """Gradients of ``loss * scale`` (the scale is 1 for transforms without loss scaling)."""
    scale = loss_scale_of(opt_state)
    return jax.tree.map(
        lambda p: (jnp.cos(p.astype(jnp.float32) * (step + 1)) * 0.1 * scale).astype(p.dtype),
        params,
    )


def _avals(tree):
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [(tuple(x.shape), jnp.dtype(x.dtype), jax.typeof(x).weak_type) for x in leaves]


@parametrize_registry
def test_abstract_init_matches_real_init(entry):
    with jax.numpy_dtype_promotion(entry.promotion):
        tx = entry.factory()
        params = _params()
        abstract_params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
        abstract = jax.eval_shape(tx.init, abstract_params)
        assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
        real_treedef, real = _avals(tx.init(params))
        abstract_leaves, abstract_treedef = jax.tree.flatten(abstract)
        assert real_treedef == abstract_treedef
        assert real == [(tuple(x.shape), jnp.dtype(x.dtype), x.weak_type) for x in abstract_leaves]


@parametrize_registry
def test_jit_without_retracing(entry):
    with jax.numpy_dtype_promotion(entry.promotion):
        tx = entry.factory()
        chex.clear_trace_counter()
        init = jax.jit(chex.assert_max_traces(tx.init, n=1))
        update = jax.jit(chex.assert_max_traces(tx.update, n=1))
        params = _params()
        state = init(params)
        for step in range(3):
            updates, state = update(_grads(params, step, state), state, params)
            params = optax.apply_updates(params, updates)
        state = init(params)  # a second init reuses the trace too


@parametrize_registry
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_updates_in_param_dtype_and_state_does_not_drift(entry, dtype):
    with jax.numpy_dtype_promotion(entry.promotion):
        tx = entry.factory()
        params = _params(dtype)
        state = tx.init(params)
        initial = _avals(state)
        update = jax.jit(tx.update)
        for step in range(3):
            updates, state = update(_grads(params, step, state), state, params)
            assert _avals(updates) == _avals(params)
            values = [np.asarray(u, np.float32) for u in jax.tree.leaves(updates)]
            assert all(np.isfinite(v).all() for v in values)
            emits = (step + 1) % entry.emits_every == 0
            assert any(v.any() for v in values) == emits
            params = optax.apply_updates(params, updates)
            assert _avals(state) == initial


@parametrize_registry
def test_composes_in_chain_and_multisteps(entry):
    with jax.numpy_dtype_promotion(entry.promotion):
        _check_composed(entry, lambda tx: optax.chain(optax.identity(), tx),
                        emit_every=entry.emits_every)
    # optax 0.2.8's MultiSteps itself mixes f32/int32 and int32/bool: standard promotion.
    with jax.numpy_dtype_promotion("standard"):
        _check_composed(entry, lambda tx: optax.MultiSteps(tx, every_k_schedule=2),
                        emit_every=2 * entry.emits_every)


def _check_composed(entry, wrap, emit_every):
    tx = entry.factory()
    composed = wrap(tx)
    params = _params()
    state = composed.init(params)
    initial = _avals(state)
    assert float(loss_scale_of(state)) == float(loss_scale_of(tx.init(params)))
    update = jax.jit(composed.update)
    for step in range(4):
        updates, state = update(_grads(params, step, state), state, params)
        assert _avals(updates) == _avals(params) and _avals(state) == initial
        emitted = any(np.asarray(u).any() for u in jax.tree.leaves(updates))
        assert emitted == ((step + 1) % emit_every == 0)
        params = optax.apply_updates(params, updates)


def _shardings_by_path(abstract_state, params, param_shardings, replicated):
    """A sharding for each state leaf: the param's sharding when the leaf's tree path ends with
    that param's path and the shapes agree (Adam's mu['w'] and so on), else replicated."""
    by_path = {
        path: (p.shape, sharding)
        for (path, p), sharding in zip(
            jax.tree_util.tree_leaves_with_path(params),
            jax.tree.leaves(param_shardings),
            strict=True,
        )
    }

    def pick(path, leaf):
        for start in range(len(path)):
            shape, sharding = by_path.get(tuple(path[start:]), (None, None))
            if shape == leaf.shape:
                return sharding
        return replicated

    return jax.tree_util.tree_map_with_path(pick, abstract_state)


@parametrize_registry
def test_sharded_params_keep_their_sharding(entry):
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    replicated = NamedSharding(mesh, P())
    param_shardings = {"w": NamedSharding(mesh, P("a", "b")), "b": replicated}
    with jax.numpy_dtype_promotion(entry.promotion):
        tx = entry.factory()
        params = jax.device_put(_params(), param_shardings)
        abstract_state = jax.eval_shape(tx.init, params)
        state_shardings = _shardings_by_path(abstract_state, params, param_shardings, replicated)
        state = jax.jit(tx.init, out_shardings=state_shardings)(params)
        update = jax.jit(tx.update)
        for step in range(2):
            grads = jax.device_put(_grads(params, step, state), param_shardings)
            updates, state = update(grads, state, params)
            for u, s in zip(
                jax.tree.leaves(updates), jax.tree.leaves(param_shardings), strict=True
            ):
                assert u.sharding.is_equivalent_to(s, u.ndim), (u.sharding, s)
            for leaf, s in zip(
                jax.tree.leaves(state), jax.tree.leaves(state_shardings), strict=True
            ):
                assert leaf.sharding.is_equivalent_to(s, leaf.ndim), (leaf.sharding, s)
            params = optax.apply_updates(params, updates)
        # The path rule found every leaf shaped like the sharded param (Adam's mu['w'], nu['w']).
        for leaf, s in zip(
            jax.tree.leaves(abstract_state), jax.tree.leaves(state_shardings), strict=True
        ):
            if leaf.shape == params["w"].shape:
                assert s == param_shardings["w"]
