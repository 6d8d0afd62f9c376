"""effijax's Mistral against Hugging Face's ``MistralForCausalLM``: same weights, same outputs.

A tiny random checkpoint written by ``transformers`` with a sliding window shorter than the
prompt loads into effijax with transformers' logits (the window is read and used); what effijax
writes loads back in ``transformers`` bit for bit and into effijax as the same config. A Llama
with a window is refused on export, not written as a windowless ``LlamaForCausalLM``.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import reference

torch = reference("torch", reason="Mistral parity tests need torch (effijax[interop])")
transformers = reference("transformers", reason="Mistral parity tests need "
                         "transformers (pip install effijax[interop])")

from effijax.errors import ConfigError  # noqa: E402
from effijax.interop import config_from_hf, hf_config, load_hf, save_hf  # noqa: E402
from effijax.models import MistralConfig, llama_config, mistral_config  # noqa: E402
from effijax.paths import named_leaves  # noqa: E402

ATOL = 1e-4  # as tests/test_hf_parity.py: f32 logits of magnitude ~5, observed ~1e-5
VOCAB = 128
WINDOW = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``(directory, transformers model, effijax config, params)`` of one random checkpoint."""
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rope_theta=10000.0, rms_norm_eps=1e-6, sliding_window=WINDOW,
                  attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**fields)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    directory = tmp_path_factory.mktemp("mistral")
    model.save_pretrained(directory)
    config, params = load_hf(directory, seq_len=32)
    return directory, model, config, params


def _logits(config, params, tokens):
    return np.asarray(jax.jit(config.logits_fn(None))(params, jnp.asarray(tokens, jnp.int32)))


def test_a_transformers_checkpoint_gives_transformers_logits_past_its_window(checkpoint):
    _, reference, config, params = checkpoint
    assert type(config) is MistralConfig and config.sliding_window == WINDOW
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 16))  # 16 > the window of 5
    with torch.no_grad():
        expected = reference(torch.tensor(tokens)).logits.float().numpy()
    assert np.abs(_logits(config, params, tokens) - expected).max() <= ATOL
    # The window is read and used: without it the logits past it are far off.
    unwindowed = dataclasses.replace(config, sliding_window=None)
    assert np.abs(_logits(unwindowed, params, tokens) - expected).max() > 100 * ATOL
    assert config.num_params == reference.num_parameters() == sum(
        x.size for x in jax.tree.leaves(params))


@pytest.mark.slow  # compiles a prefill and a decode step: ~6 s
def test_greedy_generation_past_the_window_is_transformers_generate(checkpoint):
    """Ragged prompts shorter than, as long as and longer than the window, continued well past
    it: every layer decodes from a ring of WINDOW slots, as transformers' sliding cache does."""
    from effijax.generate import generate

    _, reference, config, params = checkpoint
    assert config.init_cache(1, 64).k_LBWGK.shape[:3] == (2, 1, WINDOW)  # no full-length slots
    prompts = [np.random.default_rng(i).integers(0, VOCAB, n) for i, n in enumerate((3, 5, 12))]
    out = generate(config, params, prompts, max_new_tokens=10)
    # A cache of 64 positions (16 + 10 rounded up), of which each layer keeps WINDOW.
    assert out.cache_bytes == 2 * (2 * 3 * WINDOW * 2 * 16 * 4) + 3 * 4  # k, v; + pad_B
    for prompt, new in zip(prompts, out.tokens, strict=True):
        with torch.no_grad():
            theirs = reference.generate(torch.tensor(prompt[None]), max_new_tokens=10,
                                        do_sample=False, eos_token_id=None, pad_token_id=0)
        assert np.asarray(new).tolist() == theirs[0, len(prompt):].tolist()


def test_save_reload_is_bit_exact_and_loads_in_transformers(tmp_path, checkpoint):
    _, reference, config, params = checkpoint
    save_hf(tmp_path, config, params)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["architectures"], saved["model_type"], saved["sliding_window"]) == \
        (["MistralForCausalLM"], "mistral", WINDOW)
    reloaded, again = load_hf(tmp_path, seq_len=32)
    assert reloaded == config
    ours, theirs = dict(named_leaves(params)), dict(named_leaves(again))
    assert ours.keys() == theirs.keys()
    assert all(np.array_equal(np.asarray(ours[k]), np.asarray(theirs[k])) for k in ours)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(model).__name__ == "MistralForCausalLM"
    assert model.config.sliding_window == WINDOW
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_the_window_defaults_as_transformers_and_is_checked():
    fields = {"model_type": "mistral", "vocab_size": 256, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256}
    assert config_from_hf(fields).sliding_window == 4096  # MistralConfig's default
    assert config_from_hf({**fields, "sliding_window": None}).sliding_window is None
    with pytest.raises(ConfigError, match="sliding_window"):
        config_from_hf({**fields, "sliding_window": 2.5})


def test_a_llama_with_a_window_is_not_exported_as_a_windowless_llama():
    with pytest.raises(ConfigError, match="MistralConfig"):
        hf_config(llama_config("llama-tiny", sliding_window=4))
    assert mistral_config("mistral-tiny").sliding_window == 8
