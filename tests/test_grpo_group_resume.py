"""GRPO with ``--num-iterations N`` > 1 resumes exactly from a checkpoint inside a rollout
group: the group's rollout (its rows, advantages and the sampling pass's ``old_logps``) is saved
beside the train state and read back, so a run stopped after step 3 of 6 with N = 2 trains on,
from the same rollout, to the uninterrupted run's losses, metrics and completions, to the bit.
A rollout that does not belong to the checkpoint (another seed, group, step, batch size or
rows) is refused; a checkpoint inside a group written before rollouts were saved resumes as it
did then, with a warning.

The three runs (6 steps; 3 steps; resumed to 6) are full fine-tunes of the tiny Llama in this
process, through ``effijax train``; they compile the same programs.
"""

import jax
import numpy as np
import pytest
from _llama_files import VOCAB_SIZE, write_gguf, write_sum_prompts

from effijax.checkpoint import open_checkpoints
from effijax.cli import main as cli_main
from effijax.errors import ConfigError
from effijax.models import llama_config
from effijax.recipe._grpo import ROLLOUT_ITEM, Draw
from effijax.run import read_metrics

SEQ, T, BATCH, N = 32, 8, 8, 2  # seq_len, max completion length, completions, num_iterations
TINY = llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=SEQ)
ROWS = ("inputs", "targets", "mask", "segments", "advantages", "old_logps")


def _argv(files, out, steps):
    # A constant rate, so that the resume's longer --steps changes nothing else.
    return ["train", "--objective", "grpo", "--from", str(files / "tiny.gguf"), "--data",
            str(files / "prompts.jsonl"), "--num-generations", "4", "--max-completion-length",
            str(T), "--seq-len", str(SEQ), "--batch-size", str(BATCH), "--num-iterations",
            str(N), "--rewards", "_grpo_rewards:low_ids", "--lr", "2e-2", "--schedule",
            "constant", "--warmup", "0", "--steps", str(steps), "--no-progress", "--out",
            str(out)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted run (6 steps) and one stopped after step 3, inside the group of steps
    3 and 4, and resumed to 6; the stopped run's step-3 rollout, as its checkpoint holds it."""
    files = tmp_path_factory.mktemp("grpo_group_resume")
    write_gguf(files / "tiny.gguf", TINY, jax.jit(TINY.init_params)(jax.random.key(0)))
    write_sum_prompts(files / "prompts.jsonl")
    whole, split = files / "whole", files / "split"
    assert cli_main(_argv(files, whole, 6)) == 0
    assert cli_main(_argv(files, split, 3)) == 0
    with open_checkpoints(split / "checkpoints", keep=None) as ckpt:
        stopped = ckpt.extra(3)
        record = ckpt.metadata(3)
    assert cli_main([*_argv(files, split, 6), "--allow-changes", "steps"]) == 0
    return whole, split, stopped, record


@pytest.mark.slow  # the three runs of GRPO (13-16 s on 2 busy cores)
def test_a_run_stopped_inside_a_group_resumes_to_the_uninterrupted_runs_numbers(runs):
    whole, split, _, _ = runs
    a, b = read_metrics(whole), read_metrics(split)
    assert [r["step"] for r in b] == list(range(1, 7))
    names = set(a[0]) - {"step_time_s", "tokens_per_s", "wall_time_s", "time"}
    for name in sorted(names):
        assert [r.get(name) for r in b] == [r.get(name) for r in a], name
    # Steps 2, 4 and 6 trained on the rollout sampled the step before (no statistics of
    # their own), with the ratio to its old log-probabilities; step 4 is the resumed one.
    assert ["reward" in r for r in a] == [True, False] * 3
    assert a[3]["loss"] != a[2]["loss"]
    # The same completions, sampled at steps 1, 3 and 5 only: the resume sampled nothing anew.
    samples = read_metrics(split / "completions.jsonl")
    assert samples == read_metrics(whole / "completions.jsonl")
    assert [r["step"] for r in samples] == [1, 3, 5]


@pytest.mark.slow
def test_a_checkpoint_holds_the_rollout_only_inside_a_group(runs):
    whole, split, stopped, record = runs
    assert record["extra"] == [ROLLOUT_ITEM] and list(stopped) == [ROLLOUT_ITEM]
    rollout = stopped[ROLLOUT_ITEM]
    # [seed, the group's first step, the step saved, batch size, num_iterations]
    assert rollout["group"].tolist() == [0, 2, 3, BATCH, N]
    assert sorted(rollout) == sorted([*ROWS, "group"])
    assert rollout["inputs"].shape == (BATCH, SEQ) and rollout["advantages"].shape == (BATCH,)
    # At a group's boundary (step 6 of N = 2) the step holds the state alone, as before.
    for run in (whole, split):
        with open_checkpoints(run / "checkpoints", keep=None) as ckpt:
            assert ckpt.extra(6) == {} and "extra" not in ckpt.metadata(6)
        assert sorted(p.name for p in (run / "checkpoints" / "6").iterdir()
                      if p.is_dir()) == ["state"]


def _draw():
    def sample(*args):
        raise AssertionError("a resumed group samples nothing")

    return Draw(sample, N, SEQ)


@pytest.mark.slow
def test_a_rollout_that_does_not_belong_to_the_checkpoint_is_refused(runs):
    stopped = runs[2]
    kw = {"seed": 0, "step": 3, "batch_size": BATCH, "where": "ckpt/3"}
    draw = _draw()
    draw.resume(stopped, **kw)
    carried = draw.carried(3)[ROLLOUT_ITEM]  # what a checkpoint after step 3 would hold again
    for name, array in stopped[ROLLOUT_ITEM].items():
        np.testing.assert_array_equal(carried[name], array, strict=True, err_msg=name)
    batch = draw(None, params=None, frozen=None, **{k: kw[k] for k in ("seed", "batch_size")},
                 step=3)  # step 4's rows: the kept rollout's
    np.testing.assert_array_equal(batch["old_logps"], stopped[ROLLOUT_ITEM]["old_logps"])
    for change, message in [
            ({"seed": 1}, r"holds the rollout of seed 0, the group of steps 3\.\.4 "
                          r"\(num_iterations 2\), saved after step 3, 8 completions, not this "
                          r"run's at step 3 \(seed 1, "),
            ({"step": 5}, r"not this run's at step 5 \(seed 0, the group of steps 5\.\.6"),
            ({"batch_size": 16}, r"not this run's at step 3 .* 16 completions\)"),
            ({"step": 4}, "holds a rollout, but step 4 ends a group of 2 steps")]:
        with pytest.raises(ConfigError, match=f"checkpoint='ckpt/3': .*{message}"):
            _draw().resume(stopped, **{**kw, **change})
    rows = dict(stopped[ROLLOUT_ITEM])
    rows["old_logps"] = rows["old_logps"][:, :-1]
    with pytest.raises(ConfigError, match=r"'old_logps' as float32\[8, 31\], this run reads "
                       r"float32\[8, 32\]"):
        _draw().resume({ROLLOUT_ITEM: rows}, **kw)
    del rows["old_logps"]
    with pytest.raises(ConfigError, match="not a grpo rollout's"):
        _draw().resume({ROLLOUT_ITEM: rows}, **kw)
    with pytest.raises(ConfigError, match=r"holds \['other'\] beside the state"):
        _draw().resume({**stopped, "other": {"x": np.zeros(1)}}, **kw)


def test_a_checkpoint_inside_a_group_without_a_rollout_resumes_with_a_warning(capsys):
    draw = _draw()
    draw.resume({}, seed=0, step=3, batch_size=BATCH, where="ckpt/3")  # an earlier effijax's
    err = capsys.readouterr().err
    assert "ckpt/3 (step 3) lies inside a group of 2 steps" in err
    assert "from step 4 on the run differs from an uninterrupted one" in err
    draw.resume({}, seed=0, step=4, batch_size=BATCH, where="ckpt/4")  # a boundary: all there
    assert capsys.readouterr().err == ""
    assert draw.carried(4) == {} and _draw().carried(3) == {}


def test_one_update_per_rollout_carries_nothing():
    draw = Draw(lambda *a: ({"inputs": np.zeros((BATCH, SEQ), np.int32)}, {}), 1, SEQ)
    draw(None, params=None, frozen=None, seed=0, step=2, batch_size=BATCH)
    assert draw.carried(2) == draw.carried(3) == {}
