"""``effijax train --eval-tasks``: harness tasks scored on the live weights during a run (every
``--eval-tasks-every`` steps) and on the trained weights at its end.

One tiny run (the byte-level GPT, 4 steps, tasks every 2, a checkpoint every 2) with two shipped
tasks, a few documents each: a multiple-choice task (``acc``, ``acc_norm``) and a perplexity task
(word and byte perplexity, bits per byte: floats that move with any change of the weights). The
scores it records in ``task_scores.jsonl`` (a record of step 2 and one of step 4) and
``summary.json`` (step 4's) are compared with ``lm_eval.simple_evaluate`` of
:class:`~effijax.harness.EffijaxLM` over the run's checkpoints of those steps (the same weights,
read back): equal, bit for bit.
"""

import json

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="the harness tests need lm-evaluation-harness "
                              "(pip install 'effijax[eval]')")

from effijax.errors import ConfigError  # noqa: E402
from effijax.harness import SHIPPED_TASKS, EffijaxLM, task_manager, task_metrics  # noqa: E402
from effijax.recipe import TrainConfig, train  # noqa: E402
from effijax.run import read_metrics  # noqa: E402

TASKS = "effijax_qa_choice,effijax_docs_perplexity"
LIMIT = 2
STEPS = 4
EVERY = 2


def _config(out, **overrides):
    return TrainConfig(**{"model": "tiny", "seq_len": 64, "steps": STEPS, "batch_size": 2,
                          "eval_batches": 0, "precision": "fp32", "progress": False,
                          "checkpoint_every": EVERY, "out": str(out), "eval_tasks": TASKS,
                          "eval_tasks_limit": LIMIT, "eval_tasks_every": EVERY, **overrides})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_tasks") / "run"
    result = train(_config(out))
    assert result.status == "done"
    return out, result.summary


def _scores_of_checkpoint(out, step):
    """``task_metrics`` of ``simple_evaluate`` over the run's checkpoint of ``step``."""
    from effijax.checkpoint import read_params
    from effijax.generate import Loaded, load

    run = load(str(out))
    params = read_params(out / "checkpoints", step=step,
                         params_abstract=run.model.abstract_params())
    lm = EffijaxLM(loaded=Loaded(run.model, params, tokenizer=run.tokenizer), batch_size=2)
    return task_metrics(lm_eval.simple_evaluate(
        model=lm, tasks=TASKS.split(","), task_manager=task_manager(include_defaults=False),
        limit=LIMIT, bootstrap_iters=0, torch_random_seed=None))


@pytest.mark.slow  # a training run and the harness on it four times: 9 s
def test_scores_recorded_equal_simple_evaluate_of_the_same_weights(run):
    out, summary = run
    records, scores = read_metrics(out), read_metrics(out / "task_scores.jsonl")
    scored = {r["step"]: {k: v for k, v in r.items() if k != "step"} for r in scores}
    assert sorted(scored) == [EVERY, STEPS] and len(scores) == 2
    # metrics.jsonl keeps one record a step, without the scores
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert not any(k.startswith("eval_tasks/") for r in records for k in r)
    assert summary["final_loss_steps"] == STEPS
    final = scored[STEPS]
    assert {k: summary[k] for k in final} == final
    assert json.loads((out / "summary.json").read_text())["eval_tasks/effijax_qa_choice/acc"] \
        == final["eval_tasks/effijax_qa_choice/acc"]
    assert set(final) >= {
        "eval_tasks/effijax_qa_choice/acc", "eval_tasks/effijax_qa_choice/acc_norm",
        "eval_tasks/effijax_docs_perplexity/word_perplexity",
        "eval_tasks/effijax_docs_perplexity/bits_per_byte"}
    assert 1.0 < final["eval_tasks/effijax_docs_perplexity/byte_perplexity"] < 256.0
    # Training moved the weights between the two evaluations: the perplexities moved.
    bpb = "eval_tasks/effijax_docs_perplexity/bits_per_byte"
    assert scored[EVERY][bpb] != final[bpb]
    for step, logged in scored.items():  # the same weights, from the run's checkpoints
        assert logged == _scores_of_checkpoint(out, step), step


@pytest.mark.slow  # lm_eval indexes its own tasks (6 s) to say the name is none of them
def test_an_unknown_task_is_refused_before_anything_is_built(tmp_path):
    with pytest.raises(ConfigError, match="eval_tasks='effijax_qa_choise'.*no such task.*"
                       + ".*".join(SHIPPED_TASKS)):
        train(_config(tmp_path / "run", eval_tasks="effijax_qa_choise"))
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


def test_bad_task_settings_are_refused_before_anything_is_built(tmp_path):
    with pytest.raises(ConfigError, match="eval_tasks='effijax_qa_choice,': expected task "
                       "names separated by commas, such as effijax_offline"):
        train(_config(tmp_path / "run", eval_tasks="effijax_qa_choice,"))
    with pytest.raises(ConfigError, match="eval_tasks_limit=0"):
        _config(tmp_path / "run", eval_tasks_limit=0)
    assert not (tmp_path / "run").exists()
