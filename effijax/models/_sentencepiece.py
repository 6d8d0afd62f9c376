"""SentencePiece vocabularies (Gemma's, Llama 2's) as BPE tokenizers, from tokens and scores.

A SentencePiece BPE vocabulary is what a GGUF file with ``tokenizer.ggml.model = 'llama'``
stores: tokens, a score per token and llama.cpp's token types, no merge list. llama.cpp
tokenizes it by writing spaces as ``▁`` (U+2581), starting from one symbol per character and
merging the adjacent pair whose concatenation is the best-scoring token until no pair is a
token; a character that is no token becomes one ``<0xNN>`` token per UTF-8 byte.
:func:`sentencepiece_bpe` writes that as a Hugging Face BPE tokenizer: every way to cut a token
into two tokens is a merge, ranked by the token's score (user-defined tokens first, as
SentencePiece matches them whole), with byte fallback and the ``▁`` spelling, and a prefix
space when the vocabulary asks for one. Control and user-defined tokens become added tokens, so
text that spells them keeps them whole. The result encodes as ``transformers``' tokenizer of the
same GGUF does (Gemma 3's 262,144 tokens included: tests/test_sentencepiece.py).

Deriving the merges looks up every cut of every token (1.2 million for Gemma 3), on hashes in
numpy (:func:`_cuts`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from effijax.errors import ConfigError, whole_number
from effijax.models._tokenizer import Tokenizer, set_post_processor, with_backend

__all__ = ["sentencepiece_bpe", "sentencepiece_merges"]

# llama.cpp's token types (``tokenizer.ggml.token_type``).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_BASE = 0x9E3779B97F4A7C15  # the hash's multiplier: odd, so invertible modulo 2**64


def _powers(base: int, n: int) -> np.ndarray:
    """``base**0 .. base**(n - 1)`` modulo 2**64."""
    factors = np.full(max(n, 1), base % (1 << 64), np.uint64)
    factors[0] = 1
    return np.cumprod(factors, dtype=np.uint64)


def _cuts(strings: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every way to cut one of ``strings`` (distinct) into two others: ``(whole, cut, left,
    right)``, indices into ``strings`` and the left part's length.

    All strings' code points lie in one array, each prefix with its polynomial hash (modulo
    2**64, one cumulative sum), so a cut is two lookups in the strings' sorted hashes; every hit
    is then compared code point by code point, so a hash collision cannot make a wrong merge
    (nor lose one, unless two strings of the vocabulary share a hash). Time and memory grow
    with the vocabulary's total length.

    Example:
      >>> [a.tolist() for a in _cuts(["a", "b", "ab", "aba"])]  # ab = a|b, aba = ab|a
      [[2, 3], [1, 2], [0, 2], [1, 0]]
    """
    lengths = np.fromiter(map(len, strings), np.int64, len(strings))
    ends = np.cumsum(lengths)
    starts = ends - lengths
    text = "".join(strings).encode("utf-32-le", "surrogatepass")
    codes = np.frombuffer(text, np.uint32).astype(np.uint64) + 1
    owner = np.repeat(np.arange(len(strings)), lengths)
    local = np.arange(len(codes)) - starts[owner]  # each code point's place in its string
    summed = np.cumsum(codes * _powers(_BASE, int(lengths.max(initial=1)))[local],
                       dtype=np.uint64)
    prefix = summed - np.concatenate([np.zeros(1, np.uint64), summed])[starts][owner]
    full = np.where(lengths > 0, prefix[np.maximum(ends - 1, 0)] if len(codes) else 0, 0)
    table = np.nonzero(lengths > 0)[0]
    table = table[np.argsort(full[table], kind="stable")]
    sorted_hashes = full[table]

    def find(hashes):
        at = np.minimum(np.searchsorted(sorted_hashes, hashes), len(table) - 1)
        return np.where(sorted_hashes[at] == hashes, table[at], -1)

    at = np.nonzero(local < lengths[owner] - 1)[0]  # the last code point of a left part
    whole, cut = owner[at], local[at] + 1
    left = find(prefix[at])
    whole, cut, left, at = whole[left >= 0], cut[left >= 0], left[left >= 0], at[left >= 0]
    inverse = _powers(pow(_BASE, -1, 1 << 64), int(lengths.max(initial=1)))
    right = find((full[whole] - prefix[at]) * inverse[cut])
    hit = (right >= 0) & (lengths[left] == cut) & (lengths[right] == lengths[whole] - cut)
    whole, cut, left, right = whole[hit], cut[hit], left[hit], right[hit]
    # Compare each hit's string with its two parts, code point by code point.
    size = lengths[whole]
    of = np.repeat(np.arange(len(whole)), size)
    j = np.arange(int(size.sum())) - np.repeat(np.cumsum(size) - size, size)
    part = np.where(j < cut[of], starts[left[of]] + j, starts[right[of]] + j - cut[of])
    same = codes[starts[whole[of]] + j] == codes[part]
    exact = np.logical_and.reduceat(same, np.cumsum(size) - size) if len(whole) else same
    return whole[exact], cut[exact], left[exact], right[exact]


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float],
                         token_types: Sequence[int] | None = None) -> list[tuple[str, str]]:
    """The merges that make BPE tokenize ``tokens`` as SentencePiece (and llama.cpp) do, best
    first: every cut of a token into two tokens, ranked by the token's score, user-defined tokens
    (type 4) first, ties by id; a token's cuts longest left part first.

    ``tokens`` must be distinct (spelled as the BPE vocabulary spells them).

    Example:
      >>> sentencepiece_merges(["a", "b", "c", "ab", "bc"], [0, 0, 0, -2, -1])
      [('b', 'c'), ('a', 'b')]
    """
    scores = np.asarray(scores, np.float64)
    user = np.asarray(token_types if token_types is not None else [NORMAL] * len(tokens))
    rank = np.empty(len(tokens), np.int64)
    rank[np.lexsort((np.arange(len(tokens)), -scores, user != USER_DEFINED))] = \
        np.arange(len(tokens))
    whole, cut, left, right = _cuts(tokens)
    order = np.lexsort((-cut, rank[whole]))
    pairs = zip(left[order].tolist(), right[order].tolist(), strict=True)
    return [(tokens[a], tokens[b]) for a, b in pairs]


def sentencepiece_bpe(tokens: Sequence[str], scores: Sequence[float],
                      token_types: Sequence[int] | None = None, *,
                      add_space_prefix: bool = True, bos_id: int | None = None,
                      eos_id: int | None = None, unk_id: int | None = None,
                      pad_id: int | None = None, add_bos: bool = False, add_eos: bool = False,
                      chat_template: str | None = None) -> Tokenizer:
    """A SentencePiece BPE vocabulary as a :class:`Tokenizer` (a GGUF's ``llama`` tokenizer).

    Text has its spaces written as ``▁``; merges come from :func:`sentencepiece_merges`; a
    character that is no token is spelled by its UTF-8 bytes' ``<0xNN>`` tokens (byte
    fallback). A token spelled with spaces (Gemma's runs of spaces) is respelled with ``▁``,
    the only way text can reach it, and reached by merges as ``transformers`` does (llama.cpp
    matches it whole in the raw text instead, which cuts a run longer than the longest such
    token differently, and ranks two cuts of one token by position, not length). Control
    tokens (type 3) and the special ids become special added tokens and user-defined ones
    (type 4) plain added tokens, matched whole in the text, as ``transformers`` does. Decoding
    gives the text back exactly (with ``add_space_prefix``, a text that starts with a space loses
    that space, as in ``transformers``, whose prefix is not added to text that already starts
    with one; a ``▁`` in the text decodes as a space).

    Args:
      tokens: the vocabulary in id order (SentencePiece's pieces).
      scores: one per token; a merge into a higher-scoring token is made first.
      token_types: llama.cpp's token types, one per token (None: all normal).
      add_space_prefix: write a ``▁`` before the text (Llama 2: True; Gemma: False), only at
        its start (not after an added token), as ``transformers`` does; the decoder takes it
        off again.
      bos_id, eos_id, unk_id, pad_id, add_bos, add_eos, chat_template: see :class:`Tokenizer`.

    Raises:
      ConfigError: scores or token types not one per token, a score that is not finite, or a
        special id out of range.

    Example:
      >>> tokens = ["<s>", "<0x21>", "▁", "a", "b", "ab", "▁ab"]
      >>> tok = sentencepiece_bpe(tokens, [0, 0, 0, -1, -2, -3, -4], [3, 6, 1, 1, 1, 1, 1],
      ...                         bos_id=0, add_bos=True)
      >>> ids = tok.encode("ab ab!", add_special_tokens=True)
      >>> [tok.token(i) for i in ids], tok.decode(ids, skip_special_tokens=True)
      (['<s>', '▁ab', '▁ab', '<0x21>'], 'ab ab!')
    """
    from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    n = len(tokens)
    if n == 0:
        raise ConfigError("tokens", "[]", "expected at least one token")
    scores = np.asarray(scores, np.float64)
    types = np.asarray(token_types if token_types is not None else [NORMAL] * n)
    for name, values in (("scores", scores), ("token_types", types)):
        if values.shape != (n,):
            raise ConfigError(name, f"{values.size:,} values", f"expected one per token ({n:,})")
    if not np.isfinite(scores).all():
        bad = int(np.nonzero(~np.isfinite(scores))[0][0])
        raise ConfigError("scores", float(scores[bad]), f"token {bad}'s score; expected a "
                          "finite number")
    for name, value in (("bos_id", bos_id), ("eos_id", eos_id), ("unk_id", unk_id),
                        ("pad_id", pad_id)):
        whole_number(name, value, minimum=0, maximum=n - 1, none=True)

    present = set(tokens)
    spelled = [t.replace(" ", "▁") if " " in t and t.replace(" ", "▁") not in present else t
               for t in tokens]
    vocab = {token: index for index, token in enumerate(spelled)}  # a repeated token: the last
    distinct = list(vocab)
    ids = np.fromiter(vocab.values(), np.int64, len(vocab))
    merges = sentencepiece_merges(distinct, scores[ids], types[ids])
    backend = Backend(models.BPE(vocab, merges, unk_token=None if unk_id is None
                                 else spelled[unk_id], fuse_unk=True, byte_fallback=True,
                                 dropout=None))
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁",
                                                         prepend_scheme="first", split=False)
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    else:
        backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence(steps)
    named = {i for i in (bos_id, eos_id, unk_id, pad_id) if i is not None}
    special = [i for i in range(n) if types[i] == CONTROL or i in named]
    backend.add_special_tokens([AddedToken(spelled[i], special=True, normalized=False)
                                for i in special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind, s in zip(tokens, types.tolist(), spelled, strict=True)
                        if kind == USER_DEFINED and t == s])
    set_post_processor(backend, bos_id if add_bos else None, eos_id if add_eos else None)
    tokenizer = Tokenizer(spec=backend.to_str(), bos_id=bos_id, eos_id=eos_id, unk_id=unk_id,
                          pad_id=pad_id, add_bos=add_bos, add_eos=add_eos,
                          chat_template=chat_template)
    return with_backend(tokenizer, backend)
