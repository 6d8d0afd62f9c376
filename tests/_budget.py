"""The test suite's time budget: where a run's time went, per module, and whether it kept to it.

``tests/conftest.py`` feeds every test's report into a :class:`ModuleTimes` (under pytest-xdist,
in the controlling process, from the workers' reports) and prints :func:`table` and
:func:`verdict` at the end of the run. Everything here is pure: the check is tested with made-up
durations (tests/test_budget.py), never with a timed test.

* A module's time is the sum of its tests' setup, call and teardown: what a worker spent on it
  (the first test to use a shared fixture pays for building it). Its compile time is what JAX
  reported lowering and compiling (XLA) in the test's own process, not in the processes a test
  starts, which are counted apart.
* The fast tier (``-m "not slow"``) leaves out the tests marked slow and those
  tests/slow_tests.txt lists, by one rule: a test of ``FAST_LIMIT_S`` (1.5 s) or more on 2
  cores, or a module whose shared fixtures take 5 s or more to build. Each run names the tests
  of the fast tier that broke the rule (:meth:`ModuleTimes.strays`), so the list does not drift.
* ``GOAL_S`` (25 minutes of wall time for the whole suite on 2 cores): past it, one warning line
  names the five slowest modules. ``CEILING_S`` (60 minutes, two thirds of CI's 90): past it,
  the same line is an error, and under CI (``CI`` set) the run fails, so a change that doubles a
  module's time is seen when it lands, not when CI's limit stops everything.
"""

from __future__ import annotations

import dataclasses
import re

GOAL_S = 25 * 60
CEILING_S = 60 * 60
FAST_LIMIT_S = 1.5  # a test that takes this long on 2 cores belongs outside the fast tier


@dataclasses.dataclass
class Module:
    """One module's share of a run: its tests, their summed seconds, JAX's compile seconds in
    the test processes, and the processes its tests started."""

    tests: int = 0
    seconds: float = 0.0
    compile_s: float = 0.0
    processes: int = 0


def module_of(nodeid: str) -> str:
    """The module of a test id.

    Example:
      >>> module_of("tests/test_step.py::test_x[fsdp-2]")
      'tests/test_step.py'
    """
    return nodeid.split("::", 1)[0]


class ModuleTimes:
    """Seconds per module, accumulated from test reports (one per phase).

    Example:
      >>> times = ModuleTimes()
      >>> times.add("tests/test_a.py::test_x", "setup", 2.0, compile_s=1.5)
      >>> times.add("tests/test_a.py::test_x", "call", 1.0, processes=2)
      >>> times.add("tests/test_b.py::test_y", "call", 0.5)
      >>> times.modules["tests/test_a.py"]
      Module(tests=1, seconds=3.0, compile_s=1.5, processes=2)
    """

    def __init__(self):
        self.modules: dict[str, Module] = {}
        self.fast: dict[str, float] = {}  # the seconds of each fast-tier test (not slow)

    def add(self, nodeid: str, when: str, seconds: float, *, compile_s: float = 0.0,
            processes: int = 0, slow: bool = False) -> None:
        nodeid = test_id(nodeid)
        module = self.modules.setdefault(module_of(nodeid), Module())
        module.tests += when == "call"
        module.seconds += seconds
        module.compile_s += compile_s
        module.processes += processes
        if not slow and when == "call":  # a shared fixture's setup is its module's cost
            self.fast[nodeid] = self.fast.get(nodeid, 0.0) + seconds

    def strays(self, limit_s: float = FAST_LIMIT_S) -> list[tuple[str, float]]:
        """The fast-tier tests that took ``limit_s`` or more, slowest first: what the fast
        tier's rule leaves out (tests/slow_tests.txt) but no mark or line does yet.

        Example:
          >>> times = ModuleTimes()
          >>> times.add("tests/test_a.py::test_x", "setup", 3.0)  # a fixture: the module's
          >>> times.add("tests/test_a.py::test_x", "call", 4.5)
          >>> times.add("tests/test_a.py::test_y", "call", 9.0, slow=True)
          >>> times.add("tests/test_a.py::test_z", "call", 1.0)
          >>> times.strays()
          [('tests/test_a.py::test_x', 4.5)]
        """
        return sorted(((k, v) for k, v in self.fast.items() if v >= limit_s),
                      key=lambda kv: -kv[1])


def test_id(nodeid: str) -> str:
    """A test's id without the group pytest-xdist appends under ``--dist loadgroup``.

    Example:
      >>> test_id("tests/test_a.py::test_x[1]@tests/test_a.py")
      'tests/test_a.py::test_x[1]'
    """
    return re.sub(r"@tests/[\w/]+\.py$", "", nodeid)


def strays_line(strays: list[tuple[str, float]], limit_s: float = FAST_LIMIT_S) -> str | None:
    """One line naming the fast-tier tests over the limit (None when there are none).

    Example:
      >>> strays_line([("tests/test_a.py::test_x", 5.5)])
      'fast tier: 1 test outside tests/slow_tests.txt took 1.5 s or more: \
tests/test_a.py::test_x 5.5 s (list it there, mark it slow, or make it cheaper)'
    """
    if not strays:
        return None
    names = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in strays[:10])
    more = f" and {len(strays) - 10} more" if len(strays) > 10 else ""
    tests, it = ("test", "it") if len(strays) == 1 else ("tests", "them")
    return (f"fast tier: {len(strays)} {tests} outside tests/slow_tests.txt took {limit_s:g} s "
            f"or more: {names}{more} (list {it} there, mark {it} slow, or make {it} cheaper)")


def minutes(seconds: float) -> str:
    """``seconds`` as the README writes a duration.

    Example:
      >>> minutes(1549.4), minutes(59.4), minutes(89.6)
      ('25 min 49 s', '59 s', '1 min 30 s')
    """
    seconds = round(seconds)
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60} s"


def slowest(modules: dict[str, Module], count: int) -> list[tuple[str, Module]]:
    """The ``count`` modules with the most seconds, slowest first (ties by name)."""
    return sorted(modules.items(), key=lambda kv: (-kv[1].seconds, kv[0]))[:count]


def table(modules: dict[str, Module], rows: int | None = None) -> list[str]:
    """The per-module table, slowest first: ``rows`` of them (None: every module) and a total.

    Example:
      >>> print("\\n".join(table({"tests/test_a.py": Module(3, 90.0, 60.0, 2),
      ...                          "tests/test_b.py": Module(10, 30.0, 0.0, 0)})))
      module           tests  seconds  share  compile s  processes
      tests/test_a.py      3     90.0    75%       60.0          2
      tests/test_b.py     10     30.0    25%        0.0          0
      all 2 modules       13    120.0   100%       60.0          2
    """
    total = sum(m.seconds for m in modules.values()) or 1.0
    shown = slowest(modules, len(modules) if rows is None else rows)
    every = Module(sum(m.tests for m in modules.values()), sum(m.seconds for m in
                   modules.values()), sum(m.compile_s for m in modules.values()),
                   sum(m.processes for m in modules.values()))
    lines = [(name, m) for name, m in shown] + [(f"all {len(modules)} modules", every)]
    width = max(len(name) for name, _ in lines)
    out = [f"{'module':<{width}}  tests  seconds  share  compile s  processes"]
    for name, m in lines:
        out.append(f"{name:<{width}}  {m.tests:5d}  {m.seconds:7.1f}  {m.seconds / total:5.0%}"
                   f"  {m.compile_s:9.1f}  {m.processes:9d}")
    return out


def verdict(wall_s: float, modules: dict[str, Module], *, goal_s: float = GOAL_S,
            ceiling_s: float = CEILING_S) -> tuple[str | None, bool]:
    """Whether a run of ``wall_s`` seconds kept to the budget: ``(line, over_ceiling)``, where
    ``line`` is None within the goal, else one line naming the five slowest modules.

    Example:
      >>> m = {f"tests/test_{i}.py": Module(1, 60.0 * i) for i in range(1, 8)}
      >>> verdict(20 * 60, m)
      (None, False)
      >>> line, fail = verdict(26 * 60, m)
      >>> fail, line
      (False, 'test budget: the suite took 26 min 0 s, over the 25-minute goal; the five \
slowest modules: tests/test_7.py 7 min 0 s, tests/test_6.py 6 min 0 s, tests/test_5.py 5 min 0 s, \
tests/test_4.py 4 min 0 s, tests/test_3.py 3 min 0 s')
      >>> verdict(61 * 60, m)[1]
      True
    """
    if wall_s <= goal_s:
        return None, False
    over = wall_s > ceiling_s
    limit = (f"past the {ceiling_s / 60:g}-minute ceiling (two thirds of CI's limit)" if over
             else f"over the {goal_s / 60:g}-minute goal")
    names = ", ".join(f"{name} {minutes(m.seconds)}" for name, m in slowest(modules, 5))
    return (f"test budget: the suite took {minutes(wall_s)}, {limit}; the five slowest modules: "
            f"{names}"), over


def exit_status(status: int, over_ceiling: bool, ci: bool) -> int:
    """The run's exit status once the budget is checked: a run past the ceiling fails under CI
    (``ci``), and only there (elsewhere its line is printed red); a failed run stays failed.

    Example:
      >>> exit_status(0, over_ceiling=True, ci=True), exit_status(0, True, False)
      (1, 0)
    """
    return 1 if status == 0 and over_ceiling and ci else status


def crowded_group(groups: dict[str, list[str]], total: int) -> str | None:
    """What is wrong where one pytest-xdist group would hold a quarter of the run's ``total``
    tests or more, from 4 modules or more (``groups``: each group's tests, by module), else
    None. ``--dist loadgroup`` runs a group in one worker: a session fixture that every test
    uses (an autouse one) would tie the suite into one group, and one of the two workers would
    run it all (the fast tier on the 2-core AVX-512 EPYC: 2 min 5 s instead of 1 min 18 s).

    Example:
      >>> crowded_group({"tests/a.py": ["tests/a.py"] * 30 + ["b", "c", "d"]}, 100)[:61]
      'pytest-xdist would run 33 of the 100 tests in one worker: the'
      >>> crowded_group({"tests/a.py": ["tests/a.py"] * 30 + ["b", "c", "d"]}, 200) is None
      True
    """
    for name, modules in groups.items():
        if len(modules) * 4 >= total and len(set(modules)) >= 4:
            return (f"pytest-xdist would run {len(modules)} of the {total} tests in one worker: "
                    f"the {len(set(modules))} modules of group {name!r} share a fixture wider "
                    "than a module (tests/conftest.py's _sharing_groups); if every test uses "
                    "it (an autouse fixture's), make it narrower than the session, or add it to "
                    "_BUILT_IN_EACH_WORKER if each worker can build it")
    return None
