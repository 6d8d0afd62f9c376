"""KV-cached generation: the cached forward pass equals the full one, and what is built on it.

The cached decode step (``model.decode_fn``) gives the full forward pass's logits at every
position (f32) for the Llama (grouped-query attention) and the GPT, with and without LoRA
adapters; greedy generation equals the argmax rollout of the full forward pass; adapters applied
factored generate what the merged model generates; sampling is reproducible and a tiny top-p is
greedy; an EOS stops a row; generating N tokens compiles the step once. ``effijax generate``
runs on a tiny GGUF with a chat template and on training runs (full and LoRA).
"""

import functools
import os
import pathlib
import re
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _adapters import random_adapters
from _run_env import compiles_as_the_suite

from effijax import lora
from effijax.errors import ConfigError
from effijax.generate import generate, load, sample, top_p_mask
from effijax.models import LlamaConfig, gpt_config, llama_config

REPO = pathlib.Path(__file__).resolve().parents[1]
# f32 logits of magnitude ~2 through two layers of 3x-scaled weights (sharp softmaxes): the
# cached and the full pass differ only in the order of their reductions (matmuls of 2 rows
# against 48, softmaxes over 32 positions against 24). Measured: 2.4e-6 at most, with and
# without adapters, on AVX-512 and with XLA held to AVX2, AVX and SSE4.2 (the adapters of
# ADAPTER_SCALE still move the logits by 2.5); a wrong mask or position moves them by ~0.1.
ATOL = 5e-5
# Adapters twice this size triple the effective weights, saturate the softmaxes and amplify
# rounding 15x (3.3e-5 on one host, 6.6e-5 on another): a test of rounding luck, not of the
# cache.
ADAPTER_SCALE = 0.1


def _scaled(params, factor=3.0):
    """Random parameters with visible logits (matrices scaled up): greedy rollouts vary."""
    return jax.tree.map(lambda x: x * factor if x.ndim > 1 else x, params)


MODELS = {
    "llama-gqa": llama_config("llama-tiny", seq_len=32),  # 4 query heads, 2 kv heads
    "gpt": gpt_config("tiny", seq_len=32),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model_params(request):
    model = MODELS[request.param]
    return model, _scaled(model.init_params(jax.random.key(0)))


@functools.cache
def _decode_jit(model, spec=None):
    return jax.jit(model.decode_fn(spec))


def _cached_logits(model, params, tokens_BS, prefill, spec=None):
    """Logits of a prefill of ``prefill`` tokens, then one token per step, concatenated."""
    decode = _decode_jit(model, spec)
    cache = model.init_cache(tokens_BS.shape[0], model.seq_len)
    logits, cache = decode(params, cache, tokens_BS[:, :prefill], jnp.int32(0))
    out = [logits]
    for i in range(prefill, tokens_BS.shape[1]):
        logits, cache = decode(params, cache, tokens_BS[:, i:i + 1], jnp.int32(i))
        out.append(logits)
    return jnp.concatenate(out, axis=1)


@pytest.mark.parametrize("with_lora", [False, True], ids=["base", "lora"])
def test_cached_decoding_gives_the_full_forward_logits_at_every_position(model_params,
                                                                         with_lora):
    model, params = model_params
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, model.vocab_size)
    spec = None
    if with_lora:
        spec = lora.LoraSpec(rank=4, alpha=8.0, targets=model.lora_targets)
        adapters = random_adapters(params, spec, seed=7, scale=ADAPTER_SCALE)
        params = {"base": params, "adapters": adapters}
    full = _logits_jit(model, spec)(params, tokens)
    cached = _cached_logits(model, params, tokens, prefill=16, spec=spec)
    assert cached.dtype == jnp.float32 and cached.shape == full.shape
    assert float(jnp.abs(full).max()) > 1.0  # logits worth comparing
    np.testing.assert_allclose(cached, full, atol=ATOL, rtol=0)
    # The prefill's logits at one position only (a padded prompt's last real token).
    cache = model.init_cache(2, model.seq_len)
    last, _ = _decode_jit(model, spec)(params, cache, tokens[:, :16], jnp.int32(0), jnp.int32(9))
    assert last.shape == (2, 1, model.vocab_size)
    np.testing.assert_allclose(last[:, 0], full[:, 9], atol=ATOL, rtol=0)


@functools.cache
def _logits_jit(model, spec=None):
    return jax.jit(model.logits_fn(spec))


def _rollout(model, params, prompt, n, spec=None):
    """Greedy decoding by the full forward pass (no cache): argmax at the last real position
    of one fixed-length window (causal: the padding after it changes nothing)."""
    ids = list(prompt)
    window = np.zeros((1, model.seq_len), np.int32)
    for _ in range(n):
        window[0, :len(ids)] = ids
        logits = _logits_jit(model, spec)(params, jnp.asarray(window))
        ids.append(int(jnp.argmax(logits[0, len(ids) - 1])))
    return ids[len(prompt):]


def test_greedy_generation_is_the_argmax_rollout_of_the_full_forward_pass(model_params):
    model, params = model_params
    prompt = [3, 1, 4, 1, 5, 9, 2]
    out = generate(model, params, prompt, max_new_tokens=12)
    expected = _rollout(model, params, prompt, 12)
    assert len(set(expected)) > 2  # not a degenerate repeat
    assert out.tokens[0].tolist() == expected
    assert out.lengths.tolist() == [12] and not out.finished.any()
    assert out.prompt_tokens == 7


@pytest.mark.parametrize("unroll", [False, True], ids=["scanned", "unrolled"])
def test_adapters_without_merging_generate_what_the_merged_model_generates(unroll):
    model = MODELS["llama-gqa"]
    params = _scaled(model.init_params(jax.random.key(2)))
    spec = lora.LoraSpec(rank=4, alpha=8.0, targets=model.lora_targets)
    adapters = random_adapters(params, spec, seed=3, scale=0.2)
    prompt = [10, 20, 30, 40]
    factored = generate(model, {"base": params, "adapters": adapters}, prompt,
                        max_new_tokens=10, lora=spec, unroll_layers=unroll)
    merged = generate(model, lora.merge(params, adapters, spec), prompt, max_new_tokens=10,
                      unroll_layers=unroll)
    base = generate(model, params, prompt, max_new_tokens=10)
    assert factored.tokens.tolist() == merged.tokens.tolist()
    assert factored.tokens.tolist() != base.tokens.tolist()  # the adapters matter
    assert base.tokens[0].tolist() == _rollout(model, params, prompt, 10)
    if unroll:  # the unrolled decode step over one buffer per layer: the same tokens
        assert generate(model, params, prompt, max_new_tokens=10,
                        unroll_layers=True).tokens.tolist() == base.tokens.tolist()


def test_sampling_is_reproducible_and_a_tiny_top_p_is_greedy(model_params):
    model, params = model_params
    prompt = np.array([[5, 6, 7], [8, 9, 10]])  # a batch of two
    kw = dict(max_new_tokens=10, temperature=1.5)
    a = generate(model, params, prompt, seed=1, **kw)
    b = generate(model, params, prompt, seed=1, **kw)
    c = generate(model, params, prompt, seed=2, **kw)
    greedy = generate(model, params, prompt, max_new_tokens=10)
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.tokens.tolist() != c.tokens.tolist()
    assert a.tokens.tolist() != greedy.tokens.tolist()
    assert greedy.tokens[1].tolist() == _rollout(model, params, [8, 9, 10], 10)
    tiny = generate(model, params, prompt, seed=1, top_p=1e-6, **kw)
    assert tiny.tokens.tolist() == greedy.tokens.tolist()


def test_top_p_keeps_the_smallest_set_holding_the_mass():
    probs = jnp.array([[0.1, 0.4, 0.2, 0.3]])
    logits = jnp.log(probs)
    assert top_p_mask(logits, jnp.float32(0.5)).tolist() == [[False, True, False, True]]
    assert top_p_mask(logits, jnp.float32(0.71)).tolist() == [[False, True, True, True]]
    assert top_p_mask(logits, jnp.float32(1.0)).tolist() == [[True] * 4]
    # Sampling with top_p=0.5 only ever draws tokens 1 and 3, about 4:3.
    keys = jax.random.split(jax.random.key(0), 2000)
    draws = jax.vmap(lambda k: sample(logits, k, jnp.float32(1.0), jnp.float32(0.5))[0])(keys)
    counts = np.bincount(np.asarray(draws), minlength=4)
    assert counts[0] == counts[2] == 0
    assert abs(counts[1] / 2000 - 4 / 7) < 0.05


def test_generation_stops_at_end_of_sequence(model_params):
    model, params = model_params
    prompt = [3, 1, 4, 1, 5, 9, 2]
    free = generate(model, params, prompt, max_new_tokens=12).tokens[0].tolist()
    eos = free[4]
    stop = free.index(eos)  # the first time it appears
    out = generate(model, params, prompt, max_new_tokens=12, eos_id=eos)
    assert out.finished.tolist() == [True] and out.lengths.tolist() == [stop]
    assert out.tokens.shape == (1, stop + 1)  # the loop ended at the EOS
    assert out.tokens[0, :stop].tolist() == free[:stop]
    # In a batch, a finished row repeats its EOS while the other goes on.
    batch = np.array([prompt, [7, 7, 7, 7, 7, 7, 7]])
    both = generate(model, params, batch, max_new_tokens=12, eos_id=[eos])
    assert both.tokens[0, :stop].tolist() == free[:stop]
    assert set(both.tokens[0, stop:].tolist()) <= {eos}


def test_generating_n_tokens_compiles_one_prefill_and_one_decode_step(monkeypatch):
    model = llama_config("llama-tiny", seq_len=32, d_ff=96)  # shapes no other test compiles
    params = model.init_params(jax.random.key(4))
    counted = chex.assert_max_traces(model.decode_fn(), n=2)  # prefill + decode step
    monkeypatch.setattr(LlamaConfig, "decode_fn", lambda self, spec=None: counted)
    first = generate(model, params, [1, 2, 3], max_new_tokens=20)
    assert first.tokens.shape == (1, 20) and first.compile_s > 0
    again = generate(model, params, [4, 5, 6, 7], max_new_tokens=20, temperature=0.7, top_p=0.9)
    assert again.compile_s == 0.0  # same bucket and cache: nothing compiled, nothing traced


# --------------------------------------------------------------------------------------------
# Prompts of different lengths in one batch: left padding with per-row positions and masks.
# --------------------------------------------------------------------------------------------

RAGGED = [[3, 1, 4], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4], [9, 9, 8, 7, 6, 5, 1]]


def _with_adapters(model, params, with_lora):
    if not with_lora:
        return params, None
    spec = lora.LoraSpec(rank=4, alpha=8.0, targets=model.lora_targets)
    adapters = random_adapters(params, spec, seed=7, scale=ADAPTER_SCALE)
    return {"base": params, "adapters": adapters}, spec


@pytest.mark.parametrize("with_lora", [False, True], ids=["base", "lora"])
def test_cached_logits_of_left_padded_rows_equal_the_full_forward_pass(model_params, with_lora):
    model, params = model_params
    params, spec = _with_adapters(model, params, with_lora)
    extra = [[5, 6, 7, 8], [11, 3, 2, 9], [1, 1, 12, 4]]  # fed one per step after the prefill
    lengths = [len(p) for p in RAGGED]
    padded = 16
    tokens = np.zeros((3, padded), np.int32)
    for b, prompt in enumerate(RAGGED):
        tokens[b, padded - len(prompt):] = prompt
    decode = _decode_jit(model, spec)
    cache = model.init_cache(3, model.seq_len)
    cache = cache._replace(pad_B=jnp.asarray([padded - n for n in lengths], jnp.int32))
    prefill, cache = decode(params, cache, jnp.asarray(tokens), jnp.int32(0))
    steps = []
    for i in range(4):
        column = jnp.asarray([[row[i]] for row in extra], jnp.int32)
        logits, cache = decode(params, cache, column, jnp.int32(padded + i))
        steps.append(logits[:, 0])
    window = np.zeros((3, model.seq_len), np.int32)  # unpadded, causal: the tail is unseen
    for b, prompt in enumerate(RAGGED):
        window[b, :lengths[b] + 4] = prompt + extra[b]
    full = _logits_jit(model, spec)(params, jnp.asarray(window))
    assert float(jnp.abs(full).max()) > 1.0
    for b, n in enumerate(lengths):
        cached = jnp.concatenate([prefill[b, padded - n:], jnp.stack([s[b] for s in steps])])
        np.testing.assert_allclose(cached, full[b, :n + 4], atol=ATOL, rtol=0)


@pytest.mark.parametrize("with_lora", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["base", "lora"])
def test_prompts_of_different_lengths_generate_what_each_generates_alone(model_params,
                                                                         with_lora):
    model, params = model_params
    params, spec = _with_adapters(model, params, with_lora)
    batch = generate(model, params, RAGGED, max_new_tokens=8, lora=spec)
    assert batch.tokens.shape == (3, 8) and batch.prompt_lengths.tolist() == [3, 11, 7]
    assert batch.prompt_tokens == 11
    alone = [generate(model, params, prompt, max_new_tokens=8, lora=spec).tokens[0].tolist()
             for prompt in RAGGED]
    assert batch.tokens.tolist() == alone
    assert [o.tolist() for o in batch.outputs] == alone
    assert len({tuple(row) for row in alone}) == 3  # the rows differ: each kept its own prompt
    # ... and alone, each is the full forward pass's argmax rollout of its unpadded prompt.
    assert alone == [_rollout(model, params, prompt, 8, spec) for prompt in RAGGED]
    # A 2-D array of prompts of one length is a batch too, and a NumPy row works like a list.
    same = generate(model, params, np.array([RAGGED[0], RAGGED[0][::-1]]), max_new_tokens=8,
                    lora=spec)
    assert same.tokens[0].tolist() == alone[0]
    mixed = generate(model, params, [np.array(RAGGED[2]), RAGGED[0]], max_new_tokens=8,
                     lora=spec)
    assert mixed.tokens.tolist() == [alone[2], alone[0]]


def test_each_row_stops_at_its_end_of_sequence(model_params):
    model, params = model_params
    free = generate(model, params, RAGGED[:2], max_new_tokens=12).tokens.tolist()
    eos = [free[0][3], free[1][6]]
    stops = [min((row.index(e) for e in eos if e in row), default=12) for row in free]
    assert stops[0] <= 3 and stops[1] <= 6 and stops[0] != stops[1]
    out = generate(model, params, RAGGED[:2], max_new_tokens=12, eos_id=eos)
    assert out.lengths.tolist() == stops and out.finished.tolist() == [True, True]
    assert out.tokens.shape == (2, max(stops) + 1)  # the loop ended when both rows had
    for b, stop in enumerate(stops):
        assert out.tokens[b, :stop].tolist() == free[b][:stop]
        assert out.outputs[b].tolist() == free[b][:stop]
        assert set(out.tokens[b, stop:].tolist()) == {free[b][stop]}  # its EOS, repeated


def test_sampled_rows_are_reproducible_and_independent_of_the_other_prompts(model_params):
    model, params = model_params
    kw = dict(max_new_tokens=10, temperature=1.5, seed=3)
    a = generate(model, params, [RAGGED[0], RAGGED[1]], **kw).tokens
    b = generate(model, params, [RAGGED[0], RAGGED[2]], **kw).tokens
    alone = generate(model, params, RAGGED[0], **kw).tokens
    assert a[0].tolist() == b[0].tolist() == alone[0].tolist()
    assert a.tolist() == generate(model, params, [RAGGED[0], RAGGED[1]], **kw).tokens.tolist()
    twice = generate(model, params, [RAGGED[1], RAGGED[1]], **kw).tokens
    assert twice[0].tolist() != twice[1].tolist()  # one prompt twice: two samples
    greedy = generate(model, params, [RAGGED[1], RAGGED[1]], max_new_tokens=10).tokens
    assert greedy[0].tolist() == greedy[1].tolist()


def test_a_new_mix_of_prompt_lengths_compiles_nothing(monkeypatch):
    model = llama_config("llama-tiny", seq_len=32, d_ff=80)  # shapes no other test compiles
    params = model.init_params(jax.random.key(6))
    counted = chex.assert_max_traces(model.decode_fn(), n=2)  # prefill + decode step
    monkeypatch.setattr(LlamaConfig, "decode_fn", lambda self, spec=None: counted)
    first = generate(model, params, [[1, 2, 3], list(range(1, 10))], max_new_tokens=20)
    assert first.tokens.shape == (2, 20) and first.compile_s > 0
    again = generate(model, params, [list(range(4, 16)), [7, 6, 5, 4, 3]], max_new_tokens=20,
                     temperature=0.7)
    assert again.compile_s == 0.0 and again.prompt_lengths.tolist() == [12, 5]


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt=list(range(250)), max_new_tokens=10), "max_new_tokens"),
    (dict(prompt=[1, 2], top_p=0.0), "top_p"),
    (dict(prompt=[1, 2], temperature=-1.0), "temperature"),
    (dict(prompt=[1, 999]), "prompt"),
    (dict(prompt=[], max_new_tokens=3), "prompt"),
    (dict(prompt=[1, 2], max_new_tokens=0), "max_new_tokens"),
    (dict(prompt=[[1, 2], list(range(250))], max_new_tokens=10), "max_new_tokens"),
    (dict(prompt=[[1, 2], []]), "prompt"),
    (dict(prompt=[[1, 2], [3, 999]]), "prompt"),
    (dict(prompt=[[1, 2], 3]), "prompt"),
    (dict(prompt="some text"), "prompt"),
    (dict(prompt=[[1.5, 2.0]]), "prompt"),
], ids=["too-long", "top-p", "temperature", "out-of-vocabulary", "empty", "no-tokens",
        "longest-too-long", "an-empty-prompt", "a-prompt-out-of-vocabulary", "ids-and-lists",
        "text", "floats"])
def test_bad_arguments_fail_before_compiling(kwargs, field):
    model = llama_config("llama-tiny")  # context 256
    params = jax.eval_shape(lambda: model.init_params(jax.random.key(0)))
    prompt = kwargs.pop("prompt")
    with pytest.raises(ConfigError) as e:
        generate(model, params, prompt, **kwargs)
    assert e.value.field == field


# --------------------------------------------------------------------------------------------
# Models on disk: a tiny GGUF with a tokenizer and chat template, training runs, the CLI.
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    pytest.importorskip("gguf", reason="GGUF files need the gguf package")
    from _llama_files import VOCAB_SIZE, write_gguf

    model = llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=32)
    params = _scaled(model.init_params(jax.random.key(5)), 4.0)
    file = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(file, model, params)
    return file


def test_load_a_gguf_and_complete_text_and_chat(tiny_gguf):
    pytest.importorskip("jinja2", reason="chat templates need jinja2")
    loaded = load(str(tiny_gguf))
    assert loaded.tokenizer is not None and loaded.eos_id == 2 and loaded.lora is None
    out = loaded.complete("the thin", max_new_tokens=8)
    ids = loaded.encode("the thin")
    expected = _rollout(loaded.model, loaded.params, ids.tolist(), 8)
    stop = expected.index(2) if 2 in expected else 8
    assert out.text == loaded.decode(expected[:stop])
    chat = loaded.complete("hi", chat=True, max_new_tokens=4)
    assert chat.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert chat.generation.prompt_tokens == len(loaded.encode(chat.prompt))
    with pytest.raises(ConfigError, match="model_from='nowhere': no such run directory"):
        load("nowhere")


def test_load_renders_chat_with_a_template_file_instead_of_the_models(tiny_gguf, tmp_path):
    pytest.importorskip("jinja2", reason="chat templates need jinja2")
    turns = tmp_path / "turns.jinja"
    turns.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                     "{% if add_generation_prompt %}<assistant>{% endif %}")
    loaded = load(str(tiny_gguf), chat_template=str(turns))
    assert loaded.chat_prompt("hi") == "<user>hi<assistant>"
    assert loaded.model.tokenizer is loaded.tokenizer
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError) as e:
        load(str(tiny_gguf), chat_template=str(broken))
    assert e.value.field == "chat_template"


def test_a_reply_streams_as_it_is_decoded(tiny_gguf, monkeypatch):
    from effijax.generate import _load

    loaded = load(str(tiny_gguf))
    events, real = [], _load.generate

    def logged(*args, on_tokens=None, **kwargs):  # each step's tokens, as generate gives them
        def step(tokens_B):
            events.append(("step", int(tokens_B[0])))
            on_tokens(tokens_B)
        return real(*args, on_tokens=step, **kwargs)

    monkeypatch.setattr(_load, "generate", logged)
    out = loaded.complete("the thin", max_new_tokens=8,
                          on_text=lambda piece: events.append(("text", piece)))
    steps = [i for i, (kind, _) in enumerate(events) if kind == "step"]
    texts = [i for i, (kind, _) in enumerate(events) if kind == "text"]
    assert [t for kind, t in events if kind == "step"] == out.generation.tokens[0].tolist()
    assert "".join(p for kind, p in events if kind == "text") == out.text != ""
    assert len(texts) > 1 and texts[0] < steps[-1], events  # pieces come between the steps


def test_cli_streams_what_no_stream_prints_whole(tiny_gguf, capsys, monkeypatch):
    from effijax.cli import main

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a person at a terminal
    argv = ["generate", "--from", str(tiny_gguf), "--prompt", "the thin", "--max-new-tokens",
            "6"]
    assert main(argv) == 0
    streamed = capsys.readouterr()
    assert main([*argv, "--no-stream"]) == 0
    whole = capsys.readouterr()
    assert streamed.out == whole.out == load(str(tiny_gguf)).complete(
        "the thin", max_new_tokens=6).text + "\n"
    for err in (streamed.err, whole.err):  # every wait said on stderr, before it starts
        lines = err.splitlines()
        assert lines[0] == f"effijax generate: loading {tiny_gguf}", lines
        assert lines[1].startswith("effijax generate: loaded in ") and "compiling" in lines[1]


def _cli(*args, timeout=300):
    env = compiles_as_the_suite({**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"})
    return subprocess.run([sys.executable, "-m", "effijax", "generate", *args],
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_cli_generates_from_a_gguf(tiny_gguf):
    pytest.importorskip("jinja2", reason="chat templates need jinja2")
    proc = _cli("--from", str(tiny_gguf), "--prompt", "the thin", "--max-new-tokens", "6",
                "--verbose")
    assert proc.returncode == 0, proc.stderr
    loaded = load(str(tiny_gguf))
    expected = loaded.complete("the thin", max_new_tokens=6).text
    assert proc.stdout == expected + "\n"
    assert "tokens/s" in proc.stderr and "compile" in proc.stderr and "prefill" in proc.stderr
    assert re.search(r", KV cache \d[\d.]* (B|KB|MB)\n", proc.stderr), proc.stderr
    chat = _cli("--from", str(tiny_gguf), "--prompt", "hi", "--chat",
                "--max-new-tokens", "4", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == loaded.complete("hi", chat=True, max_new_tokens=4, temperature=0.8,
                                          top_p=0.9, seed=3).text + "\n"


def test_cli_generates_several_prompts_as_json_lines(tiny_gguf, tmp_path, capsys):
    """``effijax generate`` called in this process (the program's own start is the test
    above's): its standard output is one JSON line a prompt."""
    import json

    from effijax.cli import main

    file = tmp_path / "prompts.jsonl"
    file.write_text('{"prompt": "the"}\n\n"thin in the thin the"\n')
    assert main(["generate", "--from", str(tiny_gguf), "--prompt", "the thin", "--prompt",
                 "in the thin the thin in", "--prompts-file", str(file),
                 "--max-new-tokens", "6"]) == 0
    proc = capsys.readouterr()
    prompts = ["the thin", "in the thin the thin in", "the", "thin in the thin the"]
    loaded = load(str(tiny_gguf))
    assert len({len(loaded.encode(p)) for p in prompts}) == 4
    records = [json.loads(line) for line in proc.out.splitlines()]
    assert records == [{"prompt": p, "completion": loaded.complete(p, max_new_tokens=6).text}
                       for p in prompts]
    assert "4 prompts" in proc.err and "tokens/s" in proc.err
    text = tmp_path / "prompts.txt"  # a text file: one prompt per line
    text.write_text("the thin\n\nin the\n")
    from effijax.cli._generate import read_prompts

    assert read_prompts(str(text)) == ["the thin", "in the"]


@pytest.mark.parametrize("content, message", [
    ("", "holds no prompts"),
    ('{"prompt": "a"}\n{"text": "b"}\n', 'line 2: expected a JSON string or an object'),
    ('"a"\nnot json\n', "line 2 is not JSON"),
])
def test_a_bad_prompts_file_fails_before_loading(content, message, tmp_path, capsys):
    from effijax.cli import main

    file = tmp_path / "prompts.jsonl"
    file.write_text(content)
    assert main(["generate", "--from", "smollm2", "--prompts-file", str(file)]) == 2
    err = capsys.readouterr().err
    assert f"--prompts-file='{file}'" in err and message in err


@pytest.mark.parametrize("flags, message", [
    (["--from", "smollm2"], "give a prompt (--prompt TEXT"),
    (["--from", "smollm2", "--prompts-file", "/no/such/file"],
     "--prompts-file='/no/such/file': no such file"),
    (["--from", "/no/such/run", "--prompt", "x"], "--from='/no/such/run': no such"),
    (["--from", "smollm2", "--prompt", "x", "--top-p", "0"], "--top-p=0.0: must be in"),
    (["--from", "smollm2", "--prompt", "x", "--max-new-tokens", "0"],
     "--max-new-tokens=0: must be an integer >= 1"),
    (["--from", "smollm2", "--prompt", "x", "--system", "s"], "only applies with --chat"),
])
def test_cli_bad_flags_fail_before_loading(flags, message, capsys):
    from effijax.cli import main

    assert main(["generate", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_gguf):
    """A full fine-tuning run and a LoRA run of the tiny GGUF (3 steps each)."""
    from effijax.recipe import TrainConfig, train

    root = tmp_path_factory.mktemp("runs")
    data = root / "corpus.txt"
    data.write_text("".join(f"the thin {i} in the {i}\n" for i in range(300)))
    common = dict(model_from=str(tiny_gguf), seq_len=16, batch_size=2, eval_batches=1,
                  progress=False, steps=3, data=str(data), lr=3e-3)
    train(TrainConfig(out=str(root / "full"), **common))
    train(TrainConfig(out=str(root / "lora"), lora_rank=2, **common))
    return root / "full", root / "lora"


@pytest.mark.slow
def test_runs_load_with_their_tokenizer_and_adapters(runs, tiny_gguf):
    full, lora_run = runs
    loaded = load(str(full))
    assert loaded.tokenizer is not None and loaded.lora is None  # from the GGUF it started from
    assert "step 3" in loaded.source
    base = load(str(tiny_gguf))
    assert jax.tree.structure(loaded.params) == jax.tree.structure(base.params)
    changed = jax.tree.map(lambda a, b: bool((a != b).any()), loaded.params, base.params)
    assert any(jax.tree.leaves(changed))  # trained parameters, not the GGUF's
    prompt = loaded.encode("the thin")
    out = generate(loaded.model, loaded.params, prompt, max_new_tokens=6)
    assert out.tokens[0].tolist() == _rollout(loaded.model, loaded.params, prompt.tolist(), 6)

    adapted = load(str(lora_run))
    assert adapted.lora is not None and adapted.lora.rank == 2
    assert set(adapted.params) == {"base", "adapters"}
    chex.assert_trees_all_equal(adapted.params["base"], base.params)
    merged = lora.merge(adapted.params["base"], adapted.params["adapters"], adapted.lora)
    factored = generate(adapted.model, adapted.params, prompt, max_new_tokens=6,
                        lora=adapted.lora)
    assert factored.tokens.tolist() == generate(adapted.model, merged, prompt,
                                                max_new_tokens=6).tokens.tolist()
    proc = _cli("--from", str(lora_run), "--prompt", "the thin", "--max-new-tokens", "6")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == adapted.complete("the thin", max_new_tokens=6).text + "\n"


# --------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct against transformers' generate on the same GGUF.
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_transformers, one_torch_thread):
    """SmolLM2 loaded by effijax and by ``transformers`` from the same GGUF (f32); torch on one
    thread for the rest of the module (conftest's ``one_torch_thread``: its greedy continuations
    took 14 s of CPU on 2 threads under load)."""
    torch, reference = smollm2_transformers
    return load("smollm2"), reference, torch


def _transformers_greedy(reference, torch, ids, n):
    with torch.no_grad():
        out = reference.generate(torch.tensor(ids[None].astype(np.int64)), max_new_tokens=n,
                                 do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


@pytest.mark.slow
@pytest.mark.optimized  # a real model against transformers (logits, greedy ids)
def test_smollm2_greedy_generation_matches_transformers_generate(smollm2):
    loaded, reference, torch = smollm2
    prompt = "The capital of France is"
    ids = loaded.encode(prompt)
    ours = generate(loaded.model, loaded.params, ids, max_new_tokens=16)
    assert loaded.decode(ours.tokens[0]).startswith(" Paris.")
    assert ours.tokens[0].tolist() == _transformers_greedy(reference, torch, ids, 16)
    # The chat template and the EOS: a short answer that ends by itself.
    chat = loaded.complete("What is the capital of France? Answer in one word.", chat=True,
                           max_new_tokens=24)
    assert chat.generation.finished[0] and "Paris" in chat.text


@pytest.mark.slow
@pytest.mark.optimized  # a real model against transformers (logits, greedy ids)
def test_smollm2_prompts_of_different_lengths_match_transformers_generate_alone(smollm2):
    loaded, reference, torch = smollm2
    prompts = ["The capital of France is", "Water boils at a temperature of",
               "Once upon a time, in a small village by the sea, there lived an old fisherman "
               "who"]
    ids = [loaded.encode(p) for p in prompts]
    assert len({len(i) for i in ids}) == 3
    batch = generate(loaded.model, loaded.params, ids, max_new_tokens=12)
    for row, prompt_ids in zip(batch.tokens.tolist(), ids, strict=True):
        assert row == _transformers_greedy(reference, torch, prompt_ids, 12)
    texts = [c.text for c in loaded.complete_batch(prompts, max_new_tokens=12)]
    assert texts[0].startswith(" Paris")
