"""A model's tokenizer as an immutable value, run by Hugging Face's ``tokenizers`` library.

:class:`Tokenizer` holds the tokenizer's complete ``tokenizers`` JSON (what a Hugging Face
``tokenizer.json`` contains), the special token ids and the chat template: plain, comparable data,
so a :class:`~effijax.models.LlamaConfig` can carry it as a field, and the same object writes the
tokenizer files Hugging Face loads (:meth:`Tokenizer.save`). The ``tokenizers.Tokenizer`` that
does the work is built from the JSON on first use.

Three ways in: :meth:`Tokenizer.load` reads a model directory's ``tokenizer.json`` and
``tokenizer_config.json``, each checked first (a malformed one is one
:class:`~effijax.errors.FileError` naming the file and the field); :func:`byte_level_bpe`
builds GPT-2 style byte-level BPE from a vocabulary and merges (what a GGUF file stores), with
the pre-tokenizer its ``pre`` name says; :func:`~effijax.models.sentencepiece_bpe` builds a
SentencePiece vocabulary (tokens and scores, Gemma's and Llama 2's kind). ``tokenizers`` is
imported on first use, so importing effijax does not load it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence

import numpy as np

from effijax.data import (
    MAX_JSON_BYTES,
    compile_template,
    line_pieces,
    read_json,
    regular_size,
)
from effijax.errors import INT32_MAX, ConfigError, FileError, whole_number

__all__ = ["Tokenizer", "byte_level_bpe", "PRE_TOKENIZERS"]

# GPT-2's split, which ``ByteLevel(use_regex=True)`` applies itself.
_GPT2 = None
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

#: Pre-tokenization by a GGUF's ``tokenizer.ggml.pre`` name, as llama.cpp defines it: the regexes
#: that split text before BPE, applied in order (``None`` is GPT-2's own split). "smollm" (like
#: StarCoder) isolates every digit first, then splits the GPT-2 way: the split SmolLM's own
#: ``tokenizer.json`` makes (``Digits(individual_digits=True)`` then ``ByteLevel``).
PRE_TOKENIZERS: dict[str, tuple[str | None, ...]] = {
    "default": (_GPT2,),
    "gpt2": (_GPT2,),
    "gpt-2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),
    "starcoder": (r"\p{N}", _GPT2),
    "refact": (r"\p{N}", _GPT2),
    "codeshell": (r"\p{N}", _GPT2),
    "llama3": (_LLAMA3,),
    "llama-v3": (_LLAMA3,),
    "llama-bpe": (_LLAMA3,),
    "smaug-bpe": (_LLAMA3,),
    "qwen2": (_QWEN2,),
}


# Texts longer than this (in characters) are encoded in pieces of about this size, in parallel.
_CHUNK_CHARS = 1 << 20

# SentencePiece's spaces as the tokenizers library writes them (a normalizer writes every space
# as U+2581, "▁"), and the split on spaces transformers' Gemma tokenizer adds after it, which
# finds none.
_SPACES_TO_METASPACE = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
_NO_OP_SPLIT = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                "invert": False}


# The cut is effijax.data's (the processes that tokenize a store import effijax.data only).
_line_chunks = line_pieces


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (``bytes_to_unicode``)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _backend(spec: str):
    """A ``tokenizers.Tokenizer`` from its JSON, its padding and truncation switched off
    (see :attr:`Tokenizer.backend`)."""
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_str(spec)
    backend.no_padding()
    backend.no_truncation()
    return backend


def _special_id(config: dict, name: str, backend, path: str) -> int | None:
    """The id of ``tokenizer_config.json``'s special token ``name`` (None when it names none);
    a token the vocabulary lacks is an error (``transformers`` would add it as a new token,
    one past the model's embedding rows)."""
    token = config.get(name)
    if isinstance(token, dict):
        token = token.get("content")
    if token is None:
        return None
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise FileError(path, name, f"{token!r} is not in tokenizer.json's vocabulary or "
                        "added_tokens; expected one of its tokens")
    return token_id


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tokenizer:
    """A tokenizer: ``tokenizers`` JSON, special token ids, and the chat template.

    Attributes:
      spec: the serialised ``tokenizers.Tokenizer`` (the text of a ``tokenizer.json``).
      bos_id, eos_id, unk_id, pad_id: special token ids, or None.
      add_bos, add_eos: whether :meth:`encode` with ``add_special_tokens=True`` adds them (the
        ``spec``'s post-processor does it; the flags record it for ``tokenizer_config.json``).
      chat_template: the Jinja chat template, or None.

    Example:
      >>> tok = byte_level_bpe(["a", "b", "ab", "Ġ", "Ġab"], ["a b", "Ġ ab"])
      >>> tok.encode("ab ab").tolist(), tok.decode([2, 4])
      ([2, 4], 'ab ab')
    """

    spec: str = dataclasses.field(repr=False)
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        if not isinstance(self.spec, str):
            raise ConfigError("spec", type(self.spec).__name__,
                              "expected the tokenizers JSON as a str (tokenizer.json's text)")
        for name in ("bos_id", "eos_id", "unk_id", "pad_id"):
            whole_number(name, getattr(self, name), minimum=0, none=True)  # a token id

    @functools.cached_property
    def backend(self):
        """The ``tokenizers.Tokenizer`` (built from :attr:`spec` once, then cached), without
        padding or truncation: effijax encodes whole texts and pads batches itself, and a
        ``tokenizer.json``'s ``{"Fixed": 1000000000000}`` would allocate terabytes per text."""
        return _backend(self.spec)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token(self, token_id: int | None) -> str | None:
        """The token's string (its vocabulary spelling), or None for None."""
        return None if token_id is None else self.backend.id_to_token(token_id)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> np.ndarray:
        """Token ids of ``text`` as int32; special tokens written in the text stay whole.

        ``add_special_tokens=True`` runs the post-processor (adds BOS/EOS where the tokenizer
        does); training data is encoded without. A long text is cut into pieces at line ends
        and encoded on every core when the pre-tokenizer provably splits there anyway (byte-level
        BPE with the splits of :data:`PRE_TOKENIZERS`): the ids are the same, only faster.
        """
        if add_special_tokens or len(text) <= _CHUNK_CHARS:
            ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
            return np.asarray(ids, np.int32)
        encodings = self.backend.encode_batch(self.pieces(text), add_special_tokens=False)
        return np.concatenate([np.asarray(e.ids, np.int32) for e in encodings])

    def pieces(self, text: str, size: int = _CHUNK_CHARS) -> list[str]:
        """``text`` cut into pieces of about ``size`` characters that encode (without special
        tokens) to the ids of the whole, one after the other: cut at line ends
        (:func:`_line_chunks`) where the pre-tokenizer provably splits there anyway, else whole
        (``[text]``). What lets a long text reach the tokenizer in bounded pieces, on every
        core.

        Example:
          >>> tok = byte_level_bpe(["a", "b", "Ċ", "."], [])
          >>> tok.pieces("ab.\\nab\\nba", size=2)
          ['ab.\\n', 'ab', '\\nba']
        """
        return _line_chunks(text, size) if self._splits_at_line_starts else [text]

    @functools.cached_property
    def _splits_at_line_starts(self) -> bool:
        """Whether text cut by :func:`_line_chunks` encodes to the same ids as the whole.

        True for byte-level splits effijax knows (GPT-2's, the digit split, :data:`PRE_TOKENIZERS`'
        regexes) without a normalizer, and for SentencePiece BPE without a prefix space whose
        ``"\\n"`` is an added token (Gemma's: text is cut into words at added tokens only);
        False for anything else (a ``Metaspace`` prefix, say, would be added to every piece).
        """
        spec = json.loads(self.spec)
        added = [token["content"] for token in spec.get("added_tokens", [])]
        if spec.get("normalizer") == _SPACES_TO_METASPACE:
            # A newline is a word of its own, and no added token spans one with anything else.
            return spec.get("pre_tokenizer") in (None, _NO_OP_SPLIT) and "\n" in added and all(
                set(token) == {"\n"} for token in added if "\n" in token)
        pre = spec.get("pre_tokenizer")
        if spec.get("normalizer") is not None or pre is None:
            return False
        if any("\n" in token for token in added):
            return False  # matched before pre-tokenization, across any cut
        parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        known = {regex for splits in PRE_TOKENIZERS.values() for regex in splits if regex}

        def safe(part) -> bool:
            kind = part.get("type")
            if kind == "ByteLevel":
                return not part.get("add_prefix_space", False)
            if kind == "Digits":
                return True
            if kind == "Split":
                return (part.get("pattern") or {}).get("Regex") in known
            return False

        return bool(parts) and all(safe(part) for part in parts)

    def fingerprint(self, *, chat_template: bool = True) -> str:
        """The SHA-256 of what this tokenizer computes: the tokenizer as the ``tokenizers``
        library loaded it (vocabulary, merges, added tokens, normalizer, pre-tokenizer,
        post-processor), its special token ids and flags, and with ``chat_template`` its chat
        template.

        The tokenizer is taken as the library serialises what it loaded (its own order, no
        spacing), so the same ``tokenizer.json`` saved with other indentation or key order has
        the same fingerprint; the template is taken as written (its whitespace renders).

        Example:
          >>> import dataclasses, json
          >>> tok = byte_level_bpe(["a", "b", "ab"], ["a b"], chat_template="{{ messages }}")
          >>> edited = dataclasses.replace(tok, chat_template="{{ messages }}!")
          >>> tok.fingerprint() == edited.fingerprint(), len(tok.fingerprint())
          (False, 64)
          >>> tok.fingerprint(chat_template=False) == edited.fingerprint(chat_template=False)
          True
          >>> spaced = dataclasses.replace(tok, spec=json.dumps(json.loads(tok.spec), indent=4))
          >>> spaced.fingerprint() == tok.fingerprint()
          True
        """
        digest = hashlib.sha256(self.backend.to_str().encode("utf-8"))
        rest = {**{f"{name}_id": getattr(self, f"{name}_id") for name in ("bos", "eos", "unk",
                                                                          "pad")},
                "add_bos": self.add_bos, "add_eos": self.add_eos,
                "chat_template": self.chat_template if chat_template else None}
        digest.update(json.dumps(rest, sort_keys=True).encode("utf-8"))
        return digest.hexdigest()

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; for byte-level BPE, ``decode(encode(text)) == text``."""
        return self.backend.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                                   skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], *,
                            add_generation_prompt: bool = False) -> str:
        """Renders ``[{"role": ..., "content": ...}, ...]`` with :attr:`chat_template`.

        Uses Jinja in a sandbox the way ``transformers`` does (``trim_blocks``,
        ``lstrip_blocks``, ``bos_token``/``eos_token`` in scope); the template is compiled on
        first use.

        Raises:
          ConfigError: ``field="chat_template"``: the template failed or ran over its bounds
            of time and size (:mod:`effijax.data._template`).
        """
        if self.chat_template is None:
            raise ConfigError("chat_template", None, "this tokenizer has no chat template")
        return self._compiled_chat_template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=self.token(self.bos_id) or "", eos_token=self.token(self.eos_id) or "")

    @functools.cached_property
    def _compiled_chat_template(self):
        """The chat template compiled once (rendering a dataset renders it per record), in
        a sandbox that bounds its time and output (:func:`effijax.data.compile_template`)."""
        return compile_template(self.chat_template)

    # Files ------------------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike) -> list[str]:
        """Writes ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

        What ``transformers.AutoTokenizer.from_pretrained(directory)`` reads; returns the file
        names written.
        """
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(self.spec)
        special = {name: self.token(getattr(self, f"{name}_id"))
                   for name in ("bos", "eos", "unk", "pad")}
        special = {f"{name}_token": token for name, token in special.items() if token is not None}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "clean_up_tokenization_spaces": False,
            "model_max_length": int(1e30),
            **special,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
        with open(os.path.join(directory, "special_tokens_map.json"), "w",
                  encoding="utf-8") as f:
            json.dump(special, f, indent=2, ensure_ascii=False)
        return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]

    @classmethod
    def load(cls, directory: str | os.PathLike, *, rows: int | None = None) -> Tokenizer:
        """Reads a model directory's ``tokenizer.json`` (and ``tokenizer_config.json``), each
        file checked before it is trusted.

        Special tokens and the chat template come from ``tokenizer_config.json`` (a
        ``chat_template.jinja`` file next to it wins, as in recent ``transformers``); whether
        BOS and EOS are added from ``tokenizer.json``'s post-processor, which ``transformers`` 5
        follows over ``add_bos_token`` (written by :meth:`save` to agree with it). The fields
        read must have the types expected, every token id must be below ``rows`` (and 2^31),
        each special token must be in the vocabulary, and the ``tokenizers`` library must
        accept the tokenizer and encode and decode a sample with it, else one line names the
        file and the field. ``tokenizer.json``'s ``padding`` and ``truncation`` are dropped:
        effijax encodes whole texts and pads batches itself.

        Args:
          directory: holds ``tokenizer.json``.
          rows: the embedding rows of the model the tokenizer belongs to (its config's
            ``vocab_size``), when known: a larger id would index past them.

        Raises:
          FileNotFoundError: the directory has no ``tokenizer.json``.
          FileError: a tokenizer file is malformed, naming it and the field.

        Example:
          >>> import json, os, tempfile
          >>> d = tempfile.mkdtemp()
          >>> _ = byte_level_bpe(["a", "b", "ab"], ["a b"]).save(d)
          >>> Tokenizer.load(d).encode("ab").tolist()
          [2]
          >>> Tokenizer.load(d, rows=2)  # doctest: +ELLIPSIS
          Traceback (most recent call last):
          ...
          effijax.errors.FileError: .../tokenizer.json: model.vocab: token 'ab' has id 2; ...
          >>> with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
          ...     json.dump({"eos_token": 7}, f)
          >>> Tokenizer.load(d)  # doctest: +ELLIPSIS
          Traceback (most recent call last):
          ...
          effijax.errors.FileError: .../tokenizer_config.json: eos_token: 7; expected a token ...
        """
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"no tokenizer.json in {os.fspath(directory)!r}; effijax reads fast-tokenizer "
                "files only (convert a slow tokenizer with transformers' save_pretrained)")
        parsed = _tokenizer_json(path, rows)
        if parsed.get("padding") is not None or parsed.get("truncation") is not None:
            # Never handed to the library (see Tokenizer.backend), nor written back by save().
            spec = json.dumps({**parsed, "padding": None, "truncation": None},
                              ensure_ascii=False)
        else:
            with open(path, encoding="utf-8") as f:
                spec = f.read()
        config_path = os.path.join(directory, "tokenizer_config.json")
        config = _tokenizer_config(config_path) if os.path.exists(config_path) else {}
        template = config.get("chat_template")
        template_path = os.path.join(directory, "chat_template.jinja")
        if os.path.exists(template_path):
            template = read_chat_template(template_path)
        if isinstance(template, list):  # several named templates: take the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default", next(iter(named.values()), None))
        # Parsed and run now, so that a spec the library refuses (or panics on) is named.
        backend = _library(path, _backend, spec)
        ids = {name: _special_id(config, f"{name}_token", backend, config_path)
               for name in ("bos", "eos", "unk", "pad")}
        try:
            tokenizer = cls(spec=spec, **{f"{name}_id": i for name, i in ids.items()},
                            chat_template=template)
        except ConfigError as e:
            raise FileError.of(config_path, e) from None
        return _library(path, _with_flags, tokenizer, backend)


#: Text every loaded tokenizer encodes and decodes once, so that a normalizer, pre-tokenizer,
#: post-processor or decoder the library accepts but cannot run is found at load.
_SAMPLE = "Hello, world! 12 \u00fcber caf\u00e9\n\tend."


def _library(path: str, call, *args):
    """``call(*args)``, the ``tokenizers`` library's failures as one :class:`FileError` about
    ``path``: its plain ``Exception``s, and the panics of its Rust code (pyo3's
    ``PanicException`` derives from ``BaseException``, so ``except Exception`` misses it).

    What the library writes to the process's standard error meanwhile (a panic's message and
    backtrace, straight to file descriptor 2) is held back, and passed on only when the call
    succeeds: a refused file is the one line of the error.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            result = call(*args)
        except BaseException as e:  # noqa: BLE001 (narrowed just below)
            if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
                raise  # KeyboardInterrupt, SystemExit
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise FileError(path, "file", f"the tokenizers library cannot read it ({first})") \
                from None
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        held.seek(0)
        if said := held.read():
            os.write(2, said)
    return result


def _with_flags(tokenizer: Tokenizer, backend) -> Tokenizer:
    """``tokenizer`` with ``add_bos``/``add_eos`` read off its post-processor (whether encoding
    ``""`` with special tokens gives BOS first, EOS last): ``transformers`` 5 follows the
    post-processor whatever ``tokenizer_config.json``'s ``add_bos_token`` says. A sample text is
    encoded and decoded too (see :data:`_SAMPLE`)."""
    backend.decode(backend.encode(_SAMPLE, add_special_tokens=True).ids)
    ids = backend.encode("", add_special_tokens=True).ids
    add_bos = tokenizer.bos_id is not None and ids[:1] == [tokenizer.bos_id]
    add_eos = tokenizer.eos_id is not None and len(ids) > add_bos and ids[-1] == tokenizer.eos_id
    return with_backend(dataclasses.replace(tokenizer, add_bos=add_bos, add_eos=add_eos),
                        backend)


def with_backend(tokenizer: Tokenizer, backend) -> Tokenizer:
    """``tokenizer`` with :attr:`Tokenizer.backend` already there: ``backend``, the
    ``tokenizers.Tokenizer`` its ``spec`` serialises (a large vocabulary is not parsed again).

    Example:
      >>> tok = byte_level_bpe(["a", "b", "ab"], ["a b"])
      >>> backend = tok.backend
      >>> with_backend(dataclasses.replace(tok, add_bos=False), backend).backend is backend
      True
    """
    vars(tokenizer)["backend"] = backend  # what the cached property would compute
    return tokenizer


# The tokenizer files, checked before anything trusts them: the fields Tokenizer.load reads
# have the types it expects (a forged file is one FileError, not a traceback).

def _token_id(n) -> bool:
    """A JSON whole number >= 0 (not a bool)."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _check_ids(path: str, where: str, ids, rows: int | None) -> None:
    """Every ``(token, id)`` of ``ids`` below ``rows`` (the model's embedding rows) and 2^31
    (ids reach the device as int32)."""
    bound = min(rows, INT32_MAX + 1) if rows is not None else INT32_MAX + 1
    for token, i in ids:
        if i >= bound:
            why = (f"the model has {rows:,} embedding rows (config.json's vocab_size)"
                   if rows is not None and rows < INT32_MAX + 1 else "expected ids below 2^31")
            raise FileError(path, where, f"token {token!r} has id {i:,}; {why}")


def _tokenizer_json(path: str, rows: int | None = None) -> dict:
    """``tokenizer.json`` parsed, its model, vocabulary, merges and added tokens checked (every
    id below ``rows`` when given, and 2^31)."""
    spec = read_json(path)
    model = spec.get("model")
    if not isinstance(model, dict):
        raise FileError(path, "model", "expected an object (the tokenizer model)")
    vocab, merges = model.get("vocab"), model.get("merges", [])
    if vocab is not None and not (
            isinstance(vocab, list) or isinstance(vocab, dict) and all(
                _token_id(i) for i in vocab.values())):
        raise FileError(path, "model.vocab", "expected an object of token -> id (ids >= 0) "
                        "or a list")
    if isinstance(vocab, dict):
        _check_ids(path, "model.vocab", vocab.items(), rows)
    elif isinstance(vocab, list) and vocab:  # a unigram vocabulary: ids are positions
        last = vocab[-1][0] if isinstance(vocab[-1], list) and vocab[-1] else vocab[-1]
        _check_ids(path, "model.vocab", [(last, len(vocab) - 1)], rows)
    if not isinstance(merges, list) or not all(
            isinstance(m, str) and len(m.split(" ")) == 2 or isinstance(m, list) and len(m) == 2
            and all(isinstance(p, str) for p in m) for m in merges):
        raise FileError(path, "model.merges", "expected a list of pairs ('a b' or ['a', 'b'])")
    added = spec.get("added_tokens", [])
    if not isinstance(added, list) or not all(
            isinstance(t, dict) and isinstance(t.get("content"), str)
            and _token_id(t.get("id")) for t in added):
        raise FileError(path, "added_tokens", "expected a list of {content: str, id: int >= 0}")
    _check_ids(path, "added_tokens", [(t["content"], t["id"]) for t in added], rows)
    return spec


def _tokenizer_config(path: str) -> dict:
    """``tokenizer_config.json`` parsed, its chat template, special tokens and flags checked."""
    config = read_json(path)
    template = config.get("chat_template")
    if not (template is None or isinstance(template, str) or isinstance(template, list) and all(
            isinstance(t, dict) and isinstance(t.get("template"), str)
            and isinstance(t.get("name", ""), str) for t in template)):
        raise FileError(path, "chat_template", "expected a string, or a list of {name, "
                        "template} objects")
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        token = config.get(name)
        if not (token is None or isinstance(token, str)
                or isinstance(token, dict) and isinstance(token.get("content"), str)):
            raise FileError(path, name, f"{token!r}; expected a token string or "
                            "{content: str}")
    for name in ("add_bos_token", "add_eos_token"):
        if config.get(name) is not None and not isinstance(config[name], bool):
            raise FileError(path, name, f"{config[name]!r}; expected true or false")
    return config


def read_chat_template(path: str | os.PathLike) -> str:
    """A chat template file's text (``chat_template.jinja``, or one given with
    ``--chat-template``): a regular UTF-8 file of bounded size. (Compiling it is
    :func:`effijax.data.compile_template`'s.)

    Raises:
      FileNotFoundError: no such file.
      FileError: not a regular file, too large, or not UTF-8.

    Example:
      >>> import pathlib, tempfile
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "t.jinja"
      >>> _ = path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
      >>> read_chat_template(path)[:6]
      '{% for'
    """
    path = os.fspath(path)
    if regular_size(path) > MAX_JSON_BYTES:
        raise FileError(path, "file", f"is larger than {MAX_JSON_BYTES:,} bytes")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise FileError(path, f"byte {e.start:,}", "is not UTF-8 text") from None


def byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], *, pre: str = "default",
                   token_types: Sequence[int] | None = None, bos_id: int | None = None,
                   eos_id: int | None = None, unk_id: int | None = None,
                   pad_id: int | None = None, add_bos: bool = False, add_eos: bool = False,
                   chat_template: str | None = None) -> Tokenizer:
    """GPT-2 style byte-level BPE from a vocabulary and merges (a GGUF's ``gpt2`` tokenizer).

    Args:
      tokens: the vocabulary in id order, spelled in GPT-2's byte alphabet (``"Ġthe"``); a token
        using other characters is respelled from its UTF-8 bytes, as ``transformers`` does.
      merges: ``"left right"`` pairs, best first.
      pre: the pre-tokenizer's name in :data:`PRE_TOKENIZERS` (a GGUF's ``tokenizer.ggml.pre``).
      token_types: llama.cpp's token types; control tokens (3) become special added tokens and
        user-defined ones (4) plain added tokens, so text containing them keeps them whole.
      bos_id, eos_id, unk_id, pad_id, add_bos, add_eos, chat_template: see :class:`Tokenizer`.

    Raises:
      ConfigError: an unknown ``pre`` name.

    Example:
      >>> tok = byte_level_bpe(["<s>", "1", "2", "Ġ", "Ġ1"], ["Ġ 1"], pre="smollm",
      ...                      token_types=[3, 1, 1, 1, 1])
      >>> tok.encode("<s> 12").tolist()  # digits are isolated before BPE: no "Ġ1"
      [0, 3, 1, 2]
    """
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    if pre not in PRE_TOKENIZERS:
        raise ConfigError("pre", pre, f"unknown pre-tokenizer; known: {sorted(PRE_TOKENIZERS)}")
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    vocab = {}
    for index, token in enumerate(tokens):
        if not set(token) <= letters:
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab[token] = index
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Backend(models.BPE(vocab, pairs, dropout=None, continuing_subword_prefix="",
                                 end_of_word_suffix="", fuse_unk=False))
    splits = []
    for regex in PRE_TOKENIZERS[pre]:
        if regex is None:
            splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        else:
            splits.append(pre_tokenizers.Split(Regex(regex), behavior="isolated"))
    if PRE_TOKENIZERS[pre][-1] is not None:
        splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    backend.pre_tokenizer = splits[0] if len(splits) == 1 else pre_tokenizers.Sequence(splits)
    backend.decoder = decoders.ByteLevel()
    if token_types is not None:
        control = [AddedToken(t, special=True, normalized=False)
                   for t, kind in zip(tokens, token_types, strict=True)
                   if kind == 3 and set(t) <= letters]
        user = [AddedToken(t, special=False, normalized=False)
                for t, kind in zip(tokens, token_types, strict=True) if kind == 4]
        backend.add_special_tokens(control)
        backend.add_tokens(user)
    set_post_processor(backend, bos_id if add_bos else None, eos_id if add_eos else None)
    return Tokenizer(spec=backend.to_str(), bos_id=bos_id, eos_id=eos_id, unk_id=unk_id,
                     pad_id=pad_id, add_bos=add_bos, add_eos=add_eos, chat_template=chat_template)


def set_post_processor(backend, bos_id: int | None, eos_id: int | None) -> None:
    """Makes ``backend`` (a ``tokenizers.Tokenizer``) add ``bos_id`` first and ``eos_id`` last
    when asked for special tokens (None: not added), as ``transformers``' ``add_bos_token`` /
    ``add_eos_token`` do; with neither, a backend without a post-processor keeps none.

    Example:
      >>> backend = byte_level_bpe(["<s>", "a"], [], token_types=[3, 1]).backend
      >>> set_post_processor(backend, 0, None)
      >>> backend.encode("aa", add_special_tokens=True).ids
      [0, 1, 1]
    """
    from tokenizers import processors

    specials = list(dict.fromkeys((backend.id_to_token(i), i) for i in (bos_id, eos_id)
                                  if i is not None))
    if not specials and backend.post_processor is None:
        return
    bos = [backend.id_to_token(bos_id)] if bos_id is not None else []
    eos = [backend.id_to_token(eos_id)] if eos_id is not None else []
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join([*bos, "$A", *eos]),
        pair=" ".join([*bos, "$A", *eos, *bos, "$B:1", *eos]), special_tokens=specials)
