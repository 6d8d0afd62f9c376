"""A Llama-family decoder in Flax NNX (Llama 2/3, SmolLM2, ...), with scanned layers.

The architecture of Hugging Face's ``LlamaForCausalLM``: token embedding, ``n_layers`` pre-norm
layers (RMSNorm, grouped-query self-attention with rotary position embeddings, RMSNorm, SwiGLU
MLP), a final RMSNorm and an output head (optionally tied to the embedding); no biases. As in
the GPT, the layers' parameters are stacked along a leading ``L`` axis and scanned, every matmul
goes through ``_dense`` (f32 accumulation, factored LoRA), and norm statistics, softmax, logits
and loss are f32 islands; the model computes in its parameters' dtype. This file holds what is
the Llama's own (config, rotary positions, RMSNorm, SwiGLU MLP, the layer); the passes, the
attention and the config plumbing are the decoder skeleton's (:mod:`effijax.models._decoder`).

Parameter paths use Hugging Face's module names, so LoRA targets read as in PEFT:
``layers/attn/q_proj/kernel`` is ``model.layers.{i}.self_attn.q_proj.weight`` transposed
(Flax's (in, out) layout). Rotary embeddings follow Hugging Face's rotate-half convention
(llama.cpp's GGUF files permute Q and K rows to theirs; :mod:`effijax.interop` undoes it).

Packed rows: with ``segments_BS`` attention stays within each segment and the rotary positions
restart at 0 at each segment's start, so each packed example is computed as if alone.

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
import numpy as np
from flax import nnx

from effijax.errors import ConfigError, whole_number
from effijax.models._decoder import (
    AttentionSpec,
    Decoder,
    DecoderConfig,
    PreNormBlock,
    WeightNames,
    check_run_choices,
    preset_config,
)
from effijax.models._dense import keep, token_rows, unkeep
from effijax.models._interface import (
    ModelShape,
    PretrainedFormat,
    register_family,
    register_pretrained,
)
from effijax.models._layers import INIT_STD, _Dense
from effijax.models._rotary import RotaryAttention, rope_positions
from effijax.models._tokenizer import Tokenizer
from effijax.precision import rms_norm

__all__ = ["Llama", "LlamaConfig", "LLAMA_PRESETS", "llama_config", "LLAMA_TENSORS",
           "LLAMA_BLOCK_FIELDS", "refuse_unsupported"]


def _positive_float(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value <= 0:
        raise ConfigError(name, value, "expected a positive finite number")


def _rope_scaling(value) -> tuple | None:
    """Llama 3.1's rotary scaling as ``(factor, low, high, original_max_position)`` (a list, as
    JSON gives it, is accepted), or None."""
    if value is None:
        return None
    scaling = tuple(value)
    if len(scaling) != 4:
        raise ConfigError("rope_scaling", value, "expected (factor, low_freq_factor, "
                          "high_freq_factor, original_max_position) or None")
    for name, number in zip(("rope_scaling.factor", "rope_scaling.low_freq_factor",
                             "rope_scaling.high_freq_factor"), scaling[:3], strict=True):
        _positive_float(name, number)
    whole_number("rope_scaling.original_max_position", scaling[3], maximum=None)
    if not scaling[1] < scaling[2]:
        raise ConfigError("rope_scaling", value, "low_freq_factor must be below high_freq_factor")
    return float(scaling[0]), float(scaling[1]), float(scaling[2]), int(scaling[3])


@register_family
@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(DecoderConfig):
    """Architecture of a :class:`Llama`; an immutable value (``dataclasses.replace`` changes it).

    It is the Llama family's :class:`~effijax.models.LanguageModel`. A model loaded from a GGUF
    file or a Hugging Face directory (:mod:`effijax.interop`) carries its :class:`Tokenizer` in
    :attr:`tokenizer`; that field is not architecture: it is left out of equality, hashing,
    ``repr`` and :meth:`to_dict`, so a config with and without it is the same model (and the same
    compiled program), and ``dataclasses.replace(model, tokenizer=...)`` attaches one.

    Attributes:
      vocab_size: number of token ids ``V``.
      d_model: residual width ``D`` (Hugging Face's ``hidden_size``).
      n_layers: layers ``L`` (stacked and scanned).
      n_heads: query heads ``H``.
      n_kv_heads: key/value heads ``G`` (grouped-query attention; must divide ``n_heads``);
        None means ``n_heads``.
      head_dim: head width ``K`` (even, for the rotary halves); None means ``d_model // n_heads``.
      d_ff: SwiGLU hidden width ``F`` (``intermediate_size``).
      rope_theta: rotary base.
      rope_scaling: Llama 3.1's frequency scaling ``(factor, low_freq_factor, high_freq_factor,
        original_max_position)``, or None.
      rms_eps: RMSNorm epsilon.
      tie_embeddings: the output head is the token embedding, transposed (no ``lm_head``).
      seq_len: the training window (tokens per row of a batch), at most ``max_position``.
      max_position: the context length the model was built for (``max_position_embeddings``).
      sliding_window: every layer's sliding attention window (Mistral's ``sliding_window``):
        query ``i`` attends to keys ``i - sliding_window < j <= i``; None (Llama): all earlier
        keys.
      remat: ``jax.checkpoint`` policy by name, see :data:`~effijax.models.REMAT`.
      attention: the attention implementation's name in :data:`~effijax.models.ATTENTION`;
        ``"auto"`` (the default) runs cuDNN's fused kernel on a GPU where it applies and the
        blockwise (flash) kernel on a CPU: SmolLM2's LoRA step at 4 x 512 tokens took 19.5 s
        with it against 23.5 s with ``"naive"`` (2-core AVX2 CPU, f32; 4.0 vs 4.2 s at 4 x 128).
      unroll_layers: unroll the loop over the layers instead of scanning it. The same arithmetic;
        the compiled program grows with the depth (SmolLM2's 30 layers compile in about 3x the
        time) but skips the scan's per-layer slicing of stacked parameters and residuals. On a
        2-core AMD CPU (AVX2) SmolLM2's LoRA step was no faster for it interleaved with the
        scanned one in ``benchmarks/finetune.py`` (2.40 vs 2.42 s), and its peak memory grew by
        822 MiB; on a 2-core Intel Xeon (AVX-512) 3.24 vs 3.60 s, at 1,071 MiB more.
      tokenizer: the model's :class:`Tokenizer`, or None (see above).

    Example:
      >>> config = LlamaConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
      ...                      seq_len=32)
      >>> config.head_dim, config.shape().kv_heads
      (16, 2)
      >>> LlamaConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=3, d_ff=128, seq_len=32)
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: n_kv_heads=3: must divide n_heads=4 (each key/value head ...
    """

    vocab_size: int = 256
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    rms_eps: float = 1e-5
    tie_embeddings: bool = False
    seq_len: int
    max_position: int = 4096
    sliding_window: int | None = None
    remat: str = "none"
    attention: str = "auto"
    unroll_layers: bool = False
    tokenizer: Tokenizer | None = dataclasses.field(default=None, compare=False, repr=False)

    family: ClassVar[str] = "llama"
    # Biases on the q, k, v projections (Qwen2's; the Llama has none): a family's constant.
    attention_bias: ClassVar[bool] = False
    context_field: ClassVar[str] = "max_position"
    lora_targets: ClassVar[str] = (
        r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)/kernel")

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "seq_len",
                     "max_position"):
            whole_number(name, getattr(self, name))
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        whole_number("n_kv_heads", self.n_kv_heads)
        if self.n_heads % self.n_kv_heads:
            raise ConfigError("n_kv_heads", self.n_kv_heads,
                              f"must divide n_heads={self.n_heads} (each key/value head serves "
                              "n_heads / n_kv_heads query heads)")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ConfigError("d_model", self.d_model,
                                  f"not divisible by n_heads={self.n_heads}; set head_dim "
                                  "explicitly")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        whole_number("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ConfigError("head_dim", self.head_dim, "must be even (rotary embeddings "
                              "rotate pairs of halves)")
        whole_number("sliding_window", self.sliding_window, none=True)
        _positive_float("rope_theta", self.rope_theta)
        _positive_float("rms_eps", self.rms_eps)
        object.__setattr__(self, "rope_scaling", _rope_scaling(self.rope_scaling))
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError("tie_embeddings", self.tie_embeddings, "expected a bool")
        if self.seq_len > self.max_position:
            raise ConfigError("seq_len", self.seq_len, f"exceeds max_position="
                              f"{self.max_position}, the context the model was built for")
        check_run_choices(self)
        if self.tokenizer is not None and not isinstance(self.tokenizer, Tokenizer):
            raise ConfigError("tokenizer", type(self.tokenizer).__name__,
                              "expected an effijax.models.Tokenizer or None")

    # The LanguageModel interface (the rest is DecoderConfig's) -------------------------------

    @property
    def name(self) -> str:
        """The preset's name when the architecture is one (``"smollm2-135m"``), else its shape."""
        for preset, config in self.presets.items():
            if _architecture(self) == _architecture(config):
                return preset
        return f"{self.decoder.__name__} d{self.d_model} L{self.n_layers}"

    def shape(self) -> ModelShape:
        """The activation formula's numbers: grouped-query attention, a gated (SwiGLU) MLP."""
        return ModelShape(num_params=self.num_params, layers=self.n_layers, hidden=self.d_model,
                          heads=self.n_heads, kv_heads=self.n_kv_heads, head_dim=self.head_dim,
                          ffn=self.d_ff, vocab=self.vocab_size, seq_len=self.seq_len,
                          gated_mlp=True)

    @property
    def num_params(self) -> int:
        """Parameters of the model (closed form; the tree's count).

        Example:
          >>> llama_config("smollm2-135m").num_params, llama_config("llama-2-7b").num_params
          (134515008, 6738415616)
        """
        d, f, v = self.d_model, self.d_ff, self.vocab_size
        qk = self.n_heads * self.head_dim
        kv = self.n_kv_heads * self.head_dim
        per_layer = d * qk + 2 * d * kv + qk * d + 3 * d * f + 2 * d
        if self.attention_bias:
            per_layer += qk + 2 * kv
        heads = 1 if self.tie_embeddings else 2
        return heads * v * d + self.n_layers * per_layer + d

    def to_dict(self) -> dict:
        """The architecture as a JSON-able dict with its ``family`` (no tokenizer).

        Example:
          >>> model = llama_config("llama-3.1-405b")
          >>> model.to_dict()["rope_scaling"]
          [8.0, 1.0, 4.0, 8192]
          >>> LlamaConfig.from_dict({k: v for k, v in model.to_dict().items()
          ...                        if k != "family"}) == model
          True
        """
        fields = super().to_dict()
        if fields["rope_scaling"] is not None:
            fields["rope_scaling"] = list(fields["rope_scaling"])
        return fields

    def encode(self, data: bytes) -> np.ndarray:
        """Token ids of UTF-8 training data with :attr:`tokenizer` (no BOS/EOS added).

        Without a tokenizer, a byte-vocabulary model (``vocab_size == 256``) reads bytes.
        Invalid UTF-8 is replaced by U+FFFD before tokenizing.

        Raises:
          ConfigError: no tokenizer and a vocabulary that is not bytes.
        """
        if self.tokenizer is None:
            if self.vocab_size == 256:
                return np.frombuffer(data, np.uint8)
            raise ConfigError(
                "tokenizer", None,
                f"{self.name} has a {self.vocab_size}-token vocabulary but no tokenizer; load "
                "the model with effijax.interop.load_pretrained (GGUF or Hugging Face directory) "
                "or attach one: "
                "dataclasses.replace(model, tokenizer=effijax.interop.load_tokenizer(path))")
        return self.tokenizer.encode(data.decode("utf-8", errors="replace"))


def _architecture(config: LlamaConfig) -> LlamaConfig:
    """The config without the run's choices (window, remat, attention): the bare architecture."""
    return dataclasses.replace(config, seq_len=1, remat="none", attention="naive",
                               unroll_layers=False)


LLAMA_PRESETS: dict[str, LlamaConfig] = {
    # Compiles in about a second: for tests. GQA (2 query heads per kv head), untied head.
    "llama-tiny": LlamaConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, seq_len=64,
                        max_position=256),
    # HuggingFaceTB/SmolLM2-135M(-Instruct): 134.5M parameters, tied embeddings.
    "smollm2-135m": LlamaConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9,
                                n_kv_heads=3, head_dim=64, d_ff=1536, rope_theta=100000.0,
                                rms_eps=1e-5, tie_embeddings=True, seq_len=2048,
                                max_position=8192),
    # meta-llama/Llama-2-7b-hf: 6.74B parameters.
    "llama-2-7b": LlamaConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                              d_ff=11008, rope_theta=10000.0, rms_eps=1e-5, seq_len=4096,
                              max_position=4096),
    # meta-llama/Llama-2-70b-hf: grouped-query attention with 8 kv heads.
    "llama-2-70b": LlamaConfig(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64,
                               n_kv_heads=8, d_ff=28672, rope_theta=10000.0, rms_eps=1e-5,
                               seq_len=4096, max_position=4096),
    # meta-llama/Llama-3.1-405B: 128K context through Llama 3's rotary frequency scaling.
    "llama-3.1-405b": LlamaConfig(vocab_size=128256, d_model=16384, n_layers=126, n_heads=128,
                                  n_kv_heads=8, d_ff=53248, rope_theta=500000.0,
                                  rope_scaling=(8.0, 1.0, 4.0, 8192), rms_eps=1e-5,
                                  seq_len=8192, max_position=131072),
}


# Preset names are unique across families (effijax.models.preset looks them up by name alone).
LlamaConfig.presets = LLAMA_PRESETS


def llama_config(name: str, **overrides) -> LlamaConfig:
    """A preset :class:`LlamaConfig`, with fields replaced by ``overrides``.

    Presets: ``"llama-tiny"`` (tests), ``"smollm2-135m"``, ``"llama-2-7b"``, ``"llama-2-70b"``,
    ``"llama-3.1-405b"`` (shapes from their published ``config.json``).

    Example:
      >>> llama_config("llama-2-70b").shape().num_params
      68976648192
      >>> llama_config("llama-tiny", seq_len=16).seq_len
      16
    """
    return preset_config(LlamaConfig, name, overrides)


# ----------------------------------------------------------------------------------------------
# The family's layer (attention, rotary embeddings and the scanned stack are shared).


# SwiGLU that keeps only its two inputs for the backward pass and recomputes the sigmoid there
# (the GPT's GELU does the same): autodiff would also keep sigmoid(g) and silu(g), two more
# B·S·F arrays per layer. Computed in f32 and returned in the inputs' dtype.
@jax.custom_vjp
def _swiglu(g_BSF: jax.Array, u_BSF: jax.Array) -> jax.Array:
    g = g_BSF.astype(jnp.float32)
    return (g * jax.nn.sigmoid(g) * u_BSF.astype(jnp.float32)).astype(g_BSF.dtype)


def _swiglu_fwd(g_BSF, u_BSF):
    return _swiglu(g_BSF, u_BSF), (keep(g_BSF), keep(u_BSF))


def _swiglu_bwd(residuals, dy_BSF):
    g_BSF, u_BSF = (unkeep(r) for r in residuals)
    g, u, dy = (t.astype(jnp.float32) for t in (g_BSF, u_BSF, dy_BSF))
    sig = jax.nn.sigmoid(g)
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    du = dy * g * sig
    return dg.astype(g_BSF.dtype), du.astype(u_BSF.dtype)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class _RMSNorm(nnx.Module):
    def __init__(self, d: int, *, eps: float, stack: tuple[int, ...]):
        self.scale = nnx.Param(jnp.ones((*stack, d), jnp.float32))
        self.eps = eps

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        return rms_norm(x_BSD, self.scale[...], self.eps)


class _MLP(nnx.Module):
    """``down(glu(gate(x), up(x)))``: the Llama's SwiGLU; a family with another gated unit
    (Gemma's GeGLU) sets ``glu``."""

    glu = staticmethod(_swiglu)
    # Megatron: gate and up column-parallel, down row-parallel (effijax.models._tensor_roles).
    tensor_roles: ClassVar[dict] = {"gate_proj": ("embed", "mlp"), "up_proj": ("embed", "mlp"),
                                    "down_proj": ("mlp", "embed")}

    def __init__(self, config: LlamaConfig, *, stack: tuple[int, ...], rngs: nnx.Rngs):
        d, f = config.d_model, config.d_ff
        dense = functools.partial(_Dense, std=INIT_STD, stack=stack, rngs=rngs, bias=False)
        self.gate_proj = dense(d, f)
        self.up_proj = dense(d, f)
        self.down_proj = dense(f, d)

    def __call__(self, x_BSD: jax.Array, lora: dict | None = None) -> jax.Array:
        lora = lora or {}
        b, s, _ = x_BSD.shape
        x_ND = token_rows(x_BSD)  # x itself on a context mesh
        h_NF = self.glu(self.gate_proj(x_ND, lora.get("gate_proj")),
                        self.up_proj(x_ND, lora.get("up_proj")))
        return self.down_proj(h_NF, lora.get("down_proj")).reshape(b, s, -1)


class _Layer(PreNormBlock):
    """One pre-norm Llama layer (RMSNorm, grouped-query attention with rotary embeddings and
    q/k/v biases where the family has them, RMSNorm, SwiGLU MLP), constructed once with
    ``stack=(L,)`` and scanned. No dropout of its own: LoRA's dropout keys come in through the
    adapters' hooks."""

    norm_names = ("input_norm", "post_attention_norm")  # Hugging Face's module names

    @staticmethod
    def norm(config: LlamaConfig, *, stack: tuple[int, ...]) -> nnx.Module:
        return _RMSNorm(config.d_model, eps=config.rms_eps, stack=stack)

    def __init__(self, config: LlamaConfig, *, stack: tuple[int, ...], rngs: nnx.Rngs):
        qkv_bias = config.attention_bias
        spec = AttentionSpec(d_model=config.d_model, heads=config.n_heads,
                             kv_heads=config.n_kv_heads, head_dim=config.head_dim,
                             implementation=config.attention,
                             names=("q_proj", "k_proj", "v_proj", "o_proj"),
                             bias=(qkv_bias, qkv_bias, qkv_bias, False))
        self.build_norms(config, stack)
        self.attn = RotaryAttention(spec, std=INIT_STD, out_std=INIT_STD, stack=stack, rngs=rngs)
        self.mlp = _MLP(config, stack=stack, rngs=rngs)


# ----------------------------------------------------------------------------------------------
# The model.


class Llama(Decoder):
    """The Llama decoder: embedding, scanned layers, final RMSNorm, (tied) output head.

    Args:
      config: the architecture (its tokenizer is not kept: the module is architecture only).
      policy: precision policy (default fp32): parameters are created in its param dtypes,
        logits returned in ``output_dtype``.
      rngs: ``nnx.Rngs`` for initialisation.

    Calls and decoding are :class:`~effijax.models._decoder.Decoder`'s (``tokens_BS`` up to
    ``config.max_position``; the only dropout is LoRA's).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> tied = Llama(llama_config("llama-tiny", tie_embeddings=True), rngs=nnx.Rngs(0))
      >>> hasattr(tied, "lm_head"), tied(jnp.zeros((2, 8), jnp.int32)).shape
      (False, (2, 8, 256))
    """

    layer_type = _Layer
    names = WeightNames("layers", "norm",
                        r"layers/(attn/[qkvo]_proj|mlp/(gate|up|down)_proj)/kernel",
                        "the Llama's factored LoRA adapts the layers' projections only "
                        "(layers/attn/{q,k,v,o}_proj/kernel, "
                        "layers/mlp/{gate,up,down}_proj/kernel)")

    @classmethod
    def architecture(cls, config: LlamaConfig) -> LlamaConfig:
        return dataclasses.replace(config, tokenizer=None)

    @property
    def tied(self) -> bool:
        return self.config.tie_embeddings

    def embed_positions(self, x_BSD, positions_BS, length):
        """Rotary positions: the ``(cos, sin)`` tables for the layers, ``[S, K]`` shared by the
        rows or, at per-row positions (packed rows, decoding), ``[B, S, K]``."""
        cfg = self.config
        return x_BSD, rope_positions(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, length,
                                     positions_BS)


LlamaConfig.decoder = Llama


# ----------------------------------------------------------------------------------------------
# Pretrained files: Hugging Face's LlamaForCausalLM and llama.cpp's 'llama' GGUFs.

#: effijax path -> (Hugging Face name, GGUF name); ``{i}`` is the layer of a stacked parameter.
LLAMA_TENSORS: dict[str, tuple[str, str]] = {
    "embed/embedding": ("model.embed_tokens.weight", "token_embd.weight"),
    "layers/input_norm/scale": ("model.layers.{i}.input_layernorm.weight",
                                "blk.{i}.attn_norm.weight"),
    "layers/attn/q_proj/kernel": ("model.layers.{i}.self_attn.q_proj.weight",
                                  "blk.{i}.attn_q.weight"),
    "layers/attn/k_proj/kernel": ("model.layers.{i}.self_attn.k_proj.weight",
                                  "blk.{i}.attn_k.weight"),
    "layers/attn/v_proj/kernel": ("model.layers.{i}.self_attn.v_proj.weight",
                                  "blk.{i}.attn_v.weight"),
    "layers/attn/o_proj/kernel": ("model.layers.{i}.self_attn.o_proj.weight",
                                  "blk.{i}.attn_output.weight"),
    "layers/post_attention_norm/scale": ("model.layers.{i}.post_attention_layernorm.weight",
                                         "blk.{i}.ffn_norm.weight"),
    "layers/mlp/gate_proj/kernel": ("model.layers.{i}.mlp.gate_proj.weight",
                                    "blk.{i}.ffn_gate.weight"),
    "layers/mlp/up_proj/kernel": ("model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight"),
    "layers/mlp/down_proj/kernel": ("model.layers.{i}.mlp.down_proj.weight",
                                    "blk.{i}.ffn_down.weight"),
    "norm/scale": ("model.norm.weight", "output_norm.weight"),
    "lm_head/kernel": ("lm_head.weight", "output.weight"),
}


#: The ``config.json`` values effijax's Llama block implements (None: the key is absent).
LLAMA_BLOCK_FIELDS = {"hidden_act": ("silu", None), "attention_bias": (False, None),
                      "mlp_bias": (False, None)}


def refuse_unsupported(fields: dict, family: str, allowed: dict[str, tuple]) -> None:
    """Refuses a ``config.json`` field whose value ``family`` does not implement.

    Args:
      fields: the parsed ``config.json``.
      family: the family's name, for the message.
      allowed: ``{field: the values it may take}``, the first one named in the message.

    Raises:
      ConfigError: naming the field, its value and the one supported.

    Example:
      >>> refuse_unsupported({"hidden_act": "gelu"}, "Llama", LLAMA_BLOCK_FIELDS)
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: hidden_act='gelu': effijax's Llama supports 'silu' only
    """
    for name, values in allowed.items():
        if fields.get(name) not in values or fields.get(name) is True:  # True == 1
            raise ConfigError(name, fields.get(name), f"effijax's {family} supports "
                              f"{values[0]!r} only")


def _check_hf(fields: dict) -> None:
    """Refuses what effijax's Llama lacks: another activation, biases, tensor-parallel slices."""
    refuse_unsupported(fields, "Llama", {**LLAMA_BLOCK_FIELDS, "pretraining_tp": (1, None)})


def _hf_fields(model: LlamaConfig) -> dict:
    """Llama's own ``config.json`` keys; a sliding window has no place in them."""
    if model.sliding_window is not None:
        raise ConfigError("sliding_window", model.sliding_window, "Hugging Face's "
                          "LlamaForCausalLM has no sliding window: build the model as "
                          "effijax.models.MistralConfig to export it (model_type 'mistral')")
    return {"attention_bias": False, "mlp_bias": False}


register_pretrained(PretrainedFormat(
    model_type="llama", hf_class="LlamaForCausalLM", config=LlamaConfig, tensors=LLAMA_TENSORS,
    check_hf=_check_hf, hf_fields=_hf_fields, gguf_architecture="llama", gguf_permuted=True))
