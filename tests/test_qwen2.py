"""effijax's Qwen2 against Hugging Face's ``Qwen2ForCausalLM``: the same weights, the same outputs.

Tiny random checkpoints written by ``transformers`` (q/k/v biases, tied and untied heads) load
into effijax with transformers' logits; what effijax writes (the model directory, merged LoRA,
PEFT adapters) loads back in ``transformers``/``peft`` with effijax's outputs, and into effijax
bit for bit; greedy generation continues as ``generate`` does; a GGUF written like llama.cpp's
converter writes a Qwen2 loads the same in both. Unknown formats are refused naming the
supported ones.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _llama_files import VOCAB_SIZE, write_gguf
from _parity import (
    assert_peft_and_merged_exports_give_our_logits,
    assert_same_params,
    our_logits,
    torch_logits,
)
from _reference import reference

torch = reference("torch", reason="Qwen2 parity tests need torch (effijax[interop])")
transformers = reference("transformers", reason="Qwen2 parity tests need "
                         "transformers (pip install effijax[interop])")
peft = reference("peft", reason="PEFT export tests need peft (effijax[interop])")

from effijax.errors import ConfigError, FileError  # noqa: E402
from effijax.generate import generate  # noqa: E402
from effijax.interop import config_from_hf, load_gguf, load_hf, save_hf  # noqa: E402
from effijax.models import Qwen2Config, pretrained_format, qwen2_config  # noqa: E402

ATOL = 1e-4  # as tests/test_hf_parity.py: f32 logits of magnitude ~5, observed ~1e-5
VOCAB = VOCAB_SIZE  # the GGUF writer's tokenizer's size


def _hf_model(seed=0, **overrides):
    """A tiny random Qwen2ForCausalLM with non-trivial weights (biases and norm scales)."""
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  use_sliding_window=False)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**fields)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            else:
                p.uniform_(0.5, 1.5)
    return model


def _checkpoint(directory, tied: bool):
    """``(directory, transformers model, effijax config, params)`` of one random checkpoint."""
    reference = _hf_model(tie_word_embeddings=tied)
    reference.save_pretrained(directory)
    config, params = load_hf(directory, seq_len=32)
    return directory, reference, config, params


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(request, tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("qwen2"), request.param)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("qwen2-tied"), True)


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("qwen2-untied"), False)


def _tokens(shape=(2, 24), seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, shape)


def test_transformers_checkpoints_give_transformers_logits(checkpoint):
    _, reference, config, params = checkpoint
    assert type(config) is Qwen2Config
    assert config.tie_embeddings == reference.config.tie_word_embeddings
    assert config.rope_theta == 10000.0 and config.rms_eps == 1e-6
    tokens = _tokens()
    expected = torch_logits(reference, tokens)
    ours = our_logits(config, params, tokens)
    assert np.abs(ours - expected).max() <= ATOL
    # The biases are loaded and used: without them the logits are far off.
    unbiased = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if "bias" in jax.tree_util.keystr(path) else x, params)
    assert np.abs(our_logits(config, unbiased, tokens) - expected).max() > 100 * ATOL


def test_parameter_count_is_transformers(checkpoint):
    _, reference, config, params = checkpoint
    tree = sum(x.size for x in jax.tree.leaves(params))
    assert config.num_params == tree == reference.num_parameters()
    assert config.shape().num_params == config.num_params


def test_save_reload_is_bit_exact_and_loads_in_transformers(tmp_path, checkpoint):
    directory, reference, config, params = checkpoint
    # Sharded on the way out (many files and an index), then read back.
    written = save_hf(tmp_path, config, params, max_shard_bytes=40_000)
    assert "model.safetensors.index.json" in written and len(written) > 4
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["Qwen2ForCausalLM"] and saved["model_type"] == "qwen2"
    assert saved["use_sliding_window"] is False
    reloaded, again = load_hf(tmp_path, seq_len=32)
    assert reloaded == config
    assert_same_params(params, again)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(model).__name__ == "Qwen2ForCausalLM"
    for name, tensor in reference.state_dict().items():  # the same bits as the original
        assert torch.equal(model.state_dict()[name], tensor), name


@pytest.mark.slow  # compiles a prefill and a decode step: ~7 s
def test_greedy_generation_matches_transformers_generate(tied):
    _, reference, config, params = tied
    prompt = _tokens((1, 7), seed=3)[0]
    ours = generate(config, params, prompt, max_new_tokens=10)
    with torch.no_grad():
        theirs = reference.generate(torch.tensor(prompt[None]), max_new_tokens=10,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours.tokens[0].tolist() == theirs[0, len(prompt):].tolist()


# peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`: their warning, not ours.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.slow  # imports peft and compiles the factored-LoRA forward: ~10-20 s
def test_peft_adapters_and_merged_export_give_effijax_logits(tmp_path, untied):
    directory, _, config, params = untied
    assert_peft_and_merged_exports_give_our_logits(
        tmp_path, directory, config, params, transformers.Qwen2ForCausalLM, _tokens(seed=2), ATOL)


def test_sliding_window_layers_give_transformers_logits_and_export_alike(tmp_path):
    """use_sliding_window with max_window_layers=1: layer 0 global, layer 1 within 5 keys, as
    transformers' eager attention masks them; the export reads back the same rule."""
    reference = _hf_model(use_sliding_window=True, sliding_window=5, max_window_layers=1,
                          attn_implementation="eager")
    reference.save_pretrained(tmp_path / "hf")
    config, params = load_hf(tmp_path / "hf", seq_len=32)
    assert (config.sliding_window, config.max_window_layers) == (5, 1)
    tokens = _tokens()
    ours = our_logits(config, params, tokens)
    assert np.abs(torch_logits(reference, tokens) - ours).max() <= ATOL
    unwindowed = our_logits(dataclasses.replace(config, sliding_window=None), params, tokens)
    assert np.abs(unwindowed - ours).max() > 100 * ATOL  # the window changes the logits
    save_hf(tmp_path / "out", config, params)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["layer_types"] == ["full_attention", "sliding_attention"]
    assert load_hf(tmp_path / "out", seq_len=32)[0] == config


def _hf_fields(**overrides):
    return {"model_type": "qwen2", "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": True,
            "rope_theta": 1000000.0, **overrides}


def test_config_json_reads_as_the_preset_and_refuses_what_qwen2_lacks():
    assert config_from_hf(_hf_fields(), seq_len=64) == qwen2_config("qwen2-tiny")
    assert config_from_hf(_hf_fields(use_sliding_window=False, sliding_window=4096,
                                     max_window_layers=2), seq_len=64) == \
        qwen2_config("qwen2-tiny")
    windowed = config_from_hf(_hf_fields(use_sliding_window=True, sliding_window=16,
                                         max_window_layers=1), seq_len=64)
    assert (windowed.sliding_window, windowed.max_window_layers) == (16, 1)
    with pytest.raises(FileError, match=r"^config.json: layer_types=\['sliding_attention', "
                       r"'full_attention'\]: effijax's Qwen2 reads transformers' pattern only"):
        config_from_hf(_hf_fields(use_sliding_window=True, sliding_window=16,
                                  max_window_layers=1,
                                  layer_types=["sliding_attention", "full_attention"]))
    with pytest.raises(FileError, match=r"^config.json: max_window_layers=-1: must be an "
                       r"integer >= 0"):
        config_from_hf(_hf_fields(use_sliding_window=True, max_window_layers=-1))
    with pytest.raises(FileError, match=r"hidden_act='gelu': effijax's Qwen2 supports 'silu'"):
        config_from_hf(_hf_fields(hidden_act="gelu"))


def test_unknown_formats_are_refused_listing_the_supported_ones():
    with pytest.raises(FileError, match=r"^config.json: model_type='phi3': effijax loads "
                       r"these model_types only: 'gemma3_text', 'llama', 'mistral', 'qwen2'$"):
        config_from_hf(_hf_fields(model_type="phi3"))
    with pytest.raises(ConfigError, match=r"^general.architecture='phi3': effijax loads these "
                       r"general.architectures only: 'gemma3', 'llama', 'qwen2'$"):
        pretrained_format(gguf_architecture="phi3")


def test_llama_cpp_style_qwen2_gguf_loads_alike_in_both(tmp_path, untied):
    _, reference, config, params = untied
    write_gguf(tmp_path / "tiny.gguf", config, params, architecture="qwen2", permuted=False)
    loaded_config, loaded = load_gguf(tmp_path / "tiny.gguf", seq_len=32)
    # The same model and the same bits as from the Hugging Face directory.
    assert loaded_config == config
    assert_same_params(params, loaded)
    # transformers reads the file as the Qwen2 it came from: effijax's logits, tested above.
    from_gguf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    assert type(from_gguf).__name__ == "Qwen2ForCausalLM"
    tokens = _tokens(seed=4)
    assert np.abs(torch_logits(from_gguf, tokens) - torch_logits(reference, tokens)
                  ).max() <= 1e-5
