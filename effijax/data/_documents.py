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

A document held whole is encoded by :func:`encode_each`; a file of any size by
:func:`encode_file`, which reads it in blocks of :data:`BLOCK_BYTES` and cuts it where
:func:`encode_each` cuts the whole (:func:`line_pieces`), so both give the same ids while the
file never sits in memory (a token store is prepared this way).
"""

from __future__ import annotations

import codecs
import hashlib
import itertools
import os
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from effijax.errors import ConfigError

__all__ = ["PIECE_CHARS", "MAX_PIECE_CHARS", "BLOCK_BYTES", "end_of_text_id",
           "encode_documents", "encode_each", "encode_file", "decode_text", "line_pieces",
           "cuts_lines", "documents_fingerprint"]

_END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>")
#: Characters of text given to the tokenizer at once: about 150 MB of its memory.
PIECE_CHARS = 2**20
#: The longest piece a document may keep where it cannot be cut (no line end to cut at, or a
#: tokenizer that must see the text whole): about 600 MB of the tokenizer's memory.
MAX_PIECE_CHARS = 4 * 2**20
#: Bytes of a file read at once by :func:`encode_file`.
BLOCK_BYTES = 2**20
# Byte-order marks, longest first (UTF-32's starts with UTF-16's).
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be"),
         (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))


def line_pieces(text: str, size: int) -> list[str]:
    """``text`` cut into pieces of about ``size`` characters, each cut right before a newline
    that follows a letter or digit, or right after a single newline between a non-space and a
    letter or digit (``".\\nThe"``).

    Every pre-tokenizer effijax knows ends a piece at both places and starts the next one
    without looking back: before such a newline (after a word), and after a lone newline that
    follows punctuation (GPT-2 keeps that newline alone, Llama 3's
    ``[^\\s\\p{L}\\p{N}]+[\\r\\n]*`` takes it along with the punctuation; a word follows).
    Cutting before other whitespace would not do (GPT-2's ``\\s+(?!\\S)`` looks ahead past a
    run of spaces), nor between newlines (Llama 3's ``\\s*[\\r\\n]+`` takes them all).
    (:meth:`effijax.models.Tokenizer.pieces` cuts with it where its pre-tokenizer allows.)

    Example:
      >>> line_pieces("ab.\\ncd\\nef", 1)
      ['ab.\\n', 'cd', '\\nef']
    """
    chunks, start = [], 0
    while len(text) - start > size:
        cut = text.find("\n", start + size)
        while cut != -1:
            if text[cut - 1].isalnum():
                break
            if (cut + 1 < len(text) and text[cut + 1].isalnum()
                    and not text[cut - 1].isspace()):
                cut += 1
                break
            cut = text.find("\n", cut + 1)
        if cut == -1:
            break
        chunks.append(text[start:cut])
        start = cut
    chunks.append(text[start:])
    return chunks


def cuts_lines(tokenizer) -> bool:
    """Whether ``tokenizer`` takes a long text in :func:`line_pieces` (its ``pieces`` cuts
    one), rather than whole.

    Example:
      >>> from effijax.models import byte_level_bpe
      >>> cuts_lines(byte_level_bpe(["a", "b", "Ċ"], []))
      True
    """
    return len(tokenizer.pieces("a\nb", 1)) > 1


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
        raise _uncut(tokenizer, name, f"{len(longest):,}")
    return pieces


def _uncut(tokenizer, name: str, length: str) -> ConfigError:
    """The error for a stretch of ``length`` characters the tokenizer would be given whole."""
    why = ("has a stretch of {} characters without a line end to cut at (a newline after a "
           "letter, digit or punctuation)" if cuts_lines(tokenizer) else "has {} characters, "
           "and this tokenizer cannot be given a text in pieces (it would encode them unlike "
           "the whole)")
    return ConfigError("data", name, why.format(length) + f"; effijax gives the tokenizer at "
                       f"most {MAX_PIECE_CHARS:,} characters at once (it needs about 150 bytes "
                       "a character): break the text into lines or files")


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


def _utf8_cut(data: bytes) -> int:
    """Where ``data`` may be cut without parting a character from its continuation bytes:
    before a trailing lead byte (and the continuation bytes after it), else at its end."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return len(data)
        if byte >= 0xC0:
            return len(data) - back
    return len(data)  # four continuation bytes: none of them joins what follows


def _not_utf8(name: str, at: int, byte: int, failed: bytes, carry: bytes,
              rest: Iterator[bytes], size: int) -> ConfigError:
    """:func:`decode_text`'s error for the whole document: its bad bytes counted in the part
    that ``failed``, the ``carry`` after it and the blocks left (read to the end, one at a
    time); ``size``: the document's bytes up to ``carry``."""
    def bad(data: bytes) -> int:
        return len(data) - len(data.decode("utf-8", "ignore").encode("utf-8"))

    count = bad(failed)
    for block in rest:
        data = carry + block
        cut = _utf8_cut(data)
        count, carry, size = count + bad(data[:cut]), data[cut:], size + len(block)
    count += bad(carry)
    return ConfigError("data", name, f"is not UTF-8 text: byte {at + 1:,} is 0x{byte:02X} "
                       f"({count:,} of its {size:,} bytes are not UTF-8; Latin-1 or "
                       "Windows-1252?); convert it, e.g. iconv -f latin1 -t utf-8")


def _marked(decoder, blocks: Iterator[bytes], bom: bytes, encoding: str,
            name: str) -> Iterator[str]:
    """The text after a UTF-16/32 byte-order mark, decoded block by block."""
    fed = 0  # bytes given to the decoder, after the mark
    for block in itertools.chain(blocks, [None]):
        pending = len(decoder.getstate()[0])
        try:
            yield decoder.decode(b"" if block is None else block, final=block is None)
        except UnicodeDecodeError as e:
            kind = encoding[:6].upper()
            at = fed - pending + e.start + len(bom)
            raise ConfigError("data", name, f"starts with a {kind} byte-order mark but byte "
                              f"{at + 1:,} is not {kind}; save it as UTF-8") from None
        fed += 0 if block is None else len(block)


def _texts(blocks: Iterable[bytes], name: str) -> Iterator[str]:
    """The text of a document given in blocks of bytes, decoded as :func:`decode_text`
    decodes the whole (the same text, the same errors), one block at a time."""
    blocks = iter(blocks)
    head = b""
    for block in blocks:  # enough bytes to see the longest byte-order mark
        head += block
        if len(head) >= 4:
            break
    for bom, encoding in _BOMS:
        if head.startswith(bom):
            decoder = codecs.getincrementaldecoder(encoding)("strict")
            yield from _marked(decoder, itertools.chain([head[len(bom):]], blocks), bom,
                               encoding, name)
            return
    carry, done = b"", 0  # done: the document's bytes before carry
    for block in itertools.chain([head], blocks, [None]):  # None: the end
        data = carry + (block or b"")
        cut = len(data) if block is None else _utf8_cut(data)
        part, carry = data[:cut], data[cut:]
        try:
            yield part.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _not_utf8(name, done + e.start, part[e.start], part, carry, blocks,
                            done + len(data)) from None
        done += len(part)


def _stream_pieces(tokenizer, texts: Iterable[str], name: str) -> Iterator[str]:
    """The pieces :func:`_pieces` cuts the whole text into, from its consecutive parts: a
    buffer is cut as the whole would be (:func:`line_pieces` decides each cut from the
    characters on both sides of it), all but its last piece given out, which waits for the
    text after it."""
    buffer = ""
    for text in texts:
        buffer += text
        if len(buffer) > PIECE_CHARS:
            *done, buffer = tokenizer.pieces(buffer, PIECE_CHARS)
            yield from _checked(tokenizer, done, name)
            if len(buffer) > MAX_PIECE_CHARS:
                raise _uncut(tokenizer, name, f"more than {MAX_PIECE_CHARS:,}")
    yield from _checked(tokenizer, tokenizer.pieces(buffer, PIECE_CHARS)
                        if len(buffer) > PIECE_CHARS else [buffer], name)


def _checked(tokenizer, pieces: list[str], name: str) -> list[str]:
    longest = max(pieces, key=len, default="")
    if len(longest) > MAX_PIECE_CHARS:
        raise _uncut(tokenizer, name, f"{len(longest):,}")
    return pieces


def _blocks(path: str | os.PathLike, size: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while block := f.read(size):
            yield block


def encode_file(tokenizer, path: str | os.PathLike, name: str | None = None, *,
                block_bytes: int = BLOCK_BYTES) -> Iterator[np.ndarray]:
    """The ids of one text file as :func:`encode_each` gives the file's bytes (BOS where the
    tokenizer adds one, the text, the end-of-text id), in consecutive arrays, reading the file
    ``block_bytes`` at a time: neither the file nor its ids are ever held whole. The text is
    decoded and cut into the pieces :func:`encode_each` cuts (the same ids, the same errors).
    ``tokenizer=None``: the file's bytes (``uint8``), the byte models' tokens.

    Raises:
      ConfigError: ``field="data"``, value ``name`` (default: the path): as
        :func:`encode_each`.

    Example:
      >>> import pathlib, tempfile
      >>> from effijax.models import byte_level_bpe
      >>> tok = byte_level_bpe(["a", "b", "ab", "<|endoftext|>"], ["a b"],
      ...                      token_types=[1, 1, 1, 3])
      >>> f = pathlib.Path(tempfile.mkdtemp()) / "a.txt"
      >>> _ = f.write_bytes(b"abba")
      >>> [ids.tolist() for ids in encode_file(tok, f, block_bytes=3)]  # the text, then <eot>
      [[2, 1, 0], [3]]
      >>> whole = encode_each(tok, [b"abba"])[0]
      >>> np.concatenate(list(encode_file(tok, f))).tolist() == whole.tolist()
      True
    """
    name = str(path) if name is None else name
    blocks = _blocks(path, block_bytes)
    if tokenizer is None:
        for block in blocks:
            yield np.frombuffer(block, np.uint8)
        return
    if tokenizer.add_bos and tokenizer.bos_id is not None:
        yield np.asarray([tokenizer.bos_id], np.int32)
    pieces = _stream_pieces(tokenizer, _texts(blocks, name), name)
    group, size = [], 0
    for piece in itertools.chain(pieces, [None]):  # None: the end, the last group encoded
        if group and (piece is None or size + len(piece) > PIECE_CHARS):
            for e in tokenizer.backend.encode_batch(group, add_special_tokens=False):
                yield np.asarray(e.ids, np.int32)
            group, size = [], 0
        if piece is not None:
            group.append(piece)
            size += len(piece)
    yield np.asarray([end_of_text_id(tokenizer)], np.int32)


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
