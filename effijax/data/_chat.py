"""Chat and instruction data: JSONL records rendered with a model's chat template, trained on
the assistant's tokens only.

A record is one JSON object per line, either ``{"messages": [{"role": ..., "content": ...},
...]}`` or ``{"prompt": ..., "response": ...}`` (optionally with ``"system"``), which is the
conversation ``[system?, user: prompt, assistant: response]``. :func:`read_records` checks every
line and names the file and line of the first bad one.

:func:`render_chat` renders a conversation with the tokenizer's own chat template (Jinja, as
``transformers`` renders it) and tokenizes the whole text at once, so the ids are exactly what the
model sees at generation time. The loss mask marks the tokens of each assistant turn: the text
the template adds for that turn beyond the generation prompt that precedes it (the reply and its
end-of-turn token, such as ``<|im_end|>``; whitespace the template writes after the turn is not
trained). A token is trained when its first character lies in such a span.

:func:`pack_examples` packs the rendered examples whole, in order, into rows of ``seq_len + 1``
tokens (greedy next-fit: an example that does not fit in the current row starts the next one);
the rest of a row is padding that is never trained. An example longer than a row keeps its first
``seq_len + 1`` tokens. Each token also gets its example's id in the row (1, 2, ... in order, 0 for
padding): the batches carry these as ``"segments"``, with which the models keep attention within
an example and restart positions at its start, so a packed example is trained exactly as if it
were alone in its row (as ``transformers``' flattening collator with position ids does). The
first token of an example is never a target (nothing before it in its own context predicts
it). The training batches are rows drawn by :func:`~effijax.data.batch_at`.
:func:`split_records` holds out a deterministic set of records by their content.

The tokenizer is any object with ``apply_chat_template(messages, add_generation_prompt=...)``
and a ``tokenizers`` ``backend`` (:class:`effijax.models.Tokenizer`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from effijax.data._corpus import val_count
from effijax.data._files import bounded_lines
from effijax.errors import NO_VALUE, ConfigError, whole_number

__all__ = ["Record", "Packed", "MAX_SPAN_WORK", "parse_line", "table_record", "read_records",
           "render_chat", "turn_end_id", "pack_examples", "split_records", "records_fingerprint",
           "target_mask"]

_RECORD_KEYS = ({"messages"}, {"prompt", "response"}, {"prompt", "response", "system"})


class Record(NamedTuple):
    """One conversation: ``messages`` (``[{"role", "content"}]``), where it came from
    (``source``: ``"file:line"``) and the line's text (``raw``, what the split hashes)."""

    messages: tuple[dict, ...]
    source: str
    raw: str


class Packed(NamedTuple):
    """Packed examples: ``tokens_NW`` (int32 ids) and ``mask_NW`` (int32, 1 = trained) of ``N``
    rows of ``W = seq_len + 1`` tokens; the batches' targets and mask are ``[:, 1:]``.

    Attributes:
      tokens_NW, mask_NW: the rows.
      segments_NW: int32 example ids within each row (1..n in order, 0 for padding), or None
        for rows that are windows of one text stream (no segments: each row is one sequence).
        The batches' ``"segments"`` are ``[:, :-1]`` (the inputs').
      examples: examples packed; ``truncated``: of them, cut to one row.
      filled: real tokens in the rows (padding excluded).
    """

    tokens_NW: np.ndarray
    mask_NW: np.ndarray
    segments_NW: np.ndarray | None = None
    examples: int = 0
    truncated: int = 0
    filled: int = 0

    def __len__(self) -> int:
        return len(self.tokens_NW)

    @property
    def trained_tokens(self) -> int:
        """Target positions with a nonzero mask (the first column is never a target)."""
        return int(np.count_nonzero(target_mask(self.mask_NW, self.segments_NW)))


def target_mask(mask_NW: np.ndarray, segments_NW: np.ndarray | None) -> np.ndarray:
    """The targets' loss mask of rows ``[N, W]``: ``mask_NW[:, 1:]``, and with segments zero
    where a target starts another segment than its input (an example's first token, which the
    example alone never predicts).

    Example:
      >>> import numpy as np
      >>> target_mask(np.array([[0, 1, 1, 1]]), np.array([[1, 1, 2, 2]])).tolist()
      [[1, 0, 1]]
    """
    mask_NS = mask_NW[:, 1:]
    if segments_NW is None:
        return mask_NS
    return mask_NS * (segments_NW[:, 1:] == segments_NW[:, :-1]).astype(mask_NS.dtype)


def _bad(source: str, problem: str) -> ConfigError:
    return ConfigError("data", source, problem + "; expected one JSON object per line: "
                       '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", '
                       '"content": "..."}]} or {"prompt": "...", "response": "..."}')


def _surrogate(text: str) -> int | None:
    """Where ``text`` holds a lone surrogate (JSON's ``"\\ud800"``), which is no character
    and cannot be encoded or tokenized; None for text."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _check_text(obj: dict, source: str, where: str) -> None:
    for key, value in obj.items():
        at = _surrogate(value)
        if at is not None:
            raise _bad(source, f"{where}{key!r} holds a lone surrogate ({value[at]!r} at "
                       f"character {at:,}), which is not text: fix the escape that wrote it")


def _record(obj: Any, source: str) -> tuple[dict, ...]:
    if not isinstance(obj, dict):
        raise _bad(source, f"a JSON {type(obj).__name__}, not an object")
    if set(obj) not in _RECORD_KEYS:
        raise _bad(source, f"keys {sorted(obj)}")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise _bad(source, '"messages" must be a non-empty list')
        for i, m in enumerate(messages):
            if (not isinstance(m, dict) or set(m) != {"role", "content"}
                    or not isinstance(m["role"], str) or not m["role"]
                    or not isinstance(m["content"], str)):
                raise _bad(source, f'messages[{i}] must be {{"role": str, "content": str}}, '
                           f"got {json.dumps(m)[:80]}")
        for i, m in enumerate(messages):
            _check_text(m, source, f"messages[{i}]")
        if not any(m["role"] == "assistant" for m in messages):
            raise _bad(source, 'no message has role "assistant": nothing to train on')
        return tuple({"role": m["role"], "content": m["content"]} for m in messages)
    for key in sorted(obj):
        if not isinstance(obj[key], str):
            raise _bad(source, f'"{key}" must be a string, got {type(obj[key]).__name__}')
    _check_text(obj, source, "")
    system = ({"role": "system", "content": obj["system"]},) if "system" in obj else ()
    return (*system, {"role": "user", "content": obj["prompt"]},
            {"role": "assistant", "content": obj["response"]})


def parse_line(line: str, source: str) -> Record:
    """One JSONL line as a :class:`Record` (its ``raw`` text: the line stripped).

    Raises:
      ConfigError: ``field="data"``, value ``source``: the line is not a record (see
        :func:`read_records`).

    Example:
      >>> parse_line('{"prompt": "2+2?", "response": "4"}', "x:1").messages[1]
      {'role': 'assistant', 'content': '4'}
    """
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise _bad(source, f"not JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:  # Python's JSON reader recurses once per level
        raise _bad(source, "nested too deeply to read") from None
    return Record(_record(obj, source), source, line.strip())


def table_record(row: dict, source: str) -> Record:
    """A table's row (its ``messages``, or ``prompt``/``response``/``system`` columns) as a
    :class:`Record`; its ``raw`` text, which the split hashes, is the row as compact JSON with
    sorted keys.

    Example:
      >>> table_record({"prompt": "2+2?", "response": "4"}, "t.parquet:0").raw
      '{"prompt":"2+2?","response":"4"}'
    """
    raw = json.dumps(row, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return Record(_record(row, source), source, raw)


def read_records(path: str | os.PathLike) -> list[Record]:
    """Reads and checks a chat / instruction JSONL file (blank lines are skipped).

    Raises:
      ConfigError: ``field="data"``, value ``"file:line"`` of the first bad record (not UTF-8,
        longer than :data:`~effijax.data.MAX_RECORD_BYTES`, not JSON or nested too deeply,
        unknown keys, a message that is not ``{"role": str, "content": str}``, a string with a
        lone surrogate such as ``"\\ud800"``, no assistant message), the file has no record,
        or is not a regular file (a pipe, a device).

    Example:
      >>> import pathlib, tempfile
      >>> f = pathlib.Path(tempfile.mkdtemp()) / "chat.jsonl"
      >>> _ = f.write_text('{"prompt": "2+2?", "response": "4"}\\n\\n{"prompt": 1}\\n')
      >>> read_records(f)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      effijax.errors.ConfigError: data='.../chat.jsonl:3': keys ['prompt']; expected ...
    """
    path = Path(path)
    records = [parse_line(line, f"{path}:{number}") for number, line in bounded_lines(path, "data")
               if line.strip()]
    if not records:
        raise ConfigError("data", str(path), "holds no record (one JSON object per line)")
    return records


def records_fingerprint(records: Sequence[Record]) -> str:
    """``"<n records>:<sha256 prefix>"`` of the records' lines, in order.

    Example:
      >>> records_fingerprint([Record(({"role": "assistant", "content": "hi"},), "x:1", "{}")])
      '1:ca3d163bab055381'
    """
    digest = hashlib.sha256()
    for r in records:
        digest.update(r.raw.encode("utf-8") + b"\n")
    return f"{len(records)}:{digest.hexdigest()[:16]}"


def split_records(records: Sequence[Record], val_fraction: float = 0.05
                  ) -> tuple[list[Record], list[Record]]:
    """``(train, val)``: the ``max(1, round(n * val_fraction))`` records with the smallest
    SHA-256 of their line are validation, the rest train; both keep the file's order.

    The choice depends on each record's content only, so editing or reordering other records
    moves no record between the splits except at the boundary of the count.

    Raises:
      ConfigError: ``val_fraction`` not in (0, 1), or fewer than 2 records.

    Example:
      >>> recs = [Record((), f"x:{i}", str(i)) for i in range(40)]
      >>> train, val = split_records(recs)
      >>> len(train), [r.raw for r in val]
      (38, ['9', '39'])
    """
    if (isinstance(val_fraction, bool) or not isinstance(val_fraction, int | float)
            or not 0.0 < val_fraction < 1.0):
        raise ConfigError("val_fraction", val_fraction, "expected a fraction in (0, 1), e.g. 0.05")
    if len(records) < 2:
        raise ConfigError("data", len(records), "records: at least 2 are needed (one is held "
                          "out for validation)")
    n_val = val_count(len(records), val_fraction)
    order = sorted(range(len(records)),
                   key=lambda i: hashlib.sha256(records[i].raw.encode("utf-8")).digest())
    held = set(order[:n_val])
    return ([r for i, r in enumerate(records) if i not in held],
            [r for i, r in enumerate(records) if i in held])


def _render(tokenizer, messages, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(list(messages),
                                         add_generation_prompt=add_generation_prompt)


#: Work the prefix renders of one conversation may do in all (see :func:`assistant_spans`),
#: in characters rendered, each message rendered counting as :data:`_MESSAGE_COST` more (a
#: template spends about as long on a message as on 512 characters): about 7 s at worst.
#: Conversations of up to about 500 short messages, or 16 turns over 4 MiB, fit.
MAX_SPAN_WORK = 2**26
_MESSAGE_COST = 512


def _too_long(messages: Sequence[dict], turns: int, work: float) -> ConfigError:
    # Named as a template's error: the caller names the record it met (file and line).
    return ConfigError("chat_template", NO_VALUE, f"a conversation of {len(messages):,} "
                       "messages: locating its assistant turns renders it again up to each of "
                       f"its {turns:,} assistant "
                       f"turns: about {work:,.0f} characters in all, over the {MAX_SPAN_WORK:,} "
                       f"allowed (a message counts as {_MESSAGE_COST}); split it into shorter "
                       "conversations")


def assistant_spans(tokenizer, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
    """``(text, spans)``: the rendered conversation and the ``[start, end)`` character spans
    of its assistant turns (see the module docstring).

    A template is code, so where turn ``i`` starts is only known by rendering the first ``i``
    messages: the work grows with the square of the conversation's length. It is bounded by
    :data:`MAX_SPAN_WORK`, estimated from the whole text before any prefix is rendered (so a
    conversation of 100,000 turns is refused at once) and counted as the prefixes render.

    Raises:
      ConfigError: ``field="chat_template"``: the template does not render a conversation's
        prefixes as prefixes of the whole (the assistant's spans cannot then be found);
        or the conversation needs more than :data:`MAX_SPAN_WORK`.
    """
    text = _render(tokenizer, messages)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    # The estimate: each prefix as long as its share of the messages' characters.
    at, before_chars = 0, []
    for m in messages:
        before_chars.append(at)
        at += len(m["content"]) + 1
    estimate = sum(2 * (len(text) * before_chars[i] / at + _MESSAGE_COST * i) for i in turns)
    if estimate > MAX_SPAN_WORK:
        raise _too_long(messages, len(turns), estimate)
    spans, work = [], 0
    for i in turns:
        before = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        upto = _render(tokenizer, messages[: i + 1])
        work += len(before) + len(upto) + _MESSAGE_COST * (2 * i + 1)
        if work > MAX_SPAN_WORK:
            raise _too_long(messages, len(turns), work)
        if not (text.startswith(upto) and upto.startswith(before)):
            raise ConfigError("chat_template", "the model's", "renders a conversation's first "
                              "turns differently from the whole conversation, so the assistant "
                              "turns cannot be located; use a template that renders turn by turn")
        end = len(upto.rstrip())
        if end > len(before):
            spans.append((len(before), end))
    return text, spans


def render_chat(tokenizer, messages: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)``: a conversation rendered with the chat template and tokenized whole,
    and ``mask`` (int32, 1 on the assistant turns' tokens).

    No BOS/EOS is added beyond what the template writes (``transformers``'
    ``apply_chat_template(tokenize=True)`` gives the same ids).

    Example:
      >>> from effijax.models import byte_level_bpe
      >>> tok = byte_level_bpe(["<s>", "a", "b", ":", "Ċ"], [], token_types=[3, 1, 1, 1, 1],
      ...     chat_template="{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
      ...                   "<s>{% endfor %}{% if add_generation_prompt %}a:{% endif %}")
      >>> ids, mask = render_chat(tok, [{"role": "b", "content": "ab"},
      ...                               {"role": "assistant", "content": "ba"}])
      >>> tok.decode(ids), mask.tolist()  # trained: "ba<s>"
      ('b:ab<s>a:ba<s>', [0, 0, 0, 0, 0, 0, 0, 1, 1, 1])
    """
    text, spans = assistant_spans(tokenizer, messages)
    encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    ids = np.asarray(encoding.ids, np.int32)
    starts = np.asarray([start for start, _ in encoding.offsets], np.int64)
    mask = np.zeros(len(ids), np.int32)
    for a, b in spans:
        mask[(starts >= a) & (starts < b)] = 1
    return ids, mask


def turn_end_id(tokenizer) -> int | None:
    """The special token the chat template closes an assistant turn with, or None (none, or
    plain text). A reply ends there: SmolLM2's ``<|im_end|>`` is also its EOS, but Gemma's
    ``<end_of_turn>`` is not (its EOS is ``<eos>``), so generation stops at either.

    Example:
      >>> from effijax.models import byte_level_bpe
      >>> tok = byte_level_bpe(["<s>", "<e>", "a", "b", ":"], [], token_types=[3, 3, 1, 1, 1],
      ...     chat_template="{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
      ...                   "<e>{% endfor %}{% if add_generation_prompt %}a:{% endif %}")
      >>> tok.token(turn_end_id(tok))
      '<e>'
    """
    reply = "Hello."
    text, spans = assistant_spans(tokenizer, [{"role": "user", "content": "Hi."},
                                              {"role": "assistant", "content": reply}])
    if not spans:
        return None
    start, end = spans[-1]
    after = text.find(reply, start)
    if after < 0:  # the template rewrote the reply: no end to locate
        return None
    ids = tokenizer.backend.encode(text[after + len(reply):end], add_special_tokens=False).ids
    if not ids or tokenizer.decode([ids[0]], skip_special_tokens=True) != "":
        return None
    return int(ids[0])


def pack_examples(examples: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int, *,
                  pad_id: int) -> Packed:
    """Packs ``(ids, mask)`` examples whole, in order, into rows of ``seq_len + 1`` tokens.

    Greedy next-fit: an example that does not fit in the current row's free space starts a new
    row; padding (``pad_id``, mask 0, segment 0) fills the rest. An example longer than a row is
    cut to its first ``seq_len + 1`` tokens (counted in ``truncated``). ``segments_NW`` numbers
    the examples of each row 1, 2, ... in order.

    Raises:
      ConfigError: no example, or ``seq_len`` below 1.

    Example:
      >>> import numpy as np
      >>> ex = [(np.array([1, 2, 3]), np.array([0, 1, 1])), (np.array([4, 5]), np.array([0, 1]))]
      >>> p = pack_examples(ex, 3, pad_id=0)
      >>> p.tokens_NW.tolist(), p.mask_NW.tolist()
      ([[1, 2, 3, 0], [4, 5, 0, 0]], [[0, 1, 1, 0], [0, 1, 0, 0]])
      >>> p = pack_examples(ex, 4, pad_id=0)
      >>> p.tokens_NW.tolist(), p.segments_NW.tolist()
      ([[1, 2, 3, 4, 5]], [[1, 1, 1, 2, 2]])
    """
    whole_number("seq_len", seq_len)
    if not examples:
        raise ConfigError("data", 0, "examples: nothing to pack")
    width = seq_len + 1
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = []
    used = width  # forces a first row
    truncated = 0
    for ids, mask in examples:
        ids, mask = np.asarray(ids, np.int32), np.asarray(mask, np.int32)
        if len(ids) > width:
            ids, mask, truncated = ids[:width], mask[:width], truncated + 1
        if used + len(ids) > width:
            rows.append([])
            used = 0
        rows[-1].append((ids, mask))
        used += len(ids)
    tokens_NW = np.full((len(rows), width), pad_id, np.int32)
    mask_NW = np.zeros((len(rows), width), np.int32)
    segments_NW = np.zeros((len(rows), width), np.int32)
    for r, row in enumerate(rows):
        at = 0
        for number, (ids, mask) in enumerate(row, start=1):
            tokens_NW[r, at:at + len(ids)] = ids
            mask_NW[r, at:at + len(ids)] = mask
            segments_NW[r, at:at + len(ids)] = number
            at += len(ids)
    filled = sum(len(ids) for row in rows for ids, _ in row)
    return Packed(tokens_NW, mask_NW, segments_NW, examples=len(examples), truncated=truncated,
                  filled=filled)
