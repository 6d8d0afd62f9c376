"""Evaluation the field reports: lm-evaluation-harness tasks on effijax models.

:class:`EffijaxLM` is an ``lm_eval`` model over any model effijax opens (a run directory, a
LoRA run with its base, a GGUF file, a Hugging Face directory, ``smollm2``): log-likelihoods
from the model's fused scoring head, rolling log-likelihoods in the harness's windows, and
KV-cached generation with the tasks' stop strings, in length-sorted batches of a few compiled
shapes. Importing :mod:`effijax.harness._model` registers it as ``effijax`` in lm_eval's
registry. Three offline tasks ship in the package (:data:`SHIPPED_TASKS`, the group
:data:`TASK_GROUP`; files in :data:`TASKS_DIR`), built from the Q&A set and held-out text;
:func:`evaluate_tasks` runs them, or any task lm_eval knows, through
``lm_eval.simple_evaluate``. ``effijax eval --from MODEL --tasks a,b`` is the command line;
:func:`evaluate_weights` scores parameters in memory (``effijax train --eval-tasks``).

lm_eval is optional (``pip install 'effijax[eval]'``): without it, building a model or a task
manager says what to install.

Example:
  >>> from effijax.harness import sequence_bucket, SHIPPED_TASKS
  >>> sequence_bucket(40, 8192), SHIPPED_TASKS[0]
  (64, 'effijax_qa_exact')
"""

from effijax._lazy import attach

# Each name is imported from its module on first use (the package convention, see
# effijax/_lazy.py): importing the package costs only what is used.
__getattr__, __dir__, __all__ = attach(__name__, {
    "effijax.harness._model": ("EffijaxLM", "LM_EVAL_PIN", "require_lm_eval", "sequence_bucket"),
    "effijax.harness._tasks": ("TASKS_DIR", "SHIPPED_TASKS", "TASK_GROUP", "choice_records",
        "docs_records", "write_task_data", "task_manager", "check_tasks", "evaluate_tasks"),
    "effijax.harness._training": ("EVAL_TASKS_PREFIX", "check_eval_tasks", "task_metrics",
                                  "evaluate_weights"),
})
