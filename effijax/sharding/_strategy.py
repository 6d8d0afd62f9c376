"""ZeRO/FSDP strategies: one knob that decides what is sharded, and the shardings it implies.

On a ``(data, fsdp, tensor)`` mesh the batch is always split over ``("data", "fsdp")``. The
strategy decides which of the model state is split over ``fsdp`` (and replicated over ``data``:
with ``data=2, fsdp=4`` each group of 4 devices holds one sharded copy):

========  ===========  ==============================  =================================
name      parameters   gradients (constraint)          optimizer state
========  ===========  ==============================  =================================
ddp       replicated   replicated (all-reduce)         replicated
zero1     replicated   replicated (all-reduce)         sharded like its parameter
zero2     replicated   sharded (reduce-scatter)        sharded like its parameter
fsdp      sharded      sharded (reduce-scatter)        sharded like its parameter
========  ===========  ==============================  =================================

"Replicated" means over ``data`` and ``fsdp``: a weight the model's tensor layout splits over
the ``tensor`` axis (:mod:`effijax.sharding._tensor`) stays split there under every strategy
(:func:`tensor_only`), as do its gradient and optimizer state. (``zero3`` is an alias of
``fsdp``.) ZeRO-1/2 compute the update on the shard and all-gather
the new parameters back to replicated (the ``out_shardings`` say so); FSDP keeps them sharded
and gathers them, in the compute dtype, where the forward and backward passes use them.

Shardings are derived, never left to chance: :func:`state_shardings` covers every leaf of a
``TrainState`` (optimizer-state leaves get their parameter's spec, matched by tree path; scalars
and PRNG keys an explicit replicated sharding), :func:`init_sharded` creates the state born
sharded, and :func:`assert_sharded_like_params` catches the jax pitfall of a replicated
optimizer state (``jax.jit(optimizer.init)`` can return one).

This module sits below ``effijax.step``: it provides the pieces (:func:`constraints`,
:func:`jit_sharded`) that the train step composes; see :func:`jit_sharded`'s example.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from effijax.errors import ConfigError
from effijax.paths import map_with_path, named_leaves
from effijax.sharding._mesh import _check_mesh, batch_sharding, replicated
from effijax.sharding._names import BATCH_AXES, Strategy, get_strategy
from effijax.sharding._rules import DEFAULT_MIN_SHARD_SIZE, partition_specs
from effijax.sharding._tensor import TensorLayout

__all__ = [
    "param_shardings",
    "state_shardings",
    "assert_sharded_like_params",
    "init_sharded",
    "constraints",
    "jit_sharded",
    "ShardedStep",
    "grad_shardings",
    "with_shardings",
    "tensor_only",
    "match_param",
]


def _rule_kwargs(rules, logical_axes, min_shard_size, tensor_layout) -> dict:
    return {"rules": rules, "logical_axes": logical_axes, "min_shard_size": min_shard_size,
            "tensor_layout": tensor_layout}


def tensor_only(spec: P) -> P:
    """``spec`` without its ``data``/``fsdp`` entries: how a strategy that does not shard a
    leaf over ``fsdp`` still lays it out (tensor parallelism is the model's layout, not a
    strategy's choice); ``P()`` on a mesh without a tensor split.

    Example:
      >>> tensor_only(P(None, "fsdp", "tensor")), tensor_only(P("fsdp"))
      (P(None, None, 'tensor'), P())
    """
    entries = []
    for entry in spec:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        kept = tuple(a for a in axes if a not in BATCH_AXES)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def param_shardings(
    abstract_params,
    mesh: Mesh,
    strategy: str | Strategy,
    *,
    rules: Sequence[tuple] | None = None,
    logical_axes: Mapping[str, Any] | None = None,
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
    tensor_layout: TensorLayout | None = None,
):
    """``NamedSharding`` of every parameter under ``strategy`` (sharded over ``fsdp`` only for
    FSDP; a tensor-parallel split is kept by every strategy, see :func:`tensor_only`).

    The rule arguments are those of :func:`~effijax.sharding.partition_specs`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from effijax.sharding import make_mesh
      >>> params = {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32)}
      >>> param_shardings(params, make_mesh(), "fsdp")["w"].spec
      P('fsdp',)
      >>> param_shardings(params, make_mesh(), "zero2")["w"].spec
      P()
    """
    strategy = get_strategy(strategy)
    specs = partition_specs(abstract_params, mesh,
                            **_rule_kwargs(rules, logical_axes, min_shard_size, tensor_layout))
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s if strategy.shard_params else tensor_only(s)),
        specs, is_leaf=lambda x: isinstance(x, P))


def _part(tree, name: str):
    if hasattr(tree, name):
        return getattr(tree, name)
    if isinstance(tree, Mapping) and name in tree:
        return tree[name]
    raise ConfigError("state", type(tree).__name__, f"expected a TrainState-like value with "
                      f"a {name!r} field (step, params, opt_state, rng)")


def match_param(path: str, param_paths: Sequence[str]) -> str | None:
    """The longest parameter path that is a '/'-suffix of an optimizer-state leaf path (the
    parameter whose layout the leaf takes when their shapes agree).

    Example:
      >>> match_param("0/mu/blocks/w", ["w", "blocks/w", "b"])
      'blocks/w'
    """
    best = None
    for p in param_paths:
        if (path == p or path.endswith("/" + p)) and (best is None or len(p) > len(best)):
            best = p
    return best


def state_shardings(
    abstract_state,
    mesh: Mesh,
    strategy: str | Strategy,
    *,
    rules: Sequence[tuple] | None = None,
    logical_axes: Mapping[str, Any] | None = None,
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
    tensor_layout: TensorLayout | None = None,
):
    """``NamedSharding`` of every leaf of a ``TrainState`` (step, params, opt_state, rng).

    * ``params``: as :func:`param_shardings`;
    * ``opt_state``: a leaf whose path ends with a parameter's path (on a '/' boundary; the
      longest such parameter) and whose shape equals that parameter's gets the parameter's
      sharded spec when the strategy shards optimizer state (zero1, zero2, fsdp): Adam's
      ``.../mu/blocks/w``, ``MultiSteps``' ``acc_grads/blocks/w``, states inside
      ``dynamic_loss_scale``'s ``inner_state``. Everything else (counts, loss scales) is
      replicated;
    * ``step``, ``rng`` and any other leaf: an explicit replicated ``NamedSharding`` on ``mesh``
      (a leaf without one lands on a single device and breaks ``jit``).

    Args:
      abstract_state: a ``TrainState`` (or anything with ``params`` and ``opt_state``), usually
        from ``jax.eval_shape``.
      mesh, strategy: as in :func:`param_shardings`; rule arguments as in
        :func:`~effijax.sharding.partition_specs`.

    Returns:
      A pytree of ``NamedSharding`` with the structure of ``abstract_state``.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from effijax.sharding import make_mesh
      >>> state = {"params": {"w": jnp.zeros((64, 32))}, "opt_state": None, "rng": None}
      >>> state["opt_state"] = optax.adam(1e-3).init(state["params"])
      >>> sh = state_shardings(jax.eval_shape(lambda: state), make_mesh(), "zero1")
      >>> sh["params"]["w"].spec, sh["opt_state"][0].mu["w"].spec, sh["opt_state"][0].count.spec
      (P(), P('fsdp',), P())
    """
    strategy = get_strategy(strategy)
    _check_mesh(mesh)
    params = _part(abstract_state, "params")
    _part(abstract_state, "opt_state")
    kwargs = _rule_kwargs(rules, logical_axes, min_shard_size, tensor_layout)
    specs = dict(named_leaves(partition_specs(params, mesh, **kwargs),
                              is_leaf=lambda x: isinstance(x, P)))
    shapes = {path: tuple(leaf.shape) for path, leaf in named_leaves(params)}
    rep = replicated(mesh)

    def sharding_of(path: str, leaf):
        head, _, rest = path.partition("/")
        if head == "params" and rest in specs:
            spec = specs[rest]
            return NamedSharding(mesh, spec if strategy.shard_params else tensor_only(spec))
        if head == "opt_state" and hasattr(leaf, "shape"):
            match = match_param(rest, list(specs))
            if match is not None and tuple(leaf.shape) == shapes[match]:
                spec = specs[match]
                return NamedSharding(mesh, spec if strategy.shard_opt_state
                                     else tensor_only(spec))
        return rep

    return map_with_path(sharding_of, abstract_state)


def _sharding_of(leaf):
    if isinstance(leaf, jax.Array):
        return leaf.sharding
    return getattr(leaf, "sharding", None)


def assert_sharded_like_params(state, shardings) -> None:
    """Raises if any leaf of ``state`` is not laid out as ``shardings`` says.

    The guard against jax's silent fallback: ``jax.jit(optimizer.init)(sharded_params)`` can
    return a fully replicated optimizer state, which costs the whole ZeRO saving without an
    error. Works on real arrays and on abstract leaves that carry a ``sharding``.

    Args:
      state: a ``TrainState`` of arrays (or ``ShapeDtypeStruct`` s with shardings).
      shardings: the expected shardings, from :func:`state_shardings`.

    Raises:
      ValueError: naming each offending leaf path (up to 8), the parameter it was matched to,
        the sharding it has and the one it should have.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from effijax.sharding import make_mesh, replicated
      >>> mesh, tx = make_mesh(), optax.adam(1e-3)
      >>> init = lambda: {"params": {"w": jnp.zeros((64, 32))},
      ...                 "opt_state": tx.init({"w": jnp.zeros((64, 32))})}
      >>> sh = state_shardings(jax.eval_shape(init), mesh, "zero1")
      >>> assert_sharded_like_params(jax.jit(init, out_shardings=sh)(), sh)  # fine
      >>> bad = jax.jit(init, out_shardings=replicated(mesh))()
      >>> assert_sharded_like_params(bad, sh)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: 2 state leaves ...: opt_state/0/mu/w (parameter 'w') is replicated, ...
    """
    param_paths = [p for p, _ in named_leaves(_part(state, "params"))]
    problems = []

    def check(path: str, leaf, expected):
        if not hasattr(leaf, "shape"):
            return
        actual = _sharding_of(leaf)
        ndim = len(leaf.shape)
        if actual is not None and actual.is_equivalent_to(expected, ndim):
            return
        head, _, rest = path.partition("/")
        match = rest if head == "params" else match_param(rest, param_paths)
        where = f"{path} (parameter {match!r})" if match else path
        if actual is None:
            has = "has no sharding"
        elif actual.device_set != expected.device_set:
            has = f"lives on {len(actual.device_set)} device(s), not the mesh's " \
                  f"{len(expected.device_set)}"
        elif actual.is_fully_replicated:
            has = "is replicated"
        else:
            has = f"is sharded as {getattr(actual, 'spec', actual)}"
        # Leaves that should be sharded but are not (the costly case) are listed first.
        problems.append((expected.is_fully_replicated, f"{where} {has}, expected {expected.spec}"))

    map_with_path(check, state, shardings)
    if problems:
        problems = [text for _, text in sorted(problems, key=lambda p: p[0])]
        shown = "; ".join(problems[:8])
        raise ValueError(
            f"{len(problems)} state leaves are not sharded as derived from their parameters: "
            f"{shown}{'; ...' if len(problems) > 8 else ''}. Create the state with "
            "effijax.sharding.init_sharded (jit with out_shardings=state_shardings(...)); "
            "jax.jit(optimizer.init) alone may replicate the optimizer state."
        )


def init_sharded(
    init_fn: Callable,
    *args,
    mesh: Mesh,
    strategy: str | Strategy,
    rules: Sequence[tuple] | None = None,
    logical_axes: Mapping[str, Any] | None = None,
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
    tensor_layout: TensorLayout | None = None,
):
    """Runs ``init_fn(*args)`` born sharded: no device ever holds the whole model.

    Shapes come from ``jax.eval_shape``, shardings from :func:`state_shardings`, and the
    initialiser runs under ``jax.jit(init_fn, out_shardings=...)``, so each device computes only
    its shards (jax's partitionable threefry makes random init shard-local). The result is
    checked with :func:`assert_sharded_like_params`.

    Args:
      init_fn: returns a ``TrainState`` (anything with ``params`` and ``opt_state``), e.g.
        ``lambda key: init_train_state(init_params(key), optimizer, key)``.
      *args: passed to ``init_fn`` (e.g. a PRNG key).
      mesh, strategy: as in :func:`state_shardings`; rule arguments as in
        :func:`~effijax.sharding.partition_specs`.

    Returns:
      ``(state, shardings)``: the sharded state and the tree of its ``NamedSharding`` s (pass
      it to :func:`jit_sharded`).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from effijax.sharding import make_mesh
      >>> tx = optax.adam(1e-3)
      >>> def init(key):
      ...     params = {"w": jax.random.normal(key, (64, 32))}
      ...     return {"params": params, "opt_state": tx.init(params), "rng": key}
      >>> state, sh = init_sharded(init, jax.random.key(0), mesh=make_mesh(), strategy="fsdp")
      >>> state["params"]["w"].addressable_shards[0].data.shape
      (8, 32)
    """
    abstract = jax.eval_shape(init_fn, *args)
    shardings = state_shardings(abstract, mesh, strategy,
                                **_rule_kwargs(rules, logical_axes, min_shard_size, tensor_layout))
    state = jax.jit(init_fn, out_shardings=shardings)(*args)
    assert_sharded_like_params(state, shardings)
    return state, shardings


def constraints(mesh: Mesh, strategy: str | Strategy, specs) -> tuple[Callable | None,
                                                                      Callable | None]:
    """The ``(constrain_params, constrain_grads)`` hooks of ``effijax.step.make_train_step``.

    * ``constrain_params`` (fsdp only, else None): pins the *compute-dtype* parameters to their
      sharded spec right after the policy's cast, so the all-gather happens where a matmul uses
      the weight, in the compute dtype (bf16 under a bf16 policy; checked in the
      post-partitioning HLO). Unpinned, the gather's place is XLA's choice; when anything asks
      for the cast weight replicated, XLA hoists the gather above the cast and moves f32 bytes
      (observed on jax 0.10.2).
    * ``constrain_grads``: zero2/fsdp pin the gradients to the sharded spec (so the reduction
      is a reduce-scatter and the optimizer runs on the shard); ddp/zero1 pin them replicated
      (an all-reduce).

    Reduction dtype: XLA's partitioner reduces a weight gradient where the backward matmul
    produces its partial sums, in that matmul's output dtype: the compute dtype for a plain
    ``x @ w`` in bf16, f32 for ``effijax.precision.dot`` (f32 accumulation). A cast placed at
    this constraint does not move the collective (checked on jax 0.10.2: casting f32 grads to
    bf16 before the constraint still left an f32 all-reduce), so there is no ``reduce_dtype``
    knob here: choose it in the model through the matmul's accumulation dtype. (Under FSDP
    f32 accumulation has a price: the backward's input-gradient matmul multiplies the f32
    cotangent by the weight converted to f32, and XLA gathers that weight again, in f32.)

    Args:
      mesh: the mesh.
      strategy: a strategy name or :class:`Strategy`.
      specs: the sharded specs, from :func:`~effijax.sharding.partition_specs` (the same for
        every strategy).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from effijax.sharding import make_mesh, partition_specs
      >>> mesh = make_mesh()
      >>> specs = partition_specs({"w": jnp.zeros((64, 32))}, mesh)
      >>> cp, cg = constraints(mesh, "zero2", specs)
      >>> cp is None, jax.jit(cg)({"w": jnp.ones((64, 32))})["w"].sharding.spec
      (True, P('fsdp',))
    """
    strategy = get_strategy(strategy)
    _check_mesh(mesh)
    is_spec = lambda x: isinstance(x, P)
    sharded = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)

    def pin(tree, shardings):
        return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)

    def constrain_sharded(tree):
        return pin(tree, sharded)

    unsharded = jax.tree.map(lambda s: NamedSharding(mesh, tensor_only(s)), specs,
                             is_leaf=is_spec)

    def constrain_unsharded(tree):
        return pin(tree, unsharded)

    constrain_params = constrain_sharded if strategy.shard_params else None
    constrain_grads = constrain_sharded if strategy.shard_grads else constrain_unsharded
    return constrain_params, constrain_grads


@dataclasses.dataclass(frozen=True)
class ShardedStep:
    """A jitted step that is called and lowered under ``jax.set_mesh(mesh)``.

    The mesh context lets :func:`~effijax.sharding.constrain_batch` inside the model see the
    mesh (``jax.set_mesh`` cannot be entered inside ``jit``).

    Attributes:
      jitted: the ``jax.jit`` -wrapped step.
      mesh: the mesh entered around each call.
    """

    jitted: Any
    mesh: Mesh

    def __call__(self, *args):
        with jax.set_mesh(self.mesh):
            return self.jitted(*args)

    def lower(self, *args):
        """``jitted.lower(*args)`` under the mesh (for compile checks and the census)."""
        with jax.set_mesh(self.mesh):
            return self.jitted.lower(*args)


def jit_sharded(step: Callable, mesh: Mesh, shardings, *, batch=None,
                donate: bool = True) -> ShardedStep:
    """``jax.jit`` of ``step(state, batch) -> (state, metrics)`` with every sharding explicit.

    ``in_shardings=(shardings, batch)``, ``out_shardings=(shardings, replicated)`` (so the
    state keeps its layout across steps: ZeRO-1/2 all-gather the new parameters back to
    replicated), ``donate_argnums=0`` (the old state's buffers are reused).

    Args:
      step: e.g. ``effijax.step.make_train_step(loss_fn, tx, policy,
        constrain_params=cp, constrain_grads=cg)`` with ``cp, cg`` from :func:`constraints`.
      mesh: the mesh.
      shardings: the state's shardings (from :func:`init_sharded` / :func:`state_shardings`).
      batch: the batch's sharding (a prefix for the batch pytree); default
        :func:`~effijax.sharding.batch_sharding`. Check sizes first with
        :func:`~effijax.sharding.check_batch`.
      donate: donate the input state.

    Returns:
      A :class:`ShardedStep` (call it like the step; ``.lower`` for inspection).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from effijax.sharding import make_mesh, partition_specs, check_batch, init_sharded
      >>> from effijax.step import init_train_state, make_train_step
      >>> mesh, tx = make_mesh(), optax.sgd(0.1)
      >>> loss_fn = lambda p, b, rng: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
      >>> init = lambda key: init_train_state({"w": jnp.zeros((64, 32))}, tx, key)
      >>> state, sh = init_sharded(init, jax.random.key(0), mesh=mesh, strategy="fsdp")
      >>> cp, cg = constraints(mesh, "fsdp", partition_specs(state.params, mesh))
      >>> step = jit_sharded(make_train_step(loss_fn, tx, "fp32", constrain_params=cp,
      ...                                    constrain_grads=cg), mesh, sh)
      >>> batch = {"x": jnp.ones((16, 64)), "y": jnp.ones((16, 32))}
      >>> check_batch(batch, mesh)
      >>> state, metrics = step(state, batch)
      >>> float(metrics["loss"]), state.params["w"].sharding.spec
      (1.0, P('fsdp',))
    """
    _check_mesh(mesh)
    if not callable(step):
        raise ConfigError("step", type(step).__name__, "must be callable")
    batch = batch_sharding(mesh) if batch is None else batch
    jitted = jax.jit(
        step,
        in_shardings=(shardings, batch),
        out_shardings=(shardings, replicated(mesh)),
        donate_argnums=(0,) if donate else (),
    )
    return ShardedStep(jitted, mesh)


def grad_shardings(specs, mesh: Mesh, strategy: str | Strategy):
    """Where the gradients live under ``strategy``: sharded for zero2/fsdp, else replicated.

    Args:
      specs: the parameters' sharded specs (:func:`~effijax.sharding.partition_specs`).
      mesh: the mesh.
      strategy: a strategy name or :class:`~effijax.sharding.Strategy`.

    Returns:
      A tree of ``NamedSharding`` shaped like the parameters (what
      :func:`~effijax.sharding.memory_report` takes as ``grad_shardings``).

    Example:
      >>> from jax.sharding import PartitionSpec as P
      >>> from effijax.sharding import make_mesh
      >>> mesh = make_mesh()
      >>> grad_shardings({"w": P("fsdp")}, mesh, "zero2")["w"].spec
      P('fsdp',)
      >>> grad_shardings({"w": P("fsdp")}, mesh, "zero1")["w"].spec
      P()
    """
    strategy = get_strategy(strategy)
    _check_mesh(mesh)
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s if strategy.shard_grads else tensor_only(s)),
        specs, is_leaf=lambda x: isinstance(x, P))


def with_shardings(tree, shardings):
    """``jax.ShapeDtypeStruct`` s of ``tree``'s leaves carrying ``shardings`` (for ``lower``,
    :func:`device_bytes`, :func:`~effijax.sharding.memory_report`); touches no buffer, so it
    works on donated arrays too.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from effijax.sharding import make_mesh, replicated
      >>> with_shardings({"w": jnp.zeros(3)}, {"w": replicated(make_mesh())})["w"].shape
      (3,)
    """
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)

