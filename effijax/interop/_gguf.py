"""GGUF files (llama.cpp's format): architecture, weights and tokenizer in one file.

:func:`load_gguf` reads the hyperparameters (``llama.block_count``, ``llama.embedding_length``,
...; ``qwen2.*`` for a Qwen2: ``general.architecture`` picks the registered
:class:`~effijax.models.PretrainedFormat`) into the family's config, the tokenizer from
``tokenizer.ggml.*`` (see :func:`effijax.models.byte_level_bpe` and
:func:`effijax.models.sentencepiece_bpe`), and the tensors, dequantized
with
``gguf.quants.dequantize`` (Q4_1, Q8_0, F16, ... to f32, then the parameter dtype). The file is
memory-mapped, so a tensor is read when its parameter is assembled. Nothing in the file is
trusted before it is checked: the layout by :func:`~effijax.interop._gguf_check.read_gguf` as
it reads the file (counts, lengths and offsets against the file's size), the hyperparameters
and tokenizer fields here (types, ranges, a model-size bound), the tensors' types and finiteness
as they are read; each failure is one :class:`~effijax.errors.FileError` naming the file.

Two conventions differ from Hugging Face's. GGUF lists shapes in ggml order (``(in, out)``), but
the dequantized arrays are row-major ``(out, in)``, torch's layout. And llama.cpp's converter
permutes the rows of ``attn_q``/``attn_k`` so that each head's rotary pairs are adjacent
(``(x0, x1), (x2, x3), ...``) instead of Hugging Face's halves (``x_i`` with ``x_{i+K/2}``); the
loader undoes it (:func:`unpermute`; Qwen2's converter does not permute). No ``output.weight``
means the head is tied to the embedding.

Llama 3.1/3.2's rotary scaling is stored by llama.cpp's converter as a tensor,
``rope_freqs.weight``: what each rotary frequency is divided by. It is not a parameter: the
loader recovers the config's ``rope_scaling`` from it (:func:`effijax.models.llama3_scaling`,
which checks that the four numbers give the file's factors back), so the model computes the
file's frequencies with its own rule. Other ``{architecture}.rope.scaling.type`` values (linear,
YaRN) are refused.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import numpy as np

from effijax.errors import ConfigError, FileError, whole_number
from effijax.interop._files import LIMITS, check_finite, check_size, number_field, whole_field
from effijax.interop._gguf_check import GgufFile, read_gguf
from effijax.interop._gguf_types import GGUF_HYPERPARAMETERS
from effijax.interop._hf import DEFAULT_SEQ_LEN
from effijax.interop._weights import assemble_params, check_tensors, expected_hf_shapes
from effijax.models import (
    LlamaConfig,
    PretrainedFormat,
    Tokenizer,
    byte_level_bpe,
    format_of,
    llama3_scaling,
    pretrained_format,
    sentencepiece_bpe,
)
from effijax.paths import named_leaves

__all__ = ["load_gguf", "gguf_config", "gguf_kept_bytes", "gguf_tokenizer", "open_gguf",
           "permute", "unpermute", "read_metadata"]

_Q, _K = "self_attn.q_proj.weight", "self_attn.k_proj.weight"

#: The tensor in which llama.cpp's converter stores Llama 3's rotary scaling: what each rotary
#: frequency is divided by (:func:`~effijax.models.rope_factors`), f32, ``[head_dim / 2]``.
ROPE_FREQS = "rope_freqs.weight"


def _dequantized() -> frozenset:
    """The ggml types ``gguf.quants.dequantize`` turns into floats."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    return frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits})


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order: per head, the rotary halves interleaved.

    ``w`` is ``(n_heads · K, d_in)`` in Hugging Face's order.

    Example:
      >>> permute(np.arange(4)[:, None], 1)[:, 0].tolist()  # halves (0, 1), (2, 3)
      [0, 2, 1, 3]
    """
    k = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, k // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of :func:`permute`: GGUF's Q/K rows back in Hugging Face's order.

    Example:
      >>> w = np.random.default_rng(0).normal(size=(12, 5))
      >>> bool(np.array_equal(unpermute(permute(w, 3), 3), w))
      True
    """
    k = w.shape[0] // n_heads
    return w.reshape(n_heads, k // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_metadata(reader: GgufFile) -> dict:
    """A GGUF file's key/value metadata as plain Python values (arrays are lists)."""
    return reader.metadata


def open_gguf(source: str) -> GgufFile:
    """A GGUF file's metadata and tensors (:func:`~effijax.interop._gguf_check.read_gguf`:
    its layout checked as it is read; the tensors' data memory-mapped)."""
    if not os.path.isfile(source):
        raise FileNotFoundError(f"no GGUF file at {source!r}")
    return read_gguf(source)


def _f32(value) -> float:
    """A float stored as f32, as the shortest decimal that rounds to it (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _token_list(metadata: dict, key: str, source: str, item: type, size: int | None):
    """``metadata[key]``: None, or a list of ``item`` (of ``size`` entries when given)."""
    value = metadata.get(key)
    if value is None:
        return None
    # Checked per distinct type (a vocabulary's 262,144 entries have one), not per entry.
    if not isinstance(value, list) or not all(issubclass(t, item) and not issubclass(t, bool)
                                              for t in set(map(type, value))):
        raise FileError(source, key, f"expected a list of {item.__name__}")
    if size is not None and len(value) != size:
        raise FileError(source, key, f"has {len(value):,} entries; expected one per token "
                        f"({size:,})")
    return value


# The tokenizer models read (``tokenizer.ggml.model``): byte-level BPE and SentencePiece.
_TOKENIZER_MODELS = ("gpt2", "llama")


def _check_tokenizer(metadata: dict, source: str) -> None:
    """The ``tokenizer.ggml.*`` fields :func:`byte_level_bpe` and :func:`sentencepiece_bpe`
    read, checked for type and range (they would fail on them with whatever the tokenizers
    library says, or build a wrong tokenizer)."""
    tokens = _token_list(metadata, "tokenizer.ggml.tokens", source, str, None)
    if not tokens or len(tokens) > LIMITS["vocab_size"]:
        raise FileError(source, "tokenizer.ggml.tokens", f"expected 1 to "
                        f"{LIMITS['vocab_size']:,} tokens")
    if metadata["tokenizer.ggml.model"] == "gpt2":
        merges = _token_list(metadata, "tokenizer.ggml.merges", source, str, None) or []
        bad = next((m for m in merges if len(m.split(" ", 1)) != 2), None)
        if bad is not None:
            raise FileError(source, "tokenizer.ggml.merges", f"{bad!r} is not a pair; expected "
                            "'left right'")
    else:  # SentencePiece: a finite score per token
        key = "tokenizer.ggml.scores"
        if metadata.get(key) is None:
            raise FileError(source, key, "missing; a SentencePiece ('llama') tokenizer needs a "
                            "score per token")
        scores = np.asarray(_token_list(metadata, key, source, float, len(tokens)), np.float64)
        if not np.isfinite(scores).all():
            bad = int(np.nonzero(~np.isfinite(scores))[0][0])
            raise FileError(source, key, f"token {bad}'s score is {scores[bad]}; expected a "
                            "finite number")
    types = _token_list(metadata, "tokenizer.ggml.token_type", source, int, len(tokens)) or []
    bad = next((t for t in types if not 0 <= t <= 6), None)
    if bad is not None:
        raise FileError(source, "tokenizer.ggml.token_type", f"has {bad}; expected llama.cpp's "
                        "types 0 to 6")
    for name in ("bos", "eos", "unknown", "padding"):
        key = f"tokenizer.ggml.{name}_token_id"
        try:  # a token id: a whole number below the vocabulary's size
            whole_number(key, metadata.get(key), minimum=0, maximum=len(tokens) - 1, none=True)
        except ConfigError as e:
            raise FileError.of(source, e) from None
    for key in ("tokenizer.ggml.pre", "tokenizer.chat_template"):
        if metadata.get(key) is not None and not isinstance(metadata[key], str):
            raise FileError(source, key, f"{metadata[key]!r}; expected a string")
    for name in ("add_bos_token", "add_eos_token", "add_space_prefix"):
        key = f"tokenizer.ggml.{name}"
        if metadata.get(key) is not None and not isinstance(metadata[key], bool):
            raise FileError(source, key, f"{metadata[key]!r}; expected true or false")


def gguf_tokenizer(metadata: dict, *, pre: str | None = None,
                   source: str = "GGUF") -> Tokenizer | None:
    """The tokenizer a GGUF's ``tokenizer.*`` metadata describes, or None.

    ``tokenizer.ggml.model`` says which: ``gpt2`` is byte-level BPE (:func:`byte_level_bpe`,
    with the merges and the ``pre`` split), ``llama`` SentencePiece (:func:`sentencepiece_bpe`:
    tokens, scores and token types, spaces as ``▁``, byte fallback; Gemma's and Llama 2's).
    BOS is added as ``tokenizer.ggml.add_bos_token`` says (for SentencePiece, llama.cpp's
    default: yes), and the prefix space as ``add_space_prefix`` says (default: yes).

    Args:
      metadata: from :func:`read_metadata`.
      pre: override ``tokenizer.ggml.pre`` (e.g. ``"gpt2"``: the split ``transformers`` uses
        for every byte-level GGUF, which differs from SmolLM's on whitespace before digits);
        SentencePiece has no such split and ignores it.
      source: the file, for the errors.

    Raises:
      FileError: the tokenizer metadata is malformed (naming ``source`` and the key).

    Warns:
      UserWarning: a tokenizer model other than these (e.g. ``t5``, ``bert``), which is not
        supported: the model loads without a tokenizer.

    Example:
      >>> tok = gguf_tokenizer({"tokenizer.ggml.model": "llama",
      ...                       "tokenizer.ggml.tokens": ["<s>", "▁", "a", "▁a"],
      ...                       "tokenizer.ggml.scores": [0.0, -1.0, -2.0, -3.0],
      ...                       "tokenizer.ggml.token_type": [3, 1, 1, 1],
      ...                       "tokenizer.ggml.bos_token_id": 0})
      >>> tok.encode("a a", add_special_tokens=True).tolist()  # BOS, prefix space: "▁a▁a"
      [0, 3, 3]
    """
    kind = metadata.get("tokenizer.ggml.model")
    if kind is None:
        return None
    if kind not in _TOKENIZER_MODELS:
        warnings.warn(f"GGUF tokenizer.ggml.model={kind!r} is not supported (byte-level BPE "
                      "'gpt2' and SentencePiece 'llama' only); the model is loaded without a "
                      "tokenizer", stacklevel=3)
        return None
    _check_tokenizer(metadata, source)
    get = metadata.get
    special = dict(bos_id=get("tokenizer.ggml.bos_token_id"),
                   eos_id=get("tokenizer.ggml.eos_token_id"),
                   unk_id=get("tokenizer.ggml.unknown_token_id"),
                   pad_id=get("tokenizer.ggml.padding_token_id"),
                   add_eos=get("tokenizer.ggml.add_eos_token", False),
                   chat_template=get("tokenizer.chat_template"))
    try:
        if kind == "llama":
            return sentencepiece_bpe(
                get("tokenizer.ggml.tokens"), get("tokenizer.ggml.scores"),
                get("tokenizer.ggml.token_type"),
                add_space_prefix=get("tokenizer.ggml.add_space_prefix", True),
                add_bos=get("tokenizer.ggml.add_bos_token", True), **special)
        return byte_level_bpe(
            get("tokenizer.ggml.tokens"), get("tokenizer.ggml.merges") or [],
            pre=pre or get("tokenizer.ggml.pre") or "default",
            token_types=get("tokenizer.ggml.token_type"),
            add_bos=get("tokenizer.ggml.add_bos_token", False), **special)
    except ConfigError as e:
        raise FileError.of(source, e) from None
    except Exception as e:  # noqa: BLE001 (the tokenizers library raises plain Exception)
        raise FileError(source, "tokenizer.ggml.*", "the tokenizers library refuses the "
                        f"vocabulary ({str(e).splitlines()[0] if str(e) else e!r})") from None


def _config(metadata: dict, tensors: dict, *, seq_len, tokenizer, source,
            rope_freqs) -> LlamaConfig:
    """The architecture; every field checked (naming the file and the key) before it is used."""
    try:
        fmt = pretrained_format(gguf_architecture=metadata.get("general.architecture"))
        config = _block_config(fmt, metadata, tensors, seq_len=seq_len, tokenizer=tokenizer,
                               source=source, rope_freqs=rope_freqs)
    except ConfigError as e:
        raise FileError.of(source, e) from None
    check_size(config, source)
    return config


def _read_rope_freqs(tensors: dict, source: str) -> np.ndarray | None:
    """The values of the file's :data:`ROPE_FREQS` tensor (``head_dim / 2`` floats, the one
    tensor read for the config), or None when it has none."""
    from gguf.quants import dequantize

    t = tensors.get(ROPE_FREQS)
    if t is None:
        return None
    if t.tensor_type not in _dequantized():
        raise FileError(source, f"tensor {ROPE_FREQS!r}", f"type {t.tensor_type.name} is not "
                        "one effijax reads (llama.cpp writes it F32)")
    with np.errstate(all="ignore"):
        values = dequantize(t.data, t.tensor_type).reshape(tuple(int(n) for n in
                                                                 reversed(t.shape)))
    check_finite(source, ROPE_FREQS, values)
    return values


def _block_config(fmt: PretrainedFormat, metadata: dict, tensors: dict, *, seq_len, tokenizer,
                  source, rope_freqs) -> LlamaConfig:
    """A Llama-block family's config from its ``{architecture}.*`` keys (and Llama 3's rotary
    scaling from ``rope_freqs``, the values of the file's :data:`ROPE_FREQS`, if any)."""
    arch = fmt.gguf_architecture

    def whole(key, default=None):  # bounded as the config field the key holds
        return whole_field(metadata, f"{arch}.{key}", GGUF_HYPERPARAMETERS[key][0], source,
                           default)

    def number(key, default=None):
        return _f32(number_field(metadata, f"{arch}.{key}", source, default))

    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", None):
        raise ConfigError(f"{arch}.rope.scaling.type", kind, "effijax reads Llama 3's rotary "
                          f"scaling ({ROPE_FREQS}) from GGUF, no other; load the Hugging Face "
                          "checkpoint instead")
    d, heads = whole("embedding_length"), whole("attention.head_count")
    head_dim = whole("attention.key_length", max(d // heads, 1))
    rope_dim = whole("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ConfigError(f"{arch}.rope.dimension_count", rope_dim,
                          f"partial rotary embeddings (head_dim {head_dim}) are not supported")
    # Older files have no vocab_size: the embedding's rows, or the tokenizer's size.
    vocab = (tensors["token_embd.weight"][0] if "token_embd.weight" in tensors else
             len(metadata.get("tokenizer.ggml.tokens") or ()))
    max_position = whole("context_length", 2048)
    theta = number("rope.freq_base", 10000.0)
    scaling = None
    if rope_freqs is not None:  # the frequencies are the file's: the numbers that give them
        try:
            scaling = llama3_scaling(rope_freqs, head_dim, theta, name=ROPE_FREQS)
        except ConfigError as e:
            raise ConfigError(e.field, e.value, f"{e.problem}; load the Hugging Face "
                              "checkpoint instead") from None
    return fmt.config(
        vocab_size=whole("vocab_size", vocab), d_model=d, n_layers=whole("block_count"),
        n_heads=heads, n_kv_heads=whole("attention.head_count_kv", heads), head_dim=head_dim,
        d_ff=whole("feed_forward_length"), rope_theta=theta, rope_scaling=scaling,
        rms_eps=number("attention.layer_norm_rms_epsilon"),
        tie_embeddings="output.weight" not in tensors,
        seq_len=min(max_position, DEFAULT_SEQ_LEN) if seq_len is None else seq_len,
        max_position=max_position, tokenizer=tokenizer, **fmt.gguf_fields(metadata))


def gguf_config(path: str | os.PathLike, *, seq_len: int | None = None) -> LlamaConfig:
    """The architecture a GGUF file describes, from its metadata and tensor shapes (no weight
    is read, no tokenizer built; only Llama 3's rotary factors, the ``head_dim / 2`` floats of
    ``rope_freqs.weight``, when the file has them): what :func:`effijax.memory` needs of a
    model.

    Raises:
      FileError: the file is malformed or describes an unsupported or implausible model.
    """
    return _header(os.fspath(path), seq_len)[0]


def _header(source: str, seq_len: int | None) -> tuple[LlamaConfig, dict]:
    """``(config, {name: tensor})`` from the file's metadata and tensor table (no weight
    read, no tokenizer built)."""
    reader = open_gguf(source)
    tensors = {t.name: t for t in reader.tensors}
    shapes = {name: tuple(int(n) for n in reversed(t.shape)) for name, t in tensors.items()}
    return _config(read_metadata(reader), shapes, seq_len=seq_len, tokenizer=None,
                   source=source, rope_freqs=_read_rope_freqs(tensors, source)), tensors


def _kept_layers(config, fmt: PretrainedFormat, tensors: dict) -> dict:
    """``{path: [each layer's tensor]}``: the stacked kernels whose every layer the file holds
    in a block type kept as it is (:data:`~effijax.precision.GGML_BLOCKS`); a role in F32 or
    F16 in some layer is left out (dequantized as usual)."""
    from effijax.precision import GGML_BLOCKS

    kept = {}
    for path, (_, gg) in fmt.tensors.items():
        if path.startswith("layers/") and path.endswith("/kernel"):
            layers = [tensors[gg.format(i=i)] for i in range(config.n_layers)]
            if all(t.tensor_type.name in GGML_BLOCKS for t in layers):
                kept[path] = layers
    return kept


def _kept_blocks(config, fmt: PretrainedFormat, tensors: dict, source: str) -> dict:
    """``{path: GGMLBlocks}`` of :func:`_kept_layers`, rows as the file holds them (Q/K rows
    unpermuted). Each tensor is decoded once, transiently, to check that its scales are
    finite."""
    from gguf.quants import dequantize

    from effijax.precision import ggml_blocks

    kept = {}
    for path, layers in _kept_layers(config, fmt, tensors).items():
        for t in layers:
            with np.errstate(all="ignore"):  # a forged scale overflows: said just below
                check_finite(source, t.name, dequantize(t.data, t.tensor_type))
        hf = fmt.tensors[path][0]
        heads = (config.n_heads if hf.endswith(_Q) else config.n_kv_heads
                 if hf.endswith(_K) else None)
        rows = [np.asarray(t.data) if heads is None or not fmt.gguf_permuted
                else unpermute(np.asarray(t.data), heads) for t in layers]
        in_features = int(layers[0].shape[0])  # ggml order: (in, out)
        kept[path] = ggml_blocks([(t.tensor_type.name, r) for t, r in zip(layers, rows,
                                                                          strict=True)],
                                 in_features, path=path)
    return kept


def gguf_kept_bytes(path: str | os.PathLike, *, dtype: Any = "bf16") -> int:
    """Exact bytes of a LoRA base loaded from a GGUF file with its blocks kept
    (``--frozen-dtype gguf``): the kept kernels' rows (padded as
    :class:`~effijax.precision.GGMLBlocks` pads them) and type indices, every other parameter
    in ``dtype``. From the file's header alone (no tensor is read). The same count as the
    loaded base's arrays' ``nbytes`` (tested).

    Raises:
      FileError: the file is malformed or describes an unsupported model.
    """
    from effijax.precision import ggml_blocks_bytes, parse_dtype

    itemsize = np.dtype(parse_dtype(dtype)).itemsize
    config, tensors = _header(os.fspath(path), None)
    kept = _kept_layers(config, format_of(config), tensors)
    total = 0
    for name, leaf in named_leaves(config.abstract_params()):
        if name in kept:
            total += ggml_blocks_bytes([t.tensor_type.name for t in kept[name]],
                                       *leaf.shape[-2:])
        else:
            total += math.prod(leaf.shape) * itemsize
    return total


def load_gguf(path: str | os.PathLike, *, policy=None, shardings=None,
              seq_len: int | None = None, pre: str | None = None,
              keep_blocks: bool = False) -> tuple[LlamaConfig, dict]:
    """Loads a GGUF file of a registered architecture (``general.architecture`` ``"llama"``,
    ``"qwen2"``, ``"gemma3"``): config, tokenizer and dequantized parameters.

    Args:
      path: the ``.gguf`` file.
      policy: the parameters' dtypes (default f32).
      shardings: where each parameter goes (a tree like the parameters, or one sharding);
        default: the default device.
      seq_len: the training window (default ``min({architecture}.context_length, 2048)``).
      pre: override the tokenizer's pre-tokenizer name (see :func:`gguf_tokenizer`).
      keep_blocks: keep the layers' quantized kernels as the file's blocks
        (:class:`~effijax.precision.GGMLBlocks`, a QLoRA base with no requantization: see
        ``--frozen-dtype gguf``) instead of dequantizing them; a role the file holds in F32 or
        F16 in some layer is dequantized as usual.

    Returns:
      ``(config, params)``, ``params`` matching ``config.abstract_params(policy)`` (with
      ``keep_blocks``, the kept kernels' shapes: :func:`~effijax.precision.dequantized_shapes`).

    Raises:
      FileNotFoundError: no such file.
      FileError: a malformed file (its layout is checked before anything is read), another
        architecture, unsupported features, tensors missing, unexpected or misshaped (all
        named at once), or of a type that is not dequantized.
    """
    from gguf.quants import dequantize

    source = os.fspath(path)
    reader = open_gguf(source)
    metadata = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}  # views into the memory-mapped file
    # ggml lists dimensions fastest-first: reversed, they are torch's (out, in).
    shapes = {name: tuple(int(n) for n in reversed(t.shape)) for name, t in tensors.items()}
    config = _config(metadata, shapes, seq_len=seq_len,
                     tokenizer=gguf_tokenizer(metadata, pre=pre, source=source), source=source,
                     rope_freqs=_read_rope_freqs(tensors, source))
    # The metadata (the vocabulary's strings, scores and merges: tens of MB for Gemma 3's
    # 262,144 tokens) is not needed past this point; the tensors keep the file mapped.
    del reader, metadata
    fmt = format_of(config)
    to_gguf = {}
    for path_, (hf, gg) in fmt.tensors.items():
        for layer in (range(config.n_layers) if path_.startswith("layers/") else [None]):
            to_gguf[hf.format(i=layer)] = gg.format(i=layer)
    expected = {to_gguf[name]: shape for name, (_, _, shape) in expected_hf_shapes(config).items()}
    # The rotary factors are in the config now, not a parameter.
    check_tensors(expected, shapes, source=source, ignored=lambda name: name == ROPE_FREQS)
    dequantized = _dequantized()
    for name in expected:
        if tensors[name].tensor_type not in dequantized:
            raise FileError(source, f"tensor {name!r}", f"type "
                            f"{tensors[name].tensor_type.name} is not a weight type effijax "
                            f"dequantizes ({', '.join(sorted(t.name for t in dequantized))})")

    def read(hf_name: str) -> np.ndarray:
        t = tensors[to_gguf[hf_name]]
        with np.errstate(all="ignore"):  # a forged scale overflows: said just below
            w = dequantize(t.data, t.tensor_type).reshape(shapes[t.name])
        check_finite(source, t.name, w)
        if fmt.gguf_norm_offset and t.name.endswith("norm.weight"):
            w = w - np.float32(fmt.gguf_norm_offset)  # Gemma's (1 + w), stored as 1 + w
        if fmt.gguf_permuted and hf_name.endswith(_Q):
            w = unpermute(w, config.n_heads)
        elif fmt.gguf_permuted and hf_name.endswith(_K):
            w = unpermute(w, config.n_kv_heads)
        return w

    kept = _kept_blocks(config, fmt, tensors, source) if keep_blocks else None
    params = assemble_params(config, read, policy=policy, shardings=shardings, kept=kept)
    return config, params
