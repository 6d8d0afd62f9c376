"""Real pretrained models in and out: GGUF files and Hugging Face directories, the tokenizer,
and exports that Hugging Face loads.

* :func:`load_pretrained` reads a model of a registered family (Llama, Qwen2: see
  :class:`~effijax.models.PretrainedFormat`), a ``.gguf`` file (:func:`load_gguf`; quantized
  tensors are dequantized) or a Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``
  directory (:func:`load_hf`), into ``(config, params)``, parameter by parameter, straight onto
  the shardings asked for. Llama 3's rotary scaling is read from either: ``config.json``'s
  ``llama3`` rope type, or the ``rope_freqs.weight`` tensor llama.cpp's converter writes.
  The config carries the tokenizer (``config.encode(data)`` tokenizes).
* :func:`save_hf` writes a directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads
  (weights, ``config.json``, tokenizer files with the chat template), LoRA adapters merged in if
  given; :func:`save_peft` writes the adapters alone for ``peft.PeftModel.from_pretrained``;
  :func:`save_gguf` writes one GGUF file (f32, f16, bf16 or a block quantization such as
  ``q8_0``) that llama.cpp, Ollama and ``transformers`` load, adapters merged in (Llama 3's
  rotary scaling as ``rope_freqs.weight``).

Every file is checked before it is trusted (GGUF layouts, safetensors headers, ``config.json``,
tokenizer files, shard indexes that must stay inside the model directory); a bad one is one
:class:`effijax.errors.FileError` naming the file, the field or offset and what was expected.
``gguf``, ``tokenizers`` and ``safetensors`` are imported when a function needs them.

Example:
  >>> import tempfile, jax
  >>> from effijax.models import llama_config
  >>> model = llama_config("llama-tiny")
  >>> params = model.init_params(jax.random.key(0))
  >>> directory = tempfile.mkdtemp()
  >>> save_hf(directory, model, params)
  ['model.safetensors', 'config.json', 'generation_config.json']
  >>> loaded, loaded_params = load_pretrained(directory, seq_len=model.seq_len)
  >>> loaded == model, bool(jax.tree.all(jax.tree.map(lambda a, b: (a == b).all(),
  ...                                                 loaded_params, params)))
  (True, True)
"""

from effijax._lazy import attach

# Each name is imported from its module on first use (the package convention, see
# effijax/_lazy.py): importing the package costs only what is used.
__getattr__, __dir__, __all__ = attach(__name__, {
    "effijax.interop._files": ("is_gguf", "model_file"),
    "effijax.interop._gguf": ("gguf_config", "gguf_kept_bytes", "gguf_tokenizer", "load_gguf",
        "permute", "unpermute"),
    "effijax.interop._gguf_check": ("gguf_value",),
    "effijax.interop._gguf_types": ("GGUF_DTYPES",),
    "effijax.interop._gguf_write": ("gguf_format", "gguf_tokenizer_fields", "save_gguf"),
    "effijax.interop._hf": ("config_from_hf", "hf_config", "load_hf", "save_hf"),
    "effijax.interop._io": ("export_adapters", "load_pretrained", "load_tokenizer", "peft_module",
        "read_config", "save_peft", "weight_files"),
    "effijax.interop._weights": ("TENSORS", "gguf_name", "hf_name"),
})
