"""A decoder-only GPT in Flax NNX, with scanned layers and fp32 islands.

The model is GPT-2 shaped: token and learned position embeddings, ``n_layers`` pre-LayerNorm
blocks (causal multi-head self-attention, then a GELU MLP), a final LayerNorm, and an output head
tied to the token embedding. The blocks' parameters are stacked along a leading layer axis and
the forward pass runs ``jax.lax.scan`` over them, so compile time does not grow with depth.

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
import functools
import math
import re
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from effijax.errors import ConfigError
from effijax.lora import LoraSpec
from effijax.models._attention import ATTENTION
from effijax.models._blockwise import REMAT_POLICIES
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
from effijax.models._interface import LanguageModel, ModelShape, register_family
from effijax.models._layers import (
    _constrain,
    _Dense,
    _dense,
    _dropout,
    _Embed,
    _run_layers,
    check_call,
    make_apply,
    make_loss_fn,
    segment_positions,
)
from effijax.precision import Policy, get_policy, layer_norm

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

_INIT_STD = 0.02


# ``jax.checkpoint`` policies by ``GPTConfig.remat`` name; "none" means no checkpointing.
REMAT: dict[str, Any] = {
    "none": None,
    "block": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    **REMAT_POLICIES,
}


# ----------------------------------------------------------------------------------------------
# Configuration.


@register_family
@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig(LanguageModel):
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
        (cuDNN's fused kernel on a GPU where it applies, else the best fallback).
      unroll_layers: unroll the loop over the blocks instead of scanning it (see
        :class:`~effijax.models.LlamaConfig`); the same arithmetic.

    Example:
      >>> GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4).head_dim
      8
      >>> GPTConfig(seq_len=16, d_model=30, n_layers=2, n_heads=4)
      Traceback (most recent call last):
      ...
      ValueError: d_model: 30 is not divisible by n_heads=4; pick d_model = n_heads * head_dim
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
    attention: str = "naive"
    unroll_layers: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model: {self.d_model} is not divisible by n_heads={self.n_heads}; "
                "pick d_model = n_heads * head_dim"
            )
        if not isinstance(self.dropout, int | float) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: expected a rate in [0, 1), got {self.dropout!r}")
        if not isinstance(self.ln_eps, int | float) or not self.ln_eps > 0:
            raise ValueError(f"ln_eps: expected a positive float, got {self.ln_eps!r}")
        if self.remat not in REMAT:
            raise ValueError(f"remat: unknown mode {self.remat!r}; choose one of {list(REMAT)}")
        if not isinstance(self.unroll_layers, bool):
            raise ValueError(f"unroll_layers: expected a bool, got {self.unroll_layers!r}")
        if self.attention not in ATTENTION:
            raise ValueError(
                f"attention: unknown implementation {self.attention!r}; "
                f"choose one of {list(ATTENTION)}"
            )
        if self.attention == "xla" and self.dropout > 0:
            raise ValueError(
                f"attention: 'xla' (jax.nn.dot_product_attention) has no attention dropout but "
                f"dropout={self.dropout}; use attention='auto' (it falls back to one with "
                "dropout), 'naive' or 'blockwise', or dropout=0"
            )

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

    # The LanguageModel interface ------------------------------------------------------------

    @property
    def name(self) -> str:
        """The preset's name when the config is one (``"mini GPT"``), else its shape."""
        for preset, config in PRESETS.items():
            if dataclasses.replace(self, seq_len=config.seq_len, unroll_layers=False) == config:
                return f"{preset} GPT"
        return f"GPT d{self.d_model} L{self.n_layers}"

    def with_seq_len(self, seq_len: int) -> GPTConfig:
        """Learned positions: the model is rebuilt with ``seq_len`` rows of the embedding."""
        try:
            return dataclasses.replace(self, seq_len=seq_len)
        except ValueError as e:
            raise ConfigError("seq_len", seq_len, str(e).removeprefix("seq_len: ")) from None

    def abstract_params(self, policy: Policy | str | None = None) -> dict:
        """See :func:`abstract_params`."""
        return abstract_params(self, policy)

    def init_params(self, key: jax.Array, policy: Policy | str | None = None) -> dict:
        """See :func:`init_params`."""
        return init_params(self, policy, key)

    def loss_fn(self, lora: LoraSpec | None = None):
        """See :func:`make_loss_fn`."""
        return make_loss_fn(_graphdef(self), lora)

    def logits_fn(self, lora: LoraSpec | None = None):
        """``logits_fn(params, tokens_BS, segments_BS=None)``: :func:`make_apply` without
        dropout."""
        apply = make_apply(_graphdef(self), lora)
        return lambda params, tokens_BS, segments_BS=None: apply(params, tokens_BS,
                                                                 segments_BS=segments_BS)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
        """An empty :class:`~effijax.models.KVCache` (``max_len <= seq_len``: learned
        positions)."""
        return init_cache(self.n_layers, batch, max_len, self.n_heads, self.head_dim, dtype)

    def decode_fn(self, lora: LoraSpec | None = None):
        """See :func:`effijax.models.make_decode` (cached forward pass, no dropout)."""
        return make_decode(_graphdef(self), lora, stack="blocks")

    def shape(self) -> ModelShape:
        """The numbers of the activation formula (plain multi-head attention, GELU MLP)."""
        return ModelShape(num_params=param_count(self), layers=self.n_layers,
                          hidden=self.d_model, heads=self.n_heads, kv_heads=self.n_heads,
                          head_dim=self.head_dim, ffn=self.d_ff, vocab=self.vocab_size,
                          seq_len=self.seq_len)

    def to_dict(self) -> dict:
        """The fields as a dict with ``family: "gpt"``."""
        return {"family": self.family, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, fields: dict) -> GPTConfig:
        """Rebuilds a config; unknown fields and bad values are :class:`ConfigError`\\ s."""
        known = {f.name for f in dataclasses.fields(cls)}
        for key in fields:
            if key not in known:
                raise ConfigError(f"model_config.{key}", fields[key],
                                  f"not a GPTConfig field; fields are {sorted(known)}")
        try:
            return cls(**fields)
        except (TypeError, ValueError) as e:
            raise ConfigError("model_config", fields, str(e)) from None


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
    if name not in PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}; presets: {', '.join(PRESETS)}")
    try:
        return dataclasses.replace(PRESETS[name], **overrides)
    except TypeError as e:
        fields = [f.name for f in dataclasses.fields(GPTConfig)]
        raise ValueError(f"gpt_config({name!r}): {e}; GPTConfig fields are {fields}") from e


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
# Building blocks (the generic ones are in effijax.models._layers).


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
    return jax.nn.gelu(x), x


def _gelu_bwd(x, g):
    return jax.vjp(jax.nn.gelu, x)[1](g)


_gelu.defvjp(_gelu_fwd, _gelu_bwd)


class _LayerNorm(nnx.Module):
    def __init__(self, d: int, *, eps: float, stack: tuple[int, ...]):
        self.scale = nnx.Param(jnp.ones((*stack, d), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((*stack, d), jnp.float32))
        self.eps = eps

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        return layer_norm(x_BSD, self.scale[...], self.bias[...], self.eps)


class _Attention(nnx.Module):
    def __init__(self, config: GPTConfig, *, out_std: float, stack: tuple[int, ...],
                 rngs: nnx.Rngs):
        d = config.d_model
        self.q = _Dense(d, d, std=_INIT_STD, stack=stack, rngs=rngs)
        self.k = _Dense(d, d, std=_INIT_STD, stack=stack, rngs=rngs)
        self.v = _Dense(d, d, std=_INIT_STD, stack=stack, rngs=rngs)
        self.o = _Dense(d, d, std=out_std, stack=stack, rngs=rngs)
        self.config = config

    def __call__(self, x_BSD: jax.Array, key: jax.Array | None,
                 lora: dict | None = None, cache: tuple | None = None,
                 segments_BS: jax.Array | None = None):
        cfg = self.config
        lora = lora or {}
        b, s, _ = x_BSD.shape
        split = lambda y_BSD: y_BSD.reshape(b, s, cfg.n_heads, cfg.head_dim)
        # One flat input for q, k and v: the backward pass saves each projection's input (for a
        # weight or adapter gradient), and three reshapes of x would be three saved copies.
        x_ND = x_BSD.reshape(b * s, -1)
        q_BSHK = split(self.q(x_ND, lora.get("q")))
        k_BSHK = split(self.k(x_ND, lora.get("k")))
        v_BSHK = split(self.v(x_ND, lora.get("v")))
        if cache is not None:  # decoding (effijax.models._cache): write, then attend to all
            k_BTHK, v_BTHK, start, pad_B = cache
            k_BTHK = write_cache(k_BTHK, k_BSHK, start)
            v_BTHK = write_cache(v_BTHK, v_BSHK, start)
            out_BSHK = cached_attend(q_BSHK, k_BTHK, v_BTHK, start, pad_B)
            return self.o(out_BSHK.reshape(b, s, cfg.d_model), lora.get("o")), (k_BTHK, v_BTHK)
        out_BSHK = ATTENTION[cfg.attention](
            q_BSHK, k_BSHK, v_BSHK, causal=True, dropout_rate=cfg.dropout, dropout_key=key,
            segments_BS=segments_BS,
        )
        return self.o(out_BSHK.reshape(b, s, cfg.d_model), lora.get("o"))


class _MLP(nnx.Module):
    def __init__(self, config: GPTConfig, *, out_std: float, stack: tuple[int, ...],
                 rngs: nnx.Rngs):
        self.fc_in = _Dense(config.d_model, config.d_ff, std=_INIT_STD, stack=stack, rngs=rngs)
        self.fc_out = _Dense(config.d_ff, config.d_model, std=out_std, stack=stack, rngs=rngs)

    def __call__(self, x_BSD: jax.Array, lora: dict | None = None) -> jax.Array:
        lora = lora or {}
        return self.fc_out(_gelu(self.fc_in(x_BSD, lora.get("fc_in"))), lora.get("fc_out"))


class _Block(nnx.Module):
    """One pre-LayerNorm transformer block.

    Constructed once with ``stack=(L,)`` so every parameter carries a leading layer axis; the
    forward pass merges it with one layer's slice of that state at a time (see ``_run_blocks``).
    """

    def __init__(self, config: GPTConfig, *, stack: tuple[int, ...], rngs: nnx.Rngs):
        out_std = _INIT_STD / math.sqrt(2 * config.n_layers)
        self.ln1 = _LayerNorm(config.d_model, eps=config.ln_eps, stack=stack)
        self.attn = _Attention(config, out_std=out_std, stack=stack, rngs=rngs)
        self.ln2 = _LayerNorm(config.d_model, eps=config.ln_eps, stack=stack)
        self.mlp = _MLP(config, out_std=out_std, stack=stack, rngs=rngs)
        self.config = config

    def __call__(self, x_BSD: jax.Array, key: jax.Array | None,
                 lora: dict | None = None, segments_BS: jax.Array | None = None,
                 cache: tuple | None = None):
        """The block's output; with a ``cache`` (``(k_BTHK, v_BTHK, start, pad_B)``, decoding,
        no dropout) also the cache slices with this step's keys and values written.
        ``segments_BS`` (packed rows) keeps attention within each segment."""
        rate = self.config.dropout
        lora = lora or {}
        if cache is not None:
            attn_BSD, kv = self.attn(self.ln1(x_BSD), None, lora.get("attn"), cache)
            x_BSD = x_BSD + attn_BSD
            return x_BSD + self.mlp(self.ln2(x_BSD), lora.get("mlp")), kv
        k_attn, k_res1, k_res2 = (None,) * 3 if key is None else tuple(jax.random.split(key, 3))
        attn_BSD = self.attn(self.ln1(x_BSD), k_attn, lora.get("attn"), segments_BS=segments_BS)
        x_BSD = x_BSD + _dropout(attn_BSD, rate, k_res1)
        x_BSD = x_BSD + _dropout(self.mlp(self.ln2(x_BSD), lora.get("mlp")), rate, k_res2)
        return x_BSD


# ----------------------------------------------------------------------------------------------
# The model.


# The kernels the factored LoRA apply can adapt: those of the blocks' ``_Dense`` layers.
_ADAPTABLE = re.compile(r"^blocks/(attn/[qkvo]|mlp/fc_(in|out))/kernel$")


class GPT(nnx.Module):
    """Decoder-only transformer with tied embeddings and scanned, stacked blocks.

    Args:
      config: the architecture.
      policy: precision policy (default fp32). Parameters are created in ``policy.param_dtype``
        (honouring ``policy.overrides``); logits are returned in ``policy.output_dtype``.
      rngs: ``nnx.Rngs`` for initialisation (the ``params`` stream, or ``default``).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> model = GPT(gpt_config("tiny"), rngs=nnx.Rngs(0))
      >>> model(jnp.zeros((2, 8), jnp.int32)).shape
      (2, 8, 256)
    """

    def __init__(self, config: GPTConfig, *, policy: Policy | str | None = None,
                 rngs: nnx.Rngs):
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config: expected a GPTConfig, got {type(config).__name__}")
        policy = get_policy("fp32" if policy is None else policy)
        self.config = config
        self.policy = policy
        self.embed = _Embed(config.vocab_size, config.d_model, rngs=rngs)
        self.pos_embed = _Embed(config.seq_len, config.d_model, rngs=rngs)
        self.blocks = _Block(config, stack=(config.n_layers,), rngs=rngs)
        self.ln_f = _LayerNorm(config.d_model, eps=config.ln_eps, stack=())
        # Created in f32 (same values for every policy), then stored in the policy's dtypes.
        state = nnx.state(self, nnx.Param)
        nnx.replace_by_pure_dict(state, policy.cast_to_param(nnx.to_pure_dict(state)))
        nnx.update(self, state)

    def __call__(self, tokens_BS: jax.Array, *, deterministic: bool = True,
                 rngs: nnx.Rngs | jax.Array | None = None, adapters: dict | None = None,
                 lora: LoraSpec | None = None, segments_BS: jax.Array | None = None
                 ) -> jax.Array:
        """Returns next-token logits ``[B, S, V]`` in ``policy.output_dtype``.

        Args:
          tokens_BS: integer token ids, ``S <= config.seq_len``.
          deterministic: when False and ``config.dropout > 0`` (or ``lora.dropout > 0``),
            dropout is applied.
          rngs: where dropout keys come from: an ``nnx.Rngs`` (its ``dropout`` stream) or a raw
            ``jax.random`` key (what a functional train step passes, one per step).
          adapters: LoRA adapters for this model's parameters (:func:`effijax.lora.init`), in
            the dtype to compute them in; only the blocks' dense kernels can be adapted here.
          lora: the :class:`~effijax.lora.LoraSpec` of ``adapters`` (static: scales, dropout).
          segments_BS: packed rows' integer segment ids ``[B, S]`` (one id per example, another
            for padding): attention stays within a segment and positions restart at each
            segment's start. None: one sequence per row.
        """
        cfg = self.config
        check_call(self, tokens_BS, adapters, lora, adaptable=_ADAPTABLE,
                   adaptable_text="the GPT's factored LoRA adapts the blocks' dense kernels only "
                   "(blocks/attn/{q,k,v,o}/kernel, blocks/mlp/{fc_in,fc_out}/kernel)",
                   segments_BS=segments_BS)
        s = tokens_BS.shape[1]
        if s > cfg.seq_len:
            raise ValueError(f"tokens_BS: sequence length {s} exceeds config.seq_len={cfg.seq_len}")
        key = None
        lora_dropout = lora is not None and lora.dropout > 0
        if not deterministic and (cfg.dropout > 0 or lora_dropout):
            if rngs is None:
                raise ValueError(
                    "dropout is on (deterministic=False, config.dropout > 0 or lora.dropout > 0) "
                    "but no rngs were given; pass rngs=nnx.Rngs(dropout=...) or a jax.random key"
                )
            key = rngs.dropout() if isinstance(rngs, nnx.Rngs) else rngs

        embedding_VD = self.embed.embedding[...]
        x_BSD = jnp.take(embedding_VD, tokens_BS, axis=0)
        if segments_BS is None:
            x_BSD = x_BSD + self.pos_embed.embedding[...][:s].astype(x_BSD.dtype)[None]
        else:
            pos_BSD = jnp.take(self.pos_embed.embedding[...], segment_positions(segments_BS),
                               axis=0)
            x_BSD = x_BSD + pos_BSD.astype(x_BSD.dtype)
        x_BSD = _constrain(x_BSD)

        graphdef, stacked = nnx.split(self.blocks)
        keys_L = None if key is None else jax.random.split(key, cfg.n_layers)
        block_adapters = None if adapters is None else adapters.get("blocks")
        consts = () if segments_BS is None else (segments_BS,)
        x_BSD = _run_layers(x_BSD, stacked, keys_L, block_adapters, consts, graphdef=graphdef,
                            remat=REMAT[cfg.remat], lora=None if block_adapters is None else lora,
                            path="blocks", unroll=cfg.unroll_layers)

        return self._head(x_BSD)

    def decode(self, tokens_BS: jax.Array, cache: KVCache, start: jax.Array, *,
               last: jax.Array | None = None, adapters: dict | None = None,
               lora: LoraSpec | None = None, layers: tuple | None = None
               ) -> tuple[jax.Array, KVCache]:
        """The cached forward pass of ``tokens_BS`` at slots ``start .. start + S - 1`` (each
        row's learned positions counted from its first real token, see ``cache.pad_B``):
        ``(logits, cache)``, see :func:`effijax.models.make_decode`."""
        cfg = self.config
        check_call(self, tokens_BS, adapters, lora, adaptable=_ADAPTABLE,
                   adaptable_text="the GPT's factored LoRA adapts the blocks' dense kernels only")
        s, t = tokens_BS.shape[1], cache.max_len
        if t > cfg.seq_len or s > t:
            raise ValueError(f"cache of {t} positions for {s} tokens: need tokens <= cache <= "
                             f"config.seq_len={cfg.seq_len} (learned positions)")
        start = jnp.asarray(start, jnp.int32)
        x_BSD = jnp.take(self.embed.embedding[...], tokens_BS, axis=0)
        pos_BSD = jnp.take(self.pos_embed.embedding[...], row_positions(cache, start, s), axis=0)
        x_BSD = _constrain(x_BSD + pos_BSD.astype(x_BSD.dtype))
        graphdef, stacked = nnx.split(self.blocks)
        block_adapters = None if adapters is None else adapters.get("blocks")
        x_BSD, cache = run_layers_cached(x_BSD, stacked, cache, start, block_adapters,
                                         graphdef=graphdef,
                                         lora=None if block_adapters is None else lora,
                                         path="blocks", layers=layers)
        return self._head(select_last(x_BSD, last)), cache

    def _head(self, x_BSD: jax.Array) -> jax.Array:
        """Final LayerNorm and the tied head (the token embedding, used transposed)."""
        x_BSD = self.ln_f(x_BSD)
        logits_BSV = _dense(x_BSD, self.embed.embedding[...].T, None)
        return logits_BSV.astype(self.policy.output_dtype)


# ----------------------------------------------------------------------------------------------
# Functional API: pure parameter dicts in, arrays out.


def split_params(model: GPT) -> tuple[nnx.GraphDef, dict]:
    """Splits a model into its static ``graphdef`` and its parameters as a plain nested dict.

    The dict's '/'-joined paths are ``embed/embedding``, ``blocks/attn/q/kernel``, ...;
    ``nnx.merge(graphdef, params)`` rebuilds the model.

    Example:
      >>> from flax import nnx
      >>> graphdef, params = split_params(GPT(gpt_config("tiny"), rngs=nnx.Rngs(0)))
      >>> params["blocks"]["attn"]["q"]["kernel"].shape
      (2, 64, 64)
    """
    graphdef, state = nnx.split(model, nnx.Param)
    return graphdef, nnx.to_pure_dict(state)


@functools.lru_cache(maxsize=32)
def _graphdef(config: GPTConfig) -> nnx.GraphDef:
    """The model's static structure (policy-independent: dtypes live in the parameters)."""
    return abstract_split(config)[0]


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
    model = GPT(config, policy=policy, rngs=nnx.Rngs(params=key))
    return split_params(model)[1]


def abstract_params(config: GPTConfig, policy: Policy | str | None = None) -> dict:
    """The parameter tree as ``jax.ShapeDtypeStruct`` leaves, without allocating anything.

    Example:
      >>> abstract_params(gpt_config("base"), "pure_bf16")["blocks"]["mlp"]["fc_in"]["kernel"]
      ShapeDtypeStruct(shape=(14, 768, 3072), dtype=bfloat16)
    """
    return jax.eval_shape(lambda key: init_params(config, policy, key), jax.random.key(0))


def abstract_split(config: GPTConfig, policy: Policy | str | None = None
                   ) -> tuple[nnx.GraphDef, dict]:
    """``(graphdef, abstract params)`` of a model, without allocating any parameter.

    The graphdef is what :func:`make_apply` and :func:`make_loss_fn` need; pair it with
    :func:`init_params` (or restored parameters) to run the model functionally.

    Example:
      >>> graphdef, params = abstract_split(gpt_config("tiny"))
      >>> params["ln_f"]["scale"]
      ShapeDtypeStruct(shape=(64,), dtype=float32)
    """
    model = nnx.eval_shape(lambda: GPT(config, policy=policy, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model, nnx.Param)
    return graphdef, nnx.to_pure_dict(state)
