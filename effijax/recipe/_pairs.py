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
Rows with a value each computed once before training (:class:`ScoredPairs`: DPO's precomputed
reference log-probabilities) give their batches that value too, as the f32 ``[B]`` array
``batch["reference_logps"]``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from effijax.data import (
    Packed,
    find_sources,
    packed_batch,
    parse_objects,
    records_fingerprint,
    render_chat,
    split_records,
    table_rows,
    target_mask,
)
from effijax.errors import ConfigError
from effijax.models import abstract_split, make_sequence_logps
from effijax.recipe._sections import TRUNCATION_MODES
from effijax.sources import VAL_FRACTION, Dataset, padding_id

__all__ = ["PAIR_METRICS", "REFERENCE_LOGPS", "Pair", "ScoredPairs", "read_pairs", "pair_rows",
           "load_pairs", "pair_batch", "pair_eval_batches", "completion_window", "policy_logps",
           "check_pair_loss"]

_KEYS = ("prompt", "chosen", "rejected")
# What evaluation averages over the validation pairs besides the loss (TRL's names; every pair
# loss of effijax.objectives returns them).
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected")
# The batches' row value of DPO's precomputed reference log-probabilities (ScoredPairs).
REFERENCE_LOGPS = "reference_logps"


class Pair(NamedTuple):
    """One preference pair, where it came from (``"file:line"``, ``"file:row"`` of a table)
    and its record (``raw``). Its ``prompt``, ``chosen`` and ``rejected`` are all strings, or
    all conversations (TRL's conversational form: lists of ``{"role", "content"}`` messages,
    the completions' the assistant's)."""

    prompt: str | list
    chosen: str | list
    rejected: str | list
    source: str
    raw: str


_EXPECTED = '{"prompt": "...", "chosen": "...", "rejected": "..."}'


def _bad(source: str, problem: str) -> ConfigError:
    return ConfigError("data", source, f"{problem}; expected one JSON object per line: "
                       f"{_EXPECTED}")


def _check_messages(messages: list, key: str, source: str) -> None:
    for message in messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise _bad(source, f"{key!r} is a conversation, and {str(message)[:60]!r} is not "
                       "a {\"role\": str, \"content\": str} message")


def _pair(obj: dict, source: str, line: str) -> Pair:
    missing = [k for k in _KEYS if k not in obj]
    if missing:
        raise _bad(source, f"no {', '.join(repr(k) for k in missing)}")
    if any(isinstance(obj[key], list) for key in _KEYS):  # the conversational form
        for key in _KEYS:
            if not isinstance(obj[key], list):
                raise _bad(source, "'prompt', 'chosen' and 'rejected' are all strings or all "
                           f"conversations (lists of messages), but {key!r} is a "
                           f"{type(obj[key]).__name__}")
            _check_messages(obj[key], key, source)
        for key in ("chosen", "rejected"):
            if any(m["role"] != "assistant" for m in obj[key]):
                raise _bad(source, f"the {key} completion holds a message that is not the "
                           "assistant's")
            if not "".join(m["content"] for m in obj[key]).strip():
                raise _bad(source, f"the {key} completion is empty")
        return Pair(obj["prompt"], obj["chosen"], obj["rejected"], source, line)
    for key in _KEYS:
        if not isinstance(obj[key], str):
            raise _bad(source, f"{key!r} is a {type(obj[key]).__name__}, not a string")
    for key in ("chosen", "rejected"):
        if not obj[key].strip():
            raise _bad(source, f"the {key} completion is empty")
    return Pair(obj["prompt"], obj["chosen"], obj["rejected"], source, line)


def read_pairs(path: str) -> list[Pair]:
    """The pairs of a JSONL file (blank lines skipped), or of Parquet or Arrow tables (a file,
    a folder of them, a ``datasets`` ``save_to_disk`` folder) with the columns ``prompt``,
    ``chosen`` and ``rejected``, in order. A table's row reads as the JSONL line
    ``json.dumps`` writes of it (its ``raw``: the same pairs hold out the same pairs, and the
    data has the same fingerprint).

    Raises:
      ConfigError: ``field="data"``, value ``"file:line"`` (``"file:row"``) of the first bad
        record (not JSON, a missing or non-string ``prompt``/``chosen``/``rejected``, an empty
        completion, a conversation's bad message).
      FileError: a table without those columns.

    Example:
      >>> import pathlib, tempfile
      >>> f = pathlib.Path(tempfile.mkdtemp()) / "pairs.jsonl"
      >>> _ = f.write_text('{"prompt": "2+2?", "chosen": "4", "rejected": "5"}\\n'
      ...                  '{"prompt": "1+1?", "chosen": "2"}\\n')
      >>> read_pairs(f)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      effijax.errors.ConfigError: data='.../pairs.jsonl:2': no 'rejected'; expected ...
    """
    if Path(path).suffix.lower() == ".jsonl":
        return parse_objects(path, _pair, "pair", _EXPECTED)
    pairs = []
    for source in find_sources(path):
        if source.kind == "jsonl":
            pairs += parse_objects(source.path, _pair, "pair", _EXPECTED)
        elif source.kind == "text":
            raise ConfigError("data", str(source.path), "a text file among preference pairs: "
                              "pairs come from JSONL, Parquet or Arrow records with the "
                              "columns prompt, chosen and rejected")
        else:
            pairs += [_pair(row, f"{source.path}:{i}", json.dumps(row) + "\n")
                      for i, row in enumerate(table_rows(source, list(_KEYS)))]
    if not pairs:
        raise ConfigError("data", str(path), "holds no pair")
    return pairs


def _plain(tokenizer, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
    """Plain text: [BOS] prompt completion EOS, the mask on the completion and EOS."""
    def encode(text):
        return tokenizer.backend.encode(text, add_special_tokens=False).ids

    lead = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    end = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    head, tail = lead + encode(prompt), encode(completion) + end
    return (np.asarray(head + tail, np.int32),
            np.asarray([0] * len(head) + [1] * len(tail), np.int32))


def _side(tokenizer, prompt, completion):
    if isinstance(prompt, str):
        if tokenizer.chat_template is None:
            return _plain(tokenizer, prompt, completion)
        return render_chat(tokenizer, [{"role": "user", "content": prompt},
                                       {"role": "assistant", "content": completion}])
    if tokenizer.chat_template is None:
        raise ConfigError("chat_template", None, "conversational pairs are rendered with a "
                          "chat template, and the tokenizer has none: give --chat-template "
                          "FILE")
    ids, marks = render_chat(tokenizer, [*prompt, *completion])
    if any(m["role"] == "assistant" for m in prompt):  # earlier replies: context, not trained
        head, _ = render_chat(tokenizer, prompt)
        if not np.array_equal(ids[:len(head)], head):
            raise ConfigError("chat_template", None, "renders the prompt's conversation "
                              "differently alone than before the completion, so its assistant "
                              "turns cannot be told from the completion's")
        marks = np.where(np.arange(len(marks)) < len(head), 0, marks).astype(np.int32)
    return ids, marks


def _cut(ids, marks, width: int, truncation_mode: str | None, source: str, name: str):
    """A side of more than ``width`` tokens cut as ``truncation_mode`` says (None: refused);
    None when its prompt alone fills the row (``keep_start``: the pair is dropped)."""
    if truncation_mode is None:
        raise ConfigError("data", source, f"the {name} side is {len(ids)} tokens, over the "
                          f"{width} of a row "
                          "(seq_len + 1); raise --seq-len, shorten the pair, or cut it with "
                          "--truncation-mode keep_start or keep_end")
    if truncation_mode == "keep_end":
        return ids[-width:], marks[-width:]
    if int(np.argmax(marks != 0)) >= width:  # the prompt fills the row: nothing to train
        return None
    return ids[:width], marks[:width]


def pair_rows(tokenizer, pairs, seq_len: int, truncation_mode: str | None = None) -> Packed:
    """The pairs as rows of ``seq_len + 1`` tokens: chosen at ``2i``, rejected at ``2i + 1``.

    A side longer than a row (TRL's ``max_length``: the row's ``seq_len + 1`` tokens) is
    refused, or with ``truncation_mode`` (TRL's): ``keep_start`` keeps its first tokens and
    drops a pair whose prompt alone fills a row, ``keep_end`` keeps its last tokens; the mask
    is cut with the tokens. ``truncated`` counts the sides cut; ``examples`` the rows kept.
    """
    if truncation_mode not in (None, *TRUNCATION_MODES):
        raise ConfigError("truncation_mode", truncation_mode, "choose keep_start or keep_end "
                          "(TRL's), or leave it out to refuse a pair longer than a row")
    width = seq_len + 1
    kept, cut = [], 0
    for pair in pairs:
        sides = []
        for name, completion in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            try:
                ids, marks = _side(tokenizer, pair.prompt, completion)
            except ConfigError as e:
                if e.field != "chat_template":
                    raise
                raise ConfigError("data", pair.source, e.problem) from None
            if len(ids) > width:
                side = _cut(ids, marks, width, truncation_mode, pair.source, name)
                if side is None:
                    break
                (ids, marks), cut = side, cut + 1
            if not marks[1:].any():
                raise ConfigError("data", pair.source, f"the {name} completion has no token "
                                  "to train after rendering")
            sides.append((ids, marks))
        if len(sides) == 2:
            kept += sides
    pad = padding_id(tokenizer)
    tokens = np.full((len(kept), width), pad, np.int32)
    mask = np.zeros((len(kept), width), np.int32)
    for row, (ids, marks) in enumerate(kept):
        tokens[row, :len(ids)], mask[row, :len(ids)] = ids, marks
    return Packed(tokens, mask, None, examples=len(kept), truncated=cut,
                  filled=sum(len(ids) for ids, _ in kept))


def load_pairs(path: str | None, model, *, seq_len: int | None = None,
               val_fraction: float = VAL_FRACTION,
               truncation_mode: str | None = None) -> Dataset:
    """The run's training and validation pairs (see the module docstring; :func:`read_pairs`:
    JSONL, Parquet or Arrow) as a :class:`~effijax.sources.Dataset` of format ``"pairs"``;
    ``truncation_mode``: :func:`pair_rows`' (part of the data's fingerprint when given)."""
    seq_len = model.seq_len if seq_len is None else seq_len
    if path is None:
        raise ConfigError("data", path, "a preference objective (dpo, simpo, orpo) trains on "
                          "{\"prompt\", \"chosen\", \"rejected\"} records: --data PAIRS "
                          "(.jsonl, .parquet, .arrow or a folder of them)")
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ConfigError("data", path, f"preference pairs are tokenized by the model's "
                          f"tokenizer, and {model.name} has none: train from one (e.g. --from "
                          "smollm2)")
    pairs = read_pairs(path)
    train, val = split_records(pairs, val_fraction)
    train_rows = pair_rows(tokenizer, train, seq_len, truncation_mode)
    val_rows = pair_rows(tokenizer, val, seq_len, truncation_mode)
    for name, rows, given in (("training", train_rows, train), ("validation", val_rows, val)):
        if not len(rows):
            raise ConfigError("data", path, f"each of the {len(given)} {name} pairs has a "
                              f"prompt that fills a row of {seq_len + 1} tokens "
                              "(--truncation-mode keep_start drops those): raise --seq-len")
    how = "chat template" if tokenizer.chat_template is not None else "plain text"
    dropped = len(pairs) - (len(train_rows) + len(val_rows)) // 2
    cut = "" if truncation_mode is None else (
        f"; {train_rows.truncated + val_rows.truncated} sides cut ({truncation_mode})"
        + (f", {dropped} pairs dropped (their prompt fills a row)" if dropped else ""))
    note = (f"preference pairs ({how}): {len(train_rows) // 2} training and "
            f"{len(val_rows) // 2} validation pairs, rows of {seq_len + 1} tokens (chosen at "
            f"2i, rejected at 2i+1){cut}")
    fingerprint = records_fingerprint(pairs)
    if truncation_mode is not None:  # other rows from the same records
        fingerprint = f"{fingerprint}:{truncation_mode}"
    return Dataset(train_rows, val_rows, fingerprint, "pairs",
                   train_rows.filled + val_rows.filled, note)


class ScoredPairs(NamedTuple):
    """Pair rows (:func:`pair_rows`) with the reference's summed log-probability of each row's
    completion (f32 ``[N]``), computed once before training (DPO's
    ``--precompute-reference``); their batches carry it as ``batch["reference_logps"]``."""

    rows: Packed
    reference_logps: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)


def _take(data: Packed | ScoredPairs, index: np.ndarray) -> dict:
    """The batch of rows ``index`` (with their reference log-probabilities when scored)."""
    if isinstance(data, ScoredPairs):
        return {**packed_batch(data.rows, index),
                REFERENCE_LOGPS: data.reference_logps[index].astype(np.float32)}
    return packed_batch(data, index)


def _rows(pairs_P: np.ndarray) -> np.ndarray:
    """Rows ``2p, 2p + 1`` of each pair ``p``, interleaved."""
    return np.stack([2 * pairs_P, 2 * pairs_P + 1], axis=1).reshape(-1)


def _process_slice(batch_size: int, process_index: int, process_count: int) -> slice:
    rows = batch_size // process_count
    return slice(process_index * rows, (process_index + 1) * rows)


def pair_batch(data: Packed | ScoredPairs, *, seed: int, step: int, batch_size: int, seq_len: int,
               process_index: int = 0, process_count: int = 1) -> dict:
    """The training batch of ``step``: ``batch_size / 2`` pairs drawn with replacement by
    ``np.random.Philox(key=(seed, step))``, chosen rows at even positions."""
    del seq_len  # the rows' width, checked when they were built
    rng = np.random.Generator(np.random.Philox(key=np.array([seed, step], dtype=np.uint64)))
    picks = rng.integers(0, len(data) // 2, size=batch_size // 2)
    return _take(data, _rows(picks)[_process_slice(batch_size, process_index, process_count)])


def pair_eval_batches(data: Packed | ScoredPairs, *, batch_size: int, seq_len: int,
                      num_batches: int, process_index: int = 0,
                      process_count: int = 1) -> list[dict]:
    """Fixed validation batches: ``num_batches * batch_size / 2`` pairs spread evenly over
    the validation pairs (repeated only when there are fewer)."""
    del seq_len
    total = num_batches * (batch_size // 2)
    picks = np.linspace(0, len(data) // 2 - 1, total).round().astype(np.int64)
    rows = _process_slice(batch_size, process_index, process_count)
    step = batch_size // 2
    return [_take(data, _rows(picks[i * step:(i + 1) * step])[rows])
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
