"""Text a user reads speaks of papers, tables and hardware, never of how this project was
planned: no "issue 5", "seed 003", "the seeds' formulas", "No GPU was lent to this issue"."""

import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Each pattern names what to write instead.
INTERNAL = [
    (re.compile(r"\bissues? #?\d+", re.I), "name the measurement or the goal itself"),
    (re.compile(r"\bissue \"", re.I), "name the measurement or the goal itself"),
    (re.compile(r"\bseeds? ?0\d\d\b", re.I), "name the paper or the lecture notes and the table"),
    (re.compile(r"\bseeds?'s?(?=\W)", re.I), "name the paper (e.g. Rajbhandari et al. 2020, ZeRO)"),
    (re.compile(r"\bthe seeds\b", re.I), "name the paper or the lecture notes"),
    (re.compile(r"\bseed (formulas?|tables?|documents?|derivation)\b", re.I),
     "name the formula's source (e.g. Korthikanti et al. 2022)"),
    (re.compile(r"\blent to\b|\bwas lent\b", re.I), "say 'not measured on a GPU'"),
]


def _notebook_text(path: pathlib.Path) -> str:
    nb = json.loads(path.read_text())
    parts = []
    for cell in nb["cells"]:
        parts.append("".join(cell["source"]))
        for out in cell.get("outputs", []):
            parts.append("".join(out.get("text", "")))
            parts.extend("".join(v) for k, v in out.get("data", {}).items()
                         if k.startswith("text/"))
    return "\n".join(parts)


def _files():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             ROOT / "benchmarks" / "RESULTS.md"]
    for folder in ("benchmarks", "experiments", "effijax"):
        files += sorted((ROOT / folder).rglob("*.py"))
    files += sorted((ROOT / "notebooks").glob("*.ipynb"))
    return files


def _findings(text: str) -> list[str]:
    found = []
    for pattern, instead in INTERNAL:
        for m in pattern.finditer(text):
            line = text[:m.start()].count("\n") + 1
            found.append(f"line {line}: {m.group(0)!r} ({instead})")
    return found


def test_the_check_finds_planning_words():
    text = ("Goal (issue 5): ...\nseed 003's Table S1\nthe seeds' formulas\n"
            "the seed formula\nNo GPU was lent to this issue.\n")
    assert len(_findings(text)) == 6
    clean = ("--seed 0 seeds the parameters; Rajbhandari et al. 2020 (ZeRO); Biderman et al. "
             "2024, table S1; not measured on a GPU; GitHub issues are welcome")
    assert _findings(clean) == []


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_user_facing_text_speaks_of_papers_and_hardware(path):
    text = _notebook_text(path) if path.suffix == ".ipynb" else path.read_text()
    assert _findings(text) == []
