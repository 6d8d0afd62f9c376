"""README's quick start stays true (two commands, and CI runs the README's test command), the
manual in docs/ is reachable from it, and its links lead somewhere."""

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
    section = (ROOT / "docs" / "architecture.md").read_text()
    assert section.startswith("# How effijax is built\n"), section[:80]
    named = set(re.findall(r"`(\w+)(?:/|\.py)`", section))
    pkg = ROOT / "effijax"
    tops = {p.stem for p in pkg.iterdir()
            if (p.suffix == ".py" and p.name not in ("__init__.py", "__main__.py"))
            or (p.is_dir() and (p / "__init__.py").exists())}
    assert tops <= named, sorted(tops - named)


def _pages() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _outside_code(text: str) -> str:
    """The text less its fenced blocks (those indented in a list item too)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            kept.append(line)
    return "\n".join(kept)


def _links(text: str) -> list[str]:
    """The targets of the page's Markdown links, ``[text](target)``, outside code."""
    prose = re.sub(r"`[^`\n]*`", "", _outside_code(text))
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", prose)


def _anchors(text: str) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces
    as hyphens, a repeated one numbered."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *$", _outside_code(text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
    return {slug if n == 0 else f"{slug}-{n}" for slug, count in seen.items()
            for n in range(count + 1)}


def test_every_docs_page_is_linked_from_the_readme():
    docs = sorted((ROOT / "docs").glob("*.md"))
    assert len(docs) >= 10, docs
    linked = {(ROOT / target.split("#")[0]).resolve()
              for target in _links((ROOT / "README.md").read_text())}
    missing = [p.name for p in docs if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_every_docs_page_has_a_title_and_links_back():
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        assert re.match(r"# \S.*\n\n\S", text), f"{page.name} does not start with a title"
        assert "../README.md" in _links(text), f"{page.name} does not link back to the README"


def test_every_relative_link_leads_to_a_file_and_its_heading():
    broken = []
    for page in _pages():
        for target in _links(page.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:: not ours to check
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_the_link_checks_can_fail():
    assert _links("see [a](docs/x.md#b) and `[c](d)`\n```\n[e](f)\n```\n") == ["docs/x.md#b"]
    assert _anchors("# QLoRA: a 4-bit base\n## `eval`, and more\n## `eval`, and more\n") == {
        "qlora-a-4-bit-base", "eval-and-more", "eval-and-more-1"}
