"""GGUF out: a model of a registered family (LoRA adapters merged in) as the file llama.cpp,
Ollama and ``transformers`` load.

:func:`save_gguf` is :func:`~effijax.interop.load_gguf` backwards, in the layout llama.cpp's
own converter writes: the family's ``general.architecture`` and ``{architecture}.*``
hyperparameters, the tensors under their GGUF names in ggml's order (the Llama's ``attn_q`` /
``attn_k`` rows permuted as llama.cpp expects them; Llama 3's rotary scaling as the f32 tensor
``rope_freqs.weight``, first), the tokenizer's ``tokenizer.ggml.*`` fields and chat template.
Matrices are stored as ``dtype`` asks (``f32``, ``f16``, ``bf16``, or a block quantization
``q8_0``, ``q5_0``, ``q5_1``, ``q4_0``, ``q4_1``, quantized by the ``gguf`` package, the
reference implementation); norms and biases stay f32, as llama.cpp keeps them, and a matrix
whose rows do not split into whole blocks is stored f16. The k-quants
(``Q4_K``, ``Q6_K``, ...) are not written: ``gguf`` has no quantizer for them.

The file is written tensor by tensor (one parameter on the host at a time, as
:func:`~effijax.interop.save_hf` does), under a temporary name renamed into place when it is
complete (:func:`effijax.atomic.write_with`): a killed export leaves the earlier file or none.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any

import numpy as np

from effijax import atomic
from effijax.errors import ConfigError, all_of
from effijax.interop._gguf import ROPE_FREQS, permute
from effijax.interop._gguf_types import GGUF_DTYPES, GGUF_HYPERPARAMETERS
from effijax.interop._hf import _merged_leaf, export_leaves
from effijax.interop._weights import host_array, to_hf
from effijax.models import (
    PRE_TOKENIZERS,
    Tokenizer,
    byte_level_bpe,
    format_of,
    llama3_scaling,
    pretrained_format,
    rope_factors,
)

__all__ = ["save_gguf", "gguf_format", "gguf_tokenizer_fields"]


# Text on which two pre-tokenizers that split it alike are taken to be the same split: words,
# contractions, digit runs, punctuation, runs of spaces, tabs and newlines, non-ASCII letters.
_PROBE = ("Hello world! It's 2024: 12345 apples, 3.14159 pies;  two  spaces\tand tabs\n\n"
          "  indented\r\nline's end \u00e9t\u00e9 \u4f60\u597d 42nd I'M we'll they'VE x=y+1 "
          "\U0001f600!!  ?? \u00a0nbsp 7,000,000 ")


# Families llama.cpp's converter writes under another architecture: Mistral as a Llama (its
# window is dropped: see _hyperparameters).
_WRITTEN_AS = {"mistral": "llama"}


def _check_dtype(dtype: Any) -> str:
    if not isinstance(dtype, str) or dtype.lower() not in GGUF_DTYPES:
        raise ConfigError("dtype", dtype, f"GGUF tensor types effijax writes: "
                          f"{', '.join(GGUF_DTYPES)}")
    return dtype.lower()


def gguf_format(model):
    """The :class:`~effijax.models.PretrainedFormat` ``model`` is written to GGUF as, once
    everything :func:`save_gguf` would refuse about it is checked (a family without a GGUF
    architecture, rotary scaling outside a ``llama`` file, a tokenizer of another kind): what
    ``effijax train --export-gguf`` checks before training.

    Example:
      >>> from effijax.models import mistral_config, gpt_config
      >>> gguf_format(mistral_config("mistral-7b-v0.1")).gguf_architecture
      'llama'
      >>> gguf_format(gpt_config("tiny"))
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: model='tiny GPT': the gpt family has no Hugging Face ...
    """
    return _checked(model)[0]


def _checked(model) -> tuple[Any, dict, dict]:
    """``(format, family metadata, tokenizer fields)`` of ``model``, every check run before
    any refusal, so that one error names every reason (a family without a GGUF architecture
    stops at once: nothing else applies)."""
    fmt = _written_format(model)
    errors, results = [], []
    for check in (lambda: _check_rope(model, fmt), lambda: fmt.gguf_metadata(model),
                  lambda: {} if model.tokenizer is None else
                  gguf_tokenizer_fields(model.tokenizer, model.vocab_size)):
        try:
            results.append(check())
        except ConfigError as e:
            errors.append(e)
    if errors:
        raise all_of(errors)
    return fmt, results[1], results[2]


def _written_format(model):
    """The format ``model`` is written as (Mistral as a Llama, see ``_WRITTEN_AS``); refuses a
    family without a GGUF architecture."""
    fmt = format_of(model)
    if fmt.gguf_architecture is None and fmt.model_type not in _WRITTEN_AS:
        raise ConfigError("model", model.name, f"the {model.family} family has no GGUF "
                          "architecture")
    if fmt.gguf_architecture is None:  # written, and read back, as that architecture's
        fmt = pretrained_format(gguf_architecture=_WRITTEN_AS[fmt.model_type])
    return fmt


def _check_rope(model, fmt) -> None:
    """Llama 3's scaling goes into ``rope_freqs.weight``, which llama.cpp reads in ``llama``
    files only, and only where effijax can read it back."""
    rope_freqs = _rope_freqs(model)
    if rope_freqs is not None and fmt.gguf_architecture != "llama":
        raise ConfigError("rope_scaling", model.rope_scaling, f"llama.cpp reads Llama 3's "
                          f"rotary scaling ({ROPE_FREQS}) in 'llama' files only, not "
                          f"{fmt.gguf_architecture!r} ones; export the Hugging Face directory")
    if rope_freqs is not None:  # a file effijax could not read back is not written
        try:
            llama3_scaling(rope_freqs, model.head_dim, model.rope_theta, name=ROPE_FREQS)
        except ConfigError as e:
            raise ConfigError("rope_scaling", model.rope_scaling, f"as {ROPE_FREQS}, it would "
                              f"not be read back: the tensor {e.problem}; export the Hugging "
                              "Face directory") from None


def _rope_freqs(model) -> np.ndarray | None:
    """The ``rope_freqs.weight`` llama.cpp's converter writes for Llama 3's scaling (each
    frequency's divisor, f32), or None for a model without one."""
    if getattr(model, "rope_scaling", None) is None:
        return None
    return rope_factors(model.head_dim, model.rope_theta, model.rope_scaling).astype(np.float32)


def _pre_name(backend) -> str:
    """The llama.cpp pre-tokenizer name (``tokenizer.ggml.pre``) that splits text as
    ``backend``'s pre-tokenizer does, tried on a probe text."""
    if backend.pre_tokenizer is None:
        raise ConfigError("tokenizer", "pre_tokenizer", "a byte-level BPE tokenizer without a "
                          "pre-tokenizer has no llama.cpp equivalent")
    ours = backend.pre_tokenizer.pre_tokenize_str(_PROBE)
    for name in PRE_TOKENIZERS:
        reference = byte_level_bpe(["a"], [], pre=name).backend.pre_tokenizer
        if reference.pre_tokenize_str(_PROBE) == ours:
            return name
    raise ConfigError("tokenizer", "pre_tokenizer", "splits text unlike every llama.cpp "
                      f"pre-tokenizer effijax knows ({', '.join(PRE_TOKENIZERS)})")


def gguf_tokenizer_fields(tokenizer: Tokenizer, vocab_size: int) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` metadata of a tokenizer, which
    :func:`~effijax.interop.gguf_tokenizer` reads back to one that encodes alike.

    A byte-level BPE tokenizer becomes llama.cpp's ``gpt2`` model: tokens in id order, token
    types (special added tokens are control tokens, other added tokens user-defined), merges,
    the pre-tokenizer's name (found by how it splits a probe text). A SentencePiece one (BPE
    with byte fallback and ``▁`` for spaces, :func:`~effijax.models.sentencepiece_bpe`'s)
    becomes llama.cpp's ``llama`` model: tokens, a score per token that ranks its merges as the
    tokenizer does (minus the rank of the first merge that makes it), types (``<0xNN>`` byte
    tokens, control and user-defined tokens) and the space prefix. Either way the vocabulary
    is padded to the model's ``vocab_size`` with ``[PAD{i}]`` tokens of the unused type (as
    llama.cpp's converter pads), and the special ids and flags and the chat template follow.

    Raises:
      ConfigError: a tokenizer of another kind, or larger than ``vocab_size``.

    Example:
      >>> from effijax.models import byte_level_bpe, sentencepiece_bpe
      >>> tok = byte_level_bpe(["<s>", "a", "b", "ab"], ["a b"], token_types=[3, 1, 1, 1],
      ...                      bos_id=0)
      >>> fields = gguf_tokenizer_fields(tok, vocab_size=5)
      >>> fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
      (['<s>', 'a', 'b', 'ab', '[PAD4]'], [3, 1, 1, 1, 5])
      >>> fields["tokenizer.ggml.merges"], fields["tokenizer.ggml.pre"]
      (['a b'], 'default')
      >>> spm = sentencepiece_bpe(["<s>", "<0x21>", "a", "b", "c", "ab", "bc"],
      ...                         [0, 0, 0, 0, 0, -2, -1], [3, 6, 1, 1, 1, 1, 1], bos_id=0,
      ...                         add_space_prefix=False)
      >>> fields = gguf_tokenizer_fields(spm, vocab_size=7)
      >>> fields["tokenizer.ggml.model"], fields["tokenizer.ggml.scores"]  # bc first, then ab
      ('llama', [0.0, 0.0, 0.0, 0.0, 0.0, -1.0, 0.0])
      >>> fields["tokenizer.ggml.token_type"], fields["tokenizer.ggml.add_space_prefix"]
      ([3, 6, 1, 1, 1, 1, 1], False)
    """
    spec = json.loads(tokenizer.spec)
    model = spec.get("model") or {}
    decoder = spec.get("decoder") or {}
    sentencepiece = model.get("type") == "BPE" and model.get("byte_fallback") is True
    if not sentencepiece and (model.get("type") != "BPE" or decoder.get("type") != "ByteLevel"):
        raise ConfigError("tokenizer", model.get("type"), "only byte-level BPE (llama.cpp's "
                          "'gpt2') and SentencePiece BPE ('llama') tokenizers are written to "
                          "GGUF")
    vocab = dict(model.get("vocab") or {})
    added = {t["id"]: t for t in spec.get("added_tokens") or []}
    for index, token in added.items():
        vocab.setdefault(token["content"], index)
    size = max(vocab.values(), default=-1) + 1
    if size > vocab_size:
        raise ConfigError("tokenizer", size, f"has more tokens than the model's vocab_size "
                          f"({vocab_size})")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [5] * vocab_size  # llama.cpp's UNUSED
    for token, index in vocab.items():
        tokens[index], types[index] = token, 1  # NORMAL
    merges = [m.split(" ", 1) if isinstance(m, str) else m for m in model.get("merges") or []]
    if sentencepiece:
        for index, token in enumerate(tokens[:size]):
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                types[index] = 6  # BYTE
    for index, token in added.items():
        types[index] = 3 if token.get("special") else 4  # CONTROL, USER_DEFINED
    fields = {"tokenizer.ggml.model": "llama" if sentencepiece else "gpt2",
              "tokenizer.ggml.pre": "default" if sentencepiece else _pre_name(tokenizer.backend),
              "tokenizer.ggml.tokens": tokens}
    if sentencepiece:
        first: dict[str, int] = {}
        for rank, (left, right) in enumerate(merges):
            first.setdefault(left + right, rank)
        fields["tokenizer.ggml.scores"] = [float(-first[t]) if t in first else 0.0
                                           for t in tokens]
        fields["tokenizer.ggml.add_space_prefix"] = \
            (spec.get("pre_tokenizer") or {}).get("type") == "Metaspace"
    fields["tokenizer.ggml.token_type"] = types
    if not sentencepiece:
        fields["tokenizer.ggml.merges"] = [" ".join(m) for m in merges]
    fields["tokenizer.ggml.add_bos_token"] = tokenizer.add_bos
    fields["tokenizer.ggml.add_eos_token"] = tokenizer.add_eos
    for key, value in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id),
                       ("unknown", tokenizer.unk_id), ("padding", tokenizer.pad_id)):
        if value is not None:
            fields[f"tokenizer.ggml.{key}_token_id"] = value
    if tokenizer.chat_template is not None:
        fields["tokenizer.chat_template"] = tokenizer.chat_template
    return fields


def _hyperparameters(model, arch: str, own: dict[str, Any]) -> dict[str, Any]:
    """``{architecture}.*``: what :func:`~effijax.interop.load_gguf` reads back; ``own``, the
    family's own keys (Gemma 3's window), last."""
    if getattr(model, "sliding_window", None) is not None and \
            f"{arch}.attention.sliding_window" not in own:
        warnings.warn(f"{model.name}: GGUF's {arch!r} architecture has no sliding window (as "
                      "llama.cpp writes Mistral models); readers of the file attend to every "
                      f"earlier key beyond {model.sliding_window} tokens", stacklevel=3)
    return {**{f"{arch}.{key}": kind(getattr(model, field))
               for key, (field, kind) in GGUF_HYPERPARAMETERS.items()}, **own}


def _add_field(writer, key: str, value) -> None:
    """One metadata entry, typed as llama.cpp's converter types it (counts and ids uint32,
    floats f32; an array's items typed by the ``gguf`` writer: token types int32)."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_array(key, list(value))


def _tensor_plan(model, fmt, leaves, qtype_name: str):
    """``[(path, layer, gguf name, torch shape, ggml type)]`` in the family's order."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    matrix_type = GGMLQuantizationType[GGUF_DTYPES[qtype_name][0]]
    block = GGML_QUANT_SIZES[matrix_type][0]
    plan = []
    for path, (_, gg) in fmt.tensors.items():
        if path not in leaves:
            continue
        leaf = leaves[path]
        stacked = path.startswith("layers/")
        shape = tuple(leaf.shape[1:] if stacked else leaf.shape)
        torch_shape = shape[::-1] if path.endswith("/kernel") else shape
        if len(torch_shape) < 2:
            kind = GGMLQuantizationType.F32
        elif torch_shape[-1] % block == 0:
            kind = matrix_type
        else:  # rows that do not split into whole blocks: f16, as llama.cpp falls back
            kind = GGMLQuantizationType.F16 if block > 1 else matrix_type
        for layer in (range(model.n_layers) if stacked else [None]):
            plan.append((path, layer, gg.format(i=layer), torch_shape, kind))
    return plan


def _encoded(w: np.ndarray, kind) -> np.ndarray:
    """``w`` (f32, torch layout) as the bytes or floats of ggml type ``kind``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if kind == GGMLQuantizationType.F32:
        return np.ascontiguousarray(w, np.float32)
    if kind == GGMLQuantizationType.F16:
        return np.ascontiguousarray(w, np.float16)
    return quantize(np.ascontiguousarray(w, np.float32), kind)


def _write_body(writer, plan, leaves, fmt, model, adapters, lora, rope_freqs) -> None:
    """The metadata, the tensor infos, then each tensor (one parameter on the host at a time),
    after ``rope_freqs`` if the model has them (first, as llama.cpp's converter writes them)."""
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    if rope_freqs is not None:
        writer.write_tensor_data(rope_freqs)
    host: dict[str, np.ndarray] = {}
    for path, layer, gg, _, kind in plan:
        if path not in host:
            host.clear()
            host[path] = np.asarray(
                host_array(_merged_leaf(path, leaves[path], adapters, lora)), np.float32)
        w = to_hf(path, host[path] if layer is None else host[path][layer])
        if fmt.gguf_norm_offset and gg.endswith("norm.weight"):
            w = w + np.float32(fmt.gguf_norm_offset)  # Gemma's (1 + w) as llama.cpp stores it
        if fmt.gguf_permuted and gg.endswith("attn_q.weight"):
            w = permute(w, model.n_heads)
        elif fmt.gguf_permuted and gg.endswith("attn_k.weight"):
            w = permute(w, model.n_kv_heads)
        writer.write_tensor_data(_encoded(w, kind))


def save_gguf(path: str | os.PathLike, model, params, *, adapters=None, lora=None,
              dtype: str = "f16", name: str | None = None) -> str:
    """Writes ``model`` with ``params`` (and LoRA ``adapters``, merged in f32) as one GGUF file.

    Args:
      path: the ``.gguf`` file to write (its folder must exist); replaced whole.
      model: the architecture of a family with a GGUF format (Llama, Qwen2; Mistral is
        written as llama.cpp writes it, a ``llama`` without its sliding window) and,
        for a file llama.cpp can run, its tokenizer (a byte-level BPE one). A Llama's
        ``rope_scaling`` (Llama 3's) is written as llama.cpp's converter writes it, the tensor
        ``rope_freqs.weight`` (:func:`~effijax.models.rope_factors`), which
        :func:`~effijax.interop.load_gguf` reads back to the same config.
      params: its parameters (sharded or not).
      adapters, lora: LoRA adapters and their spec, merged into the weights; or neither.
      dtype: the matrices' type, one of :data:`GGUF_DTYPES`.
      name: ``general.name`` (default: the model's name).

    Returns:
      ``path``, as a string.

    Raises:
      ConfigError: an unknown ``dtype``, a family without a GGUF architecture, a model
        feature GGUF cannot hold (rotary scaling in a Qwen2), a tokenizer of another kind;
        raised before anything is written.

    Example:
      >>> import tempfile, os, jax, numpy as np
      >>> from effijax.interop import load_gguf
      >>> from effijax.models import llama_config
      >>> model = llama_config("llama-tiny")
      >>> params = model.init_params(jax.random.key(0))
      >>> file = save_gguf(os.path.join(tempfile.mkdtemp(), "tiny.gguf"), model, params,
      ...                  dtype="f32")
      >>> loaded, back = load_gguf(file, seq_len=model.seq_len)
      >>> loaded == model, all(np.array_equal(a, b) for a, b in zip(
      ...     jax.tree.leaves(back), jax.tree.leaves(params)))
      (True, True)
    """
    import gguf

    qtype_name = _check_dtype(dtype)
    leaves = export_leaves(model, params, adapters, lora)
    fmt, metadata, tokenizer_fields = _checked(model)
    arch = fmt.gguf_architecture
    fields = {"general.architecture": arch, "general.name": name or model.name,
              **_hyperparameters(model, arch, metadata), **tokenizer_fields}
    plan = _tensor_plan(model, fmt, leaves, qtype_name)
    rope_freqs = _rope_freqs(model)
    file_type = gguf.LlamaFileType[GGUF_DTYPES[qtype_name][1]]

    def fill(tmp) -> None:
        writer = gguf.GGUFWriter(None, arch)
        for key, value in fields.items():
            if key != "general.architecture":
                _add_field(writer, key, value)
        writer.add_file_type(int(file_type))
        if qtype_name not in ("f32", "f16", "bf16"):
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        if rope_freqs is not None:
            writer.add_tensor_info(ROPE_FREQS, rope_freqs.shape, rope_freqs.dtype,
                                   rope_freqs.nbytes, raw_dtype=gguf.GGMLQuantizationType.F32)
        for _, _, gg, shape, kind in plan:
            block, size = gguf.GGML_QUANT_SIZES[kind]
            nbytes = math.prod(shape) // block * size
            writer.add_tensor_info(gg, shape, np.dtype(np.float32), nbytes, raw_dtype=kind)
        writer.write_header_to_file(path=tmp)
        try:
            _write_body(writer, plan, leaves, fmt, model, adapters, lora, rope_freqs)
        finally:
            writer.close()  # on a failure too (the temporary file is then removed)

    atomic.write_with(path, fill)
    return os.fspath(path)
