"""Hugging Face model directories: ``config.json`` + safetensors in, and out.

:func:`load_hf` reads a ``LlamaForCausalLM`` directory (``model.safetensors``, or shards listed in
``model.safetensors.index.json``) into a :class:`~effijax.models.LlamaConfig` and parameters:
torch's ``(out, in)`` matrices are transposed to Flax's ``(in, out)`` and the layers stacked,
one parameter at a time (see :func:`~effijax.interop._weights.assemble`). :func:`save_hf` writes
the inverse, optionally with LoRA adapters merged in, plus the tokenizer files, so that
``transformers.AutoModelForCausalLM.from_pretrained(directory)`` loads it.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

from effijax.errors import ConfigError
from effijax.interop._weights import (
    TENSORS,
    assemble,
    check_tensors,
    expected_hf_shapes,
    hf_name,
    host_array,
    to_hf,
)
from effijax.models import LlamaConfig, Tokenizer
from effijax.paths import named_leaves

__all__ = ["config_from_hf", "hf_config", "load_hf", "save_hf", "DEFAULT_SEQ_LEN"]

#: The training window of a loaded model when none is asked for (capped by its context).
DEFAULT_SEQ_LEN = 2048

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def _rope_from_hf(fields: dict) -> tuple[float, tuple | None]:
    """``(rope_theta, rope_scaling)`` from a config in either transformers 4's or 5's spelling."""
    params = fields.get("rope_parameters") or {}
    legacy = fields.get("rope_scaling") or {}
    theta = params.get("rope_theta", fields.get("rope_theta", 10000.0))
    scaling = {**legacy, **params}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    if kind == "llama3":
        return float(theta), (float(scaling["factor"]), float(scaling["low_freq_factor"]),
                              float(scaling["high_freq_factor"]),
                              int(scaling["original_max_position_embeddings"]))
    raise ConfigError("rope_scaling", kind, "effijax's Llama implements the default rotary "
                      "embedding and Llama 3's ('llama3') scaling only")


def config_from_hf(fields: dict, *, seq_len: int | None = None,
                   tokenizer: Tokenizer | None = None) -> LlamaConfig:
    """A :class:`LlamaConfig` from a Hugging Face ``config.json`` dict.

    Args:
      fields: the parsed ``config.json`` (``model_type`` "llama").
      seq_len: the training window; default ``min(max_position_embeddings, 2048)``.
      tokenizer: attached to the config.

    Raises:
      ConfigError: not a Llama, or a feature effijax's Llama lacks (biases, another
        activation, another rotary scaling), naming the field.

    Example:
      >>> import dataclasses
      >>> from effijax.models import llama_config
      >>> config = config_from_hf({"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
      ...     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
      ...     "num_key_value_heads": 2, "max_position_embeddings": 256})
      >>> config == dataclasses.replace(llama_config("llama-tiny"), rms_eps=1e-6, seq_len=256)
      True
    """
    if fields.get("model_type") != "llama":
        raise ConfigError("model_type", fields.get("model_type"),
                          "effijax loads Llama-family models (model_type 'llama') only")
    for name, allowed in (("hidden_act", ("silu", None)), ("attention_bias", (False, None)),
                          ("mlp_bias", (False, None)), ("pretraining_tp", (1, None))):
        if fields.get(name) not in allowed:
            raise ConfigError(name, fields.get(name), f"effijax's Llama supports {allowed[0]!r} "
                              "only")
    theta, scaling = _rope_from_hf(fields)
    max_position = int(fields.get("max_position_embeddings", 2048))
    heads = int(fields["num_attention_heads"])
    return LlamaConfig(
        vocab_size=int(fields["vocab_size"]), d_model=int(fields["hidden_size"]),
        n_layers=int(fields["num_hidden_layers"]), n_heads=heads,
        n_kv_heads=int(fields.get("num_key_value_heads") or heads),
        head_dim=fields.get("head_dim"), d_ff=int(fields["intermediate_size"]),
        rope_theta=theta, rope_scaling=scaling, rms_eps=float(fields.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(fields.get("tie_word_embeddings", False)),
        seq_len=min(max_position, DEFAULT_SEQ_LEN) if seq_len is None else seq_len,
        max_position=max_position, tokenizer=tokenizer)


def hf_config(model: LlamaConfig, *, dtype: str = "float32") -> dict:
    """The ``config.json`` dict of ``LlamaForCausalLM`` for ``model``.

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
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": None if tok is None else tok.bos_id,
        "eos_token_id": None if tok is None else tok.eos_id,
        "pad_token_id": None if tok is None else tok.pad_id,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
    }


def _weight_files(directory: str) -> dict[str, str]:
    """``{tensor name: file}`` from the index, or every name of ``model.safetensors``."""
    import safetensors

    index = os.path.join(directory, _INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(directory, file) for name, file in weight_map.items()}
    single = os.path.join(directory, _SINGLE)
    if not os.path.isfile(single):
        raise FileNotFoundError(
            f"no {_SINGLE} or {_INDEX} in {directory!r}; effijax reads safetensors only "
            "(convert pytorch_model.bin with transformers' save_pretrained)")
    with safetensors.safe_open(single, framework="numpy") as f:
        return {name: single for name in f.keys()}


def _ignored(name: str) -> bool:
    # Older checkpoints store the rotary frequencies, which the config determines.
    return name.endswith("rotary_emb.inv_freq")


def load_hf(directory: str | os.PathLike, *, policy=None, shardings=None,
            seq_len: int | None = None) -> tuple[LlamaConfig, dict]:
    """Loads a Hugging Face ``LlamaForCausalLM`` directory.

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
      FileNotFoundError: no config or weights.
      ConfigError: an unsupported architecture, or tensors missing, unexpected or misshaped
        (all named at once).
    """
    import safetensors

    directory = os.fspath(directory)
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no config.json in {directory!r}")
    with open(config_path) as f:
        fields = json.load(f)
    tokenizer = None
    if os.path.isfile(os.path.join(directory, "tokenizer.json")):
        tokenizer = Tokenizer.load(directory)
    config = config_from_hf(fields, seq_len=seq_len, tokenizer=tokenizer)
    files = _weight_files(directory)
    found = {}
    for file in sorted(set(files.values())):
        with safetensors.safe_open(file, framework="numpy") as f:
            for name in f.keys():
                found[name] = tuple(f.get_slice(name).get_shape())
    expected = expected_hf_shapes(config)
    if config.tie_embeddings and "lm_head.weight" in found:
        # Some exporters write the tied head too; it must be the embedding.
        expected["lm_head.weight"] = ("", None, found["lm_head.weight"])
    check_tensors({n: shape for n, (_, _, shape) in expected.items()}, found,
                  source=directory, ignored=_ignored)
    if config.tie_embeddings and "lm_head.weight" in found:
        head, emb = (_read(files, n) for n in ("lm_head.weight", "model.embed_tokens.weight"))
        if not np.array_equal(head, emb):
            raise ConfigError("tie_word_embeddings", True, f"{directory!r} has an lm_head.weight "
                              "that differs from model.embed_tokens.weight")
    params = assemble(config, lambda name: _read(files, name), policy=policy,
                      shardings=shardings)
    return config, params


def _read(files: dict[str, str], name: str) -> np.ndarray:
    import safetensors

    with safetensors.safe_open(files[name], framework="numpy") as f:
        return f.get_tensor(name)


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


def save_hf(directory: str | os.PathLike, model: LlamaConfig, params, *, adapters=None,
            lora=None, dtype: Any = None, max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Writes a Hugging Face ``LlamaForCausalLM`` directory that ``transformers`` loads.

    ``config.json``, ``generation_config.json``, the weights (``model.safetensors``, or
    ``model-0000k-of-0000n.safetensors`` shards of at most ``max_shard_bytes`` with their
    index) and, when the model has a tokenizer, ``tokenizer.json``, ``tokenizer_config.json``
    (with the chat template) and ``special_tokens_map.json``. Parameters are fetched and written
    one at a time.

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

    if (adapters is None) != (lora is None):
        raise ValueError("adapters and lora go together: pass both or neither")
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    leaves = dict(named_leaves(params))
    abstract = dict(named_leaves(model.abstract_params()))
    if set(leaves) != set(abstract):
        raise ConfigError("params", "tree", f"does not match {model.name}: missing "
                          f"{sorted(set(abstract) - set(leaves))}, unexpected "
                          f"{sorted(set(leaves) - set(abstract))}")
    out_dtype = None if dtype is None else jnp.dtype(dtype)
    # Plan the shards from the shapes, then write them parameter by parameter.
    sizes = []
    for path in TENSORS:
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
        # Bytes written as any other output file (0644 under the usual umask): safetensors'
        # save_file creates its files 0600.
        data = safetensors.numpy.save(tensors, metadata={"format": "pt"})
        with open(os.path.join(directory, file), "wb") as f:
            f.write(data)
        del data
        del tensors
    host.clear()
    written = list(names)
    if len(names) > 1:
        with open(os.path.join(directory, _INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        written.append(_INDEX)
    stored = (out_dtype or jnp.dtype(next(iter(leaves.values())).dtype)).name
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config(model, dtype=stored), f, indent=2)
    tok = model.tokenizer
    generation = {"bos_token_id": None if tok is None else tok.bos_id,
                  "eos_token_id": None if tok is None else tok.eos_id,
                  "pad_token_id": None if tok is None else tok.pad_id}
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in generation.items() if v is not None}, f, indent=2)
    written += ["config.json", "generation_config.json"]
    if tok is not None:
        written += tok.save(directory)
    return written
