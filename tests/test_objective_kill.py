"""A LoRA run of each objective with its own batches (DPO on pairs, GRPO sampling from the
policy) killed (SIGKILL) after its step-2 checkpoint resumes, in a new process, to the numbers
of the run that was never stopped: every step's loss and TRL-named metric (and GRPO's sampled
completions, ``completions.jsonl``), to the bit.

The killed run is ``effijax train`` in its own process, its batches held at half a second each
(``tests/_slow_batches_train.py``: a slow data pipeline, the same batches) so that the kill
lands while it trains; it is killed as soon as step 2's checkpoint is committed. The
uninterrupted run and the resume run in this process. All three compile as the suite does, the
same programs: the same bits.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from _llama_files import VOCAB_SIZE, write_gguf, write_sum_prompts
from _pairs import write_pairs
from _run_env import run_env

from effijax.checkpoint import latest_step
from effijax.cli import main as cli_main
from effijax.models import llama_config
from effijax.run import read_metrics

pytestmark = pytest.mark.slow  # three runs, one in a process of its own: 10-20 s each

SEQ, STEPS = 32, 6
TINY = llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=SEQ)
SLOW = Path(__file__).with_name("_slow_batches_train.py")
# Each objective's data, command-line settings and the metrics compared.
OBJECTIVES = {
    "dpo": (write_pairs, ["--batch-size", "4", "--eval-batches", "1", "--lr", "1e-2"],
            ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins",
             "rewards/accuracies", "logps/chosen", "logps/rejected")),
    "grpo": (write_sum_prompts, ["--batch-size", "8", "--num-generations", "4",
                                 "--max-completion-length", "8", "--rewards",
                                 "_grpo_rewards:low_ids", "--lr", "2e-2"],
             ("loss", "reward", "reward_std", "completions/mean_length", "grad_norm")),
}


def _killed_after_step_2(argv: list[str], out: Path, env: dict) -> None:
    proc = subprocess.Popen([sys.executable, str(SLOW), *argv, "--out", str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while latest_step(out / "checkpoints") != 2:
            assert proc.poll() is None, f"the run ended before its kill: {proc.communicate()}"
            assert time.monotonic() < deadline, "no step-2 checkpoint within 300 s"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_a_killed_lora_run_resumes_to_the_uninterrupted_runs_numbers(objective, tmp_path):
    write_data, settings, names = OBJECTIVES[objective]
    write_gguf(tmp_path / "tiny.gguf", TINY, jax.jit(TINY.init_params)(jax.random.key(0)))
    write_data(tmp_path / "data.jsonl")
    argv = ["train", "--objective", objective, "--from", str(tmp_path / "tiny.gguf"),
            "--lora-rank", "2", "--data", str(tmp_path / "data.jsonl"), "--steps", str(STEPS),
            "--seq-len", str(SEQ), "--checkpoint-every", "2", "--no-progress", *settings]
    env = {**run_env(tmp_path)["env"], "EFFIJAX_TEST_BATCH_DELAY_S": "0.5"}
    env["PYTHONPATH"] = os.pathsep.join([str(SLOW.parent), env["PYTHONPATH"]])
    assert cli_main([*argv, "--out", str(tmp_path / "whole")]) == 0
    killed = tmp_path / "killed"
    _killed_after_step_2(argv, killed, env)
    assert len(read_metrics(killed)) < STEPS  # it was training when killed
    assert cli_main([*argv, "--out", str(killed)]) == 0
    whole, resumed = read_metrics(tmp_path / "whole"), read_metrics(killed)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for name in names:
        assert [r[name] for r in resumed] == [r[name] for r in whole], name
    assert resumed[-1]["loss"] != resumed[0]["loss"]  # it trained
    if objective == "grpo":  # the same completions sampled, scored and logged
        assert read_metrics(killed / "completions.jsonl") == read_metrics(
            tmp_path / "whole" / "completions.jsonl")
