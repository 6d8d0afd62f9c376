"""Loss scaling as optax transforms: the scale lives in ``opt_state``, skipping happens inside jit.

fp16 gradients below 2^-24 flush to zero. The train step multiplies the loss by
``loss_scale_of(opt_state)``; the wrapped optimizer receives gradients of ``loss * scale``,
divides them by that same scale in f32, and makes one fused finiteness check over every leaf.
A finite step runs the inner optimizer; a non-finite step returns exact zeros and leaves the
inner state bitwise unchanged (so Adam's count and schedule counters do not advance). The
dynamic variant then adjusts the scale with PyTorch ``GradScaler``'s rule (grow after
``growth_interval`` consecutive finite steps, back off on overflow; floored at ``min_scale``,
1.0 by default, where PyTorch has no floor: see :func:`dynamic_loss_scale`), optionally with
Megatron-LM's hysteresis. Everything is ``jnp.where`` on device: no host sync, no retracing.

Composition. Wrap the *whole* optimizer, clipping included, so that clipping sees unscaled
gradients: ``dynamic_loss_scale(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr)))``.
Learning-rate schedules inside the wrapper do not advance on skipped steps.

Gradient accumulation. Use ``effijax.precision.accumulate(dynamic_loss_scale(opt), k)``: the
scale only changes on the effective step, so it is constant across the k micro-steps, and one
finiteness check over the accumulated gradient decides the whole effective step (PyTorch's
semantics). ``accumulate`` is ``optax.MultiSteps`` plus one repair: optax 0.2.8 resets its
accumulator as ``(1 - emit) * acc`` and ``0 * inf`` is NaN, so with plain ``MultiSteps`` every
effective step after the first overflow is skipped (a strict-xfail test pins that upstream bug).
``dynamic_loss_scale(MultiSteps(opt, k).gradient_transformation())`` also works, with different
semantics: each micro-step is checked on its own and a bad one is dropped, and
``growth_interval`` then counts micro-steps.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from effijax.errors import ConfigError, whole_number

__all__ = [
    "DynamicLossScaleState",
    "StaticLossScaleState",
    "dynamic_loss_scale",
    "static_loss_scale",
    "loss_scale_of",
    "skipped_steps_of",
    "step_skipped",
    "all_finite",
]

_F32_MAX = float(np.finfo(np.float32).max)


class DynamicLossScaleState(NamedTuple):
    """State of :func:`dynamic_loss_scale`.

    The hyperparameters (factors, interval, min/max, hysteresis) are closed over by the
    transform, not stored, so nothing here can be lost when the state crosses ``jit``.

    Attributes:
      scale: f32 scalar; the next step's loss must be multiplied by it.
      growth_count: int32 scalar; consecutive finite steps since the last growth, growth
        attempt or overflow.
      hysteresis_left: int32 scalar; overflows still tolerated before the scale backs off
        (never below 0; refilled to ``hysteresis`` every ``growth_interval`` finite steps).
      skipped_total: int32 scalar; non-finite steps skipped so far.
      last_skipped: bool scalar; whether the most recent update was skipped.
      inner_state: the wrapped optimizer's state.
    """

    scale: jax.Array
    growth_count: jax.Array
    hysteresis_left: jax.Array
    skipped_total: jax.Array
    last_skipped: jax.Array
    inner_state: optax.OptState


class StaticLossScaleState(NamedTuple):
    """State of :func:`static_loss_scale`.

    Attributes:
      scale: f32 scalar, fixed at construction; the loss must be multiplied by it.
      skipped_total: int32 scalar; non-finite steps skipped so far.
      last_skipped: bool scalar; whether the most recent update was skipped.
      inner_state: the wrapped optimizer's state.
    """

    scale: jax.Array
    skipped_total: jax.Array
    last_skipped: jax.Array
    inner_state: optax.OptState


_LossScaleState = (DynamicLossScaleState, StaticLossScaleState)


def _is_loss_scale_state(x: Any) -> bool:
    return isinstance(x, _LossScaleState)


def all_finite(tree: Any) -> jax.Array:
    """Returns one bool scalar: True iff every floating leaf of ``tree`` is finite.

    Non-floating leaves (ints, bools) are ignored; an empty tree is finite. Under ``jit`` with
    sharded leaves the reduction is global (over all shards), and nothing is synced to the host.

    Args:
      tree: any pytree of arrays.

    Returns:
      A bool scalar array.

    Example:
      >>> import jax.numpy as jnp
      >>> bool(all_finite({"a": jnp.ones(3), "b": jnp.arange(2)}))
      True
      >>> bool(all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.nan])}))
      False
    """
    checks = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    if not checks:
        return jnp.ones((), dtype=jnp.bool_)
    return jnp.all(jnp.stack(checks))


def _unscale(updates: Any, scale: jax.Array, params: Any) -> Any:
    """Divides by ``scale`` in f32, then casts to the dtype the inner optimizer expects.

    The target dtype is each param's dtype (the dtype the inner optimizer's state was built
    for; optax optimizers over bf16 params fail under strict promotion when fed f32 grads), or
    the incoming gradient's dtype when no params are given.
    """

    def one(g, target_dtype):
        return (g.astype(jnp.float32) / scale).astype(target_dtype)

    if params is None:
        return jax.tree.map(lambda g: one(g, g.dtype), updates)
    return jax.tree.map(lambda g, p: one(g, p.dtype), updates, params)


def _skip_or_apply(
    inner: optax.GradientTransformationExtraArgs,
    updates: Any,
    inner_state: optax.OptState,
    scale: jax.Array,
    params: Any,
    extra_args: dict[str, Any],
) -> tuple[Any, optax.OptState, jax.Array]:
    """The step shared by both transforms: unscale, check, update or keep everything."""
    grads = _unscale(updates, scale, params)
    # Checked after the cast: a value that overflows the param dtype (f16) counts as non-finite.
    finite = all_finite(grads)
    inner_updates, new_inner_state = inner.update(grads, inner_state, params, **extra_args)
    # Select, never recompute: the old state comes back bitwise on a skipped step.
    new_inner_state = jax.tree.map(
        lambda new, old: jnp.where(finite, new, old), new_inner_state, inner_state
    )
    like = updates if params is None else params

    def out(u, p):
        dtype = p.dtype
        return jnp.where(finite, u.astype(dtype), jnp.zeros((), dtype))

    return jax.tree.map(out, inner_updates, like), new_inner_state, finite


def _check_inner(inner: Any) -> optax.GradientTransformationExtraArgs:
    if not isinstance(inner, optax.GradientTransformation):
        hint = ""
        if hasattr(inner, "init") and hasattr(inner, "update"):
            hint = (
                "; it has init/update methods: pass `inner.gradient_transformation()` (for "
                "optax.MultiSteps) or `optax.GradientTransformation(inner.init, inner.update)`"
            )
        raise ConfigError(
            "inner", inner, "must be an optax.GradientTransformation (e.g. optax.adamw(1e-3) or "
            f"an optax.chain), got {type(inner).__name__}{hint}"
        )
    return optax.with_extra_args_support(inner)


def _check_scale(name: str, value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ConfigError(name, value, "must be a positive finite float, e.g. 2.0**16") from None
    if not (math.isfinite(v) and 0.0 < v <= _F32_MAX):
        raise ConfigError(
            name, value, f"must be a positive finite float representable in float32 "
            f"(0 < {name} <= {_F32_MAX:.8g})"
        )
    return v


def _check_factor(name: str, value: Any, accepted: str, ok) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    if not (math.isfinite(v) and ok(v)):
        raise ConfigError(name, value, f"must be {accepted}")
    return v


def dynamic_loss_scale(
    inner: optax.GradientTransformation,
    *,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float = 1.0,
    max_scale: float = _F32_MAX,
    hysteresis: int = 1,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` with dynamic loss scaling (PyTorch ``GradScaler``, Megatron hysteresis).

    The train step multiplies its loss by ``loss_scale_of(opt_state)`` and passes the
    gradients of the scaled loss (any float dtype) to ``update``, which:

    1. divides them by ``state.scale`` in f32 -- the scale *before* this step adjusts it, i.e.
       the one that multiplied the loss -- and casts them to each param's dtype (to the
       gradient's own dtype when ``params`` is None);
    2. checks all leaves for inf/NaN with one fused bool scalar;
    3. finite: returns ``inner``'s updates (cast to the param dtype) and new state;
       ``growth_count += 1``; when it reaches ``growth_interval`` it resets to 0, the scale is
       multiplied by ``growth_factor`` unless the result would exceed ``max_scale`` (or be
       inf; then the scale stays), and ``hysteresis_left`` is refilled to ``hysteresis``
       (Megatron refills whenever the interval completes, also when growth is capped);
    4. non-finite: returns exact zeros (param dtype; gradient dtype when ``params`` is None),
       keeps ``inner_state`` bitwise, resets ``growth_count``, ``skipped_total += 1``,
       decrements ``hysteresis_left`` (floored at 0) and, when it is 0, backs off:
       ``scale = max(scale * backoff_factor, min_scale)``. With ``hysteresis=1`` every
       overflow backs off, like PyTorch; with ``k`` the first ``k - 1`` overflows after a
       refill only skip the step, like Megatron-LM and DeepSpeed.

    With the defaults the scale first grows after the 2000th consecutive finite step, exactly
    PyTorch's schedule, with two differences. PyTorch has no ``min_scale``: the default floor
    of 1.0 stops the halving that PyTorch continues after 16 overflows in a row from 2^16
    (pass ``min_scale=2.0**-100`` to match it; a scale below 1 shrinks the gradients it is
    meant to protect from underflow). And step 2 checks the *unscaled* f32 gradients where
    PyTorch checks the scaled ones; dividing a finite value by a scale >= 1 cannot overflow,
    so the two agree whenever the scale is >= 1, hence always under the default floor. The factors
    are applied in f32; PyTorch multiplies in f64 before rounding, which agrees whenever the
    factors are exact in f32 (2, 0.5, any power of two). Wrap the whole optimizer, gradient
    clipping included, so clipping sees unscaled gradients. For gradient accumulation see the
    module docstring.

    Args:
      inner: the optimizer to wrap; extra args given to ``update`` are passed through.
      init_scale: the first scale, in ``[min_scale, max_scale]``.
      growth_factor: multiplier on growth, > 1.
      backoff_factor: multiplier on backoff, in (0, 1).
      growth_interval: consecutive finite steps per growth attempt, >= 1.
      min_scale: lower clamp of the scale on backoff, positive.
      max_scale: growth that would exceed it is skipped; positive and finite in f32.
      hysteresis: overflows (since the last refill) needed to back off, >= 1.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`DynamicLossScaleState`.

    Raises:
      ConfigError: naming the argument (``init_scale``, ``growth_interval``, ``inner``, ...), its
        value and what is accepted, before any tracing.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0, growth_interval=2)
      >>> params = {"w": jnp.ones(2)}
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.full(2, 0.5) * loss_scale_of(state)}  # grads of loss * scale
      >>> updates, state = tx.update(grads, state, params)
      >>> updates["w"].tolist(), float(loss_scale_of(state))
      ([-0.05000000074505806, -0.05000000074505806], 8.0)
      >>> updates, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, state, params)
      >>> updates["w"].tolist(), float(loss_scale_of(state)), int(skipped_steps_of(state))
      ([0.0, 0.0], 4.0, 1)
    """
    inner = _check_inner(inner)
    init_scale = _check_scale("init_scale", init_scale)
    min_scale = _check_scale("min_scale", min_scale)
    max_scale = _check_scale("max_scale", max_scale)
    growth_factor = _check_factor(
        "growth_factor", growth_factor, "a finite float > 1, e.g. 2.0", lambda v: v > 1.0
    )
    backoff_factor = _check_factor(
        "backoff_factor", backoff_factor, "a float in (0, 1), e.g. 0.5", lambda v: 0.0 < v < 1.0
    )
    growth_interval = whole_number("growth_interval", growth_interval)
    hysteresis = whole_number("hysteresis", hysteresis)
    if min_scale > init_scale:
        raise ConfigError("min_scale", min_scale, f"must be <= init_scale={init_scale!r}; "
                          "lower min_scale or raise init_scale")
    if init_scale > max_scale:
        raise ConfigError("init_scale", init_scale, f"must be <= max_scale={max_scale!r}; "
                          "lower init_scale or raise max_scale")

    def init_fn(params):
        return DynamicLossScaleState(
            scale=jnp.asarray(init_scale, dtype=jnp.float32),
            growth_count=jnp.zeros((), dtype=jnp.int32),
            hysteresis_left=jnp.asarray(hysteresis, dtype=jnp.int32),
            skipped_total=jnp.zeros((), dtype=jnp.int32),
            last_skipped=jnp.zeros((), dtype=jnp.bool_),
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        scale = state.scale
        new_updates, inner_state, finite = _skip_or_apply(
            inner, updates, state.inner_state, scale, params, extra_args
        )
        # Finite step: count, and every growth_interval steps try to grow and refill.
        count = state.growth_count + 1
        interval_done = finite & (count >= growth_interval)
        grown = scale * growth_factor
        grow = interval_done & jnp.isfinite(grown) & (grown <= max_scale)
        # Non-finite step: spend one unit of hysteresis; back off when none is left.
        hyst_after_overflow = jnp.maximum(state.hysteresis_left - 1, 0)
        backoff = ~finite & (hyst_after_overflow == 0)
        backed_off = jnp.maximum(scale * backoff_factor, min_scale)

        new_state = DynamicLossScaleState(
            scale=jnp.where(backoff, backed_off, jnp.where(grow, grown, scale)),
            growth_count=jnp.where(finite & ~interval_done, count, 0),
            hysteresis_left=jnp.where(
                finite,
                jnp.where(interval_done, hysteresis, state.hysteresis_left),
                hyst_after_overflow,
            ),
            skipped_total=state.skipped_total + (~finite).astype(jnp.int32),
            last_skipped=~finite,
            inner_state=inner_state,
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def static_loss_scale(
    inner: optax.GradientTransformation, scale: float
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` with a fixed loss scale; non-finite steps are still skipped.

    ``update`` unscales in f32 by ``scale``, checks finiteness once over all leaves, and on a
    non-finite step returns exact zeros with ``inner_state`` bitwise unchanged, like
    :func:`dynamic_loss_scale`; the scale itself never changes. Updates come back in the param
    dtype (the gradient dtype when ``params`` is None).

    Args:
      inner: the optimizer to wrap; extra args given to ``update`` are passed through.
      scale: the loss scale, positive and finite in f32.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`StaticLossScaleState`.

    Raises:
      ConfigError: ``scale`` is not positive and finite in f32, or ``inner`` is not an optax
        transformation; before any tracing.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = static_loss_scale(optax.sgd(1.0), 1024.0)
      >>> params = {"w": jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.array([1024.0, 2048.0])}, state, params)
      >>> updates["w"].tolist(), float(loss_scale_of(state)), bool(step_skipped(state))
      ([-1.0, -2.0], 1024.0, False)
    """
    inner = _check_inner(inner)
    scale = _check_scale("scale", scale)

    def init_fn(params):
        return StaticLossScaleState(
            scale=jnp.asarray(scale, dtype=jnp.float32),
            skipped_total=jnp.zeros((), dtype=jnp.int32),
            last_skipped=jnp.zeros((), dtype=jnp.bool_),
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        new_updates, inner_state, finite = _skip_or_apply(
            inner, updates, state.inner_state, state.scale, params, extra_args
        )
        new_state = StaticLossScaleState(
            scale=state.scale,
            skipped_total=state.skipped_total + (~finite).astype(jnp.int32),
            last_skipped=~finite,
            inner_state=inner_state,
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _find_loss_scale_state(opt_state: Any) -> DynamicLossScaleState | StaticLossScaleState | None:
    leaves = jax.tree_util.tree_leaves(opt_state, is_leaf=_is_loss_scale_state)
    return next((x for x in leaves if _is_loss_scale_state(x)), None)


def _read_field(opt_state: Any, field: str, default: jax.Array) -> jax.Array:
    found = _find_loss_scale_state(opt_state)
    if found is None:
        return default
    return jnp.asarray(getattr(found, field)).astype(default.dtype)


def loss_scale_of(opt_state: Any) -> jax.Array:
    """Returns the f32 loss scale held anywhere in ``opt_state``, or 1.0 if there is none.

    Finds the first :class:`DynamicLossScaleState` or :class:`StaticLossScaleState` in any
    pytree (chains, ``optax.MultiStepsState``, ``inject_hyperparams`` states, dicts, named
    tuples), so a train step can always multiply its loss by the result.

    Args:
      opt_state: an optimizer state.

    Returns:
      An f32 scalar.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = optax.MultiSteps(dynamic_loss_scale(optax.adam(1e-3), init_scale=512.0), 4)
      >>> float(loss_scale_of(tx.init({"w": jnp.ones(2)})))
      512.0
      >>> float(loss_scale_of(optax.adam(1e-3).init({"w": jnp.ones(2)})))
      1.0
    """
    return _read_field(opt_state, "scale", jnp.ones((), dtype=jnp.float32))


def skipped_steps_of(opt_state: Any) -> jax.Array:
    """Returns the int32 number of non-finite steps skipped so far (0 without loss scaling).

    Args:
      opt_state: an optimizer state; searched like :func:`loss_scale_of`.

    Returns:
      An int32 scalar.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = static_loss_scale(optax.sgd(0.1), 8.0)
      >>> params = {"w": jnp.ones(2)}
      >>> _, state = tx.update({"w": jnp.full(2, jnp.nan)}, tx.init(params), params)
      >>> int(skipped_steps_of(state))
      1
    """
    return _read_field(opt_state, "skipped_total", jnp.zeros((), dtype=jnp.int32))


def step_skipped(opt_state: Any) -> jax.Array:
    """Returns a bool scalar: whether the most recent update was skipped (False without scaling).

    Args:
      opt_state: an optimizer state; searched like :func:`loss_scale_of`.

    Returns:
      A bool scalar.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = dynamic_loss_scale(optax.sgd(0.1))
      >>> params = {"w": jnp.ones(2)}
      >>> state = tx.init(params)
      >>> bool(step_skipped(state))
      False
      >>> _, state = tx.update({"w": jnp.array([1.0, jnp.inf])}, state, params)
      >>> bool(step_skipped(state))
      True
    """
    return _read_field(opt_state, "last_skipped", jnp.zeros((), dtype=jnp.bool_))
