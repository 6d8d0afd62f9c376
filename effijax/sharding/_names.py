"""Mesh axes and data-parallel strategies by name: what a config or a command line names, checked
without importing JAX (the meshes and shardings built from them are in ``_mesh`` and
``_strategy``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from effijax.errors import ConfigError

__all__ = ["AXES", "BATCH_AXES", "CONTEXT_AXIS", "parse_mesh", "check_context", "Strategy",
           "STRATEGIES", "get_strategy"]

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
#: The mesh axis that splits the sequence (context parallelism: ring attention,
#: :func:`effijax.models.context_attend`). A mesh has it only when asked for (``context > 1``),
#: between ``fsdp`` and ``tensor``; no parameter is split over it.
CONTEXT_AXIS = "context"


def parse_mesh(spec: str) -> dict[str, int]:
    """Parses a CLI mesh string such as ``"data=2,fsdp=4"`` into :func:`make_mesh` kwargs.

    The axes are :data:`AXES` and :data:`CONTEXT_AXIS` (``"fsdp=2,context=4"``). Axes left
    out keep :func:`make_mesh`'s defaults; ``-1`` is accepted ("the rest").

    Raises:
      ConfigError: an item is not ``axis=int``, the axis is unknown or given twice.

    Example:
      >>> parse_mesh("data=2, fsdp=-1")
      {'data': 2, 'fsdp': -1}
      >>> parse_mesh("fsdp=2,context=4")
      {'fsdp': 2, 'context': 4}
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("mesh", spec, "expected 'axis=size,...', e.g. 'data=2,fsdp=4'")
    out: dict[str, int] = {}
    for item in spec.split(","):
        name, eq, value = (s.strip() for s in item.partition("="))
        if not eq:
            raise ConfigError("mesh", spec, f"item {item.strip()!r} is not 'axis=size'; "
                              "write e.g. 'data=2,fsdp=4'")
        if name not in (*AXES, CONTEXT_AXIS):
            raise ConfigError("mesh", spec, f"unknown axis {name!r}; the axes are "
                              f"{', '.join((*AXES, CONTEXT_AXIS))}")
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


def check_context(mesh_shape: Mapping[str, int], seq_len: int, *, dropout: float = 0.0,
                  load_balanced: bool = True) -> int:
    """Checks, before anything is traced, that a model can train on a mesh with a ``context``
    axis (:data:`CONTEXT_AXIS`); returns the context degree (1: no such axis, nothing checked).

    Each row's ``seq_len`` tokens are split over the axis: into ``context`` contiguous chunks,
    or with ``load_balanced`` (the models' layout for causal masks) into ``2 x context`` chunks,
    device ``i`` holding chunks ``i`` and ``2 x context - 1 - i``. Ring attention has no
    attention dropout.

    Args:
      mesh_shape: the mesh's ``{axis: size}`` (``mesh.shape``, sizes resolved).
      seq_len: tokens per training row (the model's ``seq_len``).
      dropout: the model's dropout rate (attention probabilities and residual branches).
      load_balanced: the sequence is cut into ``2 x context`` chunks, not ``context``.

    Raises:
      ConfigError: naming ``seq_len`` (with multiples that work) or ``dropout``, and the fix.

    Example:
      >>> check_context({"data": 1, "fsdp": 2, "context": 4, "tensor": 1}, 64)
      4
      >>> check_context({"data": 1, "fsdp": 8, "tensor": 1}, 63, dropout=0.1)  # no context
      1
      >>> check_context({"data": 1, "fsdp": 2, "context": 4, "tensor": 1}, 60)
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: seq_len=60: context parallelism cuts each row into \
2 x context = 8 equal chunks (load-balanced: device i holds chunks i and 7 - i), and 8 does \
not divide it; use a multiple of 8 (e.g. 56 or 64), or another context degree
    """
    n = int(mesh_shape.get(CONTEXT_AXIS, 1))
    if n == 1:
        return 1
    parts = 2 * n if load_balanced else n
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ConfigError("seq_len", seq_len, "expected a positive int")
    if seq_len % parts:
        lower, higher = seq_len // parts * parts, (seq_len // parts + 1) * parts
        how = (f"2 x context = {parts} equal chunks (load-balanced: device i holds chunks i and "
               f"{parts - 1} - i)" if load_balanced else f"context = {parts} equal chunks")
        raise ConfigError("seq_len", seq_len, f"context parallelism cuts each row into {how}, "
                          f"and {parts} does not divide it; use a multiple of {parts} (e.g. "
                          f"{f'{lower} or ' if lower else ''}{higher}), or another context "
                          "degree")
    if dropout:
        raise ConfigError("dropout", dropout, f"ring attention over the mesh's context={n} has "
                          "no attention dropout; set the model's dropout to 0, or train "
                          "without a context axis")
    return n



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
