"""Text documents through a model's tokenizer: each document (file) is tokenized on its own
(after BOS where the tokenizer adds one) and followed by the end-of-text token, and the results
are concatenated into one token stream.

The separator tells the model where a document ends, so a training window that spans two files
does not read as one text. Which token that is: the tokenizer's special ``<|endoftext|>`` (or
``<|end_of_text|>``, Llama 3's spelling) when it has one, else its end-of-sequence token. A
model without a tokenizer (the byte GPT) keeps reading the corpus as raw bytes
(:func:`~effijax.data.load_corpus`), with no separator.

A document is text: UTF-8, or UTF-16/32 after a byte-order mark (:func:`decode_text`); other
bytes are refused, naming the first one and how many there are (a Latin-1 file would otherwise
train as replacement characters). A long document reaches the tokenizer in pieces of about
:data:`PIECE_CHARS` characters, cut where its pre-tokenizer splits anyway
(:meth:`~effijax.models.Tokenizer.pieces`: the ids are those of the whole), so the
tokenizer's memory stays bounded whatever the file; a stretch it cannot cut that is longer than
:data:`MAX_PIECE_CHARS` (one 200 MB line) is refused rather than handed over whole.
"""

from __future__ import annotations

import codecs
import hashlib
from collections.abc import Iterator, Sequence

import numpy as np

from effijax.errors import ConfigError

__all__ = ["PIECE_CHARS", "MAX_PIECE_CHARS", "end_of_text_id", "encode_documents",
           "encode_each", "decode_text", "documents_fingerprint"]

_END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>")
#: Characters of text given to the tokenizer at once: about 150 MB of its memory.
PIECE_CHARS = 2**20
#: The longest piece a document may keep where it cannot be cut (no line end to cut at, or a
#: tokenizer that must see the text whole): about 600 MB of the tokenizer's memory.
MAX_PIECE_CHARS = 4 * 2**20
# Byte-order marks, longest first (UTF-32's starts with UTF-16's).
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be"),
         (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))


def decode_text(document: bytes, name: str) -> str:
    """``document`` as text (see the module docstring): UTF-8, or UTF-16/32 with its mark.

    Raises:
      ConfigError: ``field="data"``, value ``name``: the bytes are not UTF-8 (nor UTF-16/32
        after such a mark).

    Example:
      >>> decode_text("héllo".encode("utf-16"), "a.txt")
      'héllo'
      >>> decode_text("héllo".encode("latin-1"), "a.txt")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      effijax.errors.ConfigError: data='a.txt': is not UTF-8 text: byte 2 is 0xE9 (1 of its 5 \
bytes are not UTF-8; Latin-1 or Windows-1252?); convert it, e.g. iconv -f latin1 -t utf-8
    """
    for bom, encoding in _BOMS:
        if document.startswith(bom):
            try:
                return document[len(bom):].decode(encoding)
            except UnicodeDecodeError as e:
                kind = encoding[:6].upper()
                raise ConfigError("data", name, f"starts with a {kind} byte-order mark but "
                                  f"byte {e.start + len(bom) + 1:,} is not {kind}; save it as "
                                  "UTF-8") from None
    try:
        return document.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = len(document) - len(document.decode("utf-8", "ignore").encode("utf-8"))
        raise ConfigError("data", name, f"is not UTF-8 text: byte {e.start + 1:,} is "
                          f"0x{document[e.start]:02X} ({bad:,} of its {len(document):,} bytes are "
                          "not UTF-8; Latin-1 or Windows-1252?); convert it, e.g. iconv -f "
                          "latin1 -t utf-8") from None


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


def encode_documents(tokenizer, documents: Sequence[bytes], *,
                     names: Sequence[str] | None = None) -> np.ndarray:
    """``doc_1 <eot> doc_2 <eot> ...``: each document tokenized on its own (decoded and cut
    into pieces as the module docstring says), each followed by :func:`end_of_text_id`. A
    tokenizer that adds BOS (``add_bos``: Gemma's, Llama 2's) starts each document with it,
    once, as ``transformers``' ``tokenizer(document)`` does; the post-processor's EOS is not
    added (the separator ends the document). Documents are encoded in parallel.

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
    pieces = encode_each(tokenizer, documents, names=names)
    return np.concatenate(pieces) if pieces else np.zeros(0, np.int32)


def _pieces(tokenizer, text: str, name: str) -> list[str]:
    """``text`` in the pieces the tokenizer may take one at a time
    (:meth:`~effijax.models.Tokenizer.pieces`), none over :data:`MAX_PIECE_CHARS`."""
    pieces = tokenizer.pieces(text, PIECE_CHARS) if len(text) > PIECE_CHARS else [text]
    longest = max(pieces, key=len)
    if len(longest) > MAX_PIECE_CHARS:
        cuttable = len(tokenizer.pieces("a\nb", 1)) > 1
        why = ("has a stretch of {:,} characters without a line end to cut at (a newline "
               "after a letter, digit or punctuation)" if cuttable else "has {:,} characters, "
               "and this tokenizer cannot be given a text in pieces (it would encode them "
               "unlike the whole)")
        raise ConfigError("data", name, why.format(len(longest)) + f"; effijax gives the "
                          f"tokenizer at most {MAX_PIECE_CHARS:,} characters at once (it needs "
                          "about 150 bytes a character): break the text into lines or files")
    return pieces


def _batches(texts: Sequence[str]) -> Iterator[list[str]]:
    """``texts`` in consecutive groups of at most :data:`PIECE_CHARS` characters (or one text):
    encoded together on every core, in bounded memory."""
    group, size = [], 0
    for text in texts:
        if group and size + len(text) > PIECE_CHARS:
            yield group
            group, size = [], 0
        group.append(text)
        size += len(text)
    if group:
        yield group


def encode_each(tokenizer, documents: Sequence[bytes], *,
                names: Sequence[str] | None = None) -> list[np.ndarray]:
    """Each document's ids (after BOS where the tokenizer adds one) followed by
    :func:`end_of_text_id`, as :func:`encode_documents` concatenates them (a token store keeps
    where each one starts). Documents are decoded with :func:`decode_text` and tokenized in
    pieces (see the module docstring).

    Raises:
      ConfigError: ``field="data"``, value the document's name (``names[i]``, else ``"document
        i of n"``): it is not UTF-8, or cannot be cut into pieces the tokenizer can take.

    Example:
      >>> from effijax.models import byte_level_bpe
      >>> tok = byte_level_bpe(["a", "b", "ab", "<|endoftext|>"], ["a b"],
      ...                      token_types=[1, 1, 1, 3])
      >>> [ids.tolist() for ids in encode_each(tok, [b"ab", b"ba"])]
      [[2, 3], [1, 0, 3]]
    """
    eot = np.asarray([end_of_text_id(tokenizer)], np.int32)
    bos = np.asarray([tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None
                     else [], np.int32)
    owners, texts = [], []
    for i, document in enumerate(documents):
        name = names[i] if names is not None else f"document {i + 1} of {len(documents)}"
        pieces = _pieces(tokenizer, decode_text(document, name), name)
        owners += [i] * len(pieces)
        texts += pieces
    ids: list[list[np.ndarray]] = [[bos] for _ in documents]
    at = 0
    for group in _batches(texts):
        for e in tokenizer.backend.encode_batch(group, add_special_tokens=False):
            ids[owners[at]].append(np.asarray(e.ids, np.int32))
            at += 1
    return [np.concatenate([*parts, eot]) for parts in ids]


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
