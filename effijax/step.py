"""The functional train step: precision policy + loss scaling + any optax optimizer.

``make_train_step(loss_fn, optimizer, policy)`` returns a pure ``step(state, batch) -> (state,
metrics)`` meant for ``jax.jit(step, donate_argnums=0)``. One step:

1. derives this step's PRNG key from ``(state.rng, state.step)``, so resuming needs only the step;
2. casts the master parameters to the policy's compute dtype (f32 islands stay in the model);
3. multiplies the f32 loss by the loss scale found in ``opt_state`` (1 when there is none);
4. differentiates with respect to the *master* parameters: the cast's transpose hands back
   gradients in the parameter dtype, while the backward pass itself ran in the compute dtype;
5. lets the optimizer (e.g. ``dynamic_loss_scale(adamw)``) unscale, check finiteness, skip or
   apply, and applies the updates.

Any model works if it can be written as ``loss_fn(params, batch, rng) -> loss`` (or
``(loss, aux)`` with ``has_aux=True``): an NNX model via ``nnx.split``/``nnx.merge``, a Linen
model via ``module.apply``, or a plain function.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from effijax.optimizers import make_optimizer, optax_promotion
from effijax.precision import (
    DynamicLossScaleState,
    Policy,
    StaticLossScaleState,
    get_policy,
    is_floating,
    loss_scale_of,
    step_skipped,
)
from effijax.sharding import (
    DEFAULT_MIN_SHARD_SIZE,
    ReplicatedParameterWarning,
    ShardedStep,
    Strategy,
    TensorLayout,
    constraints,
    get_strategy,
    grad_shardings,
    init_sharded,
    jit_sharded,
    partition_specs,
)

__all__ = [
    "TrainState",
    "init_train_state",
    "make_train_step",
    "make_optimizer",
    "has_loss_scale",
    "learning_rate_of",
    "global_norm_f32",
    "optax_promotion",
    "ShardedTraining",
    "make_sharded_step",
    "make_sharded_training",
]


class TrainState(NamedTuple):
    """Everything a training run carries from step to step.

    Attributes:
      step: int32 scalar, the number of steps taken (skipped steps included); the data position
        and the per-step PRNG key are functions of it.
      params: the master parameters (any pytree).
      opt_state: the optimizer state, including the loss-scale state when there is one.
      rng: the run's base PRNG key; per-step keys are ``fold_in(rng, step)``.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array


def init_train_state(params, optimizer: optax.GradientTransformation, rng) -> TrainState:
    """Builds the initial :class:`TrainState`.

    Args:
      params: master parameters (already in the policy's ``param_dtype``).
      optimizer: any optax transformation.
      rng: a PRNG key (``jax.random.key(seed)``) or an int seed.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> s = init_train_state({"w": jnp.zeros(3)}, optax.sgd(0.1), 0)
      >>> int(s.step), s.params["w"].shape
      (0, (3,))
    """
    if isinstance(rng, int):
        rng = jax.random.key(rng)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=_init_optimizer(optimizer, params),
        rng=rng,
    )


def _init_optimizer(optimizer, params):
    with optax_promotion():
        return optimizer.init(params)


def _is_loss_scale_state(x) -> bool:
    return isinstance(x, DynamicLossScaleState | StaticLossScaleState)


def has_loss_scale(opt_state) -> bool:
    """True if a loss-scale state sits anywhere inside ``opt_state`` (a structural check).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from effijax.precision import dynamic_loss_scale
      >>> has_loss_scale(dynamic_loss_scale(optax.sgd(0.1)).init({"w": jnp.ones(2)}))
      True
    """
    leaves = jax.tree.leaves(opt_state, is_leaf=_is_loss_scale_state)
    return any(_is_loss_scale_state(x) for x in leaves)


def learning_rate_of(opt_state) -> jax.Array | None:
    """The learning rate an ``optax.inject_hyperparams`` optimizer last used, or None.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
      >>> float(learning_rate_of(tx.init({"w": jnp.ones(1)})))
      0.5
    """
    kinds = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
    for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds)):
        if isinstance(x, kinds) and "learning_rate" in x.hyperparams:
            return jnp.asarray(x.hyperparams["learning_rate"], jnp.float32)
    return None


def global_norm_f32(tree) -> jax.Array:
    """Global L2 norm of the floating leaves, accumulated in f32 (safe for f16/bf16 leaves).

    Example:
      >>> import jax.numpy as jnp
      >>> float(global_norm_f32({"a": jnp.array([3.0], jnp.float16), "b": jnp.array([4.0])}))
      5.0
    """
    sq = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)
          if is_floating(x)]
    return jnp.sqrt(sum(sq, jnp.float32(0.0)))


def _probe_loss_scaling(optimizer) -> bool | None:
    """Whether ``optimizer`` keeps a loss scale, found abstractly; None if it can't be probed."""
    try:
        probe = {"probe": jax.ShapeDtypeStruct((1,), jnp.float32)}
        state = jax.eval_shape(lambda p: _init_optimizer(optimizer, p), probe)
    except Exception:  # an optimizer whose init depends on the parameter structure
        return None
    return has_loss_scale(state)


_FP16_UNSCALED = (
    "policy {policy} computes in float16 but the optimizer has no loss scaling: gradients below "
    "2^-24 underflow to zero. Wrap the optimizer: effijax.precision.dynamic_loss_scale(optimizer) "
    "(or pass allow_unscaled_fp16=True to run unscaled on purpose)"
)


def make_train_step(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    policy: Policy | str = "fp32",
    *,
    has_aux: bool = False,
    allow_unscaled_fp16: bool = False,
    constrain_params: Callable[[Any], Any] | None = None,
    constrain_grads: Callable[[Any], Any] | None = None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
    """Returns a pure ``step(state, batch) -> (state, metrics)`` for ``jax.jit``.

    Args:
      loss_fn: ``loss_fn(params, batch, rng) -> loss`` (or ``(loss, aux)`` with ``has_aux``),
        called with parameters already cast to ``policy.compute_dtype``. The loss is taken in f32.
      optimizer: an optax transformation; wrap it in :func:`~effijax.precision.dynamic_loss_scale`
        for fp16. For gradient accumulation use
        ``effijax.precision.accumulate(dynamic_loss_scale(opt), k)``.
      policy: a :class:`~effijax.precision.Policy` or preset name.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; aux scalars join the metrics.
      allow_unscaled_fp16: permit an fp16 policy without loss scaling (for experiments that
        show why it fails).
      constrain_params: applied to the compute-dtype parameters right after the cast (the
        sharding strategies use it to pin where the all-gather happens: after the cast, so it
        moves compute-dtype bytes).
      constrain_grads: applied to the gradients before the optimizer (ZeRO-2/3 pin them to the
        sharded layout, i.e. a reduce-scatter instead of an all-reduce).

    Returns:
      ``step``. Its metrics are f32/bool scalars: ``loss`` (unscaled), ``grad_norm`` (of the
      unscaled gradients; inf/nan on an overflowing step), ``loss_scale`` (the scale that
      multiplied this step's loss), ``skipped`` (the optimizer skipped the update),
      ``grads_finite``, ``learning_rate`` (when the optimizer exposes it, see
      :func:`learning_rate_of`), plus aux entries.

    Raises:
      ValueError: at construction (or at trace time, for optimizers whose state cannot be probed
        abstractly) when the policy computes in fp16 and the optimizer has no loss scaling.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from effijax.precision import dynamic_loss_scale
      >>> def loss_fn(p, b, rng):  # p arrives in the compute dtype (fp16 here)
      ...     return jnp.mean((b["x"].astype(p["w"].dtype) @ p["w"] - 1.0) ** 2)
      >>> tx = dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**10)
      >>> step = jax.jit(make_train_step(loss_fn, tx, "fp16"), donate_argnums=0)
      >>> state = init_train_state({"w": jnp.zeros((2, 1))}, tx, 0)
      >>> batch = {"x": jnp.ones((4, 2))}
      >>> state, m = step(state, batch)
      >>> float(m["loss"]), float(m["loss_scale"]), bool(m["skipped"])
      (1.0, 1024.0, False)
    """
    policy = get_policy(policy)
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(optimizer, optax.GradientTransformation):
        raise ValueError(
            f"optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__}"
        )
    check_fp16 = policy.needs_loss_scaling and not allow_unscaled_fp16
    if check_fp16 and _probe_loss_scaling(optimizer) is False:
        raise ValueError(_FP16_UNSCALED.format(policy=policy))

    def step(state: TrainState, batch) -> tuple[TrainState, dict]:
        scaled = has_loss_scale(state.opt_state)
        if check_fp16 and not scaled:
            raise ValueError(_FP16_UNSCALED.format(policy=policy))
        rng = jax.random.fold_in(state.rng, state.step)
        scale = loss_scale_of(state.opt_state)

        def scaled_loss(params):
            compute_params = policy.cast_to_compute(params)
            if constrain_params is not None:
                compute_params = constrain_params(compute_params)
            out = loss_fn(compute_params, batch, rng)
            loss, aux = out if has_aux else (out, {})
            loss = jnp.asarray(loss).astype(jnp.float32)
            return loss * scale, (loss, aux)

        grads, (loss, aux) = jax.grad(scaled_loss, has_aux=True)(state.params)
        if constrain_grads is not None:
            grads = constrain_grads(grads)
        with optax_promotion():
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # apply_updates keeps each parameter's dtype; assert it so drift is caught at trace time.
        jax.tree.map(_same_dtype, state.params, params)

        # The norm is finite iff every gradient is (barring an f32 overflow of the sum of
        # squares, which only an overflowing step produces): one pass over the gradients.
        norm = global_norm_f32(grads)
        metrics = {
            "loss": loss,
            "grad_norm": norm / scale,
            "loss_scale": scale,
            "skipped": step_skipped(opt_state) if scaled else jnp.zeros((), bool),
            "grads_finite": jnp.isfinite(norm),
        }
        lr = learning_rate_of(opt_state)
        if lr is not None:
            metrics["learning_rate"] = lr
        for k, v in dict(aux).items():
            metrics[k] = v
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                               rng=state.rng)
        return new_state, metrics

    return step


def _same_dtype(before, after):
    if hasattr(before, "dtype") and before.dtype != after.dtype:
        raise TypeError(f"parameter dtype drifted from {before.dtype} to {after.dtype}")


def make_sharded_step(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    policy: Policy | str = "fp32",
    *,
    mesh,
    strategy: str | Strategy,
    specs,
    shardings,
    has_aux: bool = False,
    allow_unscaled_fp16: bool = False,
    batch_sharding=None,
    donate: bool = True,
) -> ShardedStep:
    """:func:`make_train_step` under a strategy's constraints, jitted with every sharding.

    The step half of :func:`make_sharded_training`, for when the state already exists (or is
    only abstract: ``step.lower(abstract_state, abstract_batch).compile()`` with
    :func:`effijax.sharding.with_shardings` measures a configuration without allocating it).

    Args:
      loss_fn, optimizer, policy, has_aux, allow_unscaled_fp16: as in :func:`make_train_step`.
      mesh, strategy: the mesh and the strategy.
      specs: the parameters' sharded specs (:func:`effijax.sharding.partition_specs`).
      shardings: the state's shardings (:func:`effijax.sharding.state_shardings`).
      batch_sharding, donate: as in :func:`effijax.sharding.jit_sharded`.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from effijax.sharding import make_mesh, partition_specs, state_shardings
      >>> tx, mesh = optax.sgd(0.1), make_mesh()
      >>> loss_fn = lambda p, b, rng: jnp.mean((b["x"] @ p["w"]) ** 2)
      >>> abstract = jax.eval_shape(
      ...     lambda: init_train_state({"w": jnp.zeros((64, 32))}, tx, jax.random.key(0)))
      >>> sh = state_shardings(abstract, mesh, "fsdp")
      >>> step = make_sharded_step(loss_fn, tx, mesh=mesh, strategy="fsdp",
      ...                          specs=partition_specs(abstract.params, mesh), shardings=sh)
      >>> batch = jax.ShapeDtypeStruct((16, 64), jnp.float32)
      >>> compiled = step.lower(abstract, {"x": batch}).compile()
    """
    constrain_params, constrain_grads = constraints(mesh, strategy, specs)
    step = make_train_step(loss_fn, optimizer, policy, has_aux=has_aux,
                           allow_unscaled_fp16=allow_unscaled_fp16,
                           constrain_params=constrain_params, constrain_grads=constrain_grads)
    return jit_sharded(step, mesh, shardings, batch=batch_sharding, donate=donate)


class ShardedTraining(NamedTuple):
    """A train state born sharded and its step, from :func:`make_sharded_training`.

    Attributes:
      state: the initial :class:`TrainState`, each leaf laid out as ``shardings`` says.
      shardings: the ``NamedSharding`` of every state leaf (the step keeps them).
      specs: each parameter's sharded ``PartitionSpec`` (the same for every strategy; what
        FSDP stores and ZeRO shards the optimizer state and gradients by).
      grad_shardings: where the gradients live (sharded for zero2/fsdp, else replicated).
      step: the :class:`~effijax.sharding.ShardedStep` (call ``step(state, batch)``).
      mesh: the mesh.
      strategy: the :class:`~effijax.sharding.Strategy`.
    """

    state: TrainState
    shardings: Any
    specs: Any
    grad_shardings: Any
    step: ShardedStep
    mesh: Any
    strategy: Strategy


def make_sharded_training(
    init_fn: Callable[..., TrainState],
    *args,
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    policy: Policy | str = "fp32",
    mesh,
    strategy: str | Strategy,
    rules: Sequence[tuple] | None = None,
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
    tensor_layout: TensorLayout | None = None,
    has_aux: bool = False,
    allow_unscaled_fp16: bool = False,
    batch_sharding=None,
    donate: bool = True,
) -> ShardedTraining:
    """Data-parallel training under a strategy: born-sharded state + constrained, sharded step.

    The composition of :func:`effijax.sharding.init_sharded` (no device ever holds the whole
    model: ``init_fn`` runs under ``jit`` with the derived ``out_shardings``),
    :func:`effijax.sharding.constraints` (where FSDP gathers weights, where gradients are
    reduced) and :func:`effijax.sharding.jit_sharded` around :func:`make_train_step`. The batch
    is split over ``("data", "fsdp")``: check its size first with
    :func:`effijax.sharding.check_batch`.

    Args:
      init_fn: ``init_fn(*args) -> TrainState``, e.g. ``lambda key: init_train_state(
        init_params(key), optimizer, key)``; traced abstractly first, then run sharded.
      *args: passed to ``init_fn`` (PRNG keys).
      loss_fn, optimizer, policy, has_aux, allow_unscaled_fp16: as in :func:`make_train_step`
        (``optimizer`` must be the one ``init_fn`` initialised the state with).
      mesh: a mesh from :func:`effijax.sharding.make_mesh`.
      strategy: ``ddp``, ``zero1``, ``zero2``, ``fsdp`` (or ``zero3``).
      rules, min_shard_size, tensor_layout: partition rules, as in
        :func:`effijax.sharding.partition_specs` (``tensor_layout``: a model's
        ``tensor_layout()``, for a mesh with a ``tensor`` axis).
      batch_sharding: the batch's sharding (default: split over ``("data", "fsdp")``).
      donate: donate the state to the step.

    Returns:
      A :class:`ShardedTraining`.

    Raises:
      ConfigError: an unknown strategy, a bad mesh or bad rules, before anything is traced.

    Warns:
      ReplicatedParameterWarning: once per large parameter that no dimension lets shard.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from effijax.sharding import make_mesh
      >>> tx = optax.sgd(0.1)
      >>> loss_fn = lambda p, b, rng: jnp.mean((b["x"] @ p["w"] - 1.0) ** 2)
      >>> init = lambda key: init_train_state({"w": jnp.zeros((64, 32))}, tx, key)
      >>> run = make_sharded_training(init, jax.random.key(0), loss_fn=loss_fn, optimizer=tx,
      ...                             mesh=make_mesh(data=2), strategy="fsdp")
      >>> state, metrics = run.step(run.state, {"x": jnp.ones((8, 64))})
      >>> float(metrics["loss"]), state.params["w"].sharding.spec
      (1.0, P('fsdp',))
    """
    strategy = get_strategy(strategy)
    kwargs = {"rules": rules, "min_shard_size": min_shard_size, "tensor_layout": tensor_layout}
    abstract = jax.eval_shape(init_fn, *args)
    specs = partition_specs(abstract.params, mesh, **kwargs)  # warns once per leftover leaf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedParameterWarning)  # already warned above
        state, shardings = init_sharded(init_fn, *args, mesh=mesh, strategy=strategy, **kwargs)
    jitted = make_sharded_step(loss_fn, optimizer, policy, mesh=mesh, strategy=strategy,
                               specs=specs, shardings=shardings, has_aux=has_aux,
                               allow_unscaled_fp16=allow_unscaled_fp16,
                               batch_sharding=batch_sharding, donate=donate)
    return ShardedTraining(state=state, shardings=shardings, specs=specs,
                           grad_shardings=grad_shardings(specs, mesh, strategy), step=jitted,
                           mesh=mesh, strategy=strategy)
