"""Logits of the same tokens from a ``transformers`` model and from effijax, for the parity tests
of each family (``test_qwen2.py``, ``test_gemma3.py``)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np


def torch_logits(model, tokens):
    """``model``'s f32 logits of integer ``tokens`` ``[B, S]`` (torch imported by the caller)."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


@functools.cache
def _logits_fn(config, spec):
    return jax.jit(config.logits_fn(spec))  # compiled once per model (and LoRA spec)


def our_logits(config, params, tokens, spec=None, adapters=None):
    """effijax's logits of ``tokens`` (with ``adapters`` under ``spec`` when given)."""
    args = params if spec is None else {"base": params, "adapters": adapters}
    return np.asarray(_logits_fn(config, spec)(args, jnp.asarray(tokens, jnp.int32)))
