"""GGUF's names that effijax reads and writes: the tensor types it writes
(:func:`~effijax.interop.save_gguf`), by the name a user gives (``--export-gguf q8_0``), and
the hyperparameter keys of a Llama-block file. A module of its own, importing nothing:
checking a run's config must not import jax."""

__all__ = ["GGUF_DTYPES", "GGUF_HYPERPARAMETERS"]

#: ``{architecture}.KEY`` -> (the config field it holds, its type), as llama.cpp names them:
#: what :func:`~effijax.interop.load_gguf` reads and :func:`~effijax.interop.save_gguf`
#: writes for every Llama-block family (a family's own keys come from its format).
GGUF_HYPERPARAMETERS: dict[str, tuple[str, type]] = {
    "context_length": ("max_position", int),
    "embedding_length": ("d_model", int),
    "block_count": ("n_layers", int),
    "feed_forward_length": ("d_ff", int),
    "attention.head_count": ("n_heads", int),
    "attention.head_count_kv": ("n_kv_heads", int),
    "attention.key_length": ("head_dim", int),
    "attention.value_length": ("head_dim", int),
    "rope.dimension_count": ("head_dim", int),
    "rope.freq_base": ("rope_theta", float),
    "attention.layer_norm_rms_epsilon": ("rms_eps", float),
    "vocab_size": ("vocab_size", int),
}

#: name -> (``gguf.GGMLQuantizationType`` of the matrices, ``gguf.LlamaFileType`` of the file).
GGUF_DTYPES: dict[str, tuple[str, str]] = {
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q5_1": ("Q5_1", "MOSTLY_Q5_1"),
    "q5_0": ("Q5_0", "MOSTLY_Q5_0"),
    "q4_1": ("Q4_1", "MOSTLY_Q4_1"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
}
