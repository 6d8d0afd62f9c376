"""GGUF out (``save_gguf``): what effijax writes, effijax and ``transformers`` read back.

Tiny Llama and Qwen2 models (with a byte-level tokenizer and random LoRA adapters merged in) go
out in every tensor type and come back: bit for bit in f32, within the block quantization's
error otherwise; ``transformers`` (its own GGUF reader, with llama.cpp's row permutation undone
on its side) gives effijax's logits. The bundled SmolLM2 exported at Q8_0 continues a prompt in
``transformers`` as effijax does. Bad requests are refused before a byte is written, and a
failed export leaves the earlier file whole.
"""

import dataclasses
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _adapters import random_adapters
from _llama_files import CHAT_TEMPLATE, MERGES, VOCAB_SIZE, vocabulary
from _reference import GGUFReference

gguf = pytest.importorskip("gguf", reason="GGUF export needs gguf (pip install effijax[interop])")
pytest.importorskip("tokenizers", reason="tokenizers (pip install effijax[interop])")

from effijax import lora  # noqa: E402
from effijax.errors import ConfigError  # noqa: E402
from effijax.interop import (  # noqa: E402
    _gguf_write,  # noqa: E402
    gguf_tokenizer_fields,
    load_gguf,
    save_gguf,
)
from effijax.models import (  # noqa: E402
    byte_level_bpe,
    gpt_config,
    llama_config,
    mistral_config,
    qwen2_config,
)

ATOL = 1e-4  # f32 logits of magnitude ~5 through two different programs (tests/test_qwen2.py)


def _tokenizer():
    tokens, types, merges = vocabulary()
    return byte_level_bpe(tokens, merges, pre="smollm", token_types=types, bos_id=1, eos_id=2,
                          unk_id=0, pad_id=2, chat_template=CHAT_TEMPLATE)


def _model(family):
    make = {"llama": llama_config("llama-tiny"), "qwen2": qwen2_config("qwen2-tiny")}[family]
    return dataclasses.replace(make, vocab_size=VOCAB_SIZE, tokenizer=_tokenizer())


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def trained(request):
    """``(model, params, spec, adapters)``: random weights (q/k/v biases for Qwen2) and random
    LoRA adapters on every projection."""
    model = _model(request.param)
    params = model.init_params(jax.random.key(0))
    spec = lora.LoraSpec(rank=4, alpha=8.0, targets=model.lora_targets)
    adapters = random_adapters(params, spec, seed=3, scale=0.05)
    return model, params, spec, adapters


def _leaves(tree):
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0", "q4_1"])
def test_effijax_reads_its_export_back(tmp_path, trained, dtype):
    model, params, _, _ = trained
    file = save_gguf(tmp_path / "m.gguf", model, params, dtype=dtype)
    loaded, back = load_gguf(file, seq_len=model.seq_len)
    assert loaded == model
    text = "<|im_start|>the 12 thin things\n"
    assert loaded.tokenizer.encode(text).tolist() == model.tokenizer.encode(text).tolist()
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE
    ours, theirs = _leaves(params), _leaves(back)
    if dtype == "f32":
        assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))
        return
    # f16: half an f16 ulp; Q8_0 / Q4_1: half a quantization step of a 32-value block
    # (absmax / 127, range / 15), bounded here by the tensor's own absmax.
    step = {"f16": 2.0**-11, "q8_0": 1 / 127, "q4_1": 2 / 15}[dtype]
    for a, b in zip(ours, theirs, strict=True):
        assert np.abs(a - b).max() <= step * np.abs(a).max() * 1.01 + 1e-7


@pytest.mark.slow  # imports torch and transformers: ~10 s before the first comparison
def test_transformers_reads_the_export_with_adapters_merged(tmp_path, trained, one_torch_thread):
    torch = pytest.importorskip("torch", reason="parity needs torch (effijax[interop])")
    transformers = pytest.importorskip("transformers", reason="parity needs transformers")
    model, params, spec, adapters = trained
    file = save_gguf(tmp_path / "m.gguf", model, params, adapters=adapters, lora=spec,
                     dtype="f32")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, VOCAB_SIZE, (2, 24))
    with torch.no_grad():
        theirs = reference(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(jax.jit(model.logits_fn(spec))(
        {"base": params, "adapters": adapters}, jnp.asarray(tokens, jnp.int32)))
    assert np.abs(theirs - ours).max() <= ATOL
    unmerged = np.asarray(jax.jit(model.logits_fn())(params, jnp.asarray(tokens, jnp.int32)))
    assert np.abs(unmerged - ours).max() > 100 * ATOL  # the adapters are in the file
    assert os.path.basename(file) == "m.gguf"


def test_tokenizer_fields_pad_the_vocabulary_and_name_the_split():
    fields = gguf_tokenizer_fields(_tokenizer(), VOCAB_SIZE + 2)
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert tokens[-2:] == [f"[PAD{VOCAB_SIZE}]", f"[PAD{VOCAB_SIZE + 1}]"]
    assert types[:3] == [3, 3, 3] and types[-2:] == [5, 5] and set(types[3:-2]) == {1}
    assert fields["tokenizer.ggml.merges"] == MERGES
    assert fields["tokenizer.ggml.pre"] == "smollm"
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"]) == (1, 2)
    with pytest.raises(ConfigError, match=r"^tokenizer=264: has more tokens than the model's "
                       r"vocab_size \(100\)$"):
        gguf_tokenizer_fields(_tokenizer(), 100)


def test_bad_requests_are_refused_before_anything_is_written(tmp_path):
    model = _model("llama")
    params = model.init_params(jax.random.key(0))
    file = tmp_path / "m.gguf"
    with pytest.raises(ConfigError, match=r"^dtype='q4_k': GGUF tensor types effijax writes: "
                       r"f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0$"):
        save_gguf(file, model, params, dtype="q4_k")
    gpt = gpt_config("tiny")
    with pytest.raises(ConfigError, match=r"the gpt family has no Hugging Face counterpart"):
        save_gguf(file, gpt, gpt.init_params(jax.random.key(0)))
    # Llama 3.1's numbers on llama-tiny's 8 frequencies: one between the regimes, so the
    # rope_freqs tensor would not determine them when read back (tests/test_gguf_rope.py).
    scaled = dataclasses.replace(model, rope_scaling=(8.0, 1.0, 4.0, 8192))
    with pytest.raises(ConfigError, match=r"^rope_scaling=.*: as rope_freqs\.weight, it would "
                       r"not be read back"):
        save_gguf(file, scaled, params)
    assert list(tmp_path.iterdir()) == []
    mistral = mistral_config("mistral-tiny")
    with pytest.warns(UserWarning, match=r"no sliding window .* beyond 8 tokens"):
        save_gguf(file, mistral, mistral.init_params(jax.random.key(0)), dtype="f32")
    assert load_gguf(file, seq_len=32)[0].sliding_window is None


def test_a_failed_export_leaves_the_earlier_file_whole(tmp_path, monkeypatch):
    model = _model("llama")
    params = model.init_params(jax.random.key(0))
    file = save_gguf(tmp_path / "m.gguf", model, params, dtype="q8_0")
    before = pathlib.Path(file).read_bytes()
    written = []
    encoded = _gguf_write._encoded

    def fail_on_the_third(w, kind):
        written.append(kind)
        if len(written) == 3:
            raise OSError(28, "No space left on device")
        return encoded(w, kind)

    monkeypatch.setattr(_gguf_write, "_encoded", fail_on_the_third)
    with pytest.raises(OSError, match="No space left"):
        save_gguf(file, model, params, dtype="f32")
    assert pathlib.Path(file).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


@pytest.mark.slow
@pytest.mark.optimized  # a real model against transformers (logits, greedy ids)
def test_smollm2_at_q8_0_continues_in_transformers_as_in_effijax(tmp_path, one_torch_thread):
    torch = pytest.importorskip("torch", reason="parity needs torch (effijax[interop])")
    pytest.importorskip("transformers", reason="parity needs transformers")
    from effijax.generate import generate
    from effijax.sources import bundled_path

    try:
        source = bundled_path("smollm2")
    except ConfigError as e:
        pytest.skip(f"the bundled SmolLM2 is not installed ({e})")
    model, params = load_gguf(source)
    save_gguf(tmp_path / "smollm2-q8_0.gguf", model, params, dtype="q8_0")
    del params
    exported, exported_params = load_gguf(tmp_path / "smollm2-q8_0.gguf")
    assert exported == model
    prompt = "The capital of France is"
    ids = exported.tokenizer.encode(prompt)
    ours = np.asarray(generate(exported, exported_params, ids, max_new_tokens=8).tokens[0])
    # transformers' own reading of the export (gguf-py parsing it once for config and tensors).
    reference = GGUFReference(tmp_path / "smollm2-q8_0.gguf").model()
    with torch.no_grad():
        theirs = reference.generate(torch.tensor(ids[None].astype(np.int64)), max_new_tokens=8,
                                    do_sample=False).numpy()[0, len(ids):]
    assert ours.tolist() == theirs.tolist()
    assert exported.tokenizer.decode(ours.tolist()).startswith(" Paris")
    pre = gguf_tokenizer_fields(model.tokenizer, model.vocab_size)["tokenizer.ggml.pre"]
    assert pre == "smollm"  # found by how it splits text, as the source file named it


def _same_encodings(ours, back, corpus):
    for text in corpus:
        assert back.encode(text).tolist() == ours.encode(text).tolist(), text
        assert back.encode(text, add_special_tokens=True).tolist() == \
            ours.encode(text, add_special_tokens=True).tolist(), text


@pytest.mark.parametrize("prefix", [False, True], ids=["gemma", "llama2"])
def test_sentencepiece_tokenizers_are_written_as_llama_cpp_reads_them(prefix):
    from _sentencepiece_files import vocabulary as sentencepiece_vocabulary
    from test_sentencepiece import LEADING, TINY_CORPUS

    from effijax.interop import gguf_tokenizer
    from effijax.models import sentencepiece_bpe

    tokens, scores, types = sentencepiece_vocabulary(spaces=not prefix)
    ours = sentencepiece_bpe(tokens, scores, types, add_space_prefix=prefix, bos_id=2,
                             eos_id=1, unk_id=3, pad_id=0, add_bos=True)
    fields = gguf_tokenizer_fields(ours, len(tokens) + 1)
    assert fields["tokenizer.ggml.model"] == "llama"
    assert fields["tokenizer.ggml.add_space_prefix"] is prefix
    written = fields["tokenizer.ggml.token_type"]
    assert written[-1] == 5 and written[6:262] == [6] * 256  # padding; the byte tokens
    assert [written[tokens.index(t)] for t in ("<bos>", "\n", "a")] == [3, 4, 1]
    back = gguf_tokenizer(fields)
    _same_encodings(ours, back, TINY_CORPUS + LEADING)
    unpadded = gguf_tokenizer_fields(ours, len(tokens))  # read back, the padding is a token
    assert gguf_tokenizer_fields(gguf_tokenizer(unpadded), len(tokens)) == unpadded


@pytest.mark.slow
def test_gemma3s_tokenizer_written_and_read_back_encodes_alike(gemma3_gguf):
    from test_sentencepiece import GEMMA_CORPUS, _stdlib_text

    from effijax.interop import gguf_tokenizer, load_tokenizer

    ours = load_tokenizer(gemma3_gguf)
    fields = gguf_tokenizer_fields(ours, ours.vocab_size)
    back = gguf_tokenizer(fields)
    _same_encodings(ours, back, GEMMA_CORPUS)
    text = _stdlib_text(100_000)
    assert np.array_equal(back.encode(text), ours.encode(text))
