"""The backend a trace is made for: this process' own, or another one named for the length of a
with-block (:func:`attention_backend`), so that a step exported for ``cuda`` or ``tpu`` from a
CPU host carries that platform's choices: the attention implementation
(:mod:`effijax.models._blockwise`, :mod:`effijax.models._attention`) and the form of the 16-bit
matmuls' backward and residuals (:mod:`effijax.models._dense`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

from effijax.errors import ConfigError

__all__ = ["attention_backend", "target_backend"]

# The backend whose attention choices a trace makes, when it is not this process' own: set only
# by attention_backend, for the length of a with-block. A jax user context, not a plain
# variable: jax keys its trace, lowering and compilation caches on it, so a function traced
# outside the block is traced again inside instead of reusing the other backend's choice.
_TARGET_BACKEND = jax.make_user_context(None)
# jax.export's platform names and the jax.default_backend() name of each.
_BACKEND_OF_PLATFORM = {"cpu": "cpu", "cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu"}


@contextlib.contextmanager
def attention_backend(platform: str) -> Iterator[str]:
    """Inside the block, attention is chosen for ``platform``, not for this process' backend.

    The implementations pick what runs when they are traced, from ``jax.default_backend()``:
    cuDNN's fused kernel or a fallback on a GPU, the pure-JAX kernels elsewhere. A step traced
    here for another platform (``jax.export.export(step, platforms=["cuda"])`` on a CPU host)
    needs that platform's choice instead, or its module is the CPU program under a cuda label.
    Traces made inside the block choose for ``platform`` (jax's trace caches tell the block's
    traces from the others, so a step traced outside is traced again inside). The models' 16-bit
    matmuls choose their backward the same way (``effijax.models._dense``: a CPU form, or the
    plain ``dot_general`` elsewhere).

    Args:
      platform: a ``jax.export`` platform (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``) or a
        ``jax.default_backend()`` name (``"gpu"``).

    Yields:
      The backend name the choices use (``"gpu"`` for ``"cuda"``).

    Raises:
      ConfigError: an unknown platform, before anything is traced.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from effijax.models import choose_attention
      >>> q = jax.ShapeDtypeStruct((1, 8, 2, 64), jnp.float32)
      >>> with attention_backend("cuda") as backend:
      ...     backend, choose_attention(q, dropout=False).name
      ('gpu', 'xla')
      >>> target_backend()  # outside the block: this process' backend again
      'cpu'
    """
    if platform not in _BACKEND_OF_PLATFORM:
        raise ConfigError("platform", platform, f"unknown; choose one of "
                          f"{', '.join(_BACKEND_OF_PLATFORM)}")
    backend = _BACKEND_OF_PLATFORM[platform]
    with _TARGET_BACKEND(backend):
        yield backend


def target_backend() -> str:
    """The backend a trace chooses attention and the 16-bit matmuls' form for:
    :func:`attention_backend`'s inside its block, else ``jax.default_backend()``.

    Example:
      >>> target_backend() == jax.default_backend()
      True
    """
    backend = _TARGET_BACKEND.value
    return jax.default_backend() if backend is None else backend
