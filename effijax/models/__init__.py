"""Models used by experiments: a decoder-only GPT in Flax NNX and its functional API.

Build a model with ``GPT(gpt_config("mini"), rngs=nnx.Rngs(0))`` or, functionally, get
``graphdef, params = abstract_split(config)`` / ``init_params(config, policy, key)`` and run
``make_loss_fn(graphdef)(params, batch, rng)``. Parameters are plain nested dicts whose
'/'-joined paths (``blocks/attn/q/kernel``) are what precision overrides, sharding rules and LoRA
targets match.
"""

from effijax.models._blockwise import blockwise_attend
from effijax.models._gpt import (
    ATTENTION,
    GPT,
    PRESETS,
    REMAT,
    GPTConfig,
    abstract_params,
    abstract_split,
    attend,
    gpt_config,
    init_params,
    make_apply,
    make_loss_fn,
    param_count,
    split_params,
)

__all__ = [
    "GPT",
    "GPTConfig",
    "gpt_config",
    "PRESETS",
    "param_count",
    "attend",
    "blockwise_attend",
    "ATTENTION",
    "REMAT",
    "split_params",
    "make_apply",
    "make_loss_fn",
    "init_params",
    "abstract_params",
    "abstract_split",
]
