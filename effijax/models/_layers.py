"""Building blocks shared by effijax's models: the one matmul (with factored LoRA), the scanned
layer stack, and the language-model loss.

Every parameter matmul of a model goes through :func:`_dense`, which adds a LoRA hook's
``s·(x a) b`` with a hand-written backward (:func:`_lora_delta`) and never forms ``a b``. A
model's layers are one module constructed with a leading stack axis ``L``; :func:`_run_layers`
scans it over the residual stream, building each layer's LoRA hooks from that layer's slice of
the adapters (:func:`_lora_hooks`), under a ``jax.checkpoint`` policy. :func:`make_loss_fn` is
the masked mean cross-entropy every family's ``loss_fn`` returns, its output head fused with the
loss (:mod:`effijax.models._head`).

Packed rows: a batch may carry ``"segments"`` (int32 ``[B, S]``, the inputs' example ids, 0 for
padding). The segments are the one source of truth for a packed row: the attention masks keys of
other segments, and each model derives its positions from them with :func:`segment_positions`
(restarting at 0 at every segment start), so an example packed into a row is computed as it
would be alone.

Shape suffixes: ``B`` batch, ``S`` sequence, ``D`` input width, ``F`` output width, ``R`` LoRA
rank, ``N`` flattened tokens, ``L`` layers, ``V`` vocabulary.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from effijax.errors import NO_VALUE, ConfigError
from effijax.lora import LoraSpec, pairs, validate
from effijax.models._dense import (
    freeze_kernels,
    keep,
    kept_shapes,
    materialize,
    matmul,
    token_rows,
    unkeep,
)
from effijax.precision import (
    dequantize,
    dequantized_shapes,
    dot,
    is_quantized,
)
from effijax.sharding import constrain_activations

INIT_STD = 0.02  # GPT-2's and Hugging Face's ``initializer_range``


class _LoraHook(NamedTuple):
    """One adapted kernel inside a traced layer: adds ``scale · dropout(x) @ a @ b``.

    Built inside the scanned block from that layer's slice of the adapters (so it crosses no
    transform boundary); ``scale`` and ``dropout`` are Python floats from the static spec.
    """

    a_DR: jax.Array
    b_RF: jax.Array
    scale: float
    dropout: float
    key: jax.Array | None


def _dense(x_BSD: jax.Array, kernel_DF: jax.Array, bias_F: jax.Array | None,
           lora: _LoraHook | None = None, *, transposed: bool = False) -> jax.Array:
    """The one matmul of the model: ``x @ kernel + bias`` with f32 accumulation.

    Every parameter matmul goes through here (the tied head too, with the embedding transposed),
    so LoRA hooks in here. A hook must reach tracing through the parameters or the static
    graphdef, not through a module global: ``_run_layers`` is jitted and reuses its traces.

    With a LoRA hook the result is ``x @ kernel + (scale · x @ a) @ b + bias``: thin matmuls
    only (``d_in × r``, ``r × d_out``), no ``d_in × d_out`` delta, and since ``kernel`` is not
    differentiated when only the adapters are, no gradient for it is ever computed. The adapter
    term has a hand-written backward (:func:`_lora_delta`). ``b = 0`` adds exact zeros, so a
    fresh adapter leaves the output bit-identical.

    The base matmul is :func:`~effijax.models._dense.matmul`: on a CPU its backward for 16-bit
    operands runs in the layout XLA:CPU's bf16 GEMM takes. ``transposed=True`` takes the kernel
    stored (out, in), as the tied head's embedding is.

    The result has ``x``'s dtype; when a policy override keeps this kernel in another dtype, the
    activations are cast to meet it (never the kernel). The same holds for the adapters (f32
    adapters on a bf16 base run their matmuls in f32).
    """
    # Flatten the leading axes to one: a 2-D matmul's backward contracts over a single axis.
    # XLA:CPU ran the thin adapter gradients of the 3-D einsum 5x slower than this. Not where
    # a context axis splits the sequence: flattening gathered it there (token_rows).
    lead = x_BSD.shape[:-1]
    x_ND = token_rows(x_BSD)
    if is_quantized(kernel_DF):  # a QLoRA base's frozen kernel (never the tied head)
        y_NF = _dot_quantized(x_ND, kernel_DF)
    else:  # an array, or a frozen kernel's bits (freeze_kernels): matmul takes both
        y_NF = matmul(x_ND.astype(kernel_DF.dtype), kernel_DF, transposed=transposed)
    if lora is not None:
        xa_ND = _dropout(x_ND, lora.dropout, lora.key).astype(lora.a_DR.dtype)
        u_NF = _lora_delta(xa_ND, lora.a_DR, lora.b_RF, lora.scale)
        y_NF = y_NF + u_NF.astype(y_NF.dtype)
    y = y_NF.reshape(*lead, y_NF.shape[-1])
    # The bias after the reshape back to x's axes: a row-parallel matmul's partial sums then
    # reach the sequence-parallel constraint as [B, S, F], which XLA reduce-scatters along S
    # (a bias added to the flat [B*S, F] made it all-reduce: S's split has no flat form).
    if bias_F is not None:
        y = y + bias_F.astype(y.dtype)
    return y.astype(x_BSD.dtype)


# A quantized kernel (a QLoRA base, effijax.precision.quantize) is dequantized to the activations'
# dtype right where it is used, one layer at a time inside the scan. Checkpointed, so the
# backward keeps the quantized codes (its inputs) and dequantizes again, instead of saving a
# full-precision kernel per layer: no full-precision copy of the base ever exists.
@functools.partial(jax.checkpoint, prevent_cse=False)
def _dot_quantized(x_ND: jax.Array, kernel_DF) -> jax.Array:
    return dot("...d,df->...f", x_ND, dequantize(kernel_DF, x_ND.dtype))


# The adapter term ``u = x (s·a) b`` with a hand-written backward. Autodiff of the einsums gives
# the adapter gradients as ``da = xᵀ·dh`` and ``db = hᵀ·du``: dots whose left operand contracts
# over its leading (token) axis. XLA:CPU hands only dots whose left operand contracts over its
# last axis to its fast GEMM library (YNNPACK); the others take a generic fallback that is 4-7x
# slower for these thin (d × r) outputs, e.g. 4.3 ms instead of 0.6 ms for xᵀ·dh with x of
# 1024 × 1536 (benchmarks/RESULTS.md, "LoRA vs full fine-tuning"). So the backward computes
# ``daᵀ = dhᵀ·x`` and ``db = hᵀ·du`` from row-major ``r × n`` operands (``dhᵀ = b·duᵀ`` is
# itself such a dot) and transposes only ``r × n`` and ``r × d`` arrays. Those transposes are
# pinned with ``optimization_barrier``: XLA otherwise folds them back into the dots' dimension
# numbers, which is exactly the slow form. The scale multiplies ``a`` (d × r), not an activation.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _lora_delta(x_ND: jax.Array, a_DR: jax.Array, b_RF: jax.Array, scale: float) -> jax.Array:
    return _lora_delta_fwd(x_ND, a_DR, b_RF, scale)[0]


def _lora_delta_fwd(x_ND, a_DR, b_RF, scale):
    as_DR = a_DR * jnp.asarray(scale, a_DR.dtype)
    h_NR = dot("...d,dr->...r", x_ND, as_DR)
    u_NF = dot("...r,rf->...f", h_NR, b_RF)
    return u_NF, (keep(x_ND), keep(materialize(jnp.moveaxis(h_NR, -1, 0))), as_DR, b_RF)


def _lora_delta_bwd(scale, residuals, du_NF):
    x_ND, h_RN, as_DR, b_RF = (unkeep(r) for r in residuals)
    dh_RN = dot("rf,...f->r...", b_RF, du_NF)
    dx_ND = dot("...r,dr->...d", materialize(jnp.moveaxis(dh_RN, 0, -1)), as_DR)
    das_RD = dot("r...,...d->rd", dh_RN, x_ND) * jnp.asarray(scale, x_ND.dtype)
    db_RF = dot("r...,...f->rf", h_RN, du_NF)
    return dx_ND, materialize(das_RD).T, db_RF


_lora_delta.defvjp(_lora_delta_fwd, _lora_delta_bwd)


def _constrain(x_BSD: jax.Array, *, sequence_parallel: bool = False) -> jax.Array:
    """Sharding hook on the residual stream, called at every block boundary.

    Under a mesh set with ``jax.set_mesh`` it pins ``x_BSD`` to
    :func:`effijax.sharding.activation_spec`; with no mesh it is the identity. Where it is
    called, and what is split there:

    * the embedding's output (the scan's entry), each layer's two residual sums (after the
      attention and after the MLP, inside the scanned or unrolled layers) and so the final
      norm's input: batch over ``("data", "fsdp")`` and, with ``sequence_parallel`` (a training
      or evaluation pass: :meth:`Decoder.__call__`'s default) on a ``tensor > 1`` mesh that
      divides the sequence, the sequence over ``tensor``. The norms, dropouts and residual
      adds then hold ``S / tensor`` tokens per device; XLA reduce-scatters the row-parallel
      outputs (o, the MLP's out) and all-gathers the sequence before q/k/v and the MLP's in;
    * generation (:func:`~effijax.models._cache.run_layers_cached`: one-token steps, ragged
      prompts): batch only, whatever the mesh.

    Pinning the batch keeps XLA from splitting small batches the tensor-parallel way (gathering
    activations instead of FSDP's weights).
    """
    return constrain_activations(x_BSD, sequence_parallel=sequence_parallel)


def _dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout; the identity when ``key`` is None or ``rate`` is 0."""
    if key is None or rate == 0.0:
        return x
    keep = 1.0 - rate
    mask = jax.random.bernoulli(key, keep, x.shape)
    return jnp.where(mask, x / keep, jnp.zeros_like(x))


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> jax.Array:
    return std * jax.random.normal(rngs.params(), shape, jnp.float32)


class _Dense(nnx.Module):
    """A (stackable) dense layer: ``kernel`` in Flax's (in, out) layout and, optionally, a bias."""

    def __init__(self, d_in: int, d_out: int, *, std: float, stack: tuple[int, ...],
                 rngs: nnx.Rngs, bias: bool = True):
        self.kernel = nnx.Param(_normal(rngs, (*stack, d_in, d_out), std))
        if bias:
            self.bias = nnx.Param(jnp.zeros((*stack, d_out), jnp.float32))

    def __call__(self, x: jax.Array, lora: dict | None = None) -> jax.Array:
        hook = None if lora is None else lora.get("kernel")
        bias = self.bias[...] if hasattr(self, "bias") else None
        return _dense(x, self.kernel.get_value(), bias, hook)  # an array, Quantized or Kept



class _Embed(nnx.Module):
    def __init__(self, n: int, d: int, *, rngs: nnx.Rngs, std: float = INIT_STD):
        self.embedding = nnx.Param(_normal(rngs, (n, d), std))


def _lora_hooks(adapters, spec: LoraSpec, key: jax.Array | None, path: str):
    """One layer's adapters (``{"attn": {"q": {"kernel": {"a", "b"}}}}``) as :class:`_LoraHook`s.

    ``path`` is the adapters' parameter path (``blocks``): it picks each kernel's scale from the
    spec and seeds its dropout stream.
    """
    if set(adapters) == {"a", "b"}:
        hook_key = None
        if key is not None and spec.dropout > 0:
            hook_key = jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF)
        return _LoraHook(adapters["a"], adapters["b"], spec.scale_for(path), spec.dropout,
                         hook_key)
    return {k: _lora_hooks(v, spec, key, f"{path}/{k}") for k, v in adapters.items()}


# Jitted so that an eager (NNX-style) call compiles the layer stack once per shape instead of
# retracing the scan every call; inside an outer jit it is simply inlined.
@functools.partial(jax.jit, static_argnames=("graphdef", "remat", "lora", "path", "unroll",
                                             "sequence_parallel"))
def _run_layers(x_BSD, stacked, keys_L, adapters=None, consts=(), *, graphdef: nnx.GraphDef,
                remat: Any, lora: LoraSpec | None = None, path: str, unroll: bool = False,
                windows_L: jax.Array | None = None, sequence_parallel: bool = False):
    """Scans stacked layers over the residual stream, one layer's parameters per step.

    The layer module is called as ``layer(x_BSD, key, hooks, *consts)``. ``adapters`` (the
    subtree of a LoRA adapter tree under ``path``, stacked along ``L`` like the kernels) is
    scanned together with the layer parameters; ``consts`` (e.g. rotary tables) are the same
    for every layer. ``remat`` is a ``jax.checkpoint`` policy, or None for no checkpointing.
    ``unroll`` unrolls the loop completely (the models' ``unroll_layers``): the compiled
    program grows with the depth, but it no longer slices each layer's parameters and residuals
    out of stacked buffers, nor zero-fills those buffers every step. ``windows_L`` (int32
    ``[L]``: layers whose sliding attention windows differ, Gemma 3's local/global pattern) is
    scanned too and each layer is called with its own as ``window=``. ``sequence_parallel`` is
    passed to every layer, which pins its residual sums with it (see :func:`_constrain`).
    """

    def body(x_BSD, layer):
        layer_state, layer_key, layer_adapters, window = layer
        hooks = None if layer_adapters is None else _lora_hooks(layer_adapters, lora, layer_key,
                                                                path)
        x_BSD = nnx.merge(graphdef, layer_state)(x_BSD, layer_key, hooks, *consts,
                                                 sequence_parallel=sequence_parallel,
                                                 **({} if window is None else {"window": window}))
        return _constrain(x_BSD, sequence_parallel=sequence_parallel), None

    if remat is not None:
        body = jax.checkpoint(body, policy=remat, prevent_cse=False)
    x_BSD, _ = jax.lax.scan(body, x_BSD, (stacked, keys_L, adapters, windows_L), unroll=unroll)
    return x_BSD


def _split_lora_params(params) -> tuple[Any, Any]:
    """``(base, adapters)`` of the ``{"base": ..., "adapters": ...}`` a LoRA pass takes."""
    if not (isinstance(params, dict) and set(params) == {"base", "adapters"}):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ConfigError("params", NO_VALUE, "with lora=spec, params must be {'base': params, "
                          "'adapters': adapters} (the adapters from effijax.lora.init); "
                          f"got {got}")
    return params["base"], params["adapters"]


def segment_positions(segments_BS: jax.Array) -> jax.Array:
    """int32 ``[B, S]`` positions that restart at 0 wherever the segment id changes.

    The position of ``i`` is ``i`` minus the index of its segment's first token, the running
    maximum (``lax.cummax``) of the indices where a segment starts.

    Example:
      >>> import jax.numpy as jnp
      >>> segment_positions(jnp.array([[1, 1, 1, 2, 2, 0, 0]])).tolist()
      [[0, 1, 2, 0, 1, 0, 1]]
    """
    b, s = segments_BS.shape
    index_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    starts_BS = jnp.concatenate(
        [jnp.ones((b, 1), bool), segments_BS[:, 1:] != segments_BS[:, :-1]], axis=1)
    return index_BS - jax.lax.cummax(jnp.where(starts_BS, index_BS, 0), axis=1)


def make_apply(graphdef: nnx.GraphDef, lora: LoraSpec | None = None, *,
               sequence_parallel: bool = True, frozen_base: bool = False
               ) -> Callable[..., jax.Array]:
    """Returns ``apply(params, tokens_BS, *, rng=None, deterministic=True, segments_BS=None)
    -> logits_BSV``.

    ``params`` are used in their own dtype: cast them with ``policy.cast_to_compute`` first for
    mixed precision. Dropout runs when ``deterministic=False`` and the config's rate is positive;
    ``rng`` is then a ``jax.random`` key (pass a fresh one each step).

    With ``lora`` (a :class:`~effijax.lora.LoraSpec`), ``params`` is ``{"base": params,
    "adapters": adapters}`` and the adapted kernels compute ``x w + s·(x a) b`` (factored: no
    ``d_in × d_out`` delta is formed). To train only the adapters, see
    :func:`effijax.lora.freeze_base`. ``frozen_base=True`` declares the base frozen: no gradient
    reaches it, and on the CPU its 16-bit kernels run from their bits
    (:func:`~effijax.models._dense.freeze_kernels`: XLA:CPU would slice them through f32),
    which the LoRA train step of :func:`effijax.recipe.plan_job` uses.

    ``segments_BS`` (int ``[B, S]``, packed rows) keeps each segment's attention within itself
    and restarts its positions (see :func:`segment_positions`). ``sequence_parallel`` is the
    models' switch of the same name (on a ``tensor > 1`` mesh, the residual stream split along
    the sequence; see :func:`_constrain`).

    Any effijax model works here (the GPT's and the Llama's graphdef): their modules take
    ``(tokens_BS, *, deterministic, rngs, adapters, lora)``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from effijax import lora
      >>> from effijax.models import abstract_split, gpt_config, init_params
      >>> graphdef, params = abstract_split(gpt_config("tiny"))
      >>> params = init_params(gpt_config("tiny"), None, jax.random.key(0))
      >>> tokens = jnp.zeros((1, 4), jnp.int32)
      >>> make_apply(graphdef)(params, tokens).shape
      (1, 4, 256)
      >>> spec = lora.LoraSpec()
      >>> adapters = lora.init(jax.random.key(1), params, spec)
      >>> logits = make_apply(graphdef, spec)({"base": params, "adapters": adapters}, tokens)
      >>> bool(jnp.all(logits == make_apply(graphdef)(params, tokens)))  # b = 0 at init
      True
    """
    _check_lora(lora)

    def apply(params, tokens_BS, *, rng=None, deterministic=True, segments_BS=None):
        model, adapted = _merge(graphdef, params, lora, frozen_base)
        return model(tokens_BS, deterministic=deterministic, rngs=rng, segments_BS=segments_BS,
                     sequence_parallel=sequence_parallel, **adapted)

    return apply


def check_lm_batch(batch) -> None:
    """Refuses a language-model batch without ``inputs`` and ``targets`` (what
    :func:`make_loss_fn` and :func:`~effijax.models.make_sequence_logps` read)."""
    missing = {"inputs", "targets"} - set(batch)
    if missing:
        raise KeyError(f"batch is missing {sorted(missing)}; expected "
                       "{'inputs': int32[B, S], 'targets': int32[B, S]} and optionally 'mask', "
                       "'segments'")


def make_loss_fn(graphdef: nnx.GraphDef, lora: LoraSpec | None = None, *,
                 sequence_parallel: bool = True, frozen_base: bool = False
                 ) -> Callable[..., tuple[jax.Array, dict]]:
    """Returns ``loss_fn(params, batch, rng=None) -> (loss, {"accuracy": acc})``.

    ``batch`` is ``{"inputs": int32[B, S], "targets": int32[B, S]}``; the loss is the mean token
    cross-entropy in f32, the accuracy the f32 fraction of argmax hits. Dropout is active when
    ``rng`` is a key and the config's dropout rate is positive. With ``lora``, ``params`` is
    ``{"base": ..., "adapters": ...}`` as in :func:`make_apply`; wrap the loss in
    :func:`effijax.lora.freeze_base` to differentiate only the adapters. An optional
    ``batch["mask"]`` (``[B, S]``) restricts both to the positions where it is nonzero; an
    optional ``batch["segments"]`` (int ``[B, S]``) runs the packed examples of each row as if
    alone (see :func:`make_apply`, which also says what ``sequence_parallel`` and
    ``frozen_base`` do). The output head is fused with the loss
    (:func:`~effijax.models._head.head_cross_entropy`): the step keeps no ``[B, S, V]`` logits.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from effijax.models import abstract_split, gpt_config, init_params
      >>> config = gpt_config("tiny")
      >>> graphdef, _ = abstract_split(config)
      >>> params = init_params(config, None, jax.random.key(0))
      >>> batch = {"inputs": jnp.zeros((2, 8), jnp.int32), "targets": jnp.ones((2, 8), jnp.int32)}
      >>> loss, aux = make_loss_fn(graphdef)(params, batch)
      >>> loss.dtype, sorted(aux)
      (dtype('float32'), ['accuracy'])
    """
    _check_lora(lora)

    def loss_fn(params, batch, rng=None):
        check_lm_batch(batch)
        model, adapted = _merge(graphdef, params, lora, frozen_base)
        segments_BS, mask_BS = batch.get("segments"), batch.get("mask")
        loss, accuracy = model.loss(batch["inputs"], batch["targets"],
                                    None if mask_BS is None else mask_BS != 0,
                                    deterministic=rng is None, rngs=rng,
                                    segments_BS=segments_BS,
                                    sequence_parallel=sequence_parallel, **adapted)
        return loss, {"accuracy": accuracy}

    return loss_fn


def _check_lora(lora) -> None:
    if lora is not None and not isinstance(lora, LoraSpec):
        raise TypeError(f"lora: expected a LoraSpec or None, got {type(lora).__name__}")


def _merge(graphdef: nnx.GraphDef, params, lora: LoraSpec | None, frozen_base: bool):
    """The model of ``params`` (``{"base", "adapters"}`` with ``lora``) and the keyword
    arguments that pass its adapters on (none without ``lora``)."""
    if lora is None:
        return nnx.merge(graphdef, params), {}
    base, adapters = _split_lora_params(params)
    model = nnx.merge(graphdef, freeze_kernels(base) if frozen_base else base)
    return model, {"adapters": adapters, "lora": lora}


def check_call(module: nnx.Module, tokens_BS: jax.Array, adapters, lora, *, adaptable,
               adaptable_text: str, segments_BS: jax.Array | None = None) -> None:
    """The checks a model's ``__call__`` runs before tracing: adapters and their spec come
    together, every adapter targets a kernel the factored path adapts (``adaptable``, a
    compiled regex; ``adaptable_text`` says which in the error), the adapters fit the
    parameters, the tokens are integer ``[batch, seq]`` ids, and segments, when given, are
    integer ids of the tokens' shape."""
    if (adapters is None) != (lora is None):
        raise ConfigError("adapters", NO_VALUE, "adapters and lora go together: pass the "
                          "adapter tree and its LoraSpec, or neither")
    if lora is not None:
        if not isinstance(lora, LoraSpec):
            raise TypeError(f"lora: expected a LoraSpec, got {type(lora).__name__}")
        for path in pairs(adapters):
            if not adaptable.match(path):
                raise ConfigError("adapters", path, f"{adaptable_text}; fold other adapters in "
                                  "with effijax.lora.merge")
        params = dequantized_shapes(kept_shapes(nnx.to_pure_dict(nnx.state(module,
                                                                            nnx.Param))))
        validate(params, adapters, lora)
    if tokens_BS.ndim != 2 or not jnp.issubdtype(tokens_BS.dtype, jnp.integer):
        raise ConfigError("tokens_BS", NO_VALUE, "expected integer ids of shape [batch, seq], "
                          f"got {tokens_BS.dtype}{list(tokens_BS.shape)}")
    if segments_BS is not None and (segments_BS.shape != tokens_BS.shape
                                    or not jnp.issubdtype(segments_BS.dtype, jnp.integer)):
        raise ConfigError("segments_BS", NO_VALUE, "expected integer segment ids of the tokens' "
                          f"shape {list(tokens_BS.shape)}, got "
                          f"{segments_BS.dtype}{list(segments_BS.shape)}")
