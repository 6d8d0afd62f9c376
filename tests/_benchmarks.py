"""``benchmark_script(name)``: a script of ``benchmarks/`` imported as the module
``benchmark_<name>``, for the tests of its pure parts. The prefix keeps it apart from the
experiment of the same name (``experiments/finetune.py`` beside ``benchmarks/finetune.py``) when
one pytest worker imports both. The scripts import their shared ``harness`` module by name, so
the folder is on ``sys.path`` while the module is in use.

    @pytest.fixture(scope="module")
    def mfu():
        with benchmark_script("mfu") as module:
            yield module
"""

import contextlib
import importlib.util
import pathlib
import sys

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
