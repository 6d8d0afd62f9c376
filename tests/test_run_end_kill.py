"""Real kills at every phase of a run's end, each followed by the same command.

``effijax train`` (a tiny LoRA Llama, 3 steps, exporting adapters, PEFT and a Hugging Face
directory) runs as a subprocess that SIGKILLs itself at a chosen point after its last step
(tests/_end_kill_worker.py wraps effijax's own functions; nothing in effijax knows): once the
final checkpoint is committed, inside the final evaluation, half-way through the write of each
export's weights, and before ``summary.json``. The same command run again must say that it
completes the run's end, exit 0, and leave the directory an uninterrupted run's: every export
and ``loss.png`` byte-equal, ``metrics.jsonl`` and ``summary.json`` equal but for their timings.

One uninterrupted reference run is shared by the module (it also fills the JAX compilation
cache the other runs read).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _run_env import ROOT, run_env

from effijax.checkpoint import LOCK_FILE

WORKER = ROOT / "tests" / "_end_kill_worker.py"
STEPS = 3
# What varies from one session to the next without changing the run: wall-clock timings, and
# the step this session started from (the completion says it started at the last step).
TIMINGS = {"tokens_per_s", "step_time_s", "first_step_s", "wall_time_s"}
SESSION = {"start_step"}


def _command(corpus: str) -> list[str]:
    """The one command every run here gives (``--out`` relative: each in its own folder)."""
    return ["train", "--model", "llama-tiny", "--seq-len", "16", "--batch-size", "2",
            "--eval-batches", "1", "--no-progress", "--steps", str(STEPS), "--checkpoint-every",
            "2", "--lora-rank", "2", "--lora-random-base", "--export-hf", "--data", corpus,
            "--out", "run"]


def _run(env: dict, cwd: Path, *prefix: str) -> subprocess.CompletedProcess:
    cwd.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, *prefix, *_command(env["corpus"])], cwd=cwd,
                          env=env["env"], capture_output=True, text=True, timeout=300)


def _files(out: Path) -> dict[str, Path]:
    """The run directory's files, by relative path, outside its checkpoints."""
    return {p.relative_to(out).as_posix(): p for p in sorted(out.rglob("*"))
            if p.is_file() and p.relative_to(out).parts[0] != "checkpoints"}


def _without(record: dict, keys: set) -> dict:
    return {k: v for k, v in record.items() if k not in keys}


def _metrics(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [_without(json.loads(line), TIMINGS) for line in lines]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return run_env(tmp_path_factory.mktemp("end-kill"))


@pytest.fixture(scope="module")
def reference(env):
    """The uninterrupted run every completed end must equal."""
    done = _run(env, env["root"] / "reference", "-m", "effijax")
    assert done.returncode == 0, done.stderr
    return env["root"] / "reference" / "run"


@pytest.mark.parametrize("point", ["checkpoint", "evaluation", "adapters.safetensors",
                                   "adapter_model.safetensors", "model.safetensors",
                                   "summary.json"])
def test_a_run_killed_in_its_end_is_completed_by_the_same_command(
        env, reference, tmp_path, point):
    out = tmp_path / "run"
    killed = _run(env, tmp_path, str(WORKER), point)
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-2000:])
    # What the kill left: no summary, and each export in place is whole (the reference's).
    left = _files(out)
    assert "summary.json" not in left and "checkpoints" in {p.name for p in out.iterdir()}
    if point.endswith((".safetensors", ".json")):  # killed in the middle of that very write
        (partial,) = out.rglob(f".{point}.tmp")
        assert (partial.stat().st_size > 0) == (point != "summary.json"), partial
    for name in ("adapters.safetensors", "peft/adapter_model.safetensors",
                 "hf/model.safetensors"):
        if name in left:
            assert left[name].read_bytes() == (reference / name).read_bytes(), name

    again = _run(env, tmp_path, "-m", "effijax")
    assert again.returncode == 0, again.stderr[-2000:]
    assert (f"the run reached step {STEPS} in {out.resolve()}/checkpoints but stopped before its "
            "end was written; completing it") in again.stdout, again.stdout
    assert f"done: {STEPS} steps (the run's end completed)" in again.stdout, again.stdout

    got, want = _files(out), _files(reference)
    assert sorted(got) == sorted(want)  # nothing missing, no temporary file left
    # The lock file stays after a run, naming its last holder (host, process, time).
    for name in sorted(set(want) - {"summary.json", "metrics.jsonl", "config.json",
                                    LOCK_FILE}):
        assert got[name].read_bytes() == want[name].read_bytes(), name
    assert _metrics(out) == _metrics(reference)
    summary, expected = (json.loads((d / "summary.json").read_text()) for d in (out, reference))
    assert (summary["start_step"], expected["start_step"]) == (STEPS, 0)
    # The starting parameters' loss is read back from config.json, not measured again.
    assert summary["eval_loss_start"] == expected["eval_loss_start"]
    assert _without(summary, TIMINGS | SESSION) == _without(expected, TIMINGS | SESSION)
    config, first = (json.loads((d / "config.json").read_text()) for d in (out, reference))
    assert [r["step"] for r in config.pop("resumes")] == [STEPS]
    assert config == first
