"""Memory accounting: the published analytic formulas and a planner built on them.

:func:`model_states` gives per-device bytes of parameters, gradients and optimizer state for a
parameter count, optimizer, precision, ZeRO stage and LoRA fraction; :func:`estimate_tree` counts
the same from a real abstract parameter pytree and optax optimizer; :func:`activation_bytes` is
the transformer activation formula (with a tensor-parallel degree, sequence parallelism and a
context-parallel degree); :func:`communication` the per-step traffic of a ``(data, fsdp,
tensor)`` mesh; :func:`plan` picks the cheapest configuration that fits, :func:`plan_mesh` the
mesh to run it on (a ``context`` axis too, when asked).
:func:`measure` reads what XLA really allocates for a compiled function, :func:`compare` sets it
against an estimate, and :func:`activation_measure` sweeps a GPT train step over sequence
lengths (naive vs blockwise attention vs remat) next to the formula.
GB means 10**9 bytes throughout (the unit of the ZeRO paper's and Biderman et al. 2024's
tables). Precisions are named as the training policies are (``fp32``, ``bf16``, ``fp16``,
``pure_bf16``; ``mixed`` is an alias of ``bf16``); bad arguments raise
:class:`~effijax.errors.ConfigError` naming the argument.
"""

from effijax._lazy import attach

# Each name is imported from its module on first use: importing the package (the CLI's
# flag checks, a config's validation) does not import JAX. __all__ lists every name.
__getattr__, __dir__, __all__ = attach(__name__, {
    "effijax.memory._activations": ("CHECKPOINTING", "activation_bytes"),
    "effijax.memory._estimate": ("GB", "GIB", "OPTIMIZERS", "PRECISIONS", "PRECISION_ALIASES",
        "FROZEN_DTYPES", "FROZEN_SCALE_BITS", "ModelStateBytes", "format_bytes", "model_states",
        "parse_bytes", "parse_count"),
    "effijax.memory._tree": ("estimate_tree", "frozen_base_bytes"),
    "effijax.memory._communication": ("Communication", "communication"),
    "effijax.memory._measure": ("ACTIVATION_VARIANTS", "ROW_HEADER", "ActivationPoint",
        "Measurement", "Row", "activation_measure", "compare", "measure", "tree_bytes"),
    "effijax.memory._plan": ("HEADROOM", "Plan", "plan"),
    "effijax.memory._mesh_plan": ("Candidate", "MeshPlan", "RULE", "plan_mesh"),
})
