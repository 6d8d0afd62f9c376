"""Loss and perplexity of a model on a file, with the masking training uses.

The model is any ``model_from`` a run accepts (:mod:`effijax.sources`): ``smollm2``, a
GGUF file, a Hugging Face directory, or an earlier run's directory; a LoRA run evaluates its
base with its adapters (``adapters.safetensors``, factored, not merged). The data is read
whole, by the reader training reads it with (:func:`~effijax.sources.load_eval_data`): a text
file's every token in consecutive windows, or a chat / instruction JSONL file's every record,
scored on the assistant's tokens only, each packed example attending only to itself with
positions from its own start (as if alone). Text and JSONL files larger than
:data:`~effijax.sources.MEMORY_BYTES` together are read, as ``effijax train`` reads them, from
the token store it prepares of them in effijax's cache (:func:`~effijax.sources.cached_store`,
the same tokens and rows; a run's store is reused), memory-mapped, each batch built when it is
scored: host memory does not grow with the data. A token store (``effijax data prepare``) is
read whole the same way. The loss is the mean cross-entropy over the scored tokens (each
batch's masked mean weighted by its scored tokens) and the perplexity its exponential. A
perplexity measured over few tokens (fewer than :data:`FEW_TOKENS`, or text shorter than one
window, which the model never reads with a full context) is a rough figure:
:attr:`EvalResult.caution` says so.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from effijax.data import packed_batch
from effijax.errors import ConfigError, FileError, whole_number
from effijax.memory import measure, tree_bytes
from effijax.precision import (
    PRESET_ALIASES,
    AutoPrecision,
    auto_precision,
    cpu_flags,
    get_policy,
)
from effijax.sources import (
    Opened,
    cached_store,
    check_memory,
    check_template_file,
    in_memory,
    load_eval_data,
    open_model,
    with_chat_template,
)

__all__ = ["EvalResult", "FEW_TOKENS", "load_model", "scoring_precision", "evaluate_model"]

# Below this many scored tokens a perplexity says little: a token's loss varies by a few nats,
# so the mean of 100 is uncertain by a few tenths of a nat (the perplexity by tens of percent).
FEW_TOKENS = 100


class EvalResult(NamedTuple):
    """What :func:`evaluate_model` measured.

    Attributes:
      loss: mean cross-entropy (nats) over the scored tokens; ``perplexity``: ``exp(loss)``.
      tokens: scored tokens (the targets the loss counts); ``rows``: windows of
        ``seq_len + 1`` evaluated; ``seq_len``: the window.
      format: ``"bytes"``, ``"text"`` or ``"chat"``; ``fingerprint``: the data's.
      model: what was evaluated, in words.
      precision: the precision policy of the forward pass (a preset's name);
        ``precision_reason``: how ``auto`` decided it (empty when it was asked for).
    """

    loss: float
    perplexity: float
    tokens: int
    rows: int
    seq_len: int
    format: str
    fingerprint: str
    model: str
    precision: str
    precision_reason: str

    def to_dict(self) -> dict:
        return self._asdict()

    @property
    def caution(self) -> str | None:
        """Why the perplexity is a rough figure, in words (None: nothing to say): fewer scored
        tokens than :data:`FEW_TOKENS`, or text shorter than one window.

        Example:
          >>> r = EvalResult(5.6, 270.0, 1, 1, 256, "text", "1:ab", "tiny", "fp32", "")
          >>> r.caution
          'only 1 token scored (fewer than 100, and less than one window of 256): the \
perplexity is a rough figure; evaluate on more text'
          >>> r._replace(tokens=5000, rows=20).caution is None
          True
        """
        short = self.format != "chat" and self.tokens < self.seq_len
        if self.tokens >= FEW_TOKENS and not short:
            return None
        why = [f"fewer than {FEW_TOKENS}"] if self.tokens < FEW_TOKENS else []
        why += [f"less than one window of {self.seq_len}"] if short else []
        what = "assistant token" if self.format == "chat" else "token"
        return (f"only {self.tokens:,} {what}{'' if self.tokens == 1 else 's'} scored "
                f"({', and '.join(why)}): the perplexity is a rough figure; evaluate on more "
                "text")


def load_model(model_from: str, *, seq_len: int | None = None) -> Opened:
    """What ``model_from`` names (``smollm2``, a GGUF file, a Hugging Face directory, a full
    run (its latest checkpoint) or a finished LoRA run (its base + adapters, unmerged)), opened
    by :func:`~effijax.sources.open_model`, ready to score: the tokenizer it reads data with
    attached to the model, ``seq_len`` (default: the run's, or the pretrained model's) applied,
    and ``source`` saying what it is in words (``"tiny from runs/a"``).

    ``params`` is ``{"base": ..., "adapters": ...}`` when ``lora`` is not None.

    Raises:
      ConfigError: ``field="model"``: nothing evaluable at ``model_from`` (an unknown name or
        path, a run without checkpoints or adapters).

    Example:
      >>> load_model("no/such/run")
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: model='no/such/run': no such run directory, GGUF file ...
    """
    try:
        loaded = open_model(model_from)
    except FileError:  # names the file, the field or byte: said as it is
        raise
    except ConfigError as e:
        raise ConfigError("model", model_from, e.problem) from None
    except (OSError, ValueError) as e:
        raise ConfigError("model", model_from, f"cannot read it ({e})") from None
    model = loaded.model
    if loaded.tokenizer is not None and loaded.tokenizer is not getattr(model, "tokenizer", None):
        # A full run's model is rebuilt from its config.json without one; a LoRA run's may
        # carry the run's --chat-template: what the run read its data with.
        model = dataclasses.replace(model, tokenizer=loaded.tokenizer)
    model = model if seq_len is None else model.with_seq_len(seq_len)
    adapted = "" if loaded.lora is None else f" + LoRA r={loaded.lora.rank} adapters"
    return dataclasses.replace(loaded, model=model,
                               source=f"{model.name} from {model_from}{adapted}")


def scoring_precision(precision: str, opened: Opened) -> AutoPrecision:
    """The forward pass's precision for ``opened``: ``precision`` itself (a preset's name or
    alias), or for ``auto`` the precision a run directory trained in (as a resume keeps it),
    else :func:`effijax.precision.auto_precision`'s choice for the model's width here.

    Example:
      >>> from effijax.models import gpt_config
      >>> scoring_precision("float32", Opened(gpt_config("tiny"), None))
      AutoPrecision(precision='fp32', reason='')
      >>> scoring_precision("auto", Opened(gpt_config("tiny"), None, precision="bf16"))
      AutoPrecision(precision='bf16', reason="auto: the run's own")
    """
    if precision != "auto":
        return AutoPrecision(PRESET_ALIASES.get(precision, precision), "")
    if opened.precision is not None:
        return AutoPrecision(opened.precision, "auto: the run's own")
    return auto_precision(jax.default_backend(), opened.model.shape().hidden, cpu_flags())


def _source(data: str, model, chat_template: str | None, data_format: str, say) -> str:
    """``data`` as training reads it: text or JSONL files larger than
    :data:`~effijax.sources.MEMORY_BYTES` replaced by the store training prepares of them
    (``like_memory``: the same tokens, rows and identity); anything else as it is (a Parquet
    source too: :func:`~effijax.sources.load_eval_data` says how to prepare it)."""
    tokenizer = getattr(model, "tokenizer", None)
    if in_memory(data, tokenizer, data_format):
        return data
    return str(cached_store(data, tokenizer, chat_template=chat_template,
                            data_format=data_format, like_memory=True, print_fn=say))


def _batches(rows, batch_size: int):
    """Consecutive rows in batches of ``batch_size``; the last is filled with unscored rows.
    Packed chat rows carry their segments (each example scored as if alone)."""
    n = len(rows)
    for start in range(0, n, batch_size):
        index = np.arange(start, start + batch_size)
        real = index < n
        yield packed_batch(rows, np.where(real, index, 0), real)


def _scorer(loss_fn, policy, params, rows, batch_size: int):
    """The loss of one batch, compiled ahead of time from the batch's shapes (no batch is
    built yet) and refused before it runs when it does not fit in memory."""

    def scored(p, batch):
        return loss_fn(policy.cast_to_compute(p), batch, None)[0]

    one = packed_batch(rows, np.zeros(1, np.int64), np.ones(1, bool))
    batch = {k: jax.ShapeDtypeStruct((batch_size, *v.shape[1:]), v.dtype) for k, v in one.items()}
    compiled = jax.jit(scored).lower(params, batch).compile()
    check_memory(measure(compiled).total_bytes, tree_bytes(params),
            what=f"evaluating batches of {batch_size:,} rows of {rows.tokens_NW.shape[1] - 1:,} "
            "tokens", fix="lower --batch-size")
    return compiled


def evaluate_model(model: str, data: str, *, seq_len: int | None = None, batch_size: int = 8,
                   data_format: str = "auto", max_batches: int | None = None,
                   precision: str = "fp32", chat_template: str | None = None,
                   say: Callable[[str], Any] | None = None) -> EvalResult:
    """Loss and perplexity of ``model`` on the file ``data`` (see the module docstring).

    Args:
      model: ``smollm2``, a GGUF file, a Hugging Face directory, or a run directory.
      data: a text file or folder, a chat / instruction ``.jsonl`` file, or a token store.
      seq_len: the window (default: the model's).
      batch_size: windows per forward pass.
      data_format: ``auto`` (chat for ``.jsonl``), ``text`` or ``chat``.
      max_batches: evaluate only the first this many batches (None: all).
      precision: a precision policy (the compute dtype of the forward pass), or ``auto``
        (``effijax eval``'s default): a run directory's own precision, else decided for the
        loaded model as :func:`effijax.precision.auto_precision` decides it, as ``effijax
        train`` decides it (:func:`scoring_precision`).
      chat_template: a Jinja chat template file that renders chat data instead of the model's
        own (``--chat-template``, as :func:`~effijax.recipe.train` takes it).
      say: given a line before each stage that takes seconds for a real model (loading it,
        reading the data, compiling and scoring), as it begins (``effijax eval`` prints them).

    Raises:
      ConfigError: a bad model, data file or record (file and line), or setting; a batch
        whose compiled forward pass does not fit in memory (``field="memory"``), before it
        runs.

    Example:
      >>> import pathlib, tempfile
      >>> from effijax.recipe import TrainConfig, train
      >>> out = tempfile.mkdtemp()
      >>> _ = train(TrainConfig(model="tiny", seq_len=16, steps=2, batch_size=2,
      ...                       eval_batches=0, progress=False, out=out))  # doctest: +ELLIPSIS
      effijax train: ...
      >>> text = pathlib.Path(out) / "sample.txt"
      >>> _ = text.write_text("def f(x):\\n    return x\\n" * 20)
      >>> r = evaluate_model(out, str(text))
      >>> r.format, r.tokens, round(r.perplexity, 2) == round(math.exp(r.loss), 2)
      ('bytes', 459, True)
    """
    whole_number("batch_size", batch_size)
    whole_number("max_batches", max_batches, none=True)
    whole_number("seq_len", seq_len, minimum=2, none=True)
    if not Path(data).exists():
        raise ConfigError("data", data, "no such file or folder")
    if precision != "auto":  # a bad name is refused before anything is loaded, as precision
        try:
            get_policy(precision)
        except ConfigError as e:
            raise e.renamed("precision") from None
    check_template_file(chat_template)
    say = say or (lambda line: None)
    say(f"loading {model}")
    opened = load_model(model, seq_len=seq_len)
    lm, params, spec = opened.model, opened.params, opened.lora
    decided = scoring_precision(precision, opened)
    policy = get_policy(decided.precision)
    if chat_template is not None:
        lm = with_chat_template(lm, chat_template)
    say(f"reading {data}")
    rows, fingerprint, fmt = load_eval_data(_source(data, lm, chat_template, data_format, say),
                                            lm, data_format=data_format)
    batches = -(-len(rows) // batch_size)
    n = min(batches, max_batches or batches)
    why = f" ({decided.reason})" if decided.reason else ""
    say(f"compiling the forward pass in {decided.precision}{why}, then scoring {n:,} "
        f"batch{'' if n == 1 else 'es'} of {batch_size} windows")
    scored = _scorer(lm.loss_fn(spec), policy, params, rows, batch_size)
    total, count, evaluated = 0.0, 0, 0
    for i, batch in enumerate(_batches(rows, batch_size)):
        if max_batches is not None and i >= max_batches:
            break
        n = int(np.count_nonzero(batch["mask"]))
        evaluated += min(batch_size, len(rows) - i * batch_size)
        if n:
            total += float(scored(params, batch)) * n
            count += n
    if not count:
        raise ConfigError("data", data, "has no token to score (a chat file whose assistant "
                          "turns all fall beyond seq_len?)")
    loss = total / count
    return EvalResult(loss=loss, perplexity=math.exp(min(loss, 700.0)), tokens=count,
                      rows=evaluated, seq_len=lm.seq_len, format=fmt, fingerprint=fingerprint,
                      model=opened.source, precision=decided.precision,
                      precision_reason=decided.reason)
