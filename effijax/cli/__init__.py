"""The ``effijax`` command line: ``effijax train``, ``effijax memory``, ``effijax plan``,
``effijax eval``, ``effijax data``, ``effijax generate``.

Each subcommand lives in its own module (``_train``, ``_memory``, ``_eval``, ``_data``,
``_generate``), parses its flags, validates them before anything is compiled, and calls library
functions; ``_main`` builds the parser and runs the program. ``--from SOURCE`` names the model a
command starts from in every command (``_from``). ``python -m effijax`` is the same program.

Example:
  >>> from effijax.cli import build_parser
  >>> build_parser().parse_args(["generate", "--from", "smollm2", "--prompt", "Hi"]).model_from
  'smollm2'
"""

from effijax._lazy import attach

# Building the parser imports every subcommand's module; the console script's `main` is served
# from `_main` on first use (PEP 562), so `import effijax.cli` itself costs nothing.
__getattr__, __dir__, __all__ = attach(__name__, {
    "effijax.cli._main": ("main", "build_parser"),
    "effijax.cli._hugepages": ("reexec_with_hugepages", "SWITCH", "TUNABLE"),
})
