"""The tiny model the harness tests share: a Llama with sharp weights and the tiny chat
tokenizer (:mod:`_llama_files`), written as a GGUF file and opened as a user's model is."""

from _llama_files import VOCAB_SIZE, sharp_params, write_gguf

from effijax.models import llama_config


def write_tiny_gguf(file, seq_len: int):
    """Writes the tiny Llama (context ``seq_len``) to ``file``; returns ``file``."""
    model = llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=seq_len)
    write_gguf(file, model, sharp_params(model))
    return file
