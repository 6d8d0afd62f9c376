"""The models' import in the commands that run them (``train``, ``eval``, ``generate``), after
each has said on a terminal what it waits for (:mod:`effijax.cli._status`) and, for ``train``,
what a Ctrl-C would leave (:mod:`effijax.cli._interrupt`)."""

from __future__ import annotations

import sys

__all__ = ["import_models"]


def import_models() -> None:
    """Imports :mod:`effijax.models` (JAX, flax) with IPython hidden from flax.

    On import, ``flax.nnx`` asks IPython whether it runs inside a notebook, to colour its
    reprs; where IPython is installed (Jupyter, the test extras), importing it to learn that
    costs 0.3-0.6 s of every command's start on 2 cores. The ``effijax`` program is never
    inside IPython, so flax is told at once: ``import IPython`` fails while the models are
    imported, and IPython stays importable afterwards. Where flax or IPython is already
    imported (a notebook, a test calling the commands), nothing happens.

    Example:
      >>> import sys
      >>> import_models()
      >>> sys.modules.get("IPython", "importable") is not None
      True
    """
    if "IPython" in sys.modules or "flax.nnx" in sys.modules:
        return
    sys.modules["IPython"] = None  # ``import IPython`` raises ImportError
    try:
        import effijax.models  # noqa: F401
    finally:
        del sys.modules["IPython"]
