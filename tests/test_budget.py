"""The suite's time budget (tests/_budget.py, wired in tests/conftest.py), checked with made-up
durations: the per-module table, the warning past the 25-minute goal naming the five slowest
modules, and the failure under CI past the 60-minute ceiling. No test here is timed."""

import doctest

import _budget
import pytest


def _modules(*seconds: float) -> dict[str, _budget.Module]:
    return {f"tests/test_{i}.py": _budget.Module(tests=i + 1, seconds=s, compile_s=s / 2,
                                                 processes=i)
            for i, s in enumerate(seconds)}


def test_the_module_examples_run():
    result = doctest.testmod(_budget, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 5 and result.failed == 0


def test_reports_add_up_per_module_and_count_each_test_once():
    times = _budget.ModuleTimes()
    for when, seconds in (("setup", 3.0), ("call", 1.5), ("teardown", 0.5)):
        times.add("tests/test_a.py::test_x[1]", when, seconds, compile_s=0.25, processes=1)
    times.add("tests/test_a.py::test_x[2]", "call", 2.0)
    times.add("tests/test_b.py::test_y", "call", 7.0, compile_s=6.0)
    a, b = times.modules["tests/test_a.py"], times.modules["tests/test_b.py"]
    assert (a.tests, a.seconds, a.compile_s, a.processes) == (2, 7.0, 0.75, 3)
    assert (b.tests, b.seconds, b.compile_s, b.processes) == (1, 7.0, 6.0, 0)
    # Ties by name; the table's rows slowest first, the total last.
    assert [name for name, _ in _budget.slowest(times.modules, 5)] == ["tests/test_a.py",
                                                                        "tests/test_b.py"]
    rows = _budget.table(times.modules)
    assert rows[-1].split()[:5] == ["all", "2", "modules", "3", "14.0"]


def test_within_the_goal_nothing_is_said():
    assert _budget.verdict(24 * 60, _modules(600, 300)) == (None, False)
    assert _budget.verdict(_budget.GOAL_S, _modules(600, 300)) == (None, False)


def test_past_the_goal_one_line_names_the_five_slowest():
    line, over = _budget.verdict(_budget.GOAL_S + 1, _modules(10, 700, 20, 300, 90, 60, 5))
    assert not over
    assert line == ("test budget: the suite took 25 min 1 s, over the 25-minute goal; the five "
                    "slowest modules: tests/test_1.py 11 min 40 s, tests/test_3.py 5 min 0 s, "
                    "tests/test_4.py 1 min 30 s, tests/test_5.py 1 min 0 s, tests/test_2.py 20 s")


def test_past_the_ceiling_the_line_says_so_and_fails():
    line, over = _budget.verdict(_budget.CEILING_S + 1, _modules(3000, 600))
    assert over and line.startswith("test budget: the suite took 60 min 1 s, past the "
                                    "60-minute ceiling (two thirds of CI's limit); ")
    assert line.endswith("tests/test_0.py 50 min 0 s, tests/test_1.py 10 min 0 s")
    assert _budget.CEILING_S == 90 * 60 * 2 // 3


@pytest.mark.parametrize("wall_s, ci, status, expected", [
    (20 * 60, True, 0, 0),  # within the goal
    (30 * 60, True, 0, 0),  # over the goal: a warning, not a failure
    (61 * 60, False, 0, 0),  # past the ceiling outside CI: a red line, not a failure
    (61 * 60, True, 0, 1),  # past the ceiling under CI: the run fails
    (61 * 60, True, 1, 1),  # a run that failed already stays failed
])
def test_the_ceiling_fails_a_run_under_ci_only(wall_s, ci, status, expected):
    line, over = _budget.verdict(wall_s, _modules(wall_s * 2))
    assert over == (wall_s > _budget.CEILING_S)
    assert (line is None) == (wall_s <= _budget.GOAL_S)
    assert _budget.exit_status(status, over, ci) == expected


def test_fast_tier_tests_over_the_limit_are_named():
    times = _budget.ModuleTimes()
    # A test's own call counts (its setup builds fixtures: the module's cost, in its total);
    # xdist's group suffix is dropped.
    times.add("tests/test_a.py::test_x[1]@tests/test_a.py", "setup", 20.0)
    times.add("tests/test_a.py::test_x[1]@tests/test_a.py", "call", 1.5)
    times.add("tests/test_a.py::test_x[1]@tests/test_a.py", "teardown", 0.5)
    times.add("tests/test_a.py::test_y", "call", 1.4)
    times.add("tests/test_b.py::test_z", "call", 30.0, slow=True)
    times.add("tests/test_b.py::test_w", "call", 12.0)
    assert times.strays() == [("tests/test_b.py::test_w", 12.0),
                              ("tests/test_a.py::test_x[1]", 1.5)]
    assert times.modules["tests/test_a.py"].tests == 2
    assert times.modules["tests/test_a.py"].seconds == 23.4
    line = _budget.strays_line(times.strays())
    assert line.startswith("fast tier: 2 tests outside tests/slow_tests.txt took 1.5 s or more: "
                           "tests/test_b.py::test_w 12.0 s, tests/test_a.py::test_x[1] 1.5 s")
    assert _budget.strays_line([]) is None


@pytest.mark.parametrize("tests, modules, crowded", [
    (25, 4, True),    # a quarter of the run, from 4 modules: one worker would run it
    (24, 4, False),   # under a quarter
    (60, 3, False),   # modules that share a process or a reference model on purpose
])
def test_a_group_that_would_crowd_one_worker_is_named(tests, modules, crowded):
    group = [f"tests/test_{i % modules}.py" for i in range(tests)]
    line = _budget.crowded_group({"tests/test_0.py": group}, 100)
    assert (line is not None) == crowded
    if crowded:
        assert line.startswith(f"pytest-xdist would run {tests} of the 100 tests in one worker: "
                               f"the {modules} modules of group 'tests/test_0.py'")
        assert "_BUILT_IN_EACH_WORKER" in line
