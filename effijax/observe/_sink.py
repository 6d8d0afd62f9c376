"""The sink interface the training loop calls, and the record-to-scalars rule all sinks share."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

__all__ = ["MetricsSink", "Sinks", "scalars", "memory_markdown"]


@runtime_checkable
class MetricsSink(Protocol):
    """Where a run's metrics go (TensorBoard, W&B, ...). Every method is host-side.

    ``log`` receives one training step's record (a dict with an int ``step``, 1-based: the
    number of optimizer steps done); ``values`` receives named numbers for one step (the
    evaluation loss at the end); ``text`` receives Markdown (the config, the memory report).
    """

    def log(self, record: Mapping) -> None: ...

    def values(self, step: int, values: Mapping[str, float]) -> None: ...

    def text(self, tag: str, text: str, step: int) -> None: ...

    def close(self) -> None: ...


def scalars(record: Mapping, prefix: str = "train/") -> dict[str, float]:
    """The numbers of a step record as named scalars: ints, floats and bools (as 0/1), except
    the step itself; non-finite values are kept (both TensorBoard and W&B plot them).

    Example:
      >>> scalars({"step": 3, "loss": 2.5, "skipped": False, "note": "x"})
      {'train/loss': 2.5, 'train/skipped': 0.0}
    """
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, str) or not isinstance(value, int | float):
            continue
        out[prefix + key] = float(value)
    return out


_BYTE_UNITS = (("GB", 1e9), ("MB", 1e6), ("KB", 1e3))


def _bytes(n: float) -> str:
    for unit, size in _BYTE_UNITS:
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def memory_markdown(memory: Mapping[str, float]) -> str:
    """A per-device memory report (bytes by kind) as a Markdown table, largest first.

    Example:
      >>> print(memory_markdown({"params": 2_000_000, "opt_state": 4_000_000}))
      | per device | bytes |
      | --- | --- |
      | opt_state | 4.00 MB |
      | params | 2.00 MB |
    """
    rows = sorted(((k, v) for k, v in memory.items() if isinstance(v, int | float)),
                  key=lambda kv: -kv[1])
    return "\n".join(["| per device | bytes |", "| --- | --- |",
                      *(f"| {k} | {_bytes(v)} |" for k, v in rows)])


class Sinks:
    """Several sinks as one: each call goes to every sink, in order.

    Example:
      >>> class Printer:
      ...     def log(self, record): print("step", record["step"], scalars(record))
      ...     def values(self, step, values): print("step", step, dict(values))
      ...     def text(self, tag, text, step): print(tag, text)
      ...     def close(self): print("closed")
      >>> sinks = Sinks([Printer()])
      >>> sinks.log({"step": 1, "loss": 2.0})
      step 1 {'train/loss': 2.0}
      >>> sinks.values(1, {"eval/loss": 1.5})
      step 1 {'eval/loss': 1.5}
      >>> sinks.close()
      closed
      >>> Sinks([]).active
      False
    """

    def __init__(self, sinks: Iterable[MetricsSink]):
        self.sinks = tuple(sinks)

    @property
    def active(self) -> bool:
        """Whether any sink is attached."""
        return bool(self.sinks)

    def log(self, record: Mapping) -> None:
        """Sends one step's record to every sink."""
        for sink in self.sinks:
            sink.log(record)

    def values(self, step: int, values: Mapping[str, float]) -> None:
        """Sends named values of one step to every sink (non-finite ones included)."""
        values = {k: float(v) for k, v in values.items() if isinstance(v, int | float)}
        for sink in self.sinks:
            sink.values(step, values)

    def text(self, tag: str, text: str, step: int) -> None:
        """Sends Markdown text to every sink."""
        for sink in self.sinks:
            sink.text(tag, text, step)

    def close(self) -> None:
        """Closes every sink (all of them, even when one fails; the first error is raised)."""
        error = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001 -- close the others, then raise
                error = error or e
        if error is not None:
            raise error
