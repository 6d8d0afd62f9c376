"""LoRA as a pytree transform: a spec, adapters next to the frozen weights, merge and export.

A :class:`LoraSpec` picks kernels by '/'-joined path regex; :func:`init` returns adapters, a
nested dict ``{path...: {"a": (..., d_in, r), "b": (..., r, d_out)}}`` mirroring those kernels,
so that the adapted layer computes ``x @ w + s·(x @ a) @ b`` with ``s = alpha / r`` (PEFT's
convention; ``b`` starts at zero, so the model is unchanged at init). effijax's GPT consumes
adapters factored (``effijax.models.make_loss_fn(graphdef, lora=spec)``); :func:`freeze_base`
turns that loss into one that differentiates only the adapters, so gradients and optimizer state
exist only for them. Any other model can use :func:`merge`. Adapters are saved alone with
:func:`save_adapters` or exported to Hugging Face PEFT with :func:`export_peft`.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from effijax import lora
  >>> w = jnp.zeros((64, 64))
  >>> params = {"attn": {"q": {"kernel": w}, "k": {"kernel": w}}}
  >>> adapters = lora.init(jax.random.key(0), params, lora.LoraSpec())
  >>> lora.trainable_report(params, adapters)
  'trainable params: 1,024 || all params: 9,216 || trainable%: 11.1111'
"""

from effijax._lazy import attach

# Each name is imported from its module on first use (the package convention, see
# effijax/_lazy.py): importing the package costs only what is used.
__getattr__, __dir__, __all__ = attach(__name__, {
    "effijax.lora._adapters": ("count_params", "freeze_base", "init", "merge", "merge_error",
        "pairs", "select", "trainable_report", "unmerge", "validate"),
    "effijax.lora._peft": ("export_peft", "load_adapters", "peft_module_name", "save_adapters"),
    "effijax.lora._sharding": ("adapter_rules",),
    "effijax.lora._spec": ("LoraSpec",),
})
