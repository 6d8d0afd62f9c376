"""The architecture's import rules, checked by walking every module's imports with ast."""

import ast
import pathlib
import re

PKG = pathlib.Path(__file__).resolve().parents[1] / "effijax"


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _modules(sub: str = "") -> dict[str, set[str]]:
    root = PKG / sub if sub else PKG
    files = root.rglob("*.py") if root.is_dir() else [root]
    return {str(p.relative_to(PKG)): _imports(p) for p in files}


def _offenders(mods, forbidden):
    return {m: sorted(i for i in imps if any(i == f or i.startswith(f + ".") for f in forbidden))
            for m, imps in mods.items()
            if any(i == f or i.startswith(f + ".") for f in forbidden for i in imps)}


def test_precision_sharding_lora_do_not_import_each_other():
    trio = ("effijax.precision", "effijax.sharding", "effijax.lora")
    for pkg in trio:
        others = [t for t in trio if t != pkg]
        assert not _offenders(_modules(pkg.split(".")[1]), others), pkg


def test_lower_layers_do_not_import_upper_layers():
    upper = ("effijax.train", "effijax.jobs", "effijax.run", "effijax.cli", "effijax.memory",
             "effijax.checkpoint", "effijax.models", "effijax.data", "effijax.interop")
    for pkg in ("precision", "sharding", "lora"):
        assert not _offenders(_modules(pkg), upper), pkg


def test_only_checkpoint_imports_orbax_and_only_models_and_lora_import_flax():
    everything = _modules()
    orbax = _offenders(everything, ("orbax",))
    assert all(m.startswith("checkpoint/") for m in orbax), orbax
    flax = _offenders(everything, ("flax",))
    assert all(m.startswith(("models/", "lora/")) for m in flax), flax


def test_only_distributed_module_calls_jax_distributed():
    pattern = re.compile(r"(?<![\w.])jax\.distributed")  # not effijax.distributed
    for path in PKG.rglob("*.py"):
        if path.name == "distributed.py":
            continue
        assert not pattern.search(path.read_text()), path


def test_models_do_not_import_interop():
    # File formats sit above the models: a model never needs to know where weights come from.
    assert not _offenders(_modules("models"), ("effijax.interop",))
