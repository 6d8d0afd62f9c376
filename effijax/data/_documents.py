"""Text documents through a model's tokenizer: each document (file) is tokenized on its own
(after BOS where the tokenizer adds one) and followed by the end-of-text token, and the results
are concatenated into one token stream.

The separator tells the model where a document ends, so a training window that spans two files
does not read as one text. Which token that is: the tokenizer's special ``<|endoftext|>`` (or
``<|end_of_text|>``, Llama 3's spelling) when it has one, else its end-of-sequence token. A
model without a tokenizer (the byte GPT) keeps reading the corpus as raw bytes
(:func:`~effijax.data.load_corpus`), with no separator.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from effijax.errors import ConfigError

__all__ = ["end_of_text_id", "encode_documents", "encode_each", "documents_fingerprint"]

_END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>")


def end_of_text_id(tokenizer) -> int:
    """The id that ends a document (see the module docstring).

    Raises:
      ConfigError: the tokenizer has neither an end-of-text nor an end-of-sequence token.

    Example:
      >>> from effijax.models import byte_level_bpe
      >>> end_of_text_id(byte_level_bpe(["a", "<|endoftext|>"], [], token_types=[1, 3]))
      1
    """
    for name in _END_OF_TEXT:
        found = tokenizer.backend.token_to_id(name)
        if found is not None:
            return int(found)
    if tokenizer.eos_id is None:
        raise ConfigError("tokenizer", None, "has no end-of-text or end-of-sequence token to "
                          "separate documents")
    return int(tokenizer.eos_id)


def encode_documents(tokenizer, documents: Sequence[bytes]) -> np.ndarray:
    """``doc_1 <eot> doc_2 <eot> ...``: each UTF-8 document tokenized on its own (undecodable
    bytes become U+FFFD), each followed by :func:`end_of_text_id`. A tokenizer that adds BOS
    (``add_bos``: Gemma's, Llama 2's) starts each document with it, once, as ``transformers``'
    ``tokenizer(document)`` does; the post-processor's EOS is not added (the separator ends the
    document). Documents are encoded in parallel.

    Returns:
      A 1-D int32 array.

    Example:
      >>> from effijax.models import byte_level_bpe
      >>> tok = byte_level_bpe(["a", "b", "ab", "<|endoftext|>", "<s>"], ["a b"],
      ...                      token_types=[1, 1, 1, 3, 3])
      >>> encode_documents(tok, [b"ab", b"ba"]).tolist()
      [2, 3, 1, 0, 3]
      >>> tok = byte_level_bpe(["a", "b", "ab", "<|endoftext|>", "<s>"], ["a b"],
      ...                      token_types=[1, 1, 1, 3, 3], bos_id=4, add_bos=True)
      >>> encode_documents(tok, [b"ab", b"ba"]).tolist()
      [4, 2, 3, 4, 1, 0, 3]
    """
    pieces = encode_each(tokenizer, documents)
    return np.concatenate(pieces) if pieces else np.zeros(0, np.int32)


def encode_each(tokenizer, documents: Sequence[bytes]) -> list[np.ndarray]:
    """Each document's ids (after BOS where the tokenizer adds one) followed by
    :func:`end_of_text_id`, as :func:`encode_documents` concatenates them (a token store keeps
    where each one starts).

    Example:
      >>> from effijax.models import byte_level_bpe
      >>> tok = byte_level_bpe(["a", "b", "ab", "<|endoftext|>"], ["a b"],
      ...                      token_types=[1, 1, 1, 3])
      >>> [ids.tolist() for ids in encode_each(tok, [b"ab", b"ba"])]
      [[2, 3], [1, 0, 3]]
    """
    eot = np.asarray([end_of_text_id(tokenizer)], np.int32)
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    texts = [d.decode("utf-8", errors="replace") for d in documents]
    encodings = tokenizer.backend.encode_batch(texts, add_special_tokens=False)
    return [np.concatenate([np.asarray(bos + e.ids, np.int32), eot]) for e in encodings]


def documents_fingerprint(documents: Sequence[bytes]) -> str:
    """``"<n bytes>:<sha256 prefix>"`` over the documents and their boundaries.

    Example:
      >>> documents_fingerprint([b"he", b"llo"]) != documents_fingerprint([b"hel", b"lo"])
      True
    """
    digest = hashlib.sha256()
    for d in documents:
        digest.update(len(d).to_bytes(8, "little") + d)
    return f"{sum(map(len, documents))}:{digest.hexdigest()[:16]}"
