"""Deprecated (kept for one release): the ready-to-run job lives with the other job pieces in
:mod:`effijax.recipe`; ``from effijax.recipe import build_lm_job, LMJob, abstract_state`` gives
the same objects (``abstract_lm_state`` is ``abstract_state``).
"""

import warnings

from effijax.recipe import CompiledStep, LMJob, build_lm_job
from effijax.recipe import abstract_state as abstract_lm_state

__all__ = ["LMJob", "CompiledStep", "build_lm_job", "abstract_lm_state"]

warnings.warn("effijax.jobs is deprecated: import build_lm_job, LMJob and abstract_state from "
              "effijax.recipe", DeprecationWarning, stacklevel=2)
