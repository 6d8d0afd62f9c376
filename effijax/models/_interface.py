"""The model interface: what the training recipe needs from a language model family.

A model is a frozen dataclass of architecture fields that also provides the functions of that
architecture. The recipe, the memory estimator and the sharding strategies talk to it only
through :class:`LanguageModel`, so a new family (the GPT here, a Llama-family decoder next)
plugs in by implementing these methods and registering itself with :func:`register_family`:

* ``abstract_params(policy)`` / ``init_params(key, policy)``: the parameter tree (plain nested
  dicts; '/'-joined paths are what precision overrides, sharding rules and LoRA targets match);
* ``loss_fn(lora)`` / ``logits_fn(lora)``: pure functions of compute-dtype parameters (with a
  :class:`~effijax.lora.LoraSpec`, of ``{"base": params, "adapters": adapters}``);
* ``partition_rules()``, ``tensor_layout()``, ``lora_targets``: how the strategies lay the
  parameters out (and how a ``tensor`` axis splits them), and which kernels LoRA adapts;
* ``shape()``: the numbers the memory formulas need; ``encode(data)``: the tokenizer;
* ``init_cache(batch, max_len)`` / ``decode_fn(lora)``: decoding with a key/value cache.

A family with pretrained checkpoints also registers a :class:`PretrainedFormat` with
:func:`register_pretrained`: the Hugging Face ``model_type`` (and GGUF ``general.architecture``)
that names it, its ``config.json`` checks and fields, and its tensor names. :mod:`effijax.interop`
reads and writes every registered format, and refuses any other naming the supported ones.

A batch is ``{"inputs": int32[B, S], "targets": int32[B, S]}``, optionally with ``"mask"``
(``[B, S]``, nonzero where the target is trained on) and, for rows that pack several examples,
``"segments"`` (int32 ``[B, S]``, the inputs' example ids, 0 for padding: attention stays
within an example and positions restart at each example's start); the loss is the mean
cross-entropy over the trained positions, in f32.
"""

from __future__ import annotations

import abc
import dataclasses
import difflib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np

from effijax.errors import ConfigError

__all__ = ["LanguageModel", "ModelShape", "register_family", "model_from_dict", "FAMILIES",
           "preset", "preset_names", "PretrainedFormat", "PRETRAINED", "register_pretrained",
           "pretrained_format", "format_of"]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The architecture numbers the memory estimator needs (the activation formula's letters).

    Attributes:
      num_params: parameters of the model (the loaded tree's count, embeddings included).
      layers: transformer blocks ``L``.
      hidden: residual width ``h``.
      heads: query heads ``a``.
      kv_heads: key/value heads (``heads`` without grouped-query attention).
      head_dim: width of one head.
      ffn: MLP hidden width.
      vocab: vocabulary size.
      seq_len: the training sequence length ``s``.
      gated_mlp: the MLP has a gate (SwiGLU, GeGLU: three matrices) rather than two.
      sandwich_norms: norms after the attention and the MLP and on the query and key heads
        too (Gemma 3), whose inputs the backward pass keeps.
    """

    num_params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    seq_len: int
    gated_mlp: bool = False
    sandwich_norms: bool = False

    def activation_args(self) -> dict:
        """The shape as :func:`effijax.memory.activation_bytes` and :func:`effijax.memory.plan`
        take it (all but the sequence length and batch, which a run chooses).

        Example:
          >>> ModelShape(num_params=1, layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16,
          ...            ffn=128, vocab=256, seq_len=32, gated_mlp=True).activation_args()["ffn"]
          128
        """
        return {"layers": self.layers, "hidden": self.hidden, "heads": self.heads,
                "kv_heads": self.kv_heads, "head_dim": self.head_dim, "ffn": self.ffn,
                "gated_mlp": self.gated_mlp, "vocab": self.vocab,
                "sandwich_norms": self.sandwich_norms}


class LanguageModel(abc.ABC):
    """A causal language model: a frozen architecture config plus the functions of it.

    Implementations are frozen dataclasses (change them with ``dataclasses.replace``) whose
    ``family`` names them in :data:`FAMILIES`; ``to_dict``/``model_from_dict`` round-trip them
    through a run's ``config.json``.
    """

    family: ClassVar[str]
    # The family's named configurations (one table per family; names are unique across them).
    presets: ClassVar[dict[str, LanguageModel]]
    # Fields (or properties) every implementation has: the training sequence length (tokens
    # per row of a batch) and the number of token ids.
    seq_len: int
    vocab_size: int
    # The default LoRA targets: a regex over '/'-joined parameter paths (every attention and MLP
    # kernel of the blocks, what "LoRA Learns Less and Forgets Less" adapts).
    lora_targets: ClassVar[str]

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """A short human-readable name for logs and plots, e.g. ``"mini GPT"``."""

    @abc.abstractmethod
    def with_seq_len(self, seq_len: int) -> LanguageModel:
        """The same model trained on windows of ``seq_len`` tokens (a :class:`ConfigError`
        naming ``seq_len`` when the architecture cannot take it)."""

    @abc.abstractmethod
    def abstract_params(self, policy: Any = None) -> Any:
        """The parameter tree as ``jax.ShapeDtypeStruct`` leaves (nothing allocated); in the
        policy's ``param_dtype``."""

    @abc.abstractmethod
    def init_params(self, key: Any, policy: Any = None) -> Any:
        """Freshly initialised parameters (jit it with ``out_shardings`` to create them
        sharded)."""

    @abc.abstractmethod
    def loss_fn(self, lora: Any = None, *, sequence_parallel: bool = True,
                frozen_base: bool = False) -> Callable[..., tuple[Any, dict]]:
        """``loss_fn(params, batch, rng=None) -> (loss, aux)``: mean cross-entropy in f32 over
        the trained positions; ``aux`` holds f32 scalars (e.g. ``accuracy``). Dropout runs when
        ``rng`` is a key. With ``lora`` (a :class:`~effijax.lora.LoraSpec`) ``params`` is
        ``{"base": ..., "adapters": ...}``. ``sequence_parallel``: on a ``tensor > 1`` mesh,
        split the activations between the blocks along the sequence
        (:func:`effijax.sharding.activation_spec`). ``frozen_base``: with ``lora``, no gradient
        reaches the base (see :func:`effijax.models.make_apply`)."""

    @abc.abstractmethod
    def logits_fn(self, lora: Any = None) -> Callable[..., Any]:
        """``logits_fn(params, tokens_BS, segments_BS=None) -> logits_BSV`` in the policy's
        output dtype; ``segments_BS`` as a batch's ``"segments"``."""

    @abc.abstractmethod
    def shape(self) -> ModelShape:
        """The architecture's numbers for :mod:`effijax.memory`."""

    @abc.abstractmethod
    def to_dict(self) -> dict:
        """The architecture as a JSON-able dict, ``family`` included."""

    @classmethod
    @abc.abstractmethod
    def from_dict(cls, fields: dict) -> LanguageModel:
        """Rebuilds the model from :meth:`to_dict`'s output (without ``family``)."""

    # Decoding with a key/value cache (effijax.generate). A family without it keeps these
    # defaults, and generation says so before anything is traced.

    @property
    def max_context(self) -> int:
        """The most positions the model can attend over (a cache's largest ``max_len``)."""
        return self.seq_len

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> Any:
        """An empty :class:`~effijax.models.KVCache` for ``batch`` rows of ``max_len``
        positions, in ``dtype`` (the compute dtype; default f32)."""
        raise NotImplementedError(f"{self.name}: the {self.family} family has no KV cache")

    def decode_fn(self, lora: Any = None) -> Callable[..., tuple[Any, Any]]:
        """``decode(params, cache, tokens_BS, start, last=None) -> (logits, cache)``: the
        forward pass of new tokens at positions ``start ..`` against the cache, see
        :func:`effijax.models.make_decode`."""
        raise NotImplementedError(f"{self.name}: the {self.family} family has no KV cache")

    def partition_rules(self) -> list[tuple[str, Any]] | None:
        """Partition rules for :func:`effijax.sharding.partition_specs` (None: automatic)."""
        return None

    def tensor_layout(self) -> Any:
        """The :class:`effijax.sharding.TensorLayout` that splits the model over a mesh's
        ``tensor`` axis (None: the model is not tensor-parallel; its weights are replicated
        over ``tensor``)."""
        return None

    def encode(self, data: bytes) -> np.ndarray:
        """Token ids of raw training data (the model's tokenizer).

        The default is the byte vocabulary: one token per byte, for models whose
        ``vocab_size`` is 256.
        """
        if self.vocab_size < 256:
            raise ConfigError("model", self.name, f"vocabulary of {self.vocab_size} cannot "
                              "hold bytes and the model has no tokenizer")
        return np.frombuffer(data, np.uint8)


FAMILIES: dict[str, type[LanguageModel]] = {}


def register_family(cls: type[LanguageModel]) -> type[LanguageModel]:
    """Class decorator: makes ``cls`` loadable by :func:`model_from_dict` under ``cls.family``.

    Example:
      >>> from effijax.models import GPTConfig
      >>> FAMILIES["gpt"] is GPTConfig
      True
    """
    FAMILIES[cls.family] = cls
    return cls


def model_from_dict(fields: dict) -> LanguageModel:
    """The model a :meth:`LanguageModel.to_dict` output describes.

    Raises:
      ConfigError: no or an unknown ``family``, or fields the family does not have.

    Example:
      >>> from effijax.models import gpt_config
      >>> model = gpt_config("tiny")
      >>> model_from_dict(model.to_dict()) == model
      True
    """
    if not isinstance(fields, dict):
        raise ConfigError("model_config", fields, "expected a JSON object of architecture "
                          "fields")
    family = fields.get("family", "gpt")  # runs written before the interface were all GPTs
    if family not in FAMILIES:
        close = difflib.get_close_matches(str(family), FAMILIES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError("model_config.family", family,
                          f"unknown model family; known: {', '.join(sorted(FAMILIES))}{hint}")
    rest = {k: v for k, v in fields.items() if k != "family"}
    return FAMILIES[family].from_dict(rest)


def preset_names() -> list[str]:
    """Every registered family's preset names.

    Example:
      >>> preset_names()[:4]
      ['tiny', 'mini', 'small', 'base']
    """
    return [name for cls in FAMILIES.values() for name in cls.presets]


def preset(name: str) -> LanguageModel:
    """The model a preset name stands for, whatever its family.

    Raises:
      ConfigError: an unknown name (naming the closest preset).

    Example:
      >>> preset("mini").name
      'mini GPT'
    """
    for cls in FAMILIES.values():
        if name in cls.presets:
            return cls.presets[name]
    close = difflib.get_close_matches(str(name), preset_names(), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError("model", name, f"unknown model preset; {hint}presets: "
                      f"{', '.join(preset_names())}")


@dataclasses.dataclass(frozen=True)
class PretrainedFormat:
    """How one family is spelled in Hugging Face directories and GGUF files.

    Attributes:
      model_type: ``config.json``'s ``model_type`` (``"llama"``, ``"qwen2"``).
      hf_class: the ``transformers`` class (``config.json``'s ``architectures``).
      config: the family's config class (built from the fields every Llama-block family shares:
        widths, heads, rotary base, norm epsilon, tied head).
      tensors: ``{effijax path: (Hugging Face name, GGUF name)}``, ``{i}`` the layer of a stacked
        parameter, in the order the weights are written.
      check_hf: ``check_hf(fields)`` raises :class:`~effijax.errors.ConfigError` on a
        ``config.json`` feature the family does not implement (another activation, biases, ...).
      hf_fields: ``hf_fields(model)``: the family's own ``config.json`` keys.
      gguf_architecture: GGUF's ``general.architecture`` (its metadata's key prefix), or None
        when the family is not read from GGUF.
      gguf_permuted: llama.cpp's converter permuted the ``attn_q``/``attn_k`` rows (the Llama's
        GGUFs; Qwen2's are stored in Hugging Face's order).
      config_fields: ``config_fields(fields)``: the family's own config fields read from a
        ``config.json`` dict (Mistral's ``sliding_window``); checked by the config itself. They
        replace the shared ones of the same name (Gemma 3 reads its two rotary bases itself).
      gguf_fields: ``gguf_fields(metadata)``: the same from a GGUF's metadata (Gemma 3's
        ``gemma3.attention.sliding_window``), with the family's defaults for what it lacks.
      gguf_metadata: ``gguf_metadata(model)``: the family's own ``{architecture}.*`` keys that
        :func:`~effijax.interop.save_gguf` writes (what ``gguf_fields`` reads back); a
        :class:`~effijax.errors.ConfigError` for a model GGUF cannot describe.
      gguf_norm_offset: what llama.cpp's converter added to every ``*norm.weight`` (Gemma's
        ``(1 + w)`` norms are stored as plain weights ``1 + w``): subtracted on load.
      refused: ``{model_type: why}``: neighbouring model types refused with the reason
        and what to load instead (Gemma 3's multimodal ``"gemma3"``).
    """

    model_type: str
    hf_class: str
    config: type
    tensors: Mapping[str, tuple[str, str]]
    check_hf: Callable[[dict], None]
    hf_fields: Callable[[Any], dict]
    gguf_architecture: str | None = None
    gguf_permuted: bool = True
    config_fields: Callable[[dict], dict] = lambda fields: {}
    gguf_fields: Callable[[dict], dict] = lambda metadata: {}
    gguf_metadata: Callable[[Any], dict] = lambda model: {}
    gguf_norm_offset: float = 0.0
    refused: Mapping[str, str] = dataclasses.field(default_factory=dict)


#: Hugging Face ``model_type`` -> the family that reads it.
PRETRAINED: dict[str, PretrainedFormat] = {}


def register_pretrained(fmt: PretrainedFormat) -> PretrainedFormat:
    """Makes ``fmt``'s family loadable from (and exportable to) its Hugging Face and GGUF files.

    Example:
      >>> PRETRAINED["llama"].hf_class
      'LlamaForCausalLM'
    """
    PRETRAINED[fmt.model_type] = fmt
    return fmt


def pretrained_format(*, model_type: Any = None, gguf_architecture: Any = None
                      ) -> PretrainedFormat:
    """The registered format of a Hugging Face ``model_type`` or a GGUF ``general.architecture``.

    Raises:
      ConfigError: an unknown one, listing the supported ones.

    Example:
      >>> pretrained_format(model_type="qwen2").hf_class
      'Qwen2ForCausalLM'
      >>> pretrained_format(model_type="phi3")
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: model_type='phi3': effijax loads ... 'mistral', 'qwen2'
      >>> pretrained_format(model_type="gemma3")
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: model_type='gemma3': Gemma 3's multimodal ...
      >>> pretrained_format(model_type={})
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: model_type={}: effijax loads these model_types only: ...
    """
    if gguf_architecture is None:
        field, value = "model_type", model_type
        known = {fmt.model_type: fmt for fmt in PRETRAINED.values()}
    else:
        field, value = "general.architecture", gguf_architecture
        known = {fmt.gguf_architecture: fmt for fmt in PRETRAINED.values()
                 if fmt.gguf_architecture is not None}
    if not isinstance(value, str) or value not in known:  # a hostile file's {} is unhashable
        for fmt in PRETRAINED.values():
            if gguf_architecture is None and isinstance(value, str) and value in fmt.refused:
                raise ConfigError(field, value, fmt.refused[value])
        raise ConfigError(field, value, f"effijax loads these {field}s only: "
                          f"{', '.join(repr(k) for k in sorted(known))}")
    return known[value]


def format_of(model: LanguageModel) -> PretrainedFormat:
    """The pretrained format of a model's family.

    Raises:
      ConfigError: the family has none (naming the families that have one).

    Example:
      >>> from effijax.models import gpt_config, llama_config
      >>> format_of(llama_config("llama-tiny")).model_type
      'llama'
      >>> format_of(gpt_config("tiny"))
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: model='tiny GPT': the gpt family has no Hugging Face ...
    """
    for fmt in PRETRAINED.values():
        if type(model) is fmt.config:
            return fmt
    families = ", ".join(sorted(fmt.config.family for fmt in PRETRAINED.values()))
    raise ConfigError("model", model.name, f"the {model.family} family has no Hugging Face "
                      f"counterpart; families with one: {families}")
