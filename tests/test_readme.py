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


# Examples in order: each file a command reads was made by a command (or a Python block)
# before it on the same page, or ships with the project, or names a bundled model or preset.
_READ_FLAGS = ("--data", "--from", "--config", "--chat-template", "--prompts-file")


def _page_steps(text: str) -> list[tuple[str, list[str] | str]]:
    """The page's steps in order: ``("run", argv)`` for each ``effijax`` command (a bash block's
    line, or an output block's ``$`` line; continuations joined), ``("python", source)`` for each
    Python block, ``("toml", source)`` for each TOML file shown (named by its first comment)."""
    import shlex

    steps = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        if lang in ("python", "toml"):
            steps.append((lang, body))
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.strip()
            if lang in ("", "console") and not line.startswith("$ "):
                continue  # an output block: only its "$" lines are commands
            line = line.removeprefix("$ ").split(" #", 1)[0]
            for part in line.split("&&"):
                words = shlex.split(part)
                if words[:1] == ["srun"]:
                    words = words[1:]
                if words[:1] == ["effijax"]:
                    steps.append(("run", words[1:]))
    return steps


def _reads_and_writes(argv: list[str]) -> tuple[list[str], list[str]]:
    """The paths a command reads and writes (its flags and, for eval and data, positionals)."""
    reads, writes = [], []
    for i, word in enumerate(argv[:-1]):
        value = argv[i + 1]
        if word in _READ_FLAGS and ":" not in value:  # a mixture names weights: skipped
            reads.append(value)
        elif word == "--out":
            writes.append(value)
    flags_with_values = {i + 1 for i, w in enumerate(argv) if w.startswith("--")}
    positionals = [w for i, w in enumerate(argv) if not w.startswith("-")
                   and i not in flags_with_values]
    if argv[:1] == ["eval"]:
        reads += positionals[1:]
    elif argv[:2] == ["data", "prepare"]:
        reads += positionals[2:3]
    elif argv[:2] == ["data", "make-example"]:
        writes += positionals[2:3]
    elif argv[:1] == ["train"] and "--out" not in argv:
        writes.append("runs/train")
    return reads, writes


def _unmade_reads(text: str) -> list[str]:
    """Each path a command of ``text`` reads that nothing before it made and nothing ships."""
    from effijax.models import preset_names
    from effijax.sources import BUNDLED

    made, missing = set(), []
    for kind, step in _page_steps(text):
        if kind == "python":  # a file a Python block writes: a string literal with a suffix
            made |= set(re.findall(r"""["']([\w./-]+\.\w+)["']""", step))
            continue
        if kind == "toml":  # the file shown ("# name.toml"), and the run directory it names
            made |= set(re.findall(r"^# ([\w./-]+\.toml)$", step, re.M))
            made |= set(re.findall(r"^out = \"([^\"]+)\"$", step, re.M))
            continue
        reads, writes = _reads_and_writes(step)
        for path in reads:
            if re.search(r"[|{}\[\]]", path) or re.fullmatch(r"[A-Z_]+(\.\w+)?", path):
                continue  # a synopsis' placeholder (FILE, RUN_DIR|FILE.gguf), not a path
            known = (path in BUNDLED or path in preset_names() or path.rstrip("/") in made
                     or any(path.startswith(m.rstrip("/") + "/") for m in made)
                     or (ROOT / path).exists() or path.startswith("/"))
            if not known:
                missing.append(f"effijax {' '.join(step)}: reads {path}")
        made |= {w.rstrip("/") for w in writes}
    return missing


def test_every_example_reads_only_what_an_earlier_one_made_or_the_project_ships():
    problems = {page.relative_to(ROOT).as_posix(): _unmade_reads(page.read_text())
                for page in _pages()}
    assert {page: p for page, p in problems.items() if p} == {}


def test_the_order_check_can_fail():
    later = ("```bash\neffijax train --data runs/made.store --out runs/x\n"
             "effijax data prepare docs/ --out runs/made.store --from smollm2\n```\n")
    assert _unmade_reads(later) == ["effijax train --data runs/made.store --out runs/x: reads "
                                    "runs/made.store"]
    assert _unmade_reads("\n".join(reversed(later.splitlines()[1:3])).join(
        ["```bash\n", "\n```\n"])) == []
