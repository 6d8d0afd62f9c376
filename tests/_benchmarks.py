"""``benchmark_script(name)``: a script of ``benchmarks/`` imported as a module, for the tests
of its pure parts. The scripts import their shared ``harness`` module by name, so the folder is
on ``sys.path`` while the module is in use.

    @pytest.fixture(scope="module")
    def mfu():
        with benchmark_script("mfu") as module:
            yield module
"""

import contextlib
import importlib
import pathlib
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@contextlib.contextmanager
def benchmark_script(name: str):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
