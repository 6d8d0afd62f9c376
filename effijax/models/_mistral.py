"""Mistral: the Llama block with a sliding attention window.

Hugging Face's ``MistralForCausalLM`` is :class:`~effijax.models.Llama`'s architecture (RMSNorm,
grouped-query attention with rotate-half rotary embeddings, SwiGLU, untied head) in which every
layer's query ``i`` attends to the keys ``i - sliding_window < j <= i`` (``sliding_window`` None:
all earlier keys, as Mistral 7B v0.3 ships). The window is the Llama config's own field
(:attr:`~effijax.models.LlamaConfig.sliding_window`, honoured by every attention
implementation and by the KV cache, where each layer keeps a ring of ``sliding_window`` slots
instead of ``max_len``), so this family is the Llama with its defaults (Mistral 7B
v0.1's rotary base 1e4 and window 4096, transformers' defaults too) and its pretrained format:
``model_type: "mistral"``, the Llama's tensor names. llama.cpp writes Mistral models as
``general.architecture = 'llama'`` GGUFs without the window, so none is read here from GGUF.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from effijax.errors import whole_number
from effijax.models._decoder import preset_config
from effijax.models._interface import PretrainedFormat, register_family, register_pretrained
from effijax.models._llama import (
    LLAMA_BLOCK_FIELDS,
    LLAMA_TENSORS,
    Llama,
    LlamaConfig,
    refuse_unsupported,
)

__all__ = ["Mistral", "MistralConfig", "MISTRAL_PRESETS", "mistral_config"]

# transformers' MistralConfig default, used when a config.json leaves the key out.
_HF_DEFAULT_WINDOW = 4096


@register_family
@dataclasses.dataclass(frozen=True, kw_only=True)
class MistralConfig(LlamaConfig):
    """Architecture of a :class:`Mistral`: :class:`~effijax.models.LlamaConfig`'s fields, with
    Mistral 7B v0.1's window (4096) and norm epsilon (1e-5) as defaults.

    Example:
      >>> config = mistral_config("mistral-tiny")
      >>> config.family, config.sliding_window, config.name
      ('mistral', 8, 'mistral-tiny')
      >>> from effijax.models import model_from_dict
      >>> model_from_dict(config.to_dict()) == config
      True
    """

    sliding_window: int | None = _HF_DEFAULT_WINDOW

    family: ClassVar[str] = "mistral"


MISTRAL_PRESETS: dict[str, MistralConfig] = {
    # Compiles in about a second: for tests. A window shorter than its sequence, GQA.
    "mistral-tiny": MistralConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                                  sliding_window=8, seq_len=32, max_position=256),
    # mistralai/Mistral-7B-v0.1: 7.24B parameters, window 4096.
    "mistral-7b-v0.1": MistralConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                                     n_kv_heads=8, d_ff=14336, seq_len=4096,
                                     max_position=32768, rms_eps=1e-5),
}

MistralConfig.presets = MISTRAL_PRESETS


def mistral_config(name: str, **overrides) -> MistralConfig:
    """A preset :class:`MistralConfig`, with fields replaced by ``overrides``.

    Presets: ``"mistral-tiny"`` (tests), ``"mistral-7b-v0.1"`` (shape from its published
    ``config.json``).

    Example:
      >>> mistral_config("mistral-7b-v0.1").num_params
      7241732096
    """
    return preset_config(MistralConfig, name, overrides)


class Mistral(Llama):
    """The Mistral decoder: :class:`~effijax.models.Llama`'s, its attention windowed by
    ``config.sliding_window``.

    Example:
      >>> from flax import nnx
      >>> model = Mistral(mistral_config("mistral-tiny"), rngs=nnx.Rngs(0))
      >>> model.config.sliding_window
      8
    """


MistralConfig.decoder = Mistral


def _check_hf(fields: dict) -> None:
    """Refuses what effijax's Mistral lacks: another activation, biases."""
    refuse_unsupported(fields, "Mistral", LLAMA_BLOCK_FIELDS)


def _config_fields(fields: dict) -> dict:
    """``sliding_window`` from ``config.json`` (absent: transformers' default, 4096)."""
    window = fields.get("sliding_window", _HF_DEFAULT_WINDOW)
    return {"sliding_window": whole_number("sliding_window", window, none=True)}


register_pretrained(PretrainedFormat(
    model_type="mistral", hf_class="MistralForCausalLM", config=MistralConfig,
    tensors=LLAMA_TENSORS, check_hf=_check_hf,
    hf_fields=lambda model: {"sliding_window": model.sliding_window},
    config_fields=_config_fields))
