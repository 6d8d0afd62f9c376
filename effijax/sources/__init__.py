"""Where models and data come from, opened for any command: train, eval, generate, memory, plan
and data prepare share it, below the recipe (which keeps ``TrainConfig`` and the stages of
train).

A model (``_models.py``): :func:`architecture` names the model a preset, a bundled name
(:data:`BUNDLED`), a GGUF file, a Hugging Face directory or a run directory holds, without its
weights; :func:`read_pretrained` loads a pretrained one with the SHA-256 of its weights;
:func:`with_chat_template` gives it another chat template. A model opened for use
(``_open.py``): :func:`open_model` opens a run directory (its parameters, adapters and
tokenizer, from its ``config.json`` as plain values), a GGUF file, a Hugging Face directory or
``smollm2`` as an :class:`Opened` model; a LoRA run's base is checked by content
(``_bases.py``: :func:`base_changes`); :func:`export_paths` names what a run exports. Data
(``_data.py``): :func:`load_dataset` reads text, chat JSONL, token stores and their mixtures
through a model, split for validation; :func:`load_eval_data` reads a file or store whole
for evaluation; :func:`prepare` (``_prepare.py``) tokenizes a corpus once into a memory-mapped
token store, and :func:`cached_store` (``_prepared.py``) keeps one in effijax's cache for
``--data`` too large (or in a table format) to read in memory. Pre-flight (``_preflight.py``):
:func:`check_memory`, :func:`check_compiled_memory` and :func:`storage` refuse, in one line
with the fix, what would fail late.

Example:
  >>> resolve_format("chat.jsonl"), mixture_spec("a.store:0.7,b.store:0.3")
  ('chat', [('a.store', 0.7), ('b.store', 0.3)])
"""

from effijax._lazy import attach

# Each name is imported from its module on first use (the package convention, see
# effijax/_lazy.py): the CLI's flag checks read BUNDLED without importing JAX.
__getattr__, __dir__, __all__ = attach(__name__, {
    "effijax.sources._models": ("Bundled", "BUNDLED", "MAX_CONFIG_BYTES", "ModelSource",
        "RENAMED_SETTINGS", "current_names",
        "architecture", "bundled_path", "cache_root", "check_run_dir", "check_template_file",
        "is_pretrained",
        "missing_source", "read_pretrained", "tokenizer_with_template", "with_chat_template"),
    "effijax.sources._data": ("Dataset", "VAL_FRACTION", "load_dataset", "load_eval_data",
        "mixture_spec", "no_chat_template", "padding_id", "resolve_format", "template_digest",
        "text_rows"),
    "effijax.sources._prepare": ("MIN_SHARD_BYTES", "SHARD_BYTES", "SHARDS_WANTED",
        "default_shard_bytes", "prepare", "prepare_tokenizer", "work_dir"),
    "effijax.sources._prepared": ("MEMORY_BYTES", "cached_store", "check_sources", "in_memory",
        "needs_preparing", "stores_dir", "training_data", "waiting_lock"),
    "effijax.sources._open": ("Opened", "open_model", "export_paths", "missing_exports"),
    "effijax.sources._bases": ("base_changes", "compared_origin", "short_digest",
        "weight_file_changes"),
    "effijax.sources._preflight": ("check_compiled_memory", "check_memory", "checkpoint_folder",
        "device_budget", "state_bytes", "step_bytes", "storage"),
})
