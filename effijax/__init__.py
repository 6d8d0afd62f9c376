"""effijax: efficient training in plain functional JAX.

* :mod:`effijax.precision`: precision policies, fp32 islands, loss scaling as optax transforms.
* :mod:`effijax.sharding`: meshes and DDP / ZeRO-1/2/3 (FSDP) strategies.
* :mod:`effijax.memory`: analytic memory estimates, measurement, the planner.
* :mod:`effijax.models`, :mod:`effijax.data`: Flax NNX models (a GPT, the Llama family) and
  offline byte corpora.
* :mod:`effijax.interop`: pretrained models in and out (GGUF files, Hugging Face directories,
  tokenizers, PEFT adapters).
* :mod:`effijax.step`: ``TrainState`` and the functional, jittable train step.

Subpackages and the names below are imported on first use (``effijax.models``,
``effijax.get_policy``), so ``import effijax`` stays light and does not import JAX.
"""

from effijax._lazy import attach

# Each name is imported from its module on first use: importing the package (the CLI's
# flag checks, a config's validation) does not import JAX. __all__ lists every name.
__getattr__, __dir__, _lazy_names = attach(__name__, {
    "effijax.errors": ("ConfigError", "FileError"),
    "effijax.precision": ("Policy", "get_policy", "dynamic_loss_scale", "static_loss_scale"),
    "effijax.step": ("TrainState", "init_train_state", "make_train_step", "make_optimizer"),
})

__version__ = "0.1.0"
__all__ = [*_lazy_names, "__version__"]
