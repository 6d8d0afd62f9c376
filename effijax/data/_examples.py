"""An instruction set every machine can build offline: questions about the Python standard
library answered from the running interpreter itself.

For each public function of a fixed list of standard-library modules that has a docstring and an
introspectable signature, two records with checkable answers:

* "What is the signature of ``textwrap.dedent``?" → ``textwrap.dedent(text)``
  (``inspect.signature``);
* "In one line, what does ``textwrap.dedent`` do?" → the docstring's first line.

The records come in a fixed order (module, function, kind), so the same Python version always
writes the same file; exact match against the response is the task metric. Functions whose
signature shows an object's memory address (a default such as ``<function copy2 at 0x7f...>``)
are left out: their answer would change from one process to the next.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
from pathlib import Path

from effijax.errors import ConfigError

__all__ = ["STDLIB_MODULES", "stdlib_qa", "write_jsonl"]

#: Modules the questions are about: pure-Python, import without side effects, stable APIs.
STDLIB_MODULES = ("base64", "bisect", "calendar", "colorsys", "difflib", "fnmatch", "fractions",
                  "functools", "glob", "heapq", "html", "json", "keyword", "os.path",
                  "posixpath", "random", "shlex", "shutil", "statistics", "string", "tempfile",
                  "textwrap", "uuid", "zipfile")


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _first_line(doc: str) -> str:
    for line in inspect.cleandoc(doc).splitlines():
        if line.strip():
            return line.strip()
    return ""


def _functions(module_name: str):
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    for name in sorted(set(names)):
        obj = getattr(module, name, None)
        if not inspect.isfunction(obj) or obj.__name__.startswith("_"):
            continue
        doc = inspect.getdoc(obj)
        if not doc:
            continue
        try:
            signature = str(inspect.signature(obj))
        except (TypeError, ValueError):
            continue
        if _ADDRESS.search(signature):  # not the same answer in another process
            continue
        summary = _first_line(doc)
        if 8 <= len(summary) <= 160 and len(signature) <= 120:
            yield name, signature, summary


def stdlib_qa(modules: tuple[str, ...] = STDLIB_MODULES) -> list[dict]:
    """Question/answer records (``{"prompt", "response"}``) about ``modules``' functions.

    Example:
      >>> records = stdlib_qa(("textwrap",))
      >>> records[0]["prompt"], records[0]["response"]
      ('What is the signature of textwrap.dedent?', 'textwrap.dedent(text)')
      >>> records[1]["prompt"]
      'In one line, what does textwrap.dedent do?'
    """
    records = []
    for module_name in modules:
        for name, signature, summary in _functions(module_name):
            qualified = f"{module_name}.{name}"
            records.append({"prompt": f"What is the signature of {qualified}?",
                            "response": f"{qualified}{signature}"})
            records.append({"prompt": f"In one line, what does {qualified} do?",
                            "response": summary})
    return records


def write_jsonl(path: str | os.PathLike, records: list[dict]) -> int:
    """Writes one JSON object per line (UTF-8); returns the number of records.

    Raises:
      ConfigError: the folder does not exist.

    Example:
      >>> import os, tempfile
      >>> path = os.path.join(tempfile.mkdtemp(), "qa.jsonl")
      >>> write_jsonl(path, stdlib_qa(("textwrap",)))
      10
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise ConfigError("out", str(path), f"the folder {path.parent} does not exist")
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return len(records)
