"""GRPO (group relative policy optimisation) as a training objective, with its rollouts in the
loop, under LoRA or in full.

It trains on prompts (:func:`load_prompts`: ``{"prompt": ...}`` JSONL records, the prompt a
text or chat messages, any other columns passed to the rewards by name, as TRL does). Each step
``k`` draws ``batch_size / num_generations`` prompts by ``(seed, k)``, samples
``num_generations`` completions of each with effijax's cached sampler
(:func:`effijax.generate.rollout`) on the train state's current parameters (under LoRA the
frozen base with the adapters applied on the fly; in full training the parameters in the compute
dtype), seeded by ``(seed, k)`` so that a resumed run samples what the uninterrupted one did,
scores them (:func:`effijax.objectives.score_completions`), forms the group-relative advantages
(:func:`effijax.objectives.group_advantages`) and takes the clipped policy-gradient step
(:func:`effijax.objectives.grpo_loss`). By default one update per rollout (TRL's
``num_iterations=1``): the sampling policy is the policy itself, without gradient, and the
ratio is 1. With ``num_iterations=N > 1`` a rollout serves ``N`` consecutive steps (sampled at
the steps ``0, N, 2N, ...``, seeded by that step): the sampling pass also scores the completions
on the parameters that sampled them (at the rollout's temperature, without dropout), and every
one of the ``N`` updates takes its ratio to those stored log-probabilities (the batch's
``old_logps``, f32 ``[B, S]`` at the completion's target positions), so that from the second
update on the ratio leaves 1 and the clipping acts, as in TRL. The kept rollout is then part of
the run's state: a checkpoint inside a group (after a step that is not a multiple of ``N``)
holds it beside the train state and a resume takes it back (:class:`Draw`), so that a run
stopped at any step resumes exactly.

A step's rows are ``[left padding, prompt, completion]`` of ``seq_len`` tokens: the prompt in
the first ``seq_len - max_completion_length`` (a longer prompt is refused when the data is
read), the completion in the last ``max_completion_length``. With ``beta > 0`` the KL penalty
compares with a reference: under LoRA the base with the adapters off (no copy), in full training
a frozen copy of the starting weights that rides in every batch (the job holds it only then).

The rollout's statistics (TRL's ``reward``, ``reward_std``, ``rewards/{name}/mean``,
``completions/mean_length``, ...) ride in the batch as host numbers under
:data:`ROLLOUT_METRICS`; the loop adds them to the step's metrics. With them, under
:data:`ROLLOUT_SAMPLES`, rides the step's first prompt and its group of completions
(:func:`samples_record`), which the loop appends to the run directory's ``completions.jsonl``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from effijax.data import parse_objects, records_fingerprint
from effijax.errors import ConfigError, whole_number
from effijax.generate import make_completion_logps, rollout, rollout_batch, rollout_metrics
from effijax.models import abstract_split
from effijax.objectives import (
    check_grpo_settings,
    group_advantages,
    grpo_loss,
    resolve_reward,
    score_completions,
)
from effijax.recipe import _report, _sections
from effijax.recipe._objective import ROLLOUT_METRICS, ROLLOUT_SAMPLES, Objective, with_reference
from effijax.sources import Dataset, padding_id

__all__ = ["GRPO", "Draw", "ROLLOUT_ITEM", "Prompt", "Prompts", "read_prompt_records",
           "load_prompts", "prompt_ids", "rollout_seed", "parse_rewards", "samples_record"]

class Prompt(NamedTuple):
    """One prompt record: its ``prompt`` (a text or chat messages), its other columns, where it
    came from (``"file:line"``) and its line (``raw``)."""

    prompt: Any
    columns: dict
    source: str
    raw: str


@dataclasses.dataclass(frozen=True)
class Prompts:
    """A run's prompts: the records and each one's token ids (chat-rendered with the
    generation prompt appended, or plain text)."""

    records: list[Prompt]
    ids: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.records)


_EXPECTED = '{"prompt": "..." (or chat messages), other columns for the rewards}'


def _bad(source: str, problem: str) -> ConfigError:
    return ConfigError("data", source, f"{problem}; expected one JSON object per line: "
                       f"{_EXPECTED}")


def _messages(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in value)


def _record(obj: dict, source: str, line: str) -> Prompt:
    if "prompt" not in obj:
        raise _bad(source, "no 'prompt'")
    prompt = obj["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _bad(source, "the prompt is empty")
    elif not _messages(prompt):
        raise _bad(source, "'prompt' is neither a string nor a list of chat messages "
                   '({"role": ..., "content": ...})')
    return Prompt(prompt, {k: v for k, v in obj.items() if k != "prompt"}, source, line)


def read_prompt_records(path: str) -> list[Prompt]:
    """The prompt records of a JSONL file (blank lines skipped).

    Raises:
      ConfigError: ``field="data"``, value ``"file:line"`` of the first bad record (not JSON,
        no ``prompt``, an empty one, one that is neither a text nor chat messages).

    Example:
      >>> import pathlib, tempfile
      >>> f = pathlib.Path(tempfile.mkdtemp()) / "prompts.jsonl"
      >>> _ = f.write_text('{"prompt": "2+2?", "answer": "4"}\\n{"question": "1+1?"}\\n')
      >>> read_prompt_records(f)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      effijax.errors.ConfigError: data='.../prompts.jsonl:2': no 'prompt'; expected ...
    """
    return parse_objects(path, _record, "prompt", _EXPECTED)


def prompt_ids(tokenizer, prompt) -> np.ndarray:
    """A prompt's token ids: with a chat template, the prompt as a user message (or its
    messages) rendered with the generation prompt appended; without one, the text (BOS first
    where the tokenizer starts texts with one).

    Example:
      >>> from effijax.models import byte_level_bpe
      >>> tok = byte_level_bpe(["<s>", "a", "b", "u", ":"], [], token_types=[3, 1, 1, 1, 1],
      ...     chat_template="{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
      ...                   "<s>{% endfor %}{% if add_generation_prompt %}a:{% endif %}")
      >>> tok.decode(prompt_ids(tok, "ab"))  # the user's turn, then the assistant's opening
      'u:ab<s>a:'
      >>> tok.decode(prompt_ids(tok, [{"role": "b", "content": "ba"}]))
      'b:ba<s>a:'
    """
    if tokenizer.chat_template is None:
        if not isinstance(prompt, str):
            raise ConfigError("chat_template", None, "chat-message prompts are rendered with "
                              "the model's chat template, and it has none: give text prompts "
                              "or --chat-template")
        lead = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
        return np.asarray(lead + list(tokenizer.encode(prompt)), np.int32)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
    # The template writes its own BOS (Gemma's), which encoding would add a second time.
    return np.asarray(tokenizer.encode(text, add_special_tokens=False), np.int32)


def load_prompts(path: str | None, model, *, max_completion_length: int,
                 seq_len: int | None = None) -> Dataset:
    """The run's prompts (see the module docstring) as a :class:`~effijax.sources.Dataset`
    of format ``"prompts"``: all of them train (GRPO has no validation loss; ``val`` is empty).

    Raises:
      ConfigError: not a ``.jsonl`` file, a model without a tokenizer, a bad record, or a
        prompt longer than ``seq_len - max_completion_length`` tokens (named by its line).
    """
    seq_len = model.seq_len if seq_len is None else seq_len
    if path is None or Path(path).suffix.lower() != ".jsonl":
        raise ConfigError("data", path, "grpo samples completions of prompts: give a .jsonl "
                          "file of {\"prompt\": ...} records (--data PROMPTS.jsonl)")
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ConfigError("data", path, f"prompts are tokenized by the model's tokenizer, and "
                          f"{model.name} has none: train from one (e.g. --from smollm2)")
    room = seq_len - max_completion_length
    if room < 1:
        raise ConfigError("max_completion_length", max_completion_length, f"leaves no room for "
                          f"a prompt in a row of seq_len={seq_len} tokens: use less, or raise "
                          "--seq-len")
    records = read_prompt_records(path)
    ids = []
    for record in records:
        try:
            row = prompt_ids(tokenizer, record.prompt)
        except ConfigError as e:
            if e.field != "chat_template":
                raise
            raise ConfigError("data", record.source, e.problem) from None
        if row.size == 0:
            raise ConfigError("data", record.source, "the prompt encodes to no tokens")
        if row.size > room:
            raise ConfigError("data", record.source, f"the prompt is {row.size} tokens, over the "
                              f"{room} a row leaves it (seq_len {seq_len} - "
                              f"max_completion_length {max_completion_length}); raise --seq-len "
                              "or shorten it (prompts are not cut)")
        ids.append(row)
    how = "chat template" if tokenizer.chat_template is not None else "plain text"
    note = (f"prompts ({how}): {len(records)}, up to {max(r.size for r in ids)} tokens; rows of "
            f"{seq_len} tokens ({room} for the prompt, {max_completion_length} for the "
            "completion)")
    empty = Prompts([], [])
    return Dataset(Prompts(records, ids), empty, records_fingerprint(records), "prompts",
                   int(sum(r.size for r in ids)), note)


def rollout_seed(seed: int, step: int) -> int:
    """The sampling seed of step ``step``'s rollout: a pure function of ``(seed, step)``, so a
    resumed run samples what the uninterrupted one did.

    Example:
      >>> rollout_seed(0, 3) == rollout_seed(0, 3) != rollout_seed(0, 4)
      True
    """
    return int(np.random.SeedSequence([seed, step]).generate_state(1)[0] & 0x7FFFFFFF)


def parse_rewards(rewards: str | None, reward_weights: str | None
                  ) -> tuple[list[Callable], list[float] | None]:
    """``--rewards`` (comma-separated built-in names or dotted paths) resolved
    (:func:`effijax.objectives.resolve_reward`) and ``--reward-weights`` (comma-separated
    numbers, one per reward) parsed, as the config checks them
    (:func:`effijax.recipe._sections.reward_weights`).

    Example:
      >>> functions, weights = parse_rewards("exact_match,answer_format", "1,0.5")
      >>> [f.__name__ for f in functions], weights
      (['exact_match', 'answer_format'], [1.0, 0.5])
      >>> parse_rewards("exact_match", "1,2")
      Traceback (most recent call last):
      effijax.errors.ConfigError: reward_weights='1,2': expected 1 finite numbers, one per reward
    """
    try:
        functions = [resolve_reward(name) for name in _sections.reward_names(rewards)]
    except ConfigError as e:
        raise ConfigError("rewards", e.value, e.problem) from None
    return functions, _sections.reward_weights(reward_weights, len(functions))


def _number(x) -> float | None:
    x = float(x)
    return x if np.isfinite(x) else None  # JSON has no NaN: a reward that did not score


def samples_record(step: int, record: Prompt, completions: list[str], scores, advantages,
                   lengths, finished) -> dict:
    """A step's line of ``completions.jsonl``: ``step`` (as in ``metrics.jsonl``), the
    prompt (text or chat messages) and its other ``columns``, and each of its completions with
    its ``rewards`` (by name; None where a reward did not score it), their weighted sum
    ``reward``, its ``advantage``, its ``tokens`` (the end-of-sequence included) and whether it
    ``finished`` (False: cut at the maximum length). ``scores``' and the other sequences' rows
    are the prompt's completions.

    Example:
      >>> from effijax.objectives import score_completions
      >>> p = Prompt("1+1?", {"answer": "2"}, "p.jsonl:1", "")
      >>> scores = score_completions(["exact_match"], ["1+1?"] * 2, ["2", "3"],
      ...                            columns={"answer": ["2", "2"]})
      >>> line = samples_record(3, p, ["2", "3"], scores, [0.7, -0.7], [2, 5], [True, False])
      >>> line["step"], line["columns"], line["completions"][0]
      (3, {'answer': '2'}, {'completion': '2', 'rewards': {'exact_match': 1.0}, \
'reward': 1.0, 'advantage': 0.7, 'tokens': 2, 'finished': True})
    """
    rows = [{"completion": text,
             "rewards": {name: _number(v) for name, v in zip(scores.names, per, strict=True)},
             "reward": _number(total), "advantage": _number(a), "tokens": int(n),
             "finished": bool(f)}
            for text, per, total, a, n, f in zip(completions, scores.per_reward, scores.rewards,
                                                 advantages, lengths, finished, strict=True)]
    return {"step": step, "prompt": record.prompt, "columns": record.columns,
            "completions": rows}


def _grpo_loss(model, lora, *, sequence_parallel: bool = True, beta: float = 0.0,
               epsilon: float = 0.2, epsilon_high: float | None = None,
               loss_type: str = "dapo", max_completion_length: int = 256,
               temperature: float = 1.0, num_iterations: int = 1, **rollout_settings):
    """GRPO's loss of a rollout batch (see the module docstring); ``rollout_settings`` are
    :func:`_rollout`'s."""
    del rollout_settings
    settings = {"beta": beta, "epsilon": epsilon, "epsilon_high": epsilon_high,
                "loss_type": loss_type, "max_completion_length": max_completion_length}
    check_grpo_settings(**settings)
    reused = whole_number("num_iterations", num_iterations) > 1
    logps = make_completion_logps(abstract_split(model)[0], lora, temperature=temperature,
                                  sequence_parallel=sequence_parallel,
                                  frozen_base=lora is not None)
    width = max_completion_length

    def body(params, batch, rng, reference):
        rows = {k: batch[k] for k in ("inputs", "targets", "mask", "segments")}
        rows["completion_mask"] = batch["mask"][:, -width - 1:-1] != 0
        logps_NT = logps(params, rows, rng)
        ref_NT = None
        if beta:  # no dropout, no gradient
            ref_NT = jax.lax.stop_gradient(logps(reference, rows))
        # The sampling pass's (stored with the rollout); with one update, the policy's own.
        old_NT = batch["old_logps"][:, -width - 1:-1] if reused else None
        return grpo_loss(logps_NT, batch["advantages"], rows["completion_mask"],
                         old_token_logps_NT=old_NT, ref_token_logps_NT=ref_NT, **settings)

    return with_reference(body, lora, needed=bool(beta))


ROLLOUT_ITEM = "rollout"
"""The name under which a checkpoint inside a group of ``num_iterations`` steps holds the
group's rollout (:meth:`Draw.carried`, :meth:`effijax.checkpoint.Checkpointer.extra`)."""

# What a kept rollout holds besides its group (the global rows the group's steps read), with
# each array's dtype; "advantages" is [B], the others [B, seq_len].
_KEPT = {"inputs": np.int32, "targets": np.int32, "mask": np.int32, "segments": np.int32,
         "advantages": np.float32, "old_logps": np.float32}


def _group_words(group) -> str:
    seed, first, step, batch_size, reuse = (int(x) for x in group)
    return (f"seed {seed}, the group of steps {first + 1}..{first + reuse} (num_iterations "
            f"{reuse}), saved after step {step}, {batch_size} completions")


class Draw:
    """GRPO's ``draw`` (what :attr:`~effijax.recipe._objective.Objective.rollout` makes):
    ``draw(data, *, params, frozen, seed, step, batch_size, process_index=0,
    process_count=1) -> batch``, this process' rows of step ``step``'s training batch, sampled
    on ``params`` (the train state's, now) with the rollout's statistics under
    :data:`ROLLOUT_METRICS`. With ``num_iterations`` ``N > 1`` it is the rollout of the group's
    first step ``step - step % N``, sampled there (with the sampling pass's ``old_logps``) and
    kept for the group's other steps.

    What it keeps is then part of the run's state: a checkpoint after a step inside a group
    holds it beside the train state (:meth:`carried`, which the loop saves as the checkpoint's
    ``extra``) and a resume from it takes it back (:meth:`resume`), so that a run stopped at any
    step samples and trains as the uninterrupted one. A checkpoint at a group's boundary
    (after a multiple of ``N`` steps), and every checkpoint of a run with ``N = 1``, holds
    nothing more than the state: the next step samples anew.

    Example:
      >>> import numpy as np
      >>> rows = {k: np.zeros((4, 8), np.int32) for k in ("inputs", "targets", "mask",
      ...                                                   "segments")}
      >>> rows |= {"advantages": np.zeros(4, np.float32),
      ...          "old_logps": np.zeros((4, 8), np.float32)}
      >>> draw = Draw(lambda *args: (rows, {}), num_iterations=2, seq_len=8)
      >>> _ = draw(None, params=None, frozen=None, seed=0, step=2, batch_size=4)  # samples
      >>> saved = draw.carried(3)  # after step 3, inside the group of steps 3 and 4
      >>> saved[ROLLOUT_ITEM]["group"].tolist(), draw.carried(4)
      ([0, 2, 3, 4, 2], {})
      >>> resumed = Draw(None, num_iterations=2, seq_len=8)  # a resumed run's: samples nothing
      >>> resumed.resume(saved, seed=0, step=3, batch_size=4, where="ckpt/3")
      >>> resumed(None, params=None, frozen=None, seed=0, step=3, batch_size=4)["mask"].shape
      (4, 8)
      >>> resumed.resume(saved, seed=0, step=5, batch_size=4, where="ckpt/5")
      Traceback (most recent call last):
      effijax.errors.ConfigError: checkpoint='ckpt/5': holds the rollout of seed 0, the group \
of steps 3..4 (num_iterations 2), saved after step 3, 4 completions, not this run's at step 5 ...
    """

    def __init__(self, sample: Callable, num_iterations: int, seq_len: int):
        self._sample = sample  # (data, params, frozen, seed, first, step, batch_size)
        self.num_iterations = num_iterations
        self._seq_len = seq_len
        self._kept = None  # the last rollout: ((seed, first step, batch size), global rows)

    def __call__(self, data: Prompts, *, params, frozen, seed: int, step: int,
                 batch_size: int, process_index: int = 0, process_count: int = 1) -> dict:
        first = step - step % self.num_iterations
        key = (seed, first, batch_size)
        metrics = {}
        if self.num_iterations == 1 or self._kept is None or self._kept[0] != key:
            batch, metrics = self._sample(data, params, frozen, seed, first, step, batch_size)
            self._kept = (key, batch)
        mine = slice(process_index * batch_size // process_count,
                     (process_index + 1) * batch_size // process_count)
        # The statistics ride with the step that sampled; the others reuse its rows.
        return {**{k: v[mine] for k, v in self._kept[1].items()}, ROLLOUT_METRICS: metrics}

    def carried(self, step: int) -> dict:
        """What a checkpoint after ``step`` steps holds beside the state:
        ``{ROLLOUT_ITEM: {rows..., "group": [seed, first step, step, batch_size,
        num_iterations]}}`` (int64) when ``step`` falls inside a group whose rollout this draw
        keeps (the steps to come read it); ``{}`` at a group's boundary and with one update per
        rollout."""
        reuse = self.num_iterations
        if self._kept is None or step % reuse == 0:
            return {}
        (seed, first, batch_size), rows = self._kept
        if first != step - step % reuse:
            return {}
        group = np.array([seed, first, step, batch_size, reuse], np.int64)
        return {ROLLOUT_ITEM: {**rows, "group": group}}

    def resume(self, extra: dict, *, seed: int, step: int, batch_size: int,
               where: str) -> None:
        """Takes back what the checkpoint ``where`` of step ``step`` held beside the state
        (:meth:`carried`, as :meth:`effijax.checkpoint.Checkpointer.extra` reads it back): the
        group's rollout, which the steps up to the group's end read instead of sampling it
        again. A checkpoint inside a group that holds none (written before effijax saved
        rollouts) is resumed as it was then, with a warning: the group's rollout is sampled
        again, by its seed, on the resumed parameters, and the run no longer repeats the
        uninterrupted one.

        Raises:
          ConfigError: ``field="checkpoint"``: a rollout that does not belong to this run at
            this step (another seed, group, step, batch size or ``num_iterations``; other rows
            or shapes), or one at a step where the run keeps none.
        """
        reuse = self.num_iterations
        expected = np.array([seed, step - step % reuse, step, batch_size, reuse], np.int64)
        saved = extra.get(ROLLOUT_ITEM)
        others = sorted(set(extra) - {ROLLOUT_ITEM})
        if others:
            raise ConfigError("checkpoint", where, f"holds {others} beside the state, which a "
                              "grpo run never writes: it is not this run's checkpoint")
        if saved is None:
            self._kept = None
            if step % reuse:
                _report.warn(f"{where} (step {step}) lies inside a group of {reuse} steps "
                             "that share a rollout, and holds no rollout (written by an "
                             "earlier effijax): the group's rollout is sampled again, by its "
                             "seed, on the resumed parameters, and from step "
                             f"{step + 1} on the run differs from an uninterrupted one")
            return
        if step % reuse == 0:
            raise ConfigError("checkpoint", where, f"holds a rollout, but step {step} ends a "
                              f"group of {reuse} steps (the next step samples anew): it does not "
                              "belong to this checkpoint")
        group = np.asarray(saved.get("group", ()))
        if group.shape != expected.shape or not np.array_equal(group, expected):
            said = (_group_words(group) if group.shape == expected.shape
                    else f"group {group.tolist()}")
            raise ConfigError("checkpoint", where, f"holds the rollout of {said}, not this "
                              f"run's at step {step} ({_group_words(expected)}): it does not "
                              "belong to this checkpoint; move the step aside to resume from "
                              "the one before")
        rows = {k: v for k, v in saved.items() if k != "group"}
        if sorted(rows) != sorted(_KEPT):
            raise ConfigError("checkpoint", where, f"holds a rollout of the rows "
                              f"{sorted(rows)}, not a grpo rollout's {sorted(_KEPT)}")
        for name, dtype in _KEPT.items():
            shape = (batch_size,) if name == "advantages" else (batch_size, self._seq_len)
            a = np.asarray(rows[name])
            if a.shape != shape or a.dtype != dtype:
                raise ConfigError("checkpoint", where, f"holds the rollout's {name!r} as "
                                  f"{a.dtype.name}{list(a.shape)}, this run reads "
                                  f"{np.dtype(dtype).name}{list(shape)}: it does not belong "
                                  "to this checkpoint")
        self._kept = ((seed, int(expected[1]), batch_size), rows)


def _rollout(model, lora, *, policy, num_generations: int = 8, max_completion_length: int = 256,
             temperature: float = 1.0, top_p: float = 1.0, scale_rewards: str = "group",
             rewards: str | None = None, reward_weights: str | None = None,
             num_iterations: int = 1, **loss_settings):
    """The run's :class:`Draw`: each step's rollout on the train state's parameters (with
    ``num_iterations > 1``, the group's, kept from the step that sampled it, with the sampling
    pass's ``old_logps``)."""
    del loss_settings
    functions, weights = parse_rewards(rewards, reward_weights)
    reuse = whole_number("num_iterations", num_iterations)
    tokenizer = model.tokenizer
    pad = padding_id(tokenizer)
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    if tokenizer.chat_template is not None:
        from effijax.data import turn_end_id

        end = turn_end_id(tokenizer)
        if end is not None and end not in eos:
            eos.append(end)
    width = model.seq_len - max_completion_length
    # The sampling pass's log-probabilities, on the parameters as the step computes with them.
    old_logps = None if reuse == 1 else jax.jit(make_completion_logps(
        abstract_split(model)[0], lora, temperature=temperature, sequence_parallel=False,
        frozen_base=lora is not None))

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    def sample(data: Prompts, params, frozen, seed: int, first: int, step: int,
               batch_size: int) -> tuple[dict, dict]:
        """The rollout of step ``first`` (drawn now, for step ``step``): its global rows and
        its statistics."""
        rng = np.random.Generator(np.random.Philox(key=np.array([seed, first], np.uint64)))
        picks = rng.integers(0, len(data), size=batch_size // num_generations)
        sampling = ({"base": frozen, "adapters": params} if lora is not None
                    else policy.cast_to_compute(params))
        out = rollout(model, sampling, [data.ids[i] for i in picks],
                      num_generations=num_generations,
                      max_completion_length=max_completion_length, temperature=temperature,
                      top_p=top_p, seed=rollout_seed(seed, first), eos_id=eos or None,
                      lora=lora, decode=decode, pad_id=pad)
        # Each prompt left-padded to the row's fixed prompt width (the sampler's is a multiple
        # of 16 over the longest: only padding is cut).
        prompts_NP = np.full((batch_size, width), pad, np.int32)
        cut = min(width, out.prompt_ids.shape[1])
        prompts_NP[:, width - cut:] = out.prompt_ids[:, -cut:]
        rows = rollout_batch(out._replace(prompt_ids=prompts_NP))
        records = [data.records[i] for i in picks for _ in range(num_generations)]
        chat = [not isinstance(r.prompt, str) for r in records]
        # TRL's: a conversational prompt's completion is the assistant's message.
        completions = [[{"role": "assistant", "content": text}] if c else text
                       for text, c in zip(out.completions, chat, strict=True)]
        keys = sorted({k for r in records for k in r.columns})
        scores = score_completions(functions, [r.prompt for r in records], completions,
                                   weights=weights, completion_ids=[
                                       ids[m] for ids, m in zip(out.completion_ids,
                                                                out.completion_mask,
                                                                strict=True)],
                                   columns={k: [r.columns.get(k) for r in records]
                                            for k in keys})
        advantages, stats = group_advantages(jnp.asarray(scores.rewards), num_generations,
                                             scale_rewards=scale_rewards)
        metrics = {**{k: float(v) for k, v in stats.items()}, **scores.metrics,
                   **rollout_metrics(out)}
        group = slice(0, num_generations)  # the first prompt's completions
        metrics[ROLLOUT_SAMPLES] = samples_record(
            step + 1, records[0], out.completions[group],
            scores._replace(per_reward=scores.per_reward[group], rewards=scores.rewards[group]),
            np.asarray(advantages)[group], out.completion_mask[group].sum(axis=1),
            out.finished[group])
        batch = {"inputs": rows["inputs"], "targets": rows["targets"],
                 "mask": rows["mask"].astype(np.int32), "segments": rows["segments"],
                 "advantages": np.asarray(advantages, np.float32)}
        if old_logps is not None:
            scoring = ({"base": frozen, "adapters": policy.cast_to_compute(params)}
                       if lora is not None else sampling)
            old_NT = np.asarray(old_logps(scoring, {
                **{k: rows[k] for k in ("inputs", "targets", "mask", "segments")},
                "completion_mask": rows["mask"][:, -max_completion_length - 1:-1] != 0}),
                np.float32)
            # At the completion's target positions, as the loss reads them back.
            batch["old_logps"] = np.zeros(rows["targets"].shape, np.float32)
            batch["old_logps"][:, -max_completion_length - 1:-1] = old_NT
        return batch, metrics

    return Draw(sample, reuse, model.seq_len)


def _check(*, rewards: str | None = None, reward_weights: str | None = None, **settings) -> None:
    """The rewards resolved (their modules imported) before the run reads anything."""
    del settings
    parse_rewards(rewards, reward_weights)


def _needs_reference(settings: dict) -> bool:
    """A full fine-tune holds a reference copy only for a KL penalty (``beta > 0``): the
    config's, ``effijax memory``'s and ``plan``'s answer
    (:func:`effijax.recipe._sections.holds_reference`)."""
    return _sections.holds_reference("grpo", settings.get("beta"))


def _configure(grpo: Objective, settings: dict) -> Objective:
    """With ``num_iterations > 1``, batches that carry the sampling pass's ``old_logps``."""
    if settings.get("num_iterations", 1) > 1:
        return grpo._replace(token_values=("old_logps",))
    return grpo


GRPO = Objective("grpo", _grpo_loss, eval_batches=None, load=load_prompts, metric=None,
                 token_mean=False, reference=_needs_reference, rollout=_rollout,
                 row_values=("advantages",), load_settings=("max_completion_length",),
                 check=_check, configure=_configure)
