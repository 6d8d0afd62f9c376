"""Small helpers a sharded training job needs around the strategies: gradient shardings,
per-device state bytes without compiling, abstract states that carry their shardings, one
compilation that yields both the executable and its census, and the census grouped for a run's
``summary.json``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from effijax.paths import named_leaves
from effijax.sharding._census import Census, _tree_device_bytes, collective_census
from effijax.sharding._mesh import _check_mesh, replicated
from effijax.sharding._names import Strategy, get_strategy
from effijax.sharding._strategy import _part

__all__ = ["grad_shardings", "DeviceBytes", "device_bytes", "with_shardings", "census_records",
           "compile_with_census"]


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
    rep = replicated(mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s) if strategy.shard_grads else rep,
                        specs, is_leaf=lambda x: isinstance(x, P))


@dataclasses.dataclass(frozen=True)
class DeviceBytes:
    """Per-device bytes of a training state's model states (no compilation involved).

    Attributes:
      params, opt_state, other_state: bytes of the state's leaves on one device (``other_state``
        is the step counter, the PRNG key and anything else).
      grads: bytes of the gradients on one device (0 when no gradient shardings were given).
      replicated: bytes of parameter-shaped leaves (params, grads, optimizer moments) that stay
        whole on every device although the strategy shards their group: the leftovers
        (leaves below the automatic rule's ``min_shard_size``, or with no divisible dimension).
      model_states: ``params + grads + opt_state``.
    """

    params: int
    grads: int
    opt_state: int
    other_state: int
    replicated: int
    model_states: int = dataclasses.field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "model_states", self.params + self.grads + self.opt_state)


def _leaf_device_bytes(shape, dtype, sharding) -> int:
    shape = tuple(shape)
    if sharding is not None:
        shape = sharding.shard_shape(shape)
    return math.prod(shape) * np.dtype(dtype).itemsize


def device_bytes(state, *, grad_shardings=None, strategy: str | Strategy | None = None
                 ) -> DeviceBytes:
    """Per-device bytes of ``state`` (arrays, or ``ShapeDtypeStruct`` s with shardings).

    The same accounting as :func:`~effijax.sharding.memory_report`, without a compiled step:
    what one device stores of each leaf, read from the leaves' shardings.

    Args:
      state: a ``TrainState`` (anything with ``params`` and ``opt_state``).
      grad_shardings: the gradients' shardings (:func:`grad_shardings`); gradients take the
        parameters' dtypes.
      strategy: when given, ``replicated`` counts the parameter-shaped leaves of the groups
        that ``strategy`` shards but that stayed whole.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from effijax.sharding import make_mesh, state_shardings
      >>> tx, mesh = optax.adam(1e-3), make_mesh()
      >>> init = lambda: {"params": {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)},
      ...                 "opt_state": tx.init({"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)})}
      >>> abstract = jax.eval_shape(init)
      >>> sh = state_shardings(abstract, mesh, "fsdp")
      >>> b = device_bytes(with_shardings(abstract, sh), strategy="fsdp",
      ...                  grad_shardings=sh["params"])
      >>> b.params, b.grads, b.replicated  # w: 8192 B / 8; b (128 B) stays whole in 4 places
      (1152, 1152, 512)
    """
    params = _part(state, "params")
    opt_state = _part(state, "opt_state")
    total = _tree_device_bytes(state)
    p, o = _tree_device_bytes(params), _tree_device_bytes(opt_state)
    grads = replicated_bytes = 0
    param_leaves = named_leaves(params)
    if grad_shardings is not None:
        for (_, leaf), (_, sh) in zip(param_leaves, named_leaves(grad_shardings), strict=True):
            nbytes = _leaf_device_bytes(leaf.shape, leaf.dtype, sh)
            grads += nbytes
            if strategy is not None and get_strategy(strategy).shard_grads \
                    and sh.is_fully_replicated and leaf.ndim:
                replicated_bytes += nbytes
    if strategy is not None:
        strategy = get_strategy(strategy)
        shapes = {tuple(leaf.shape) for _, leaf in param_leaves if leaf.ndim}

        def whole(leaf) -> bool:
            sh = getattr(leaf, "sharding", None)
            return sh is None or sh.is_fully_replicated

        if strategy.shard_params:
            replicated_bytes += sum(_leaf_device_bytes(x.shape, x.dtype, None)
                                    for _, x in param_leaves if x.ndim and whole(x))
        if strategy.shard_opt_state:
            replicated_bytes += sum(
                _leaf_device_bytes(x.shape, x.dtype, None) for _, x in named_leaves(opt_state)
                if hasattr(x, "shape") and x.ndim and tuple(x.shape) in shapes and whole(x))
    return DeviceBytes(params=p, grads=grads, opt_state=o, other_state=total - p - o,
                       replicated=replicated_bytes)


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


def census_records(census: Census) -> list[dict]:
    """The census grouped by ``(kind, dtype)``: ``count``, ``bytes``, ``wire_bytes`` per device.

    Bytes follow :class:`~effijax.sharding.Collective`: ``bytes`` is the full tensor each
    collective works on, ``wire_bytes`` what a ring sends per device.

    Example:
      >>> from effijax.sharding import Census, Collective
      >>> c = Census(ops=(Collective("all-gather", "bf16", (64, 32), 4096, 8, 3584.0,
      ...                            "all-gather", "ag"),) * 2)
      >>> census_records(c)
      [{'kind': 'all-gather', 'dtype': 'bf16', 'count': 2, 'bytes': 8192, 'wire_bytes': 7168.0}]
    """
    groups: dict[tuple[str, str], dict] = {}
    for c in census.ops:
        row = groups.setdefault((c.kind, c.dtype), {"kind": c.kind, "dtype": c.dtype,
                                                     "count": 0, "bytes": 0,
                                                     "wire_bytes": 0.0})
        row["count"] += 1
        row["bytes"] += c.bytes
        row["wire_bytes"] += c.wire_bytes
    return list(groups.values())


class _Keep:
    """Stands in for a jitted function: :func:`collective_census` lowers through ``.lower`` and
    compiles the lowering (with its dump options); this keeps the executable it compiles."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = None

    def lower(self, *args, **kwargs):
        return _KeptLowering(self, self.fn.lower(*args, **kwargs))


class _KeptLowering:
    def __init__(self, keep: _Keep, lowered):
        self._keep = keep
        self._lowered = lowered

    def compile(self, *args, **kwargs):
        self._keep.compiled = self._lowered.compile(*args, **kwargs)
        return self._keep.compiled

    def __getattr__(self, name):  # as_text and the rest: the real lowering's
        return getattr(self._lowered, name)


def compile_with_census(fn, *args, **kwargs):
    """Compiles ``fn(*args)`` once and returns ``(compiled, census)``.

    :func:`~effijax.sharding.collective_census` compiles the program a second time (with XLA
    dumping the partitioned module) next to the one ``jit`` runs; here the census' compilation
    is the executable: call ``compiled(*args)`` to run the step (donation and shardings as
    lowered; no mesh context needed). XLA's dump options change what is written to disk, not
    the program.

    Args:
      fn: a ``jax.jit`` function or :class:`~effijax.sharding.ShardedStep` (anything with
        ``.lower``).
      *args, **kwargs: arrays or ``jax.ShapeDtypeStruct`` s with shardings.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> from effijax.sharding import make_mesh
      >>> mesh = make_mesh()
      >>> f = jax.jit(lambda w: w * 2.0, in_shardings=NamedSharding(mesh, P("fsdp")),
      ...             out_shardings=NamedSharding(mesh, P()))
      >>> compiled, census = compile_with_census(f, jax.ShapeDtypeStruct((64, 4), jnp.float32))
      >>> census.count("all-gather"), float(compiled(jnp.ones((64, 4)))[0, 0])
      (1, 2.0)
    """
    if not hasattr(fn, "lower"):
        raise TypeError(f"fn must be jitted (have .lower), got {type(fn).__name__}")
    keep = _Keep(fn)
    census = collective_census(keep, *args, **kwargs)
    return keep.compiled, census
