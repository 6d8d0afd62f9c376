"""The training recipe: one frozen config, one ``train(config)``, for every model family.

``TrainConfig`` holds every setting and its default (it loads from TOML or JSON); ``train``
runs it top to bottom: start → model → data → optimizer → plan → state → compile → loop →
evaluate → export. ``effijax train`` is argparse → ``TrainConfig`` → ``train``; experiments and
notebooks call the same function. The job pieces (:func:`plan_job`, :func:`init_state`, ...)
are public for code that drives its own loop on any :class:`~effijax.models.LanguageModel`.

Example:
  >>> cfg = TrainConfig(model="tiny", steps=10, batch_size=4)
  >>> cfg.warmup_steps
  1
"""

from effijax.recipe._config import (
    DEFAULT_MODEL,
    PRECISION_ALIASES,
    PRECISIONS,
    TrainConfig,
    field_kind,
    flag_of,
)
from effijax.recipe._job import (
    CompiledStep,
    Job,
    abstract_state,
    batch_fn,
    compile_job,
    evaluate,
    init_frozen,
    init_state,
    plan_job,
)
from effijax.recipe._sources import BUNDLED, bundled_path, load_params, read_source
from effijax.recipe._train import TrainResult, optimizer_for, resolve, train

__all__ = [
    "TrainConfig",
    "TrainResult",
    "train",
    "resolve",
    "optimizer_for",
    "flag_of",
    "field_kind",
    "DEFAULT_MODEL",
    "PRECISIONS",
    "PRECISION_ALIASES",
    "Job",
    "CompiledStep",
    "plan_job",
    "abstract_state",
    "init_state",
    "init_frozen",
    "batch_fn",
    "evaluate",
    "compile_job",
    "BUNDLED",
    "bundled_path",
    "read_source",
    "load_params",
]
