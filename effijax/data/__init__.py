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

A corpus too large for memory is tokenized once into a store (:mod:`effijax.data._store`: flat
token arrays and a manifest, memory-mapped when trained on) from text, JSONL, Parquet or Arrow
files (:mod:`effijax.data._tables`; a text file read and tokenized in blocks by
:func:`encode_file`, the ids :func:`encode_each` gives it whole, so that no file is held in
memory); several corpora are drawn with weights as a :class:`Mixture`.

Training builds the batches of the steps to come on a background thread while the step runs
(:class:`Prefetcher`): the same batches, in the same order, as building each when it is needed.

Everything read is bounded: data must be regular files or folders (a pipe or a device is
refused, :func:`regular_path`), a JSONL record is one line of at most :data:`MAX_RECORD_BYTES`,
and a chat template renders within :data:`RENDER_SECONDS` and :data:`MAX_RENDERED_CHARS`
(:func:`compile_template`).
"""

from effijax._lazy import attach

# Each name is imported from its module on first use (the package convention, see
# effijax/_lazy.py): importing the package costs only what is used.
__getattr__, __dir__, __all__ = attach(__name__, {
    "effijax.data._batches": ("Led", "batch_at", "eval_batches", "packed_batch"),
    "effijax.data._chat": ("Packed", "Record", "pack_examples", "parse_line", "read_records",
        "records_fingerprint", "render_chat", "split_records", "table_record", "target_mask",
        "turn_end_id"),
    "effijax.data._corpus": ("DEFAULT_MAX_BYTES", "corpus_fingerprint", "document_files",
        "load_corpus", "load_documents", "split_corpus", "stdlib_files", "val_count"),
    "effijax.data._documents": ("BLOCK_BYTES", "cuts_lines", "documents_fingerprint",
        "encode_documents", "encode_each", "encode_file", "end_of_text_id", "line_pieces"),
    "effijax.data._files": ("MAX_JSON_BYTES", "MAX_RECORD_BYTES", "bounded_lines", "parse_objects",
        "read_json", "regular_path", "regular_size"),
    "effijax.data._examples": ("STDLIB_MODULES", "stdlib_qa", "write_jsonl"),
    "effijax.data._mixture": ("Mixture", "mixture"),
    "effijax.data._prefetch": ("Prefetcher",),
    "effijax.data._store": ("STORE_FORMAT", "STORE_VERSION", "Contents", "Store", "assemble",
        "commit_documents", "commit_shard", "committed_shard", "is_store", "open_store",
        "release_pages", "remove_work", "store_rows", "store_split", "token_dtype", "verify_store"),
    "effijax.data._tables": ("TABLE_SUFFIXES", "Source", "check_columns", "content_fingerprint",
        "find_sources", "plan_pieces", "read_piece", "table_rows"),
    "effijax.data._template": ("MAX_RENDERED_CHARS", "RENDER_SECONDS", "TEMPLATE_HINT",
        "compile_template"),
})
