"""A Llama-family decoder in Flax NNX (Llama 2/3, SmolLM2, ...), with scanned layers.

The architecture of Hugging Face's ``LlamaForCausalLM``: token embedding, ``n_layers`` pre-norm
layers (RMSNorm, grouped-query self-attention with rotary position embeddings, RMSNorm, SwiGLU
MLP), a final RMSNorm and an output head (optionally tied to the embedding); no biases. As in
the GPT, the layers' parameters are stacked along a leading ``L`` axis and scanned, every matmul
goes through ``_dense`` (f32 accumulation, factored LoRA), and norm statistics, softmax, logits
and loss are f32 islands; the model computes in its parameters' dtype.

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
import re
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from effijax.errors import ConfigError
from effijax.lora import LoraSpec
from effijax.models._cache import (
    KVCache,
    cached_attend,
    init_cache,
    make_decode,
    row_positions,
    run_layers_cached,
    select_last,
    write_cache,
)
from effijax.models._gpt import ATTENTION, REMAT
from effijax.models._interface import LanguageModel, ModelShape, register_family
from effijax.models._layers import (
    INIT_STD,
    _constrain,
    _Dense,
    _dense,
    _Embed,
    _run_layers,
    check_call,
    make_apply,
    make_loss_fn,
    segment_positions,
)
from effijax.models._tokenizer import Tokenizer
from effijax.precision import Policy, get_policy, rms_norm

__all__ = ["Llama", "LlamaConfig", "LLAMA_PRESETS", "llama_config"]


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(name, value, "expected a positive int")


def _positive_float(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value <= 0:
        raise ConfigError(name, value, "expected a positive finite number")


@register_family
@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(LanguageModel):
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
      remat: ``jax.checkpoint`` policy by name, see :data:`~effijax.models.REMAT`.
      attention: the attention implementation's name in :data:`~effijax.models.ATTENTION`.
      unroll_layers: unroll the loop over the layers instead of scanning it. The same arithmetic;
        the compiled program grows with the depth (SmolLM2's 30 layers compile in about 3x the
        time) but skips the scan's per-layer slicing of stacked parameters and residuals. On a
        2-core CPU SmolLM2's LoRA step was no faster for it interleaved with the scanned one in
        ``benchmarks/finetune.py`` (2.40 vs 2.42 s), and its peak memory grew by 822 MiB.
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
    remat: str = "none"
    attention: str = "naive"
    unroll_layers: bool = False
    tokenizer: Tokenizer | None = dataclasses.field(default=None, compare=False, repr=False)

    family: ClassVar[str] = "llama"
    lora_targets: ClassVar[str] = (
        r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)/kernel")

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "seq_len",
                     "max_position"):
            _positive_int(name, getattr(self, name))
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        _positive_int("n_kv_heads", self.n_kv_heads)
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
        _positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ConfigError("head_dim", self.head_dim, "must be even (rotary embeddings "
                              "rotate pairs of halves)")
        _positive_float("rope_theta", self.rope_theta)
        _positive_float("rms_eps", self.rms_eps)
        if self.rope_scaling is not None:
            scaling = tuple(self.rope_scaling)
            if len(scaling) != 4:
                raise ConfigError("rope_scaling", self.rope_scaling,
                                  "expected (factor, low_freq_factor, high_freq_factor, "
                                  "original_max_position) or None")
            for name, value in zip(("rope_scaling.factor", "rope_scaling.low_freq_factor",
                                    "rope_scaling.high_freq_factor"), scaling[:3], strict=True):
                _positive_float(name, value)
            _positive_int("rope_scaling.original_max_position", scaling[3])
            if not scaling[1] < scaling[2]:
                raise ConfigError("rope_scaling", self.rope_scaling,
                                  "low_freq_factor must be below high_freq_factor")
            object.__setattr__(self, "rope_scaling",
                               (float(scaling[0]), float(scaling[1]), float(scaling[2]),
                                int(scaling[3])))
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError("tie_embeddings", self.tie_embeddings, "expected a bool")
        if self.seq_len > self.max_position:
            raise ConfigError("seq_len", self.seq_len, f"exceeds max_position="
                              f"{self.max_position}, the context the model was built for")
        if self.remat not in REMAT:
            raise ConfigError("remat", self.remat, f"unknown mode; choose one of {list(REMAT)}")
        if not isinstance(self.unroll_layers, bool):
            raise ConfigError("unroll_layers", self.unroll_layers, "expected a bool")
        if self.attention not in ATTENTION:
            raise ConfigError("attention", self.attention,
                              f"unknown implementation; choose one of {list(ATTENTION)}")
        if self.tokenizer is not None and not isinstance(self.tokenizer, Tokenizer):
            raise ConfigError("tokenizer", type(self.tokenizer).__name__,
                              "expected an effijax.models.Tokenizer or None")

    # The LanguageModel interface ------------------------------------------------------------

    @property
    def name(self) -> str:
        """The preset's name when the architecture is one (``"smollm2-135m"``), else its shape."""
        for preset, config in LLAMA_PRESETS.items():
            if _architecture(self) == _architecture(config):
                return preset
        return f"Llama d{self.d_model} L{self.n_layers}"

    def with_seq_len(self, seq_len: int) -> LlamaConfig:
        """Rotary positions: any window up to ``max_position``."""
        return dataclasses.replace(self, seq_len=seq_len)

    def abstract_params(self, policy: Policy | str | None = None) -> dict:
        """The parameter tree as ``jax.ShapeDtypeStruct`` leaves, in the policy's param dtypes.

        Example:
          >>> llama_config("smollm2-135m").abstract_params()["layers"]["attn"]["k_proj"]
          {'kernel': ShapeDtypeStruct(shape=(30, 576, 192), dtype=float32)}
        """
        abstract = _abstract_split(self, get_policy("fp32" if policy is None else policy))[1]
        return jax.tree.map(lambda leaf: leaf, abstract)  # fresh dicts: the cache's stay intact

    def init_params(self, key: jax.Array, policy: Policy | str | None = None) -> dict:
        """Fresh parameters (Hugging Face's init: normal(0.02) matrices, unit norm scales).

        Jit it with ``static_argnums`` and ``out_shardings`` to create them sharded.
        """
        return _split(Llama(self, policy=policy, rngs=nnx.Rngs(params=key)))[1]

    def loss_fn(self, lora: LoraSpec | None = None):
        """See :func:`effijax.models.make_loss_fn` (masked mean cross-entropy in f32)."""
        return make_loss_fn(_graphdef(self), lora)

    def logits_fn(self, lora: LoraSpec | None = None):
        """``logits_fn(params, tokens_BS, segments_BS=None) -> logits_BSV`` in the policy's
        output dtype."""
        apply = make_apply(_graphdef(self), lora)
        return lambda params, tokens_BS, segments_BS=None: apply(params, tokens_BS,
                                                                 segments_BS=segments_BS)

    @property
    def max_context(self) -> int:
        """Rotary positions: the context the model was built for (``max_position``)."""
        return self.max_position

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
        """An empty :class:`~effijax.models.KVCache`: ``n_kv_heads`` keys per position."""
        return init_cache(self.n_layers, batch, max_len, self.n_kv_heads, self.head_dim, dtype)

    def decode_fn(self, lora: LoraSpec | None = None):
        """See :func:`effijax.models.make_decode` (cached forward pass)."""
        return make_decode(_graphdef(self), lora, stack="layers")

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
        heads = 1 if self.tie_embeddings else 2
        return heads * v * d + self.n_layers * per_layer + d

    def to_dict(self) -> dict:
        """The architecture as a JSON-able dict with ``family: "llama"`` (no tokenizer)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name != "tokenizer"}
        if fields["rope_scaling"] is not None:
            fields["rope_scaling"] = list(fields["rope_scaling"])
        return {"family": self.family, **fields}

    @classmethod
    def from_dict(cls, fields: dict) -> LlamaConfig:
        """Rebuilds a config from :meth:`to_dict`'s output; unknown fields are errors.

        Example:
          >>> model = llama_config("llama-3.1-405b")
          >>> LlamaConfig.from_dict({k: v for k, v in model.to_dict().items()
          ...                        if k != "family"}) == model
          True
        """
        known = {f.name for f in dataclasses.fields(cls)} - {"tokenizer"}
        for key in fields:
            if key not in known:
                raise ConfigError(f"model_config.{key}", fields[key],
                                  f"not a LlamaConfig field; fields are {sorted(known)}")
        fields = dict(fields)
        if fields.get("rope_scaling") is not None:
            fields["rope_scaling"] = tuple(fields["rope_scaling"])
        try:
            return cls(**fields)
        except TypeError as e:
            raise ConfigError("model_config", fields, str(e)) from None

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
                "the model with effijax.interop.load (GGUF or Hugging Face directory) or attach "
                "one: dataclasses.replace(model, tokenizer=effijax.interop.load_tokenizer(path))")
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
    if name not in LLAMA_PRESETS:
        raise ConfigError("name", name, f"unknown Llama preset; presets: {list(LLAMA_PRESETS)}")
    known = {f.name for f in dataclasses.fields(LlamaConfig)}
    for key in overrides:
        if key not in known:
            raise ConfigError(key, overrides[key], f"not a LlamaConfig field; fields are "
                              f"{sorted(known)}")
    return dataclasses.replace(LLAMA_PRESETS[name], **overrides)


# ----------------------------------------------------------------------------------------------
# Rotary embeddings.


def _inv_freq(config: LlamaConfig) -> np.ndarray:
    """Rotary frequencies ``[K/2]`` in f64, with Llama 3.1's scaling when the config has it."""
    k = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, k, 2, dtype=np.float64) / k))
    if config.rope_scaling is None:
        return inv_freq
    factor, low, high, original = config.rope_scaling
    # Wavelengths longer than the original context are slowed by ``factor``, shorter than
    # original / high kept, and those between interpolated (Hugging Face's llama3 rope type).
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return np.where(medium, smoothed, scaled)


@functools.lru_cache(maxsize=16)
def _rope_tables(config: LlamaConfig, s: int) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and ``sin`` tables ``[S, K]`` in f32 for positions ``0..S-1``.

    Angles are computed in f64 on the host: ``position · frequency`` in f32 is off by up to
    ``position · 2^-24`` radians, visible at long contexts. Both halves of a head share a
    frequency (Hugging Face's rotate-half layout).
    """
    angles_SK2 = np.arange(s, dtype=np.float64)[:, None] * _inv_freq(config)[None, :]
    angles_SK = np.concatenate([angles_SK2, angles_SK2], axis=-1)
    return np.cos(angles_SK).astype(np.float32), np.sin(angles_SK).astype(np.float32)


def _rope(x_BSHK: jax.Array, cos_SK: jax.Array, sin_SK: jax.Array) -> jax.Array:
    """Rotates each head's two halves: ``x cos + rotate_half(x) sin``, in f32. The tables are
    ``[S, K]`` (shared by the rows) or ``[B, S, K]`` (per-row positions: packed rows, left-padded
    prompts)."""
    x = x_BSHK.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x * cos_SK[..., None, :] + rotated * sin_SK[..., None, :]
    return out.astype(x_BSHK.dtype)


# ----------------------------------------------------------------------------------------------
# Layers.


def _grouped_attention(name: str, q_BSHK, k_BSGK, v_BSGK, segments_BS=None) -> jax.Array:
    """Causal attention with ``G`` key/value heads for ``H`` query heads (within each segment
    of packed rows when ``segments_BS`` is given).

    Query head ``h`` reads kv head ``h // (H // G)`` (Hugging Face's ``repeat_kv``). Every
    implementation in ``ATTENTION`` takes the ``G`` heads as they are: no ``H``-head copy of the
    keys and values is made or kept for the backward pass.
    """
    return ATTENTION[name](q_BSHK, k_BSGK, v_BSGK, causal=True, segments_BS=segments_BS)


# SwiGLU that keeps only its two inputs for the backward pass and recomputes the sigmoid there
# (the GPT's GELU does the same): autodiff would also keep sigmoid(g) and silu(g), two more
# B·S·F arrays per layer. Computed in f32 and returned in the inputs' dtype.
@jax.custom_vjp
def _swiglu(g_BSF: jax.Array, u_BSF: jax.Array) -> jax.Array:
    g = g_BSF.astype(jnp.float32)
    return (g * jax.nn.sigmoid(g) * u_BSF.astype(jnp.float32)).astype(g_BSF.dtype)


def _swiglu_fwd(g_BSF, u_BSF):
    return _swiglu(g_BSF, u_BSF), (g_BSF, u_BSF)


def _swiglu_bwd(residuals, dy_BSF):
    g_BSF, u_BSF = residuals
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


class _Attention(nnx.Module):
    def __init__(self, config: LlamaConfig, *, stack: tuple[int, ...], rngs: nnx.Rngs):
        d, q, kv = config.d_model, config.n_heads * config.head_dim, \
            config.n_kv_heads * config.head_dim
        dense = functools.partial(_Dense, std=INIT_STD, stack=stack, rngs=rngs, bias=False)
        self.q_proj = dense(d, q)
        self.k_proj = dense(d, kv)
        self.v_proj = dense(d, kv)
        self.o_proj = dense(q, d)
        self.config = config

    def __call__(self, x_BSD: jax.Array, cos_SK, sin_SK, lora: dict | None = None,
                 cache: tuple | None = None, segments_BS: jax.Array | None = None):
        cfg = self.config
        lora = lora or {}
        b, s, _ = x_BSD.shape
        # One flat input for the three projections: the backward pass saves each one's input.
        x_ND = x_BSD.reshape(b * s, -1)
        q_BSHK = self.q_proj(x_ND, lora.get("q_proj")).reshape(b, s, cfg.n_heads, cfg.head_dim)
        k_BSGK = self.k_proj(x_ND, lora.get("k_proj")).reshape(b, s, cfg.n_kv_heads,
                                                               cfg.head_dim)
        v_BSGK = self.v_proj(x_ND, lora.get("v_proj")).reshape(b, s, cfg.n_kv_heads,
                                                               cfg.head_dim)
        q_BSHK, k_BSGK = _rope(q_BSHK, cos_SK, sin_SK), _rope(k_BSGK, cos_SK, sin_SK)
        if cache is None:
            out_BSHK = _grouped_attention(cfg.attention, q_BSHK, k_BSGK, v_BSGK, segments_BS)
            return self.o_proj(out_BSHK.reshape(b, s, -1), lora.get("o_proj"))
        # Decoding (effijax.models._cache): write this step's keys and values, attend to all.
        k_BTGK, v_BTGK, start, pad_B = cache
        k_BTGK, v_BTGK = write_cache(k_BTGK, k_BSGK, start), write_cache(v_BTGK, v_BSGK, start)
        out_BSHK = cached_attend(q_BSHK, k_BTGK, v_BTGK, start, pad_B)
        return self.o_proj(out_BSHK.reshape(b, s, -1), lora.get("o_proj")), (k_BTGK, v_BTGK)


class _MLP(nnx.Module):
    def __init__(self, config: LlamaConfig, *, stack: tuple[int, ...], rngs: nnx.Rngs):
        d, f = config.d_model, config.d_ff
        dense = functools.partial(_Dense, std=INIT_STD, stack=stack, rngs=rngs, bias=False)
        self.gate_proj = dense(d, f)
        self.up_proj = dense(d, f)
        self.down_proj = dense(f, d)

    def __call__(self, x_BSD: jax.Array, lora: dict | None = None) -> jax.Array:
        lora = lora or {}
        b, s, _ = x_BSD.shape
        x_ND = x_BSD.reshape(b * s, -1)
        h_NF = _swiglu(self.gate_proj(x_ND, lora.get("gate_proj")),
                       self.up_proj(x_ND, lora.get("up_proj")))
        return self.down_proj(h_NF, lora.get("down_proj")).reshape(b, s, -1)


class _Layer(nnx.Module):
    """One pre-norm Llama layer, constructed once with ``stack=(L,)`` and scanned."""

    def __init__(self, config: LlamaConfig, *, stack: tuple[int, ...], rngs: nnx.Rngs):
        self.input_norm = _RMSNorm(config.d_model, eps=config.rms_eps, stack=stack)
        self.attn = _Attention(config, stack=stack, rngs=rngs)
        self.post_attention_norm = _RMSNorm(config.d_model, eps=config.rms_eps, stack=stack)
        self.mlp = _MLP(config, stack=stack, rngs=rngs)

    def __call__(self, x_BSD: jax.Array, key: jax.Array | None, lora: dict | None,
                 cos_SK: jax.Array, sin_SK: jax.Array, segments_BS: jax.Array | None = None,
                 cache: tuple | None = None):
        """The layer's output; with a ``cache`` (``(k_BTGK, v_BTGK, start, pad_B)``, decoding)
        also the cache slices with this step's keys and values written. ``segments_BS`` (packed
        rows; the rotary tables are then ``[B, S, K]``) keeps attention within each segment."""
        del key  # Llama has no dropout; LoRA dropout keys come in through the hooks
        lora = lora or {}
        attn = self.attn(self.input_norm(x_BSD), cos_SK, sin_SK, lora.get("attn"), cache,
                         segments_BS=segments_BS)
        attn_BSD, kv = attn if cache is not None else (attn, None)
        x_BSD = x_BSD + attn_BSD
        x_BSD = x_BSD + self.mlp(self.post_attention_norm(x_BSD), lora.get("mlp"))
        return x_BSD if cache is None else (x_BSD, kv)


# The kernels the factored LoRA apply can adapt: the layers' projections.
_ADAPTABLE = re.compile(r"^layers/(attn/[qkvo]_proj|mlp/(gate|up|down)_proj)/kernel$")


class Llama(nnx.Module):
    """The Llama decoder: embedding, scanned layers, final RMSNorm, (tied) output head.

    Args:
      config: the architecture (its tokenizer is not kept: the module is architecture only).
      policy: precision policy (default fp32): parameters are created in its param dtypes,
        logits returned in ``output_dtype``.
      rngs: ``nnx.Rngs`` for initialisation.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> model = Llama(llama_config("llama-tiny"), rngs=nnx.Rngs(0))
      >>> model(jnp.zeros((2, 8), jnp.int32)).shape
      (2, 8, 256)
    """

    def __init__(self, config: LlamaConfig, *, policy: Policy | str | None = None,
                 rngs: nnx.Rngs):
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config: expected a LlamaConfig, got {type(config).__name__}")
        policy = get_policy("fp32" if policy is None else policy)
        config = dataclasses.replace(config, tokenizer=None)
        self.config = config
        self.policy = policy
        self.embed = _Embed(config.vocab_size, config.d_model, rngs=rngs)
        self.layers = _Layer(config, stack=(config.n_layers,), rngs=rngs)
        self.norm = _RMSNorm(config.d_model, eps=config.rms_eps, stack=())
        if not config.tie_embeddings:
            self.lm_head = _Dense(config.d_model, config.vocab_size, std=INIT_STD, stack=(),
                                  rngs=rngs, bias=False)
        state = nnx.state(self, nnx.Param)
        nnx.replace_by_pure_dict(state, policy.cast_to_param(nnx.to_pure_dict(state)))
        nnx.update(self, state)

    def __call__(self, tokens_BS: jax.Array, *, deterministic: bool = True,
                 rngs: nnx.Rngs | jax.Array | None = None, adapters: dict | None = None,
                 lora: LoraSpec | None = None, segments_BS: jax.Array | None = None
                 ) -> jax.Array:
        """Next-token logits ``[B, S, V]`` in ``policy.output_dtype``.

        Args:
          tokens_BS: integer ids, ``S <= config.max_position``.
          deterministic, rngs: LoRA dropout (the model itself has none) runs when
            ``deterministic=False`` and ``lora.dropout > 0``, with keys from ``rngs``.
          adapters, lora: LoRA adapters of the layers' projections and their spec, or neither.
          segments_BS: packed rows' integer segment ids ``[B, S]``: attention stays within a
            segment and the rotary positions restart at each segment's start.
        """
        cfg = self.config
        check_call(self, tokens_BS, adapters, lora, adaptable=_ADAPTABLE,
                   adaptable_text="the Llama's factored LoRA adapts the layers' projections only "
                   "(layers/attn/{q,k,v,o}_proj/kernel, layers/mlp/{gate,up,down}_proj/kernel)",
                   segments_BS=segments_BS)
        s = tokens_BS.shape[1]
        if s > cfg.max_position:
            raise ValueError(f"tokens_BS: sequence length {s} exceeds config.max_position="
                             f"{cfg.max_position}")
        key = None
        if not deterministic and lora is not None and lora.dropout > 0:
            if rngs is None:
                raise ValueError("LoRA dropout is on (deterministic=False, lora.dropout > 0) "
                                 "but no rngs were given; pass a jax.random key")
            key = rngs.dropout() if isinstance(rngs, nnx.Rngs) else rngs

        embedding_VD = self.embed.embedding[...]
        x_BSD = _constrain(jnp.take(embedding_VD, tokens_BS, axis=0))
        cos_SK, sin_SK = (jnp.asarray(t) for t in _rope_tables(cfg, s))
        consts = (cos_SK, sin_SK)
        if segments_BS is not None:  # per-row positions: the tables' rows at each position
            positions_BS = segment_positions(segments_BS)
            consts = (jnp.take(cos_SK, positions_BS, axis=0),
                      jnp.take(sin_SK, positions_BS, axis=0), segments_BS)
        graphdef, stacked = nnx.split(self.layers)
        keys_L = None if key is None else jax.random.split(key, cfg.n_layers)
        layer_adapters = None if adapters is None else adapters.get("layers")
        x_BSD = _run_layers(x_BSD, stacked, keys_L, layer_adapters, consts,
                            graphdef=graphdef, remat=REMAT[cfg.remat],
                            lora=None if layer_adapters is None else lora, path="layers",
                            unroll=cfg.unroll_layers)
        return self._head(x_BSD)

    def decode(self, tokens_BS: jax.Array, cache: KVCache, start: jax.Array, *,
               last: jax.Array | None = None, adapters: dict | None = None,
               lora: LoraSpec | None = None, layers: tuple | None = None
               ) -> tuple[jax.Array, KVCache]:
        """The cached forward pass of ``tokens_BS`` at slots ``start .. start + S - 1`` (each
        row's rotary positions counted from its first real token, see ``cache.pad_B``):
        ``(logits, cache)``, see :func:`effijax.models.make_decode`."""
        cfg = self.config
        check_call(self, tokens_BS, adapters, lora, adaptable=_ADAPTABLE,
                   adaptable_text="the Llama's factored LoRA adapts the layers' projections only")
        s, t = tokens_BS.shape[1], cache.max_len
        if t > cfg.max_position or s > t:
            raise ValueError(f"cache of {t} positions for {s} tokens: need tokens <= cache <= "
                             f"config.max_position={cfg.max_position}")
        x_BSD = _constrain(jnp.take(self.embed.embedding[...], tokens_BS, axis=0))
        start = jnp.asarray(start, jnp.int32)
        positions_BS = row_positions(cache, start, s)
        cos_BSK, sin_BSK = (jnp.take(jnp.asarray(table), positions_BS, axis=0)
                            for table in _rope_tables(cfg, t))
        graphdef, stacked = nnx.split(self.layers)
        layer_adapters = None if adapters is None else adapters.get("layers")
        x_BSD, cache = run_layers_cached(x_BSD, stacked, cache, start, layer_adapters,
                                         (cos_BSK, sin_BSK), graphdef=graphdef,
                                         lora=None if layer_adapters is None else lora,
                                         path="layers", layers=layers)
        return self._head(select_last(x_BSD, last)), cache

    def _head(self, x_BSD: jax.Array) -> jax.Array:
        """Final norm and the (tied) output head: logits in the policy's output dtype."""
        x_BSD = self.norm(x_BSD)
        embedding_VD = self.embed.embedding[...]
        head_DV = embedding_VD.T if self.config.tie_embeddings else self.lm_head.kernel[...]
        logits_BSV = _dense(x_BSD, head_DV, None)
        return logits_BSV.astype(self.policy.output_dtype)


def _split(model: Llama) -> tuple[nnx.GraphDef, dict]:
    graphdef, state = nnx.split(model, nnx.Param)
    return graphdef, nnx.to_pure_dict(state)


@functools.lru_cache(maxsize=32)
def _abstract_split(config: LlamaConfig, policy: Policy) -> tuple[nnx.GraphDef, dict]:
    model = nnx.eval_shape(lambda: Llama(config, policy=policy, rngs=nnx.Rngs(0)))
    return _split(model)


def _graphdef(config: LlamaConfig) -> nnx.GraphDef:
    """The static structure (policy-independent: dtypes live in the parameters)."""
    return _abstract_split(config, get_policy("fp32"))[0]
