"""Offline corpora and deterministic batching.

A corpus is a 1-D ``uint8`` array of byte tokens (:func:`load_corpus`; the local Python
standard library by default, so nothing is downloaded). A training batch is a pure function of
``(seed, step)`` (:func:`batch_at`), so resuming needs no iterator state, and each process of a
multi-process run takes its own rows of the same global batch.
"""

from effijax.data._batches import batch_at, eval_batches
from effijax.data._corpus import (
    DEFAULT_MAX_BYTES,
    corpus_fingerprint,
    load_corpus,
    split_corpus,
    stdlib_files,
)

__all__ = [
    "load_corpus",
    "stdlib_files",
    "DEFAULT_MAX_BYTES",
    "corpus_fingerprint",
    "split_corpus",
    "batch_at",
    "eval_batches",
]
