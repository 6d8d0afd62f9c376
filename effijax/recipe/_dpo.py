"""DPO (direct preference optimisation) as a training objective, under LoRA.

The data is a JSONL file of ``{"prompt": ..., "chosen": ..., "rejected": ...}`` records. Each
side of a pair is rendered as chat data is, ``[user: prompt, assistant: completion]`` with the
model's chat template (:func:`effijax.data.render_chat`), or without a template as plain text
(the prompt's tokens, then the completion's and the end-of-text token, BOS first where the
tokenizer starts texts with one); the loss mask marks the completion's tokens only. Each pair
is two rows of ``seq_len + 1`` tokens, the chosen side at row ``2i`` and the rejected at
``2i + 1`` (padding after each, never trained); a side longer than a row is refused (raise
``--seq-len``), not cut. 5% of the pairs, chosen by their content, are held out.

A batch of ``batch_size`` rows is ``batch_size / 2`` pairs, drawn with replacement by
``(seed, step)`` as :func:`effijax.data.batch_at` draws rows. The loss
(:func:`effijax.objectives.dpo_loss`, TRL's) compares the policy's summed log-probabilities
of each completion (the base with the adapters, :func:`effijax.models.make_sequence_logps`)
with the reference's: the same base with the adapters off (zeroed: the policy's own base
arithmetic, exactly), under ``stop_gradient``, so no second copy of the base exists. Its
metrics are TRL's (``rewards/chosen``, ..., ``logps/rejected``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from effijax import lora as lora_lib
from effijax.data import (
    Packed,
    bounded_lines,
    packed_batch,
    records_fingerprint,
    render_chat,
    split_records,
)
from effijax.errors import ConfigError
from effijax.models import abstract_split, make_sequence_logps
from effijax.objectives import dpo_loss
from effijax.recipe._data import VAL_FRACTION, Dataset, _pad_id
from effijax.recipe._objective import Objective

__all__ = ["DPO", "Pair", "read_pairs", "load_pairs", "pair_batch", "pair_eval_batches"]

_KEYS = ("prompt", "chosen", "rejected")


class Pair(NamedTuple):
    """One preference pair, where it came from (``"file:line"``) and its line (``raw``)."""

    prompt: str
    chosen: str
    rejected: str
    source: str
    raw: str


def _bad(source: str, problem: str) -> ConfigError:
    return ConfigError("data", source, problem + '; expected one JSON object per line: '
                       '{"prompt": "...", "chosen": "...", "rejected": "..."}')


def _pair(line: str, source: str) -> Pair:
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        raise _bad(source, "not valid JSON") from None
    if not isinstance(obj, dict):
        raise _bad(source, f"a JSON {type(obj).__name__}, not an object")
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
    pairs = [_pair(line, f"{path}:{number}") for number, line in bounded_lines(path, "data")
             if line.strip()]
    if not pairs:
        raise ConfigError("data", str(path), "holds no pair (one JSON object per line)")
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


def _side(tokenizer, prompt: str, completion: str):
    if tokenizer.chat_template is None:
        return _plain(tokenizer, prompt, completion)
    return render_chat(tokenizer, [{"role": "user", "content": prompt},
                                   {"role": "assistant", "content": completion}])


def pair_rows(tokenizer, pairs, seq_len: int) -> Packed:
    """The pairs as rows of ``seq_len + 1`` tokens: chosen at ``2i``, rejected at ``2i + 1``."""
    width = seq_len + 1
    pad = _pad_id(tokenizer)
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
    :class:`~effijax.recipe.Dataset` of format ``"pairs"``."""
    seq_len = model.seq_len if seq_len is None else seq_len
    if path is None or Path(path).suffix.lower() != ".jsonl":
        raise ConfigError("data", path, "dpo trains on a .jsonl file of {\"prompt\", "
                          "\"chosen\", \"rejected\"} records (--data PAIRS.jsonl)")
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


def _dpo_loss(model, lora, *, sequence_parallel: bool = True, beta: float = 0.1,
              loss_type: str = "sigmoid", label_smoothing: float = 0.0):
    """DPO's loss of interleaved pair rows: the policy is the base with the adapters, the
    reference the same base without them (no gradient)."""
    if lora is None:
        raise ConfigError("objective", "dpo", "trains LoRA adapters against the base with the "
                          "adapters off; pass lora= (--lora-rank R)")
    graphdef, _ = abstract_split(model)
    policy = make_sequence_logps(graphdef, lora, sequence_parallel=sequence_parallel,
                                 frozen_base=True)

    def loss(params, batch, rng=None):
        logps_B, counts_B = policy(params, batch, rng)
        # The adapters off: the same frozen base through the same function with zero adapters
        # (their products are exact zeros), so the reference's arithmetic is the policy's own
        # base arithmetic (on a CPU, a 16-bit base's kept bits) and policy == reference at
        # the adapters' init (B = 0) bit for bit; no dropout (rng None), no gradient.
        off = {"base": params["base"],
               "adapters": jax.tree.map(jnp.zeros_like, params["adapters"])}
        ref_B = jax.lax.stop_gradient(policy(off, batch)[0])
        return dpo_loss(logps_B[0::2], logps_B[1::2], ref_B[0::2], ref_B[1::2], beta=beta,
                        loss_type=loss_type, label_smoothing=label_smoothing,
                        chosen_counts=counts_B[0::2], rejected_counts=counts_B[1::2])

    return lora_lib.freeze_base(loss)


DPO = Objective("dpo", _dpo_loss, batch=pair_batch, eval_batches=pair_eval_batches,
                metric=None, token_mean=False, needs_lora=True)
