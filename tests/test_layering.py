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
    upper = ("effijax.step", "effijax.run", "effijax.cli", "effijax.memory",
             "effijax.checkpoint", "effijax.models", "effijax.data", "effijax.recipe",
             "effijax.interop", "effijax.objectives")
    for pkg in ("precision", "sharding", "lora"):
        assert not _offenders(_modules(pkg), upper), pkg


# The layers above the core, bottom to top. A module may import its own layer and those below,
# never one above: the library never reaches up into the recipe, the recipe never into the CLI.
LAYERS = [
    ("_lazy.py", "errors.py", "paths.py", "provenance.py", "atomic.py"),
    ("precision", "sharding", "lora", "data", "distributed", "_rendezvous.py"),
    ("models", "interop", "memory", "step.py", "optimizers.py", "checkpoint"),
    # Training objectives: losses of the models' outputs (per-sequence log-probabilities), which
    # the recipe composes; never the recipe's own business (data, loop, checkpoints).
    ("objectives",),
    # Where models and data come from, opened for any command (train, eval, generate, memory,
    # plan, data prepare): below the recipe, which keeps TrainConfig and the stages of train.
    ("sources",),
    # Generation opens a trained model through effijax.sources.open_model, never the recipe
    # (test_only_the_cli_imports_the_recipe): it sits above the sources and below the recipe,
    # whose GRPO objective samples its rollouts with it.
    ("generate",),
    ("run.py", "observe"),
    # lm-evaluation-harness over generation and the models' scoring: below the recipe, which
    # scores a run's weights with it (train --eval-tasks).
    ("harness",),
    ("recipe",),
    ("cli", "__main__.py"),
]


def _module_name(entry: str) -> str:
    return "effijax." + entry.removesuffix(".py")


def test_upper_layers_never_import_back_up():
    for i, layer in enumerate(LAYERS):
        above = [_module_name(e) for upper in LAYERS[i + 1:] for e in upper]
        for entry in layer:
            bad = _offenders(_modules(entry), above)
            assert not bad, f"{entry} imports a higher layer: {bad}"


def test_every_module_is_in_a_layer():
    placed = {e for layer in LAYERS for e in layer} | {"__init__.py"}
    tops = {p.name for p in PKG.iterdir() if p.suffix == ".py" or
            (p.is_dir() and (p / "__init__.py").exists())}
    assert tops <= placed, sorted(tops - placed)


def test_only_the_cli_imports_the_recipe():
    # The recipe is TrainConfig and the stages of train: the library below and beside it (data,
    # models, generation, ...) never needs it; the CLI, experiments and benchmarks drive it.
    outside = {m: i for m, i in _modules().items() if not m.startswith(("cli/", "recipe/"))}
    assert not _offenders(outside, ("effijax.recipe",)), _offenders(outside, ("effijax.recipe",))
    for root in ("experiments", "benchmarks"):  # allowed there, and used
        assert any("effijax.recipe" in _imports(p) for p in (PKG.parent / root).rglob("*.py"))


def test_checkpoints_do_not_import_the_training_loop():
    assert not _offenders(_modules("checkpoint"), ("effijax.run", "effijax.step",
                                                   "effijax.recipe")), "checkpoint"


def test_no_module_imports_another_packages_private_modules():
    # Tests may reach into a module's internals to test them; library code, experiments and
    # benchmarks go through the public names.
    private = re.compile(r"^effijax\.(\w+)\._\w+")
    roots = [PKG, PKG.parent / "experiments", PKG.parent / "benchmarks"]
    for root in roots:
        for path in root.rglob("*.py"):
            inside = path.relative_to(PKG).parts[0] if path.is_relative_to(PKG) else None
            for name in _imports(path):
                m = private.match(name)
                assert not m or m.group(1) == inside, f"{path}: imports {name}"


def test_only_checkpoint_imports_orbax_and_only_models_and_lora_import_flax():
    everything = _modules()
    orbax = _offenders(everything, ("orbax",))
    assert all(m.startswith("checkpoint/") for m in orbax), orbax
    flax = _offenders(everything, ("flax",))
    assert all(m.startswith(("models/", "lora/")) for m in flax), flax


def test_only_the_joining_module_calls_jax_distributed():
    # Mentions count too (a docstring, a comment): the one module keeps the word to itself.
    # Equality, not a subset, so that a pattern that stopped matching would fail here.
    pattern = re.compile(r"(?<![\w.])jax\.distributed")  # not effijax.distributed
    callers = {str(path.relative_to(PKG)) for path in PKG.rglob("*.py")
               if pattern.search(path.read_text())}
    assert callers == {"distributed/_join.py"}, callers


def test_models_do_not_import_interop():
    # File formats sit above the models: a model never needs to know where weights come from.
    assert not _offenders(_modules("models"), ("effijax.interop",))


# Import cycles ------------------------------------------------------------------------------------
# Every import counts, a function-local one too (it hides a cycle from Python, not from the
# reader), and so does a lazy re-export table (``attach(__name__, {"effijax.x._y": ...})``).


def _module_of(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(path: pathlib.Path, module: str, modules: set[str]) -> set[str]:
    """The effijax modules ``path`` imports: ``from pkg import x`` is an edge to ``pkg.x`` when
    that is a submodule, else to ``pkg``; relative imports are resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                         for a in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "attach"
              and len(node.args) == 2 and isinstance(node.args[1], ast.Dict)):
            found.update(k.value for k in node.args[1].keys if isinstance(k, ast.Constant))
    return found & modules


def _import_graph() -> dict[str, set[str]]:
    """Module -> the effijax modules it imports. Importing ``a.b.c`` from outside package
    ``a.b`` runs ``a.b``'s ``__init__`` first, so it is an edge to ``a.b`` too (the root
    package ``effijax`` only re-exports lazily and is left out)."""
    paths = {_module_of(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for module, path in paths.items():
        edges = set()
        for target in _targets(path, module, set(paths)):
            edges.add(target)
            parent = target.rpartition(".")[0]
            while parent not in ("", "effijax"):
                if module != parent and not module.startswith(parent + "."):
                    edges.add(parent)
                parent = parent.rpartition(".")[0]
        graph[module] = edges - {module, "effijax"}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iteratively)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_two_modules_import_each_other():
    graph = _import_graph()
    assert not _cycles(graph), {
        " <-> ".join(c): {m: sorted(graph[m] & set(c)) for m in c} for c in _cycles(graph)}


def test_no_two_top_level_units_import_each_other():
    # effijax.recipe, effijax.generate, effijax.run, ...: a package is one unit with its modules.
    def unit(module: str) -> str:
        return ".".join(module.split(".")[:2])

    units: dict[str, set[str]] = {}
    for module, edges in _import_graph().items():
        if module != "effijax":
            units.setdefault(unit(module), set()).update(unit(e) for e in edges)
    units = {u: e - {u} for u, e in units.items()}
    assert not _cycles(units), _cycles(units)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# One name per concept ----------------------------------------------------------------------------
# Each command module of the CLI implements the same two-function protocol (``add_parsers``,
# ``run``): one concept, so one name. Anything else public is defined in one module only.
_PROTOCOLS = {"add_parsers": "cli/", "run": "cli/"}


def _public_definitions() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, (ast.FunctionDef, ast.ClassDef))
                    and not node.name.startswith("_")):
                found.setdefault(node.name, []).append(str(path.relative_to(PKG)))
    return found


def test_no_two_modules_define_the_same_public_name():
    twice = {name: where for name, where in _public_definitions().items() if len(where) > 1
             and not all(w.startswith(_PROTOCOLS.get(name, "\0")) for w in where)}
    assert not twice, f"one name, several definitions (rename one): {twice}"
