"""Weights in and out without torch: Hugging Face directories written by effijax and GGUF files
written like llama.cpp's converter load, export and reload exactly; wrong files are errors that
name every offending tensor; parameters land on the shardings asked for; the tokenizer comes
from a GGUF's metadata or a directory and round-trips text.

Comparisons with transformers (its own checkpoints, its logits, PEFT) are in
``test_hf_parity.py``.
"""

import dataclasses
import json
import os
import pathlib
import sysconfig

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from _llama_files import CHAT_TEMPLATE, VOCAB_SIZE, write_gguf

from effijax.errors import FileError
from effijax.interop import load_gguf, load_hf, load_pretrained, load_tokenizer, save_hf
from effijax.models import Tokenizer, llama_config
from effijax.paths import named_leaves
from effijax.sharding import make_mesh, param_shardings

TINY = llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=32)
TIED = dataclasses.replace(TINY, tie_embeddings=True, n_kv_heads=4)


def _random(model, seed=0):
    """Parameters with every entry distinct from init's (norm scales too)."""
    params = model.init_params(jax.random.key(seed))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
    return jax.tree.unflatten(treedef, [x + 0.1 * jax.random.normal(k, x.shape, x.dtype)
                                        for x, k in zip(leaves, keys, strict=True)])


def _spec(x):
    return (tuple(x.shape), jnp.dtype(x.dtype))


def _assert_equal(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (path, a), (_, b) in zip(named_leaves(actual), named_leaves(expected), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=path)


@pytest.fixture(scope="module")
def params():
    return _random(TINY)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, params):
    file = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(file, TINY, params)
    return file


# --------------------------------------------------------------------------------------------
# Hugging Face directories.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [TINY, TIED], ids=["untied-gqa", "tied-mha"])
def test_hf_directory_round_trips_exactly(tmp_path, model):
    params = _random(model)
    written = save_hf(tmp_path, model, params)
    assert written == ["model.safetensors", "config.json", "generation_config.json"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] == model.tie_embeddings
    with safetensors.safe_open(tmp_path / "model.safetensors", framework="numpy") as f:
        names = set(f.keys())
        q = f.get_tensor("model.layers.1.self_attn.q_proj.weight")
    assert ("lm_head.weight" in names) == (not model.tie_embeddings)
    assert len(names) == 2 + 9 * model.n_layers + (not model.tie_embeddings)
    np.testing.assert_array_equal(q, np.asarray(params["layers"]["attn"]["q_proj"]["kernel"][1]).T)
    loaded_model, loaded = load_hf(tmp_path, seq_len=model.seq_len)
    assert loaded_model == model
    assert jax.tree.map(_spec, loaded) == jax.tree.map(_spec, model.abstract_params())
    _assert_equal(loaded, params)


def test_sharded_files_and_bf16_export(tmp_path, params):
    written = save_hf(tmp_path, TINY, params, dtype="bfloat16", max_shard_bytes=40_000)
    shards = [w for w in written if w.startswith("model-")]
    assert len(shards) > 3 and "model.safetensors.index.json" in written
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, loaded = load_hf(tmp_path, policy="pure_bf16", seq_len=TINY.seq_len)
    _assert_equal(loaded, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
    _, as_f32 = load_hf(tmp_path, seq_len=TINY.seq_len)  # bf16 -> f32 is exact
    _assert_equal(as_f32, jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32),
                                       params))


def test_loads_straight_onto_shardings(tmp_path, params):
    save_hf(tmp_path, TINY, params)
    mesh = make_mesh(data=2)
    shardings = param_shardings(TINY.abstract_params(), mesh, "fsdp")
    _, loaded = load_hf(tmp_path, shardings=shardings, seq_len=TINY.seq_len)
    for (path, leaf), (_, sharding) in zip(named_leaves(loaded), named_leaves(shardings),
                                           strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), path
    assert not loaded["layers"]["mlp"]["up_proj"]["kernel"].sharding.is_fully_replicated
    _assert_equal(jax.device_get(loaded), jax.device_get(params))


def _rewrite(directory, edit):
    file = directory / "model.safetensors"
    with safetensors.safe_open(file, framework="numpy") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    edit(tensors)
    safetensors.numpy.save_file(tensors, file, metadata={"format": "pt"})


def test_hf_missing_extra_and_misshaped_tensors_are_all_named(tmp_path, params):
    save_hf(tmp_path, TINY, params)

    def edit(tensors):
        del tensors["model.layers.1.mlp.up_proj.weight"]
        tensors["model.layers.2.mlp.up_proj.weight"] = np.zeros((128, 64), np.float32)
        tensors["model.norm.weight"] = np.zeros((65,), np.float32)

    _rewrite(tmp_path, edit)
    with pytest.raises(FileError) as e:
        load_hf(tmp_path)
    assert e.value.path == str(tmp_path)
    message = str(e.value)
    assert "1 tensor(s) missing: model.layers.1.mlp.up_proj.weight" in message
    assert "1 unexpected: model.layers.2.mlp.up_proj.weight" in message
    assert "model.norm.weight is (65,), expected (64,)" in message


def test_tied_checkpoint_with_a_different_head_is_refused(tmp_path):
    params = _random(TIED)
    save_hf(tmp_path, TIED, params)
    _rewrite(tmp_path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1}))
    with pytest.raises(FileError, match="differs from model.embed_tokens") as e:
        load_hf(tmp_path)
    assert e.value.path == str(tmp_path / "model.safetensors")


@pytest.mark.parametrize("field, value", [("model_type", "phi3"), ("hidden_act", "gelu"),
                                          ("attention_bias", True),
                                          ("rope_scaling", {"rope_type": "yarn", "factor": 4.0})])
def test_unsupported_architectures_name_the_field(tmp_path, params, field, value):
    save_hf(tmp_path, TINY, params)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    if field == "rope_scaling":
        del config["rope_parameters"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileError) as e:
        load_hf(tmp_path)
    assert e.value.field == field and e.value.path == str(tmp_path / "config.json")


# --------------------------------------------------------------------------------------------
# GGUF.
# --------------------------------------------------------------------------------------------


def test_gguf_loads_exactly_and_round_trips_through_hf(tmp_path, gguf_file, params):
    model, loaded = load_pretrained(gguf_file, seq_len=TINY.seq_len)
    assert model == TINY
    _assert_equal(loaded, params)  # f32 tensors, llama.cpp's Q/K permutation undone
    save_hf(tmp_path, model, loaded)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(tmp_path))
    again, reloaded = load_pretrained(tmp_path, seq_len=TINY.seq_len)
    assert again == model and again.tokenizer.spec == model.tokenizer.spec
    _assert_equal(reloaded, params)


def test_gguf_without_output_weight_is_tied(tmp_path):
    params = _random(TIED)
    write_gguf(tmp_path / "tied.gguf", TIED, params)
    model, loaded = load_gguf(tmp_path / "tied.gguf", seq_len=TIED.seq_len)
    assert model.tie_embeddings and "lm_head" not in loaded
    _assert_equal(loaded, params)


def test_quantized_gguf_is_dequantized_to_the_param_dtype(tmp_path, params):
    file = tmp_path / "q8.gguf"
    write_gguf(file, TINY, params, qtype=gguf.GGMLQuantizationType.Q8_0)
    _, loaded = load_gguf(file, seq_len=TINY.seq_len)
    # The reference: gguf's own quantize -> dequantize of each torch-layout matrix.
    q = np.asarray(params["layers"]["mlp"]["down_proj"]["kernel"][1]).T
    expected = gguf.quants.dequantize(gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
                                      gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(loaded["layers"]["mlp"]["down_proj"]["kernel"][1], expected.T)
    assert 0 < np.abs(expected - q).max() < 0.02  # quantized, and close
    _, bf16 = load_gguf(file, policy="pure_bf16", seq_len=TINY.seq_len)
    assert jax.tree.map(_spec, bf16) == jax.tree.map(_spec, TINY.abstract_params("pure_bf16"))
    assert {x.dtype for x in jax.tree.leaves(bf16)} == {jnp.dtype(jnp.bfloat16)}


def test_gguf_missing_extra_and_misshaped_tensors_are_all_named(tmp_path, params):
    file = tmp_path / "bad.gguf"
    write_gguf(file, TINY, params, drop=("blk.0.ffn_gate.weight", "output_norm.weight"),
               extra={"blk.9.attn_q.weight": np.zeros((4, 4))},
               reshape={"blk.1.attn_v.weight": (16, 64)})
    with pytest.raises(FileError) as e:
        load_gguf(file)
    assert e.value.path == str(file)
    message = str(e.value)
    assert "2 tensor(s) missing: blk.0.ffn_gate.weight, output_norm.weight" in message
    assert "1 unexpected: blk.9.attn_q.weight" in message
    assert "blk.1.attn_v.weight is (16, 64), expected (32, 64)" in message


def test_gguf_of_another_architecture_is_refused(tmp_path, params):
    file = tmp_path / "gemma.gguf"
    write_gguf(file, TINY, params, architecture="gemma")
    with pytest.raises(FileError, match="gemma.gguf: general.architecture='gemma'"):
        load_gguf(file)


def test_gguf_metadata_becomes_config_and_tokenizer(gguf_file):
    model, _ = load_gguf(gguf_file)
    assert model.seq_len == min(TINY.max_position, 2048) and model.rms_eps == 1e-5
    tok = model.tokenizer
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.pad_id, tok.add_bos) == (1, 2, 0, 2, False)
    assert tok.vocab_size == VOCAB_SIZE and tok.chat_template == CHAT_TEMPLATE
    assert load_tokenizer(gguf_file) == tok
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                       add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(rendered)
    assert ids[0] == 1 and list(ids).count(2) == 1  # special tokens stay whole


# --------------------------------------------------------------------------------------------
# Tokenizer.
# --------------------------------------------------------------------------------------------


def _texts():
    stdlib = sysconfig.get_paths()["stdlib"]
    texts = [pathlib.Path(stdlib, name).read_text(encoding="utf-8")
             for name in ("textwrap.py", "dataclasses.py")]
    return texts + ["Grüße aus Köln — naïve café, 東京, Ελληνικά, emoji 😀🚀, tabs\t\tand\r\n",
                    "  leading spaces, 1234 digits,  99 and trailing  "]


def test_tokenizer_round_trips_text_exactly(gguf_file):
    tok = load_tokenizer(gguf_file)
    for text in _texts():
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and ids.max() < VOCAB_SIZE
        assert tok.decode(ids) == text


def test_smollm_split_isolates_digits_and_gpt2_does_not(gguf_file):
    tok, gpt2 = load_tokenizer(gguf_file), load_tokenizer(gguf_file, pre="gpt2")
    one = tok.backend.token_to_id("Ġ1")
    assert one not in tok.encode(" 1 the").tolist()  # the merge "Ġ 1" never applies
    assert one in gpt2.encode(" 1 the").tolist()
    assert tok.encode(" the").tolist() == gpt2.encode(" the").tolist()


def test_tokenizer_files_round_trip(tmp_path, gguf_file):
    tok = load_tokenizer(gguf_file)
    tok.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|im_start|>" and config["chat_template"] == CHAT_TEMPLATE
    assert Tokenizer.load(tmp_path) == tok
    model = dataclasses.replace(TINY, tokenizer=tok)
    text = _texts()[-2]
    np.testing.assert_array_equal(model.encode(text.encode()), tok.encode(text))


@pytest.mark.parametrize("pre", ["smollm", "gpt2", "llama3", "qwen2"])
def test_long_texts_encode_in_parallel_pieces_to_the_same_ids(gguf_file, monkeypatch, pre):
    import effijax.models._tokenizer as tokenizer_module

    tok = load_tokenizer(gguf_file, pre=pre)
    text = "\n\n\n".join(_texts()) + "  \n\t 12\n345 x.\n\ny 6\n"
    whole = tok.backend.encode(text, add_special_tokens=False).ids
    monkeypatch.setattr(tokenizer_module, "_CHUNK_CHARS", 200)
    assert tok._splits_at_line_starts
    assert len(tokenizer_module._line_chunks(text, 200)) > 50
    assert tok.encode(text).tolist() == whole


def test_tokenizers_of_unknown_splits_are_encoded_whole(tmp_path, gguf_file):
    spec = json.loads(load_tokenizer(gguf_file).spec)
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first",
                             "split": True}
    assert not Tokenizer(spec=json.dumps(spec))._splits_at_line_starts
