"""Random LoRA adapters for tests: ``lora.init``'s (``b`` zero, so the model is unchanged) plus
noise, so that the adapters change the outputs and a wrong merge or export shows."""

import jax

from effijax import lora


def random_adapters(params, spec, *, seed, scale):
    """Adapters for ``params`` under ``spec``, every leaf moved by ``scale`` times a normal."""
    adapters = lora.init(jax.random.key(seed), params, spec)
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree.unflatten(treedef, [x + scale * jax.random.normal(k, x.shape, x.dtype)
                                        for x, k in zip(leaves, keys, strict=True)])
