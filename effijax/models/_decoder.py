"""The decoder skeleton every model family shares: config plumbing, the module, the forward
and decode passes, and one self-attention.

A family is a frozen config (a :class:`DecoderConfig`), a :class:`Decoder` subclass and its
layer (one module constructed with a leading stack axis ``L`` and scanned). The skeleton does
what every family does the same way: the parameters are created in f32 and cast to the policy's
param dtypes; a forward pass checks its inputs before tracing (one error type,
:class:`~effijax.errors.ConfigError`), takes the dropout key, embeds the tokens, runs the
scanned layer stack (``remat``, ``unroll_layers``, LoRA hooks per layer), and ends in the final
norm and the (tied or separate) output head, whose logits are cast to ``policy.output_dtype``;
the cached decode pass is the same with the layers reading and writing a :class:`KVCache`;
``loss_fn``, ``logits_fn``, ``decode_fn``, ``init_cache``, ``init_params`` and
``abstract_params`` are written once on :class:`DecoderConfig`.

How to add a family (say Gemma 3, Qwen2 or Mistral), in a file of its own:

1. The config: a ``@register_family`` frozen, keyword-only dataclass subclassing
   :class:`DecoderConfig` with the fields ``vocab_size``, ``d_model``, ``n_layers``,
   ``seq_len``, ``remat``, ``attention``, ``unroll_layers`` plus its own; ``family``,
   ``lora_targets`` and ``presets`` class attributes; its ``__post_init__`` calls
   :func:`check_run_choices`; ``name``, ``shape()`` and ``context_field`` (the field that
   bounds a sequence) complete it. Set ``Config.decoder = Module`` after the module's class.
2. The layer: a :class:`PreNormBlock` subclass (or any module with its call contract,
   ``layer(x_BSD, key, hooks, inputs: LayerInputs, cache=None)``) that builds, with
   ``stack=(L,)``, its two norms (``norms``; Gemma 3's post-norms go in ``post_norms``), its
   ``attn`` (an :class:`Attention`, or a subclass: ``rotate`` applies rotary embeddings, see
   :class:`~effijax.models._rotary.RotaryAttention`; Gemma's q/k RMSNorm goes there too) and
   its ``mlp`` (GELU, SwiGLU, GeGLU: the family's own module); its ``norm`` builds its norms
   (LayerNorm, RMSNorm, Gemma's ``(1 + w)`` RMSNorm) and the final one.
   :class:`AttentionSpec` carries the projections' names, their biases (Qwen2's q/k/v
   biases), head counts and a head width independent of ``d_model / heads`` (Gemma 3).
3. The module: a :class:`Decoder` subclass with ``layer_type`` and :class:`WeightNames` (the
   stack's and the final norm's attribute names, the adaptable kernels); hooks:
   ``architecture``, ``build_positions``, ``embed_positions`` (learned positions, rotary
   tables, Gemma's ``sqrt(d_model)`` embedding scale), ``tied``, ``dropout`` and, for logit
   soft-capping, an override of ``head``. ``LayerInputs.positions`` is the family's own pytree
   (Gemma 3: both rotary tables, local and global). Sliding windows: the config's
   ``layer_windows`` (one entry per layer, None for global attention; by default its
   ``sliding_window``, if it has one, for every layer) reaches the attention as
   ``LayerInputs.window`` and sizes the KV cache's rings, see
   :attr:`DecoderConfig.layer_windows`. A per-layer pattern of other static choices (Gemma 3's two
   rotary bases) is the family's: it can key them off the same window.
4. Weight names: parameter paths are the module attribute names (``layers/attn/q_proj/kernel``);
   a family with pretrained files registers a :class:`~effijax.models.PretrainedFormat` (its
   ``model_type``, tensor names, ``config.json`` checks) that :mod:`effijax.interop` reads and
   writes (``_qwen2.py``: the Llama's layer with q/k/v biases, presets and format).

Shape suffixes: ``B`` batch, ``S`` sequence, ``T`` cached positions, ``D`` model width, ``H``
query heads, ``G`` key/value heads, ``K`` head width, ``V`` vocabulary, ``L`` layers.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from effijax.errors import NO_VALUE, ConfigError
from effijax.lora import LoraSpec
from effijax.models._attention import ATTENTION, _context_degree, _context_parallel_attend
from effijax.models._blockwise import REMAT_POLICIES
from effijax.models._cache import (
    KVCache,
    attend_layer,
    check_windows,
    init_cache,
    make_decode,
    row_positions,
    run_layers_cached,
    select_last,
)
from effijax.models._dense import token_rows
from effijax.models._head import head_cross_entropy, head_logits
from effijax.models._interface import LanguageModel
from effijax.models._layers import (
    INIT_STD,
    _constrain,
    _Dense,
    _dropout,
    _Embed,
    _run_layers,
    check_call,
    make_apply,
    make_loss_fn,
    segment_positions,
)
from effijax.models._ring import from_load_balanced, to_load_balanced
from effijax.models._tensor_roles import attention_roles, tensor_layout
from effijax.precision import Policy, get_policy

__all__ = [
    "REMAT",
    "Attention",
    "AttentionSpec",
    "Decoder",
    "DecoderConfig",
    "LayerInputs",
    "PreNormBlock",
    "WeightNames",
    "abstract_split",
    "check_run_choices",
    "preset_config",
    "split_params",
]


# ``jax.checkpoint`` policies by a config's ``remat`` name; "none" means no checkpointing.
REMAT: dict[str, Any] = {
    "none": None,
    "block": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    **REMAT_POLICIES,
}


# ----------------------------------------------------------------------------------------------
# The config side.


def check_run_choices(config) -> None:
    """The checks of the run's choices every family has: ``remat``, ``attention`` and
    ``unroll_layers``.

    Example:
      >>> from types import SimpleNamespace
      >>> check_run_choices(SimpleNamespace(remat="all", attention="naive", unroll_layers=False))
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: remat='all': unknown mode; choose one of ['none', 'block', ...
    """
    if config.remat not in REMAT:
        raise ConfigError("remat", config.remat, f"unknown mode; choose one of {list(REMAT)}")
    if config.attention not in ATTENTION:
        raise ConfigError("attention", config.attention,
                          f"unknown implementation; choose one of {list(ATTENTION)}")
    if not isinstance(config.unroll_layers, bool):
        raise ConfigError("unroll_layers", config.unroll_layers, "expected a bool")


def preset_config(cls: type, name: str, overrides: dict):
    """``cls.presets[name]`` with fields replaced by ``overrides``; unknown names are
    :class:`ConfigError`\\ s that list the choices.

    Example:
      >>> from effijax.models import GPTConfig
      >>> preset_config(GPTConfig, "tiny", {"n_layers": 3}).n_layers
      3
      >>> preset_config(GPTConfig, "tiny", {"width": 3})
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: width=3: not a GPTConfig field; GPTConfig fields are [...
    """
    if name not in cls.presets:
        raise ConfigError("name", name, f"unknown {cls.family} preset; presets: "
                          f"{', '.join(cls.presets)}")
    known = {f.name for f in dataclasses.fields(cls)}
    for key in overrides:
        if key not in known:
            raise ConfigError(key, overrides[key], f"not a {cls.__name__} field; "
                              f"{cls.__name__} fields are {sorted(known)}")
    return dataclasses.replace(cls.presets[name], **overrides)


def _architecture_fields(cls: type) -> set[str]:
    """The fields that are the model (those that take part in equality: not a tokenizer)."""
    return {f.name for f in dataclasses.fields(cls) if f.compare}


class DecoderConfig(LanguageModel):
    """The :class:`~effijax.models.LanguageModel` methods every decoder family shares.

    A family's config subclasses it and sets ``decoder`` (its :class:`Decoder` subclass) once
    that class exists; ``context_field`` names the field that bounds a sequence (learned
    positions: ``seq_len``; rotary ones: ``max_position``).
    """

    decoder: ClassVar[type]
    # The field that bounds a sequence: ``seq_len`` (learned positions), ``max_position``.
    context_field: ClassVar[str] = "seq_len"

    @property
    def max_context(self) -> int:
        """The longest sequence (or cache) the model takes: its ``context_field``."""
        return getattr(self, self.context_field)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding attention window, None for global attention: query ``i`` sees
        keys ``i - w < j <= i`` (Hugging Face's ``sliding_window`` convention). By default the
        config's ``sliding_window`` (Mistral), if it has one, for every layer; a family with a
        pattern overrides it (Gemma 3: ``w`` for five layers of six, None for the sixth).

        How it reaches a scanned stack (``Decoder._windows``): equal windows stay a Python int
        (or None) in ``LayerInputs.window``, so the kernels see a static window (cuDNN's and
        XLA's window, the blockwise tiles' skipping); windows that differ are scanned as an int32
        ``[L]`` array with the parameters, global layers getting ``max_context`` (a window
        longer than any sequence is none), so one traced layer body serves every layer: the
        masks and the blockwise loop bounds are built from the traced value (cuDNN's static
        window is then unavailable; "auto" says so on a GPU). Grouping the layers by window
        into several scans would keep it static at the price of one compiled body per run of
        equal layers. Decoding does group them (one body per kind of layer, see
        :mod:`effijax.models._cache`): its local layers keep a ring of ``window`` slots
        (:meth:`init_cache`).

        Example:
          >>> from effijax.models import mistral_config
          >>> mistral_config("mistral-tiny").layer_windows
          (8, 8)
        """
        return (getattr(self, "sliding_window", None),) * self.n_layers

    def with_seq_len(self, seq_len: int):
        """The same architecture trained on windows of ``seq_len`` tokens."""
        return dataclasses.replace(self, seq_len=seq_len)

    def abstract_params(self, policy: Policy | str | None = None) -> dict:
        """The parameter tree as ``jax.ShapeDtypeStruct`` leaves, in the policy's param dtypes
        (nothing allocated).

        Example:
          >>> from effijax.models import llama_config
          >>> llama_config("smollm2-135m").abstract_params()["layers"]["attn"]["k_proj"]
          {'kernel': ShapeDtypeStruct(shape=(30, 576, 192), dtype=float32)}
        """
        return abstract_split(self, policy)[1]

    def init_params(self, key: jax.Array, policy: Policy | str | None = None) -> dict:
        """Fresh parameters (normal(0.02) matrices, unit norm scales, zero biases) as a plain
        nested dict; jit it with ``static_argnums`` and ``out_shardings`` to create them
        sharded."""
        return split_params(self.decoder(self, policy=policy, rngs=nnx.Rngs(params=key)))[1]

    def loss_fn(self, lora: LoraSpec | None = None, *, sequence_parallel: bool = True,
                frozen_base: bool = False):
        """See :func:`effijax.models.make_loss_fn` (masked mean cross-entropy in f32)."""
        return make_loss_fn(_graphdef(self), lora, sequence_parallel=sequence_parallel,
                            frozen_base=frozen_base)

    def logits_fn(self, lora: LoraSpec | None = None):
        """``logits_fn(params, tokens_BS, segments_BS=None) -> logits_BSV`` in the policy's
        output dtype: :func:`effijax.models.make_apply` without dropout."""
        apply = make_apply(_graphdef(self), lora)
        return lambda params, tokens_BS, segments_BS=None: apply(params, tokens_BS,
                                                                 segments_BS=segments_BS)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
        """An empty :class:`~effijax.models.KVCache`: ``kv_heads`` keys per position, for
        ``max_len <= max_context`` positions in the global layers and a ring of ``window``
        slots in each layer whose window is shorter (:attr:`layer_windows`).

        Example:
          >>> from effijax.models import gemma3_config
          >>> cache = gemma3_config("gemma3-tiny").init_cache(1, 64)  # windows (8, 8, None, 8)
          >>> cache.k_LBTGK.shape, cache.k_LBWGK.shape
          ((1, 1, 64, 2, 32), (3, 1, 8, 2, 32))
        """
        shape = self.shape()
        return init_cache(shape.layers, batch, max_len, shape.kv_heads, shape.head_dim, dtype,
                          windows=self.layer_windows)

    def decode_fn(self, lora: LoraSpec | None = None):
        """See :func:`effijax.models.make_decode` (cached forward pass, no dropout)."""
        return make_decode(_graphdef(self), lora, stack=self.decoder.names.stack)

    def tensor_layout(self):
        """Megatron's layout over the ``tensor`` axis, from the modules' ``tensor_roles`` (see
        :mod:`effijax.models._tensor_roles`).

        Example:
          >>> from effijax.models import gpt_config
          >>> gpt_config("tiny").tensor_layout().names_of("blocks/mlp/fc_out/kernel")
          ('layers', 'mlp', 'embed')
        """
        graphdef, abstract = abstract_split(self)
        return tensor_layout(self, graphdef, abstract,
                             tied="lm_head" not in abstract)

    def to_dict(self) -> dict:
        """The architecture as a dict with ``family`` (no tokenizer)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare}
        return {"family": self.family, **fields}

    @classmethod
    def from_dict(cls, fields: dict):
        """Rebuilds a config from :meth:`to_dict`'s output; unknown fields and bad values are
        :class:`ConfigError`\\ s."""
        known = _architecture_fields(cls)
        for key in fields:
            if key not in known:
                raise ConfigError(f"model_config.{key}", fields[key],
                                  f"not a {cls.__name__} field; fields are {sorted(known)}")
        try:
            return cls(**fields)
        except TypeError as e:
            raise ConfigError("model_config", fields, str(e)) from None


def split_params(model: nnx.Module) -> tuple[nnx.GraphDef, dict]:
    """Splits a model into its static ``graphdef`` and its parameters as a plain nested dict.

    The dict's '/'-joined paths are ``embed/embedding``, ``blocks/attn/q/kernel``, ...;
    ``nnx.merge(graphdef, params)`` rebuilds the model.

    Example:
      >>> from flax import nnx
      >>> from effijax.models import GPT, gpt_config
      >>> graphdef, params = split_params(GPT(gpt_config("tiny"), rngs=nnx.Rngs(0)))
      >>> params["blocks"]["attn"]["q"]["kernel"].shape
      (2, 64, 64)
    """
    graphdef, state = nnx.split(model, nnx.Param)
    return graphdef, nnx.to_pure_dict(state)


@functools.lru_cache(maxsize=32)
def _abstract_split(config: DecoderConfig, policy: Policy) -> tuple[nnx.GraphDef, dict]:
    return split_params(nnx.eval_shape(lambda: config.decoder(config, policy=policy,
                                                             rngs=nnx.Rngs(0))))


def abstract_split(config: DecoderConfig, policy: Policy | str | None = None
                   ) -> tuple[nnx.GraphDef, dict]:
    """``(graphdef, abstract params)`` of a model, without allocating any parameter.

    The graphdef is what :func:`~effijax.models.make_apply` and
    :func:`~effijax.models.make_loss_fn` need; pair it with ``config.init_params`` (or
    restored parameters) to run the model functionally. The dicts are fresh on every call.

    Example:
      >>> from effijax.models import gpt_config
      >>> graphdef, params = abstract_split(gpt_config("tiny"))
      >>> params["ln_f"]["scale"]
      ShapeDtypeStruct(shape=(64,), dtype=float32)
    """
    graphdef, abstract = _abstract_split(config, get_policy("fp32" if policy is None else policy))
    return graphdef, jax.tree.map(lambda leaf: leaf, abstract)  # the cache's dicts stay intact


def _graphdef(config: DecoderConfig) -> nnx.GraphDef:
    """The static structure (policy-independent: dtypes live in the parameters)."""
    return _abstract_split(config, get_policy("fp32"))[0]


# ----------------------------------------------------------------------------------------------
# Attention and the pre-norm block.


def _balanced(seq_len: int) -> int:
    """The context degree ``n`` a trunk pass of ``seq_len`` tokens runs load-balanced over: the
    ``context`` axis of the mesh set by ``jax.set_mesh`` when ``2n`` divides ``seq_len``
    (the tokens then go through the layers in :func:`~effijax.models.to_load_balanced` order
    and the attention is ring attention on it); 1 otherwise (natural order). One rule for the
    trunk, which permutes, and the attention, which must know."""
    n = _context_degree()
    return n if n > 1 and seq_len % (2 * n) == 0 else 1


class LayerInputs(NamedTuple):
    """What every layer of a pass receives besides the residual stream: ``positions``, the
    family's position pytree (rotary ``(cos, sin)`` tables; None for learned positions, added
    before the layers), ``segments_BS`` (packed rows, or None) and ``window``, the layer's
    sliding attention window (an int shared by every layer, the layer's own int32 scalar
    when the windows differ, or None: global attention)."""

    positions: Any = None
    segments_BS: jax.Array | None = None
    window: int | jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The static shape of one self-attention: widths, heads, the implementation's name in
    :data:`~effijax.models.ATTENTION`, the attention dropout rate, and the four projections'
    attribute names (their parameter paths) and biases."""

    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    implementation: str
    dropout: float = 0.0
    names: tuple[str, str, str, str] = ("q", "k", "v", "o")
    bias: tuple[bool, bool, bool, bool] = (False, False, False, False)


class Attention(nnx.Module):
    """Causal self-attention with ``heads`` query and ``kv_heads`` key/value heads (GQA).

    The q, k, v, o projections are ``_Dense`` layers named by ``spec.names``; ``rotate`` is the
    hook for position-dependent transforms of queries and keys (identity here). With a
    ``cache`` (a :class:`~effijax.models._cache.LayerCache`, decoding) this step's keys and
    values are written into the layer's part of the cache, the queries attend to the keys
    their window reaches, and the updated cache comes back with the output.
    """

    def __init__(self, spec: AttentionSpec, *, std: float, out_std: float,
                 stack: tuple[int, ...], rngs: nnx.Rngs):
        q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
        shapes = ((spec.d_model, q), (spec.d_model, kv), (spec.d_model, kv), (q, spec.d_model))
        for name, (d_in, d_out), bias, init in zip(spec.names, shapes, spec.bias,
                                                   (std, std, std, out_std), strict=True):
            setattr(self, name, _Dense(d_in, d_out, std=init, stack=stack, rngs=rngs, bias=bias))
        self.spec = spec

    @property
    def tensor_roles(self) -> dict[str, tuple[str, str]]:
        """q/k/v column-parallel, o row-parallel (see :mod:`effijax.models._tensor_roles`)."""
        return attention_roles(self.spec.names)

    def rotate(self, q_BSHK: jax.Array, k_BSGK: jax.Array, positions) -> tuple:
        """Queries and keys after the family's position transform (none here)."""
        del positions
        return q_BSHK, k_BSGK

    def __call__(self, x_BSD: jax.Array, key: jax.Array | None, lora: dict | None,
                 inputs: LayerInputs, cache: tuple | None = None):
        spec, lora = self.spec, lora or {}
        q_proj, k_proj, v_proj, o_proj = (getattr(self, name) for name in spec.names)
        q_lora, k_lora, v_lora, o_lora = (lora.get(name) for name in spec.names)
        b, s, _ = x_BSD.shape
        # One flat input for q, k and v: the backward pass saves each projection's input (for a
        # weight or adapter gradient), and three reshapes of x would be three saved copies.
        # (x itself on a context mesh: flattening gathered the sequence there, token_rows.)
        x_ND = token_rows(x_BSD)
        q_BSHK = q_proj(x_ND, q_lora).reshape(b, s, spec.heads, spec.head_dim)
        k_BSGK = k_proj(x_ND, k_lora).reshape(b, s, spec.kv_heads, spec.head_dim)
        v_BSGK = v_proj(x_ND, v_lora).reshape(b, s, spec.kv_heads, spec.head_dim)
        q_BSHK, k_BSGK = self.rotate(q_BSHK, k_BSGK, inputs.positions)
        if cache is None:
            # The trunk's passes: in the load-balanced order on a context mesh (_balanced).
            attention = (functools.partial(_context_parallel_attend, load_balanced=True)
                         if _balanced(s) > 1 else ATTENTION[spec.implementation])
            out_BSHK = attention(
                q_BSHK, k_BSGK, v_BSGK, causal=True, dropout_rate=spec.dropout,
                dropout_key=key, segments_BS=inputs.segments_BS, window=inputs.window)
            return o_proj(out_BSHK.reshape(b, s, -1), o_lora)
        # Decoding (effijax.models._cache): write this step's keys and values, attend.
        out_BSHK, cache = attend_layer(cache, q_BSHK, k_BSGK, v_BSGK, inputs.window)
        return o_proj(out_BSHK.reshape(b, s, -1), o_lora), cache


class PreNormBlock(nnx.Module):
    """One pre-norm layer: ``x + drop(attn(norm(x)))``, then ``x + drop(mlp(norm(x)))``.

    A family's layer subclasses it: its constructor builds ``attn`` and ``mlp`` (the LoRA
    adapters' subtrees are looked up under those names) and its two norms
    (:meth:`build_norms`, under its ``norm_names``); ``dropout`` is the residual (and
    attention) dropout rate.
    ``post_norms`` (Gemma 3) normalise each branch's output before the residual sum.
    """

    # The attributes (parameter paths) of the norms before the attention and before the MLP.
    norm_names: ClassVar[tuple[str, str]]
    dropout: float = 0.0

    @staticmethod
    def norm(config, *, stack: tuple[int, ...]) -> nnx.Module:
        """The family's norm (with a leading ``stack`` shape); the final norm is one too."""
        raise NotImplementedError

    def build_norms(self, config, stack: tuple[int, ...]) -> None:
        """Creates the two norms under ``norm_names`` (no random draws: unit scales)."""
        for name in self.norm_names:
            setattr(self, name, self.norm(config, stack=stack))

    @property
    def norms(self) -> tuple[nnx.Module, nnx.Module]:
        """The norms before the attention and before the MLP."""
        return tuple(getattr(self, name) for name in self.norm_names)

    @property
    def post_norms(self) -> tuple[Any, Any]:
        """Norms of the attention's and the MLP's outputs, or None (most families)."""
        return None, None

    def __call__(self, x_BSD: jax.Array, key: jax.Array | None, lora: dict | None,
                 inputs: LayerInputs, cache: tuple | None = None,
                 window: jax.Array | None = None, sequence_parallel: bool = False):
        """The layer's output; with a ``cache`` (decoding, no dropout) also the cache with
        this step's keys and values written. ``window``: this layer's window (its slice of the
        scanned per-layer windows, or its own int when decoding; it replaces
        ``inputs.window``). Without a cache the two
        norms' outputs and the residual sum between the attention and the MLP are pinned by
        ``_constrain`` (split along the sequence with ``sequence_parallel``); the layer's
        output is pinned by its caller."""
        if window is not None:
            inputs = inputs._replace(window=window)
        lora, rate = lora or {}, self.dropout
        (attn_norm, mlp_norm), (attn_post, mlp_post) = self.norms, self.post_norms
        # LoRA dropout alone also brings a key; the model's own dropout splits it only if on.
        keys = (None,) * 3 if key is None or rate == 0.0 else tuple(jax.random.split(key, 3))
        # Training: the norms' outputs and the residual sum between attention and MLP are
        # pinned like the layer's input and output (split along the sequence with
        # sequence_parallel: the norm region of Korthikanti et al.); generation's steps are not.
        pin = ((lambda y: y) if cache is not None else
               functools.partial(_constrain, sequence_parallel=sequence_parallel))
        attn = self.attn(pin(attn_norm(x_BSD)), keys[0], lora.get("attn"), inputs, cache)
        attn_BSD, kv = (attn, None) if cache is None else attn
        x_BSD = pin(x_BSD + _dropout(_maybe(attn_post, attn_BSD), rate, keys[1]))
        mlp_BSD = self.mlp(pin(mlp_norm(x_BSD)), lora.get("mlp"))
        x_BSD = x_BSD + _dropout(_maybe(mlp_post, mlp_BSD), rate, keys[2])
        return x_BSD if cache is None else (x_BSD, kv)


def _maybe(norm, x_BSD: jax.Array) -> jax.Array:
    return x_BSD if norm is None else norm(x_BSD)


# ----------------------------------------------------------------------------------------------
# The module.


class WeightNames(NamedTuple):
    """A family's attribute names the skeleton reaches for, and what LoRA may adapt.

    Attributes:
      stack: the scanned layer stack (``"blocks"``, ``"layers"``): the parameters' subtree.
      final_norm: the norm before the output head.
      adaptable: a regex matched against whole '/'-joined paths: the kernels the factored
        LoRA adapts.
      adaptable_text: those kernels in words, for the error that names a wrong target.
    """

    stack: str
    final_norm: str
    adaptable: str
    adaptable_text: str


class Decoder(nnx.Module):
    """The decoder every family is: embedding, scanned layers, final norm, output head.

    Args:
      config: the architecture: a config whose ``decoder`` is this class.
      policy: precision policy (default fp32): parameters are created in f32 and stored in its
        param dtypes (honouring ``policy.overrides``); logits come out in ``output_dtype``.
      rngs: ``nnx.Rngs`` for initialisation (the ``params`` stream, or ``default``).
    """

    layer_type: ClassVar[type]
    names: ClassVar[WeightNames]

    def __init__(self, config, *, policy: Policy | str | None = None, rngs: nnx.Rngs):
        if getattr(type(config), "decoder", None) is not type(self):
            raise TypeError(f"config: expected the config of a {type(self).__name__}, got "
                            f"{type(config).__name__}")
        config = self.architecture(config)
        policy = get_policy("fp32" if policy is None else policy)
        self.config = config
        self.policy = policy
        # Creation order is the order the ``params`` stream is drawn in: embedding, the
        # family's position parameters, the stack, the final norm, the untied head.
        self.embed = _Embed(config.vocab_size, config.d_model, rngs=rngs)
        self.build_positions(config, rngs)
        setattr(self, self.names.stack,
                self.layer_type(config, stack=(config.n_layers,), rngs=rngs))
        setattr(self, self.names.final_norm, self.layer_type.norm(config, stack=()))
        if not self.tied:
            self.lm_head = _Dense(config.d_model, config.vocab_size, std=INIT_STD, stack=(),
                                  rngs=rngs, bias=False)
        # Created in f32 (same values for every policy), then stored in the policy's dtypes.
        state = nnx.state(self, nnx.Param)
        nnx.replace_by_pure_dict(state, policy.cast_to_param(nnx.to_pure_dict(state)))
        nnx.update(self, state)

    # Family hooks ---------------------------------------------------------------------------

    @classmethod
    def architecture(cls, config):
        """The config the module keeps (e.g. without a tokenizer)."""
        return config

    def build_positions(self, config, rngs: nnx.Rngs) -> None:
        """Creates the family's position parameters (learned embeddings), if any."""

    @property
    def tied(self) -> bool:
        """The output head is the token embedding, transposed (no ``lm_head``)."""
        return True

    @property
    def dropout(self) -> float:
        """The model's own dropout rate (LoRA's is the spec's)."""
        return 0.0

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """The config's :attr:`DecoderConfig.layer_windows`, checked: one int ``>= 1`` or None
        per layer."""
        return check_windows(self.config.layer_windows, self.config.n_layers)

    def _windows(self) -> tuple[int | None, jax.Array | None]:
        """``(window for every layer, None)`` when the layers' windows are equal, else
        ``(None, windows_L)``, int32 ``[L]`` (see :attr:`DecoderConfig.layer_windows`)."""
        windows = self.layer_windows
        if len(set(windows)) == 1:
            return windows[0], None
        glob = self.config.max_context
        return None, jnp.array([glob if w is None else min(w, glob) for w in windows],
                               jnp.int32)

    def embed_positions(self, x_BSD: jax.Array, positions_BS: jax.Array | None,
                        length: int) -> tuple[jax.Array, Any]:
        """The embedded tokens with the family's positions: ``(x_BSD, layer positions)``.

        ``positions_BS`` are the tokens' positions (packed rows, left-padded prompts), or None
        for ``0 .. S - 1`` in every row; ``length`` bounds them (the sequence, or the cache).
        """
        raise NotImplementedError

    # The passes -----------------------------------------------------------------------------

    def __call__(self, tokens_BS: jax.Array, *, deterministic: bool = True,
                 rngs: nnx.Rngs | jax.Array | None = None, adapters: dict | None = None,
                 lora: LoraSpec | None = None, segments_BS: jax.Array | None = None,
                 sequence_parallel: bool = True) -> jax.Array:
        """Next-token logits ``[B, S, V]`` in ``policy.output_dtype``.

        Args:
          tokens_BS: integer token ids, ``S <= config.max_context``.
          deterministic: when False and the model's dropout (or ``lora.dropout``) is positive,
            dropout is applied.
          rngs: where dropout keys come from: an ``nnx.Rngs`` (its ``dropout`` stream) or a raw
            ``jax.random`` key (what a functional train step passes, one per step).
          adapters: LoRA adapters of the layers' kernels (:func:`effijax.lora.init`), in the
            dtype to compute them in.
          lora: the :class:`~effijax.lora.LoraSpec` of ``adapters`` (static: scales, dropout).
          segments_BS: packed rows' integer segment ids ``[B, S]`` (one id per example, another
            for padding): attention stays within a segment and positions restart at each
            segment's start. None: one sequence per row.
          sequence_parallel: under a mesh whose ``tensor`` axis (above 1) divides ``S``,
            split the residual stream between the blocks along the sequence over ``tensor``
            (Korthikanti et al.; see :func:`effijax.sharding.activation_spec`). On by default,
            as Megatron-LM recommends with tensor parallelism: the reduce-scatter and all-gather
            that replace each all-reduce move the same bytes, and the norm, dropout and residual
            activations divide by the tensor degree. Without a mesh, or where ``tensor`` does
            not divide ``S``, the stream is batch-split only. False: batch-split only.
        """
        return self.head(self._trunk(tokens_BS, deterministic, rngs, adapters, lora,
                                     segments_BS, sequence_parallel))

    def loss(self, tokens_BS: jax.Array, targets_BS: jax.Array, where_BS: jax.Array | None = None,
             *, deterministic: bool = True, rngs: nnx.Rngs | jax.Array | None = None,
             adapters: dict | None = None, lora: LoraSpec | None = None,
             segments_BS: jax.Array | None = None, sequence_parallel: bool = True
             ) -> tuple[jax.Array, jax.Array]:
        """``(loss, accuracy)`` of predicting ``targets_BS``: the mean f32 cross-entropy and the
        top-1 accuracy over the positions ``where_BS`` marks (all when None), with the head
        fused with the loss (:func:`~effijax.models._head.head_cross_entropy`: no ``[B, S, V]``
        logits are kept). The other arguments are :meth:`__call__`'s.

        Example:
          >>> import jax.numpy as jnp
          >>> from flax import nnx
          >>> from effijax.models import gpt_config
          >>> from effijax.models._gpt import GPT
          >>> from effijax.precision import cross_entropy_and_accuracy
          >>> model = GPT(gpt_config("tiny"), rngs=nnx.Rngs(0))
          >>> tokens, targets = jnp.zeros((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32)
          >>> loss, accuracy = model.loss(tokens, targets)
          >>> bool(loss == cross_entropy_and_accuracy(model(tokens), targets)[0])
          True
        """
        x_BSD = self._trunk(tokens_BS, deterministic, rngs, adapters, lora, segments_BS,
                            sequence_parallel)
        x_BSD = getattr(self, self.names.final_norm)(x_BSD)
        kernel, transposed = self._head_kernel()
        return head_cross_entropy(x_BSD, kernel, targets_BS, where_BS, transposed=transposed,
                                  cap=self.logit_cap, output_dtype=self.policy.output_dtype)

    @property
    def logit_cap(self) -> float | None:
        """The head's logit soft-capping (``cap · tanh(logits / cap)``); None: not capped."""
        return None

    def _trunk(self, tokens_BS, deterministic, rngs, adapters, lora, segments_BS,
               sequence_parallel) -> jax.Array:
        """The residual stream after the last layer (before the final norm)."""
        cfg = self.config
        self._check(tokens_BS, adapters, lora, segments_BS)
        s = tokens_BS.shape[1]
        if s > cfg.max_context:
            raise ConfigError("tokens_BS", NO_VALUE, f"sequence length {s} exceeds config."
                              f"{cfg.context_field}={cfg.max_context}")
        key = self._dropout_key(deterministic, rngs, lora)
        positions_BS = None if segments_BS is None else segment_positions(segments_BS)
        # Context parallelism: a sequence that 2 x context splits goes through the layers in
        # ring attention's load-balanced order (each device holds chunk i and its mirror, so
        # the causal work is even). Positions and segments are computed in the natural order
        # and permuted with the tokens; the layers are position-wise but for the attention,
        # which applies the same rule (_balanced); the last layer's output is put back in
        # order before the head.
        n = _balanced(s)
        if n > 1:
            if positions_BS is None:
                positions_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), tokens_BS.shape)
            tokens_BS, positions_BS = (to_load_balanced(x, n) for x in (tokens_BS, positions_BS))
            segments_BS = None if segments_BS is None else to_load_balanced(segments_BS, n)
        # The lookup pinned batch-only: the vocabulary-parallel lookup then completes with a
        # reduction of its [B, S, D] partial sums; split along the sequence right there, XLA
        # gathered the whole embedding table over the tensor axis instead.
        x_BSD, positions = self.embed_positions(_constrain(self._embed(tokens_BS)),
                                                positions_BS, s)
        window, windows_L = self._windows()
        inputs = LayerInputs(positions, segments_BS, window)
        graphdef, stacked = nnx.split(getattr(self, self.names.stack))
        keys_L = None if key is None else jax.random.split(key, cfg.n_layers)
        layer_adapters = None if adapters is None else adapters.get(self.names.stack)
        sequence_parallel = bool(sequence_parallel)
        x_BSD = _run_layers(_constrain(x_BSD, sequence_parallel=sequence_parallel), stacked,
                            keys_L, layer_adapters, (inputs,),
                            graphdef=graphdef, remat=REMAT[cfg.remat],
                            lora=None if layer_adapters is None else lora,
                            path=self.names.stack, unroll=cfg.unroll_layers,
                            windows_L=windows_L, sequence_parallel=sequence_parallel)
        return from_load_balanced(x_BSD, n) if n > 1 else x_BSD

    def decode(self, tokens_BS: jax.Array, cache: KVCache, start: jax.Array, *,
               last: jax.Array | None = None, adapters: dict | None = None,
               lora: LoraSpec | None = None, layers: tuple | None = None
               ) -> tuple[jax.Array, KVCache]:
        """The cached forward pass of ``tokens_BS`` at slots ``start .. start + S - 1`` (each
        row's positions counted from its first real token, see ``cache.pad_B``):
        ``(logits, cache)``, see :func:`effijax.models.make_decode`."""
        self._check(tokens_BS, adapters, lora, None)
        s, t = tokens_BS.shape[1], cache.max_len
        cfg = self.config
        if t > cfg.max_context or s > t:
            raise ConfigError("cache", NO_VALUE, f"{t} positions for {s} tokens: need tokens <= "
                              f"cache <= config.{cfg.context_field}={cfg.max_context}")
        start = jnp.asarray(start, jnp.int32)
        x_BSD, positions = self.embed_positions(self._embed(tokens_BS),
                                                row_positions(cache, start, s), t)
        graphdef, stacked = nnx.split(getattr(self, self.names.stack))
        layer_adapters = None if adapters is None else adapters.get(self.names.stack)
        x_BSD, cache = run_layers_cached(_constrain(x_BSD), stacked, cache, start,
                                         layer_adapters, (LayerInputs(positions, None, None),),
                                         graphdef=graphdef,
                                         lora=None if layer_adapters is None else lora,
                                         path=self.names.stack, layers=layers,
                                         windows=self.layer_windows)
        return self.head(select_last(x_BSD, last)), cache

    def head(self, x_BSD: jax.Array) -> jax.Array:
        """Final norm and the (tied) output head: logits in the policy's output dtype."""
        x_BSD = getattr(self, self.names.final_norm)(x_BSD)
        kernel, transposed = self._head_kernel()
        return head_logits(x_BSD, kernel, transposed=transposed, cap=self.logit_cap,
                           output_dtype=self.policy.output_dtype)

    def _head_kernel(self):
        """``(kernel, transposed)``: the tied embedding as stored (V, D), transposed (see
        effijax.models._dense), or the head's own kernel (an array, bits or quantized)."""
        if self.tied:
            return self.embed.embedding[...], True
        return self.lm_head.kernel.get_value(), False

    # Shared pieces ----------------------------------------------------------------------------

    def _embed(self, tokens_BS: jax.Array) -> jax.Array:
        return jnp.take(self.embed.embedding[...], tokens_BS, axis=0)

    def _check(self, tokens_BS, adapters, lora, segments_BS) -> None:
        check_call(self, tokens_BS, adapters, lora, adaptable=_compiled(self.names.adaptable),
                   adaptable_text=self.names.adaptable_text, segments_BS=segments_BS)

    def _dropout_key(self, deterministic: bool, rngs, lora: LoraSpec | None):
        """The pass's dropout key: None unless dropout (the model's or LoRA's) is on."""
        lora_dropout = lora is not None and lora.dropout > 0
        if deterministic or not (self.dropout > 0 or lora_dropout):
            return None
        if rngs is None:
            raise ConfigError("rngs", NO_VALUE, "dropout is on (deterministic=False, the model's "
                              "dropout or lora.dropout > 0) but no rngs were given; pass "
                              "rngs=nnx.Rngs(dropout=...) or a jax.random key")
        return rngs.dropout() if isinstance(rngs, nnx.Rngs) else rngs


@functools.cache
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(f"^(?:{pattern})$")
