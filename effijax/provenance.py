"""Provenance: the library versions a result depends on (recorded in runs and checkpoints)."""

from __future__ import annotations

import platform

__all__ = ["library_versions"]


def library_versions() -> dict[str, str]:
    """Versions of the libraries a result depends on.

    Example:
      >>> sorted(library_versions())[:3]
      ['effijax', 'flax', 'jax']
    """
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("effijax", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out
