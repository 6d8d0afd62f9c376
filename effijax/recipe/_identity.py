"""A run's identity: the settings a resume must repeat for the run to stay the same run.

A resumed run continues bit for bit only when it trains the same model on the same data in the
same order with the same arithmetic. So a resume compares the new settings with those stored
in the checkpoint it restores and refuses, listing every difference, when one of these changed:
the data's content hash, the seed, the batch size, the sequence length, the model, the
precision and loss scale, the optimizer (its state has its own shape), accumulation, the LoRA
spec and what the run started from.

The optimisation settings (learning rate, schedule and its length, warm-up, weight decay and
what it spares, clipping, the optimizer's betas, epsilon and momentum) may change on purpose,
e.g. to train a finished run further: each must be named in ``allow_changes``. Everything
else (mesh, strategy, devices, checkpoint cadence, evaluation, progress) changes freely: a
resume onto another mesh is exact up to f32 summation order.
"""

from __future__ import annotations

from typing import Any

from effijax.errors import ConfigError

__all__ = ["IDENTITY", "CHANGEABLE", "LEGACY", "identity", "differences", "check_resume", "changed"]

# What a resume must repeat, with where it is read from in a config.json-shaped dict.
IDENTITY = ("data", "seed", "batch_size", "seq_len", "model", "precision", "loss_scale",
            "optimizer", "accumulate", "lora", "init_from")
# What may change on resume when named in allow_changes.
CHANGEABLE = ("lr", "steps", "warmup", "weight_decay", "clip", "schedule", "lr_end",
              "decay_fraction", "b1", "b2", "eps", "momentum", "no_decay")
# What a run recorded before a setting existed trained with (its config.json lacks the key).
LEGACY = {"optimizer": "adamw", "schedule": "cosine", "lr_end": 0.1, "decay_fraction": 0.2,
          "b1": 0.9, "b2": 0.95, "eps": 1e-8}
_LORA = ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "frozen_dtype",
         "lora_random_base")


def identity(run_json: dict) -> dict[str, Any]:
    """The identity of a run from its ``config.json``-shaped dict (settings + ``run``).

    Example:
      >>> run = {"seed": 0, "batch_size": 8, "precision": "fp32", "loss_scale": "none",
      ...        "accumulate": 1, "lora_rank": None, "run": {"corpus_sha256": "ab",
      ...        "model_config": {"family": "gpt", "seq_len": 32}}}
      >>> identity(run)["seq_len"], identity(run)["data"]
      (32, 'ab')
    """
    record = run_json.get("run") or {}
    model = dict(record.get("model_config") or {})
    lora = ({k: run_json.get(k) for k in _LORA} if run_json.get("lora_rank") is not None
            else None)
    return {
        "data": record.get("corpus_sha256"),
        "seed": run_json.get("seed"),
        "batch_size": run_json.get("batch_size"),
        "seq_len": model.get("seq_len"),
        # Unrolling the layer loop changes the program, not the arithmetic.
        "model": {k: v for k, v in model.items() if k not in ("seq_len", "unroll_layers")},
        "precision": run_json.get("precision"),
        "loss_scale": run_json.get("loss_scale"),
        "optimizer": run_json.get("optimizer", LEGACY["optimizer"]),
        "accumulate": run_json.get("accumulate"),
        "lora": lora,
        "init_from": record.get("init_from_checkpoint"),
    }


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
        if a[name] != b[name]:
            if isinstance(a[name], dict) and isinstance(b[name], dict):
                keys = sorted(set(a[name]) | set(b[name]))
                out[name] = ({k: a[name].get(k) for k in keys if a[name].get(k) != b[name].get(k)},
                             {k: b[name].get(k) for k in keys if a[name].get(k) != b[name].get(k)})
            else:
                out[name] = (a[name], b[name])
    for name in CHANGEABLE:
        old, now = saved.get(name, LEGACY.get(name)), new.get(name, LEGACY.get(name))
        if old != now:
            out[name] = (old, now)
    return out


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
    """
    diff = differences(saved, new)
    refused = [n for n in diff if n in IDENTITY or n not in allow]
    if not refused:
        return diff
    parts = []
    for name in diff:
        old, now = diff[name]
        why = ("must match the checkpointed run" if name in IDENTITY else
               f"add --allow-changes {','.join(n for n in diff if n in CHANGEABLE)} to accept"
               if name not in allow else "allowed")
        if name == "init_from":  # what the run started from: its own phrasing
            parts.append(f"init_from: this run continues a run that started from {_show(old)}, "
                         f"not from {_show(now)}")
            continue
        parts.append(f"{name} {_show(old)} -> {_show(now)} ({why})")
    raise ConfigError("resume", where, "the run's settings changed: " + "; ".join(parts)
                      + "; resume with the original settings, or start a new run with "
                      "another --out")


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
