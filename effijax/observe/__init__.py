"""Watching a run while it trains: TensorBoard, Weights & Biases, and jax.profiler traces.

The training loop hands each step's host-side record (``step``, ``loss``, ``learning_rate``,
``loss_scale``, ``skipped``, ``grad_norm``, ``tokens_per_s``, ...) to a :class:`MetricsSink`;
a sink turns the record's numbers into scalars (:func:`scalars`) and writes them where a
researcher watches. :class:`TensorBoardSink` writes event files with tensorboardX;
:class:`WandbSink` logs to a W&B run whose id lives in the run directory, so a resumed run
continues it; :class:`Sinks` fans one record out to several. :class:`Profiler` records a
``jax.profiler`` trace of chosen steps, and :func:`step_breakdown` sums such a trace by kind of
work (matmuls, attention, norms, the head and loss, the optimizer update, collectives, idle)
with each kind's achieved FLOP/s. Only the main process opens any of them.

Resuming: a run resumes from its last checkpoint, which may be older than the last step it
logged. Those steps run again, bit for bit, and are logged again; each sink keeps one value
per step (TensorBoard purges the stale tail of its event stream, W&B keeps a step's first
value), and both values are the same number.
"""

from effijax._lazy import attach

# Each name is imported from its module on first use (the package convention, see
# effijax/_lazy.py): importing the package costs only what is used.
__getattr__, __dir__, __all__ = attach(__name__, {
    "effijax.observe._breakdown": ("CATEGORIES", "CategoryTime", "HloOp", "StepBreakdown",
                                   "hlo_ops", "step_breakdown"),
    "effijax.observe._profile": ("Profiler",),
    "effijax.observe._sink": ("MetricsSink", "Sinks", "memory_markdown", "scalars"),
    "effijax.observe._tensorboard": ("TensorBoardSink",),
    "effijax.observe._wandb": ("WandbSink",),
})
