"""Mixed precision: policies, casting, fp32 islands, and loss scaling as optax transforms.

A :class:`Policy` says which dtype parameters are stored in, computed in and returned in. The
train step casts the f32 master parameters to the compute dtype once per step, the model runs its
reductions in f32 (:func:`softmax`, :func:`cross_entropy`, :func:`layer_norm`, :func:`rms_norm`,
:func:`dot`), and :func:`dynamic_loss_scale` wraps any optax optimizer so that fp16 gradients do
not underflow: the scale lives in ``opt_state``, non-finite steps are skipped inside ``jit`` with
no host sync.
"""

from effijax._lazy import attach

# Each name is imported from its module on first use: importing the package (the CLI's
# flag checks, a config's validation) does not import JAX. __all__ lists every name.
__getattr__, __dir__, __all__ = attach(__name__, {
    "effijax.precision._accumulate": ("accumulate",),
    "effijax.precision._auto": ("AutoPrecision", "auto_precision", "cpu_flags", "native_bf16",
        "NATIVE_BF16_FLAGS", "AUTO_BF16_MIN_WIDTH"),
    "effijax.precision._cast": ("cast_floating", "is_floating"),
    "effijax.precision._dtypes": ("parse_dtype",),
    "effijax.precision._ggml": ("GGML_BLOCKS", "GGMLBlocks", "dequantize_blocks", "ggml_blocks",
        "ggml_blocks_bytes", "ggml_row_bytes", "ggml_sharding"),
    "effijax.precision._loss_chunks": ("LOSS_CHUNK_TOKENS", "loss_chunk_positions"),
    "effijax.precision._islands": ("dot", "softmax", "log_softmax", "cross_entropy",
        "cross_entropy_and_accuracy", "token_nll", "token_nll_grad",
        "masked_mean", "layer_norm", "rms_norm"),
    "effijax.precision._loss_scale": ("dynamic_loss_scale", "static_loss_scale",
        "DynamicLossScaleState", "StaticLossScaleState", "loss_scale_of", "skipped_steps_of",
        "step_skipped", "all_finite"),
    "effijax.precision._quantize": ("NF4_CODES", "QUANTIZED_FORMATS", "Quantized", "ScaleCodes",
        "dequantize", "dequantize_kernels", "dequantized_shapes",
        "is_quantized", "is_quantizable", "quantize",
        "quantize_kernels", "quantized_bytes", "quantized_sharding"),
    "effijax.precision._policy": ("Policy", "get_policy", "PRESETS"),
    "effijax.precision._names": ("PRESET_NAMES", "PRESET_ALIASES", "PRESET_COMPUTE"),
})
