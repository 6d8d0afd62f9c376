"""Deterministic batching: a training batch is a pure function of ``(seed, step)``.

No iterator state: :func:`batch_at` draws the window starts of step ``step`` from a Philox
generator keyed by ``(seed, step)``, so a run resumed at step ``n`` sees exactly the batches it
would have seen, whatever happened before. Under multi-process training every process draws the
same global batch and keeps its own contiguous block of rows, so the concatenation over processes
is the single-process batch. :func:`eval_batches` returns fixed, evenly spread windows.

Packed chat examples (:class:`~effijax.data.Packed`) are batched the same way with whole rows
in place of windows, and their batches carry the loss mask as ``"mask"`` and, when the rows hold
several examples, the inputs' example ids as ``"segments"`` (int32, 0 for padding): the models
keep attention within an example and derive positions that restart at each example's start from
them (the segments are the one source of truth; no separate positions are carried). The mask of a
target that begins another example than its input is 0. Windows of a text corpus carry neither
(documents joined by an end-of-text token, as in pretraining).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from effijax.data import _mixture
from effijax.data._chat import Packed, target_mask
from effijax.data._mixture import Mixture
from effijax.data._store import release_pages
from effijax.errors import ConfigError, whole_number

__all__ = ["batch_at", "eval_batches", "packed_batch", "EvalBatches", "Led"]


@dataclasses.dataclass(frozen=True)
class Led:
    """A 1-D corpus whose every window starts with ``first``: a window is ``first`` followed by
    ``seq_len`` consecutive tokens of ``tokens``, wherever it is drawn.

    For a tokenizer that starts every text with a BOS (Gemma's, Llama 2's): such a model has
    only ever seen its BOS at position 0, and a window cut from the middle of a document without
    one is far from what it knows (Gemma 3 270M's loss on windows of effijax's README: 8.1 without
    the BOS, 4.0 with it, in ``transformers``). So training and evaluation see each window as
    the model sees a text at inference. Where the corpus holds ``first`` itself (each document
    of a BOS tokenizer's stream starts with it), a window drawn at that position starts one
    token later, so no window holds ``first`` twice in a row.

    Example:
      >>> import numpy as np
      >>> batch = batch_at(Led(np.arange(10, 20), first=2), seed=0, step=0, batch_size=2,
      ...                  seq_len=4)
      >>> batch["inputs"][:, 0].tolist(), bool((batch["targets"][:, :-1] ==
      ...                                        batch["inputs"][:, 1:]).all())
      ([2, 2], True)
    """

    tokens: np.ndarray
    first: int


def _check_int(name: str, value, *, minimum: int) -> None:
    # No int32 ceiling here: seeds reach 2**64 and steps may, on the host, exceed it.
    whole_number(name, value, minimum=minimum, maximum=None)


def _check_tokens(tokens, seq_len: int) -> np.ndarray | Led:
    if isinstance(tokens, Led):
        return Led(_check_tokens(tokens.tokens, seq_len - 1), tokens.first)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        # The shape stands for the value: the repr of a whole corpus would drown the message.
        raise ConfigError("tokens", tokens.shape, "expected a 1-D corpus of token ids, not an "
                          "array of this shape")
    if tokens.size < seq_len + 1:
        raise ConfigError(
            "seq_len", seq_len, f"the corpus has {tokens.size} tokens, fewer than seq_len + 1 = "
            f"{seq_len + 1} (one window of inputs plus the shifted target); use a bigger corpus "
            "or a shorter seq_len"
        )
    return tokens


def _check_width(data: Packed, seq_len: int) -> Packed:
    if data.tokens_NW.shape[1] != seq_len + 1:
        raise ConfigError("seq_len", seq_len, f"the packed rows hold {data.tokens_NW.shape[1]} "
                          "tokens; pack them with this seq_len (rows of seq_len + 1)")
    return data


def _process_rows(batch_size: int, process_index: int, process_count: int) -> slice:
    _check_int("process_count", process_count, minimum=1)
    _check_int("process_index", process_index, minimum=0)
    if not process_index < process_count:
        raise ConfigError("process_index", process_index,
                          f"must be in [0, process_count={process_count})")
    if batch_size % process_count:
        raise ConfigError(
            "batch_size", batch_size, f"not divisible by process_count={process_count}; each "
            "process takes batch_size // process_count rows of the global batch"
        )
    rows = batch_size // process_count
    return slice(process_index * rows, (process_index + 1) * rows)


def _check_packed(data: Packed) -> Packed:
    if not len(data):
        raise ConfigError("data", 0, "packed rows: no example to batch")
    return data


def packed_batch(data: Packed, index: np.ndarray, real_B: np.ndarray | None = None
                 ) -> dict[str, np.ndarray]:
    """The batch of rows ``index`` of ``data``: inputs, targets, mask and (when the rows have
    them) segments; rows where ``real_B`` is False are kept but not trained (mask 0).

    Example:
      >>> import numpy as np
      >>> from effijax.data import pack_examples
      >>> ex = [(np.array([1, 2, 3]), np.array([0, 1, 1])), (np.array([4, 5]), np.array([0, 1]))]
      >>> batch = packed_batch(pack_examples(ex, 4, pad_id=0), np.array([0]))
      >>> batch["inputs"].tolist(), batch["segments"].tolist(), batch["mask"].tolist()
      ([[1, 2, 3, 4]], [[1, 1, 1, 2]], [[1, 1, 0, 1]])
    """
    tokens_BW, mask_BW = data.tokens_NW[index], data.mask_NW[index]
    segments_BW = None if data.segments_NW is None else data.segments_NW[index]
    mask_BS = target_mask(mask_BW, segments_BW).astype(np.int32)
    if real_B is not None:
        mask_BS = mask_BS * real_B[:, None].astype(np.int32)
    batch = {"inputs": tokens_BW[:, :-1], "targets": tokens_BW[:, 1:], "mask": mask_BS}
    if segments_BW is not None:
        batch["segments"] = segments_BW[:, :-1].astype(np.int32)
    return batch



def _starts(tokens: np.ndarray | Led, seq_len: int) -> int:
    """How many windows of ``seq_len + 1`` tokens a (checked) corpus has to draw from."""
    if isinstance(tokens, Led):
        return tokens.tokens.size - seq_len + 1
    return tokens.size - seq_len


def _windows(tokens: np.ndarray | Led, starts: np.ndarray, seq_len: int
             ) -> dict[str, np.ndarray]:
    if isinstance(tokens, Led):
        # A window whose body would start at a document's own ``first`` (its BOS) starts one
        # token later (one earlier at the corpus' last start): never ``first`` twice in a row.
        doubled = tokens.tokens[starts] == tokens.first
        last = tokens.tokens.size - seq_len
        starts = np.where(doubled, np.where(starts < last, starts + 1, np.maximum(starts - 1, 0)),
                          starts)
        body_BW = _windows(tokens.tokens, starts, seq_len - 1)
        first_B1 = np.full((len(starts), 1), tokens.first, np.int32)
        inputs = np.concatenate([first_B1, body_BW["inputs"]], axis=1)
        return {"inputs": inputs, "targets": np.concatenate(
            [inputs[:, 1:], body_BW["targets"][:, -1:]], axis=1)}
    windows_BW = tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    release_pages(tokens)  # a mapped store's: its RSS stays one batch's
    return {"inputs": windows_BW[:, :-1], "targets": windows_BW[:, 1:]}


def batch_at(
    tokens: np.ndarray | Packed,
    *,
    seed: int,
    step: int,
    batch_size: int,
    seq_len: int,
    process_index: int = 0,
    process_count: int = 1,
) -> dict[str, np.ndarray]:
    """The training batch of ``step``: ``batch_size`` random windows of the corpus.

    Window starts are drawn uniformly (with replacement) by
    ``np.random.Generator(np.random.Philox(key=(seed, step)))``; targets are the inputs shifted
    by one token. From :class:`~effijax.data.Packed` rows, whole rows are drawn the same way
    (their width must be ``seq_len + 1``) and the batch adds their ``"mask"`` and, for packed
    examples, ``"segments"`` (see :func:`packed_batch`). From a :class:`~effijax.data.Mixture`,
    each row first draws its corpus with the weights (:mod:`effijax.data._mixture`).

    Args:
      tokens: 1-D corpus of token ids, or packed rows.
      seed: the run's data seed (``0 <= seed < 2**64``).
      step: the training step (``>= 0``).
      batch_size: the *global* batch size.
      seq_len: window length ``S``.
      process_index: this process' index in ``[0, process_count)``.
      process_count: number of processes; must divide ``batch_size``.

    Returns:
      ``{"inputs": int32[b, S], "targets": int32[b, S]}`` (and ``"mask": int32[b, S]``, with
      ``"segments": int32[b, S]`` where the rows have them, from packed rows) with
      ``b = batch_size // process_count``: rows ``[process_index * b, (process_index + 1) * b)``
      of the global batch.

    Raises:
      ConfigError: naming the argument: a seed, step or size out of range, a ``batch_size`` that
        ``process_count`` does not divide, a corpus that is not 1-D (``tokens``) or shorter than
        ``seq_len + 1`` tokens (``seq_len``), packed rows of another width (``seq_len``).

    Example:
      >>> import numpy as np
      >>> tokens = np.arange(100, dtype=np.uint8)
      >>> batch = batch_at(tokens, seed=0, step=3, batch_size=4, seq_len=8)
      >>> batch["inputs"].shape, batch["inputs"].dtype.name
      ((4, 8), 'int32')
      >>> bool((batch["targets"][:, :-1] == batch["inputs"][:, 1:]).all())
      True
    """
    whole_number("seed", seed, minimum=0, maximum=2**64 - 1)  # Philox's key word
    _check_int("step", step, minimum=0)
    _check_int("batch_size", batch_size, minimum=1)
    _check_int("seq_len", seq_len, minimum=1)
    rows = _process_rows(batch_size, process_index, process_count)
    rng = np.random.Generator(np.random.Philox(key=np.array([seed, step], dtype=np.uint64)))
    if isinstance(tokens, Mixture):
        return _mixture_batch(tokens, rng, batch_size, seq_len, rows)
    if isinstance(tokens, Packed):
        data = _check_width(_check_packed(tokens), seq_len)
        return packed_batch(data, rng.integers(0, len(data), size=batch_size)[rows])
    tokens = _check_tokens(tokens, seq_len)
    # Every process draws the whole global batch (cheap) so that its rows are the same rows.
    starts = rng.integers(0, _starts(tokens, seq_len), size=batch_size)
    return _windows(tokens, starts[rows], seq_len)


def _check(tokens, seq_len: int):
    if isinstance(tokens, Mixture):
        return Mixture(tuple(_check(p, seq_len) for p in tokens.parts), tokens.weights)
    if isinstance(tokens, Packed):
        return _check_width(_check_packed(tokens), seq_len)
    return _check_tokens(tokens, seq_len)


def _mixture_batch(data: Mixture, rng, batch_size: int, seq_len: int, rows: slice) -> dict:
    """A mixture's batch: each row's corpus by the weights, then its window or row there."""
    data = _check(data, seq_len)

    def size_of(part):
        return len(part) if isinstance(part, Packed) else _starts(part, seq_len)

    def batch_of(part, picks):
        if isinstance(part, Packed):
            return packed_batch(part, picks)
        return _windows(part, picks, seq_len)

    which, picks = _mixture.draw(data, rng, batch_size, size_of)
    return _mixture.gather(data, which, picks, rows, batch_of)


def _spread(stop: int, total: int, lo: int, hi: int) -> np.ndarray:
    """``np.linspace(0, stop, total)[lo:hi]``, bit for bit, without the other ``total``
    values: numpy computes item ``i`` as ``i * (stop / (total - 1))`` and sets the last to
    ``stop`` (``0`` for every item when ``total`` is 1 or ``stop`` is 0).

    Example:
      >>> import numpy as np
      >>> bool((_spread(997, 60, 7, 60) == np.linspace(0, 997, 60)[7:60]).all())
      True
    """
    if total == 1 or stop == 0:
        return np.zeros(hi - lo)
    values = np.arange(lo, hi, dtype=np.float64) * (stop / (total - 1))
    if hi == total:
        values[-1] = stop
    return values


@dataclasses.dataclass(frozen=True)
class EvalBatches(Sequence):
    """The fixed evaluation batches of :func:`eval_batches`, each built when it is read: a
    thousand batches cost nothing until they are evaluated, one at a time."""

    tokens: np.ndarray | Led | Packed | Mixture
    batch_size: int
    seq_len: int
    num_batches: int
    rows: slice

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.num_batches))]
        i = range(self.num_batches)[i]  # an int in range (negative ones count from the end)
        if isinstance(self.tokens, Mixture):  # batch i from corpus i % k, spread over it
            k = len(self.tokens.parts)
            part = EvalBatches(self.tokens.parts[i % k], self.batch_size, self.seq_len,
                               len(range(i % k, self.num_batches, k)), self.rows)
            return part[i // k]
        total, lo = self.num_batches * self.batch_size, i * self.batch_size
        if isinstance(self.tokens, Packed):
            index = _spread(len(self.tokens) - 1, total, lo, lo + self.batch_size)
            return packed_batch(self.tokens, index.round().astype(np.int64)[self.rows])
        starts = _spread(_starts(self.tokens, self.seq_len) - 1, total, lo, lo + self.batch_size)
        return _windows(self.tokens, starts.astype(np.int64)[self.rows], self.seq_len)


def eval_batches(
    tokens: np.ndarray | Packed,
    *,
    batch_size: int,
    seq_len: int,
    num_batches: int,
    process_index: int = 0,
    process_count: int = 1,
) -> EvalBatches:
    """Fixed evaluation batches: ``num_batches * batch_size`` windows spread evenly over the corpus.

    The same arguments always give the same batches (no seed). Windows overlap only when the
    corpus is shorter than ``num_batches * batch_size * (seq_len + 1)`` tokens. From
    :class:`~effijax.data.Packed` rows: evenly spread rows (repeated only when there are fewer
    than ``num_batches * batch_size``), with their ``"mask"`` (and ``"segments"``).
    ``process_index`` and ``process_count`` slice the rows as in :func:`batch_at`. From a
    :class:`~effijax.data.Mixture`, batch ``i`` comes from corpus ``i % k`` of its ``k``.

    Returns:
      A sequence of ``num_batches`` dicts ``{"inputs": int32[b, S], "targets": int32[b, S]}``
      (:class:`EvalBatches`), each built when read: asking for 10^9 batches allocates nothing.

    Raises:
      ConfigError: naming the argument, as :func:`batch_at`.

    Example:
      >>> import numpy as np
      >>> batches = eval_batches(np.arange(200, dtype=np.uint8), batch_size=2, seq_len=4,
      ...                        num_batches=3)
      >>> len(batches), batches[0]["inputs"].tolist()
      (3, [[0, 1, 2, 3], [39, 40, 41, 42]])
      >>> len(eval_batches(np.arange(200, dtype=np.uint8), batch_size=2, seq_len=4,
      ...                  num_batches=10**9))
      1000000000
    """
    _check_int("batch_size", batch_size, minimum=1)
    _check_int("seq_len", seq_len, minimum=1)
    _check_int("num_batches", num_batches, minimum=1)
    rows = _process_rows(batch_size, process_index, process_count)
    tokens = _check(tokens, seq_len)
    return EvalBatches(tokens, batch_size, seq_len, num_batches, rows)
