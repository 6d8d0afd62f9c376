"""A run's identity: the settings a resume must repeat for the run to stay the same run.

A resumed run continues bit for bit only when it trains the same model on the same data in the
same order with the same arithmetic. So a resume compares the new settings with those stored
in the checkpoint it restores and refuses, listing every difference, when one of these changed:
the data's content hash, the tokenizer the data went through (its chat template included for
chat data), the seed, the batch size, the sequence length, the model, the precision and loss
scale, the optimizer (its state has its own shape), accumulation, the LoRA spec, what the run
started from, each pretrained weight file it read, and the objective with its settings (a run
recorded before objectives existed trained ``sft``). A pretrained model is identified by its
content, not its place: the same files copied elsewhere are the same start. A run recorded
before the tokenizer and weight digests existed (its ``config.json`` lacks them) has them
"not recorded": that comparison is skipped.

The optimisation settings (learning rate, schedule and its length, warm-up, weight decay and
what it spares, clipping, the optimizer's betas, epsilon and momentum) may change on purpose,
e.g. to train a finished run further: each must be named in ``allow_changes``. Everything
else (mesh, strategy, devices, checkpoint cadence, evaluation, progress) changes freely: a
resume onto another mesh is exact up to f32 summation order.
"""

from __future__ import annotations

from typing import Any

from effijax.errors import ConfigError
from effijax.sources import compared_origin, short_digest, weight_file_changes

__all__ = ["IDENTITY", "CHANGEABLE", "LEGACY", "NOT_RECORDED", "OBJECTIVE_SETTINGS",
           "DEFAULT_BETA", "identity", "differences", "check_resume", "edited", "changed",
           "default_warmup"]

# What a resume must repeat, with where it is read from in a config.json-shaped dict.
IDENTITY = ("data", "tokenizer", "seed", "batch_size", "seq_len", "model", "precision",
            "loss_scale", "optimizer", "accumulate", "lora", "model_from", "weights", "objective")
# What may change on resume when named in allow_changes.
CHANGEABLE = ("lr", "steps", "warmup", "weight_decay", "clip", "schedule", "lr_end",
              "decay_fraction", "b1", "b2", "eps", "momentum", "no_decay")
# What a run recorded before a setting existed trained with (its config.json lacks the key).
LEGACY = {"optimizer": "adamw", "schedule": "cosine", "lr_end": 0.1, "decay_fraction": 0.2,
          "b1": 0.9, "b2": 0.95, "eps": 1e-8, "objective": "sft", "num_iterations": 1}
# Each objective's own settings (TrainConfig fields), part of its identity (none for sft); a
# setting another objective uses is refused for this one (TrainConfig's checks).
OBJECTIVE_SETTINGS = {"sft": (), "dpo": ("beta", "dpo_loss", "label_smoothing"),
                      "simpo": ("beta", "simpo_gamma", "cpo_alpha", "label_smoothing"),
                      "orpo": ("beta",),
                      "grpo": ("beta", "num_generations", "max_completion_length",
                               "rollout_temperature", "rollout_top_p", "epsilon",
                               "epsilon_high", "grpo_loss", "scale_rewards", "num_iterations",
                               "rewards", "reward_weights")}
# Each objective's beta when --beta is not given (config.json records null): TRL's (DPOConfig,
# CPOConfig, ORPOConfig: 0.1; GRPOConfig: 0.0, no KL penalty and no reference). A run recorded
# with the value itself is the same run.
DEFAULT_BETA = {"dpo": 0.1, "simpo": 0.1, "orpo": 0.1, "grpo": 0.0}
_LORA = ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "frozen_dtype",
         "lora_random_base")


class _NotRecorded:
    """An identity field a run recorded before it existed: never compared."""

    def __repr__(self) -> str:
        return "NOT_RECORDED"


NOT_RECORDED = _NotRecorded()


def _recorded(record: dict, key: str):
    return record[key] if key in record else NOT_RECORDED


def identity(run_json: dict) -> dict[str, Any]:
    """The identity of a run from its ``config.json``-shaped dict (settings + ``run``).

    Example:
      >>> run = {"seed": 0, "batch_size": 8, "precision": "fp32", "loss_scale": "none",
      ...        "accumulate": 1, "lora_rank": None, "run": {"corpus_sha256": "ab",
      ...        "model_config": {"family": "gpt", "seq_len": 32}}}
      >>> identity(run)["seq_len"], identity(run)["data"], identity(run)["tokenizer"]
      (32, 'ab', NOT_RECORDED)
    """
    record = run_json.get("run") or {}
    model = dict(record.get("model_config") or {})
    lora = ({k: run_json.get(k) for k in _LORA} if run_json.get("lora_rank") is not None
            else None)
    return {
        "data": record.get("corpus_sha256"),
        "tokenizer": _recorded(record, "tokenizer_sha256"),
        "seed": run_json.get("seed"),
        "batch_size": run_json.get("batch_size"),
        "seq_len": model.get("seq_len"),
        # Unrolling the layer loop changes the program, not the arithmetic. The attention
        # implementation changes only rounding (each computes the same softmax): a run recorded
        # with the models' earlier default ("naive") resumes under "auto".
        "model": {k: v for k, v in model.items()
                  if k not in ("seq_len", "unroll_layers", "attention")},
        "precision": run_json.get("precision"),
        "loss_scale": run_json.get("loss_scale"),
        "optimizer": run_json.get("optimizer", LEGACY["optimizer"]),
        "accumulate": run_json.get("accumulate"),
        "lora": lora,
        "model_from": compared_origin(record.get("init_from_checkpoint")),
        "weights": _recorded(record, "weights"),
        "objective": _objective(run_json),
    }


def _objective(run_json: dict):
    """The objective's name, or for one with settings (dpo, simpo, orpo) the name with them: a
    run recorded before objectives existed trained sft."""
    name = run_json.get("objective", LEGACY["objective"])
    if not OBJECTIVE_SETTINGS.get(name):
        return name
    settings = {k: run_json.get(k, LEGACY.get(k)) for k in OBJECTIVE_SETTINGS[name]}
    if settings.get("beta", 0) is None:
        settings["beta"] = DEFAULT_BETA.get(name)
    return {"name": name, **settings}


def _show(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={v!r}" for k, v in value.items()) + "}"
    return repr(value)


def differences(saved: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """``{name: (saved, new)}`` for each identity or changeable setting that differs.

    For a model, only the architecture fields that differ are shown.
    """
    a, b = identity(saved), identity(new)
    out = {}
    for name in IDENTITY:
        if a[name] is NOT_RECORDED or b[name] is NOT_RECORDED or a[name] == b[name]:
            continue
        if name == "weights":  # whole: which files were read, and each one's digest
            if isinstance(a[name], dict) and isinstance(b[name], dict):
                out[name] = (a[name], b[name])
            # else one run started from no pretrained model: model_from says so
        elif isinstance(a[name], dict) and isinstance(b[name], dict):
            keys = sorted(set(a[name]) | set(b[name]))
            out[name] = ({k: a[name].get(k) for k in keys if a[name].get(k) != b[name].get(k)},
                         {k: b[name].get(k) for k in keys if a[name].get(k) != b[name].get(k)})
        else:
            out[name] = (a[name], b[name])
    if "weights" in out and "model_from" in out and all(
            isinstance(o, dict) and set(o) == {"sha256"} for o in out["model_from"]):
        del out["model_from"]  # the digest of all the files, which "weights" says file by file
    for name in CHANGEABLE:
        old, now = saved.get(name, LEGACY.get(name)), new.get(name, LEGACY.get(name))
        if old != now:
            out[name] = (old, now)
    return out


def _weights_change(old: dict, now: dict) -> str:
    return ("weights: the pretrained weight files changed since the run started: "
            + ", ".join(weight_file_changes(old, now))
            + "; start from the files the run started from")


def default_warmup(steps: int) -> int:
    """The warm-up of a run that sets none: 5% of its steps, at least 1. A resume allowed to
    change ``steps`` changes this warm-up with them (it follows the steps).

    Example:
      >>> default_warmup(100), default_warmup(10)
      (5, 1)
    """
    return max(1, steps // 20)


def _warmup_follows_steps(diff: dict) -> bool:
    """Whether the warm-up changed only as the default warm-up of the changed ``steps`` (a run
    that leaves it unset: a resume allowed to change ``steps`` changes it too)."""
    if "warmup" not in diff or "steps" not in diff:
        return False
    (old, now), (old_steps, new_steps) = diff["warmup"], diff["steps"]
    return old == default_warmup(old_steps) and now == default_warmup(new_steps)


def check_resume(saved: dict, new: dict, allow: tuple[str, ...], *, where: str) -> dict:
    """Refuses a resume that changes the run; returns the allowed changes ``{name: (old, new)}``.

    Args:
      saved: the ``config.json``-shaped settings stored with the checkpoint.
      new: the resuming run's.
      allow: the changeable settings named in ``allow_changes``.
      where: the checkpoint (for the message).

    Raises:
      ConfigError: listing every difference, and for the changeable ones the flag that
        accepts them.

    Example:
      >>> saved = {"seed": 0, "lr": 1e-3, "steps": 10, "run": {}}
      >>> check_resume(saved, {**saved, "lr": 1e-4}, ("lr",), where="ckpt")
      {'lr': (0.001, 0.0001)}
      >>> check_resume(saved, {**saved, "seed": 7, "steps": 20}, (), where="ckpt")
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: resume='ckpt': the run's settings changed: seed 0 -> 7 \
(must match the checkpointed run); steps 10 -> 20 (add --allow-changes steps to accept); resume \
with the original settings, or start a new run with another --out
      >>> check_resume({**saved, "steps": 100, "warmup": 5}, {**saved, "steps": 150, "warmup": 7},
      ...              (), where="ckpt")  # a warm-up left to its default follows the steps
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: resume='ckpt': the run's settings changed: steps 100 -> 150 \
(add --allow-changes steps to accept); warmup 5 -> 7 (follows --steps: accepted with it); resume \
with the original settings, or start a new run with another --out
    """
    diff = differences(saved, new)
    refused = [n for n in diff if n in IDENTITY or n not in allow]
    if not refused:
        return diff
    follows = _warmup_follows_steps(diff)
    # Every name the resume needs (the flag's value replaces the one given).
    flags = ",".join(n for n in diff if n in CHANGEABLE and not (n == "warmup" and follows))
    parts = []
    for name in diff:
        old, now = diff[name]
        why = ("must match the checkpointed run" if name in IDENTITY else
               "follows --steps: accepted with it" if name == "warmup" and follows else
               f"add --allow-changes {flags} to accept" if name not in allow else "allowed")
        if name == "model_from":  # what the run started from: its own phrasing
            parts.append(f"model_from: this run continues a run that started from {_show(old)}, "
                         f"not from {_show(now)}")
            continue
        if name == "tokenizer":
            parts.append(f"tokenizer: the tokenizer or chat template changed since the run "
                         f"started (sha256 {short_digest(old)} -> {short_digest(now)}); restore "
                         "the tokenizer files the run started with")
            continue
        if name == "weights":
            parts.append(_weights_change(old, now))
            continue
        parts.append(f"{name} {_show(old)} -> {_show(now)} ({why})")
    raise ConfigError("resume", where, "the run's settings changed: " + "; ".join(parts)
                      + "; resume with the original settings, or start a new run with "
                      "another --out")


def edited(written: dict, saved: dict) -> list[str]:
    """The identity a run's ``config.json`` (``written``) gives that its checkpoint's settings
    (``saved``) do not: a ``config.json`` edited by hand, or copied from another run. Only
    what both record is compared.

    Example:
      >>> saved = {"seed": 0, "run": {"corpus_sha256": "ab", "model_config": {"seq_len": 32}}}
      >>> edited({**saved, "run": {**saved["run"], "corpus_sha256": "cd"}}, saved)
      ['data']
      >>> edited(saved, saved)
      []
    """
    a, b = identity(written), identity(saved)
    return [name for name in IDENTITY if a[name] is not NOT_RECORDED
            and b[name] is not NOT_RECORDED and a[name] != b[name]]


def changed(original: dict, new: dict) -> dict[str, list]:
    """``{setting: [original, new]}`` over the top-level settings and the run's devices: what
    a resume records in ``config.json``'s ``resumes`` list."""
    keys = [k for k in new if k not in ("run", "versions", "resumes")]
    out = {k: [original.get(k), new[k]] for k in keys if original.get(k) != new[k]}
    for k in ("devices", "process_count"):
        a, b = (original.get("run") or {}).get(k), (new.get("run") or {}).get(k)
        if a != b:
            out[k] = [a, b]
    return out
