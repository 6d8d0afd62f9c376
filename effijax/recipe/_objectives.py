"""The registry of training objectives: ``TrainConfig.objective`` names one of these.

Example:
  >>> sorted(OBJECTIVES), get_objective("sft").metric
  (['dpo', 'grpo', 'orpo', 'sft', 'simpo'], 'lm_loss')
"""

from __future__ import annotations

from effijax.errors import ConfigError
from effijax.recipe._dpo import DPO
from effijax.recipe._grpo import GRPO
from effijax.recipe._objective import SFT, Objective
from effijax.recipe._orpo import ORPO
from effijax.recipe._simpo import SIMPO

__all__ = ["OBJECTIVES", "get_objective"]

# One line per objective (its module defines its Objective).
OBJECTIVES: dict[str, Objective] = {
    "sft": SFT,
    "dpo": DPO,
    "simpo": SIMPO,
    "orpo": ORPO,
    "grpo": GRPO,
}


def get_objective(name: str) -> Objective:
    """The objective called ``name``."""
    if name not in OBJECTIVES:
        raise ConfigError("objective", name, f"choose one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]
