"""`effijax train` end to end, and its pre-flight validation."""

import json
import subprocess
import sys

import pytest
from _compiles import compiles

from effijax.cli import main

TINY = ["--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1",
        "--no-progress"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(300)))
    return str(path)


def test_train_writes_a_complete_run_dir(tmp_path, corpus):
    out = tmp_path / "run"
    assert main(["train", "--steps", "4", "--precision", "fp16", "--data", corpus,
                 "--out", str(out), *TINY]) == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        for key in ("loss", "loss_scale", "skipped", "grad_norm", "tokens_per_s", "learning_rate"):
            assert key in r, key
    assert records[0]["loss_scale"] == 2.0**16  # fp16 -> dynamic scaling by default
    config = json.loads((out / "config.json").read_text())
    assert config["precision"] == "fp16" and config["loss_scale"] == "dynamic"
    assert config["run"]["model_config"]["seq_len"] == 32 and config["run"]["num_params"] > 0
    assert "jax" in config["versions"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["eval_loss"] > 0
    assert (out / "loss.png").stat().st_size > 1000


def test_auto_precision_is_fp32_on_cpu_and_accumulation_runs(tmp_path, corpus):
    out = tmp_path / "run"
    assert main(["train", "--steps", "4", "--accumulate", "2", "--data", corpus,
                 "--out", str(out), *TINY]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["precision"] == "fp32" and config["loss_scale"] == "none"
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 4 and records[-1]["learning_rate"] > 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "0"], "--steps=0: must be an integer >= 1"),
        (["--batch-size", "-2"], "--batch-size=-2"),
        (["--model", "huge"], "--model='huge': unknown model preset"),
        (["--lr", "0"], "--lr=0.0: must be > 0"),
        (["--loss-scale", "lots"], "--loss-scale='lots'"),
        (["--precision", "fp16", "--loss-scale", "none"], "fp16 without loss scaling"),
        (["--data", "/no/such/file"], "--data='/no/such/file': no such file"),
        (["--steps", "5", "--accumulate", "2"], "--steps=5: must be a multiple of accumulate=2: "
         "e.g. 6"),
        (["--out", "{file}/run"], "cannot write there"),
        (["--out", ""], "--out='': is empty (an unset shell variable?); name the run "
         "directory, e.g. --out runs/mine"),
        # Hostile settings: each a line, nothing traced or written.
        (["--lr", "1e308"], "--lr=1e+308: must be > 0 and at most 3.403e+38, the largest "
         "float32"),
        (["--prefetch", "1000000000"], "--prefetch=1000000000: must be at most 64"),
        (["--batch-size", "1000000000"], "1,000,000,000 sequences of 128 tokens is "
         "128,000,000,000 tokens a step, over the 2,147,483,647 a step counts; use at most "
         "16,777,215"),
        (["--out", "runs/" + "x" * 300], "is 300 bytes, over the 255 a file name may have"),
        (["--out", "runs/\udcff\udcfe"], "--out: 'runs/\\xff\\xfe' holds bytes that are not "
         "UTF-8"),
        (["--data", "/tmp/" + "d" * 5000], "is 5,005 bytes long, over the 4,095 a path may have"),
    ],
)
def test_bad_flags_fail_before_compiling(flags, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a run directory that slipped through lands here, not in ours
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    flags = [f.replace("{file}", str(a_file)) for f in flags]
    with compiles() as compiled:
        assert main(["train", *flags]) == 2
    assert compiled == []  # pre-flight: nothing was compiled
    err = capsys.readouterr().err
    assert message in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing written


@pytest.mark.parametrize("name, text, message", [
    ("run.toml", "", "holds no settings; give the file of settings you meant, or leave --config "
     "out"),
    ("run.toml", "# only a comment\n", "holds no settings"),
    ("run.json", '{"data": "a\\u0000b"}', "data='a\\x00b': holds a NUL character"),
])
def test_a_config_file_that_cannot_be_meant_is_one_line(name, text, message, capsys, tmp_path):
    config = tmp_path / name
    config.write_text(text)
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "r")]) == 2
    assert not (tmp_path / "r").exists()
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_console_script_with_forced_cpu_devices(tmp_path, corpus):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "effijax", "train", "--steps", "2", "--cpu-devices", "3",
         "--data", corpus, "--out", str(out), *TINY],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "done: 2 steps" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert len(config["run"]["devices"]) == 3


def test_a_run_at_a_terminal_says_each_stage_as_it_begins(tmp_path, corpus, capsys,
                                                          monkeypatch):
    for stream in (sys.stdout, sys.stderr):  # a person watching, not a script
        monkeypatch.setattr(stream, "isatty", lambda: True)
    out = tmp_path / "run"
    assert main(["train", "--steps", "2", "--data", corpus, "--out", str(out), *TINY]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines()[0] == "effijax train: starting (importing JAX)"
    lines = captured.out.splitlines()
    stages = [f"effijax train: reading the data ({corpus})",
              "effijax train: compiling the training step"]
    assert lines[:2] == stages, lines
    assert lines[2].startswith("effijax train: tiny GPT") and lines[-1].startswith("done: 2")
