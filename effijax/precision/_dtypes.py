"""Names of the floating dtypes effijax computes in, and their parsing."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from effijax.errors import ConfigError

__all__ = ["parse_dtype"]

# Accepted spellings of each dtype (case-insensitive).
_DTYPE_NAMES: dict[str, Any] = {
    "f32": jnp.float32,
    "fp32": jnp.float32,
    "float32": jnp.float32,
    "full": jnp.float32,
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f16": jnp.float16,
    "fp16": jnp.float16,
    "float16": jnp.float16,
    "half": jnp.float16,
}

def parse_dtype(value: Any, *, field: str = "dtype") -> np.dtype:
    """Returns the numpy dtype for a floating dtype or one of its accepted names.

    Args:
      value: a dtype (``jnp.bfloat16``, ``np.float32``) or a name such as ``"bf16"``, ``"fp32"``,
        ``"half"``.
      field: the name of the setting the value is for, used as the error's ``field``.

    Raises:
      ConfigError: naming ``field``, if the name is unknown (the message lists the accepted
        names) or the dtype is not f32, bf16 or f16.

    Example:
      >>> parse_dtype("bf16")
      dtype(bfloat16)
      >>> parse_dtype("half", field="compute")
      dtype('float16')
      >>> parse_dtype("int8", field="compute_dtype")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      effijax.errors.ConfigError: compute_dtype='int8': unknown dtype name; accepted: bf16, ...
    """
    if isinstance(value, str):
        key = value.strip().lower()
        if key not in _DTYPE_NAMES:
            raise ConfigError(
                field, value, f"unknown dtype name; accepted: {', '.join(sorted(_DTYPE_NAMES))}"
            )
        return np.dtype(_DTYPE_NAMES[key])
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise ConfigError(
            field, value, "not a dtype; pass a floating dtype (jnp.bfloat16) or a name such as "
            "'bf16', 'fp16', 'fp32'"
        ) from None
    if dtype not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
        # The parsed dtype, not the value: repr(jnp.int32) is "<class 'jax.numpy.int32'>".
        raise ConfigError(field, dtype, "not supported; use float32, bfloat16 or float16")
    return dtype
