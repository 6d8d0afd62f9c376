"""Test configuration: 8 forced CPU devices and strict dtype promotion, once, before jax is used.

Every test in the suite sees the same 8 CPU devices, so no test forces a device count of its own
(that would split the run). Strict promotion makes silent upcasts (bf16 + f32 -> f32) errors.
"""

import os

# Must happen before jax initialises its backends.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
