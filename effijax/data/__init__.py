"""Offline corpora and deterministic batching.

A corpus is a 1-D ``uint8`` array of byte tokens (:func:`load_corpus`; the local Python
standard library by default, so nothing is downloaded). A training batch is a pure function of
``(seed, step)`` (:func:`batch_at`), so resuming needs no iterator state, and each process of a
multi-process run takes its own rows of the same global batch.

With a model's tokenizer, text files are documents joined by the end-of-text token
(:func:`encode_documents`), and chat / instruction JSONL (:func:`read_records`) is rendered with
the model's chat template (:func:`render_chat`: the mask marks the assistant's tokens) and packed
into rows (:func:`pack_examples`) that :func:`batch_at` draws with their mask and their examples'
ids (``"segments"``: packed examples do not see each other, positions restart at each one).
:func:`stdlib_qa` builds an instruction set offline (questions about the standard library,
answered from the interpreter).
"""

from effijax.data._batches import batch_at, eval_batches, packed_batch
from effijax.data._chat import (
    Packed,
    Record,
    pack_examples,
    read_records,
    records_fingerprint,
    render_chat,
    split_records,
)
from effijax.data._corpus import (
    DEFAULT_MAX_BYTES,
    corpus_fingerprint,
    load_corpus,
    load_documents,
    split_corpus,
    stdlib_files,
)
from effijax.data._documents import documents_fingerprint, encode_documents, end_of_text_id
from effijax.data._examples import STDLIB_MODULES, stdlib_qa, write_jsonl

__all__ = [
    "load_corpus",
    "load_documents",
    "encode_documents",
    "end_of_text_id",
    "documents_fingerprint",
    "Record",
    "Packed",
    "read_records",
    "render_chat",
    "pack_examples",
    "split_records",
    "records_fingerprint",
    "stdlib_qa",
    "STDLIB_MODULES",
    "write_jsonl",
    "stdlib_files",
    "DEFAULT_MAX_BYTES",
    "corpus_fingerprint",
    "split_corpus",
    "batch_at",
    "eval_batches",
    "packed_batch",
]
