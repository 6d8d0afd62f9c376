"""Casting pytrees between floating dtypes without touching anything else.

Integer leaves (token ids, step counters), booleans and typed PRNG keys pass through unchanged;
only floating leaves are cast. Per-path overrides let some parameters (norm scales, embeddings)
keep their own dtype.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from effijax.errors import ConfigError
from effijax.paths import compile_pattern, map_with_path
from effijax.precision._dtypes import parse_dtype

__all__ = ["cast_floating", "is_floating"]


def is_floating(x: Any) -> bool:
    """True for arrays (or ``ShapeDtypeStruct``s) with a floating dtype; False for keys and ints.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> is_floating(jnp.ones(2)), is_floating(jnp.arange(2)), is_floating(jax.random.key(0))
      (True, False, False)
    """
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return False
    return bool(jnp.issubdtype(dtype, jnp.floating))


def _check_overrides(overrides: Any) -> tuple[tuple[re.Pattern, np.dtype], ...]:
    """Compiles ``((path_regex, dtype), ...)``; a bad rule is a ConfigError naming its index."""
    if isinstance(overrides, str) or not isinstance(overrides, Sequence):
        raise ConfigError("overrides", overrides, "expected a tuple of (path_regex, dtype) "
                          "pairs, e.g. (('ln|norm', 'f32'),)")
    rules = []
    for i, rule in enumerate(overrides):
        field = f"overrides[{i}]"
        if not (isinstance(rule, tuple | list) and len(rule) == 2):
            raise ConfigError(field, rule, "expected a (path_regex, dtype) pair, e.g. "
                              "('ln|norm', 'f32')")
        pattern, dtype = rule
        try:
            regex = compile_pattern(pattern, field=field)
        except ValueError as e:
            # effijax.paths (shared with lora and sharding) says "{field}: {problem}".
            raise ConfigError(field, rule, str(e).removeprefix(f"{field}: ")) from None
        try:
            dtype = parse_dtype(dtype, field=field)
        except ConfigError as e:
            raise ConfigError(field, rule, f"dtype {e.value!r}: {e.problem}") from None
        rules.append((regex, dtype))
    return tuple(rules)


def cast_floating(tree, dtype, *, overrides: Sequence[tuple[str, Any]] = ()):
    """Casts every floating leaf of ``tree`` to ``dtype``; other leaves are returned as is.

    Args:
      tree: any pytree of arrays (``jax.ShapeDtypeStruct`` leaves are cast abstractly).
      dtype: the target floating dtype.
      overrides: ``((path_regex, dtype), ...)``: a floating leaf whose '/'-joined path matches a
        regex (``re.search``; the first match wins) is cast to that dtype instead.

    Returns:
      A tree of the same structure. Leaves already in the target dtype are returned unchanged
      (no copy is made inside ``jit``).

    Raises:
      ConfigError: ``dtype`` or an override is not a floating dtype (or its name), or an
        override is not a ``(path_regex, dtype)`` pair with a valid regex.

    Example:
      >>> import jax.numpy as jnp
      >>> t = cast_floating({"w": jnp.ones(2), "ids": jnp.arange(2), "ln": jnp.ones(2)},
      ...                   jnp.bfloat16, overrides=[("ln", jnp.float32)])
      >>> {k: v.dtype.name for k, v in t.items()}
      {'ids': 'int32', 'ln': 'float32', 'w': 'bfloat16'}
    """
    rules = _check_overrides(overrides)
    dtype = parse_dtype(dtype)

    def cast(path: str, x):
        if not is_floating(x):
            return x
        target = dtype
        for pattern, d in rules:
            if pattern.search(path):
                target = d
                break
        if x.dtype == target:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, target, sharding=x.sharding)
        return jnp.asarray(x).astype(target)

    return map_with_path(cast, tree)
