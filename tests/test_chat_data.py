"""Fine-tuning data through a model's tokenizer: documents joined with the end-of-text token,
chat / instruction JSONL rendered with the chat template and masked to the assistant's tokens,
packed rows batched as a pure function of (seed, step), the masked loss in training and
evaluation, and `effijax eval`."""

import dataclasses
import functools
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from _compiles import compiles
from _llama_files import VOCAB_SIZE, chat_tokenizer, write_gguf, write_qa
from _run_env import compiles_as_the_suite

from effijax.cli import main as cli_main
from effijax.data import (
    batch_at,
    encode_documents,
    eval_batches,
    load_corpus,
    pack_examples,
    packed_batch,
    read_records,
    render_chat,
    split_corpus,
    split_records,
)
from effijax.errors import ConfigError
from effijax.models import gpt_config, llama_config
from effijax.recipe import evaluate, evaluate_model, init_state, plan_job
from effijax.sources import load_dataset

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEQ = 64
TINY = llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=SEQ)
EOT, IM_START, IM_END = 0, 1, 2  # the tiny vocabulary's specials


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return dataclasses.replace(TINY, tokenizer=tok)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A folder with a 40-record JSONL (half prompt/response, half messages)."""
    d = tmp_path_factory.mktemp("chat")
    write_qa(d / "qa.jsonl")
    return d


@pytest.fixture(scope="module")
def gguf(files):
    """llama-tiny with the tiny tokenizer and template as a GGUF file, next to the JSONL."""
    write_gguf(files / "tiny.gguf", TINY, jax.jit(TINY.init_params)(jax.random.key(0)))
    return files


def _messages():
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the 1"},
            {"role": "assistant", "content": "in the"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "the end"}]


# Documents -----------------------------------------------------------------------------------

def test_documents_are_tokenized_alone_and_joined_with_end_of_text(tmp_path, tok, model):
    texts = ["the thin\n" * 300, "in the\n" * 400, "1 the 22\n" * 200]
    for i, text in enumerate(texts):
        (tmp_path / f"doc{i}.txt").write_text(text)
    want = np.concatenate([np.append(tok.encode(t), EOT) for t in texts])
    np.testing.assert_array_equal(encode_documents(tok, [t.encode() for t in texts]), want)
    data = load_dataset(str(tmp_path), model)
    assert data.format == "text" and not data.masked
    np.testing.assert_array_equal(np.concatenate([data.train, data.val]), want)
    assert int(np.sum(want == EOT)) == 3 and data.tokens == len(want)


def test_the_byte_gpt_reads_the_corpus_as_before(tmp_path):
    (tmp_path / "a.txt").write_text("abc " * 100)
    (tmp_path / "b.txt").write_text("xyz " * 100)
    data = load_dataset(str(tmp_path), gpt_config("tiny", seq_len=16))
    train, val = split_corpus(load_corpus(str(tmp_path)))
    assert data.format == "bytes" and data.train.dtype == np.uint8
    np.testing.assert_array_equal(data.train, train)
    np.testing.assert_array_equal(data.val, val)


# Chat rendering and masks --------------------------------------------------------------------

def test_chat_is_the_template_tokenized_whole_and_the_mask_is_the_assistant_turns(tok):
    messages = _messages()
    ids, mask = render_chat(tok, messages)
    assert tok.decode(ids) == tok.apply_chat_template(messages)
    # Expected by hand: the template's pieces, encoded one by one (they meet at specials and
    # newlines, so the whole text tokenizes to their concatenation).
    pieces = [("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nthe 1<|im_end|>\n"
               "<|im_start|>assistant\n", 0), ("in the<|im_end|>", 1),
              ("\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", 0),
              ("the end<|im_end|>", 1), ("\n", 0)]
    want_ids = np.concatenate([tok.encode(p) for p, _ in pieces])
    want_mask = np.concatenate([np.full(len(tok.encode(p)), m) for p, m in pieces])
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(mask, want_mask)
    assert tok.decode(ids[mask == 1]) == "in the<|im_end|>the end<|im_end|>"


def test_packing_keeps_examples_whole_and_pads_untrained(tok):
    examples = [render_chat(tok, [{"role": "user", "content": "the" * k},
                                  {"role": "assistant", "content": "in"}]) for k in (1, 2, 3)]
    lengths = [len(ids) for ids, _ in examples]
    packed = pack_examples(examples, lengths[0] + lengths[1] - 1, pad_id=IM_END)
    assert len(packed) == 2 and packed.truncated == 0  # 1 and 2 share a row, 3 starts the next
    np.testing.assert_array_equal(packed.tokens_NW[0], np.concatenate([examples[0][0],
                                                                       examples[1][0]]))
    np.testing.assert_array_equal(packed.mask_NW[1, lengths[2]:], 0)
    np.testing.assert_array_equal(packed.tokens_NW[1, lengths[2]:], IM_END)
    assert packed.filled == sum(lengths)
    short = pack_examples(examples, 9, pad_id=IM_END)
    assert len(short) == 3 and short.truncated == 3


@pytest.mark.parametrize("line, problem", [
    ('{"prompt": "a"}', r"keys \['prompt'\]"),
    ('{"prompt": "a", "response": 3}', r'"response" must be a string'),
    ('{"messages": [{"role": "user", "content": "a"}]}', 'no message has role "assistant"'),
    ('{"messages": [{"role": "user", "text": "a"}]}', r"messages\[0\] must be"),
    ('{"messages": []}', "non-empty list"),
    ("[1, 2]", "a JSON list, not an object"),
    ('{"prompt": "a", "response": "b"', "not JSON"),
])
def test_bad_records_are_refused_with_file_and_line(tmp_path, line, problem):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "q", "response": "r"}\n\n' + line + "\n")
    with pytest.raises(ConfigError, match=problem) as e:
        read_records(f)
    assert e.value.field == "data" and e.value.value == f"{f}:3"


def test_the_held_out_records_depend_on_their_content_only(files):
    records = read_records(files / "qa.jsonl")
    train, val = split_records(records)
    assert len(val) == 2 and len(train) == 38
    train2, val2 = split_records(records[::-1])
    assert {r.raw for r in val2} == {r.raw for r in val}
    assert not {r.raw for r in val} & {r.raw for r in train}


def test_chat_data_needs_a_chat_template(files):
    with pytest.raises(ConfigError, match="qa.jsonl': chat records need a model with a "
                       "tokenizer and a chat template, and tiny GPT has no tokenizer"):
        load_dataset(str(files / "qa.jsonl"), gpt_config("tiny", seq_len=16))


def test_make_example_writes_checkable_standard_library_records(tmp_path, capsys):
    import inspect
    import shlex
    import textwrap

    from effijax.cli import main

    out = tmp_path / "new" / "qa.jsonl"
    assert main(["data", "make-example", str(out)]) == 0
    records = read_records(out)
    assert len(records) > 200 and "wrote" in capsys.readouterr().out
    by_prompt = {r.messages[0]["content"]: r.messages[1]["content"] for r in records}
    assert by_prompt["What is the signature of textwrap.dedent?"] == \
        f"textwrap.dedent{inspect.signature(textwrap.dedent)}"
    assert by_prompt["In one line, what does shlex.quote do?"] == \
        inspect.getdoc(shlex.quote).splitlines()[0]
    assert main(["data", "make-example", str(tmp_path / "x.jsonl"), "--modules", "nope"]) == 2


def test_the_instruction_set_is_the_same_in_every_process():
    """No answer shows a memory address (``shutil.move``'s default ``copy2`` would), so two
    interpreters write the same records: the same data hash, split and learnable answers."""
    code = "import json; from effijax.data import stdlib_qa; print(json.dumps(stdlib_qa()))"
    root = pathlib.Path(__file__).resolve().parents[1]
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, cwd=root).stdout for _ in range(2)]
    assert runs[0] == runs[1]
    records = json.loads(runs[0])
    assert not [r for r in records if " at 0x" in r["response"]]
    assert "What is the signature of shutil.copy?" in {r["prompt"] for r in records}
    assert "What is the signature of shutil.move?" not in {r["prompt"] for r in records}


# Batches -------------------------------------------------------------------------------------

def test_packed_batches_are_pure_in_seed_and_step_and_split_over_processes(files, model):
    data = load_dataset(str(files / "qa.jsonl"), model)
    assert data.masked and data.format == "chat"
    kw = dict(seed=3, batch_size=4, seq_len=SEQ)
    a, b = batch_at(data.train, step=7, **kw), batch_at(data.train, step=7, **kw)
    assert set(a) == {"inputs", "targets", "mask", "segments"}
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["inputs"], batch_at(data.train, step=8, **kw)["inputs"])
    halves = [batch_at(data.train, step=7, process_index=i, process_count=2, **kw)
              for i in range(2)]
    for k in a:
        np.testing.assert_array_equal(np.concatenate([h[k] for h in halves]), a[k])
    # Targets are the inputs shifted; the mask is aligned with the targets.
    rows = data.train
    np.testing.assert_array_equal(a["targets"][:, :-1], a["inputs"][:, 1:])
    assert a["mask"].sum() > 0 and set(np.unique(a["mask"])) <= {0, 1}
    assert rows.trained_tokens == int(rows.mask_NW[:, 1:].sum())
    with pytest.raises(ConfigError, match="seq_len=32: the packed rows hold 65 tokens"):
        batch_at(data.train, step=0, seed=0, batch_size=2, seq_len=32)


@functools.cache
def _logits(model):
    return jax.jit(model.logits_fn())


def _nll(model, params, batch):
    """Per-position cross-entropy in numpy from the model's logits (each packed example
    attending only to itself when the batch has segments)."""
    logits = np.asarray(_logits(model)(params, batch["inputs"], batch.get("segments")),
                        np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]


@pytest.mark.slow
def test_masked_evaluation_is_the_mean_over_the_assistant_tokens(files, model):
    data = load_dataset(str(files / "qa.jsonl"), model)
    job = plan_job(model, "fp32", optax.adam(1e-3), batch_size=2, masked=True)
    params = init_state(job).params
    got = evaluate(job, params, data.train, num_batches=3)
    total = count = 0.0
    for batch in eval_batches(data.train, batch_size=2, seq_len=SEQ, num_batches=3):
        nll = _nll(model, params, batch)
        total += float((nll * batch["mask"]).sum())
        count += float(batch["mask"].sum())
    np.testing.assert_allclose(got, total / count, rtol=1e-5)
    unmasked = np.mean([_nll(model, params, b).mean() for b in
                        eval_batches(data.train, batch_size=2, seq_len=SEQ, num_batches=3)])
    assert abs(got - unmasked) > 1e-3  # the mask changes what is measured
    with pytest.raises(ConfigError, match="planned with masked=True"):
        evaluate(job, params, np.arange(500) % VOCAB_SIZE, num_batches=1)


@pytest.mark.slow
def test_evaluate_model_scores_every_assistant_token(gguf, model):
    files = gguf
    result = evaluate_model(str(files / "tiny.gguf"), str(files / "qa.jsonl"), batch_size=4,
                            seq_len=SEQ)
    from effijax.interop import load_pretrained

    loaded, params = load_pretrained(files / "tiny.gguf", seq_len=SEQ)
    records = read_records(files / "qa.jsonl")
    rows = pack_examples([render_chat(loaded.tokenizer, r.messages) for r in records], SEQ,
                         pad_id=IM_END)
    batch = packed_batch(rows, np.arange(len(rows)))
    nll = _nll(loaded, params, batch)
    mask = batch["mask"]
    assert result.format == "chat" and result.tokens == int(mask.sum()) == rows.trained_tokens
    assert result.rows == len(rows)
    np.testing.assert_allclose(result.loss, (nll * mask).sum() / mask.sum(), rtol=1e-5)
    np.testing.assert_allclose(result.perplexity, np.exp(result.loss), rtol=1e-9)
    # Through another template file: the rows it renders, and their trained tokens.
    template = pathlib.Path(files) / "turns.jinja"
    template.write_text(OTHER_TEMPLATE)
    other = evaluate_model(str(files / "tiny.gguf"), str(files / "qa.jsonl"), batch_size=4,
                           seq_len=SEQ, chat_template=str(template))
    retemplated = dataclasses.replace(loaded.tokenizer, chat_template=OTHER_TEMPLATE)
    rows = pack_examples([render_chat(retemplated, r.messages) for r in records], SEQ,
                         pad_id=IM_END)
    assert other.tokens == rows.trained_tokens
    assert other.loss != result.loss  # the turns end with another token
    batch = packed_batch(rows, np.arange(len(rows)))
    nll = _nll(loaded, params, batch)
    np.testing.assert_allclose(other.loss, (nll * batch["mask"]).sum() / batch["mask"].sum(),
                               rtol=1e-5)


def _env():
    return compiles_as_the_suite({**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})


@pytest.mark.slow
def test_eval_cli_prints_loss_and_perplexity(gguf, capsys):
    files = gguf
    cmd = [sys.executable, "-m", "effijax", "eval", "--from", str(files / "tiny.gguf"),
           str(files / "qa.jsonl"), "--batch-size", "4", "--seq-len", str(SEQ), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    want = evaluate_model(str(files / "tiny.gguf"), str(files / "qa.jsonl"), batch_size=4,
                            seq_len=SEQ)
    assert got["tokens"] == want.tokens and got["format"] == "chat"
    np.testing.assert_allclose(got["loss"], want.loss, rtol=1e-5)
    bad = files / "bad.jsonl"
    bad.write_text('{"prompt": "q", "response": "r"}\n{"prompt": "q"}\n')
    from effijax.cli import main

    assert main([*cmd[3:6], str(bad)]) == 2  # the refusal: in this process, no start's cost
    assert f"data='{bad}:2': keys ['prompt']" in capsys.readouterr().err


# Training ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_lora_on_chat_jsonl_counts_trained_tokens_and_resumes_exactly(gguf, tmp_path):
    files = gguf
    from effijax.recipe import TrainConfig, train

    base = dict(model_from=str(files / "tiny.gguf"), data=str(files / "qa.jsonl"), lora_rank=2,
                seq_len=SEQ, batch_size=2, eval_batches=2, progress=False, checkpoint_every=2)
    whole = train(TrainConfig(steps=4, out=str(tmp_path / "whole"), **base))
    train(TrainConfig(steps=2, out=str(tmp_path / "part"), **base))
    resumed = train(TrainConfig(steps=4, out=str(tmp_path / "part"), allow_changes="steps",
                                **base))
    assert resumed.summary["start_step"] == 2
    from effijax.lora import load_adapters

    a, _ = load_adapters(tmp_path / "whole" / "adapters.safetensors")
    b, _ = load_adapters(tmp_path / "part" / "adapters.safetensors")
    jax.tree.map(np.testing.assert_array_equal, a, b)
    losses = [[json.loads(line)["loss"] for line in
               (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
              for run in ("whole", "part")]
    assert losses[0] == losses[1]
    # The metrics count the trained tokens of each step's batch.
    from effijax.interop import load_pretrained

    data = load_dataset(base["data"], load_pretrained(files / "tiny.gguf", seq_len=SEQ)[0])
    records = [json.loads(line) for line in
               (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    want = [int(batch_at(data.train, seed=0, step=s, batch_size=2, seq_len=SEQ)["mask"].sum())
            for s in range(4)]
    assert [r["tokens"] for r in records] == want
    assert whole.summary["trained_tokens"] == sum(want)
    assert whole.summary["eval_loss"] < whole.summary["eval_loss_start"]


def test_a_full_fine_tune_is_evaluated_with_the_tokenizer_it_started_from(gguf, tmp_path):
    """A full run of a pretrained model keeps no tokenizer of its own: evaluating it reads
    chat and text through the tokenizer of the model it started from, not as bytes."""
    files = gguf
    from effijax.recipe import TrainConfig, train

    out = tmp_path / "full"
    train(TrainConfig(model_from=str(files / "tiny.gguf"), data=str(files / "qa.jsonl"),
                      seq_len=SEQ, batch_size=2, steps=2, eval_batches=1, progress=False,
                      out=str(out)))
    text = files / "notes.txt"
    text.write_text("the end in the 1 hi\n" * 30)
    for data in (files / "qa.jsonl", text):
        tuned = evaluate_model(str(out), str(data), batch_size=4, seq_len=SEQ)
        base = evaluate_model(str(files / "tiny.gguf"), str(data), batch_size=4, seq_len=SEQ)
        assert (tuned.format, tuned.tokens, tuned.fingerprint) == \
            (base.format, base.tokens, base.fingerprint), data.name
        assert np.isfinite(tuned.loss) and tuned.loss != base.loss


@pytest.mark.slow
def test_train_cli_fine_tunes_on_jsonl_and_prints_validation_loss_before_and_after(gguf,
                                                                                  tmp_path):
    files = gguf
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "effijax", "train", "--from", str(files / "tiny.gguf"),
           "--data", str(files / "qa.jsonl"), "--lora-rank", "2", "--seq-len", str(SEQ),
           "--steps", "4", "--batch-size", "2", "--eval-batches", "1", "--no-progress",
           "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert run.returncode == 0, run.stderr
    assert "chat data: 38 training examples" in run.stdout
    before = float(run.stdout.split("validation loss before training ")[1].split()[0])
    summary = json.loads((out / "summary.json").read_text())
    assert before == pytest.approx(summary["eval_loss_start"], abs=1e-4)
    assert f"eval loss {summary['eval_loss']:.4f} (from {before:.4f})" in run.stdout
    assert "of them trained" in run.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["data_format"] == "auto"
    assert config["run"]["corpus_sha256"].startswith("40:")
    result = evaluate_model(str(out), str(files / "qa.jsonl"), batch_size=4,
                            seq_len=SEQ)
    assert "LoRA r=2" in result.model and np.isfinite(result.loss)


@pytest.mark.slow
def test_smollm2_chat_ids_match_transformers_apply_chat_template():
    transformers = pytest.importorskip("transformers", reason="the reference chat rendering")
    from effijax.interop import load_tokenizer
    from effijax.sources import bundled_path

    file = pathlib.Path(bundled_path("smollm2"))
    # transformers builds GGUF tokenizers with GPT-2's split (see test_hf_parity), so compare
    # with that split; the template and the special tokens are the file's.
    tok = load_tokenizer(file, pre="gpt2")
    hf = transformers.AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    conversations = [
        [{"role": "user", "content": "What does json.dumps return?"},
         {"role": "assistant", "content": "A str holding the JSON text."}],
        [{"role": "system", "content": "Answer in one word."},
         {"role": "user", "content": "Capital of France?"},
         {"role": "assistant", "content": "Paris"},
         {"role": "user", "content": "And of Italy?"},
         {"role": "assistant", "content": "Rome"}],
    ]
    for messages in conversations:
        ids, mask = render_chat(tok, messages)
        theirs = hf.apply_chat_template(messages, tokenize=True)
        theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
        assert ids.tolist() == list(theirs)
        replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert tok.decode(ids[mask == 1]) == "".join(replies)
        # Each trained run of tokens is exactly one reply.
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
        runs = [tok.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2], strict=True)]
        assert runs == replies


# Turns closed by <|endoftext|> (id 0), not by the tokenizer's EOS <|im_end|> (id 2): Gemma's
# shape (<end_of_turn>, then <eos>).
OTHER_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                  "<|endoftext|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                  "assistant\n{% endif %}")


@pytest.mark.parametrize("text, problem", [
    (None, "no such file; give a Jinja chat template file"),
    ("{% for m in messages %}", "the template failed (TemplateSyntaxError: Unexpected end of "
                                "template."),
    ("{{ raise_exception('no system turns') }}", "the template failed (ValueError: no "
                                                 "system turns) on a two-turn conversation; "
                                                 "fix the file"),
])
def test_a_chat_template_file_is_checked_before_anything_is_planned(gguf, tmp_path, text,
                                                                     problem, capsys):
    path = tmp_path / "t.jinja"
    if text is not None:
        path.write_text(text)
    with compiles() as compiled:
        assert cli_main(["train", "--from", str(gguf / "tiny.gguf"), "--data",
                         str(gguf / "qa.jsonl"), "--chat-template", str(path), "--out",
                         str(tmp_path / "run")]) == 2
    assert compiled == []
    err = capsys.readouterr().err
    assert f"error: --chat-template={str(path)!r}: " in err and problem in err, err
    assert not (tmp_path / "run").exists()


def test_a_byte_model_has_no_tokenizer_for_a_chat_template(tmp_path):
    from effijax.sources import with_chat_template

    path = tmp_path / "t.jinja"
    path.write_text(OTHER_TEMPLATE)
    with pytest.raises(ConfigError, match="tiny GPT has no tokenizer to render chat with"):
        with_chat_template(gpt_config("tiny"), str(path))


@pytest.mark.slow  # one LoRA run of 2 steps
def test_a_chat_template_file_renders_the_data_and_stays_with_the_run(gguf, tmp_path):
    from effijax.recipe import TrainConfig, train

    template = tmp_path / "turns.jinja"
    template.write_text(OTHER_TEMPLATE)
    out = tmp_path / "run"
    result = train(TrainConfig(model_from=str(gguf / "tiny.gguf"), data=str(gguf / "qa.jsonl"),
                               chat_template=str(template), lora_rank=2, seq_len=SEQ,
                               batch_size=2, steps=2, eval_batches=1, progress=False,
                               out=str(out)))
    # The data went through the file's template: the trained tokens are its assistant turns.
    model = dataclasses.replace(TINY.with_seq_len(SEQ),
                                tokenizer=dataclasses.replace(chat_tokenizer(),
                                                              chat_template=OTHER_TEMPLATE))
    data = load_dataset(str(gguf / "qa.jsonl"), model)
    want = [int(batch_at(data.train, seed=0, step=s, batch_size=2, seq_len=SEQ)["mask"].sum())
            for s in range(2)]
    assert result.summary["trained_tokens"] == sum(want)
    ids, mask = render_chat(model.tokenizer, [{"role": "user", "content": "the 1"},
                                              {"role": "assistant", "content": "in the"}])
    assert ids[mask == 1][-1] == EOT  # the turn's end is trained, as the template writes it
    # The run keeps the template's text, whatever becomes of the file.
    assert json.loads((out / "config.json").read_text())["run"]["chat_template"] == \
        OTHER_TEMPLATE
    template.unlink()
    from effijax.generate import load

    loaded = load(str(out))
    assert loaded.tokenizer.chat_template == OTHER_TEMPLATE
    assert loaded.chat_prompt("hi").endswith("<|endoftext|>\n<|im_start|>assistant\n")
    # A reply stops at the turn's end as well as at EOS.
    assert loaded._stop_ids(chat=True) == (2, 0) and loaded._stop_ids(chat=False) == 2


def test_chat_records_from_a_model_without_a_template_are_refused_from_its_metadata(tmp_path):
    """Checked before the model is read: here a GGUF of metadata alone (no tensors, no
    vocabulary) is enough to refuse, and one with a template passes."""
    gguf = pytest.importorskip("gguf", reason="GGUF files need the gguf package")
    from effijax.recipe import TrainConfig
    from effijax.recipe._sources import check_chat_template

    data = tmp_path / "qa.jsonl"
    data.write_text('{"prompt": "hi", "response": "hello"}\n')
    for name, template in (("base.gguf", None), ("instruct.gguf", "{{ messages }}")):
        writer = gguf.GGUFWriter(str(tmp_path / name), "llama")
        writer.add_array("tokenizer.ggml.tokens", ["a"] * 1000)  # stepped over, not decoded
        if template is not None:
            writer.add_chat_template(template)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
    def check(**settings):
        sections = TrainConfig(data=str(data), **settings).sections
        check_chat_template(sections.model, sections.data)

    with pytest.raises(ConfigError, match=re.escape(
            f"data='{data}': chat records are rendered by the model's chat template, and "
            f"{tmp_path / 'base.gguf'} has none (a base model's): give one with --chat-template "
            "FILE")):
        check(model_from=str(tmp_path / "base.gguf"))
    check(model_from=str(tmp_path / "instruct.gguf"))
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages }}")
    check(model_from=str(tmp_path / "base.gguf"), chat_template=str(template))  # the fix: no error
