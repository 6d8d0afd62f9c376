"""Deprecated: the ready-to-run job lives with the other job pieces in :mod:`effijax.recipe`.

``from effijax.recipe import build_lm_job, LMJob, abstract_lm_state`` gives the same objects;
this module only re-exports them for code written against it.
"""

from effijax.recipe import CompiledStep, LMJob, abstract_lm_state, build_lm_job

__all__ = ["LMJob", "CompiledStep", "build_lm_job", "abstract_lm_state"]
