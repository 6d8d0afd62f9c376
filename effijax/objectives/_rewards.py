"""Reward functions for RL from verifiable rewards, with TRL's calling convention.

A reward is a plain callable ``reward(prompts, completions, **columns) -> list[float]``, TRL's
``GRPOTrainer`` signature: one number per completion, ``None`` where it does not apply. It is
called with keyword arguments: ``prompts`` and ``completions`` (texts, or chat messages for
conversational data), ``completion_ids`` (the completions' token ids) and the prompt data's other
columns (e.g. ``answer``), each a list with one entry per completion; a reward takes what it
needs and ``**kwargs`` for the rest. :func:`score_completions` calls each reward and combines
them as TRL does (``sum_then_normalize``): the weighted sum of the rewards that scored the
completion (a ``None`` counts as nothing), NaN where none did (such a completion gets advantage 0,
:func:`effijax.objectives.group_advantages`). A reward that raises, or returns the wrong count or
type, is one :class:`RewardError` naming it.

:func:`resolve_reward` turns a name into a reward: a built-in (:data:`REWARDS`: ``exact_match``,
``answer_format``) or a dotted path ``"package.module:function"`` or
``"package.module.function"``, imported (never evaluated).
"""

from __future__ import annotations

import functools
import importlib
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from effijax.errors import ConfigError

__all__ = ["REWARDS", "RewardError", "Scores", "answer_format", "exact_match", "extract_answer",
           "format_reward", "resolve_reward", "reward_name", "score_completions"]


class RewardError(ValueError):
    """A reward function failed: it raised, or returned something other than one number (or
    None) per completion. The message names the function.

    Example:
      >>> str(RewardError("len_reward", "returned 3 rewards for 4 completions"))
      "reward 'len_reward': returned 3 rewards for 4 completions"
    """

    def __init__(self, name: str, problem: str):
        self.name = name
        self.problem = problem
        super().__init__(f"reward {name!r}: {problem}")


def _text(completion) -> str:
    """A completion's text: itself, or the last message's content for chat messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], Mapping):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"expected a completion text or a list of chat messages, got "
                    f"{type(completion).__name__}")


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def extract_answer(text: str) -> str | None:
    """The final answer a completion states: the last ``<answer>...</answer>``, else the last
    ``\\boxed{...}``, else what follows the last ``####`` (GSM8K's marker) on its line, else
    the last number in the text, else the text itself (stripped); None for a blank text.

    Example:
      >>> extract_answer("3 + 4 = 7, so <answer> 7 </answer>"), extract_answer("#### 1,024")
      ('7', '1,024')
      >>> extract_answer("it is 12, not 13."), extract_answer(" Paris "), extract_answer(" ")
      ('13', 'Paris', None)
    """
    tags = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    if tags:
        return tags[-1].strip()
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxed:
        return boxed[-1].strip()
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    numbers_ = _NUMBER.findall(text)
    if numbers_:
        return numbers_[-1]
    return text.strip() or None


def _normalise(answer: str) -> str | float:
    """An answer for comparison: a number as a float (commas, ``$`` and a final ``.`` dropped),
    else the case-folded text with its spaces collapsed."""
    text = " ".join(str(answer).split()).strip().rstrip(".").replace("$", "")
    plain = text.replace(",", "")
    try:
        return float(plain)
    except ValueError:
        return text.casefold()


def exact_match(prompts, completions, answer, **columns) -> list[float | None]:
    """1.0 where the completion's final answer (:func:`extract_answer`) equals the ``answer``
    column (numbers by value, text case-insensitively), else 0.0; None where the answer is
    None (the completion is not scored by this reward).

    Example:
      >>> exact_match(["1+1?", "1+1?", "2*3?"], ["It is 2.", "<answer>3</answer>", "6.0"],
      ...             answer=["2", "2", 6])
      [1.0, 0.0, 1.0]
    """
    out: list[float | None] = []
    for completion, expected in zip(completions, answer, strict=True):
        if expected is None:
            out.append(None)
            continue
        found = extract_answer(_text(completion))
        out.append(float(found is not None and _normalise(found) == _normalise(expected)))
    return out


def format_reward(pattern: str, *, name: str = "format") -> Callable[..., list[float]]:
    """A reward of 1.0 where the completion matches the regular expression ``pattern`` from
    its start (``re.match`` with ``DOTALL`` and ``MULTILINE``, as TRL's format rewards), else
    0.0; called ``name`` in the metrics.

    Example:
      >>> think = format_reward(r"^<think>.*?</think>", name="think_format")
      >>> think(prompts=["q", "q"], completions=["<think>hm</think> 4", "4"])
      [1.0, 0.0]
    """
    try:
        compiled = re.compile(pattern, re.DOTALL | re.MULTILINE)
    except (re.error, TypeError) as e:
        raise ConfigError("pattern", pattern, f"not a regular expression: {e}") from None

    def reward(prompts, completions, **columns) -> list[float]:
        return [float(compiled.match(_text(c)) is not None) for c in completions]

    reward.__name__ = reward.__qualname__ = name
    return reward


answer_format = format_reward(r"^(?:(?!<answer>).)*<answer>.+?</answer>\s*$",
                              name="answer_format")
"""1.0 where the completion ends with one ``<answer>...</answer>``, else 0.0."""

REWARDS: dict[str, Callable[..., list]] = {
    "exact_match": exact_match,
    "answer_format": answer_format,
}
"""The built-in rewards, by the name :func:`resolve_reward` takes."""


def reward_name(reward: Callable) -> str:
    """A reward's name in the metrics: its ``__name__`` (a ``functools.partial``'s function's),
    else its class's, as TRL names them.

    Example:
      >>> import functools
      >>> reward_name(exact_match), reward_name(functools.partial(exact_match, answer=[]))
      ('exact_match', 'exact_match')
    """
    while isinstance(reward, functools.partial):
        reward = reward.func
    return getattr(reward, "__name__", type(reward).__name__)


def resolve_reward(spec: str | Callable) -> Callable[..., list]:
    """The reward ``spec`` names: a callable itself; a built-in's name (:data:`REWARDS`); or a
    dotted path, ``"package.module:function"`` (an attribute path after the colon) or
    ``"package.module.function"``, imported with :mod:`importlib` (never evaluated).

    Raises:
      ConfigError: the name is neither, the module does not import, or it has no such
        callable.

    Example:
      >>> resolve_reward("exact_match") is exact_match
      True
      >>> resolve_reward("effijax.objectives:answer_format") is answer_format
      True
      >>> resolve_reward("effijax.objectives.no_such_reward")
      Traceback (most recent call last):
      effijax.errors.ConfigError: reward='effijax.objectives.no_such_reward': module ...
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("reward", spec, "expected a callable, a built-in reward's name "
                          f"({', '.join(REWARDS)}) or a dotted path 'package.module:function'")
    spec = spec.strip()
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" in spec:
        module_name, _, attribute = spec.partition(":")
    elif "." in spec:
        module_name, _, attribute = spec.rpartition(".")
    else:
        raise ConfigError("reward", spec, f"not a built-in reward ({', '.join(REWARDS)}) nor a "
                          "dotted path: write 'package.module:function'")
    if not module_name or not attribute or not all(
            part.isidentifier() for part in module_name.split(".") + attribute.split(".")):
        raise ConfigError("reward", spec, "a dotted path is 'package.module:function' (Python "
                          "identifiers separated by dots)")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 -- any import failure is the user's to see, named
        raise ConfigError("reward", spec, f"module {module_name!r} does not import: "
                          f"{type(e).__name__}: {e}") from e
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError("reward", spec, f"module {module_name!r} has no {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError("reward", spec, f"{attribute!r} in {module_name!r} is a "
                          f"{type(target).__name__}, not a callable")
    return target


class Scores(NamedTuple):
    """What :func:`score_completions` returns.

    Attributes:
      per_reward: f32 ``[N, F]``, reward ``f`` of completion ``n`` (NaN where it returned None).
      rewards: f32 ``[N]``, their weighted sum over the rewards that scored each completion
        (NaN where none did): what the advantages are formed of.
      names: the rewards' names (:func:`reward_name`), unique (a repeated name gets ``_2``, ...).
      metrics: TRL's ``rewards/{name}/mean`` and ``rewards/{name}/std`` of each reward (over the
        completions it scored; the deviation Bessel-corrected).
    """

    per_reward: np.ndarray
    rewards: np.ndarray
    names: tuple[str, ...]
    metrics: dict[str, float]


def _unique(names: list[str]) -> tuple[str, ...]:
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return tuple(out)


def _values(name: str, out, n: int) -> np.ndarray:
    """A reward's output checked: ``n`` numbers or Nones, as f32 (None as NaN)."""
    if isinstance(out, str | bytes | Mapping) or not isinstance(out, Sequence | np.ndarray):
        raise RewardError(name, f"returned a {type(out).__name__}; expected a list of {n} "
                          "numbers (one per completion, None where it does not apply)")
    values = list(out)
    if len(values) != n:
        raise RewardError(name, f"returned {len(values)} rewards for {n} completions; it must "
                          "return exactly one per completion")
    array = np.full(n, np.nan, np.float32)
    for i, v in enumerate(values):
        if v is None:
            continue
        if not isinstance(v, numbers.Real | np.bool_):
            raise RewardError(name, f"returned a {type(v).__name__} ({v!r}) for completion {i}; "
                              "expected a number or None")
        if math.isinf(float(v)):
            raise RewardError(name, f"returned {float(v)} for completion {i}; rewards must be "
                              "finite (None or NaN where it does not apply)")
        array[i] = float(v)
    return array


def score_completions(rewards: Sequence[Callable | str], prompts: Sequence,
                      completions: Sequence, *, weights: Sequence[float] | None = None,
                      completion_ids: Sequence | None = None,
                      columns: Mapping[str, Sequence] | None = None) -> Scores:
    """Scores ``N`` completions with each reward and combines them as TRL's ``GRPOTrainer``
    does: the weighted sum, over the rewards that scored a completion, of their values (TRL's
    ``nansum``), NaN where none did.

    Args:
      rewards: the reward functions, or names :func:`resolve_reward` resolves.
      prompts: ``N`` prompts (each repeated for its ``G`` completions).
      completions: ``N`` completions (texts or chat messages).
      weights: one weight per reward (TRL's ``reward_weights``); None: all 1.
      completion_ids: ``N`` token-id lists, passed on as ``completion_ids`` when given.
      columns: the prompt data's other columns, ``N`` values each, passed on by name.

    Raises:
      ConfigError: no rewards, weights that do not match them, columns of the wrong length.
      RewardError: a reward raised, or returned the wrong count or type (the message names it).

    Example:
      >>> scores = score_completions(
      ...     ["exact_match", "answer_format"], ["2+2?"] * 2,
      ...     ["<answer>4</answer>", "5"], weights=[1.0, 0.5], columns={"answer": ["4", "4"]})
      >>> scores.rewards.tolist(), scores.names
      ([1.5, 0.0], ('exact_match', 'answer_format'))
      >>> score_completions([lambda prompts, completions, **kw: [1.0]], ["a", "b"], ["c", "d"])
      Traceback (most recent call last):
      effijax.objectives._rewards.RewardError: reward '<lambda>': returned 1 rewards for 2 ...
    """
    if isinstance(rewards, str) or callable(rewards):
        rewards = [rewards]
    functions = [resolve_reward(r) for r in rewards]
    if not functions:
        raise ConfigError("rewards", [], "give at least one reward function")
    if weights is None:
        weights = [1.0] * len(functions)
    weights = list(weights)
    if len(weights) != len(functions) or not all(
            isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w)
            for w in weights):
        raise ConfigError("reward_weights", weights, f"expected {len(functions)} finite numbers, "
                          "one per reward function")
    n = len(completions)
    if len(prompts) != n:
        raise ConfigError("prompts", len(prompts), f"expected one prompt per completion ({n})")
    kwargs = {key: list(value) for key, value in (columns or {}).items()}
    for key, value in kwargs.items():
        if len(value) != n:
            raise ConfigError("columns", key, f"has {len(value)} values for {n} completions")
    if completion_ids is not None:
        kwargs["completion_ids"] = [list(map(int, ids)) for ids in completion_ids]
    names = _unique([reward_name(f) for f in functions])
    per_reward = np.empty((n, len(functions)), np.float32)
    for f, (function, name) in enumerate(zip(functions, names, strict=True)):
        try:
            out = function(prompts=list(prompts), completions=list(completions), **kwargs)
        except Exception as e:  # noqa: BLE001 -- the user's function: name it, keep the cause
            given = ", ".join(["prompts", "completions", *kwargs])
            raise RewardError(name, f"raised {type(e).__name__}: {e} (called with {given})"
                              ) from e
        per_reward[:, f] = _values(name, out, n)
    weighted = per_reward * np.asarray(weights, np.float32)[None]
    combined = np.nansum(weighted, axis=1).astype(np.float32)
    combined[np.isnan(per_reward).all(axis=1)] = np.nan
    metrics = {}
    for f, name in enumerate(names):
        column = per_reward[:, f]
        scored = column[~np.isnan(column)]
        metrics[f"rewards/{name}/mean"] = float(scored.mean()) if scored.size else math.nan
        metrics[f"rewards/{name}/std"] = (float(scored.std(ddof=1)) if scored.size > 1
                                          else math.nan)
    return Scores(per_reward, combined, names, metrics)
