"""Weighted mixtures of corpora, batched as a pure function of ``(seed, step)``.

A :class:`Mixture` holds several corpora of one kind (token streams, or packed rows) and their
weights. Each row of a training batch first picks its corpus with the weights, then its window
(or row) in that corpus, all from the step's Philox generator (:func:`mixture_batch`): the
same ``(seed, step)`` always gives the same batch, and every process draws the whole global
choice and keeps its own rows, as for one corpus.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from effijax.errors import ConfigError

__all__ = ["Mixture", "mixture"]


class Mixture(NamedTuple):
    """Corpora (``parts``: 1-D token arrays, or :class:`~effijax.data.Packed` rows, all of one
    kind) drawn with ``weights`` (positive, summing to 1)."""

    parts: tuple
    weights: tuple[float, ...]

    def __len__(self) -> int:
        return len(self.parts)


def mixture(parts, weights) -> Mixture:
    """A :class:`Mixture` of ``parts`` with ``weights`` normalised to sum to 1.

    Weights are relative: only their ratios matter, so any finite positive floats do (weights
    whose sum overflows, ``1e308`` twice, are scaled by the largest first); a ratio
    so extreme that a weight rounds to 0 is refused (that corpus would never be drawn).

    Raises:
      ConfigError: no part, a weight that is not a positive finite number, a weight that is 0
        next to the others, as many weights as parts not given.

    Example:
      >>> import numpy as np
      >>> mixture([np.arange(10), np.arange(5)], [3, 1]).weights
      (0.75, 0.25)
      >>> mixture([np.arange(10), np.arange(5)], [1e308, 1e308]).weights
      (0.5, 0.5)
      >>> mixture([np.arange(10), np.arange(5)], [1e308, 1e-308])  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: data=[1e+308, 1e-308]: the weight 1e-308 is 0 next to ...
    """
    parts = tuple(parts)
    try:
        weights = [float(w) for w in weights]
    except (TypeError, ValueError, OverflowError):
        raise ConfigError("data", weights, "mixture weights must be positive numbers, e.g. "
                          "a:0.7,b:0.3") from None
    if not parts or len(parts) != len(weights):
        raise ConfigError("data", len(weights), f"weights for {len(parts)} corpora; give one "
                          "weight per corpus")
    if not all(np.isfinite(w) and w > 0 for w in weights):
        raise ConfigError("data", weights, "mixture weights must be positive numbers, e.g. "
                          "a:0.7,b:0.3")
    largest, scaled = max(weights), weights
    if not np.isfinite(sum(weights)):  # 1e308 + 1e308: scaled first, each to (0, 1]
        scaled = [w / largest for w in weights]
    total = sum(scaled)  # as it always was where it is finite: a run's identity keeps it
    normalised = tuple(w / total for w in scaled)
    for w, share in zip(weights, normalised, strict=True):
        if not share > 0:
            raise ConfigError("data", weights, f"the weight {w!r} is 0 next to the largest, "
                              f"{largest!r}: that corpus would never be drawn; give weights "
                              "within a factor of 1e300 of each other")
    return Mixture(parts, normalised)


def draw(data: Mixture, rng: np.random.Generator, batch_size: int, size_of) -> tuple:
    """``(which, picks)``: each global row's corpus, and for each corpus ``batch_size`` draws
    in ``[0, size_of(part))`` (a row uses the draw of its corpus at its position)."""
    which = rng.choice(len(data.parts), size=batch_size, p=np.asarray(data.weights))
    picks = [rng.integers(0, size_of(part), size=batch_size) for part in data.parts]
    return which, picks


def gather(data: Mixture, which: np.ndarray, picks: list, rows: slice, batch_of) -> dict:
    """The batch of global rows ``rows``: each built by ``batch_of(part, draws)`` from its own
    corpus, in row order."""
    which = which[rows]
    out = None
    for k, part in enumerate(data.parts):
        at = np.flatnonzero(which == k)
        if not len(at):
            continue
        sub = batch_of(part, picks[k][rows][at])
        if out is None:
            out = {key: np.zeros((len(which), *v.shape[1:]), v.dtype) for key, v in sub.items()}
        for key, v in sub.items():
            out[key][at] = v
    return out
