"""The precision presets by name, for checking a setting without importing JAX (the policies
themselves, with their dtypes, are in ``_policy``)."""

from __future__ import annotations

__all__ = ["PRESET_NAMES", "PRESET_ALIASES", "PRESET_COMPUTE"]

# The names of effijax.precision.PRESETS, in its order.
PRESET_NAMES = ("fp32", "bf16", "fp16", "pure_bf16")
# Each preset's compute dtype, by its short name: what a LoRA base is stored in when
# ``--frozen-dtype`` is ``auto`` (``_policy`` checks it against the presets' dtypes).
PRESET_COMPUTE: dict[str, str] = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16",
                                  "pure_bf16": "bf16"}
# Other spellings of the preset names (what parse_dtype accepts for the compute dtype).
PRESET_ALIASES: dict[str, str] = {
    "f32": "fp32", "float32": "fp32", "full": "fp32", "bfloat16": "bf16", "f16": "fp16",
    "float16": "fp16", "half": "fp16",
}
