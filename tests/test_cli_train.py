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
    ],
)
def test_bad_flags_fail_before_compiling(flags, message, capsys, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    flags = [f.replace("{file}", str(a_file)) for f in flags]
    with compiles() as compiled:
        assert main(["train", *flags]) == 2
    assert compiled == []  # pre-flight: nothing was compiled
    err = capsys.readouterr().err
    assert message in err, err


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
