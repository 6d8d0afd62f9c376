"""``TrainConfig`` in sections: each field in exactly the section its metadata names, each
section checking itself, and no function below ``train`` receiving the whole config."""

import ast
import dataclasses
import json
import pathlib

import pytest

from effijax.errors import ConfigError
from effijax.recipe import TrainConfig
from effijax.recipe._sections import SECTION_TYPES, Sections

PKG = pathlib.Path(__file__).resolve().parents[1] / "effijax"


def test_every_field_belongs_to_exactly_the_section_its_metadata_names():
    by_metadata = {}
    for f in dataclasses.fields(TrainConfig):
        by_metadata.setdefault(f.metadata["section"], []).append(f.name)
    assert set(by_metadata) == set(SECTION_TYPES) == set(Sections._fields)
    for name, kind in SECTION_TYPES.items():
        assert [f.name for f in dataclasses.fields(kind)] == by_metadata[name], name
    # Each field in one section only; the sections hold every field.
    names = [f.name for kind in SECTION_TYPES.values() for f in dataclasses.fields(kind)]
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(TrainConfig))


def test_the_sections_hold_the_config_values_normalised_and_stay_out_of_its_fields():
    config = TrainConfig(precision="mixed", mesh="data=2,fsdp=4", lr=1, lora_rank=4,
                         model_from="runs/base")
    s = config.sections
    assert (s.precision.precision, config.precision) == ("bf16", "bf16")
    assert s.parallel.mesh == config.mesh == {"data": 2, "fsdp": 4}
    assert s.training.lr == config.lr == 1.0 and isinstance(s.training.lr, float)
    assert s.lora.lora_rank == 4 and s.model.model_from == "runs/base"
    assert "sections" not in config.to_dict() and "_sections" not in config.to_dict()
    assert config == TrainConfig(**config.to_dict())  # equality: the fields alone
    assert dataclasses.replace(config, steps=20).sections.training.steps == 20
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.training.steps = 3


def test_a_section_checks_its_own_fields_with_the_configs_messages():
    fields = {f.name: getattr(TrainConfig(), f.name) for f in dataclasses.fields(TrainConfig)}
    training = SECTION_TYPES["training"]
    values = {f.name: fields[f.name] for f in dataclasses.fields(training)}
    with pytest.raises(ConfigError, match=r"^steps=10: must be a multiple of accumulate=4: "
                                          r"e\.g\. 12$"):
        training(**{**values, "steps": 10, "accumulate": 4})
    with pytest.raises(ConfigError, match=r"^steps=10: must be a multiple of accumulate=4"):
        TrainConfig(steps=10, accumulate=4)
    # A check across sections stays with the config.
    with pytest.raises(ConfigError, match=r"^batch_size=3: must be divisible by "
                                          r"num_processes=2"):
        TrainConfig(batch_size=3, num_processes=2)


def test_config_json_stays_flat_and_an_older_one_loads_as_before():
    config = TrainConfig(steps=40, lora_rank=4, model_from="runs/base", mesh="data=2")
    written = json.loads(json.dumps({**config.to_dict(), "run": {}, "versions": {}}))
    assert all(not isinstance(v, dict) or k in ("mesh", "run", "versions")
               for k, v in written.items())  # one flat table of settings, as before
    assert TrainConfig.from_dict(written) == config
    # A run recorded before later settings existed (no objective, prefetch, ...): its
    # sections hold the defaults of what it lacks.
    old = TrainConfig.from_dict({"model": "tiny", "steps": 6, "batch_size": 4, "run": {}})
    assert old.sections.objective.objective == "sft" and old.sections.data.prefetch == 2


# No function below `train` receives the whole config --------------------------------------------

# The only functions that take a TrainConfig: the stages' entry, and the config's own module
# (its methods and checks).
ALLOWED = {("recipe/_train.py", "train")}
OWN = "recipe/_config.py"
# Where an unannotated `config`/`cfg` parameter would be a TrainConfig (elsewhere `config`
# names a model family's config, annotated as such).
RECIPE_FLOORS = ("recipe/", "cli/", "run.py")


def _parameters(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            args = node.args
            for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs,
                        *filter(None, (args.vararg, args.kwarg))):
                yield getattr(node, "name", "<lambda>"), arg


def test_no_function_but_train_takes_the_whole_config():
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel == OWN:
            continue
        for name, arg in _parameters(ast.parse(path.read_text())):
            annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
            takes = "TrainConfig" in annotation or (
                rel.startswith(RECIPE_FLOORS) and arg.arg in ("config", "cfg")
                and not annotation)
            if takes and (rel, name) not in ALLOWED:
                found.append(f"{rel}::{name}({arg.arg}: {annotation or '?'})")
    assert not found, ("functions that take the whole TrainConfig; give them its sections "
                       "(config.sections) or the values they read: " + ", ".join(found))
