"""How much one call of :func:`~effijax.generate.generate` may take on (no jax here: the CLI
checks its flags with it before jax starts)."""

from __future__ import annotations

from effijax.errors import ConfigError

__all__ = ["MAX_PROMPTS", "check_prompt_count"]

# Prompts run as one batch with one cache row each: a cache of thousands of rows rarely fits
# any device, and a caller with more prompts gains nothing over calls of this many.
MAX_PROMPTS = 4096


def check_prompt_count(count: int, field: str = "prompt") -> None:
    """Refuses more than :data:`MAX_PROMPTS` prompts in one call.

    Example:
      >>> check_prompt_count(300_000, "--prompts-file")
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: --prompts-file='300,000 prompts': more than 4,096 in one call \
(they run as one batch, one cache row each); split them into several calls
    """
    if count > MAX_PROMPTS:
        raise ConfigError(field, f"{count:,} prompts", f"more than {MAX_PROMPTS:,} in one call "
                          "(they run as one batch, one cache row each); split them into several "
                          "calls")
