"""Harness tasks that ship with effijax, and running tasks on a model.

Three tasks, in the group ``effijax_offline``, read files in this package (``tasks/``), so they
run on a machine with no network:

* ``effijax_qa_exact``: the Q&A set of ``effijax data make-example``
  (:func:`effijax.data.stdlib_qa`: questions about the standard library's functions, answered
  from the interpreter), answered by generation, scored by exact match;
* ``effijax_qa_choice``: the same questions as four-way multiple choice by log-likelihood, the
  wrong choices other answers of the same kind (:func:`choice_records`);
* ``effijax_docs_perplexity``: word and byte perplexity (``loglikelihood_rolling``) of the
  standard-library modules' own docstrings (:func:`docs_records`), text the Q&A set does not
  hold.

The files were written once by :func:`write_task_data` (on Python 3.11; another version
writes other answers, so the shipped files stay as they are). A task file names its data with
``custom_dataset: !function effijax_data....``: lm_eval resolves that next to the YAML
wherever the package is installed, which a ``dataset_kwargs: data_files`` path (resolved from
the working directory) cannot do.

:func:`evaluate_tasks` runs tasks (these, or any the harness knows, such as HellaSwag, ARC,
MMLU or GSM8K where the Hugging Face Hub is reachable) through
:class:`~effijax.harness.EffijaxLM` with ``lm_eval.simple_evaluate``.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import platform
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from effijax.data import STDLIB_MODULES, stdlib_qa, write_jsonl
from effijax.errors import ConfigError
from effijax.harness._model import EffijaxLM, require_lm_eval

__all__ = ["TASKS_DIR", "SHIPPED_TASKS", "TASK_GROUP", "choice_records", "docs_records",
           "write_task_data", "task_manager", "check_tasks", "evaluate_tasks"]

#: The folder of the shipped task files (give it to ``lm_eval --include_path``).
TASKS_DIR = Path(__file__).resolve().parent / "tasks"
#: The shipped tasks, and the group that runs them all.
SHIPPED_TASKS = ("effijax_qa_exact", "effijax_qa_choice", "effijax_docs_perplexity")
TASK_GROUP = "effijax_offline"

# Choices per multiple-choice question (the answer and three others).
CHOICES = 4


def choice_records(records: Sequence[dict], choices: int = CHOICES) -> list[dict]:
    """Q&A records as multiple-choice questions: ``{"prompt", "choices", "gold"}``. The wrong
    choices are the answers of the next questions of the same kind (signature or summary,
    cyclically, skipping any equal to the answer or to one already chosen); question ``i``'s
    answer is choice ``i % choices``.

    Example:
      >>> qa = [{"prompt": f"What is the signature of m.f{i}?", "response": f"m.f{i}(x)"}
      ...       for i in range(5)]
      >>> r = choice_records(qa)[3]
      >>> r["choices"], r["gold"]
      (['m.f4(x)', 'm.f0(x)', 'm.f1(x)', 'm.f3(x)'], 3)
      >>> [r["gold"] for r in choice_records(qa)], choice_records(qa)[1]["choices"]
      ([0, 1, 2, 3, 0], ['m.f2(x)', 'm.f1(x)', 'm.f3(x)', 'm.f4(x)'])
    """
    kinds: dict[str, list[int]] = {}
    for i, record in enumerate(records):
        kinds.setdefault(_kind(record["prompt"]), []).append(i)
    out = []
    for i, record in enumerate(records):
        same = kinds[_kind(record["prompt"])]
        at = same.index(i)
        picked = [record["response"]]
        for step in range(1, len(same)):
            other = records[same[(at + step) % len(same)]]["response"]
            if other not in picked:
                picked.append(other)
            if len(picked) == choices:
                break
        if len(picked) < choices:
            raise ConfigError("records", len(same), f"too few distinct answers of the kind of "
                              f"{record['prompt']!r} for {choices} choices")
        gold = i % choices  # the answer's place turns with the question: no place is favoured
        out.append({"prompt": record["prompt"],
                    "choices": picked[1:gold + 1] + picked[:1] + picked[gold + 1:],
                    "gold": gold})
    return out


def _kind(prompt: str) -> str:
    """A question's kind: its first three words ("What is the", "In one line,")."""
    return " ".join(prompt.split()[:3])


def docs_records(modules: Sequence[str] = STDLIB_MODULES) -> list[dict]:
    """``{"module", "text"}``: each module's own docstring, whitespace as written.

    Example:
      >>> docs_records(("textwrap",))[0]["text"].split("\\n")[0]
      'Text wrapping and filling.'
    """
    out = []
    for name in modules:
        doc = inspect.getdoc(importlib.import_module(name))
        if doc and doc.strip():
            out.append({"module": name, "text": doc.strip()})
    return out


def write_task_data(folder: str | os.PathLike) -> dict[str, int]:
    """Writes the shipped tasks' files into ``folder``: ``qa.jsonl`` (:func:`stdlib_qa`),
    ``qa_choice.jsonl`` (:func:`choice_records` of it) and ``docs.jsonl``
    (:func:`docs_records`); returns each file's record count.

    Example:
      >>> import tempfile
      >>> counts = write_task_data(tempfile.mkdtemp())
      >>> counts["qa.jsonl"] == counts["qa_choice.jsonl"], counts["docs.jsonl"] > 10
      (True, True)
    """
    qa = stdlib_qa()
    folder = Path(folder)
    return {"qa.jsonl": write_jsonl(folder / "qa.jsonl", qa),
            "qa_choice.jsonl": write_jsonl(folder / "qa_choice.jsonl", choice_records(qa)),
            "docs.jsonl": write_jsonl(folder / "docs.jsonl", docs_records())}


def task_manager(include_defaults: bool = True):
    """lm_eval's ``TaskManager`` with the shipped tasks (and, with ``include_defaults``, every
    task lm_eval defines; reading their index takes a few seconds).

    Raises:
      ConfigError: lm_eval is not installed (saying what to install).
    """
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR), include_defaults=include_defaults)


def check_tasks(tasks: Sequence[str], manager) -> list[str]:
    """``tasks`` (names or a comma-separated text) checked against what ``manager`` knows.

    Raises:
      ConfigError: ``field="tasks"``: no task, or one lm_eval does not know (naming the shipped
        ones).
    """
    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks)]
    if not names or not all(names):
        raise ConfigError("tasks", ",".join(names), "expected task names separated by commas, "
                          f"such as {TASK_GROUP} or {','.join(SHIPPED_TASKS)}")
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise ConfigError("tasks", ",".join(unknown), "no such task; offline ones shipped with "
                          f"effijax: {', '.join(SHIPPED_TASKS)} (the group {TASK_GROUP}); any "
                          "task lm_eval lists (lm-eval ls tasks) where its data can be reached")
    return names


def evaluate_tasks(model: str | EffijaxLM, tasks: str | Sequence[str], *,
                   limit: int | float | None = None, num_fewshot: int | None = None,
                   batch_size: int = 8, precision: str = "fp32",
                   apply_chat_template: bool = False, bootstrap_iters: int = 1000,
                   include_defaults: bool = True, manager=None) -> dict[str, Any]:
    """Runs harness ``tasks`` on ``model`` (what ``--from`` names, or an :class:`EffijaxLM`)
    with ``lm_eval.simple_evaluate``; returns its results dict (``results``, ``configs``,
    ``versions``, ...; print it with ``lm_eval.utils.make_table``).

    Args:
      limit: the first this many documents of each task (a fraction below 1: that share).
      num_fewshot: examples before each question (default: each task's own).
      batch_size, precision: :class:`EffijaxLM`'s (when ``model`` is a name).
      apply_chat_template: render the prompts with the model's chat template.
      bootstrap_iters: resamples for the standard errors of metrics that need them.
      include_defaults: also know lm_eval's own tasks (False: only the shipped ones, faster).
      manager: a :func:`task_manager` already built (then ``include_defaults`` is its own).

    Raises:
      ConfigError: lm_eval missing, an unknown task, a bad setting, a model that does not open.
    """
    manager = manager or task_manager(include_defaults=include_defaults)
    names = check_tasks(tasks, manager)
    lm = model if isinstance(model, EffijaxLM) else EffijaxLM(
        model, batch_size=batch_size, precision=precision)
    import lm_eval

    with _environment_from_jax():
        return lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager,
                                       limit=limit, num_fewshot=num_fewshot, log_samples=False,
                                       apply_chat_template=apply_chat_template,
                                       bootstrap_iters=bootstrap_iters,
                                       torch_random_seed=None)  # no torch here: not imported


def _environment(storage: dict) -> None:
    """What ``lm_eval`` records of the machine in a result (``pretty_env_info``,
    ``transformers_version``, ``lm_eval_version``, ``upper_git_hash``), from JAX: the
    versions of effijax, jax, jaxlib and lm_eval, Python, the platform and the devices.

    :func:`evaluate_tasks` records this instead of the harness's own report, which imports
    ``torch`` and ``transformers`` and runs PyTorch's ``collect_env`` (``pip``, ``nvidia-smi``
    and other subprocesses): 1-4 s a call on a quiet 2-core CPU, up to 20 s on a busy one,
    and a second framework in a JAX training process that evaluates every few steps.

    Example:
      >>> info = {}
      >>> _environment(info)
      >>> sorted(info)
      ['lm_eval_version', 'pretty_env_info', 'transformers_version', 'upper_git_hash']
      >>> info["pretty_env_info"].startswith("effijax ")
      True
    """
    from importlib.metadata import PackageNotFoundError, version

    import jax

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    storage.update({
        "pretty_env_info": (
            f"effijax {installed('effijax')}, jax {jax.__version__}, jaxlib "
            f"{installed('jaxlib')}; Python {platform.python_version()} on "
            f"{platform.platform()}; {len(devices)} {jax.default_backend()} device(s) "
            f"({', '.join(kinds)}), {jax.process_count()} process(es)"),
        "transformers_version": "N/A (the model is effijax's)",
        "lm_eval_version": installed("lm_eval"),
        "upper_git_hash": None,
    })


@contextlib.contextmanager
def _environment_from_jax() -> Iterator[None]:
    """``lm_eval.simple_evaluate`` recording :func:`_environment` instead of the harness's
    report (``lm_eval.evaluator.add_env_info``), for the duration of one call."""
    import lm_eval.evaluator as evaluator

    report = evaluator.add_env_info
    evaluator.add_env_info = _environment
    try:
        yield
    finally:
        evaluator.add_env_info = report
