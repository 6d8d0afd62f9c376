"""Benchmarks print; only `--write` touches benchmarks/RESULTS.md, and then with the exact
command line that produced the result (a 2-step smoke run must never replace a recorded one)."""

import ast
import importlib
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
# The scripts (what a user runs); harness.py and torch_workers.py are the modules they share.
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py")
                 if 'if __name__ == "__main__"' in p.read_text())


@pytest.fixture
def harness(tmp_path, monkeypatch):
    """The scripts' shared module, writing to a copy of RESULTS.md in tmp_path."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module("harness")
    results = tmp_path / "RESULTS.md"
    results.write_text((BENCHMARKS / "RESULTS.md").read_text())
    monkeypatch.setattr(module, "RESULTS", results)
    return module


def _calls(tree, name):
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and
            getattr(n.func, "id", getattr(n.func, "attr", None)) == name]


def test_there_are_benchmark_scripts():
    assert {"mfu.py", "step_overhead.py", "sharding.py", "lora.py"} <= set(SCRIPTS)


def _function(tree, name):
    (found,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return found


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_writes_results_only_through_publish_with_write(script):
    tree = ast.parse((BENCHMARKS / script).read_text())
    assert not _calls(tree, "write_section"), f"{script} writes RESULTS.md directly"
    main = _function(tree, "main")
    assert [a.arg for a in main.args.args] == ["argv"]
    writer, command = tree, "command_line(__file__, argv)"
    if _calls(main, "run_script"):
        # A GPU script of sections runs through accelerator.run_script, with its own file named
        # (the Script's sixth field): the runner holds the flag and the one publish.
        (call,) = _calls(main, "run_script")
        assert ast.unparse(call.args[-1]) == "argv"
        (made,) = _calls(tree, "Script")
        assert "__file__" in ast.unparse(made.args[5]), ast.unparse(made)
        writer = _function(ast.parse((BENCHMARKS / "accelerator.py").read_text()), "run_script")
        command = "command_line(script.file, argv)"
    assert len(_calls(writer, "add_write_flag")) == 1, f"{script} has no --write flag"
    (publish,) = _calls(writer, "publish")
    keywords = {k.arg: ast.unparse(k.value) for k in publish.keywords}
    assert keywords["write"] == "args.write", keywords
    assert keywords["command"] == command, keywords


def test_command_line_is_what_a_user_types(harness, monkeypatch):
    assert (harness.command_line("/any/where/benchmarks/lora.py", ["--rank", "4", "--write"])
            == "python benchmarks/lora.py --rank 4 --write")
    monkeypatch.setattr(sys, "argv", ["benchmarks/mfu.py", "--models", "tiny mini"])
    assert harness.command_line("mfu.py") == "python benchmarks/mfu.py --models 'tiny mini'"


def test_publish_prints_and_writes_only_with_write(harness, capsys):
    before = harness.RESULTS.read_text()
    text = harness.publish("Step overhead", "a 2-step smoke run", command="python x.py",
                           write=False)
    assert harness.RESULTS.read_text() == before
    out = capsys.readouterr().out
    assert text in out and "add --write" in out
    harness.publish("Step overhead", "the real run", command="python x.py --write", write=True)
    after = harness.RESULTS.read_text()
    assert "Command: `python x.py --write`\n\nthe real run" in after
    assert "a 2-step smoke run" not in after
    assert after.count("## Step overhead\n") == 1  # replaced, not appended
    assert after.replace(after[after.index("<!-- Step overhead:start"):
                               after.index("<!-- Step overhead:end")], "") == before.replace(
        before[before.index("<!-- Step overhead:start"):
               before.index("<!-- Step overhead:end")], "")


@pytest.mark.slow  # compiles the tiny GPT step: ~10 s
def test_a_default_run_leaves_results_alone_and_write_records_the_command(harness, capsys):
    mfu = importlib.import_module("mfu")
    before = harness.RESULTS.read_text()
    mfu.main(["--quick"])
    assert harness.RESULTS.read_text() == before
    assert "Command: `python benchmarks/mfu.py --quick`" in capsys.readouterr().out
    mfu.main(["--quick", "--write"])
    assert "Command: `python benchmarks/mfu.py --quick --write`" in harness.RESULTS.read_text()


def test_interleaved_timing_leaves_each_turns_settling_steps_untimed(harness, monkeypatch):
    """Every variant gets ``warmup`` untimed steps once, then per round ``settle`` untimed and
    ``steps_per_round`` timed ones; the median is of the timed ones alone. A fake clock: a
    turn's first step (after the other variant's) costs 100, the ones after it 1."""
    clock, calls = [0.0], []

    def make(name):
        def run():
            calls.append(name)
            clock[0] += 100.0 if len(calls) == 1 or calls[-2] != name else 1.0
        return lambda: run

    monkeypatch.setattr(harness.time, "perf_counter", lambda: clock[0])
    timing = harness.time_interleaved({"a": make("a"), "b": make("b")}, rounds=3,
                                      steps_per_round=2, warmup=1, settle=1)
    assert calls == ["a", "b"] + (["a"] * 3 + ["b"] * 3) * 3
    assert {k: (t["n"], t["median_s"], t["p90_s"]) for k, t in timing.items()} == {
        "a": (6, 1.0, 1.0), "b": (6, 1.0, 1.0)}
    calls.clear()
    unsettled = harness.time_interleaved({"a": make("a"), "b": make("b")}, rounds=3,
                                         steps_per_round=2, warmup=1)
    assert len(calls) == 2 + 12
    assert unsettled["a"]["p90_s"] == 100.0  # each turn's first step, timed
