"""A decoder-only GPT in Flax NNX, with scanned layers and fp32 islands.

The model is GPT-2 shaped: token and learned position embeddings, ``n_layers`` pre-LayerNorm
blocks (causal multi-head self-attention, then a GELU MLP), a final LayerNorm, and an output head
tied to the token embedding. The blocks' parameters are stacked along a leading layer axis and
the forward pass runs ``jax.lax.scan`` over them, so compile time does not grow with depth.
This file holds what is the GPT's own (config, learned positions, LayerNorm, GELU MLP, the block);
the passes, the attention and the config plumbing are the decoder skeleton's
(:mod:`effijax.models._decoder`).

The model computes in its parameters' own dtype: a train step casts the master parameters with
``Policy.cast_to_compute`` and merges them (see :func:`make_apply`); only the logits are cast, to
``policy.output_dtype``. Every matmul goes through :func:`_dense` (``dot`` with f32 accumulation),
softmax and LayerNorm run in f32 (:mod:`effijax.precision._islands`).

LoRA: ``make_apply(graphdef, lora=spec)`` takes ``{"base": params, "adapters": adapters}`` (see
:mod:`effijax.lora`). The blocks' adapters are stacked along ``L`` like the kernels they adapt,
so they are scanned with them; ``_dense`` adds ``s·(x a) b`` to ``x w`` and never forms ``a b``.

Packed rows: with ``segments_BS`` (the ids of the examples packed into each row) attention stays
within a segment and the learned positions restart at 0 at each segment's start
(:func:`~effijax.models._layers.segment_positions`), so each example is computed as if alone.

Shape suffixes: ``B`` batch, ``S`` query sequence, ``T`` key sequence, ``D`` model width,
``H`` heads, ``K`` head width, ``F`` MLP width, ``V`` vocabulary, ``L`` layers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from effijax.errors import ConfigError, whole_number
from effijax.models._decoder import (
    REMAT,
    Attention,
    AttentionSpec,
    Decoder,
    DecoderConfig,
    PreNormBlock,
    WeightNames,
    abstract_split,
    check_run_choices,
    preset_config,
    split_params,
)
from effijax.models._dense import keep, unkeep
from effijax.models._interface import ModelShape, register_family
from effijax.models._layers import INIT_STD, _Dense, _Embed, make_apply, make_loss_fn
from effijax.precision import Policy, layer_norm

__all__ = [
    "GPT",
    "GPTConfig",
    "PRESETS",
    "REMAT",
    "abstract_params",
    "abstract_split",
    "gpt_config",
    "init_params",
    "make_apply",
    "make_loss_fn",
    "param_count",
    "split_params",
]


# ----------------------------------------------------------------------------------------------
# Configuration.


@register_family
@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig(DecoderConfig):
    """Architecture of a :class:`GPT`; an immutable value (change it with ``dataclasses.replace``).

    It is also the GPT family's :class:`~effijax.models.LanguageModel`: the training recipe
    builds, trains and measures a GPT through the interface's methods.

    Attributes:
      vocab_size: number of token ids (256: bytes).
      seq_len: maximum sequence length (rows of the position embedding).
      d_model: residual width ``D``.
      n_layers: number of blocks ``L`` (stacked and scanned).
      n_heads: attention heads; must divide ``d_model``.
      mlp_ratio: MLP hidden width is ``mlp_ratio * d_model``.
      dropout: dropout rate on attention probabilities and residual branches, in ``[0, 1)``.
      ln_eps: LayerNorm epsilon.
      remat: ``"none"``, ``"block"`` (recompute each block in the backward pass) or ``"dots"``
        (save only the non-batched matmul outputs), see :data:`REMAT`.
      attention: the attention implementation, a name in :data:`ATTENTION`: ``"naive"``,
        ``"blockwise"``, ``"xla"`` (``jax.nn.dot_product_attention``; no dropout) or ``"auto"``
        (the default: cuDNN's fused kernel on a GPU where it applies, else the best fallback;
        the blockwise kernel on a CPU, where the default ``effijax train`` run of the mini
        preset took 83 s against 101 s with ``"naive"``, 2-core AVX2 CPU, f32).
      unroll_layers: unroll the loop over the blocks instead of scanning it (see
        :class:`~effijax.models.LlamaConfig`); the same arithmetic.

    Example:
      >>> GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4).head_dim
      8
      >>> GPTConfig(seq_len=16, d_model=30, n_layers=2, n_heads=4)
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: d_model=30: not divisible by n_heads=4; pick d_model = n_heads ...
    """

    vocab_size: int = 256
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    mlp_ratio: int = 4
    dropout: float = 0.0
    ln_eps: float = 1e-5
    remat: str = "none"
    attention: str = "auto"
    unroll_layers: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            whole_number(name, getattr(self, name))
        if self.d_model % self.n_heads:
            raise ConfigError("d_model", self.d_model, f"not divisible by n_heads={self.n_heads}; "
                              "pick d_model = n_heads * head_dim")
        if not isinstance(self.dropout, int | float) or not 0.0 <= self.dropout < 1.0:
            raise ConfigError("dropout", self.dropout, "expected a rate in [0, 1)")
        if not isinstance(self.ln_eps, int | float) or not self.ln_eps > 0:
            raise ConfigError("ln_eps", self.ln_eps, "expected a positive float")
        check_run_choices(self)
        if self.attention == "xla" and self.dropout > 0:
            raise ConfigError(
                "attention", self.attention,
                f"jax.nn.dot_product_attention has no attention dropout but dropout="
                f"{self.dropout}; use attention='auto' (it falls back to one with dropout), "
                "'naive' or 'blockwise', or dropout=0")

    family: ClassVar[str] = "gpt"
    lora_targets: ClassVar[str] = r"(attn/(q|k|v|o)|mlp/(fc_in|fc_out))/kernel"

    @property
    def head_dim(self) -> int:
        """Width ``K`` of one attention head."""
        return self.d_model // self.n_heads

    @property
    def d_ff(self) -> int:
        """MLP hidden width ``F``."""
        return self.mlp_ratio * self.d_model

    # The LanguageModel interface (the rest is DecoderConfig's) -------------------------------

    @property
    def name(self) -> str:
        """The preset's name when the config is one (``"mini GPT"``), else its shape."""
        for preset, config in PRESETS.items():
            if dataclasses.replace(self, seq_len=config.seq_len, unroll_layers=False) == config:
                return f"{preset} GPT"
        return f"GPT d{self.d_model} L{self.n_layers}"

    def shape(self) -> ModelShape:
        """The numbers of the activation formula (plain multi-head attention, GELU MLP)."""
        return ModelShape(num_params=param_count(self), layers=self.n_layers,
                          hidden=self.d_model, heads=self.n_heads, kv_heads=self.n_heads,
                          head_dim=self.head_dim, ffn=self.d_ff, vocab=self.vocab_size,
                          seq_len=self.seq_len)


PRESETS: dict[str, GPTConfig] = {
    # Compiles in about a second: for tests.
    "tiny": GPTConfig(seq_len=64, d_model=64, n_layers=2, n_heads=4),
    # The `effijax train` default: a few hundred steps in a minute or two on a laptop CPU.
    "mini": GPTConfig(seq_len=128, d_model=128, n_layers=4, n_heads=4),
    "small": GPTConfig(seq_len=256, d_model=384, n_layers=6, n_heads=6),
    # 99.8M parameters with the byte vocabulary.
    "base": GPTConfig(seq_len=512, d_model=768, n_layers=14, n_heads=12),
}


GPTConfig.presets = PRESETS


def gpt_config(name: str, **overrides) -> GPTConfig:
    """Returns a preset :class:`GPTConfig`, with fields replaced by ``overrides``.

    Presets: ``"tiny"`` (d=64, L=2, seq 64), ``"mini"`` (d=128, L=4, seq 128), ``"small"``
    (d=384, L=6, seq 256), ``"base"`` (d=768, L=14, seq 512; ~100M parameters).

    Example:
      >>> gpt_config("tiny", dropout=0.1).dropout
      0.1
    """
    return preset_config(GPTConfig, name, overrides)


def param_count(config: GPTConfig) -> int:
    """Number of parameters of a :class:`GPT` with ``config`` (closed form; the head is tied).

    Example:
      >>> param_count(gpt_config("base"))
      99821568
    """
    v, s, d, f, n = config.vocab_size, config.seq_len, config.d_model, config.d_ff, config.n_layers
    per_layer = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 2 * (2 * d)
    return v * d + s * d + n * per_layer + 2 * d


# ----------------------------------------------------------------------------------------------
# The family's layer (attention and the scanned stack are the decoder skeleton's).


# tanh-GELU that keeps only its input for the backward pass and recomputes the rest there.
# Differentiated as is, it keeps about five intermediates of its input's size (the cube, the
# tanh, ...): per layer, five more B·S·4D arrays than the activation formula counts, and
# on XLA:CPU writing and reading them back is a visible share of the step (measured: the small
# GPT's step temporaries 486 -> 342 MiB, and faster). Recomputing one elementwise function costs
# less. A custom VJP rather than jax.checkpoint: the model's remat options stay the only remat.
@jax.custom_vjp
def _gelu(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x)


def _gelu_fwd(x):
    return jax.nn.gelu(x), keep(x)


def _gelu_bwd(x, g):
    return jax.vjp(jax.nn.gelu, unkeep(x))[1](g)


_gelu.defvjp(_gelu_fwd, _gelu_bwd)


class _LayerNorm(nnx.Module):
    def __init__(self, d: int, *, eps: float, stack: tuple[int, ...]):
        self.scale = nnx.Param(jnp.ones((*stack, d), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((*stack, d), jnp.float32))
        self.eps = eps

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        return layer_norm(x_BSD, self.scale[...], self.bias[...], self.eps)


class _MLP(nnx.Module):
    # Megatron: fc_in column-parallel, fc_out row-parallel (effijax.models._tensor_roles).
    tensor_roles: ClassVar[dict] = {"fc_in": ("embed", "mlp"), "fc_out": ("mlp", "embed")}

    def __init__(self, config: GPTConfig, *, out_std: float, stack: tuple[int, ...],
                 rngs: nnx.Rngs):
        self.fc_in = _Dense(config.d_model, config.d_ff, std=INIT_STD, stack=stack, rngs=rngs)
        self.fc_out = _Dense(config.d_ff, config.d_model, std=out_std, stack=stack, rngs=rngs)

    def __call__(self, x_BSD: jax.Array, lora: dict | None = None) -> jax.Array:
        lora = lora or {}
        return self.fc_out(_gelu(self.fc_in(x_BSD, lora.get("fc_in"))), lora.get("fc_out"))


class _Block(PreNormBlock):
    """One pre-LayerNorm GPT-2 block (multi-head attention with biases, GELU MLP), dropout on
    the attention probabilities and on both residual branches.

    Constructed once with ``stack=(L,)`` so every parameter carries a leading layer axis; the
    forward pass merges it with one layer's slice of that state at a time.
    """

    norm_names = ("ln1", "ln2")

    @staticmethod
    def norm(config: GPTConfig, *, stack: tuple[int, ...]) -> nnx.Module:
        return _LayerNorm(config.d_model, eps=config.ln_eps, stack=stack)

    def __init__(self, config: GPTConfig, *, stack: tuple[int, ...], rngs: nnx.Rngs):
        # GPT-2's init: the projections into the residual stream scaled by 1/sqrt(2 L).
        out_std = INIT_STD / math.sqrt(2 * config.n_layers)
        spec = AttentionSpec(d_model=config.d_model, heads=config.n_heads,
                             kv_heads=config.n_heads, head_dim=config.head_dim,
                             implementation=config.attention, dropout=config.dropout,
                             bias=(True, True, True, True))
        self.build_norms(config, stack)
        self.attn = Attention(spec, std=INIT_STD, out_std=out_std, stack=stack, rngs=rngs)
        self.mlp = _MLP(config, out_std=out_std, stack=stack, rngs=rngs)
        self.dropout = config.dropout


# ----------------------------------------------------------------------------------------------
# The model.


class GPT(Decoder):
    """Decoder-only transformer with learned positions, tied embeddings and scanned blocks.

    Args:
      config: the architecture.
      policy: precision policy (default fp32). Parameters are created in ``policy.param_dtype``
        (honouring ``policy.overrides``); logits are returned in ``policy.output_dtype``.
      rngs: ``nnx.Rngs`` for initialisation (the ``params`` stream, or ``default``).

    Calls and decoding are :class:`~effijax.models._decoder.Decoder`'s (``tokens_BS`` up to
    ``config.seq_len``; dropout when ``deterministic=False`` and ``config.dropout > 0``).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> model = GPT(gpt_config("tiny"), policy="pure_bf16", rngs=nnx.Rngs(0))
      >>> logits = model(jnp.zeros((2, 8), jnp.int32))
      >>> logits.shape, logits.dtype, model.pos_embed.embedding.shape
      ((2, 8, 256), dtype('float32'), (64, 64))
    """

    layer_type = _Block
    # LoRA's factored apply adapts the kernels of the blocks' ``_Dense`` layers.
    names = WeightNames("blocks", "ln_f", r"blocks/(attn/[qkvo]|mlp/fc_(in|out))/kernel",
                        "the GPT's factored LoRA adapts the blocks' dense kernels only "
                        "(blocks/attn/{q,k,v,o}/kernel, blocks/mlp/{fc_in,fc_out}/kernel)")

    def build_positions(self, config: GPTConfig, rngs: nnx.Rngs) -> None:
        self.pos_embed = _Embed(config.seq_len, config.d_model, rngs=rngs)

    @property
    def dropout(self) -> float:
        return self.config.dropout

    def embed_positions(self, x_BSD, positions_BS, length):
        """Learned positions, added to the token embeddings (restarting per segment, counted
        from each row's first real token when decoding)."""
        table_SD = self.pos_embed.embedding[...]
        if positions_BS is None:
            return x_BSD + table_SD[:length].astype(x_BSD.dtype)[None], None
        return x_BSD + jnp.take(table_SD, positions_BS, axis=0).astype(x_BSD.dtype), None


GPTConfig.decoder = GPT


# ----------------------------------------------------------------------------------------------
# Functional API: pure parameter dicts in, arrays out (split_params and abstract_split are the
# skeleton's, for every family).


def init_params(config: GPTConfig, policy: Policy | str | None, key: jax.Array) -> dict:
    """Initialises a model's parameters as a plain nested dict (GPT-2 initialisation).

    Jit it with ``static_argnums=(0, 1)`` (and ``out_shardings``) to create sharded parameters
    without materialising them on one device.

    Example:
      >>> import jax
      >>> params = init_params(gpt_config("tiny"), "bf16", jax.random.key(0))
      >>> params["embed"]["embedding"].dtype  # bf16 policy: f32 master parameters
      dtype('float32')
    """
    return config.init_params(key, policy)


def abstract_params(config: GPTConfig, policy: Policy | str | None = None) -> dict:
    """The parameter tree as ``jax.ShapeDtypeStruct`` leaves, without allocating anything.

    Example:
      >>> abstract_params(gpt_config("base"), "pure_bf16")["blocks"]["mlp"]["fc_in"]["kernel"]
      ShapeDtypeStruct(shape=(14, 768, 3072), dtype=bfloat16)
    """
    return config.abstract_params(policy)
