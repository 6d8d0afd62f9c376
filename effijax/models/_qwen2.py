"""Qwen2 / Qwen2.5: the Llama block with biases on the query, key and value projections.

Hugging Face's ``Qwen2ForCausalLM`` is :class:`~effijax.models.Llama`'s architecture (RMSNorm,
grouped-query attention with rotate-half rotary embeddings, SwiGLU, tied or untied head) plus a
bias on ``q_proj``, ``k_proj`` and ``v_proj`` (not ``o_proj``). So this family is the Llama's
layer with :attr:`Qwen2Config.attention_bias` set, its own presets and defaults (Qwen2.5's rotary
base 1e6, RMSNorm epsilon 1e-6), and its pretrained format: ``model_type: "qwen2"``, the Llama's
tensor names plus the three biases. Qwen2's sliding-window option (``use_sliding_window``, false
in every Qwen2.5 checkpoint) is transformers' rule: with it, the layers from
``max_window_layers`` on attend within ``sliding_window``, the ones before it globally.

Parameter paths are the Llama's with ``layers/attn/{q,k,v}_proj/bias`` added; LoRA adapts the
same kernels (PEFT's ``q_proj`` ... ``down_proj``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from effijax.errors import ConfigError, whole_number
from effijax.models._decoder import preset_config
from effijax.models._interface import PretrainedFormat, register_family, register_pretrained
from effijax.models._llama import LLAMA_TENSORS, Llama, LlamaConfig

__all__ = ["Qwen2", "Qwen2Config", "QWEN2_PRESETS", "qwen2_config", "QWEN2_TENSORS"]


@register_family
@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen2Config(LlamaConfig):
    """Architecture of a :class:`Qwen2`: :class:`~effijax.models.LlamaConfig`'s fields, with
    q/k/v biases and Qwen2.5's defaults (``rope_theta`` 1e6, ``rms_eps`` 1e-6).

    With a ``sliding_window``, the layers ``i >= max_window_layers`` attend within it and the
    first ``max_window_layers`` globally (transformers' ``use_sliding_window`` rule; 0, the
    default, windows every layer).

    Example:
      >>> config = qwen2_config("qwen2-tiny")
      >>> config.family, config.attention_bias, config.name
      ('qwen2', True, 'qwen2-tiny')
      >>> from effijax.models import model_from_dict
      >>> model_from_dict(config.to_dict()) == config
      True
    """

    rope_theta: float = 1000000.0
    rms_eps: float = 1e-6
    max_window_layers: int = 0

    family: ClassVar[str] = "qwen2"
    attention_bias: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        whole_number("max_window_layers", self.max_window_layers, minimum=0)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """None for the first ``max_window_layers`` layers, ``sliding_window`` for the rest.

        Example:
          >>> qwen2_config("qwen2-tiny", sliding_window=16, max_window_layers=1).layer_windows
          (None, 16)
        """
        return tuple(None if self.sliding_window is None or i < self.max_window_layers
                     else self.sliding_window for i in range(self.n_layers))


QWEN2_PRESETS: dict[str, Qwen2Config] = {
    # Compiles in about a second: for tests. GQA, tied head (as the small Qwen2.5s).
    "qwen2-tiny": Qwen2Config(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                              tie_embeddings=True, seq_len=64, max_position=256),
    # Qwen/Qwen2.5-0.5B(-Instruct): 494M parameters, tied embeddings.
    "qwen2.5-0.5b": Qwen2Config(vocab_size=151936, d_model=896, n_layers=24, n_heads=14,
                                n_kv_heads=2, d_ff=4864, tie_embeddings=True, seq_len=2048,
                                max_position=32768),
    # Qwen/Qwen2.5-7B: 7.6B parameters, untied head.
    "qwen2.5-7b": Qwen2Config(vocab_size=152064, d_model=3584, n_layers=28, n_heads=28,
                              n_kv_heads=4, d_ff=18944, seq_len=4096, max_position=131072),
}

Qwen2Config.presets = QWEN2_PRESETS


def qwen2_config(name: str, **overrides) -> Qwen2Config:
    """A preset :class:`Qwen2Config`, with fields replaced by ``overrides``.

    Presets: ``"qwen2-tiny"`` (tests), ``"qwen2.5-0.5b"``, ``"qwen2.5-7b"`` (shapes from their
    published ``config.json``).

    Example:
      >>> qwen2_config("qwen2.5-0.5b").num_params, qwen2_config("qwen2.5-7b").num_params
      (494032768, 7615616512)
    """
    return preset_config(Qwen2Config, name, overrides)


class Qwen2(Llama):
    """The Qwen2 decoder: :class:`~effijax.models.Llama`'s, its layers built with q/k/v biases
    (the layer reads ``config.attention_bias``).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> model = Qwen2(qwen2_config("qwen2-tiny"), rngs=nnx.Rngs(0))
      >>> model.layers.attn.q_proj.bias.shape, hasattr(model.layers.attn.o_proj, "bias")
      ((2, 64), False)
      >>> Qwen2(qwen2_config("qwen2-tiny", sliding_window=16, max_window_layers=1),
      ...       rngs=nnx.Rngs(0)).layer_windows
      (None, 16)
    """


Qwen2Config.decoder = Qwen2


# ----------------------------------------------------------------------------------------------
# Pretrained files: Hugging Face's Qwen2ForCausalLM and llama.cpp's 'qwen2' GGUFs (whose
# attn_q/attn_k rows the converter leaves in Hugging Face's order).

#: The Llama's tensor names, each q/k/v bias after its kernel.
QWEN2_TENSORS: dict[str, tuple[str, str]] = {}
for _path, _names in LLAMA_TENSORS.items():
    QWEN2_TENSORS[_path] = _names
    if _path in ("layers/attn/q_proj/kernel", "layers/attn/k_proj/kernel",
                 "layers/attn/v_proj/kernel"):
        QWEN2_TENSORS[_path.replace("/kernel", "/bias")] = tuple(
            name.replace(".weight", ".bias") for name in _names)


def _check_hf(fields: dict) -> None:
    """Refuses what effijax's Qwen2 lacks: another activation."""
    if fields.get("hidden_act", "silu") != "silu":
        raise ConfigError("hidden_act", fields.get("hidden_act"),
                          "effijax's Qwen2 supports 'silu' only")


# transformers' Qwen2Config defaults, for a config.json that leaves the keys out.
_HF_DEFAULT_WINDOW, _HF_DEFAULT_WINDOW_LAYERS = 4096, 28


def _layer_types(window: int | None, first_windowed: int, n_layers: int) -> list[str]:
    """transformers' ``layer_types`` of a Qwen2 with this window rule."""
    return ["sliding_attention" if window is not None and i >= first_windowed
            else "full_attention" for i in range(n_layers)]


def _config_fields(fields: dict) -> dict:
    """``sliding_window`` and ``max_window_layers`` from ``config.json``: none unless
    ``use_sliding_window`` is true (transformers ignores the window otherwise). An explicit
    ``layer_types`` must be the one transformers' rule gives, the only pattern effijax reads."""
    use = fields.get("use_sliding_window", False)
    if not isinstance(use, bool):
        raise ConfigError("use_sliding_window", use, "expected true or false")
    if not use:
        return {}
    window = whole_number("sliding_window", fields.get("sliding_window", _HF_DEFAULT_WINDOW),
                          none=True)
    first = whole_number("max_window_layers",
                         fields.get("max_window_layers", _HF_DEFAULT_WINDOW_LAYERS), minimum=0)
    given = fields.get("layer_types")
    n_layers = fields.get("num_hidden_layers")
    if given is not None and isinstance(n_layers, int) and \
            given != _layer_types(window, first, n_layers):
        raise ConfigError("layer_types", given, f"effijax's Qwen2 reads transformers' pattern "
                          f"only: full attention in the first max_window_layers={first} layers, "
                          f"sliding_window={window} after them")
    return {"sliding_window": window, "max_window_layers": first}


def _hf_fields(model: Qwen2Config) -> dict:
    window = model.sliding_window
    return {"use_sliding_window": window is not None, "sliding_window": window,
            "max_window_layers": model.max_window_layers if window is not None
            else model.n_layers,
            "layer_types": _layer_types(window, model.max_window_layers, model.n_layers)}


register_pretrained(PretrainedFormat(
    model_type="qwen2", hf_class="Qwen2ForCausalLM", config=Qwen2Config, tensors=QWEN2_TENSORS,
    check_hf=_check_hf, hf_fields=_hf_fields, config_fields=_config_fields,
    gguf_architecture="qwen2", gguf_permuted=False))
