"""Lazy re-exports for package ``__init__`` modules.

A package lists which of its modules defines each public name; a name is imported from its
module on first use. ``import effijax.recipe`` therefore costs only what it names: building the
CLI's parser and checking a :class:`~effijax.recipe.TrainConfig` (before anything is traced)
never imports JAX, while ``from effijax.recipe import train`` imports it as before.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable, Mapping

__all__ = ["attach"]


def attach(package: str, exports: Mapping[str, Iterable[str]]
           ) -> tuple[Callable[[str], object], Callable[[], list[str]], list[str]]:
    """The ``__getattr__``, ``__dir__`` and ``__all__`` of a package re-exporting lazily.

    Args:
      package: the package's ``__name__``.
      exports: each defining module's absolute name -> the names it contributes.

    Returns:
      ``(__getattr__, __dir__, __all__)`` for the package's namespace (PEP 562); a name is
      looked up in its module on first access and then cached in the package. A subpackage or
      module of the package is imported on access too (``effijax.precision.get_policy`` after
      ``import effijax``).

    Example:
      >>> getattr_, dir_, all_ = attach("effijax", {"effijax.errors": ["ConfigError"]})
      >>> all_, getattr_("ConfigError").__name__
      (['ConfigError'], 'ConfigError')
      >>> import effijax
      >>> effijax.precision.get_policy("bf16").compute_dtype.name
      'bfloat16'
      >>> effijax.nothing
      Traceback (most recent call last):
      AttributeError: module 'effijax' has no attribute 'nothing'

    """
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str):
        if name in where:
            value = getattr(importlib.import_module(where[name]), name)
        elif not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}"):
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(where) | set(vars(sys.modules[package])))

    return __getattr__, __dir__, list(where)
