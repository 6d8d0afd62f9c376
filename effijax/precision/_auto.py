"""What ``auto`` precision means: bf16 where it makes training faster, fp32 elsewhere.

On a GPU or TPU, bf16 compute (f32 master weights, f32 islands) is the fast path: ``auto``
picks it. On a CPU, bf16 pays only where the CPU multiplies bf16 natively (the AVX512_BF16 or
AMX_BF16 instructions) and the model is wide enough for its matmuls to outweigh the rest of the
step. ``benchmarks/auto_precision.py`` measures the bound (the full training step's bf16 / fp32
tokens/s, a 2-core AMD EPYC with AVX512_BF16): 0.78x at width 64, 0.94x at 128, 1.16x at 256,
1.30x at 384, 1.34x for SmolLM2-135M's 576, 1.52x at 768. Without those instructions a bf16
matmul has no native kernel to run on, and ``auto`` keeps fp32.

What bf16 costs in loss, on the Q&A fine-tune (``effijax data make-example``, SmolLM2, eval
loss over the held-out assistant tokens, bf16 against fp32): LoRA +0.005 and +0.012 after 40
steps (two seeds) and +0.031 after 8 steps at lr 1e-3; full fine-tuning +0.023 to +0.037 after
30 steps in three seeds, whose fp32 losses themselves spread over 0.134. Some of it is the
evaluation's own bf16 forward pass: the same fp32-trained weights score 0.020 higher on the
whole file evaluated in bf16. It is the trade ``auto`` makes on a GPU; ``--precision fp32``
keeps f32 where it matters.

The probe reads the CPU's flags from ``/proc/cpuinfo`` (Linux); elsewhere it finds none and
``auto`` stays fp32 on the CPU, as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["AutoPrecision", "auto_precision", "cpu_flags", "native_bf16",
           "NATIVE_BF16_FLAGS", "AUTO_BF16_MIN_WIDTH"]

# The CPU flags (as /proc/cpuinfo spells them) of native bf16 matmul instructions, the widest
# first.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# The narrowest residual width at which ``auto`` picks bf16 on such a CPU: the narrowest at which
# bf16 was measured faster (1.16x; 0.94x at 128).
AUTO_BF16_MIN_WIDTH = 256


class AutoPrecision(NamedTuple):
    """``auto`` decided: the precision preset and why, in a few words for the start-up line."""

    precision: str
    reason: str


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The host CPU's feature flags (lower case, as Linux lists them); empty where ``path``
    cannot be read (not Linux) or lists none.

    Example:
      >>> import tempfile, pathlib
      >>> f = pathlib.Path(tempfile.mkdtemp()) / "cpuinfo"
      >>> _ = f.write_text("processor\\t: 0\\nflags\\t\\t: fpu avx2 avx512_bf16\\n")
      >>> sorted(cpu_flags(str(f)))
      ['avx2', 'avx512_bf16', 'fpu']
      >>> cpu_flags("/no/such/file")
      frozenset()
    """
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].lower().split())
    except OSError:
        pass
    return frozenset()


def native_bf16(flags: Iterable[str]) -> str | None:
    """The widest native bf16 matmul instruction set among ``flags`` (``"AMX_BF16"``,
    ``"AVX512_BF16"``), or None.

    Example:
      >>> native_bf16({"avx2", "avx512_bf16"})
      'AVX512_BF16'
      >>> native_bf16({"avx2"}) is None
      True
    """
    flags = set(flags)
    return next((f.upper() for f in NATIVE_BF16_FLAGS if f in flags), None)


def auto_precision(backend: str, width: int, flags: Iterable[str] = ()) -> AutoPrecision:
    """What ``precision="auto"`` is for a model of residual width ``width`` on ``backend``
    (``jax.default_backend()``), whose CPU has the feature ``flags`` (:func:`cpu_flags`).

    bf16 on a GPU or TPU; on a CPU, bf16 when it has native bf16 matmuls (:func:`native_bf16`)
    and ``width >= AUTO_BF16_MIN_WIDTH``; fp32 otherwise.

    Example:
      >>> auto_precision("gpu", 128)
      AutoPrecision(precision='bf16', reason='auto: gpu')
      >>> auto_precision("cpu", 576, {"avx512_bf16"})
      AutoPrecision(precision='bf16', reason='auto: CPU with AVX512_BF16, width 576')
      >>> auto_precision("cpu", 128, {"avx512_bf16"}).reason
      'auto: width 128 < 256 on a CPU'
      >>> auto_precision("cpu", 576, {"avx2"}).reason
      'auto: CPU without native bf16'
    """
    if backend != "cpu":
        return AutoPrecision("bf16", f"auto: {backend}")
    native = native_bf16(flags)
    if native is None:
        return AutoPrecision("fp32", "auto: CPU without native bf16")
    if width < AUTO_BF16_MIN_WIDTH:
        return AutoPrecision("fp32", f"auto: width {width} < {AUTO_BF16_MIN_WIDTH} on a CPU")
    return AutoPrecision("bf16", f"auto: CPU with {native}, width {width}")
