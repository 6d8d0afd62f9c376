"""Autoregressive generation with a key/value cache: one compiled prefill, one compiled step.

:func:`generate` runs a model's cached forward pass (:meth:`LanguageModel.decode_fn`) twice
over: the *prefill* program takes the prompts, left-padded to one length (a multiple of
:data:`PROMPT_BUCKET` tokens, so nearby prompt lengths share it), fills the cache and samples
the first new token of every row from the logits at the last slot, where every prompt ends; the
*decode* program takes one token per row at the next slot, updates the cache (its buffer is
donated) and samples the next. Prompts of different lengths share the batch: the cache's
``pad_B`` tells the model each row's padding, which its attention masks out and its positions
skip (a row's first real token is at position 0), so each row computes what its prompt alone
computes. Both are compiled
ahead of time for a fixed cache of ``max_len`` positions and kept (per model,
adapter spec, parameter shapes and sizes), so generating N tokens compiles each once, and a
second call with the same shapes compiles nothing. Sampling (:func:`~effijax.generate.sample`)
runs inside the programs with traced temperature and top-p; row ``r`` draws step ``i`` with
``fold_in(fold_in(key(seed), r), i)``, so a seed reproduces a generation exactly and a row's
tokens do not depend on the other rows' prompts.

The host loop fetches each step's tokens (a few bytes) to stop at end-of-sequence: a row that
produced an EOS id is finished (its later tokens are replaced by the EOS), and the loop ends
when every row is.

With a :class:`~effijax.lora.LoraSpec`, ``params`` is ``{"base": ..., "adapters": ...}`` and the
adapters are applied factored, as in training: nothing is merged.

Shape suffixes: ``B`` batch, ``P`` padded prompt, ``V`` vocabulary.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from effijax.errors import ConfigError, whole_number
from effijax.generate._limits import check_prompt_count
from effijax.generate._sample import sample
from effijax.memory import format_bytes, tree_bytes
from effijax.precision import is_quantized
from effijax.sources import check_memory

__all__ = ["Generation", "generate", "PROMPT_BUCKET", "CACHE_BUCKET"]

# Prompts are padded to a multiple of this many tokens (one prefill program per bucket), and
# the cache to a multiple of CACHE_BUCKET positions (within the model's context).
PROMPT_BUCKET = 16
CACHE_BUCKET = 64


class Generation(NamedTuple):
    """What :func:`generate` returns.

    Attributes:
      tokens: int32 ``[B, N]``, the new tokens of each row (row ``b`` continues prompt ``b``);
        after a row's end-of-sequence its EOS id repeats.
      lengths: int ``[B]``, new tokens of each row before its EOS (all ``N`` if none).
      finished: bool ``[B]``, whether the row stopped at an EOS.
      prompt_tokens: tokens in the longest prompt (each prompt's: ``prompt_lengths``).
      compile_s: seconds spent compiling the two programs in this call (0 when kept from an
        earlier call with the same shapes).
      prefill_s: seconds of the prefill (prompt and the first token).
      decode_s: seconds of the decode steps (every token after the first).
      prompt_lengths: int ``[B]``, tokens in each prompt.
      cache_bytes: bytes of the key/value cache (its local layers' rings of ``window`` slots
        and its global layers' ``max_len``, see :mod:`effijax.models._cache`).
    """

    tokens: np.ndarray
    lengths: np.ndarray
    finished: np.ndarray
    prompt_tokens: int
    compile_s: float
    prefill_s: float
    decode_s: float
    prompt_lengths: np.ndarray
    cache_bytes: int

    @property
    def outputs(self) -> list[np.ndarray]:
        """Each row's new tokens up to its EOS (excluded): one int32 array per prompt."""
        return [row[:n] for row, n in zip(self.tokens, self.lengths, strict=True)]

    @property
    def new_tokens(self) -> int:
        """Tokens produced per row (the longest row, EOS included)."""
        return self.tokens.shape[1]

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens (all rows) per second of prefill and decoding, compile excluded."""
        return self.tokens.size / max(self.prefill_s + self.decode_s, 1e-12)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _signature(tree) -> tuple:
    # The shardings too: a program compiled for parameters on one device refuses them
    # replicated or sharded over a mesh (the harness's EffijaxLM(mesh=...)).
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(x.shape), str(x.dtype), getattr(x, "sharding", None))
                          for x in leaves)


def _compute_dtype(params, lora) -> Any:
    base = params["base"] if lora is not None else params
    # A quantized kernel (QLoRA base) is dequantized to the activations' dtype: its f32 scales
    # say nothing of the compute dtype.
    floats = [x.dtype for x in jax.tree.leaves(base, is_leaf=is_quantized)
              if not is_quantized(x) and jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.result_type(*floats) if floats else jnp.float32


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


@functools.lru_cache(maxsize=8)
def _compiled(model, lora, signature, batch: int, prompt_len: int, max_len: int,
              dtype_name: str, abstract_params, unroll: bool):
    """The compiled prefill and decode programs, and the seconds compiling them took; kept
    per model, spec, parameter signature (structure, shapes, dtypes, shardings) and sizes."""
    del signature  # part of the key only (abstract_params hashes by it too)
    decode = model.decode_fn(lora)

    def prefill(params, cache, tokens_BP, key, temperature, top_p):
        logits_B1V, cache = decode(params, cache, tokens_BP, jnp.int32(0),
                                   jnp.int32(prompt_len - 1))
        return _sample_rows(logits_B1V[:, 0], key, jnp.int32(0), temperature, top_p), cache

    def step(params, layers, cache, token_B, slot, index, key, temperature, top_p):
        logits_B1V, cache = decode(params, cache, token_B[:, None], slot, layers=layers)
        return _sample_rows(logits_B1V[:, 0], key, index, temperature, top_p), cache

    cache = jax.eval_shape(lambda: model.init_cache(batch, max_len, jnp.dtype(dtype_name)))
    params = abstract_params.tree
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    f32 = jax.ShapeDtypeStruct((), jnp.float32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    split = decode.split_layers if unroll else (lambda params: None)
    layers = jax.eval_shape(split, params)
    t0 = time.perf_counter()
    split_c = jax.jit(split).lower(params).compile() if unroll else split
    prefill_c = jax.jit(prefill, donate_argnums=1).lower(
        params, cache, jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32), key, f32,
        f32).compile()
    step_c = jax.jit(step, donate_argnums=2).lower(
        params, layers, cache, jax.ShapeDtypeStruct((batch,), jnp.int32), i32, i32, key, f32,
        f32).compile()
    return split_c, prefill_c, step_c, time.perf_counter() - t0


def _sample_rows(logits_BV, key, index, temperature, top_p) -> jax.Array:
    """The next token of each row, row ``r`` drawn with ``fold_in(fold_in(key, r), index)``:
    its own stream, whatever the batch's other rows are."""

    def row(logits_V, r):
        row_key = jax.random.fold_in(jax.random.fold_in(key, r), index)
        return sample(logits_V[None], row_key, temperature, top_p)[0]

    return jax.vmap(row)(logits_BV, jnp.arange(logits_BV.shape[0], dtype=jnp.int32))


class _Hashable(NamedTuple):
    """A pytree of ShapeDtypeStructs, hashed by its signature (for the program cache)."""

    tree: Any
    signature: tuple

    def __hash__(self):
        return hash(self.signature)

    def __eq__(self, other):
        return isinstance(other, _Hashable) and self.signature == other.signature


def _eos_ids(eos_id) -> tuple[int, ...]:
    if eos_id is None:
        return ()
    ids = (eos_id,) if isinstance(eos_id, int | np.integer) else tuple(eos_id)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int | np.integer) or i < 0:
            raise ConfigError("eos_id", eos_id, "expected a token id (int >= 0), a sequence "
                              "of them, or None")
    return tuple(int(i) for i in ids)


def _is_id(x) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _prompts(prompt) -> list[np.ndarray]:
    """The prompts as 1-D integer arrays: from one sequence of ids, a 2-D ``[batch, tokens]``
    array, or a sequence of sequences of ids (of any lengths)."""
    expected = ("expected token ids: a non-empty sequence of ints (one prompt), a 2-D [batch, "
                "tokens] array of them, or a list of such sequences (prompts of any lengths)")
    if isinstance(prompt, str | bytes):
        raise ConfigError("prompt", prompt, "expected token ids, not text: encode it first "
                          "(effijax.generate.load(...).complete takes text)")
    if hasattr(prompt, "ndim") and hasattr(prompt, "shape"):  # a NumPy or JAX array
        array = np.asarray(prompt)
        if array.ndim not in (1, 2):
            raise ConfigError("prompt", f"{array.dtype}{list(array.shape)}", expected)
        rows = [array] if array.ndim == 1 else list(array)
    elif isinstance(prompt, Sequence) and len(prompt) > 0:
        if all(_is_id(x) for x in prompt):
            rows = [np.asarray(prompt)]
        elif any(_is_id(x) or isinstance(x, str | bytes) for x in prompt):
            raise ConfigError("prompt", type(prompt).__name__, expected)
        else:
            rows = [np.asarray(row) for row in prompt]
    else:
        raise ConfigError("prompt", prompt if isinstance(prompt, Sequence) else
                          type(prompt).__name__, expected)
    for b, row in enumerate(rows):
        if row.ndim != 1 or row.size == 0 or not np.issubdtype(row.dtype, np.integer):
            where = "" if len(rows) == 1 else f" (prompt {b})"
            raise ConfigError("prompt", f"{row.dtype}{list(row.shape)}{where}", expected)
    return rows


def _check(model, prompt, max_new_tokens, temperature, top_p, max_len
           ) -> tuple[list[np.ndarray], int]:
    """The prompts as int32 arrays and the cache length; every error before tracing."""
    prompts = _prompts(prompt)
    check_prompt_count(len(prompts))
    for b, row in enumerate(prompts):
        if row.min() < 0 or row.max() >= model.vocab_size:
            bad = int(row.min()) if row.min() < 0 else int(row.max())
            where = "" if len(prompts) == 1 else f" (prompt {b} has {bad})"
            raise ConfigError("prompt", bad, f"token ids must be in [0, {model.vocab_size}) for "
                              f"{model.name}{where}")
    whole_number("max_new_tokens", max_new_tokens)
    if not isinstance(temperature, int | float) or not temperature >= 0 or \
            not np.isfinite(temperature):
        raise ConfigError("temperature", temperature, "expected a finite number >= 0 (0: "
                          "greedy)")
    if not isinstance(top_p, int | float) or not 0 < top_p <= 1:
        raise ConfigError("top_p", top_p, "expected a number in (0, 1]")
    context = model.max_context
    longest = max(row.size for row in prompts)
    needed = longest + max_new_tokens
    if max_len is None:
        padded = _round_up(longest, PROMPT_BUCKET)
        max_len = min(context, _round_up(padded + max_new_tokens, CACHE_BUCKET))
    elif isinstance(max_len, bool) or not isinstance(max_len, int) or max_len > context:
        raise ConfigError("max_len", max_len, f"expected an int <= {context}, the context of "
                          f"{model.name}")
    if needed > max_len:
        prompt_text = "a prompt" if len(prompts) == 1 else "the longest prompt"
        raise ConfigError("max_new_tokens", max_new_tokens, f"{prompt_text} of {longest} "
                          f"tokens and {max_new_tokens} new ones need {needed} positions; "
                          f"{model.name} attends over at most {max_len}: ask for fewer tokens "
                          "or shorten the prompt")
    return [row.astype(np.int32) for row in prompts], max_len


def _fits(model, abstract_params, batch: int, max_len: int, dtype) -> int:
    """The cache's bytes; refuses, before compiling, a batch whose cache (with the parameters and
    a row of f32 logits per prompt) does not fit the device (:func:`effijax.sources.check_memory`).
    """
    cache = tree_bytes(jax.eval_shape(lambda: model.init_cache(batch, max_len, dtype)))
    held = tree_bytes(abstract_params)
    check_memory(held + cache + batch * model.vocab_size * 4, held,
            what=f"generating {batch:,} prompt(s) of up to {max_len:,} positions (a key/value "
            f"cache of {format_bytes(cache)})",
            fix="give fewer prompts per call, or fewer new tokens")
    return cache


def generate(model, params, prompt, *, max_new_tokens: int = 64, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | Sequence[int] | None = None,
             lora=None, max_len: int | None = None, unroll_layers: bool = False,
             on_tokens: Callable[[np.ndarray], Any] | None = None) -> Generation:
    """Continues each prompt with ``model`` for up to ``max_new_tokens`` tokens, KV-cached.

    Prompts of different lengths run as one batch, left-padded to the longest (rounded up to a
    multiple of :data:`PROMPT_BUCKET`): each row gives what its prompt alone gives, and a new
    mix of lengths with the same padded length reuses the compiled programs.

    Args:
      model: a :class:`~effijax.models.LanguageModel` whose family decodes with a cache (the
        Llama family and the GPT).
      params: its parameters in the dtype to compute in; with ``lora``, ``{"base": params,
        "adapters": adapters}``.
      prompt: token ids: one prompt (a 1-D sequence), prompts of one length (a 2-D ``[batch,
        tokens]`` array), or a list of prompts of any lengths (one row each, in order).
      max_new_tokens: tokens to generate at most.
      temperature: 0 for greedy decoding, else the sampling temperature.
      top_p: nucleus sampling's probability mass (1: sample from every token).
      seed: the sampling seed (the same seed gives the same tokens; each row draws from its
        own stream, so a row's tokens do not depend on the other rows' prompts).
      eos_id: end-of-sequence id(s) (a tokenizer's ``eos_id``): a row stops after one, and
        generation ends when every row has stopped.
      lora: the adapters' :class:`~effijax.lora.LoraSpec`, or None.
      max_len: the cache's positions (default: the padded prompt + new tokens, rounded up to a
        multiple of :data:`CACHE_BUCKET` within the model's context).
      unroll_layers: run the decode step's layers unrolled over one buffer per layer (split
        from the stack once per call, a transient copy of it; see
        :func:`effijax.models.split_layers`) instead of scanning the stack, inside which XLA:CPU
        copies each layer's weights before its matrix-vector products. Measured on SmolLM2 on
        a shared 2-core CPU: the step 64 ms instead of 72 ms at best (median 190 vs 443 ms,
        noisy), the compile 56 s instead of 7 s; worth it for long generations only.
      on_tokens: called with each step's new tokens (int32 ``[B]``, one per row, the
        prefill's first included) as soon as they are on the host, before the next step: what
        streams a reply as it is decoded (the host reads each step's tokens anyway, to stop at
        EOS).

    Returns:
      A :class:`Generation` (tokens, lengths, timings), one row per prompt.

    Raises:
      ConfigError: bad arguments, more than :data:`~effijax.generate.MAX_PROMPTS` prompts, a
        prompt that does not fit the context, or a cache that does not fit in memory
        (``field="memory"``), before compiling.

    Example:
      >>> import jax
      >>> from effijax.models import llama_config
      >>> model = llama_config("llama-tiny")
      >>> params = model.init_params(jax.random.key(0))
      >>> out = generate(model, params, [1, 2, 3], max_new_tokens=5)
      >>> out.tokens.shape, out.lengths.tolist(), out.finished.tolist()
      ((1, 5), [5], [False])

      Prompts of different lengths, one row each; each row is what its prompt gives alone:

      >>> batch = generate(model, params, [[1, 2, 3], [4, 5, 6, 7, 8, 9]], max_new_tokens=5)
      >>> batch.tokens.shape, batch.prompt_lengths.tolist()
      ((2, 5), [3, 6])
      >>> batch.outputs[0].tolist() == out.tokens[0].tolist()
      True
    """
    prompts, max_len = _check(model, prompt, max_new_tokens, temperature, top_p, max_len)
    eos = _eos_ids(eos_id)
    batch = len(prompts)
    lengths_B = np.array([row.size for row in prompts])
    longest = int(lengths_B.max())
    # Left padding: every prompt ends at slot ``padded - 1``, every row decodes at one slot.
    padded = min(_round_up(longest, PROMPT_BUCKET), max_len - max_new_tokens)
    dtype = jnp.dtype(_compute_dtype(params, lora))
    abstract = jax.tree.map(_abstract, params)
    cache_bytes = _fits(model, abstract, batch, max_len, dtype)
    signature = _signature(abstract)
    before = _compiled.cache_info().misses
    split, prefill, step, compile_s = _compiled(model, lora, signature, batch, padded, max_len,
                                                dtype.name, _Hashable(abstract, signature),
                                                bool(unroll_layers))
    if _compiled.cache_info().misses == before:
        compile_s = 0.0

    tokens_BP = np.zeros((batch, padded), np.int32)
    for b, row in enumerate(prompts):
        tokens_BP[b, padded - row.size:] = row
    key = jax.random.key(seed)
    temperature, top_p = jnp.float32(temperature), jnp.float32(top_p)
    cache = model.init_cache(batch, max_len, dtype)
    cache = cache._replace(pad_B=jnp.asarray(padded - lengths_B, jnp.int32))
    jax.block_until_ready(cache)

    t0 = time.perf_counter()
    token_B, cache = prefill(params, cache, jnp.asarray(tokens_BP), key, temperature, top_p)
    layers = split(params)  # unroll_layers: one buffer per layer (a copy of the stack)
    host_B = np.asarray(token_B)
    prefill_s = time.perf_counter() - t0
    if on_tokens is not None:
        on_tokens(host_B)
    out = [host_B]
    finished_B = np.isin(host_B, eos)
    t0 = time.perf_counter()
    for i in range(1, max_new_tokens):
        if finished_B.all():
            break
        token_B, cache = step(params, layers, cache, token_B, jnp.int32(padded + i - 1),
                              jnp.int32(i), key, temperature, top_p)
        host_B = np.asarray(token_B)
        if on_tokens is not None:
            on_tokens(host_B)
        out.append(host_B)
        finished_B |= np.isin(host_B, eos)
    decode_s = time.perf_counter() - t0

    tokens_BN = np.stack(out, axis=1)
    is_eos_BN = np.isin(tokens_BN, eos)
    stops_B = np.where(is_eos_BN.any(1), is_eos_BN.argmax(1), tokens_BN.shape[1])
    after_BN = np.arange(tokens_BN.shape[1])[None] > stops_B[:, None]
    eos_B = tokens_BN[np.arange(batch), np.minimum(stops_B, tokens_BN.shape[1] - 1)]
    tokens_BN = np.where(after_BN, eos_B[:, None], tokens_BN).astype(np.int32)
    return Generation(tokens_BN, stops_B, is_eos_BN.any(1), longest, compile_s, prefill_s,
                      decode_s, lengths_B, cache_bytes)
