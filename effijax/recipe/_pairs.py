"""Preference pairs, the data of the preference objectives (DPO, SimPO, ORPO), and the policy's
per-sequence log-probabilities of them.

The data is a JSONL file of ``{"prompt": ..., "chosen": ..., "rejected": ...}`` records. Each
side of a pair is rendered as chat data is, ``[user: prompt, assistant: completion]`` with the
model's chat template (:func:`effijax.data.render_chat`), or without a template as plain text
(the prompt's tokens, then the completion's and the end-of-text token, BOS first where the
tokenizer starts texts with one); the loss mask marks the completion's tokens only. Each pair
is two rows of ``seq_len + 1`` tokens, the chosen side at row ``2i`` and the rejected at
``2i + 1`` (padding after each, never trained); a side longer than a row is refused (raise
``--seq-len``), not cut. 5% of the pairs, chosen by their content, are held out.

A batch of ``batch_size`` rows is ``batch_size / 2`` pairs, drawn with replacement by
``(seed, step)`` as :func:`effijax.data.batch_at` draws rows; the log-probabilities of a batch's
rows (:func:`policy_logps`) come as ``[B]``, chosen at ``0::2`` and rejected at ``1::2``.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from effijax.data import (
    Packed,
    packed_batch,
    parse_objects,
    records_fingerprint,
    render_chat,
    split_records,
    target_mask,
)
from effijax.errors import ConfigError
from effijax.models import abstract_split, make_sequence_logps
from effijax.sources import VAL_FRACTION, Dataset, padding_id

__all__ = ["PAIR_METRICS", "Pair", "read_pairs", "pair_rows", "load_pairs", "pair_batch",
           "pair_eval_batches", "completion_window", "policy_logps", "check_pair_loss"]

_KEYS = ("prompt", "chosen", "rejected")
# What evaluation averages over the validation pairs besides the loss (TRL's names; every pair
# loss of effijax.objectives returns them).
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected")


class Pair(NamedTuple):
    """One preference pair, where it came from (``"file:line"``) and its line (``raw``)."""

    prompt: str
    chosen: str
    rejected: str
    source: str
    raw: str


_EXPECTED = '{"prompt": "...", "chosen": "...", "rejected": "..."}'


def _bad(source: str, problem: str) -> ConfigError:
    return ConfigError("data", source, f"{problem}; expected one JSON object per line: "
                       f"{_EXPECTED}")


def _pair(obj: dict, source: str, line: str) -> Pair:
    missing = [k for k in _KEYS if k not in obj]
    if missing:
        raise _bad(source, f"no {', '.join(repr(k) for k in missing)}")
    for key in _KEYS:
        if not isinstance(obj[key], str):
            raise _bad(source, f"{key!r} is a {type(obj[key]).__name__}, not a string")
    for key in ("chosen", "rejected"):
        if not obj[key].strip():
            raise _bad(source, f"the {key} completion is empty")
    return Pair(obj["prompt"], obj["chosen"], obj["rejected"], source, line)


def read_pairs(path: str) -> list[Pair]:
    """The pairs of a JSONL file (blank lines skipped).

    Raises:
      ConfigError: ``field="data"``, value ``"file:line"`` of the first bad record (not JSON,
        a missing or non-string ``prompt``/``chosen``/``rejected``, an empty completion).

    Example:
      >>> import pathlib, tempfile
      >>> f = pathlib.Path(tempfile.mkdtemp()) / "pairs.jsonl"
      >>> _ = f.write_text('{"prompt": "2+2?", "chosen": "4", "rejected": "5"}\\n'
      ...                  '{"prompt": "1+1?", "chosen": "2"}\\n')
      >>> read_pairs(f)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      effijax.errors.ConfigError: data='.../pairs.jsonl:2': no 'rejected'; expected ...
    """
    return parse_objects(path, _pair, "pair", _EXPECTED)


def _plain(tokenizer, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
    """Plain text: [BOS] prompt completion EOS, the mask on the completion and EOS."""
    def encode(text):
        return tokenizer.backend.encode(text, add_special_tokens=False).ids

    lead = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    end = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    head, tail = lead + encode(prompt), encode(completion) + end
    return (np.asarray(head + tail, np.int32),
            np.asarray([0] * len(head) + [1] * len(tail), np.int32))


def _side(tokenizer, prompt: str, completion: str):
    if tokenizer.chat_template is None:
        return _plain(tokenizer, prompt, completion)
    return render_chat(tokenizer, [{"role": "user", "content": prompt},
                                   {"role": "assistant", "content": completion}])


def pair_rows(tokenizer, pairs, seq_len: int) -> Packed:
    """The pairs as rows of ``seq_len + 1`` tokens: chosen at ``2i``, rejected at ``2i + 1``."""
    width = seq_len + 1
    pad = padding_id(tokenizer)
    tokens = np.full((2 * len(pairs), width), pad, np.int32)
    mask = np.zeros((2 * len(pairs), width), np.int32)
    filled = 0
    for i, pair in enumerate(pairs):
        for j, (name, completion) in enumerate((("chosen", pair.chosen),
                                                ("rejected", pair.rejected))):
            try:
                ids, marks = _side(tokenizer, pair.prompt, completion)
            except ConfigError as e:
                if e.field != "chat_template":
                    raise
                raise ConfigError("data", pair.source, e.problem) from None
            if len(ids) > width:
                raise ConfigError("data", pair.source, f"the {name} side is {len(ids)} tokens, "
                                  f"over the {width} of a row (seq_len + 1); raise --seq-len "
                                  "or shorten the pair (pairs are not cut)")
            if not marks[1:].any():
                raise ConfigError("data", pair.source, f"the {name} completion has no token "
                                  "to train after rendering")
            tokens[2 * i + j, :len(ids)], mask[2 * i + j, :len(ids)] = ids, marks
            filled += len(ids)
    return Packed(tokens, mask, None, examples=2 * len(pairs), filled=filled)


def load_pairs(path: str | None, model, *, seq_len: int | None = None,
               val_fraction: float = VAL_FRACTION) -> Dataset:
    """The run's training and validation pairs (see the module docstring) as a
    :class:`~effijax.sources.Dataset` of format ``"pairs"``."""
    seq_len = model.seq_len if seq_len is None else seq_len
    if path is None or Path(path).suffix.lower() != ".jsonl":
        raise ConfigError("data", path, "a preference objective (dpo, simpo, orpo) trains on "
                          "a .jsonl file of {\"prompt\", \"chosen\", \"rejected\"} records "
                          "(--data PAIRS.jsonl)")
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ConfigError("data", path, f"preference pairs are tokenized by the model's "
                          f"tokenizer, and {model.name} has none: train from one (e.g. --from "
                          "smollm2)")
    pairs = read_pairs(path)
    train, val = split_records(pairs, val_fraction)
    train_rows = pair_rows(tokenizer, train, seq_len)
    val_rows = pair_rows(tokenizer, val, seq_len)
    how = "chat template" if tokenizer.chat_template is not None else "plain text"
    note = (f"preference pairs ({how}): {len(train)} training and {len(val)} validation "
            f"pairs, rows of {seq_len + 1} tokens (chosen at 2i, rejected at 2i+1)")
    return Dataset(train_rows, val_rows, records_fingerprint(pairs), "pairs",
                   train_rows.filled + val_rows.filled, note)


def _rows(pairs_P: np.ndarray) -> np.ndarray:
    """Rows ``2p, 2p + 1`` of each pair ``p``, interleaved."""
    return np.stack([2 * pairs_P, 2 * pairs_P + 1], axis=1).reshape(-1)


def _process_slice(batch_size: int, process_index: int, process_count: int) -> slice:
    rows = batch_size // process_count
    return slice(process_index * rows, (process_index + 1) * rows)


def pair_batch(data: Packed, *, seed: int, step: int, batch_size: int, seq_len: int,
               process_index: int = 0, process_count: int = 1) -> dict:
    """The training batch of ``step``: ``batch_size / 2`` pairs drawn with replacement by
    ``np.random.Philox(key=(seed, step))``, chosen rows at even positions."""
    del seq_len  # the rows' width, checked when they were built
    rng = np.random.Generator(np.random.Philox(key=np.array([seed, step], dtype=np.uint64)))
    picks = rng.integers(0, len(data) // 2, size=batch_size // 2)
    return packed_batch(data, _rows(picks)[_process_slice(batch_size, process_index,
                                                          process_count)])


def pair_eval_batches(data: Packed, *, batch_size: int, seq_len: int, num_batches: int,
                      process_index: int = 0, process_count: int = 1) -> list[dict]:
    """Fixed validation batches: ``num_batches * batch_size / 2`` pairs spread evenly over
    the validation pairs (repeated only when there are fewer)."""
    del seq_len
    total = num_batches * (batch_size // 2)
    picks = np.linspace(0, len(data) // 2 - 1, total).round().astype(np.int64)
    rows = _process_slice(batch_size, process_index, process_count)
    step = batch_size // 2
    return [packed_batch(data, _rows(picks[i * step:(i + 1) * step])[rows])
            for i in range(num_batches)]


def completion_window(data: Dataset) -> dict:
    """``{"window": W}``: the longest span, first to last trained position, of any row of the
    pairs (training and validation), rounded up to a multiple of 16: all a pair loss's head
    scores of each row (:func:`effijax.models.make_sequence_logps`' ``window``); the rows'
    width when no shorter window holds them.

    Example:
      >>> import numpy as np
      >>> from effijax.data import Packed
      >>> mask = np.zeros((2, 65), np.int32); mask[0, 40:51] = 1; mask[1, 30:35] = 1
      >>> rows = Packed(np.zeros((2, 65), np.int32), mask, None, examples=2, filled=0)
      >>> completion_window(Dataset(rows, rows, "", "pairs", 0))
      {'window': 16}
    """
    longest, width = 1, data.train.tokens_NW.shape[1] - 1
    for rows in (data.train, data.val):
        marked = target_mask(rows.mask_NW, rows.segments_NW) != 0
        if marked.any():
            any_row = marked.any(axis=1)
            first = np.argmax(marked, axis=1)
            last = width - 1 - np.argmax(marked[:, ::-1], axis=1)
            longest = max(longest, int(np.max((last - first + 1)[any_row])))
    return {"window": min(-(-longest // 16) * 16, width)}


def policy_logps(model, lora=None, *, sequence_parallel: bool = True,
                 window: int | None = None):
    """The policy's ``sequence_logps(params, batch, rng=None) -> (logps_B, counts_B)``
    (:func:`effijax.models.make_sequence_logps`): the model's own parameters in full
    fine-tuning; under LoRA (``lora``, a :class:`~effijax.lora.LoraSpec`) the frozen base with
    the adapters, ``params = {"base": ..., "adapters": ...}``, for a loss that
    :func:`effijax.lora.freeze_base` wraps (no gradient reaches the base).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from effijax.models import gpt_config
      >>> model = gpt_config("tiny")
      >>> tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
      >>> mask = jnp.broadcast_to(jnp.arange(8) >= 5, (2, 8))  # the completions' targets
      >>> batch = {"inputs": tokens, "targets": tokens + 1, "mask": mask}
      >>> logps, counts = policy_logps(model)(model.init_params(jax.random.key(0)), batch)
      >>> logps.shape, counts.tolist()
      ((2,), [3, 3])
    """
    graphdef, _ = abstract_split(model)
    return make_sequence_logps(graphdef, lora, sequence_parallel=sequence_parallel,
                               frozen_base=lora is not None, window=window)


def check_pair_loss(pair_loss, **arguments) -> None:
    """Runs a pair loss's own checks of its settings, ``pair_loss(chosen_logps, rejected_logps,
    chosen_counts, rejected_counts, **arguments)`` abstractly on one pair (``arguments``: the
    shapes of its other arrays), so that a bad setting is a
    :class:`~effijax.errors.ConfigError` naming it before the step is traced.

    Example:
      >>> import functools
      >>> from effijax.objectives import simpo_loss
      >>> check_pair_loss(functools.partial(simpo_loss, beta=0.0))
      Traceback (most recent call last):
      effijax.errors.ConfigError: beta=0.0: must be > 0 (TRL's default is 0.1)
    """
    logps, counts = (jax.ShapeDtypeStruct((1,), dtype) for dtype in (jnp.float32, jnp.int32))
    try:
        jax.eval_shape(lambda c, r, nc, nr, kw: pair_loss(c, r, nc, nr, **kw), logps, logps,
                       counts, counts, arguments)
    except ConfigError as e:  # the error alone, without the note JAX adds to one it traced
        raise e.renamed(e.field) from None
