"""GRPO writes a sample of its rollouts to the run directory: ``completions.jsonl``,
one line a step, the step's first prompt and its group of completions with their rewards and
advantages, next to ``metrics.jsonl``. The recipe runs in-process on tests/test_grpo_recipe.py's
tiny model (a fresh run starts the file anew); how the loop writes the lines and a resume cuts
them back is checked on the loop's own pieces, without compiling."""

import json

import jax
import numpy as np
import pytest
from _llama_files import VOCAB_SIZE, write_gguf, write_sum_prompts

from effijax.checkpoint import truncate_metrics
from effijax.cli import main as cli_main
from effijax.models import llama_config
from effijax.recipe import ROLLOUT_METRICS
from effijax.recipe._loop import _following, records_log
from effijax.recipe._objective import COMPLETIONS, ROLLOUT_SAMPLES
from effijax.run import RunDir

SEQ, T, G = 32, 8, 4
TINY = llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=SEQ)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo_samples")
    write_gguf(d / "tiny.gguf", TINY, jax.jit(TINY.init_params)(jax.random.key(0)))
    write_sum_prompts(d / "prompts.jsonl")
    return d


def _argv(files, out, steps):
    return ["train", "--objective", "grpo", "--from", str(files / "tiny.gguf"), "--data",
            str(files / "prompts.jsonl"), "--num-generations", str(G),
            "--max-completion-length", str(T), "--seq-len", str(SEQ), "--steps", str(steps),
            "--lora-rank", "2", "--batch-size", "8", "--rewards",
            "exact_match,_grpo_rewards:low_ids", "--reward-weights", "1,0.5",
            "--no-checkpoints", "--no-progress", "--out", str(out)]


def _lines(out, name):
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def run(files):
    """2 steps into a folder holding an older run's completions.jsonl."""
    out = files / "run"
    out.mkdir()
    (out / COMPLETIONS).write_text('{"step": 1, "stale": true}\n')
    assert cli_main(_argv(files, out, 2)) == 0
    return _lines(out, COMPLETIONS), _lines(out, "metrics.jsonl")


def test_each_step_logs_its_first_prompt_and_its_group(files, run):
    lines, metrics = run  # the older run's line is gone
    assert [line["step"] for line in lines] == [r["step"] for r in metrics] == [1, 2]
    prompts = [json.loads(line) for line in (files / "prompts.jsonl").read_text().splitlines()]
    for line in lines:
        assert {"prompt": line["prompt"], **line["columns"]} in prompts
        rows = line["completions"]
        assert len(rows) == G
        for row in rows:
            assert set(row["rewards"]) == {"exact_match", "low_ids"}
            assert row["reward"] == pytest.approx(row["rewards"]["exact_match"]
                                                  + 0.5 * row["rewards"]["low_ids"], abs=1e-6)
            assert 1 <= row["tokens"] <= T and isinstance(row["completion"], str)
            assert row["finished"] or row["tokens"] == T
        # The group-relative advantages: (r - mean) / (std + 1e-4), TRL's, within the group.
        rewards = np.array([row["reward"] for row in rows])
        expected = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-4)
        np.testing.assert_allclose([row["advantage"] for row in rows], expected, atol=1e-5)
    # Different steps sample different prompts or completions.
    assert len({json.dumps(line) for line in lines}) == 2


def _record(step):
    return {"step": step, "prompt": "1+1", "columns": {}, "completions": [
        {"completion": "2", "rewards": {"exact_match": 1.0}, "reward": 1.0, "advantage": 0.5,
         "tokens": 2, "finished": True}] * 2}


def test_the_loop_writes_each_steps_record_and_keeps_it_out_of_the_metrics(tmp_path):
    run_dir = RunDir(tmp_path)
    (tmp_path / COMPLETIONS).write_text(json.dumps(_record(9)) + "\n")
    state = {"params": 0}

    def step(state, batch):
        assert ROLLOUT_METRICS not in batch  # host-side values never reach the step
        return state, {"loss": 1.0}

    tracked, _ = _following(step, None, records_log(run_dir, 0, COMPLETIONS))
    for k in (1, 2):
        _, metrics = tracked(state, {"inputs": 0, ROLLOUT_METRICS: {
            "reward": 0.5, ROLLOUT_SAMPLES: _record(k)}})
        assert metrics == {"loss": 1.0, "reward": 0.5}
    # A run from step 0 started the file anew; a resumed one appends to what it holds.
    assert _lines(tmp_path, COMPLETIONS) == [_record(1), _record(2)]
    tracked, _ = _following(step, None, records_log(run_dir, 2, COMPLETIONS))
    tracked(state, {ROLLOUT_METRICS: {ROLLOUT_SAMPLES: _record(3)}})
    assert [line["step"] for line in _lines(tmp_path, COMPLETIONS)] == [1, 2, 3]


def test_a_resume_cuts_the_file_back_to_its_checkpoints_step(tmp_path):
    # What the recipe does to it on resuming (recipe/_state.py), as to metrics.jsonl: the lines
    # of a killed run's steps after the checkpoint are dropped, each step's group kept whole.
    path = tmp_path / COMPLETIONS
    path.write_text("".join(json.dumps(_record(k)) + "\n" for k in (1, 2, 3, 4)))
    assert truncate_metrics(path, 2) == 2
    assert _lines(tmp_path, COMPLETIONS) == [_record(1), _record(2)]


def test_a_link_planted_at_the_file_is_refused_before_anything_runs(files, tmp_path, capsys):
    out, outside = tmp_path / "run", tmp_path / "outside.txt"
    out.mkdir()
    outside.write_text("precious")
    (out / COMPLETIONS).symlink_to(outside)
    assert cli_main(_argv(files, out, 2)) == 2
    assert f"{COMPLETIONS} -> {outside} (a symbolic link)" in capsys.readouterr().err
    assert outside.read_text() == "precious"
