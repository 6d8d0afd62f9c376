"""The training recipe: one frozen config, one ``train(config)``, for every model family.

``TrainConfig`` holds every setting and its default (it loads from TOML or JSON); ``train``
runs it top to bottom, one call per stage: start → source → model → data → optimizer → plan →
run directory → state → compile → loop → evaluate → export → summary. ``effijax train`` is
argparse → ``TrainConfig`` → ``train``; experiments and notebooks call the same function. The
job pieces (:func:`plan_job`, :func:`init_state`, ..., and :func:`build_lm_job` binding them
into one value) are public for code that drives its own loop on any
:class:`~effijax.models.LanguageModel`. :func:`evaluate_model` scores what a run (or a
pretrained file) holds. Where models and data come from (``open_model``, ``load_dataset``,
``prepare``, the memory pre-flight) lies below, in :mod:`effijax.sources`.

Example:
  >>> cfg = TrainConfig(model="tiny", steps=10, batch_size=4)
  >>> cfg.warmup_steps
  1
"""

from effijax._lazy import attach

# Each name is imported from its module on first use: importing the package (the CLI's
# flag checks, a config's validation) does not import JAX. __all__ lists every name.
__getattr__, __dir__, __all__ = attach(__name__, {
    "effijax.recipe._config": ("TrainConfig", "flag_of", "field_kind", "DEFAULT_MODEL",
        "PRECISIONS", "PRECISION_ALIASES"),
    "effijax.recipe._job": ("Job", "CompiledStep", "plan_job", "abstract_state",
        "abstract_batch", "init_state", "init_frozen", "frozen_key", "batch_fn", "evaluate",
        "evaluate_metrics", "compile_job", "LMJob", "build_lm_job"),
    "effijax.recipe._train": ("TrainResult", "train", "decide_precision", "placement"),
    "effijax.recipe._sections": ("Sections", "ModelSection", "PrecisionSection",
        "TrainingSection", "OptimizerSection", "DataSection", "ParallelSection", "OutputSection",
        "ObjectiveSection", "LoraSection", "REFERENCE_OBJECTIVES", "holds_reference"),
    "effijax.recipe._optimizer": ("optimizer_for",),
    "effijax.recipe._report": ("summary_step",),
    "effijax.recipe._eval": ("EvalResult", "evaluate_model", "load_model",
        "scoring_precision"),
    "effijax.recipe._sources": ("read_source", "load_params"),
    "effijax.recipe._objectives": ("get_objective",),
    "effijax.recipe._objective": ("ROLLOUT_METRICS",),
})
