"""The shipped tasks' data, read by lm-evaluation-harness (``custom_dataset: !function``).

lm_eval imports this file from next to the task YAMLs that name it, wherever effijax is
installed; each function returns the task's one split, ``test``, from the JSONL file beside it
(written by :func:`effijax.harness.write_task_data`). The keyword arguments lm_eval passes
(the task's metadata) change nothing.
"""

import json
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _test_split(name: str):
    import datasets  # lm_eval's own dependency

    with open(_HERE / name, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def qa_test_split(**_metadata):
    """``effijax_qa_exact``'s questions and answers (``prompt``, ``response``)."""
    return _test_split("qa.jsonl")


def qa_choice_test_split(**_metadata):
    """``effijax_qa_choice``'s questions, four choices and the answer's place (``gold``)."""
    return _test_split("qa_choice.jsonl")


def docs_test_split(**_metadata):
    """``effijax_docs_perplexity``'s texts: the standard-library modules' docstrings."""
    return _test_split("docs.jsonl")
