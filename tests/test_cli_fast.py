"""Bad flags fail fast: the CLI parses and checks every setting, and `effijax memory`/`plan` run,
without importing JAX (importing it is most of a second; the README says how long a bad flag
takes). One fresh interpreter runs every case and reports, after each, whether jax was imported.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

CASES = {
    # argv: (exit code, text in stderr or stdout)
    ("train", "--lrr", "1"): (2, "unrecognized arguments: --lrr 1"),
    ("train", "--steps", "0"): (2, "effijax train: error: --steps=0: must be an integer >= 1"),
    ("train", "--steps", "ten"): (2, "argument --steps: invalid int value: 'ten'"),
    ("train", "--precision", "fp17"): (2, "--precision"),
    ("train", "--strategy", "zero4"): (2, "--strategy='zero4': unknown strategy"),
    ("train", "--mesh", "data=2,model=4"): (2, "unknown axis 'model'"),
    ("train", "--join-timeout", "0"): (2, "effijax train: error: --join-timeout=0: must be an "
                                          "integer >= 1"),
    ("train", "--lora-rank", "8"): (2, "--from SOURCE"),
    ("train", "--lora-alpha", "4"): (2, "--lora-alpha=4.0: only applies to LoRA"),
    ("train", "--config", "missing.toml"): (2, "missing.toml"),
    # A misspelt flag names the closest; none is abbreviated (--data is not --data-format).
    ("train", "--stpes", "5"): (2, "unrecognized arguments: --stpes 5; did you mean --steps? "
                                   "(see effijax train --help)"),
    ("eval", "--from", "smollm2", "--data", "notes.txt"): (2, "unrecognized arguments: --data; "
                                                              "give the data as DATA (effijax "
                                                              "eval --from MODEL FILE) without "
                                                              "a flag"),
    # --from names the model in every command; a source that names nothing is said under --from.
    ("train", "--from", "runs/base", "--lora-rank", "0"): (2, "--lora-rank=0"),
    ("eval", "--from", "/no/such/run", "notes.txt"): (2, "effijax eval: error: --from="
                                                         "'/no/such/run': no such run directory"),
    ("eval", "notes.txt"): (2, "the following arguments are required: --from"),
    ("eval", "--from", "smollm2", "notes.txt", "--batch-size", "0"):
        (2, "effijax eval: error: --batch-size=0: must be an integer >= 1"),
    ("generate", "--from", "/no/such/run", "--prompt", "x"):
        (2, "effijax generate: error: --from='/no/such/run': no such run directory"),
    ("generate", "--from", "smollm2", "--prompt", "x", "--max-new-tokens", "0"):
        (2, "effijax generate: error: --max-new-tokens=0: must be an integer >= 1"),
    ("memory", "--from", "/no/such/run"): (2, "effijax memory: error: --from='/no/such/run': "
                                              "no such run directory"),
    ("plan", "--from", "/no/such/run", "--devices", "8", "--device-memory", "80GB"):
        (2, "effijax plan: error: --from='/no/such/run': no such run directory"),
    ("memory", "--params", "7B", "--from", "smollm2"): (2, "not allowed with argument --params"),
    # The spellings of an unreleased version before --from: each error names --from (eval's
    # --data is checked above).
    ("eval", "/no/such/run", "notes.txt"):
        (2, "effijax eval: error: the following arguments are required: --from"),
    ("generate", "--model-from", "/no/such/run", "--prompt", "x"):
        (2, "effijax generate: error: the following arguments are required: --from"),
    ("train", "--init-from", "runs/base"):
        (2, "effijax train: error: unrecognized arguments: --init-from runs/base; did you mean "
            "--from?"),
    ("memory", "--model", "/no/such/run"):
        (2, "effijax memory: error: --model='/no/such/run': is not a preset but a model to read: "
            "give --from /no/such/run"),
    # A settings file: named otherwise than .toml it is still read, and a value it holds is
    # reported by the file and key (not as a flag the user never typed).
    ("train", "--config", "run.cfg"): (2, "effijax train: error: run.cfg:steps='forty': "
                                          "expected an integer"),
    ("train", "--config", "bad.conf"): (2, "--config='bad.conf': neither JSON nor TOML"),
    ("train", "--help"): (0, "--lora-random-base"),
    ("plan", "--params", "70B", "--devices", "8", "--device-memory", "80"):
        (2, "'80': a size needs a unit: write e.g. '80GB'"),
    ("plan", "--params", "70B", "--devices", "8", "--device-memory", "80GB"):
        (0, "-> plan: LoRA"),
    ("memory", "--params", "7B", "--strategy", "fsdp", "--devices", "8"): (0, "model states"),
    # The old spelling of --strategy names its replacement.
    ("memory", "--params", "7B", "--zero", "3"):
        (2, "unrecognized arguments: --zero 3; --zero is now --strategy (ddp, zero1, zero2, "
            "fsdp"),
    ("memory", "--params", "7B", "--optimizer", "adafactor"):
        (2, "effijax memory: error: --optimizer='adafactor': keeps factored second moments"),
    ("memory", "--params", "7X"): (2, "unknown unit 'X'"),
    ("--version",): (0, "effijax "),
    ("plan", "--help"): (0, "--no-lora"),
    ("memory", "--help"): (0, "--no-dropout"),
}

HARNESS = """
import contextlib, io, json, sys
from effijax.cli import main
from effijax.recipe import TrainConfig
from effijax.errors import ConfigError

results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    results.append({"argv": argv, "code": code, "text": out.getvalue() + err.getvalue(),
                    "jax": "jax" in sys.modules})
# A config is checked completely (mesh, strategy, LoRA) without jax too.
config = TrainConfig(strategy="zero3", mesh="data=2,fsdp=4", lora_rank=4, model_from="runs/base")
try:
    TrainConfig.from_dict({"lrr": 0.1})
except ConfigError as e:
    refused = str(e)
results.append({"config": [config.mesh, refused], "jax": "jax" in sys.modules})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cwd = tmp_path_factory.mktemp("cwd")
    (cwd / "run.cfg").write_text('model = "tiny"\nsteps = "forty"\n')
    (cwd / "bad.conf").write_text("steps = \n")
    proc = subprocess.run([sys.executable, "-c", HARNESS, json.dumps([list(a) for a in CASES])],
                          cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("argv", list(CASES), ids=" ".join)
def test_flags_are_checked_without_importing_jax(argv, results):
    result = next(r for r in results if tuple(r.get("argv", ())) == argv)
    code, text = CASES[argv]
    assert (result["code"], result["jax"]) == (code, False), result
    assert text in result["text"], result["text"]


def test_a_config_is_validated_without_importing_jax(results):
    last = results[-1]
    assert last["config"] == [{"data": 2, "fsdp": 4},
                              "lrr=0.1: unknown setting; did you mean 'lr'?"]
    assert last["jax"] is False


@pytest.mark.parametrize("argv", [("plan", "--help"), ("memory", "--help")])
def test_help_shows_only_defaults_that_read_right(argv, results):
    text = next(r for r in results if tuple(r.get("argv", ())) == argv)["text"]
    assert "(default: None)" not in text and "(default: True)" not in text
    assert "(default: False)" not in text and "(default: adamw)" in text
    assert "--device-memory SIZE" in text or argv[0] == "memory"


def test_the_harness_would_see_jax():
    """The check can fail: asking for a mesh imports jax."""
    code = "import sys; from effijax.sharding import make_mesh; print('jax' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "True", proc.stderr


def test_a_no_flag_says_what_it_turns_off():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "effijax", "train", "--help"], capture_output=True,
                         text=True, check=True).stdout
    flat = " ".join(out.split())
    assert "--no-checkpoints do not write checkpoints" in flat, flat
    assert "--no-progress do not show a progress bar" in flat, flat
