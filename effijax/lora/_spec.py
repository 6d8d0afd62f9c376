"""The LoRA spec: which kernels get adapters, of which rank, scaled by how much.

A :class:`LoraSpec` is an immutable value, validated when it is built. It selects parameters by
their '/'-joined path (see :mod:`effijax.paths`), so ``r"attn/(q|v)/kernel"`` means the same thing
here as in a precision override or a sharding rule.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from effijax.errors import ConfigError
from effijax.paths import compile_pattern

__all__ = ["LoraSpec", "INITS"]

INITS = ("kaiming", "gaussian")


def _is_positive_int(x) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool) and x > 0


def _is_positive_number(x) -> bool:
    return (isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool)
            and math.isfinite(x) and x > 0)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Which parameters get low-rank adapters, and how the update ``s·(x a) b`` is scaled.

    For a kernel ``w`` of shape ``(..., d_in, d_out)`` (Flax layout; leading stacked axes such as
    the GPT's layer axis are kept) the adapter is ``a: (..., d_in, r)``, ``b: (..., r, d_out)`` and
    the adapted layer computes ``x @ w + scale * (x @ a) @ b``, i.e. ``w + scale * a @ b``.

    Attributes:
      rank: the adapter rank ``r`` (PEFT's default 8).
      alpha: ``lora_alpha``; the update is scaled by ``alpha / r`` (PEFT's default alpha 8).
      targets: a regex matched with ``re.search`` against '/'-joined parameter paths, or a
        predicate ``(path, leaf) -> bool``. Every target must be a >= 2-D floating kernel.
      overrides: ``((path_regex, rank, alpha), ...)``; the first regex that matches a target's
        path gives it its own rank and alpha (PEFT's ``rank_pattern`` / ``alpha_pattern``).
      rslora: scale by ``alpha / sqrt(r)`` (rank-stabilised LoRA) instead of ``alpha / r``.
      dropout: dropout rate on the adapter's input ``x`` (the base path sees ``x`` unchanged).
      init: ``"kaiming"`` (PEFT's default: ``a`` uniform in ``±1/sqrt(d_in)``, ``b`` zero, so the
        model is unchanged at init) or ``"gaussian"`` (``a`` normal with std ``1/r``, ``b`` zero).
      dtype: the adapters' storage dtype (f32: adapters and their optimizer state stay f32 even
        when the frozen base is bf16).

    Example:
      >>> spec = LoraSpec(rank=4, alpha=8.0, overrides=((r"mlp", 2, 4.0),))
      >>> spec.scale_for("blocks/attn/q/kernel"), spec.rank_for("blocks/mlp/fc_in/kernel")
      (2.0, 2)
      >>> LoraSpec(rank=4, alpha=8.0, rslora=True).scale_for("any/kernel")
      4.0
      >>> LoraSpec(rank=0)
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: rank=0: must be a positive int (PEFT's default is 8)
    """

    rank: int = 8
    alpha: float = 8.0
    targets: str | Callable[[str, Any], bool] = r"attn/(q|v)/kernel"
    overrides: tuple = ()
    rslora: bool = False
    dropout: float = 0.0
    init: str = "kaiming"
    dtype: Any = jnp.float32

    def __post_init__(self):
        if not _is_positive_int(self.rank):
            raise ConfigError("rank", self.rank, "must be a positive int (PEFT's default is 8)")
        object.__setattr__(self, "rank", int(self.rank))
        if not _is_positive_number(self.alpha):
            raise ConfigError("alpha", self.alpha, "must be a positive finite number")
        object.__setattr__(self, "alpha", float(self.alpha))
        if isinstance(self.targets, str):
            compile_pattern(self.targets, field="targets")
        elif not callable(self.targets):
            raise ConfigError(
                "targets", self.targets,
                "must be a regex string over '/'-joined paths (e.g. r'attn/(q|v)/kernel') or a "
                "predicate (path, leaf) -> bool",
            )
        rules = []
        for i, rule in enumerate(self.overrides):
            if not (isinstance(rule, tuple | list) and len(rule) == 3):
                raise ConfigError(f"overrides[{i}]", rule, "expected (path_regex, rank, alpha)")
            pattern, rank, alpha = rule
            if not isinstance(pattern, str):
                raise ConfigError(f"overrides[{i}]", rule, "the path regex must be a str")
            compile_pattern(pattern, field=f"overrides[{i}]")
            if not _is_positive_int(rank):
                raise ConfigError(f"overrides[{i}]", rule, "rank must be a positive int")
            if not _is_positive_number(alpha):
                raise ConfigError(f"overrides[{i}]", rule, "alpha must be a positive number")
            rules.append((pattern, int(rank), float(alpha)))
        object.__setattr__(self, "overrides", tuple(rules))
        if not isinstance(self.rslora, bool):
            raise ConfigError("rslora", self.rslora, "must be a bool")
        if not (isinstance(self.dropout, int | float) and not isinstance(self.dropout, bool)
                and 0.0 <= self.dropout < 1.0):
            raise ConfigError("dropout", self.dropout, "must be a rate in [0, 1)")
        object.__setattr__(self, "dropout", float(self.dropout))
        if self.init not in INITS:
            raise ConfigError("init", self.init, f"must be one of {list(INITS)}")
        try:
            dtype = jnp.dtype(self.dtype)
        except TypeError as e:
            raise ConfigError("dtype", self.dtype, f"not a dtype ({e})") from e
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ConfigError("dtype", self.dtype, "adapters need a floating dtype (float32)")
        object.__setattr__(self, "dtype", dtype)

    def matches(self, path: str, leaf: Any = None) -> bool:
        """Whether ``targets`` selects the parameter at ``path``.

        Example:
          >>> LoraSpec().matches("blocks/attn/q/kernel"), LoraSpec().matches("blocks/attn/k/kernel")
          (True, False)
        """
        if isinstance(self.targets, str):
            return re.search(self.targets, path) is not None
        return bool(self.targets(path, leaf))

    def _override(self, path: str) -> tuple[int, float]:
        for pattern, rank, alpha in self.overrides:
            if re.search(pattern, path):
                return rank, alpha
        return self.rank, self.alpha

    def rank_for(self, path: str) -> int:
        """The rank of the adapter at ``path`` (the first matching override, else ``rank``)."""
        return self._override(path)[0]

    def alpha_for(self, path: str) -> float:
        """The alpha of the adapter at ``path`` (the first matching override, else ``alpha``)."""
        return self._override(path)[1]

    def scale_for(self, path: str) -> float:
        """The factor ``s`` of ``w + s·(a @ b)``: ``alpha / r``, or ``alpha / sqrt(r)`` with rslora.

        Example:
          >>> LoraSpec(rank=16, alpha=32).scale_for("blocks/attn/v/kernel")
          2.0
        """
        rank, alpha = self._override(path)
        return alpha / (math.sqrt(rank) if self.rslora else rank)
