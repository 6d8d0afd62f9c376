"""README's quick start stays true: two commands, and CI runs the README's test command."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _quick_start_commands():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", section, re.S)
    assert blocks, "README's quick start has no bash block"
    return [line.strip() for line in blocks[0].splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_quick_start_is_two_commands():
    commands = _quick_start_commands()
    assert len(commands) == 2, commands
    assert commands[0].endswith("effijax train")
    assert ".[test]" in commands[1] and "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    test_command = _quick_start_commands()[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in [line.strip() for line in ci]


def test_how_effijax_is_built_names_every_package_and_module():
    section = (ROOT / "README.md").read_text().split("## How effijax is built", 1)[1]
    section = section.split("\n## ", 1)[0]
    named = set(re.findall(r"`(\w+)(?:/|\.py)`", section))
    pkg = ROOT / "effijax"
    tops = {p.stem for p in pkg.iterdir()
            if (p.suffix == ".py" and p.name not in ("__init__.py", "__main__.py"))
            or (p.is_dir() and (p / "__init__.py").exists())}
    assert tops <= named, sorted(tops - named)
