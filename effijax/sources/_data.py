"""A run's data through its model: text or chat / instruction JSONL, split for validation.

Three ways, picked by the model and the data format (``auto``: ``chat`` for a ``.jsonl`` file,
else ``text``):

* **bytes**: a model without a tokenizer (the byte GPT) reads the corpus as one byte stream, as
  it always has (:func:`effijax.data.load_corpus`);
* **text**: with a tokenizer, every file is a document, tokenized on its own and followed by the
  end-of-text token (:func:`effijax.data.encode_documents`); training windows are drawn anywhere
  in the stream;
* **chat**: JSONL records rendered with the model's chat template, the loss on the assistant's
  tokens only, packed whole into rows of ``seq_len + 1`` (:mod:`effijax.data`'s chat functions).

Validation: the last 5% of the token stream (bytes, text), or 5% of the records chosen by their
content (chat).

A token store (``effijax data prepare``, :mod:`effijax.data._store`) is read the same three
ways, memory-mapped: its split is the one its manifest records, and the run's data identity is
the store's hash. ``a.store:0.7,b.store:0.3`` draws each row from one of several stores with
those weights (:func:`mixture_spec`). A Parquet or Arrow file (or a ``datasets`` folder) is
never read as text: ``effijax train`` prepares it into a store in its cache first
(:mod:`effijax.sources._prepared`); here it is refused with the commands that read it.
``effijax train`` prepares text and JSONL files larger than
:data:`effijax.sources._prepared.MEMORY_BYTES` into a store too, read the way this module reads
them (the same tokens, rows and batches), under the identity they have here (the manifest's
``content``), so that a run's host memory does not grow with its data; :func:`load_dataset`
itself reads them in memory, whatever their size.
:func:`load_eval_data` reads the same data for evaluation, whole: every token in consecutive
windows, or every record in order; from a store, memory-mapped, each batch's rows built when it
is scored (so ``effijax eval`` reads text and JSONL files larger than ``MEMORY_BYTES`` from the
store ``effijax train`` prepares of them, and its host memory does not grow with its data).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from effijax.data import (
    TABLE_SUFFIXES,
    Led,
    Packed,
    corpus_fingerprint,
    document_files,
    documents_fingerprint,
    encode_documents,
    is_store,
    load_corpus,
    load_documents,
    mixture,
    open_store,
    pack_examples,
    read_records,
    records_fingerprint,
    release_pages,
    render_chat,
    split_corpus,
    split_records,
    store_rows,
    store_split,
    verify_store,
)
from effijax.errors import NO_VALUE, ConfigError, FileError

__all__ = ["Dataset", "resolve_format", "load_dataset", "load_eval_data", "text_rows",
           "mixture_spec", "template_digest", "padding_id",
           "VAL_FRACTION", "no_chat_template"]

VAL_FRACTION = 0.05


class Dataset(NamedTuple):
    """A run's data.

    Attributes:
      train, val: 1-D token arrays (``bytes``, ``text``; for a tokenizer that starts texts with
        a BOS, each window is led by it: :class:`~effijax.data.Led`) or
        :class:`~effijax.data.Packed` rows (``chat``).
      fingerprint: identifies the content (recorded in ``config.json``).
      format: ``"bytes"``, ``"text"`` or ``"chat"``.
      tokens: tokens in train and val together (packed rows: real tokens, padding excluded).
      note: one line about the data for the start-up printout (empty for bytes).
    """

    train: Any
    val: Any
    fingerprint: str
    format: str
    tokens: int
    note: str = ""

    @property
    def masked(self) -> bool:
        """Whether batches carry a loss mask (chat data)."""
        return isinstance(self.train, Packed)

    @property
    def segmented(self) -> bool:
        """Whether batches carry the packed examples' ids (``"segments"``, chat data)."""
        return self.masked and self.train.segments_NW is not None


def resolve_format(path: str | None, data_format: str = "auto") -> str:
    """``"chat"`` or ``"text"``: ``data_format``, with ``auto`` decided by the path's suffix.

    Example:
      >>> resolve_format("x.jsonl"), resolve_format("notes/"), resolve_format(None)
      ('chat', 'text', 'text')
    """
    if data_format not in ("auto", "text", "chat"):
        raise ConfigError("data_format", data_format, "choose one of auto, text, chat")
    if data_format != "auto":
        return data_format
    return "chat" if path is not None and Path(path).suffix.lower() == ".jsonl" else "text"


def no_chat_template(model_name: str, path: str | None, tokenizer) -> ConfigError:
    """The error for chat records the model cannot render (no tokenizer, or no chat template),
    naming the fixes; said alike before the model's weights are read and after.

    Example:
      >>> print(no_chat_template("gemma3-270m", "qa.jsonl", object()))  # doctest: +ELLIPSIS
      data='qa.jsonl': chat records are rendered by the model's chat template, and gemma3-270m \
has none (a base model's): give one with --chat-template FILE ...
    """
    if tokenizer is None:
        return ConfigError("data", path, f"chat records need a model with a tokenizer and a "
                           f"chat template, and {model_name} has no tokenizer: train from one "
                           "that has both (e.g. --from smollm2), or read the file as plain text "
                           "with --data-format text")
    return ConfigError("data", path, f"chat records are rendered by the model's chat template, "
                       f"and {model_name} has none (a base model's): give one with "
                       "--chat-template FILE (a Jinja template, like the model family's "
                       "instruct model's), train from a model that has one (e.g. --from "
                       "smollm2), or read the file as plain text with --data-format text")


def _tokenizer(model, *, chat: bool, path: str | None = None):
    tokenizer = getattr(model, "tokenizer", None)
    if chat and (tokenizer is None or tokenizer.chat_template is None):
        raise no_chat_template(model.name, path, tokenizer)
    return tokenizer


def padding_id(tokenizer) -> int:
    for token_id in (tokenizer.pad_id, tokenizer.eos_id):
        if token_id is not None:
            return int(token_id)
    return 0


def _chat_examples(tokenizer, records) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for r in records:
        try:
            out.append(render_chat(tokenizer, r.messages))
        except ConfigError as e:
            if e.field != "chat_template":
                raise
            # The template's error (its own, or a bound it ran over) with the record it met.
            raise ConfigError("data", r.source, e.problem) from None
    return out


def _packed_note(name: str, packed, seq_len: int) -> str:
    cut = (f", {packed.truncated} cut to {seq_len + 1} tokens (raise --seq-len to keep them "
           "whole)" if packed.truncated else "")
    return (f"{packed.examples} {name} examples in {len(packed)} row(s) of {seq_len + 1} tokens, "
            f"{packed.trained_tokens:,} trained tokens{cut}")


class _Content(NamedTuple):
    """A data file read whole through a model: a token ``stream`` (bytes, text) or chat
    ``records`` (rendered by ``tokenizer`` once split), with the content's fingerprint."""

    format: str
    fingerprint: str
    stream: np.ndarray | None = None
    records: list | None = None
    tokenizer: Any = None
    note: str = ""


def _tables_in(path: Path) -> list[Path]:
    """The Parquet and Arrow files (or ``datasets`` folder markers) ``path`` is or holds."""
    if path.is_file():
        return [path] if path.suffix.lower() in TABLE_SUFFIXES else []
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        return [path]
    if not path.is_dir():
        return []
    return sorted(p for p in path.rglob("*") if p.suffix.lower() in TABLE_SUFFIXES)[:3]


def _refuse_tables(path: str, *, evaluating: bool) -> None:
    """A Parquet or Arrow source is prepared into a store, never read as bytes."""
    tables = _tables_in(Path(path))
    if not tables:
        return
    shown = ", ".join(p.name for p in tables)
    if evaluating:
        raise ConfigError("data", path, f"holds Parquet/Arrow data ({shown}); effijax eval "
                          "reads text or chat JSONL files, or a token store: prepare one first "
                          f"(effijax data prepare {path} --out "
                          f"{Path(path).with_suffix('.store')} --from MODEL)")
    raise ConfigError("data", path, f"holds Parquet/Arrow data ({shown}), which is read "
                      "from a token store: effijax train --data prepares one into effijax's "
                      "cache itself (effijax.sources.cached_store), or effijax data prepare "
                      f"{path} --out {Path(path).with_suffix('.store')} --from MODEL writes "
                      "one where you choose")


def _read(path: str | None, model, data_format: str, *, evaluating: bool = False) -> _Content:
    """The one reader behind training and evaluation data (see the module docstring).

    Raises:
      ConfigError: ``field="data"``, naming the path (or the record's file and line).
    """
    if path is not None:
        _refuse_tables(path, evaluating=evaluating)
    fmt = resolve_format(path, data_format)
    try:
        if fmt == "chat":
            if path is None:
                raise ConfigError("data", NO_VALUE, "chat data needs a .jsonl file (--data FILE)")
            tokenizer = _tokenizer(model, chat=True, path=path)
            if Path(path).is_dir():
                raise ConfigError("data", path, "chat / instruction data is one .jsonl file, "
                                  "not a folder")
            records = read_records(path)
            return _Content("chat", records_fingerprint(records), records=records,
                            tokenizer=tokenizer)
        tokenizer = _tokenizer(model, chat=False)
        if tokenizer is None:
            raw = load_corpus(path)
            return _Content("bytes", corpus_fingerprint(raw), model.encode(raw.tobytes()))
        documents = load_documents(path)
        names = [str(f) for f in document_files(path)]  # a document refused is named
        tokens = encode_documents(tokenizer, documents, names=names)
        note = (f"text data: {len(documents)} documents, {len(tokens):,} tokens (each document "
                f"ends with {tokenizer.token(int(tokens[-1]))})")
        return _Content("text", documents_fingerprint(documents), tokens,
                        tokenizer=tokenizer, note=note)
    except ConfigError as e:
        if e.field in ("data", "path"):
            raise ConfigError("data", e.value if e.field == "data" else path, e.problem) \
                from None
        raise


def _chat(path: str, content: _Content, seq_len: int, val_fraction: float) -> Dataset:
    tokenizer = content.tokenizer
    train_records, val_records = split_records(content.records, val_fraction)
    pad = padding_id(tokenizer)
    train = pack_examples(_chat_examples(tokenizer, train_records), seq_len, pad_id=pad)
    val = pack_examples(_chat_examples(tokenizer, val_records), seq_len, pad_id=pad)
    if not train.trained_tokens or not val.trained_tokens:
        raise ConfigError("data", path, f"no assistant token is left in the "
                          f"{'training' if not train.trained_tokens else 'validation'} rows "
                          f"of {seq_len + 1} tokens; raise --seq-len")
    tokens = train.filled + val.filled
    note = (f"chat data: {_packed_note('training', train, seq_len)}; "
            f"{_packed_note('validation', val, seq_len)}")
    return Dataset(train, val, content.fingerprint, "chat", tokens, note)


def _split_stream(path, tokens: np.ndarray, seq_len: int, val_fraction: float):
    train, val = split_corpus(tokens, val_fraction)
    if min(len(train), len(val)) <= seq_len + 1:
        need = _tokens_needed(seq_len, val_fraction)
        raise ConfigError("data", path, f"{len(tokens):,} tokens are too few for seq_len "
                          f"{seq_len}: it needs at least {need:,} ({val_fraction:.0%} is held "
                          f"out for validation, and each part must hold a window of "
                          f"{seq_len + 2} tokens); add data, or lower --seq-len to at most "
                          f"{_longest_window(len(tokens), val_fraction)}")
    return train, val


def _split_sizes(n: int, val_fraction: float) -> tuple[int, int]:
    """The (train, validation) sizes :func:`effijax.data.split_corpus` gives ``n`` tokens."""
    n_val = min(max(1, round(n * val_fraction)), n - 1)
    return n - n_val, n_val


def _tokens_needed(seq_len: int, val_fraction: float) -> int:
    """The fewest tokens whose split leaves a window of ``seq_len + 2`` on each side.

    Example:
      >>> _tokens_needed(128, 0.05)
      2590
    """
    n = max(2, int((seq_len + 1.5) / val_fraction) - 2)  # round() reaches seq_len + 2 here
    while min(_split_sizes(n, val_fraction)) <= seq_len + 1:
        n += 1
    return n


def _longest_window(n: int, val_fraction: float) -> int:
    """The longest ``seq_len`` that ``n`` tokens can train and validate (0: none)."""
    return max(0, min(_split_sizes(n, val_fraction)) - 2) if n >= 2 else 0


def mixture_spec(data: str | None) -> list[tuple[str, float]] | None:
    """``[(path, weight), ...]`` of a mixture ``a:0.7,b:0.3``; None for one path (a path that
    exists is one path, whatever colons it holds).

    Example:
      >>> mixture_spec("a.store:0.7,b.store:0.3"), mixture_spec("notes.txt")
      ([('a.store', 0.7), ('b.store', 0.3)], None)
    """
    if data is None or ":" not in data or Path(data).exists():
        return None
    parts = []
    for item in data.split(","):
        path, _, weight = item.rpartition(":")
        try:
            parts.append((path, float(weight)))
        except ValueError:
            return None  # a path with a colon in it, not a mixture
        if not path:
            return None
    return parts


def template_digest(template: str | None) -> str | None:
    """The SHA-256 of a chat template's text (None: no template), as a store's manifest records
    the ``--chat-template`` it was prepared with.

    Example:
      >>> template_digest("{{ messages }}")[:12], template_digest(None)
      ('f24189f08c85', None)
    """
    return None if template is None else hashlib.sha256(template.encode("utf-8")).hexdigest()


def _store_tokenizer(store, model, path: str) -> Any:
    """The model's tokenizer, checked to be the one the store was prepared with (for chat, its
    chat template too)."""
    tokenizer = getattr(model, "tokenizer", None)
    recorded = store.manifest["tokenizer"]
    chat = store.format == "chat"
    have = None if tokenizer is None else tokenizer.fingerprint(chat_template=chat)
    want = None if recorded is None else recorded["sha256"]
    if have == want:
        return tokenizer
    template = (recorded or {}).get("chat_template_sha256")
    ours = template_digest(getattr(tokenizer, "chat_template", None))
    if chat and template is not None and ours != template:
        run_template = ("no template" if ours is None else
                        f"the template of sha256 {ours[:12]}..")
        raise ConfigError("data", path, f"its chat records were rendered with the template of "
                          f"sha256 {template[:12]}.. (effijax data prepare --chat-template), but "
                          f"this run renders chat with {run_template}; train with "
                          "--chat-template and the same file, or prepare the store again")
    what = {None: "bytes (no tokenizer)"}
    raise ConfigError("data", path, f"was prepared with tokenizer "
                      f"{what.get(want, (want or '')[:12] + '..')}, but {model.name} "
                      f"tokenizes with {what.get(have, (have or '')[:12] + '..')}; prepare "
                      f"it again with the model you train (effijax data prepare ... --from "
                      f"MODEL{' [--chat-template FILE]' if chat else ''})")


def _leading_bos(tokenizer) -> int | None:
    """The BOS every text window starts with: the tokenizer's, where it starts texts with one
    (Gemma's), as the model sees every text; None otherwise."""
    if tokenizer is None or not tokenizer.add_bos:
        return None
    return tokenizer.bos_id


def _led(tokens: np.ndarray, tokenizer):
    """Text windows led by :func:`_leading_bos` where there is one (:class:`~effijax.data.Led`)."""
    first = _leading_bos(tokenizer)
    return tokens if first is None else Led(tokens, first)


def _checked_store(path: str, model) -> tuple[Any, Any]:
    """``(store, tokenizer)``: the store at ``path`` (memory-mapped), checked against the
    model's tokenizer and vocabulary, its content against its manifest
    (:func:`~effijax.data.verify_store`: hashed on first use and once changed, so a run, its
    resume and an evaluation refuse a store changed since it was prepared).

    Raises:
      FileError: a damaged or changed store, naming its file; ids beyond the vocabulary.
      ConfigError: ``field="data"``: another tokenizer.
    """
    store = open_store(path)
    tokenizer = _store_tokenizer(store, model, path)
    contents = verify_store(store)
    vocab = getattr(model, "vocab_size", None)
    if vocab is not None and contents.max_id >= vocab:
        raise FileError(store.path / "tokens.bin", "token id", f"{contents.max_id:,} is not "
                        f"below the vocabulary of {model.name} ({vocab:,} ids): the store was "
                        "tokenized for another model; prepare it again with --from the model "
                        "you train")
    return store, tokenizer


def _store_dataset(path: str, model, seq_len: int) -> Dataset:
    """A store's data (:func:`_checked_store`), its split checked against ``seq_len``.

    Raises:
      FileError: as :func:`_checked_store`.
      ConfigError: ``field="data"``: another tokenizer, a split too small for ``seq_len``.
    """
    store, tokenizer = _checked_store(path, model)
    split, fmt = store.manifest["split"], store.format
    if fmt == "chat":
        if not split["train_trained_tokens"] or not split["val_trained_tokens"]:
            raise ConfigError("data", path, "no assistant token in the training or validation "
                              "examples")
        pad = padding_id(tokenizer)
        train = store_rows(store, val=False, seq_len=seq_len, pad_id=pad)
        val = store_rows(store, val=True, seq_len=seq_len, pad_id=pad)
        note = (f"chat store {path}: {train.examples:,} training examples in {len(train):,} "
                f"rows of {seq_len + 1} tokens, {val.examples:,} validation examples "
                f"({train.truncated + val.truncated} cut to {seq_len + 1} tokens)")
        return Dataset(train, val, store.fingerprint, "chat", train.filled + val.filled, note)
    train, val = store_split(store)
    if min(len(train), len(val)) <= seq_len + 1:
        raise ConfigError("data", path, f"its split ({len(train):,} training and {len(val):,} "
                          f"validation tokens) leaves no window of {seq_len + 2} tokens on each "
                          "side; lower --seq-len or prepare more data")
    note = (f"{fmt} store {path}: {store.manifest['documents']:,} documents, "
            f"{store.manifest['tokens']:,} tokens (memory-mapped)")
    if "content" in store.manifest:  # prepared by a run from its text files, read as in memory
        note = (f"{fmt} data: {store.manifest['documents']:,} documents, "
                f"{store.manifest['tokens']:,} tokens, memory-mapped from {path}")
    if fmt != "bytes":
        train, val = _led(train, tokenizer), _led(val, tokenizer)
    return Dataset(train, val, store.fingerprint, "bytes" if fmt == "bytes" else "text",
                   store.manifest["tokens"], note)


def _mixture_dataset(parts: list[tuple[str, float]], model, seq_len: int) -> Dataset:
    """Stores drawn with weights (:class:`~effijax.data.Mixture`)."""
    for path, _ in parts:
        if not is_store(path):
            raise ConfigError("data", path, "a mixture (PATH:WEIGHT,...) draws from token "
                              "stores; prepare it first: effijax data prepare "
                              f"{path} --out {Path(path).with_suffix('.store')} --from MODEL")
    sets = [_store_dataset(path, model, seq_len) for path, _ in parts]
    if len({d.format for d in sets}) > 1:
        raise ConfigError("data", ",".join(p for p, _ in parts), "mixes stores of formats "
                          f"{sorted({d.format for d in sets})}; a mixture's stores hold one "
                          "kind (text, or chat)")
    weights = [w for _, w in parts]
    mixed = mixture([d.train for d in sets], weights)
    identity = json.dumps([[d.fingerprint, w] for d, w in zip(sets, mixed.weights,
                                                                strict=True)])
    note = "mixture: " + ", ".join(f"{p} ({w:.0%})" for (p, _), w in zip(parts, mixed.weights,
                                                                        strict=True))
    return Dataset(mixed, mixture([d.val for d in sets], weights),
                   "mix:" + hashlib.sha256(identity.encode()).hexdigest(), sets[0].format,
                   sum(d.tokens for d in sets), note)


def load_dataset(path: str | None, model, *, seq_len: int | None = None,
                 data_format: str = "auto", val_fraction: float = VAL_FRACTION) -> Dataset:
    """The training and validation data of ``path`` for ``model`` (see the module docstring).

    Args:
      path: a text file or folder, a chat / instruction ``.jsonl`` file, a token store, a
        mixture of stores (``a:0.7,b:0.3``), or None (the standard library's source).
      model: a :class:`~effijax.models.LanguageModel`; its ``tokenizer`` (if any) tokenizes.
      seq_len: the training window (default: the model's).
      data_format: ``auto``, ``text`` or ``chat``.
      val_fraction: the share held out for validation.

    Raises:
      ConfigError: ``field="data"``: a missing path, a bad record (named by file and line), a
        chat file for a model without a chat template, too little data for ``seq_len``.

    Example:
      >>> from effijax.models import gpt_config
      >>> data = load_dataset(None, gpt_config("tiny", seq_len=16))
      >>> data.format, data.train.dtype.name, data.masked
      ('bytes', 'uint8', False)
    """
    seq_len = model.seq_len if seq_len is None else seq_len
    parts = mixture_spec(path)
    if parts is not None:
        return _mixture_dataset(parts, model, seq_len)
    if is_store(path):
        return _store_dataset(path, model, seq_len)
    content = _read(path, model, data_format)
    if content.format == "chat":
        return _chat(path, content, seq_len, val_fraction)
    train, val = _split_stream(path, content.stream, seq_len, val_fraction)
    train, val = _led(train, content.tokenizer), _led(val, content.tokenizer)
    return Dataset(train, val, content.fingerprint, content.format, len(content.stream),
                   content.note)


class _Plan(NamedTuple):
    """Where the rows of :func:`text_rows` start in ``stream``: runs of rows, run ``k`` holding
    rows ``row0[k]`` to ``row0[k + 1] - 1``, the ``j``-th of them starting at ``origin[k] + j *
    seq_len``; ``own[k]``: a run of one row led by the stream's own ``first`` (a document's
    BOS) at ``origin[k]``. One int per run, not per row: a stream of any size is planned in
    memory that grows with its documents at most."""

    stream: Any
    seq_len: int
    pad_id: int
    first: int | None
    row0: np.ndarray
    origin: np.ndarray
    own: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.row0[-1])


def _positions(stream, value: int) -> np.ndarray:
    """Where ``stream`` holds ``value``, read a block at a time (a mapped store's pages let go
    after each)."""
    block, found = 16 * 2**20, []
    for at in range(0, stream.size, block):
        found.append(np.flatnonzero(stream[at:at + block] == value) + at)
        release_pages(stream)
    return np.concatenate(found) if found else np.zeros(0, np.int64)


def _plan(stream, seq_len: int, pad_id: int, first: int | None) -> _Plan:
    """The rows of :func:`text_rows` for ``stream``: without ``first``, windows every
    ``seq_len`` tokens; with it, a row at a document's own ``first`` reads it (untrained) and
    the ``seq_len`` after it, and the next row starts after them."""
    n = stream.size
    if first is None:
        return _Plan(stream, seq_len, pad_id, None, np.array([0, -(-(n - 1) // seq_len)]),
                     np.zeros(1, np.int64), np.zeros(1, bool))
    runs, at = [], 0  # (origin, own, rows)
    for p in _positions(stream, first).tolist():
        if p < at or (p - at) % seq_len:
            continue  # a target within a row, not where one starts
        if p > at:
            runs.append((at, False, (p - at) // seq_len))
        if p + 1 < n:  # a BOS ending the stream leads no row
            runs.append((p, True, 1))
        at = p + 1 + seq_len
    if at < n:
        runs.append((at, False, -(-(n - at) // seq_len)))
    origin, own, count = zip(*runs, strict=True) if runs else ((), (), ())
    return _Plan(stream, seq_len, pad_id, first, np.cumsum([0, *count]),
                 np.asarray(origin, np.int64), np.asarray(own, bool))


def _build(plan: _Plan, index) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``index`` of ``plan``: ``(tokens, mask)``, ``int32[len(index), seq_len + 1]``."""
    index = np.arange(plan.rows)[index].reshape(-1)
    width = plan.seq_len + 1
    tokens = np.full((len(index), width), plan.pad_id, np.int32)
    mask = np.zeros((len(index), width), np.int32)
    runs = np.searchsorted(plan.row0, index, side="right") - 1
    for b, (i, k) in enumerate(zip(index.tolist(), runs.tolist(), strict=True)):
        start = int(plan.origin[k]) + (i - int(plan.row0[k])) * plan.seq_len
        if plan.first is None:
            row, at = plan.stream[start:start + width], 0
        else:
            start += bool(plan.own[k])
            row, at = plan.stream[start:start + plan.seq_len], 1
            tokens[b, 0] = plan.first
        tokens[b, at:at + row.size] = row
        mask[b, 1:at + row.size] = 1
    release_pages(plan.stream)
    return tokens, mask


class _Windows:
    """One array of :func:`_text_windows`' rows (``tokens`` or ``mask``), built for the rows
    asked: ``rows[index]`` is ``int32[len(index), seq_len + 1]``; ``shape`` and ``len`` as an
    array's."""

    def __init__(self, plan: _Plan, field: int):  # 0: tokens, 1: mask
        self.plan, self.field = plan, field
        self.shape = (plan.rows, plan.seq_len + 1)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> np.ndarray:
        return _build(self.plan, index)[self.field]


def _checked_plan(tokens, seq_len: int, pad_id: int, first: int | None) -> _Plan:
    if tokens.ndim != 1 or tokens.size < 2:
        raise ConfigError("data", tokens.size, "tokens: at least 2 are needed to evaluate")
    return _plan(tokens, seq_len, pad_id, first)


def _text_windows(tokens, seq_len: int, *, pad_id: int = 0, first: int | None = None) -> Packed:
    """The rows of :func:`text_rows`, each built when a batch asks for it: ``tokens`` (a
    store's memory map, say) is never copied whole, and only where rows start is held.

    Example:
      >>> import numpy as np
      >>> rows = _text_windows(np.array([9, 1, 2, 3, 9, 4, 5]), 3, first=9)
      >>> len(rows), rows.tokens_NW[np.array([1])].tolist(), rows.mask_NW[[1]].tolist()
      (2, [[9, 4, 5, 0]], [[0, 1, 1, 0]])
    """
    plan = _checked_plan(tokens, seq_len, pad_id, first)
    return Packed(_Windows(plan, 0), _Windows(plan, 1), examples=plan.rows,
                  filled=int(tokens.size))


def text_rows(tokens: np.ndarray, seq_len: int, *, pad_id: int = 0, first: int | None = None):
    """Every token of a stream in consecutive windows of ``seq_len + 1`` that overlap by one
    token, as :class:`~effijax.data.Packed` rows: each token after the first is a target exactly
    once; the last row is padded (padding untrained). With ``first`` (a BOS, see
    :class:`~effijax.data.Led`), each row is ``first`` and the next ``seq_len`` tokens, every
    token of the stream a target once, except where the stream holds ``first`` itself (a
    document's BOS): a row that would start there starts with that BOS, untrained, as the
    model reads a text (never ``first`` twice in a row). These are :func:`_text_windows`' rows,
    every one built.

    Example:
      >>> import numpy as np
      >>> rows = text_rows(np.arange(7), 3)
      >>> rows.tokens_NW.tolist(), int(rows.mask_NW[:, 1:].sum())
      ([[0, 1, 2, 3], [3, 4, 5, 6]], 6)
      >>> text_rows(np.arange(7), 3, first=9).tokens_NW.tolist()
      [[9, 0, 1, 2], [9, 3, 4, 5], [9, 6, 0, 0]]
      >>> text_rows(np.array([9, 1, 2, 3, 9, 4, 5]), 3, first=9).tokens_NW.tolist()
      [[9, 1, 2, 3], [9, 4, 5, 0]]
    """
    tokens = np.asarray(tokens)
    plan = _checked_plan(tokens, seq_len, pad_id, first)
    return Packed(*_build(plan, slice(None)), examples=plan.rows, filled=int(tokens.size))


def load_eval_data(path: str, model, *, seq_len: int | None = None,
                   data_format: str = "auto"):
    """All of ``path`` as :class:`~effijax.data.Packed` rows for evaluation: every record of a
    chat file, or every token of text (:func:`text_rows`), read as :func:`load_dataset` reads
    it (the same tokens), without a split. A token store (``effijax data prepare``, or the one
    ``effijax train`` prepared of large text) is read whole, memory-mapped: its text as
    :func:`_text_windows`, its chat records in order as the rows ``pack_examples`` packs, each
    row built when a batch asks for it. Returns ``(rows, fingerprint, format)``.

    Raises:
      ConfigError: as :func:`load_dataset`; a Parquet or Arrow source (prepare it first).
      FileError: a damaged or changed store.

    Example:
      >>> import pathlib, tempfile
      >>> from effijax.models import gpt_config
      >>> text = pathlib.Path(tempfile.mkdtemp()) / "a.txt"
      >>> _ = text.write_text("hello world " * 20)
      >>> rows, fingerprint, fmt = load_eval_data(str(text), gpt_config("tiny", seq_len=16))
      >>> fmt, len(rows), rows.filled
      ('bytes', 15, 240)
    """
    seq_len = model.seq_len if seq_len is None else seq_len
    if is_store(path):
        store, tokenizer = _checked_store(path, model)
        pad = 0 if tokenizer is None else padding_id(tokenizer)
        if store.format == "chat":
            rows = store_rows(store, val=None, seq_len=seq_len, pad_id=pad)
        else:
            rows = _text_windows(store.tokens, seq_len, pad_id=pad, first=_leading_bos(tokenizer))
        return rows, store.fingerprint, store.format
    content = _read(path, model, data_format, evaluating=True)
    if content.format == "chat":
        rows = pack_examples(_chat_examples(content.tokenizer, content.records), seq_len,
                             pad_id=padding_id(content.tokenizer))
    else:
        pad = 0 if content.tokenizer is None else padding_id(content.tokenizer)
        rows = text_rows(content.stream, seq_len, pad_id=pad,
                         first=_leading_bos(content.tokenizer))
    return rows, content.fingerprint, content.format
