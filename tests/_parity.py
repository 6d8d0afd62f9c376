"""Logits of the same tokens from a ``transformers`` model and from effijax, for the parity tests
of each family (``test_qwen2.py``, ``test_gemma3.py``)."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np


def torch_logits(model, tokens):
    """``model``'s f32 logits of integer ``tokens`` ``[B, S]`` (torch imported by the caller)."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def randomized(model):
    """``model`` (a ``transformers`` model) with visible random weights from torch's generator
    (the caller seeds it), in eval mode: matrices normal with std 0.2, vectors (norm scales)
    uniform in [0.5, 1.5]."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.2)
            else:
                p.uniform_(0.5, 1.5)
    return model.eval()


@functools.cache
def _logits_fn(config, spec):
    return jax.jit(config.logits_fn(spec))  # compiled once per model (and LoRA spec)


def our_logits(config, params, tokens, spec=None, adapters=None):
    """effijax's logits of ``tokens`` (with ``adapters`` under ``spec`` when given)."""
    args = params if spec is None else {"base": params, "adapters": adapters}
    return np.asarray(_logits_fn(config, spec)(args, jnp.asarray(tokens, jnp.int32)))


def assert_peft_and_merged_exports_give_our_logits(out_dir, directory, config, params, hf_class,
                                                   tokens, atol):
    """Random LoRA adapters on every projection: their PEFT export loaded by ``peft`` onto
    ``hf_class`` (from ``directory``) and the merged ``save_hf`` export loaded by
    ``transformers`` give effijax's logits within ``atol``; the adapters change them."""
    import peft
    import transformers
    from _adapters import random_adapters

    from effijax import lora
    from effijax.interop import save_hf, save_peft

    spec = lora.LoraSpec(rank=4, alpha=16.0, targets=config.lora_targets)
    adapters = random_adapters(params, spec, seed=7, scale=0.1)
    ours = our_logits(config, params, tokens, spec, adapters)
    assert np.abs(ours - our_logits(config, params, tokens)).max() > 0.1  # adapters matter

    written = save_peft(out_dir / "adapter", config, adapters, spec, base_model=str(directory))
    last = config.n_layers - 1
    assert f"base_model.model.model.layers.{last}.self_attn.q_proj.lora_A.weight" in written
    adapter_config = json.loads((out_dir / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter_config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    base = hf_class.from_pretrained(directory)
    with_adapter = peft.PeftModel.from_pretrained(base, out_dir / "adapter").eval()
    assert np.abs(torch_logits(with_adapter, tokens) - ours).max() <= atol

    save_hf(out_dir / "merged", config, params, adapters=adapters, lora=spec)
    merged = transformers.AutoModelForCausalLM.from_pretrained(out_dir / "merged").eval()
    assert type(merged) is hf_class
    assert np.abs(torch_logits(merged, tokens) - ours).max() <= atol


def assert_same_params(ours, theirs):
    """Two parameter trees with the same paths and bit-identical leaves."""
    from effijax.paths import named_leaves

    ours, theirs = dict(named_leaves(ours)), dict(named_leaves(theirs))
    assert ours.keys() == theirs.keys()
    for path in ours:
        assert np.array_equal(np.asarray(ours[path]), np.asarray(theirs[path])), path
