"""Gemma 3 (text): Google's decoder with sandwich norms, GeGLU and local/global attention.

Hugging Face's ``Gemma3ForCausalLM`` (``model_type: "gemma3_text"``) on the decoder skeleton:

* RMSNorm with a zero-centred weight, ``x / rms(x) · (1 + w)`` (statistics and the product in
  f32), before *and after* the attention and the MLP (``post_norms``), a final one;
* the token embedding scaled by ``sqrt(d_model)`` (the scale rounded to the compute dtype, as
  transformers' ``Gemma3TextScaledWordEmbedding`` does), the tied head reading it unscaled;
* grouped-query attention whose head width ``head_dim`` is its own (256 for every released size,
  whatever ``d_model / n_heads``), with the same RMSNorm on each query and key head before the
  rotary embedding, and scores scaled by ``query_pre_attn_scalar ** -0.5`` (not ``head_dim``);
* GeGLU: ``down(gelu_tanh(gate(x)) · up(x))``;
* layers in a pattern of ``sliding_window_pattern - 1`` local layers (a sliding window of
  ``sliding_window`` keys, rotary base ``rope_local_theta``, 1e4) then one global layer (every
  earlier key, rotary base ``rope_theta``, 1e6, optionally slowed linearly by
  ``rope_linear_factor``): :attr:`Gemma3Config.layer_windows` gives the skeleton the windows
  and each layer picks its rotary table by its window, so one scanned layer body serves both
  kinds (the KV cache keeps a ring of ``sliding_window`` slots for each local layer);
* optional ``final_logit_softcapping``: ``cap · tanh(logits / cap)``.

Parameter paths are Hugging Face's module names where they do not clash with the Llama's
(``layers/attn/q_norm/scale``, ``layers/pre_feedforward_norm/scale``); the norm after the
attention is ``layers/post_attn_norm`` because the Llama's ``post_attention_norm`` is its pre-MLP
norm (Hugging Face's name for that). Norm weights are stored as Hugging Face stores them (``w``,
0 at initialisation); llama.cpp's GGUFs store ``1 + w``, which the loader undoes.

Shape suffixes: ``B`` batch, ``S`` sequence, ``D`` model width, ``H`` query heads, ``G`` key/value
heads, ``K`` head width, ``F`` MLP width, ``V`` vocabulary, ``L`` layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from effijax.errors import ConfigError, all_of, whole_number
from effijax.models._decoder import AttentionSpec, LayerInputs, PreNormBlock, preset_config
from effijax.models._dense import keep, unkeep
from effijax.models._interface import (
    ModelShape,
    PretrainedFormat,
    register_family,
    register_pretrained,
)
from effijax.models._layers import INIT_STD
from effijax.models._llama import _MLP as LlamaMLP
from effijax.models._llama import (
    LLAMA_TENSORS,
    Llama,
    LlamaConfig,
    _positive_float,
    refuse_unsupported,
)
from effijax.models._rotary import RotaryAttention, rope, rope_positions
from effijax.precision import rms_norm

__all__ = ["Gemma3", "Gemma3Config", "GEMMA3_PRESETS", "gemma3_config", "GEMMA3_TENSORS",
           "layer_types"]

_SLIDING, _FULL = "sliding_attention", "full_attention"  # Hugging Face's layer_types


def layer_types(n_layers: int, pattern: int) -> tuple[str, ...]:
    """Hugging Face's ``layer_types`` of a Gemma 3 stack: ``pattern - 1`` sliding layers, then a
    global one, repeated (``pattern`` 1: all global).

    Example:
      >>> layer_types(4, 3)
      ('sliding_attention', 'sliding_attention', 'full_attention', 'sliding_attention')
    """
    return tuple(_SLIDING if (i + 1) % pattern else _FULL for i in range(n_layers))


@register_family
@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma3Config(LlamaConfig):
    """Architecture of a :class:`Gemma3`: :class:`~effijax.models.LlamaConfig`'s fields (with
    Gemma 3's defaults: global rotary base 1e6, epsilon 1e-6, tied head, window 4096) plus its
    own.

    Attributes:
      sliding_window: the local layers' window (query ``i`` sees keys ``i - w < j <= i``); below
        ``max_position``.
      sliding_window_pattern: every ``sliding_window_pattern``-th layer is global, the others
        local (Hugging Face's ``sliding_window_pattern``; 6 in every released size).
      rope_local_theta: the local layers' rotary base (``rope_local_base_freq``).
      rope_linear_factor: the global layers' linear rotary scaling (``rope_scaling`` of type
        ``"linear"``: positions divided by it), or None.
      query_pre_attn_scalar: scores are scaled by its inverse square root.
      final_logit_softcapping: logits become ``cap · tanh(logits / cap)``; None: not capped.

    ``rope_scaling`` (Llama 3's) is not Gemma's: it must stay None.

    Example:
      >>> config = gemma3_config("gemma3-tiny")
      >>> config.family, config.head_dim, config.name
      ('gemma3', 32, 'gemma3-tiny')
      >>> from effijax.models import model_from_dict
      >>> model_from_dict(config.to_dict()) == config
      True
      >>> gemma3_config("gemma3-tiny", sliding_window=256)
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: sliding_window=256: must be below max_position=256 ...
    """

    head_dim: int | None = 256
    rope_theta: float = 1000000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = True
    sliding_window: int | None = 4096
    sliding_window_pattern: int = 6
    rope_local_theta: float = 10000.0
    rope_linear_factor: float | None = None
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None

    family: ClassVar[str] = "gemma3"

    def __post_init__(self):
        super().__post_init__()
        if self.rope_scaling is not None:
            raise ConfigError("rope_scaling", self.rope_scaling, "Gemma 3 has no Llama 3 rotary "
                              "scaling; its global layers' linear one is rope_linear_factor")
        whole_number("sliding_window", self.sliding_window)
        if self.sliding_window >= self.max_position:
            raise ConfigError("sliding_window", self.sliding_window, f"must be below "
                              f"max_position={self.max_position} (a window as long as the "
                              "context is none, and the local layers are told apart by it)")
        whole_number("sliding_window_pattern", self.sliding_window_pattern)
        for name in ("rope_local_theta", "query_pre_attn_scalar"):
            _positive_float(name, getattr(self, name))
        for name in ("rope_linear_factor", "final_logit_softcapping"):
            if getattr(self, name) is not None:
                _positive_float(name, getattr(self, name))

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Hugging Face's ``layer_types``: each layer's ``"sliding_attention"`` or
        ``"full_attention"``."""
        return layer_types(self.n_layers, self.sliding_window_pattern)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """The local layers' ``sliding_window``, None for the global ones.

        Example:
          >>> gemma3_config("gemma3-tiny").layer_windows
          (8, 8, None, 8)
        """
        return tuple(self.sliding_window if kind == _SLIDING else None
                     for kind in self.layer_types)

    def shape(self) -> ModelShape:
        """The Llama's numbers (grouped-query attention, a gated MLP: GeGLU keeps what SwiGLU
        keeps) with Gemma's extra norms."""
        return dataclasses.replace(super().shape(), sandwich_norms=True)

    @property
    def num_params(self) -> int:
        """Parameters of the model (closed form; the tree's count): the Llama's plus, per
        layer, the two norms after the attention and the MLP and the query/key norms.

        Example:
          >>> gemma3_config("gemma-3-270m").num_params, gemma3_config("gemma-3-1b").num_params
          (268098176, 999885952)
        """
        return super().num_params + self.n_layers * (2 * self.d_model + 2 * self.head_dim)


GEMMA3_PRESETS: dict[str, Gemma3Config] = {
    # Compiles in about a second: for tests. Local, local, global, local; a head width of its
    # own (32 x 4 heads = 128, d_model 64), a query scalar that is not head_dim.
    "gemma3-tiny": Gemma3Config(vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                                head_dim=32, d_ff=128, sliding_window=8, sliding_window_pattern=3,
                                query_pre_attn_scalar=24.0, seq_len=64, max_position=256),
    # google/gemma-3-270m: 268.1M parameters (170M of them the embedding).
    "gemma-3-270m": Gemma3Config(vocab_size=262144, d_model=640, n_layers=18, n_heads=4,
                                n_kv_heads=1, head_dim=256, d_ff=2048, sliding_window=512,
                                seq_len=2048, max_position=32768),
    # google/gemma-3-1b-pt: 999.9M parameters.
    "gemma-3-1b": Gemma3Config(vocab_size=262144, d_model=1152, n_layers=26, n_heads=4,
                              n_kv_heads=1, head_dim=256, d_ff=6912, sliding_window=512,
                              seq_len=2048, max_position=32768),
}

Gemma3Config.presets = GEMMA3_PRESETS


def gemma3_config(name: str, **overrides) -> Gemma3Config:
    """A preset :class:`Gemma3Config`, with fields replaced by ``overrides``.

    Presets: ``"gemma3-tiny"`` (tests), ``"gemma-3-270m"``, ``"gemma-3-1b"`` (shapes from their
    published ``config.json``).

    Example:
      >>> gemma3_config("gemma-3-270m").layer_types[:6]
      ('sliding_attention', 'sliding_attention', 'sliding_attention', 'sliding_attention', \
'sliding_attention', 'full_attention')
    """
    return preset_config(Gemma3Config, name, overrides)


# ----------------------------------------------------------------------------------------------
# The layer.


# GeGLU that keeps only its two inputs for the backward pass (as the Llama's SwiGLU and the GPT's
# GELU do): the tanh-GELU's intermediates are recomputed there. Computed in f32.
@jax.custom_vjp
def _geglu(g_BSF: jax.Array, u_BSF: jax.Array) -> jax.Array:
    g = g_BSF.astype(jnp.float32)
    return (jax.nn.gelu(g, approximate=True) * u_BSF.astype(jnp.float32)).astype(g_BSF.dtype)


def _geglu_fwd(g_BSF, u_BSF):
    return _geglu(g_BSF, u_BSF), (keep(g_BSF), keep(u_BSF))


def _geglu_bwd(residuals, dy_BSF):
    g_BSF, u_BSF = (unkeep(r) for r in residuals)
    g, u, dy = (t.astype(jnp.float32) for t in (g_BSF, u_BSF, dy_BSF))
    gelu, gelu_vjp = jax.vjp(functools.partial(jax.nn.gelu, approximate=True), g)
    return gelu_vjp(dy * u)[0].astype(g_BSF.dtype), (dy * gelu).astype(u_BSF.dtype)


_geglu.defvjp(_geglu_fwd, _geglu_bwd)


class _Norm(nnx.Module):
    """Gemma's RMSNorm: ``x / rms(x) · (1 + scale)`` in f32; ``scale`` starts at 0."""

    def __init__(self, d: int, *, eps: float, stack: tuple[int, ...]):
        self.scale = nnx.Param(jnp.zeros((*stack, d), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, 1.0 + self.scale[...].astype(jnp.float32), self.eps)


class _MLP(LlamaMLP):
    glu = staticmethod(_geglu)


class _Attention(RotaryAttention):
    """Rotary attention with Gemma's RMSNorm on each query and key head before the rotation,
    and queries rescaled so that the attention's ``1/sqrt(K)`` becomes
    ``1/sqrt(query_pre_attn_scalar)``."""

    def __init__(self, spec: AttentionSpec, config: Gemma3Config, *, stack: tuple[int, ...],
                 rngs: nnx.Rngs):
        super().__init__(spec, std=INIT_STD, out_std=INIT_STD, stack=stack, rngs=rngs)
        self.q_norm = _Norm(spec.head_dim, eps=config.rms_eps, stack=stack)
        self.k_norm = _Norm(spec.head_dim, eps=config.rms_eps, stack=stack)
        # 1.0 (skipped) when the scalar is the head width, as in every released size.
        self.query_scale = math.sqrt(spec.head_dim / config.query_pre_attn_scalar)

    def rotate(self, q_BSHK: jax.Array, k_BSGK: jax.Array, positions) -> tuple:
        cos_SK, sin_SK = positions
        q_BSHK = rope(self.q_norm(q_BSHK), cos_SK, sin_SK)
        if self.query_scale != 1.0:
            q_BSHK = q_BSHK * jnp.asarray(self.query_scale, q_BSHK.dtype)
        return q_BSHK, rope(self.k_norm(k_BSGK), cos_SK, sin_SK)


class _Layer(PreNormBlock):
    """One Gemma 3 layer, local or global by its window: norm, attention, norm, residual; norm,
    GeGLU MLP, norm, residual. Constructed once with ``stack=(L,)`` and scanned."""

    # Hugging Face's input_layernorm and pre_feedforward_layernorm.
    norm_names = ("input_norm", "pre_feedforward_norm")

    @staticmethod
    def norm(config: Gemma3Config, *, stack: tuple[int, ...]) -> nnx.Module:
        return _Norm(config.d_model, eps=config.rms_eps, stack=stack)

    def __init__(self, config: Gemma3Config, *, stack: tuple[int, ...], rngs: nnx.Rngs):
        spec = AttentionSpec(d_model=config.d_model, heads=config.n_heads,
                             kv_heads=config.n_kv_heads, head_dim=config.head_dim,
                             implementation=config.attention,
                             names=("q_proj", "k_proj", "v_proj", "o_proj"))
        self.build_norms(config, stack)
        self.post_attn_norm = self.norm(config, stack=stack)
        self.post_feedforward_norm = self.norm(config, stack=stack)
        self.attn = _Attention(spec, config, stack=stack, rngs=rngs)
        self.mlp = _MLP(config, stack=stack, rngs=rngs)
        # Global layers' window in a scan of differing windows (Decoder._windows).
        self.global_window = config.max_position

    @property
    def post_norms(self) -> tuple[nnx.Module, nnx.Module]:
        return self.post_attn_norm, self.post_feedforward_norm

    def __call__(self, x_BSD, key, lora, inputs: LayerInputs, cache=None, window=None,
                 sequence_parallel: bool = False):
        """The block of :class:`PreNormBlock` with the rotary table of this layer's kind:
        ``inputs.positions`` holds ``(local, global)`` tables, picked by the window."""
        if window is not None:
            inputs = inputs._replace(window=window)
        local, glob = inputs.positions
        window = inputs.window
        if window is None or isinstance(window, int):  # the same kind of layer throughout
            tables = glob if window is None or window >= self.global_window else local
        else:  # this layer's int32 window, scanned
            is_local = window < self.global_window
            tables = jax.tree.map(lambda a, b: jnp.where(is_local, a, b), local, glob)
        return super().__call__(x_BSD, key, lora, inputs._replace(positions=tables), cache,
                                sequence_parallel=sequence_parallel)


# ----------------------------------------------------------------------------------------------
# The model.


class Gemma3(Llama):
    """The Gemma 3 decoder: scaled embedding, scanned local/global layers, final norm, tied
    (optionally soft-capped) head.

    Example:
      >>> from flax import nnx
      >>> model = Gemma3(gemma3_config("gemma3-tiny"), rngs=nnx.Rngs(0))
      >>> model.layer_windows, model.layers.attn.q_norm.scale.shape
      ((8, 8, None, 8), (4, 32))
    """

    layer_type = _Layer

    def embed_positions(self, x_BSD, positions_BS, length):
        """The embedding times ``sqrt(d_model)`` (in the compute dtype) and the ``(local,
        global)`` rotary tables."""
        cfg = self.config
        scale = jnp.float32(math.sqrt(cfg.d_model)).astype(x_BSD.dtype)
        linear = None if cfg.rope_linear_factor is None else (cfg.rope_linear_factor,)
        local = rope_positions(cfg.head_dim, cfg.rope_local_theta, None, length, positions_BS)
        glob = rope_positions(cfg.head_dim, cfg.rope_theta, linear, length, positions_BS)
        return x_BSD * scale, (local, glob)

    @property
    def logit_cap(self) -> float | None:
        """``final_logit_softcapping``: the head's logits become ``cap · tanh(logits / cap)``
        (in f32); None: not capped."""
        return self.config.final_logit_softcapping


Gemma3Config.decoder = Gemma3


# ----------------------------------------------------------------------------------------------
# Pretrained files: Hugging Face's Gemma3ForCausalLM and llama.cpp's 'gemma3' GGUFs.


def _layer_tensor(path: str, hf: str, gguf: str) -> tuple[str, tuple[str, str]]:
    return f"layers/{path}", (f"model.layers.{{i}}.{hf}.weight", f"blk.{{i}}.{gguf}.weight")


#: effijax path -> (Hugging Face name, GGUF name): the Llama's, with Gemma's norms.
GEMMA3_TENSORS: dict[str, tuple[str, str]] = {
    "embed/embedding": LLAMA_TENSORS["embed/embedding"],
    "layers/input_norm/scale": LLAMA_TENSORS["layers/input_norm/scale"],
    **{f"layers/attn/{p}_proj/kernel": LLAMA_TENSORS[f"layers/attn/{p}_proj/kernel"]
       for p in "qkvo"},
    **dict([_layer_tensor("attn/q_norm/scale", "self_attn.q_norm", "attn_q_norm"),
            _layer_tensor("attn/k_norm/scale", "self_attn.k_norm", "attn_k_norm"),
            _layer_tensor("post_attn_norm/scale", "post_attention_layernorm",
                          "post_attention_norm"),
            _layer_tensor("pre_feedforward_norm/scale", "pre_feedforward_layernorm", "ffn_norm"),
            _layer_tensor("post_feedforward_norm/scale", "post_feedforward_layernorm",
                          "post_ffw_norm")]),
    **{f"layers/mlp/{p}_proj/kernel": LLAMA_TENSORS[f"layers/mlp/{p}_proj/kernel"]
       for p in ("gate", "up", "down")},
    "norm/scale": LLAMA_TENSORS["norm/scale"],
    "lm_head/kernel": LLAMA_TENSORS["lm_head/kernel"],
}

#: The ``config.json`` values effijax's Gemma 3 implements (None: the key is absent).
_BLOCK_FIELDS = {"hidden_activation": ("gelu_pytorch_tanh", None),
                 "hidden_act": ("gelu_pytorch_tanh", None), "attention_bias": (False, None),
                 "attn_logit_softcapping": (None,), "use_bidirectional_attention": (False, None)}


def _rope_fields(fields: dict) -> dict:
    """The two rotary bases and the global layers' linear factor, from transformers 5's
    per-layer-type ``rope_parameters`` or transformers 4's ``rope_theta``,
    ``rope_local_base_freq`` and ``rope_scaling``."""
    params = fields.get("rope_parameters") or {}
    if not isinstance(params, dict) or not all(isinstance(params.get(k) or {}, dict)
                                               for k in (_SLIDING, _FULL)):
        raise ConfigError("rope_parameters", params, "expected an object with "
                          f"'{_SLIDING}' and '{_FULL}' objects")
    local, full = params.get(_SLIDING) or {}, dict(params.get(_FULL) or {})
    legacy = fields.get("rope_scaling")
    if legacy is not None:
        if not isinstance(legacy, dict):
            raise ConfigError("rope_scaling", legacy, "expected an object or null")
        full = {**legacy, **full} if params else {**full, **legacy}
    for name, table in (("sliding_attention", local), ("full_attention", full)):
        kind = table.get("rope_type", table.get("type", "default"))
        if kind not in ("default", "linear") or (name == _SLIDING and kind != "default"):
            raise ConfigError("rope_scaling", kind, "effijax's Gemma 3 implements the default "
                              "rotary embedding, and linear scaling of its global layers, only")
    factor = full.get("factor") if full.get("rope_type", full.get("type")) == "linear" else None
    return {"rope_theta": full.get("rope_theta", fields.get("rope_theta", 1000000.0)),
            "rope_local_theta": local.get("rope_theta",
                                          fields.get("rope_local_base_freq", 10000.0)),
            "rope_linear_factor": factor, "rope_scaling": None}


def _pattern(fields: dict, n_layers) -> int:
    """``sliding_window_pattern`` from ``layer_types`` (refused unless it is such a pattern)
    or from the key itself (transformers' default 6)."""
    types = fields.get("layer_types")
    if types is None:
        return fields.get("sliding_window_pattern", 6)
    n = whole_number("num_hidden_layers", n_layers)
    pattern = next((i + 1 for i, kind in enumerate(types) if kind == _FULL), n + 1) \
        if isinstance(types, list) else 0
    if not pattern or tuple(types) != layer_types(n, pattern):
        raise ConfigError("layer_types", types, "effijax's Gemma 3 takes Gemma's pattern only: "
                          "sliding_window_pattern - 1 'sliding_attention' layers, then one "
                          "'full_attention', repeated")
    return pattern


def _check_hf(fields: dict) -> None:
    """Refuses what effijax's Gemma 3 lacks: another activation, biases, attention-score
    soft-capping, bidirectional attention, other rotary scalings, another layer pattern."""
    refuse_unsupported(fields, "Gemma 3", _BLOCK_FIELDS)
    _rope_fields(fields)
    _pattern(fields, fields.get("num_hidden_layers"))


def _config_fields(fields: dict) -> dict:
    """Gemma 3's own fields from ``config.json``, with transformers' ``Gemma3TextConfig``
    defaults for the keys it leaves out (tied head, head width 256, window 4096, ...)."""
    return {**_rope_fields(fields),
            "head_dim": fields.get("head_dim", 256),
            "tie_embeddings": fields.get("tie_word_embeddings", True),
            "sliding_window": fields.get("sliding_window", 4096),
            "sliding_window_pattern": _pattern(fields, fields.get("num_hidden_layers")),
            "query_pre_attn_scalar": fields.get("query_pre_attn_scalar", 256),
            "final_logit_softcapping": fields.get("final_logit_softcapping")}


def _hf_fields(model: Gemma3Config) -> dict:
    """The ``config.json`` keys of ``Gemma3ForCausalLM`` (both transformers 4's and 5's rotary
    spelling)."""
    full = {"rope_type": "default", "rope_theta": model.rope_theta}
    scaling = None
    if model.rope_linear_factor is not None:
        scaling = {"rope_type": "linear", "factor": model.rope_linear_factor}
        full = {**scaling, "rope_theta": model.rope_theta}
    return {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
            "attention_bias": False, "rope_scaling": scaling,
            "rope_local_base_freq": model.rope_local_theta,
            "rope_parameters": {_FULL: full, _SLIDING: {"rope_type": "default",
                                                        "rope_theta": model.rope_local_theta}},
            "sliding_window": model.sliding_window,
            "sliding_window_pattern": model.sliding_window_pattern,
            "layer_types": list(model.layer_types),
            "query_pre_attn_scalar": model.query_pre_attn_scalar,
            "final_logit_softcapping": model.final_logit_softcapping,
            "attn_logit_softcapping": None, "use_bidirectional_attention": False}


def _gguf_fields(metadata: dict) -> dict:
    """Gemma 3's own fields from ``gemma3.*`` metadata, with llama.cpp's defaults for what its
    converter does not write: local rotary base 1e4, a global layer every 6, the query scalar
    the head width (llama.cpp's rule: ``d_model / n_heads`` for the 62-layer 27B)."""
    def get(key, default=None):
        value = metadata.get(f"gemma3.{key}", default)
        return value if value is not None else default

    head_dim = get("attention.key_length", 256)
    scalar = head_dim
    if get("block_count") == 62 and get("attention.head_count"):
        scalar = get("embedding_length", 0) / get("attention.head_count")
    return {"sliding_window": get("attention.sliding_window", 4096),
            "sliding_window_pattern": get("attention.sliding_window_pattern", 6),
            "rope_local_theta": float(get("rope.freq_base_swa", 10000.0)),
            "query_pre_attn_scalar": float(scalar)}


def _gguf_metadata(model: Gemma3Config) -> dict:
    """The ``gemma3.*`` keys llama.cpp's converter writes beyond the shared ones: the window.
    What llama.cpp fixes instead of reading (the pattern of 6, the local base 1e4, the query
    scalar, no rotary scaling or logit soft-capping) is refused when the model differs."""
    fixed = _gguf_fields({"gemma3.attention.key_length": model.head_dim,
                          "gemma3.block_count": model.n_layers,
                          "gemma3.embedding_length": model.d_model,
                          "gemma3.attention.head_count": model.n_heads})
    wrong = [ConfigError(name, getattr(model, name), f"a Gemma 3 GGUF has {value} (what "
                         "llama.cpp assumes)")
             for name, value in (("sliding_window_pattern", fixed["sliding_window_pattern"]),
                                 ("rope_local_theta", fixed["rope_local_theta"]),
                                 ("query_pre_attn_scalar", fixed["query_pre_attn_scalar"]),
                                 ("rope_linear_factor", None),
                                 ("final_logit_softcapping", None))
             if getattr(model, name) != value]
    if wrong:  # every reason at once, then the one fix
        error = all_of(wrong)
        raise ConfigError(error.field, error.value, f"{error.problem}; export the Hugging Face "
                          "directory instead")
    return {"gemma3.attention.sliding_window": model.sliding_window}


register_pretrained(PretrainedFormat(
    model_type="gemma3_text", hf_class="Gemma3ForCausalLM", config=Gemma3Config,
    tensors=GEMMA3_TENSORS, check_hf=_check_hf, hf_fields=_hf_fields,
    config_fields=_config_fields, gguf_architecture="gemma3", gguf_permuted=False,
    gguf_fields=_gguf_fields, gguf_metadata=_gguf_metadata, gguf_norm_offset=1.0,
    refused={"gemma3": "Gemma 3's multimodal Gemma3ForConditionalGeneration; effijax loads its "
             "text model only: load a Gemma3ForCausalLM directory (model_type 'gemma3_text', "
             "e.g. google/gemma-3-1b-pt or gemma-3-270m) or the model's GGUF"}))
