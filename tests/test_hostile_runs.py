"""Hostile or suspicious inputs to ``effijax generate`` and ``effijax eval`` (issue #49, item 4):
each ends in one clear line, exit 2 where it is refused, never a traceback.

1. A LoRA run whose base file changed (or was replaced by another model of the same shape) is
   refused, naming the file and its recorded and current SHA-256, rather than adapted silently.
2. A prompt that is not UTF-8 text (a command line's undecodable bytes, a lone surrogate in a
   JSONL prompts file, a text prompts file that is not UTF-8) is refused, naming the prompt.
3. An evaluation over a handful of tokens says how little it measured.

One LoRA run of a tiny Llama GGUF (2 steps) is shared by the module's tests.
"""

import json
import shutil
import sys

import jax
import numpy as np
import pytest

from effijax.cli import main
from effijax.errors import ConfigError
from effijax.recipe import EvalResult, TrainConfig, train
from effijax.sources import open_model


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``effijax argv`` in this process: its exit code, stdout and stderr (never a traceback)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


def _refused(capsys, *argv: str) -> str:
    """``effijax argv`` exits 2 with one line on stderr; returns it."""
    code, _, err = _cli(capsys, *argv)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """``(run, base, other)``: a LoRA run of the tiny GGUF ``base`` (2 steps), and ``other``,
    a GGUF of the same shape with other weights."""
    pytest.importorskip("gguf", reason="GGUF files need the gguf package")
    from _llama_files import VOCAB_SIZE, write_gguf

    from effijax.models import llama_config

    root = tmp_path_factory.mktemp("hostile")
    model = llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=32)
    base, other = root / "base.gguf", root / "other.gguf"
    write_gguf(base, model, model.init_params(jax.random.key(5)))
    write_gguf(other, model, model.init_params(jax.random.key(6)))
    data = root / "corpus.txt"
    data.write_text("".join(f"the thin {i} in the {i}\n" for i in range(300)))
    run = root / "lora"
    train(TrainConfig(model_from=str(base), lora_rank=2, seq_len=16, batch_size=2, steps=2,
                      eval_batches=0, progress=False, data=str(data), out=str(run)))
    return run, base, other


def _recorded_sha(run) -> str:
    return json.loads((run / "config.json").read_text())["run"]["init_from_checkpoint"]["sha256"]


def _sha(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


# 1. A LoRA run's base changed ----------------------------------------------------------------


def test_a_lora_run_on_a_changed_base_is_refused_naming_file_and_hashes(lora_run, capsys,
                                                                         tmp_path):
    run, base, other = lora_run
    original = base.read_bytes()
    recorded, now = _recorded_sha(run), _sha(other)
    assert recorded == _sha(base) and recorded != now
    assert open_model(str(run)).lora.rank == 2  # the same base: opened as before
    try:
        shutil.copyfile(other, base)  # another model of the same shape, at the same path
        for command in (["generate", "--from", str(run), "--prompt", "the thin"],
                        ["eval", "--from", str(run), str(run.parent / "corpus.txt")]):
            line = _refused(capsys, *command)
            assert line.startswith(f"effijax {command[0]}: error: --from='{run}': its base "
                                   f"{base} changed since the run trained on it: base.gguf "
                                   f"(sha256 {recorded[:12]}.. -> {now[:12]}..)"), line
            assert f"put back the model the run trained on at {base}" in line
            assert "--export-gguf" in line  # this run wrote no merged model
        base.unlink()
        line = _refused(capsys, "generate", "--from", str(run), "--prompt", "the thin")
        assert f"its base {base} is gone; put back the model the run trained on" in line
    finally:
        base.write_bytes(original)

    # A copy of the run that exported a merged model names it; a bundled base (smollm2) whose
    # file moved is looked for where its name resolves now, and checked the same way.
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(run / "adapters.safetensors", copy)
    values = json.loads((run / "config.json").read_text())
    values.update(model_from="smollm2", export_gguf="f32")
    values["run"]["init_from_checkpoint"]["path"] = str(tmp_path / "moved" / "smollm2.gguf")
    (copy / "config.json").write_text(json.dumps(values))
    (copy / "model.gguf").write_bytes(other.read_bytes())
    import effijax.sources._open as opening

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(opening, "bundled_path", lambda name: str(other))
        with pytest.raises(ConfigError, match=(
                rf"its base {other} changed since the run trained on it: sha256 "
                rf"{recorded[:12]}\.\. -> {now[:12]}\.\.; .*or use the run's merged export: "
                rf"--from {copy}/model\.gguf$")):
            open_model(str(copy))
        elsewhere = shutil.copyfile(base, tmp_path / "elsewhere.gguf")  # same content
        patch.setattr(opening, "bundled_path", lambda name: str(elsewhere))
        assert open_model(str(copy)).lora.rank == 2


# 2. Prompts that are not text ----------------------------------------------------------------


def test_prompts_that_are_not_utf8_text_are_refused_naming_them(capsys, tmp_path):
    # The command line's bytes b"caf\xe9" (Latin-1), as Python hands them over.
    latin1 = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")
    line = _refused(capsys, "generate", "--from", "smollm2", "--prompt", "ok", "--prompt", latin1)
    assert line == ("effijax generate: error: --prompt='caf\\udce9 au lait': prompt 2 of 2 is "
                    "not text: character 4 is the byte 0xe9, which is not UTF-8 (a terminal or "
                    "script in another encoding?); pass it as UTF-8")
    bad = b"\xff\xfe".decode("utf-8", "surrogateescape")
    assert "character 1 is the byte 0xff" in _refused(capsys, "generate", "--from", "smollm2",
                                                      "--prompt", bad)

    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('"fine"\n{"prompt": "a\\ud800b"}\n')  # a JSON escape of half a pair
    line = _refused(capsys, "generate", "--from", "smollm2", "--prompts-file", str(jsonl))
    assert line == (f"effijax generate: error: --prompts-file='{jsonl}:2': the prompt on line 2 "
                    "is not text: character 2 is a lone surrogate ('\\ud800'), which no UTF-8 "
                    "text holds (a JSON escape of half a surrogate pair?); write it as UTF-8 "
                    "text")

    text = tmp_path / "p.txt"
    text.write_bytes(b"fine\n\xff\xfe bytes\n")
    line = _refused(capsys, "generate", "--from", "smollm2", "--prompts-file", str(text))
    assert f"--prompts-file='{text}:2'" in line and "UTF-8" in line, line

    # The library refuses the same before a tokenizer fails on it (a TypeError there).
    from effijax.generate import Loaded
    from effijax.models import gpt_config

    model = gpt_config("tiny")
    loaded = Loaded(model, model.init_params(jax.random.key(0)))
    with pytest.raises(ConfigError, match=r"prompt 2 of 2: character 2 is a lone surrogate"):
        loaded.complete_batch(["ok", "a\ud800"], max_new_tokens=1)
    with pytest.raises(ConfigError, match=r"system: character 1 is a lone surrogate"):
        loaded.complete_batch(["ok"], chat=True, system="\udcff", max_new_tokens=1)


# 3. An evaluation over a handful of tokens ---------------------------------------------------


def test_eval_of_a_tiny_or_random_file_says_how_little_it_measured(lora_run, capsys, tmp_path):
    run, _, _ = lora_run
    one = tmp_path / "one.txt"
    one.write_bytes(b"x")
    code, out, err = _cli(capsys, "eval", "--from", str(run), str(one), "--seq-len", "16",
                          "--batch-size", "1")
    assert code == 0, err
    assert f"on {one} (text, 1 window of 16, in fp32): loss " in out
    assert out.endswith(" over 1 token\n")
    assert err == ("effijax eval: warning: only 1 token scored (fewer than 100, and less than "
                   "one window of 16): the perplexity is a rough figure; evaluate on more text\n")

    # Random bytes are not UTF-8 text: refused in one line naming the first bad byte.
    noise = tmp_path / "noise.txt"
    noise.write_bytes(np.random.default_rng(0).integers(0, 256, 600, np.uint8).tobytes())
    code, out, err = _cli(capsys, "eval", "--from", str(run), str(noise), "--seq-len", "16",
                          "--batch-size", "1", "--max-batches", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "is not UTF-8 text: byte " in err and out == "", err

    # Enough tokens, at least a window: nothing to say.
    result = EvalResult(5.0, 148.4, 4880, 20, 256, "text", "1:ab", "m", "fp32", "")
    assert result.caution is None
    assert "fewer than 100)" in result._replace(tokens=99, seq_len=16).caution
    assert "(less than one window of 256)" in result._replace(tokens=200).caution
    assert result._replace(tokens=200, format="chat").caution is None  # packed records


def test_eval_says_what_it_waits_for_at_a_terminal(lora_run, capsys, monkeypatch, tmp_path):
    run, _, _ = lora_run
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat\n" * 40)
    argv = ("eval", "--from", str(run), str(text), "--seq-len", "16", "--max-batches", "1")
    code, out, quiet = _cli(capsys, *argv)
    assert code == 0 and quiet == "", quiet  # a script's stderr: the result alone
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, again, err = _cli(capsys, *argv)
    assert code == 0 and again == out
    assert err.splitlines() == ["effijax eval: starting (importing JAX)",
                                f"effijax eval: loading {run}", f"effijax eval: reading {text}",
                                "effijax eval: compiling the forward pass in fp32 (auto: the "
                                "run's own), then scoring 1 batch of 8 windows"], err
