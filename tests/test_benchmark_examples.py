"""Every docstring example of ``benchmarks/`` runs and gives what it shows: each script's and
shared module's, every example in the file but those marked ``+SKIP`` (a new script's are
tested as soon as it is written; the package's own are test_docstrings')."""

import pathlib
import re

import pytest
from _benchmarks import BENCHMARKS, benchmark_script, run_examples

# accelerator.py: its examples that compile a train step run after its dry run compiled it
# (test_accelerator_benchmark), where the step is in the compilation cache.
ELSEWHERE = {"accelerator.py"}
EXAMPLE = re.compile(r"^\s*>>> ", re.M)
SKIPPED = re.compile(r"^\s*>>> .*doctest: \+SKIP", re.M)
WITH_EXAMPLES = sorted(p.name for p in BENCHMARKS.glob("*.py")
                       if EXAMPLE.search(p.read_text()) and p.name not in ELSEWHERE)


def test_the_scripts_with_examples_are_found():
    assert {"mfu.py", "dpo.py", "grpo.py", "torch_workers.py"} <= set(WITH_EXAMPLES)


@pytest.mark.parametrize("script", WITH_EXAMPLES)
def test_every_example_runs_and_gives_what_it_shows(script):
    text = (BENCHMARKS / script).read_text()
    expected = len(EXAMPLE.findall(text)) - len(SKIPPED.findall(text))
    with benchmark_script(pathlib.Path(script).stem) as module:
        assert run_examples(module) == expected
