"""Rollouts for RL: ``G`` sampled completions per prompt on the given parameters, and the
teacher-forced batch that scores them.

:func:`rollout` repeats each prompt ``G`` times and samples every row with
:func:`~effijax.generate.generate` (the KV-cached sampler, on ``params`` as they are: no copy,
LoRA adapters applied factored), row ``r`` from its own stream of ``seed``, so a seed
reproduces the rollout and the ``G`` rows of a prompt differ. The completions come back padded
to ``max_completion_length`` tokens, with TRL's mask: a completion's tokens up to and
including its end-of-sequence (all of them when it has none). :func:`rollout_batch` lays a
rollout out for teacher forcing, each row ``[left padding, prompt, completion]``, the padding in
a segment of its own so each prompt starts at position 0 as in the sampler;
:func:`make_completion_logps` scores it with the model's fused head
(:func:`effijax.models.make_token_logps`): the per-token log-probabilities GRPO's loss weighs
(:func:`effijax.objectives.grpo_loss`), for the policy, the sampling policy (``old``) and a
reference alike.

Shape suffixes: ``N`` completions (prompts x ``G``), ``P`` padded prompt, ``T`` completion
tokens, ``S = P + T`` positions of the scoring batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np

from effijax.errors import ConfigError, whole_number
from effijax.generate._generate import PROMPT_BUCKET, _check, _eos_ids, _prompts, generate
from effijax.memory import tree_bytes
from effijax.models import make_token_logps
from effijax.precision import parse_dtype

__all__ = ["Rollout", "rollout", "rollout_batch", "rollout_metrics", "make_completion_logps",
           "rollout_cache_bytes"]


class Rollout(NamedTuple):
    """What :func:`rollout` returns: ``N = prompts x G`` rows, prompt ``i``'s ``G``
    completions at rows ``i·G`` to ``i·G + G - 1``.

    Attributes:
      prompt_ids: int32 ``[N, P]``, each row's prompt, left-padded (with ``pad_id``) to a
        multiple of 16 tokens.
      prompt_lengths: int32 ``[N]``, each prompt's tokens.
      completion_ids: int32 ``[N, T]``, the sampled tokens (``T = max_completion_length``),
        ``pad_id`` after a completion's end-of-sequence.
      completion_mask: bool ``[N, T]``, a completion's tokens up to and including its
        end-of-sequence (TRL's ``completion_mask``).
      finished: bool ``[N]``, whether the completion ended with an end-of-sequence (False:
        cut at ``T`` tokens).
      completions: each row's text (its tokens before the end-of-sequence, decoded), or None
        without ``decode``.
      num_generations: ``G``.
    """

    prompt_ids: np.ndarray
    prompt_lengths: np.ndarray
    completion_ids: np.ndarray
    completion_mask: np.ndarray
    finished: np.ndarray
    completions: list[str] | None
    num_generations: int


def rollout(model, params, prompts, *, num_generations: int, max_completion_length: int,
            temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
            eos_id: int | Sequence[int] | None = None, lora=None,
            decode: Callable[[list[int]], str] | None = None, pad_id: int = 0) -> Rollout:
    """Samples ``num_generations`` completions of each prompt with ``model`` on ``params``.

    Args:
      model: a :class:`~effijax.models.LanguageModel` that decodes with a cache.
      params: its parameters (``{"base", "adapters"}`` with ``lora``), used in place.
      prompts: token ids, one sequence per prompt (any lengths), as
        :func:`~effijax.generate.generate` takes them.
      num_generations: ``G >= 1`` completions per prompt.
      max_completion_length: ``T``, new tokens per completion at most.
      temperature, top_p: the sampling's (:func:`~effijax.generate.sample`; GRPO samples at
        ``temperature > 0``).
      seed: the sampling seed: the same seed, parameters and prompts give the same rollout.
      eos_id: end-of-sequence id(s): a completion stops after one (included in its mask).
      lora: the adapters' :class:`~effijax.lora.LoraSpec`, or None.
      decode: ``decode(ids) -> text`` for the completions' texts (e.g.
        ``lambda ids: tokenizer.decode(ids, skip_special_tokens=True)``); None: no texts.
      pad_id: the id that fills the prompts' left padding and the completions after their end.

    Raises:
      ConfigError: bad settings (before anything is compiled), and what
        :func:`~effijax.generate.generate` refuses.

    Example:
      >>> import jax
      >>> from effijax.models import llama_config
      >>> model = llama_config("llama-tiny")
      >>> params = model.init_params(jax.random.key(0))
      >>> out = rollout(model, params, [[1, 2, 3], [4, 5]], num_generations=2,
      ...               max_completion_length=4, seed=1)
      >>> out.completion_ids.shape, out.prompt_lengths.tolist()
      ((4, 4), [3, 3, 2, 2])
      >>> bool((out.completion_ids[0] != out.completion_ids[1]).any())  # a group's rows differ
      True
    """
    whole_number("num_generations", num_generations)
    whole_number("max_completion_length", max_completion_length)
    whole_number("pad_id", pad_id, minimum=0, maximum=model.vocab_size - 1)
    if not isinstance(temperature, int | float) or isinstance(temperature, bool) \
            or not temperature > 0:
        raise ConfigError("temperature", temperature, "a rollout samples: expected a number "
                          "> 0 (TRL's default is 1.0)")
    rows = _prompts(prompts)
    _eos_ids(eos_id)  # checked before anything is compiled
    repeated = [row for row in rows for _ in range(num_generations)]
    try:
        out = generate(model, params, repeated, max_new_tokens=max_completion_length,
                       temperature=float(temperature), top_p=float(top_p), seed=seed,
                       eos_id=eos_id, lora=lora)
    except ConfigError as e:  # this function's name for the setting
        raise (e.renamed("max_completion_length") if e.field == "max_new_tokens" else e
               ) from None
    n, t = len(repeated), max_completion_length
    completion_NT = np.full((n, t), pad_id, np.int32)
    completion_NT[:, :out.tokens.shape[1]] = out.tokens
    # TRL's mask: up to and including the first EOS (lengths is the EOS's index, or all).
    ends_N = np.where(out.finished, out.lengths + 1, np.minimum(out.lengths, t))
    mask_NT = np.arange(t)[None] < ends_N[:, None]
    completion_NT = np.where(mask_NT, completion_NT, pad_id).astype(np.int32)
    lengths_N = np.array([row.size for row in repeated], np.int32)
    width = -(-int(lengths_N.max()) // PROMPT_BUCKET) * PROMPT_BUCKET
    prompt_NP = np.full((n, width), pad_id, np.int32)
    for i, row in enumerate(repeated):
        prompt_NP[i, width - row.size:] = row
    texts = None
    if decode is not None:
        texts = [decode([int(x) for x in ids[:n_]])
                 for ids, n_ in zip(completion_NT, out.lengths, strict=True)]
    return Rollout(prompt_NP, lengths_N, completion_NT, mask_NT, np.asarray(out.finished, bool),
                   texts, num_generations)


def rollout_metrics(rollout: Rollout) -> dict[str, float]:
    """TRL's completion statistics of a rollout: ``completions/mean_length``, ``min_length``,
    ``max_length`` (tokens, the end-of-sequence included), ``clipped_ratio`` (the fraction cut
    at ``T`` tokens) and ``mean_terminated_length``, ``min_terminated_length``,
    ``max_terminated_length`` (of those that ended; 0 when none did, as TRL logs).

    Example:
      >>> import numpy as np
      >>> r = Rollout(np.zeros((2, 16)), np.array([3, 3]), np.zeros((2, 4)),
      ...             np.array([[True, True, False, False], [True] * 4]), np.array([True, False]),
      ...             None, 2)
      >>> m = rollout_metrics(r)
      >>> m["completions/mean_length"], m["completions/clipped_ratio"]
      (3.0, 0.5)
      >>> m["completions/max_terminated_length"]
      2.0
    """
    lengths = np.asarray(rollout.completion_mask).sum(axis=1).astype(np.float64)
    ended = lengths[np.asarray(rollout.finished, bool)]
    if ended.size == 0:
        ended = np.zeros(1)
    return {"completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(1 - np.mean(rollout.finished)),
            "completions/mean_terminated_length": float(ended.mean()),
            "completions/min_terminated_length": float(ended.min()),
            "completions/max_terminated_length": float(ended.max())}


def rollout_batch(rollout: Rollout) -> dict[str, np.ndarray]:
    """The teacher-forced batch of a rollout: ``inputs`` ``[N, S]`` (each row's left padding,
    prompt and completion), ``targets`` (the inputs shifted by one, ``pad_id`` at the end),
    ``segments`` (0 on the padding, 1 on the rest: each prompt starts at position 0 and never
    sees the padding, as in the sampler), ``mask`` (the completion tokens' target positions)
    and ``completion_mask`` ``[N, T]``, what :func:`make_completion_logps` reads.

    Example:
      >>> import numpy as np
      >>> r = Rollout(np.array([[0, 7, 8]]), np.array([2]), np.array([[5, 2, 0]]),
      ...             np.array([[True, True, False]]), np.array([True]), None, 1)
      >>> b = rollout_batch(r)
      >>> b["inputs"].tolist(), b["targets"].tolist(), b["segments"].tolist()
      ([[0, 7, 8, 5, 2, 0]], [[7, 8, 5, 2, 0, 0]], [[0, 1, 1, 1, 1, 1]])
      >>> b["mask"].astype(int).tolist()
      [[0, 0, 1, 1, 0, 0]]
    """
    prompt_NP, completion_NT = rollout.prompt_ids, rollout.completion_ids
    n, p = prompt_NP.shape
    tokens_NS = np.concatenate([prompt_NP, completion_NT], axis=1).astype(np.int32)
    targets_NS = np.concatenate([tokens_NS[:, 1:], tokens_NS[:, -1:]], axis=1)
    segments_NS = (np.arange(tokens_NS.shape[1])[None]
                   >= (p - rollout.prompt_lengths)[:, None]).astype(np.int32)
    # Completion token j is the target of position P - 1 + j.
    mask_NS = np.zeros(tokens_NS.shape, bool)
    mask_NS[:, p - 1:p - 1 + completion_NT.shape[1]] = rollout.completion_mask
    return {"inputs": tokens_NS, "targets": targets_NS, "segments": segments_NS,
            "mask": mask_NS, "completion_mask": np.asarray(rollout.completion_mask, bool)}


def rollout_cache_bytes(model, *, completions: int, prompt_tokens: int,
                        max_completion_length: int, dtype="fp32") -> int:
    """The bytes of the key/value cache a :func:`rollout` of ``completions`` rows (prompts x
    ``G``) allocates when its longest prompt has ``prompt_tokens`` tokens: the sampler's own
    cache (:meth:`~effijax.models.LanguageModel.init_cache`) in the compute ``dtype``, over the
    positions :func:`~effijax.generate.generate` gives it (the prompt padded to a multiple of
    :data:`~effijax.generate.PROMPT_BUCKET`, plus the completion, rounded up to a multiple of
    :data:`~effijax.generate.CACHE_BUCKET` within the model's context); ``dtype`` a floating
    dtype or its name (``"bf16"``, ``"fp32"``, ...). Shapes only: nothing is allocated.

    Example:
      >>> from effijax.models import llama_config
      >>> model = llama_config("llama-tiny")  # 2 layers, 2 key/value heads of 16
      >>> rollout_cache_bytes(model, completions=8, prompt_tokens=20, max_completion_length=8,
      ...                     dtype="bf16")  # k, v: 2 layers x 8 rows x 64 slots x 32 x 2 B
      131104
      >>> 2 * 2 * 8 * 64 * 2 * 16 * 2 + 8 * 4  # ... and each row's padding count (int32)
      131104
    """
    whole_number("completions", completions)
    whole_number("prompt_tokens", prompt_tokens)
    whole_number("max_completion_length", max_completion_length)
    longest = np.zeros(prompt_tokens, np.int32)
    try:
        _, max_len = _check(model, [longest], max_completion_length, 1.0, 1.0, None)
    except ConfigError as e:
        raise (e.renamed("max_completion_length") if e.field == "max_new_tokens" else e
               ) from None
    dtype = parse_dtype(dtype)
    return tree_bytes(jax.eval_shape(lambda: model.init_cache(completions, max_len, dtype)))


def make_completion_logps(graphdef, lora=None, *, temperature: float = 1.0,
                          sequence_parallel: bool = True, frozen_base: bool = False
                          ) -> Callable[..., jax.Array]:
    """Returns ``completion_logps(params, batch, rng=None) -> logps_NT``: each completion
    token's f32 log-probability at ``temperature`` (TRL scores at the sampling temperature), 0
    outside ``batch["completion_mask"]``, for a :func:`rollout_batch` ``batch``; the fused head
    of :func:`effijax.models.make_token_logps` (whose arguments the others are).

    Example:
      >>> import jax
      >>> from effijax.models import abstract_split, llama_config
      >>> model = llama_config("llama-tiny")
      >>> params = model.init_params(jax.random.key(0))
      >>> r = rollout(model, params, [[1, 2, 3], [4, 5]], num_generations=2,
      ...             max_completion_length=4, seed=1)
      >>> logps = make_completion_logps(abstract_split(model)[0])(params, rollout_batch(r))
      >>> logps.shape, bool((logps < 0).all())
      ((4, 4), True)
    """
    token_logps = make_token_logps(graphdef, lora, sequence_parallel=sequence_parallel,
                                   frozen_base=frozen_base, temperature=temperature)

    def completion_logps(params, batch, rng=None):
        width = batch["completion_mask"].shape[1]
        logps_NS = token_logps(params, {k: batch[k] for k in
                                        ("inputs", "targets", "mask", "segments")}, rng)
        return logps_NS[:, -width - 1:-1]

    return completion_logps
