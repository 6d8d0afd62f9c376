"""One entry point per direction: :func:`load_pretrained` a GGUF file or a Hugging Face directory,
:func:`load_tokenizer` alone, and :func:`save_peft` for LoRA adapters under Hugging Face's
Llama module names (the merged model goes out through :func:`~effijax.interop.save_hf`).
"""

from __future__ import annotations

import os

from effijax.data import read_json
from effijax.errors import ConfigError, FileError
from effijax.interop._files import MAX_CONFIG_BYTES, is_gguf, model_file
from effijax.interop._gguf import gguf_config, gguf_tokenizer, load_gguf, open_gguf, read_metadata
from effijax.interop._hf import _weight_files as _hf_weight_files
from effijax.interop._hf import (  # noqa: F401 (hf_config, load_hf: the doctests)
    config_from_hf,
    hf_config,
    hf_tokenizer,
    load_hf,
)
from effijax.interop._weights import TENSORS, hf_name
from effijax.lora import LoraSpec, export_peft, pairs
from effijax.models import LlamaConfig, Tokenizer

__all__ = ["load_pretrained", "weight_files", "read_config", "load_tokenizer", "save_peft",
           "peft_module", "export_adapters"]


def load_pretrained(path: str | os.PathLike, **kwargs) -> tuple[LlamaConfig, dict]:
    """Loads a pretrained model of a registered family (Llama, Qwen2): a ``.gguf`` file or a
    Hugging Face directory.

    Keyword arguments go to :func:`~effijax.interop.load_gguf` or
    :func:`~effijax.interop.load_hf` (``policy``, ``shardings``, ``seq_len``).

    Returns:
      ``(config, params)``; ``config.tokenizer`` is the model's tokenizer when the source has one.
    """
    path = os.fspath(path)
    if is_gguf(path):
        return load_gguf(path, **kwargs)
    if os.path.isdir(path):
        return load_hf(path, **kwargs)
    raise FileNotFoundError(f"{path!r} is neither a GGUF file nor a Hugging Face model "
                            "directory (config.json + safetensors)")


def weight_files(path: str | os.PathLike) -> list[str]:
    """The files :func:`load_pretrained` reads weights from, sorted: a GGUF file itself, or a
    Hugging Face directory's ``model.safetensors`` or every shard its index names (wherever
    inside the directory, links into the Hugging Face cache followed, the index checked as
    :func:`load_pretrained` checks it).

    Example:
      >>> import json, os, tempfile
      >>> d = tempfile.mkdtemp()
      >>> shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
      >>> for name in shards:
      ...     open(os.path.join(d, name), "wb").close()
      >>> with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
      ...     json.dump({"weight_map": {"a": shards[1], "b": shards[0], "c": shards[1]}}, f)
      >>> [os.path.basename(f) for f in weight_files(d)]
      ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
    """
    path = os.fspath(path)
    if is_gguf(path):
        return [path]
    return sorted(set(_hf_weight_files(path).values()))


def read_config(path: str | os.PathLike, *, seq_len: int | None = None) -> LlamaConfig:
    """The architecture of a pretrained model without reading its weights: a ``.gguf`` file's
    metadata, or a Hugging Face ``config.json`` (the file, or the directory holding it).

    Example:
      >>> import json, tempfile, os
      >>> from effijax.models import llama_config
      >>> d = tempfile.mkdtemp()
      >>> with open(os.path.join(d, "config.json"), "w") as f:
      ...     json.dump(hf_config(llama_config("llama-tiny")), f)
      >>> read_config(d).num_params == llama_config("llama-tiny").num_params
      True
    """
    path = os.fspath(path)
    if is_gguf(path):
        return gguf_config(path, seq_len=seq_len)
    config_file = model_file(path, "config.json") if os.path.isdir(path) else path
    if not os.path.lexists(config_file):
        raise FileNotFoundError(f"{path!r} is neither a GGUF file, a Hugging Face config.json "
                                "nor a directory holding one")
    return config_from_hf(read_json(config_file, limit=MAX_CONFIG_BYTES), seq_len=seq_len,
                          source=config_file)


def load_tokenizer(path: str | os.PathLike, *, pre: str | None = None) -> Tokenizer:
    """The tokenizer of a GGUF file (its metadata) or of a directory (``tokenizer.json``).

    ``pre`` overrides a GGUF's pre-tokenizer name (see :func:`~effijax.interop.gguf_tokenizer`).

    Raises:
      FileError: no tokenizer, or a malformed tokenizer file (naming it and the field).
    """
    path = os.fspath(path)
    if is_gguf(path):
        tokenizer = gguf_tokenizer(read_metadata(open_gguf(path)), pre=pre, source=path)
        if tokenizer is None:
            raise FileError(path, "tokenizer.ggml.model", "the GGUF file describes no "
                            "supported tokenizer")
        return tokenizer
    tokenizer = hf_tokenizer(path)
    if tokenizer is None:
        raise FileError(path, "tokenizer.json", "missing; effijax reads fast-tokenizer files "
                        "only (convert a slow tokenizer with transformers' save_pretrained)")
    return tokenizer


_HF_MODULES = {path: hf.rsplit(".weight", 1)[0] for path, (hf, _) in TENSORS.items()
               if path.endswith("/kernel")}


def peft_module(path: str, layer: int | None = None) -> str:
    """The Hugging Face module an adapted Llama kernel belongs to (PEFT's target name).

    Example:
      >>> peft_module("layers/attn/q_proj/kernel", 2), peft_module("lm_head/kernel")
      ('model.layers.2.self_attn.q_proj', 'lm_head')
    """
    if path not in _HF_MODULES:
        raise ConfigError("adapters", path, f"no Hugging Face module for it; adaptable kernels: "
                          f"{sorted(_HF_MODULES)}")
    return hf_name(path, layer).rsplit(".weight", 1)[0]


def save_peft(directory: str | os.PathLike, model: LlamaConfig, adapters, spec: LoraSpec, *,
              base_model: str) -> dict[str, tuple[int, ...]]:
    """Writes LoRA adapters of a Llama (or a Qwen2) as a PEFT adapter for its ``transformers``
    class (``LlamaForCausalLM``, ``Qwen2ForCausalLM``).

    Tensor names are Hugging Face's (``base_model.model.model.layers.{i}.self_attn.q_proj.
    lora_A.weight``), one per layer, in torch's ``(out, in)`` layout; ``target_modules`` are the
    module suffixes (``["q_proj", "v_proj"]``: every layer is adapted).
    ``peft.PeftModel.from_pretrained(base, directory)`` loads it onto the base model as
    ``transformers`` loads it.

    Args:
      directory: created if missing.
      model: the architecture the adapters belong to.
      adapters, spec: from :func:`effijax.lora.init` (and training).
      base_model: where the base weights come from (``base_model_name_or_path``: the Hugging
        Face directory or repository, or the GGUF file, the model was loaded from).

    Returns:
      ``{tensor name: shape}`` of what was written.
    """
    from effijax import lora as lora_lib

    lora_lib.validate(model.abstract_params(), adapters, spec)
    for path in pairs(adapters):
        peft_module(path)  # names the adapter that has no Hugging Face module
    suffixes = sorted({_HF_MODULES[path].rsplit(".", 1)[-1] for path in pairs(adapters)})
    return export_peft(directory, adapters, spec, base_model_name=os.fspath(base_model),
                       module_name=peft_module, target_modules=suffixes)


def export_adapters(directory: str | os.PathLike, model, adapters, spec: LoraSpec, *,
                    base_model: str) -> dict[str, tuple[int, ...]]:
    """Writes LoRA adapters in PEFT's format with the module names of the model's family:
    Hugging Face's for a Llama or a Qwen2 (:func:`save_peft`), effijax's own for other families
    (:func:`effijax.lora.export_peft`).

    Example:
      >>> import jax, tempfile
      >>> from effijax import lora
      >>> from effijax.models import llama_config
      >>> model = llama_config("llama-tiny")
      >>> spec = lora.LoraSpec(rank=2, targets=model.lora_targets)
      >>> adapters = lora.init(jax.random.key(0), model.abstract_params(), spec)
      >>> names = export_adapters(tempfile.mkdtemp(), model, adapters, spec, base_model="x")
      >>> sorted(names)[0]
      'base_model.model.model.layers.0.mlp.down_proj.lora_A.weight'
    """
    from effijax.lora import export_peft

    if isinstance(model, LlamaConfig):
        return save_peft(directory, model, adapters, spec, base_model=base_model)
    return export_peft(directory, adapters, spec, base_model_name=base_model)
