"""Every docstring example in the package runs and prints what it says (on the 8 CPU devices)."""

import doctest
import importlib
import pkgutil
import tempfile

import pytest

import effijax


def _modules():
    names = []
    for info in pkgutil.walk_packages(effijax.__path__, prefix="effijax."):
        if info.name.endswith("__main__"):
            continue
        names.append(info.name)
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name, monkeypatch, tmp_path):
    # The examples' tempfile.mkdtemp() folders are made under the test's own, which pytest
    # removes, instead of accumulating in the system's temporary folder.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    module = importlib.import_module(name)
    # A package re-exports lazily (effijax._lazy.attach): its examples see every name it
    # exports, as a user's `from effijax.interop import *` would, whatever ran before.
    exported = {n: getattr(module, n) for n in getattr(module, "__all__", ())}
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                             extraglobs=exported, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
