"""Deprecated (kept for one release): the train step is :mod:`effijax.step` ("train" names the
command and :func:`effijax.recipe.train`, the run); this module re-exports its names.
"""

import warnings

from effijax.step import *  # noqa: F403  (the same names, one place that defines them)
from effijax.step import __all__  # noqa: F401

warnings.warn("effijax.train is deprecated: the train step is effijax.step "
              "(from effijax.step import make_train_step, TrainState, ...)", DeprecationWarning,
              stacklevel=2)
