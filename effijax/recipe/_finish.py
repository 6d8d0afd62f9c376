"""The stages after the loop: evaluate, export, summary.

:func:`evaluate` gives the validation loss (also of the starting parameters, before a
fine-tune's first step); :func:`export` writes a LoRA run's adapters and, when asked, a Hugging
Face directory; :func:`summarize` gathers ``summary.json``: this session's numbers, those that
describe the whole run from step 1 (read back from ``metrics.jsonl``, whatever its resumes),
the evaluation, the exports, and the job's size, memory and collectives.

The end of a run is complete or visibly not: each export file is written whole
(:mod:`effijax.atomic`), a directory export (``peft/``, ``hf/``) is written under a temporary
name and renamed into place, and ``summary.json`` comes last. A run stopped anywhere here has
no summary of its last step (or misses an export :func:`~effijax.sources.missing_exports`
names), so the same command resumes from the final checkpoint and writes the end again, byte
for byte. A write that fails (a full disk) is one line, :class:`~effijax.errors.WriteError`.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from effijax import atomic, distributed
from effijax.checkpoint import write_errors
from effijax.interop import export_adapters, save_gguf, save_hf
from effijax.lora import save_adapters
from effijax.precision import dequantize_kernels
from effijax.recipe import _job, _report
from effijax.recipe._sections import OutputSection, TrainingSection
from effijax.run import read_metrics
from effijax.sources import export_paths

__all__ = ["evaluate_end", "evaluate_start", "score_tasks", "with_start", "export",
           "summarize"]


def evaluate_end(job, params, tokens, frozen=None, *, eval_batches: int,
                 model_from: str | None = None, key: str = "eval_loss") -> dict:
    """``{key: loss}``: the mean loss of ``params`` over ``eval_batches`` validation batches
    of ``tokens`` (empty when ``eval_batches`` is 0), and at the end (``key`` ``eval_loss``)
    the objective's evaluation metrics as ``eval_<name>`` (DPO's ``eval_rewards/accuracies``,
    ...); ``model_from``: the run's source, which makes the stage line print
    (:func:`effijax.recipe._report.stage`)."""
    if not eval_batches:
        return {}
    if key == "eval_loss":
        _report.stage(model_from, f"evaluating the trained model on {eval_batches} "
                      "validation batches")
    found = _job.evaluate_metrics(job, params, tokens, num_batches=eval_batches, frozen=frozen)
    loss = found.pop("loss")
    return {key: loss, **({f"eval_{name}": v for name, v in found.items()}
                          if key == "eval_loss" else {})}


def evaluate_start(job, initial, tokens, record: dict | None = None, *, eval_batches: int,
                   model_from: str | None = None) -> dict:
    """``{"eval_loss_start": loss}`` of a fine-tune's starting parameters (``model_from`` or
    LoRA; printed) over ``eval_batches`` validation batches of ``tokens``, empty for a run
    from the seed. Call it before the loop donates the state.

    A resumed run does not evaluate its start again: pass its ``record`` (the run record of
    its ``config.json``, where the first session kept the loss, see :func:`with_start`) and
    the loss is read back from it, so the summary describes the whole run.
    """
    if record is not None:
        return {k: record[k] for k in ("eval_loss_start",) if k in record}
    if not (model_from or job.lora is not None):
        return {}
    if not eval_batches:  # a fine-tune is judged by its validation loss: say it has none
        _report.note("--eval-batches 0: no validation loss before or after training (the "
                     "summary and the done line will have none)")
        return {}
    _report.stage(model_from, f"evaluating the starting model on {eval_batches} "
                  "validation batches")
    before = evaluate_end(job, initial.state.params, tokens, initial.frozen,
                          eval_batches=eval_batches, model_from=model_from, key="eval_loss_start")
    if before:
        _report.eval_start(before["eval_loss_start"])
    return before


def with_start(config_json: dict, before: dict) -> dict:
    """``config_json`` with the start evaluation (``before``) kept in its run record, for a
    resume to read back.

    Example:
      >>> with_start({"steps": 9, "run": {"corpus_tokens": 9}}, {"eval_loss_start": 2.5})
      {'steps': 9, 'run': {'corpus_tokens': 9, 'eval_loss_start': 2.5}}
    """
    return {**config_json, "run": {**config_json.get("run", {}), **before}} if before \
        else config_json


def score_tasks(job, params, frozen=None, *, tasks, limit: int | None = None,
                precision: str = "fp32", manager=None, model_from: str | None = None) -> dict:
    """``{"eval_tasks/<task>/<metric>": score}``: harness ``tasks`` run on ``params`` (the
    trained ones, or the live ones between two steps) as they are on the run's mesh (a LoRA
    run's adapters on its ``frozen`` base; a quantized base, QLoRA's, dequantized for it), the
    first ``limit`` documents of each, in the run's ``precision``
    (:func:`effijax.harness.evaluate_weights`; ``manager``: the task manager
    :func:`effijax.harness.check_eval_tasks` gave); empty without ``tasks``."""
    if not tasks:
        return {}
    from effijax.harness import evaluate_weights

    names = tasks if isinstance(tasks, str) else ",".join(tasks)
    _report.stage(model_from, f"evaluating the model on {names}"
                  + ("" if limit is None else f" (the first {limit} documents of each)"))
    weights = params if job.lora is None else {"base": dequantize_kernels(frozen),
                                               "adapters": params}
    return evaluate_weights(job.model, weights, tasks, lora=job.lora, limit=limit,
                            batch_size=job.batch_size, precision=precision, mesh=job.mesh,
                            manager=manager, source=model_from or job.model.name)


def export(output: OutputSection, training: TrainingSection, job, params, frozen=None, *,
           model_from: str | None = None) -> dict:
    """The files the run exports into ``output.out``: ``adapters`` (a LoRA run's
    ``adapters.safetensors`` and ``peft/``, naming ``model_from`` as their base), ``hf``
    (``training.export_hf``) and ``gguf`` (``training.export_gguf``); their summary entries.

    Raises:
      effijax.errors.WriteError: an export could not be written (one line; nothing half
        written is left in place).
    """
    files = {}
    paths = export_paths(output.out, lora=job.lora is not None, export_hf=training.export_hf,
                         export_gguf=training.export_gguf)
    with write_errors(output.out):
        if job.lora is not None:
            files["adapters"] = _export_adapters(params, job, paths,
                                                 base_model=model_from or job.model.name)
        if training.export_hf:
            _report.writing(paths["hf"], "the trained model as a Hugging Face directory")
            files["hf"] = _export_hf(params, frozen, job, paths["hf"])
        if training.export_gguf:
            _report.writing(paths["gguf"], f"the trained model as GGUF, its matrices in "
                            f"{training.export_gguf}")
            files["gguf"] = _export_gguf(params, frozen, job, paths["gguf"],
                                         training.export_gguf)
    return files


def summarize(job, compiled, summary: dict, out, entries: dict) -> dict:
    """``summary.json``: the loop's ``summary``, ``entries`` (the evaluation, the exports),
    the whole run's numbers read back from ``out``'s ``metrics.jsonl`` and the job's size,
    memory and collectives."""
    return {**summary, **entries, **_whole_run(Path(out), summary),
            **_report.summary_extras(job, compiled)}


def _whole_run(out: Path, summary: dict) -> dict:
    """The summary entries that describe the run from step 1, whatever its resumes, read back
    from ``metrics.jsonl`` (one record per step): the final loss over its last 10 steps and
    the trained tokens; a session that trained no step (it completed a run's end) takes the
    throughput and loss scale of the steps before it too."""
    try:
        records = [r for r in read_metrics(out) if r.get("step", 0) <= summary["steps"]]
    except (OSError, ValueError):
        return {}  # another process of the run, or a file it cannot read: this session's
    if not records:
        return {}
    records = sorted(records, key=lambda r: r.get("step", 0))
    tail = [float(r["loss"]) for r in records[-10:] if "loss" in r]
    whole = {"final_loss": float(np.mean(tail)) if tail else float("nan"),
             "final_loss_steps": len(tail),
             "trained_tokens": int(sum(r.get("tokens", 0) for r in records))}
    missing = summary["steps"] - len({r.get("step") for r in records})
    if missing > 0:  # lost or damaged before a resume: the numbers above leave them out
        whole["missing_metrics"] = missing
    if summary["steps"] == summary["start_step"]:
        rates = [float(r["tokens_per_s"]) for r in records[1:] if "tokens_per_s" in r]
        whole["tokens_per_s"] = float(np.median(rates)) if rates else float("nan")
        whole["final_loss_scale"] = float(records[-1].get("loss_scale", float("nan")))
    return whole


def _gathered(params, frozen, job) -> tuple:
    """``(base, adapters)`` of the trained model, on every process's host when the run has
    several (each takes part in gathering; they may be sharded over processes)."""
    def host(tree):
        return (multihost_utils.process_allgather(tree, tiled=True)
                if jax.process_count() > 1 else tree)

    # A quantized base (QLoRA) is merged as what it stands for: its dequantized kernels.
    base, adapters = (params, None) if job.lora is None else (dequantize_kernels(frozen), params)
    return host(base), None if adapters is None else host(adapters)


def _export_gguf(params, frozen, job, path: Path, dtype: str) -> str:
    """Writes ``path`` (``OUT/model.gguf``): the trained model (a LoRA run's adapters merged
    into its base, in f32, then stored in ``dtype``) with the tokenizer; returns its path.
    Process 0 writes, whole or not at all."""
    base, adapters = _gathered(params, frozen, job)
    if distributed.is_main():
        save_gguf(path, job.model, base, adapters=adapters, lora=job.lora, dtype=dtype)
    return str(path)


def _export_hf(params, frozen, job, directory: Path) -> str:
    """Writes ``directory`` (``OUT/hf``): the trained model (a LoRA run's adapters merged into
    its base, in f32) as a Hugging Face directory, with the tokenizer; returns its path. Every
    process takes part in gathering the parameters (they may be sharded over processes);
    process 0 writes."""
    base, adapters = _gathered(params, frozen, job)
    if distributed.is_main():
        tmp = atomic.fresh_dir(directory)
        save_hf(tmp, job.model, base, adapters=adapters, lora=job.lora)
        atomic.replace_dir(tmp, directory)
    return str(directory)


def _export_adapters(adapters, job, paths: dict, *, base_model: str) -> dict:
    """Writes ``paths["adapters"]`` (``OUT/adapters.safetensors``) and ``paths["peft"]``
    (``OUT/peft/``: PEFT's format, with the model family's module names, naming
    ``base_model``); returns their paths. Every process gathers the (small) adapters; process 0
    writes."""
    host = multihost_utils.process_allgather(adapters, tiled=True)
    if distributed.is_main():
        save_adapters(paths["adapters"], host, job.lora)
        tmp = atomic.fresh_dir(paths["peft"])
        export_adapters(tmp, job.model, host, job.lora, base_model=base_model)
        atomic.replace_dir(tmp, paths["peft"])
    return {"adapters": str(paths["adapters"]), "peft": str(paths["peft"])}
