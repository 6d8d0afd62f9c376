"""Per-device bytes of a training state's model states, read from its leaves' shardings: the
same accounting as :func:`~effijax.sharding.memory_report`, without compiling anything.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from effijax.paths import named_leaves
from effijax.sharding._census import _tree_device_bytes
from effijax.sharding._names import Strategy, get_strategy
from effijax.sharding._strategy import _part

__all__ = ["DeviceBytes", "device_bytes"]


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
      >>> from effijax.sharding import make_mesh, state_shardings, with_shardings
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

