"""The state stage: where the run's first state comes from.

A resumed run takes the state its run directory restored (:mod:`effijax.recipe._rundir`); a
fresh one initialises it from the seed, its parameters from ``model_from``'s checkpoint or
pretrained weights when it names one. A LoRA run also holds its frozen base, and a full run
whose objective has a reference (DPO) a frozen copy of its starting weights, made again the same
way when it resumes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from effijax import distributed
from effijax.checkpoint import truncate_metrics
from effijax.recipe import _job, _sources
from effijax.recipe._objective import COMPLETIONS
from effijax.recipe._report import summary_step
from effijax.recipe._rundir import TASK_SCORES, RunStart
from effijax.recipe._sections import OutputSection, TrainingSection
from effijax.sources import export_paths, missing_exports

__all__ = ["Initial", "initial_state"]


class Initial(NamedTuple):
    """The run's first state and its frozen tree (a LoRA run's base, a full run's reference
    copy; None otherwise)."""

    state: Any
    frozen: Any = None


def initial_state(output: OutputSection, training: TrainingSection, job, run: RunStart,
                  source) -> Initial:
    """Resumed from the run's checkpoint, or fresh (adapters from the seed, parameters from
    the seed or from ``source``'s checkpoint); the job's frozen tree. A resume says where
    it resumes ``output.out`` (a run past ``training.steps``: what it completes)."""
    base = None
    if source is not None and (job.frozen is not None or run.resume_step is None):
        base = _sources.load_params(source, job.model, None if job.mesh.size == 1 else job.mesh,
                                    run.record["init_from_checkpoint"].get("step"))
    frozen = None if job.frozen is None else _job.init_frozen(job, base)
    if run.resume_step is None:
        return Initial(_job.init_state(job, base if job.lora is None else None), frozen)
    if distributed.is_main():
        truncate_metrics(Path(output.out) / "metrics.jsonl", run.resume_step)
        for name in (COMPLETIONS, TASK_SCORES):  # GRPO's samples, the harness's scores
            truncate_metrics(Path(output.out) / name, run.resume_step, every_step=False)
        where = run.dir.ckpt.directory
        if run.resume_step >= training.steps and summary_step(output.out) == run.resume_step:
            # Finished, and asked now for exports it lacks (--export-hf added to its command).
            exports = {"lora": job.lora is not None, "export_hf": training.export_hf,
                       "export_gguf": training.export_gguf}
            paths = export_paths(output.out, **exports)
            missing = [paths[name].name for name in missing_exports(output.out, **exports)]
            print(f"effijax train: the run finished at step {run.resume_step}; adding the "
                  f"exports it lacks ({', '.join(missing)})", flush=True)
        elif run.resume_step >= training.steps:
            print(f"effijax train: the run reached step {run.resume_step} in {where} but "
                  "stopped before its end was written; completing it (final evaluation, "
                  "exports, summary.json)", flush=True)
        else:
            print(f"effijax train: resuming from step {run.resume_step} in {where}",
                  flush=True)
    return Initial(run.restored, frozen)
