"""Llama 3's rotary scaling in GGUF files: llama.cpp's ``rope_freqs.weight`` read and written.

A tiny Llama with Llama 3 scaling (head_dim 32, theta 1000, original context 32: frequencies in
all three regimes) is made by ``transformers`` and written as llama.cpp's converter writes it;
effijax's logits from the GGUF equal ``transformers``' from the directory at positions up to 63,
where the scaling matters. The four numbers come back exactly from Llama 3.1's and 3.2's
factors; factors no Llama 3 scaling gives, and other scaling types, are refused; effijax's own
export writes the converter's tensor and reads back to the same config.
"""

import dataclasses
import math

import gguf
import jax
import numpy as np
import pytest
from _llama_files import VOCAB_SIZE, llama_cpp_rope_freqs, write_gguf
from _parity import our_logits, randomized, torch_logits
from _reference import reference

from effijax.errors import ConfigError, FileError
from effijax.interop import gguf_config, gguf_format, load_gguf, load_hf, save_gguf
from effijax.models import llama3_scaling, qwen2_config, rope_factors
from effijax.paths import named_leaves

torch = reference("torch", reason="the parity test needs torch (effijax[interop])")
transformers = reference("transformers", reason="the parity test needs transformers "
                         "(pip install effijax[interop])")

ATOL = 1e-4  # f32 logits through two layers, as tests/test_hf_parity.py
HEAD_DIM, THETA, SCALING = 32, 1000.0, (4.0, 1.0, 4.0, 32)  # wavelengths 2π·1000^(i/16)
SEQ_LEN = 64  # past original_max_position / low_freq_factor = 32
FIELDS = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
              rope_theta=THETA, rms_norm_eps=1e-5, tie_word_embeddings=False)
LLAMA3 = {"rope_type": "llama3", "factor": SCALING[0], "low_freq_factor": SCALING[1],
          "high_freq_factor": SCALING[2], "original_max_position_embeddings": SCALING[3]}


def _formula(head_dim, theta, factor, low, high, original):
    """llama.cpp's rule for ``rope_freqs.weight`` as the brief states it, in f64 throughout."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    s = (original / wavelen - low) / (high - low)
    return np.where(wavelen < original / high, 1.0, np.where(
        wavelen > original / low, factor, 1 / ((1 - s) / factor + s)))


@pytest.fixture(scope="module")
def reference():
    """A random LlamaForCausalLM with Llama 3 scaling (non-trivial norms too)."""
    torch.manual_seed(0)
    return randomized(transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**FIELDS, rope_scaling=LLAMA3)))


@pytest.fixture(scope="module")
def files(reference, tmp_path_factory):
    """``(directory, gguf file, (config, params) from the directory)``: the model saved by
    transformers, and written as llama.cpp's converter writes it (rope_freqs included)."""
    root = tmp_path_factory.mktemp("llama3-rope")
    reference.save_pretrained(root / "hf")
    config, params = load_hf(root / "hf", seq_len=SEQ_LEN)
    write_gguf(root / "m.gguf", config, params,
               extra={"rope_freqs.weight": llama_cpp_rope_freqs(HEAD_DIM, THETA, *SCALING)})
    return root / "hf", root / "m.gguf", (config, params)


def test_a_llama3_gguf_gives_transformers_logits(files, reference):
    _, file, (config, params) = files
    assert config.rope_scaling == SCALING
    loaded, loaded_params = load_gguf(file, seq_len=SEQ_LEN)
    assert loaded == config and loaded.rope_scaling == SCALING
    # The factors are in the config, not a parameter: the tree is the directory's, bit for bit.
    assert [p for p, _ in named_leaves(loaded_params)] == [p for p, _ in named_leaves(params)]
    for a, b in zip(jax.tree.leaves(loaded_params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = np.random.default_rng(0).integers(0, VOCAB_SIZE, (2, SEQ_LEN))
    ours = our_logits(loaded, loaded_params, tokens)
    expected = torch_logits(reference, tokens)
    np.testing.assert_allclose(ours, expected, atol=ATOL, rtol=0)
    np.testing.assert_array_equal(ours, our_logits(config, params, tokens))
    # The scaling matters here: the same weights without it are far off.
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**FIELDS)).eval()
    plain.load_state_dict(reference.state_dict())
    assert np.abs(torch_logits(plain, tokens) - expected).max() > 100 * ATOL


@pytest.mark.parametrize("head_dim, scaling", [(128, (8.0, 1.0, 4.0, 8192)),
                                               (64, (32.0, 1.0, 4.0, 8192))],
                         ids=["llama-3.1", "llama-3.2"])
def test_the_four_numbers_come_back_exactly(head_dim, scaling):
    for factors in (llama_cpp_rope_freqs(head_dim, 500000.0, *scaling),  # f32 frequencies
                    _formula(head_dim, 500000.0, *scaling).astype(np.float32)):
        found = llama3_scaling(factors, head_dim, 500000.0)
        assert found == scaling
        assert [type(v) for v in found] == [float, float, float, int]
    # Only original / (high - low) and low / (high - low) matter: low comes back as 1.
    assert llama3_scaling(rope_factors(HEAD_DIM, THETA, (4.0, 2.0, 8.0, 64)), HEAD_DIM,
                          THETA) == SCALING
    assert llama3_scaling(np.ones(HEAD_DIM // 2, np.float32), HEAD_DIM, THETA) is None


def _refused(path, match):
    for read in (gguf_config, lambda f: load_gguf(f, seq_len=SEQ_LEN)):
        with pytest.raises(FileError, match=match):
            read(path)


def test_factors_that_are_not_llama3s_and_other_scalings_are_refused(files, tmp_path):
    _, _, (config, params) = files
    factors = llama_cpp_rope_freqs(HEAD_DIM, THETA, *SCALING)
    assert (factors == 1).sum() == 1 and (factors == 4).sum() == 12  # every regime is present
    tampered = factors.copy()
    tampered[2] *= 1.001
    write_gguf(tmp_path / "tampered.gguf", config, params, extra={"rope_freqs.weight": tampered})
    _refused(tmp_path / "tampered.gguf", r"tampered\.gguf: rope_freqs\.weight: is not Llama "
             r"3's rotary scaling of theta 1000, head_dim 32: the closest, \(4\.0, 1\.0, "
             r".*\), gives 1\.86\d* at frequency 2 where it has 1\.864\d*; load the Hugging "
             r"Face checkpoint instead$")
    write_gguf(tmp_path / "short.gguf", config, params, extra={"rope_freqs.weight": factors[:8]})
    _refused(tmp_path / "short.gguf", r"rope_freqs\.weight: has shape \(8,\); expected \(16,\): "
             r"one factor per rotary frequency \(head_dim 32 / 2\)")
    for kind in ("linear", "yarn"):
        write_gguf(tmp_path / f"{kind}.gguf", config, params, fields={
            "llama.rope.scaling.type": (kind, gguf.GGUFValueType.STRING),
            "llama.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32)})
        _refused(tmp_path / f"{kind}.gguf", rf"llama\.rope\.scaling\.type='{kind}': effijax "
                 r"reads Llama 3's rotary scaling \(rope_freqs\.weight\) from GGUF, no other")
    # One frequency between the regimes does not determine the four numbers.
    with pytest.raises(ConfigError, match=r"^factors: has 1 value\(s\) between 1 and its factor "
                       r"8\.0; two are needed to determine Llama 3's scaling$"):
        llama3_scaling(rope_factors(16, 10000.0, (8.0, 1.0, 4.0, 16)), 16, 10000.0)


def test_save_gguf_writes_the_converters_tensor_and_reads_back(files, tmp_path):
    _, _, (config, params) = files
    assert gguf_format(config).gguf_architecture == "llama"  # the export's preflight passes
    file = save_gguf(tmp_path / "out.gguf", config, params, dtype="f32")
    loaded, back = load_gguf(file, seq_len=SEQ_LEN)
    assert loaded == config and loaded.rope_scaling == SCALING
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    first = gguf.GGUFReader(file).tensors[0]  # first, as the converter writes it
    assert (first.name, first.tensor_type, tuple(first.shape)) == \
        ("rope_freqs.weight", gguf.GGMLQuantizationType.F32, (HEAD_DIM // 2,))
    written = np.asarray(first.data)
    np.testing.assert_array_max_ulp(written, _formula(HEAD_DIM, THETA, *SCALING).astype(
        np.float32), maxulp=1)
    np.testing.assert_allclose(written, llama_cpp_rope_freqs(HEAD_DIM, THETA, *SCALING),
                               rtol=1e-6, atol=0)
    # Scaling that would not be read back, or in a file llama.cpp reads none of, is refused.
    few = dataclasses.replace(config, head_dim=16, rope_theta=10000.0,
                              rope_scaling=(8.0, 1.0, 4.0, 16))
    with pytest.raises(ConfigError, match=r"^rope_scaling=\(8\.0, 1\.0, 4\.0, 16\): as "
                       r"rope_freqs\.weight, it would not be read back: the tensor has 1 "
                       r"value\(s\) between"):
        gguf_format(few)
    with pytest.raises(ConfigError, match=r"^rope_scaling=.*: llama\.cpp reads Llama 3's rotary "
                       r"scaling \(rope_freqs\.weight\) in 'llama' files only, not 'qwen2'"):
        gguf_format(qwen2_config("qwen2-tiny", rope_scaling=SCALING))
