"""Hugging Face model directories: ``config.json`` + safetensors in, and out.

:func:`load_hf` reads a directory of a registered family (``LlamaForCausalLM``,
``Qwen2ForCausalLM``: ``config.json``'s ``model_type`` picks the
:class:`~effijax.models.PretrainedFormat`; ``model.safetensors``, or shards listed in
``model.safetensors.index.json``) into the family's config and parameters:
torch's ``(out, in)`` matrices are transposed to Flax's ``(in, out)`` and the layers stacked,
one parameter at a time (see :func:`~effijax.interop._weights.assemble_params`).
:func:`save_hf` writes the inverse, optionally with LoRA adapters merged in, plus the
tokenizer files, so that ``transformers.AutoModelForCausalLM.from_pretrained(directory)`` loads it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

from effijax import atomic
from effijax.data import read_json
from effijax.errors import ConfigError, FileError
from effijax.interop._files import (
    MAX_CONFIG_BYTES,
    SafetensorsTensor,
    check_finite,
    check_size,
    model_file,
    number_field,
    safetensors_header,
    shard_files,
    whole_field,
)
from effijax.interop._weights import (
    assemble_params,
    check_tensors,
    expected_hf_shapes,
    hf_name,
    host_array,
    to_hf,
)
from effijax.models import LlamaConfig, Tokenizer, format_of, pretrained_format
from effijax.paths import named_leaves

__all__ = ["config_from_hf", "hf_config", "load_hf", "save_hf", "hf_tokenizer", "DEFAULT_SEQ_LEN"]

#: The training window of a loaded model when none is asked for (capped by its context).
DEFAULT_SEQ_LEN = 2048

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def _rope_from_hf(fields: dict, source: str) -> tuple[float, tuple | None]:
    """``(rope_theta, rope_scaling)`` from a config in either transformers 4's or 5's spelling."""
    for key in ("rope_parameters", "rope_scaling"):
        if fields.get(key) is not None and not isinstance(fields[key], dict):
            raise FileError(source, key, f"{fields[key]!r}; expected an object or null")
    params = fields.get("rope_parameters") or {}
    legacy = fields.get("rope_scaling") or {}
    theta = number_field(params if params.get("rope_theta") is not None else fields,
                         "rope_theta", source, 10000.0)
    scaling = {**legacy, **params}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind == "llama3":
        return theta, (*(number_field(scaling, key, source) for key in
                         ("factor", "low_freq_factor", "high_freq_factor")),
                       whole_field(scaling, "original_max_position_embeddings", "max_position",
                                   source))
    raise ConfigError("rope_scaling", kind, "effijax's Llama implements the default rotary "
                      "embedding and Llama 3's ('llama3') scaling only")


#: config.json's integer fields, and the :class:`LlamaConfig` field whose limit bounds each.
_INT_FIELDS = {"vocab_size": "vocab_size", "hidden_size": "d_model",
               "intermediate_size": "d_ff", "num_hidden_layers": "n_layers",
               "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
               "head_dim": "head_dim", "max_position_embeddings": "max_position"}
#: Optional ones, with their defaults (0: the value another field gives).
_INT_DEFAULTS = {"num_key_value_heads": 0, "head_dim": 0, "max_position_embeddings": 2048}


def config_from_hf(fields: dict, *, seq_len: int | None = None,
                   tokenizer: Tokenizer | None = None,
                   source: str = "config.json") -> LlamaConfig:
    """A family's config (a :class:`LlamaConfig` or one of its kind) from a Hugging Face
    ``config.json`` dict; its ``model_type`` picks the family.

    Every field is checked before it is used: integers are whole numbers within
    :data:`~effijax.interop._files.LIMITS` (``hidden_size 64.7`` is refused, not truncated),
    required keys are present, and the model is at most
    :data:`~effijax.interop._files.MAX_PARAMS` parameters.

    Args:
      fields: the parsed ``config.json`` (``model_type`` "llama", "qwen2", ...).
      seq_len: the training window; default ``min(max_position_embeddings, 2048)``.
      tokenizer: attached to the config.
      source: the file ``fields`` came from, for the errors.

    Raises:
      FileError: naming ``source`` and the field: an unknown ``model_type`` (listing the
        supported ones), a feature the family lacks in effijax (biases, another activation,
        another rotary scaling), a missing key, a value of the wrong type or out of range.

    Example:
      >>> import dataclasses
      >>> from effijax.models import llama_config
      >>> config = config_from_hf({"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
      ...     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
      ...     "num_key_value_heads": 2, "max_position_embeddings": 256})
      >>> config == dataclasses.replace(llama_config("llama-tiny"), rms_eps=1e-6, seq_len=256)
      True
    """
    try:
        config = _config_from_hf(fields, seq_len=seq_len, tokenizer=tokenizer, source=source)
    except ConfigError as e:
        raise FileError.of(source, e) from None
    check_size(config, source)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        _check_token_id(fields, key, config.vocab_size, source)
    return config


def _check_token_id(fields: dict, key: str, vocab_size: int, source: str) -> None:
    """``config.json``'s special token id ``key``: null, an id below ``vocab_size``, or a list
    of them (Llama 3's several ``eos_token_id``); -1 is also "none" for ``pad_token_id``, as
    early Llama conversions write it. effijax takes its special tokens from the tokenizer
    files, but an id past the embedding is a damaged file (``transformers`` would stop on it)."""
    value = fields.get(key)
    lowest = -1 if key == "pad_token_id" else 0
    if value is None or all(isinstance(i, int) and not isinstance(i, bool)
                            and lowest <= i < vocab_size
                            for i in (value if isinstance(value, list) else [value])):
        return
    raise FileError(source, f"{key}={value!r}", f"expected a token id from 0 to "
                    f"{vocab_size - 1:,} (vocab_size {vocab_size:,}), a list of them, or null")


def _config_from_hf(fields: dict, *, seq_len, tokenizer, source) -> LlamaConfig:
    fmt = pretrained_format(model_type=fields.get("model_type"))
    fmt.check_hf(fields)
    if not isinstance(fields.get("tie_word_embeddings", False), bool):
        raise ConfigError("tie_word_embeddings", fields["tie_word_embeddings"],
                          "expected true or false")
    ints = {key: whole_field(fields, key, limit, source, _INT_DEFAULTS.get(key))
            for key, limit in _INT_FIELDS.items()}
    own = fmt.config_fields(fields)  # the family's fields replace the shared ones
    theta, scaling = (None, None) if "rope_theta" in own else _rope_from_hf(fields, source)
    max_position = ints["max_position_embeddings"]
    return fmt.config(**{
        "vocab_size": ints["vocab_size"], "d_model": ints["hidden_size"],
        "n_layers": ints["num_hidden_layers"], "n_heads": ints["num_attention_heads"],
        "n_kv_heads": ints["num_key_value_heads"] or ints["num_attention_heads"],
        "head_dim": ints["head_dim"] or None, "d_ff": ints["intermediate_size"],
        "rope_theta": theta, "rope_scaling": scaling,
        "rms_eps": number_field(fields, "rms_norm_eps", source, 1e-6),
        "tie_embeddings": fields.get("tie_word_embeddings", False),
        "seq_len": min(max_position, DEFAULT_SEQ_LEN) if seq_len is None else seq_len,
        "max_position": max_position, "tokenizer": tokenizer, **own})


def hf_config(model: LlamaConfig, *, dtype: str = "float32") -> dict:
    """The ``config.json`` dict of ``model``'s ``transformers`` class (``LlamaForCausalLM``,
    ``Qwen2ForCausalLM``, ...).

    Rotary settings are written in both spellings (``rope_theta``/``rope_scaling`` and
    transformers 5's ``rope_parameters``), special token ids from the model's tokenizer.

    Example:
      >>> from effijax.models import llama_config
      >>> fields = hf_config(llama_config("smollm2-135m"))
      >>> fields["architectures"], fields["num_key_value_heads"], fields["tie_word_embeddings"]
      (['LlamaForCausalLM'], 3, True)
    """
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": model.rope_theta}
    rope_scaling = None
    if model.rope_scaling is not None:
        factor, low, high, original = model.rope_scaling
        rope_scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": original}
        rope_parameters = {**rope_scaling, "rope_theta": model.rope_theta}
    tok = model.tokenizer
    fmt = format_of(model)
    return {
        "architectures": [fmt.hf_class],
        "model_type": fmt.model_type,
        "vocab_size": model.vocab_size,
        "hidden_size": model.d_model,
        "intermediate_size": model.d_ff,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads,
        "head_dim": model.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": model.max_position,
        "rms_norm_eps": model.rms_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": model.tie_embeddings,
        "attention_dropout": 0.0,
        **fmt.hf_fields(model),
        "initializer_range": 0.02,
        "bos_token_id": None if tok is None else tok.bos_id,
        "eos_token_id": None if tok is None else tok.eos_id,
        "pad_token_id": None if tok is None else tok.pad_id,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
    }


#: The dtypes a weight may be stored in (an integer or boolean tensor is not a weight).
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def _weight_files(directory: str) -> dict[str, str]:
    """``{tensor name: file}`` from the index (every file inside ``directory``), or every name
    of ``model.safetensors``.

    With both, the index is used, and ``model.safetensors`` is checked all the same (its
    header): no file of the directory is a link out of it or damaged unseen because another
    was read instead.
    """
    index, single = model_file(directory, _INDEX), model_file(directory, _SINGLE)
    if os.path.lexists(index):
        files = shard_files(directory, index)
        if os.path.lexists(single):
            safetensors_header(single)
        return files
    if not os.path.lexists(single):
        raise FileError(directory, _SINGLE, f"missing, and no {_INDEX}; effijax reads "
                        "safetensors only (convert pytorch_model.bin with transformers' "
                        "save_pretrained)")
    return {name: single for name in safetensors_header(single)}


def _found_tensors(directory: str, files: dict[str, str]) -> dict[str, SafetensorsTensor]:
    """Each tensor the directory offers, checked to be where the index says."""
    headers = {file: safetensors_header(file) for file in sorted(set(files.values()))}
    for name, file in files.items():
        if name not in headers[file]:
            raise FileError(os.path.join(directory, _INDEX), f"weight_map[{name!r}]",
                            f"{os.path.basename(file)} holds no tensor {name!r}")
    return {name: headers[file][name] for name, file in files.items()}


#: The tokenizer files of a model directory :meth:`~effijax.models.Tokenizer.load` reads.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def hf_tokenizer(directory: str, *, rows: int | None = None) -> Tokenizer | None:
    """The tokenizer of a model directory (``tokenizer.json`` and ``tokenizer_config.json``),
    its files checked and parsed now (:meth:`~effijax.models.Tokenizer.load`); None when there
    is no ``tokenizer.json``.

    Args:
      directory: the model directory.
      rows: the model's embedding rows (``vocab_size``), when known: every token id must be
        below it.

    Raises:
      FileError: a tokenizer file is malformed, a link out of the directory, or has an id of
        ``rows`` or more, naming it and the field.
    """
    for name in _TOKENIZER_FILES:
        model_file(directory, name)
    if not os.path.lexists(os.path.join(directory, "tokenizer.json")):
        return None
    return Tokenizer.load(directory, rows=rows)


def _ignored(name: str) -> bool:
    # Older checkpoints store the rotary frequencies, which the config determines.
    return name.endswith("rotary_emb.inv_freq")


def load_hf(directory: str | os.PathLike, *, policy=None, shardings=None,
            seq_len: int | None = None) -> tuple[LlamaConfig, dict]:
    """Loads a Hugging Face directory of a registered family (``LlamaForCausalLM``,
    ``Qwen2ForCausalLM``).

    Every file is checked before it is trusted (see :mod:`effijax.interop._files`): the
    config's fields, the tokenizer files, each safetensors header and the shard index.

    Args:
      directory: holds ``config.json`` and ``model.safetensors`` (or sharded safetensors with
        ``model.safetensors.index.json``); ``tokenizer.json`` if present becomes the config's
        tokenizer.
      policy: the parameters' dtypes (default f32; ``"pure_bf16"`` keeps bf16 weights bf16).
      shardings: where each parameter goes (a tree like the parameters, e.g.
        :func:`effijax.sharding.param_shardings`, or one sharding); default: the default device.
      seq_len: the training window (default ``min(max_position_embeddings, 2048)``).

    Returns:
      ``(config, params)`` with ``params`` matching ``config.abstract_params(policy)``.

    Raises:
      FileNotFoundError: no config.json.
      FileError: a file is malformed or missing, the architecture is unsupported, or tensors
        are missing, unexpected or misshaped (all named at once).
    """
    directory = os.fspath(directory)
    config_path = model_file(directory, "config.json")
    if not os.path.lexists(config_path):
        raise FileNotFoundError(f"no config.json in {directory!r}")
    fields = read_json(config_path, limit=MAX_CONFIG_BYTES)
    config = config_from_hf(fields, seq_len=seq_len, source=config_path)
    tokenizer = hf_tokenizer(directory, rows=config.vocab_size)
    if tokenizer is not None:
        config = dataclasses.replace(config, tokenizer=tokenizer)
    files = _weight_files(directory)
    tensors = _found_tensors(directory, files)
    found = {name: t.shape for name, t in tensors.items()}
    expected = expected_hf_shapes(config)
    if config.tie_embeddings and "lm_head.weight" in found:
        # Some exporters write the tied head too; it must be the embedding.
        expected["lm_head.weight"] = ("", None, found["lm_head.weight"])
    check_tensors({n: shape for n, (_, _, shape) in expected.items()}, found,
                  source=directory, ignored=_ignored)
    for name in expected:
        if tensors[name].dtype not in _FLOAT_DTYPES:
            raise FileError(files[name], f"tensor {name!r}", f"dtype {tensors[name].dtype}; "
                            f"expected a floating-point one ({', '.join(_FLOAT_DTYPES)})")
    if config.tie_embeddings and "lm_head.weight" in found:
        head, emb = (_read(files, n) for n in ("lm_head.weight", "model.embed_tokens.weight"))
        if not np.array_equal(head, emb):
            raise FileError(files["lm_head.weight"], "lm_head.weight", "differs from "
                            "model.embed_tokens.weight, but config.json ties them "
                            "(tie_word_embeddings true)")
    params = assemble_params(config, lambda name: _read(files, name), policy=policy,
                      shardings=shardings)
    return config, params


def _read(files: dict[str, str], name: str) -> np.ndarray:
    import safetensors

    try:
        with safetensors.safe_open(files[name], framework="numpy") as f:
            return check_finite(files[name], name, f.get_tensor(name))
    except safetensors.SafetensorError as e:  # what the header check cannot see
        raise FileError(files[name], f"tensor {name!r}", f"cannot be read ({e})") from None


def _merged_leaf(path: str, leaf, adapters, lora):
    """One parameter with its adapter folded in (``w + s·a b`` in f32), or as it is."""
    from effijax import lora as lora_lib

    pair = lora_lib.pairs(adapters).get(path) if adapters is not None else None
    if pair is None:
        return leaf
    nested: Any = leaf
    for part in reversed(path.split("/")):
        nested = {part: nested}
    flat_adapter = {"a": pair[0], "b": pair[1]}
    for part in reversed(path.split("/")):
        flat_adapter = {part: flat_adapter}
    merged = lora_lib.merge(nested, flat_adapter, lora)
    for part in path.split("/"):
        merged = merged[part]
    return merged


def export_leaves(model, params, adapters, lora) -> dict:
    """``{path: leaf}`` of the parameters an export writes, checked against the model's tree
    (and ``adapters`` with ``lora``: both or neither) before anything is written."""
    if (adapters is None) != (lora is None):
        raise ValueError("adapters and lora go together: pass both or neither")
    leaves = dict(named_leaves(params))
    abstract = dict(named_leaves(model.abstract_params()))
    if set(leaves) != set(abstract):
        raise ConfigError("params", "tree", f"does not match {model.name}: missing "
                          f"{sorted(set(abstract) - set(leaves))}, unexpected "
                          f"{sorted(set(leaves) - set(abstract))}")
    return leaves


def save_hf(directory: str | os.PathLike, model: LlamaConfig, params, *, adapters=None,
            lora=None, dtype: Any = None, max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Writes a Hugging Face directory of the model's class (``LlamaForCausalLM``,
    ``Qwen2ForCausalLM``) that ``transformers`` loads.

    ``config.json``, ``generation_config.json``, the weights (``model.safetensors``, or
    ``model-0000k-of-0000n.safetensors`` shards of at most ``max_shard_bytes`` with their
    index) and, when the model has a tokenizer, ``tokenizer.json``, ``tokenizer_config.json``
    (with the chat template) and ``special_tokens_map.json``. Parameters are fetched and written
    one at a time, each file whole or not at all (:mod:`effijax.atomic`); to make the directory
    itself appear complete or not at all, write into :func:`effijax.atomic.fresh_dir` and
    :func:`~effijax.atomic.replace_dir` it into place (as ``effijax train`` does).

    Args:
      directory: created if missing.
      model: the architecture (and tokenizer).
      params: its parameters (sharded or not).
      adapters, lora: LoRA adapters and their spec, merged into the weights in f32 (PEFT's
        ``merge_and_unload``); or neither.
      dtype: the stored dtype (default: each parameter's own); e.g. ``"bfloat16"``.
      max_shard_bytes: the largest weights file.

    Returns:
      The file names written.
    """
    import jax.numpy as jnp
    import safetensors.numpy

    leaves = export_leaves(model, params, adapters, lora)
    fmt = format_of(model)
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    out_dtype = None if dtype is None else jnp.dtype(dtype)
    # Plan the shards from the shapes, then write them parameter by parameter.
    sizes = []
    for path in fmt.tensors:
        if path not in leaves:
            continue
        leaf = leaves[path]
        itemsize = (out_dtype or leaf.dtype).itemsize
        layers = range(model.n_layers) if path.startswith("layers/") else [None]
        per = math.prod(leaf.shape[1:] if path.startswith("layers/") else leaf.shape) * itemsize
        sizes += [(path, layer, per) for layer in layers]
    shards, current, used = [], [], 0
    for item in sizes:
        if current and used + item[2] > max_shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(item)
        used += item[2]
    shards.append(current)
    names = ([_SINGLE] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    weight_map, total = {}, 0
    host: dict[str, np.ndarray] = {}
    for file, shard in zip(names, shards, strict=True):
        tensors = {}
        for path, layer, nbytes in shard:
            if path not in host:
                host.clear()  # one parameter on the host at a time
                w = host_array(_merged_leaf(path, leaves[path], adapters, lora))
                host[path] = w if out_dtype is None else w.astype(out_dtype)
            w = host[path]
            tensors[hf_name(path, layer)] = to_hf(path, w if layer is None else w[layer])
            weight_map[hf_name(path, layer)] = file
            total += nbytes
        # Bytes written whole (atomic) and as any other output file (0644 under the usual
        # umask): safetensors' save_file creates its files 0600.
        data = safetensors.numpy.save(tensors, metadata={"format": "pt"})
        atomic.write_bytes(os.path.join(directory, file), data)
        del data
        del tensors
    host.clear()
    written = list(names)
    if len(names) > 1:
        atomic.write_text(os.path.join(directory, _INDEX), json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        written.append(_INDEX)
    stored = (out_dtype or jnp.dtype(next(iter(leaves.values())).dtype)).name
    atomic.write_text(os.path.join(directory, "config.json"),
                      json.dumps(hf_config(model, dtype=stored), indent=2))
    tok = model.tokenizer
    generation = {"bos_token_id": None if tok is None else tok.bos_id,
                  "eos_token_id": None if tok is None else tok.eos_id,
                  "pad_token_id": None if tok is None else tok.pad_id}
    atomic.write_text(os.path.join(directory, "generation_config.json"),
                      json.dumps({k: v for k, v in generation.items() if v is not None}, indent=2))
    written += ["config.json", "generation_config.json"]
    if tok is not None:
        written += tok.save(directory)
    return written
