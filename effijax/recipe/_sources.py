"""Where a run's model and starting parameters come from: a preset, or an earlier run.

``init_from`` names an earlier run's directory: its ``config.json`` says the model (checked
without jax), its latest checkpoint holds the parameters (restored read-only, laid out like fsdp
over the mesh so no device holds the whole model).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from effijax.errors import ConfigError
from effijax.recipe._config import DEFAULT_MODEL, TrainConfig

__all__ = ["Source", "check_paths", "read_run", "model_for", "latest_step", "load_params"]


class Source(NamedTuple):
    """An earlier run to start from: its directory, settings and ``run`` record."""

    path: str
    config: TrainConfig
    record: dict


def check_paths(config: TrainConfig) -> None:
    """The data exists, ``out`` can be written (nothing is created yet), ``init_from`` is
    another directory."""
    if config.data is not None and not Path(config.data).exists():
        raise ConfigError("data", config.data, "no such file or folder")
    out = Path(config.out).resolve()
    parent = next((p for p in (out, *out.parents) if p.exists()), None)
    if parent is None or not parent.is_dir():
        raise ConfigError("out", config.out, "its nearest existing parent is not a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise ConfigError("out", config.out, f"cannot write there ({e.strerror}); choose a "
                          "writable directory") from None
    if config.init_from is not None and Path(config.init_from).resolve() == out:
        raise ConfigError("out", config.out, "is the init_from run itself; write the new run to "
                          "another directory")


def read_run(run_dir: str) -> Source:
    """An earlier run's settings, checked to be a full (non-LoRA) run with checkpoints."""
    run = Path(run_dir)
    if not run.is_dir():
        raise ConfigError("init_from", run_dir, "no such run directory")
    try:
        values = json.loads((run / "config.json").read_text())
        config = TrainConfig.from_dict(values)
    except (OSError, ValueError) as e:
        raise ConfigError("init_from", run_dir, f"cannot read its config.json ({e}); pass the "
                          "out directory of an earlier effijax train run") from None
    record = values.get("run")
    if not isinstance(record, dict) or not isinstance(record.get("model_config"), dict):
        raise ConfigError("init_from", run_dir, "its config.json has no run.model_config; pass "
                          "the out directory of an earlier effijax train run")
    if config.lora_rank is not None:
        raise ConfigError("init_from", run_dir, "is a LoRA run (its checkpoints hold adapters, "
                          "not a model); start from the run it fine-tuned, or merge its adapters "
                          "with effijax.lora.merge first")
    if not config.checkpoints or not (run / "checkpoints").is_dir():
        raise ConfigError("init_from", run_dir, "has no checkpoints (it ran with "
                          "--no-checkpoints?); rerun it with checkpoints")
    return Source(str(run.resolve()), config, record)


def model_for(config: TrainConfig, source: Source | None):
    """The run's model: the source run's (``model``/``seq_len`` may only repeat it), or the
    preset ``config.model`` with ``config.seq_len``."""
    from effijax.models import model_from_dict, preset

    if source is None:
        model = preset(config.model)
        return model if config.seq_len is None else model.with_seq_len(config.seq_len)
    model = model_from_dict(source.record["model_config"])
    if config.model != DEFAULT_MODEL and config.model != source.config.model:
        raise ConfigError("model", config.model, f"the init_from run trained "
                          f"{source.config.model!r}; drop it (the run's model is used)")
    if config.seq_len is not None and config.seq_len != model.seq_len:
        raise ConfigError("seq_len", config.seq_len, f"the init_from run's model has "
                          f"{model.seq_len} positions; drop it or use {model.seq_len}")
    return model


def _abstract(source: Source, model):
    from effijax.recipe._job import abstract_state
    from effijax.recipe._train import optimizer_for

    return abstract_state(model, source.config.precision, optimizer_for(source.config),
                          seed=source.config.seed)


def latest_step(source: Source, model) -> dict:
    """``{"run": path, "step": N}``: the source run's checkpoint a fresh start reads (its
    latest), checked against the run's state structure (metadata only, nothing loaded)."""
    from effijax.checkpoint import validate_resume

    directory = Path(source.path) / "checkpoints"
    try:
        step = validate_resume(directory, _abstract(source, model))
    except ConfigError as e:
        raise ConfigError("init_from", source.path, e.problem) from None
    if step is None:
        raise ConfigError("init_from", source.path, f"{directory} holds no committed checkpoint")
    return {"run": source.path, "step": int(step)}


def load_params(source: Source, model, mesh, step: int) -> Any:
    """The source run's parameters at ``step``, restored laid out like fsdp over ``mesh``
    (None: whole, on this process' first device), read-only."""
    import warnings

    import jax

    from effijax.checkpoint import read_checkpoint, restore_target
    from effijax.sharding import ReplicatedParameterWarning, state_shardings

    abstract = _abstract(source, model)
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: device, abstract)
    else:
        with warnings.catch_warnings():  # a transient layout: small leaves stay whole
            warnings.simplefilter("ignore", ReplicatedParameterWarning)
            shardings = state_shardings(abstract, mesh, "fsdp")
    state, _ = read_checkpoint(Path(source.path) / "checkpoints", step=step,
                               target_state_abstract=restore_target(abstract, shardings))
    return state.params
