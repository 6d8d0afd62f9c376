"""Mesh axes and data-parallel strategies by name: what a config or a command line names, checked
without importing JAX (the meshes and shardings built from them are in ``_mesh`` and
``_strategy``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from effijax.errors import ConfigError

__all__ = ["AXES", "BATCH_AXES", "parse_mesh", "Strategy", "STRATEGIES", "get_strategy"]

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def parse_mesh(spec: str) -> dict[str, int]:
    """Parses a CLI mesh string such as ``"data=2,fsdp=4"`` into :func:`make_mesh` kwargs.

    Axes left out keep :func:`make_mesh`'s defaults; ``-1`` is accepted ("the rest").

    Raises:
      ConfigError: an item is not ``axis=int``, the axis is unknown or given twice.

    Example:
      >>> parse_mesh("data=2, fsdp=-1")
      {'data': 2, 'fsdp': -1}
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("mesh", spec, "expected 'axis=size,...', e.g. 'data=2,fsdp=4'")
    out: dict[str, int] = {}
    for item in spec.split(","):
        name, eq, value = (s.strip() for s in item.partition("="))
        if not eq:
            raise ConfigError("mesh", spec, f"item {item.strip()!r} is not 'axis=size'; "
                              "write e.g. 'data=2,fsdp=4'")
        if name not in AXES:
            raise ConfigError("mesh", spec, f"unknown axis {name!r}; the axes are "
                              f"{', '.join(AXES)}")
        if name in out:
            raise ConfigError("mesh", spec, f"axis {name!r} is given twice")
        try:
            size = int(value)
        except ValueError:
            raise ConfigError("mesh", spec, f"size of {name!r} must be an int, got "
                              f"{value!r}") from None
        if size < 1 and size != -1:
            raise ConfigError("mesh", spec, f"size of {name!r} must be >= 1 or -1, got {size}")
        out[name] = size
    return out



@dataclasses.dataclass(frozen=True)
class Strategy:
    """What a data-parallel strategy shards over the ``fsdp`` axis.

    Attributes:
      name: the canonical name (``ddp``, ``zero1``, ``zero2``, ``fsdp``).
      shard_opt_state: optimizer-state leaves shaped like a parameter take its sharded spec.
      shard_grads: gradients are constrained to the sharded spec before the optimizer.
      shard_params: the parameters themselves are stored sharded.

    Example:
      >>> get_strategy("zero3") == STRATEGIES["fsdp"]
      True
      >>> get_strategy("zero2").shard_grads, get_strategy("zero2").shard_params
      (True, False)
    """

    name: str
    shard_opt_state: bool
    shard_grads: bool
    shard_params: bool


STRATEGIES: Mapping[str, Strategy] = {
    "ddp": Strategy("ddp", False, False, False),
    "zero1": Strategy("zero1", True, False, False),
    "zero2": Strategy("zero2", True, True, False),
    "fsdp": Strategy("fsdp", True, True, True),
}
_ALIASES = {"zero3": "fsdp"}


def get_strategy(strategy: str | Strategy) -> Strategy:
    """Looks a strategy up by name (``ddp``, ``zero1``, ``zero2``, ``fsdp``/``zero3``).

    Raises:
      ConfigError: an unknown name; the message lists the accepted ones.

    Example:
      >>> get_strategy("fsdp").name
      'fsdp'
      >>> get_strategy("zero4")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: strategy='zero4': unknown strategy; accepted: ddp, zero1, ...
    """
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, str):
        key = strategy.strip().lower()
        key = _ALIASES.get(key, key)
        if key in STRATEGIES:
            return STRATEGIES[key]
    accepted = ", ".join([*STRATEGIES, *_ALIASES])
    raise ConfigError("strategy", strategy, f"unknown strategy; accepted: {accepted}")
