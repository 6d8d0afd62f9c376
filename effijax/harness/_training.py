"""Harness tasks scored on weights in memory: what ``effijax train --eval-tasks`` runs.

:func:`check_eval_tasks` refuses unknown task names before anything is compiled;
:func:`evaluate_weights` runs the tasks through :class:`~effijax.harness.EffijaxLM` built on the
parameters as they are (a training run's, on its mesh: no copy, nothing read from disk; a LoRA
run's adapters applied to its base) and returns each task's metrics under lm_eval's names
(:func:`task_metrics`), ``eval_tasks/<task>/<metric>``, the numbers a run records in its
``task_scores.jsonl`` (a record each time it scores), ``summary.json`` and its sinks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from effijax.errors import ConfigError
from effijax.harness._model import EffijaxLM, require_lm_eval
from effijax.harness._tasks import (
    SHIPPED_TASKS,
    TASK_GROUP,
    check_tasks,
    evaluate_tasks,
    task_manager,
)

__all__ = ["EVAL_TASKS_PREFIX", "check_eval_tasks", "task_metrics", "evaluate_weights"]

#: The prefix of every harness score a training run records.
EVAL_TASKS_PREFIX = "eval_tasks"


def check_eval_tasks(tasks: str | Sequence[str], field: str = "eval_tasks"):
    """``(names, manager)``: ``tasks`` (names or a comma-separated text) checked against the
    tasks lm_eval knows, and the ``TaskManager`` that knows them (only the shipped tasks' when
    every name is one of them: no index of lm_eval's own tasks to read).

    Raises:
      ConfigError: under ``field``: lm_eval is not installed, no task, or an unknown one (the
        message lists the shipped tasks).

    Example:
      >>> check_eval_tasks("effijax_qa_choice, effijax_qa_exact")[0]
      ['effijax_qa_choice', 'effijax_qa_exact']
      >>> check_eval_tasks("effijax_qa_choice,")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: eval_tasks='effijax_qa_choice,': expected task names ...
    """
    try:
        require_lm_eval(field, tasks)
        names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks)]
        shipped = set(names) - {""} <= {*SHIPPED_TASKS, TASK_GROUP}
        manager = task_manager(include_defaults=not shipped)
        return check_tasks(names, manager), manager
    except ConfigError as e:
        raise e.renamed(field) from None


def task_metrics(results: dict, prefix: str = EVAL_TASKS_PREFIX) -> dict[str, float]:
    """The numbers of ``lm_eval.simple_evaluate``'s ``results`` as ``prefix/<task>/<metric>``:
    lm_eval's metric names, the default filter's ``,none`` dropped (another filter stays, as
    lm_eval writes it: ``exact_match,strip``); standard errors and what is not a score
    (``alias``, ``sample_len``) left out.

    Example:
      >>> task_metrics({"results": {"qa": {"alias": "qa", "sample_len": 4, "acc,none": 0.5,
      ...                                   "acc_stderr,none": 0.1, "exact_match,strip": 0.25}}})
      {'eval_tasks/qa/acc': 0.5, 'eval_tasks/qa/exact_match,strip': 0.25}
    """
    out = {}
    for task, metrics in sorted(results["results"].items()):
        for name, value in sorted(metrics.items()):
            metric = name.split(",")[0]
            if "," not in name or metric.endswith("_stderr") or isinstance(value, str):
                continue  # alias, sample_len: not scores
            out[f"{prefix}/{task}/{name.removesuffix(',none')}"] = float(value)
    return out


def evaluate_weights(model, params, tasks: str | Sequence[str], *, lora=None, tokenizer=None,
                     limit: int | None = None, batch_size: int = 8, precision: str = "fp32",
                     mesh: Any = None, manager=None, source: str = "") -> dict[str, float]:
    """Harness ``tasks`` run on ``params`` of ``model`` as they are in memory; their
    :func:`task_metrics`.

    Args:
      model, params: the model and its parameters (with ``lora``: ``{"base": ...,
        "adapters": ...}``); on ``mesh`` they are used as placed (see
        :class:`~effijax.harness.EffijaxLM`).
      tasks: names or a comma-separated text (:func:`check_eval_tasks` checks them, unless a
        ``manager`` from it is given).
      tokenizer: the model's (default ``model.tokenizer``).
      limit: the first this many documents of each task (None: all).
      batch_size, precision, mesh: :class:`~effijax.harness.EffijaxLM`'s.
      source: what the model is called in the harness's request cache and messages.

    Example (a harness run: 10 s on 2 cores, run by ``tests/test_harness_training.py``)::

      import jax
      from effijax.models import gpt_config
      model = gpt_config("tiny")
      scores = evaluate_weights(model, model.init_params(jax.random.key(0)),
                                "effijax_qa_choice", limit=2, batch_size=4)
      list(scores)  # ['eval_tasks/effijax_qa_choice/acc', 'eval_tasks/effijax_qa_choice/acc_norm']
    """
    from effijax.generate import Loaded

    if manager is None:
        names, manager = check_eval_tasks(tasks)
    else:
        names = check_tasks(tasks, manager)
    loaded = Loaded(model, params, lora=lora,
                    tokenizer=getattr(model, "tokenizer", None) if tokenizer is None
                    else tokenizer, source=source or model.name)
    lm = EffijaxLM(loaded=loaded, batch_size=batch_size, precision=precision, mesh=mesh)
    return task_metrics(evaluate_tasks(lm, names, limit=limit, manager=manager,
                                       bootstrap_iters=0))
