"""``benchmark_script(name)``: a script of ``benchmarks/`` imported as the module
``benchmark_<name>``, for the tests of its pure parts. The prefix keeps it apart from the
experiment of the same name (``experiments/finetune.py`` beside ``benchmarks/finetune.py``) when
one pytest worker imports both. The scripts import their shared ``harness`` module by name, so
the folder is on ``sys.path`` while the module is in use. ``script_fixture(name)``: that module
as a test module's fixture; ``run_examples(module)``: its docstring examples, run.

    mfu = script_fixture("mfu")          # a fixture named mfu, built once per test module

    def test_peaks(mfu):
        assert mfu.peak_flops("cpu", "fp32") is None
"""

import contextlib
import doctest
import importlib.util
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    module_name = f"benchmark_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while it executes
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


@contextlib.contextmanager
def benchmark_script(name: str):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield _load(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def script_fixture(script: str, name: str | None = None):
    """A module-scoped fixture, named ``name`` (default: the script's name), that holds the
    script ``benchmarks/<script>.py`` imported by :func:`benchmark_script`."""

    @pytest.fixture(scope="module", name=name or script)
    def fixture():
        with benchmark_script(script) as module:
            yield module

    return fixture


def run_examples(module, names=None) -> int:
    """Runs the docstring examples of ``module`` (of the functions in ``names`` only, when
    given), failing on the first docstring with a failed example; returns how many ran."""
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(verbose=False)
    attempted = 0
    for test in finder.find(module):
        if names is not None and test.name.split(".")[-1] not in names:
            continue
        result = runner.run(test)
        assert result.failed == 0, f"docstring example of {test.name} failed"
        attempted += result.attempted
    return attempted


def private_results(monkeypatch, folder: pathlib.Path) -> pathlib.Path:
    """A copy of ``benchmarks/RESULTS.md`` in ``folder`` that the scripts' ``harness.publish``
    writes instead of the real one (for the rest of the test); returns its path."""
    copy = folder / "RESULTS.md"
    copy.write_text((BENCHMARKS / "RESULTS.md").read_text())
    monkeypatch.setattr(sys.modules["harness"], "RESULTS", copy)
    return copy
