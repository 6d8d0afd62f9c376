"""Bounded resources (issue #21): every input that used to hang, take the machine's memory or
end in a traceback is refused in one line, fast: runaway chat templates, huge records, special
files as data or settings, too many CPU devices or prompts, generation and evaluation that
cannot fit, huge evaluation and plan batches, a damaged metrics log."""

import os
import time
import tracemalloc

import jax
import numpy as np
import pytest

from effijax.cli import main
from effijax.data import (
    MAX_RECORD_BYTES,
    compile_template,
    eval_batches,
    load_corpus,
    pack_examples,
    read_records,
    render_chat,
)
from effijax.errors import ConfigError
from effijax.models import byte_level_bpe
from effijax.recipe import TrainConfig

CHAT = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}]


def _tokenizer(template: str):
    return byte_level_bpe(["<s>", "a", "b", ":", "Ċ"], [], token_types=[3, 1, 1, 1, 1],
                          chat_template=template)


def _one_line(error: Exception) -> str:
    text = str(error)
    assert "\n" not in text and len(text) < 1500, text
    return text


def _refused(fn, *args, seconds: float = 5.0, **kwargs) -> ConfigError:
    # CPU seconds of this process, not wall time: the bound is on the work done before the
    # refusal, which a loaded machine stretches in wall time but not in CPU time.
    start = time.process_time()
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    spent = time.process_time() - start
    assert spent < seconds, f"took {spent:.1f} CPU s"
    _one_line(info.value)
    return info.value


def _cli(capsys, *argv: str) -> str:
    """``effijax argv`` in this process: exit 2 and one line on stderr, no traceback."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# Chat templates ------------------------------------------------------------------------------

@pytest.mark.parametrize("template", [
    # 10^10 iterations of nested loops: the sandbox's range() alone allows each.
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    # Loops over a long string, no call at all inside.
    "{% set s = 'x' * 99999 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    # A recursive macro that never ends, and one that writes without end.
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "{% for i in range(99999) %}{% for j in range(99999) %}xxxxxxxxxx{% endfor %}{% endfor %}",
    "{{ 'x' * 10**10 }}",
    "{{ 10 ** 99999999 }}",
    # Widths that would allocate a gigabyte in one step.
    "{{ '%0999999999d' % 1 }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ '{:>{}}'.format(1, 10**9) }}",
    "{{ 'x'|center(10**9) }}",
    "{{ '%0999999999d'|format(1) }}",
], ids=["nested-range", "nested-string", "recursion", "endless-output", "repeat", "power",
        "percent", "str-format", "str-format-arg", "center", "format-filter"])
def test_a_runaway_chat_template_ends_in_one_line_within_seconds(template):
    e = _refused(render_chat, _tokenizer(template), CHAT)
    assert e.field == "chat_template"


@pytest.mark.parametrize("template, said", [
    ("{% for m in messages %}", "TemplateSyntaxError"),
    ("{{ nothing.here }}", "UndefinedError"),
    ("{{ raise_exception('no system\nmessage here') }}", "no system message here"),
    ("{{ ().__class__.__subclasses__() }}", "SecurityError"),
], ids=["syntax", "undefined", "raised", "escape"])
def test_every_chat_template_error_is_one_line(template, said):
    e = _refused(_tokenizer(template).apply_chat_template, CHAT)
    assert e.field == "chat_template" and said in str(e), e


def test_a_template_error_in_training_data_names_the_record(tmp_path):
    from effijax.sources._data import _chat_examples

    f = tmp_path / "chat.jsonl"
    f.write_text('{"prompt": "ab", "response": "ba"}\n')
    e = _refused(_chat_examples, _tokenizer("{{ raise_exception('bad role') }}"),
                 read_records(f))
    assert (e.field, e.value) == ("data", f"{f}:1") and "bad role" in str(e)


def test_bounded_templates_render_as_before():
    template = ("{% for m in messages %}{{ loop.index }}/{{ loop.length }}{% endfor %}|"
                "{{ '%s-%d' % ('a', 3) }}|{{ '{}:{}'.format(1, 2) }}|{{ 'ab'|center(6) }}|"
                "{{ 'a b c'|wordwrap(2) }}|{{ '%s'|format(7) }}")
    assert compile_template(template).render(messages=["a", "b"]) == (
        "1/22/2|a-3|1:2|  ab  |a\nb\nc|7")


# Records, lines and special files ------------------------------------------------------------

@pytest.mark.parametrize("content, said", [
    (b'{"prompt": "' + b"a" * MAX_RECORD_BYTES + b'", "response": "b"}\n', "longer than"),
    (b'{"prompt": "\xff", "response": "b"}\n', "not UTF-8"),
    (b"[" * 200_000 + b"]" * 200_000 + b"\n", "nested too deeply"),
], ids=["long", "not-utf8", "deep"])
def test_a_hostile_chat_record_is_one_line(tmp_path, content, said):
    f = tmp_path / "chat.jsonl"
    f.write_bytes(b'{"prompt": "a", "response": "b"}\n' + content)
    e = _refused(read_records, f)
    assert e.value == f"{f}:2" and said in str(e), e


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe.jsonl"
    os.mkfifo(path)
    return path


def test_pipes_and_devices_are_refused_before_reading(tmp_path, fifo):
    for path in (fifo, "/dev/zero"):
        assert "effijax reads regular files" in str(_refused(load_corpus, path))
        assert "effijax reads regular files" in str(_refused(read_records, path))
        assert "not a file" in str(_refused(TrainConfig.from_file, path))
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("hello world")
    os.mkfifo(folder / "b.txt")  # skipped: reading it would block
    assert load_corpus(folder).tobytes() == b"hello world"


def test_special_files_as_data_or_config_on_the_command_line(capsys, fifo, tmp_path):
    for flags in (["--data", str(fifo)], ["--data", "/dev/zero"], ["--config", "/dev/zero"],
                  ["--config", str(fifo)]):
        err = _cli(capsys, "train", "--model", "tiny", "--steps", "2", "--out",
                   str(tmp_path / "run"), *flags)
        assert flags[0] in err, err


@pytest.mark.parametrize("name, text", [("deep.json", "[" * 200_000 + "]" * 200_000),
                                        ("deep.toml", "a = " + "[" * 200_000 + "]" * 200_000)])
def test_a_deeply_nested_config_file_is_one_line(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    assert "nested too deeply" in str(_refused(TrainConfig.from_file, tmp_path / name))


def test_template_and_memory_errors_name_what_the_user_can_change(capsys):
    from effijax.cli._eval import _flag
    from effijax.cli._generate import _error
    from effijax.errors import NO_VALUE

    assert _flag("memory") == "memory"
    assert _error(ConfigError("chat_template", NO_VALUE, "the template failed")) == 2
    assert capsys.readouterr().err == "effijax generate: error: --chat: the template failed\n"
    _error(ConfigError("memory", NO_VALUE, "needs 9 GB"))
    assert capsys.readouterr().err == "effijax generate: error: memory: needs 9 GB\n"


def test_a_huge_config_file_is_refused_unread(tmp_path):
    f = tmp_path / "big.toml"
    f.write_bytes(b"# " + b"x" * 2**21 + b"\n")
    assert "more than the 1,048,576" in str(_refused(TrainConfig.from_file, f))


# Numeric flags and counts --------------------------------------------------------------------

def test_cpu_devices_are_bounded(capsys, tmp_path):
    e = _refused(TrainConfig, cpu_devices=100_000)
    assert "from 1 to 1,024" in str(e)
    err = _cli(capsys, "train", "--model", "tiny", "--cpu-devices", "100000", "--out",
               str(tmp_path / "run"))
    assert err.endswith("--cpu-devices=100000: must be an integer from 1 to 1,024"), err


@pytest.mark.parametrize("field, value", [
    ("seed", 10**23), ("batch_size", 1e29), ("batch_size", 10**29), ("steps", 10**12),
    ("eval_batches", 10**12),
])
def test_huge_numbers_in_settings_are_one_line(field, value):
    assert _refused(TrainConfig, **{field: value}).field == field


def test_from_a_file_that_is_no_model_says_what_from_accepts(capsys, tmp_path):
    f = tmp_path / "some.txt"
    f.write_text("hello")
    for command in (["train", "--out", str(tmp_path / "run")], ["generate", "--prompt", "x"]):
        err = _cli(capsys, *command, "--from", str(f))
        assert "not a GGUF model" in err and "Hugging Face directory" in err, err


# Generation ----------------------------------------------------------------------------------

def test_too_many_prompts_are_refused_before_loading_a_model(capsys, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("hello\n" * 100_000)
    err = _cli(capsys, "generate", "--from", str(tmp_path / "nothing"), "--prompts-file", str(f))
    assert "more than 4,096 in one call" in err, err


def test_generate_refuses_too_many_prompts_and_a_cache_that_cannot_fit(monkeypatch):
    from effijax.generate import generate
    from effijax.models import llama_config
    from effijax.sources import _preflight

    model = llama_config("llama-tiny")
    params = jax.eval_shape(model.init_params, jax.random.key(0))  # both refuse before use
    assert "more than 4,096" in str(_refused(generate, model, params, [[1]] * 100_000))
    monkeypatch.setattr(_preflight, "device_budget", lambda *a: (10_000, "a test budget"))
    e = _refused(generate, model, params, [[1, 2]] * 8, max_new_tokens=4)
    assert e.field == "memory" and "more than the 10 KB of a test budget" in str(e), e


def test_evaluation_is_refused_before_running_when_a_batch_cannot_fit():
    from effijax.models import gpt_config
    from effijax.precision import get_policy
    from effijax.recipe._eval import _scorer

    lm = gpt_config("tiny", seq_len=16)
    rows = pack_examples([(np.arange(10), np.ones(10))] * 4, 16, pad_id=0)
    params = jax.eval_shape(lm.init_params, jax.random.key(0))  # compiled, never run
    e = _refused(_scorer, lm.loss_fn(None), get_policy("fp32"), params, rows, 10**8,
                 seconds=30)
    assert e.field == "memory" and "lower --batch-size" in str(e), e


# Batches -------------------------------------------------------------------------------------

def test_evaluation_batches_are_built_lazily():
    tokens = np.arange(10_000, dtype=np.uint8)
    tracemalloc.start()
    batches = eval_batches(tokens, batch_size=8, seq_len=16, num_batches=10**9)
    few = [batches[i] for i in (0, 1, 10**9 - 1)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(batches) == 10**9 and peak < 2**20, peak
    assert [b["inputs"].shape for b in few] == [(8, 16)] * 3
    small = eval_batches(tokens, batch_size=8, seq_len=16, num_batches=3)
    assert [b["inputs"].tolist() for b in small[-1:]] == [small[2]["inputs"].tolist()]


def test_the_planner_is_not_linear_in_the_batch():
    from effijax.memory import plan

    kw = dict(devices=2, device_memory="1GB", layers=2, hidden=64, heads=2, seq_len=64)
    start = time.monotonic()
    assert plan(10**6, global_batch=2**31 - 2, **kw).explain()
    assert time.monotonic() - start < 10
    assert _refused(plan, 10**6, global_batch=10**20, **kw).field == "global_batch"


# The metrics log -----------------------------------------------------------------------------

def test_a_damaged_metrics_line_is_reported_and_dropped_on_resume(tmp_path):
    from effijax.checkpoint import truncate_metrics

    f = tmp_path / "metrics.jsonl"
    f.write_bytes(b'{"step": 1}\n\xff\xfe\n{"step": "2"}\n[1]\n{"step": 2}\n{"step": 3}\n')
    said = []
    assert truncate_metrics(f, 2, report=said.append) == 4
    assert f.read_bytes() == b'{"step": 1}\n{"step": 2}\n'
    assert [line.split(": ")[2].split(" (")[0] for line in said] == [
        "line 2 is not a metrics record", "line 3 is not a metrics record",
        "line 4 is not a metrics record"]


# Issue #49: templates that allocate, long conversations, text that is not UTF-8 or one line --

@pytest.mark.parametrize("template, said", [
    # Sizes just over the bound: were a check lost, the test would fail without a big allocation.
    ("{{ 'ab'.rjust(20000000) }}", "a width or count of 20,000,000"),
    ("{{ ('ab' * 3000).replace('a', 'a' * 9000) }}", "str.replace would make 27,003,000"),
    ("{% set ns = namespace(t='yz') %}{% for _ in range(25) %}{% set ns.t = ns.t ~ ns.t ~ '!' %}"
     "{% endfor %}", "joining with ~ would make"),
    ("{% set ns = namespace(t=['q']) %}{% for _ in range(25) %}{% set ns.t = ns.t + ns.t %}"
     "{% endfor %}", "more than 256 MiB of strings and lists"),
    ("{{ lipsum(20000) }}", "lipsum would make"),
    ("{{ ('a' * 9000000).zfill(1) ~ ('a' * 9000000) }}", "joining with ~ would make 18,000,000"),
    ("{{ range(3000)|join('-' * 6000) }}", "joining would make"),
    ("{{ ['0123456789' * 200000] * 9 }}", "a {{ value }} would make"),
    ("{{ '{0}{0}{0}'.format('w' * 6000000) }}", "would make 18,000,"),
    ("{{ ('.' * 70000)|wordwrap(3) }}", "wordwrap filter is given more than 65,536"),
    ("{% set ns = namespace(d={}) %}{% for i in range(90000) %}"
     "{% set ns.d = dict(ns.d, **{'k' ~ i: i}) %}{% endfor %}", "more than 256 MiB"),
    ("{% set ns = namespace(n=7) %}{% for _ in range(30) %}{% set ns.n = ns.n * ns.n %}"
     "{% endfor %}", "more than 4096 bits"),
], ids=["rjust", "replace", "concat-doubling", "list-doubling", "lipsum", "concat", "join-sep",
        "list-repr", "format-fields", "wordwrap", "dict-in-loop", "int-squaring"])
def test_a_template_that_allocates_without_bound_is_one_line(template, said):
    tracemalloc.start()
    e = _refused(render_chat, _tokenizer(template), CHAT)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert e.field == "chat_template" and said in str(e), e
    assert peak < 400 * 2**20, f"{peak / 2**20:.0f} MiB"


def test_a_conversation_of_many_turns_is_refused_at_once_and_short_ones_render():
    from effijax.data._chat import MAX_SPAN_WORK

    turns = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}]
    template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}<s>{% endfor %}"
                "{% if add_generation_prompt %}a:{% endif %}")
    e = _refused(render_chat, _tokenizer(template), turns * 3000, seconds=3)
    assert e.field == "chat_template" and "6,000 messages" in str(e), e
    assert f"over the {MAX_SPAN_WORK:,} allowed" in str(e), e
    ids, mask = render_chat(_tokenizer(template), turns * 100)  # 200 messages: work, not refusal
    assert int(mask.sum()) == 100 * 3


def test_a_lone_surrogate_in_a_chat_record_is_one_line(tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text('{"prompt": "a", "response": "b"}\n'
                 '{"messages": [{"role": "user", "content": "x\\udc80y"}, '
                 '{"role": "assistant", "content": "ok"}]}\n')
    e = _refused(read_records, f)
    assert e.value == f"{f}:2" and "messages[0]'content' holds a lone surrogate" in str(e), e


def test_text_that_is_not_utf8_is_refused_and_utf16_is_decoded(tmp_path, capsys):
    from effijax.data import encode_each
    from effijax.models import byte_level_bpe

    tok = byte_level_bpe(["a", "b", "ab", "<|endoftext|>"], ["a b"], token_types=[1, 1, 1, 3])
    e = _refused(encode_each, tok, [b"ab", "ab\u00e7a".encode("cp1252")])
    assert e.value == "document 2 of 2" and "byte 3 is 0xE7" in str(e), e
    for encoding in ("utf-16", "utf-16-be", "utf-32"):  # with a byte-order mark each
        data = ("\ufeff" if encoding.endswith("be") else "") + "abba"
        assert [i.tolist() for i in encode_each(tok, [data.encode(encoding)])] == [
            [2, 1, 0, 3]], encoding
    f = tmp_path / "latin1.txt"
    f.write_bytes("na\u00efve caf\u00e9\n".encode("latin-1") * 50)
    err = _cli(capsys, "data", "prepare", str(f), "--out", str(tmp_path / "store"), "--from",
               "smollm2", "--processes", "1")
    assert "is not UTF-8 text: byte 3 is 0xEF (100 of its" in err, err


def test_a_long_document_reaches_the_tokenizer_in_pieces_or_is_refused(monkeypatch):
    from effijax.data import _documents, encode_each
    from effijax.models import byte_level_bpe

    tok = byte_level_bpe([chr(c) for c in range(97, 123)] + ["<|endoftext|>", "Ċ", ".", "Ġ"],
                         [], token_types=[1] * 26 + [3, 1, 1, 1])
    monkeypatch.setattr(_documents, "PIECE_CHARS", 40)
    monkeypatch.setattr(_documents, "MAX_PIECE_CHARS", 100)
    text = "the cat sat.\nand the dog\nran away\n\n. the end\n" * 20
    seen = []
    encode_batch = tok.backend.encode_batch
    monkeypatch.setattr(type(tok.backend), "encode_batch", lambda self, texts, **kw: (
        seen.append(max(map(len, texts))), encode_batch(texts, **kw))[1], raising=False)
    whole = tok.backend.encode(text, add_special_tokens=False).ids
    assert encode_each(tok, [text.encode()])[0][:-1].tolist() == whole
    assert len(seen) > 1 and max(seen) <= 100, seen  # in pieces, none over the limit
    e = _refused(encode_each, tok, [b"ab\n" + b"x" * 101])
    assert "a stretch of 104 characters without a line end to cut at" in str(e), e
