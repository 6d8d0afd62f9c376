"""Mixed precision: policies, casting, fp32 islands, and loss scaling as optax transforms.

A :class:`Policy` says which dtype parameters are stored in, computed in and returned in. The
train step casts the f32 master parameters to the compute dtype once per step, the model runs its
reductions in f32 (:func:`softmax`, :func:`cross_entropy`, :func:`layer_norm`, :func:`rms_norm`,
:func:`dot`), and :func:`dynamic_loss_scale` wraps any optax optimizer so that fp16 gradients do
not underflow: the scale lives in ``opt_state``, non-finite steps are skipped inside ``jit`` with
no host sync.
"""

from effijax.precision._accumulate import accumulate
from effijax.precision._cast import cast_floating, is_floating
from effijax.precision._dtypes import parse_dtype
from effijax.precision._islands import (
    cross_entropy,
    dot,
    layer_norm,
    log_softmax,
    rms_norm,
    softmax,
)
from effijax.precision._loss_scale import (
    DynamicLossScaleState,
    StaticLossScaleState,
    all_finite,
    dynamic_loss_scale,
    loss_scale_of,
    skipped_steps_of,
    static_loss_scale,
    step_skipped,
)
from effijax.precision._policy import PRESET_ALIASES, PRESETS, Policy, get_policy

__all__ = [
    "Policy",
    "get_policy",
    "parse_dtype",
    "PRESETS",
    "PRESET_ALIASES",
    "cast_floating",
    "is_floating",
    "dot",
    "softmax",
    "log_softmax",
    "cross_entropy",
    "layer_norm",
    "rms_norm",
    "dynamic_loss_scale",
    "static_loss_scale",
    "DynamicLossScaleState",
    "StaticLossScaleState",
    "loss_scale_of",
    "skipped_steps_of",
    "step_skipped",
    "all_finite",
    "accumulate",
]
