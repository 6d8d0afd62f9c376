"""effijax's error type for bad configuration, raised before anything is traced or compiled."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A setting is wrong. The message names the field, the offending value and the fix.

    It subclasses ``ValueError`` so callers that already catch that keep working.

    Example:
      >>> str(ConfigError("batch_size", 10, "must be divisible by the data axes (4)"))
      'batch_size=10: must be divisible by the data axes (4)'
    """

    def __init__(self, field: str, value, problem: str):
        self.field = field
        self.value = value
        self.problem = problem
        super().__init__(f"{field}={value!r}: {problem}")

    def renamed(self, field: str) -> ConfigError:
        """The same error reported under another name (e.g. a library argument under the
        config field or flag that set it).

        Example:
          >>> str(ConfigError("rank", 0, "must be >= 1").renamed("lora_rank"))
          'lora_rank=0: must be >= 1'
        """
        return ConfigError(field, self.value, self.problem)
