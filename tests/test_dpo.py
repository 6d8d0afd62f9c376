"""DPO through the recipe (`effijax train --objective dpo`, LoRA or full): preference pairs read
and rendered as chat data is, the loss against the base with the adapters off (LoRA) or a frozen
copy of the starting weights (full fine-tuning), TRL's metrics in
metrics.jsonl, one-line errors, and the objective seam leaving SFT runs and their resume as
they were. The losses' own parity with TRL is tests/test_preference.py's; SimPO and ORPO,
the reference-free objectives on the same pairs, are tests/test_simpo_orpo.py's."""

import dataclasses
import json
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compiles import compiles
from _llama_files import VOCAB_SIZE, chat_tokenizer
from _pairs import write_model_and_pairs

from effijax.cli import main as cli_main
from effijax.errors import ConfigError
from effijax.lora import LoraSpec
from effijax.lora import init as lora_init
from effijax.models import llama_config
from effijax.objectives import DPO_LOSS_TYPES, dpo_loss
from effijax.recipe import TrainConfig, evaluate_metrics, plan_job
from effijax.recipe._config import DPO_LOSSES, OBJECTIVES
from effijax.recipe._identity import check_resume, identity
from effijax.recipe._objectives import OBJECTIVES as REGISTRY
from effijax.recipe._objectives import get_objective
from effijax.recipe._pairs import (
    PAIR_METRICS,
    completion_window,
    load_pairs,
    pair_batch,
    pair_eval_batches,
    pair_rows,
    read_pairs,
)

SEQ = 32
TINY = llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=SEQ)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_model_and_pairs(tmp_path_factory.mktemp("dpo"), TINY)


@pytest.fixture(scope="module")
def run(files):
    """`effijax train --objective dpo` for 4 steps: its metrics.jsonl records."""
    out = files / "run"
    assert cli_main(["train", "--objective", "dpo", "--from", str(files / "tiny.gguf"),
                     "--lora-rank", "2", "--data", str(files / "pairs.jsonl"), "--steps", "4",
                     "--batch-size", "4", "--seq-len", str(SEQ), "--eval-batches", "2",
                     "--no-progress", "--out", str(out)]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_dpo_run_writes_trls_metrics(run):
    assert [r["step"] for r in run] == [1, 2, 3, 4]
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                 "logps/chosen", "logps/rejected", "tokens", "loss"):
        assert all(math.isfinite(r[name]) for r in run), name
    assert "lm_loss" not in run[0]


def test_at_the_adapters_init_the_policy_is_the_reference(run):
    # B = 0: the policy is the base, so the reference must be the base with the adapters off.
    # To f32 rounding, not to the bit: the policy's forward and the reference's are two
    # computations in one program, which XLA:CPU may fuse and reduce in different orders (the
    # legacy fusion emitters the suite compiles with do: a reward of 4.8e-8, the log-probability
    # -11.3 apart by half an ulp; the bound is 20 times that).
    first = run[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert first[name] == pytest.approx(0.0, abs=1e-6), name
    assert first["logps/chosen"] < 0 and first["logps/rejected"] < 0


def _unfused_logps(logits_BSV, batch):
    logp_BSV = jax.nn.log_softmax(logits_BSV.astype(jnp.float32), axis=-1)
    picked_BS = jnp.take_along_axis(logp_BSV, batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(batch["mask"] != 0, picked_BS, 0.0), axis=1)


@pytest.fixture(scope="module")
def unfused(files):
    """Random adapters on the tiny base, a batch of 2 pairs, and the unfused log-probabilities
    of its rows with the adapters (the policy) and without them (the reference)."""
    model = dataclasses.replace(TINY, tokenizer=chat_tokenizer())
    base = model.init_params(jax.random.key(0))
    spec = LoraSpec(rank=2, alpha=8.0, targets=model.lora_targets)
    leaves, treedef = jax.tree.flatten(lora_init(jax.random.key(1), base, spec))
    keys = jax.random.split(jax.random.key(3), len(leaves))
    adapters = treedef.unflatten([0.1 * jax.random.normal(k, x.shape, x.dtype)
                                  for k, x in zip(keys, leaves, strict=True)])
    batch = pair_batch(load_pairs(str(files / "pairs.jsonl"), model).train, seed=0, step=0,
                       batch_size=4, seq_len=SEQ)
    policy = jax.jit(model.logits_fn(spec))({"base": base, "adapters": adapters},
                                            batch["inputs"])
    reference = jax.jit(model.logits_fn())(base, batch["inputs"])
    return SimpleNamespace(model=model, base=base, spec=spec, adapters=adapters, batch=batch,
                           logps=_unfused_logps(policy, batch), ref=_unfused_logps(reference,
                                                                                   batch))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_a_batchs_loss_is_dpo_loss_of_the_unfused_log_probabilities(unfused, loss_type):
    u = unfused
    job = plan_job(u.model, "fp32", optax.sgd(0.0), batch_size=4, lora=u.spec, masked=True,
                   segmented=False, objective=get_objective("dpo"),
                   objective_settings={"beta": 0.1, "loss_type": loss_type})
    got, metrics = job.eval_step(u.adapters, {**u.batch, "base": u.base})
    logps, ref = u.logps, u.ref
    counts = jnp.sum(u.batch["mask"] != 0, axis=1)
    want, wanted = dpo_loss(logps[0::2], logps[1::2], ref[0::2], ref[1::2],
                            loss_type=loss_type, chosen_counts=counts[0::2],
                            rejected_counts=counts[1::2])
    assert abs(float(logps[0] - ref[0])) > 1e-3  # the adapters do change the policy
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    # The evaluation's metrics are the loss's, TRL's names (what eval_rewards/... average).
    assert sorted(metrics) == sorted(PAIR_METRICS)
    for name in PAIR_METRICS:
        np.testing.assert_allclose(float(metrics[name]), float(wanted[name]), rtol=1e-5,
                                   atol=1e-6, err_msg=name)


def test_the_run_scores_only_its_completions_window(unfused, files):
    # What a run plans with: the pairs' longest completion span, rounded up to 16, under the
    # rows' 32 positions; the loss is the whole rows' (tests/test_preference.py: the window's
    # log-probabilities and gradients are the whole row's).
    data = load_pairs(str(files / "pairs.jsonl"), unfused.model)
    window = completion_window(data)["window"]
    assert window == 16 < SEQ
    u = unfused
    job = plan_job(u.model, "fp32", optax.sgd(0.0), batch_size=4, lora=u.spec, masked=True,
                   segmented=False, objective=get_objective("dpo"),
                   objective_settings={"window": window})
    got = float(job.eval_step(u.adapters, {**u.batch, "base": u.base})[0])
    counts = jnp.sum(u.batch["mask"] != 0, axis=1)
    want, _ = dpo_loss(u.logps[0::2], u.logps[1::2], u.ref[0::2], u.ref[1::2],
                       chosen_counts=counts[0::2], rejected_counts=counts[1::2])
    np.testing.assert_allclose(got, float(want), rtol=1e-5)


def test_pairs_are_adjacent_rows_with_the_completion_masked(files):
    tok = chat_tokenizer()
    pairs = read_pairs(str(files / "pairs.jsonl"))[:2]
    rows = pair_rows(tok, pairs, SEQ)
    assert rows.tokens_NW.shape == (4, SEQ + 1)
    for i, pair in enumerate(pairs):
        for j, completion in enumerate((pair.chosen, pair.rejected)):
            ids, mask = rows.tokens_NW[2 * i + j], rows.mask_NW[2 * i + j]
            assert tok.decode(ids[mask == 1]).startswith(completion)
    batch = pair_batch(rows, seed=0, step=5, batch_size=4, seq_len=SEQ)
    # Row 2i is a pair's chosen side, 2i+1 its rejected side: the same prompt.
    assert batch["inputs"].shape == (4, SEQ)
    np.testing.assert_array_equal(batch["inputs"][0, :6], batch["inputs"][1, :6])


@pytest.mark.parametrize("line, problem", [
    ('{"prompt": "a", "chosen": "b"}', "no 'rejected'"),
    ('{"prompt": "a", "chosen": " ", "rejected": "c"}', "the chosen completion is empty"),
    ('{"prompt": "a", "chosen": 3, "rejected": "c"}', "'chosen' is a int, not a string"),
    ("[1]", "a JSON list, not an object"),
    ("{", "not valid JSON"),
])
def test_a_bad_record_is_one_line_naming_its_file_and_line(tmp_path, line, problem):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n' + line + "\n")
    with pytest.raises(ConfigError) as e:
        read_pairs(str(path))
    assert f"data='{path}:2': {problem}" in str(e.value) and "\n" not in str(e.value)


def test_a_pair_longer_than_a_row_is_refused_not_cut(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "the " * 40, "chosen": "1", "rejected": "2"}) + "\n")
    with pytest.raises(ConfigError, match=r"p.jsonl:1': the chosen side is \d+ tokens, over the "
                       r"17 of a row \(seq_len \+ 1\); raise --seq-len"):
        pair_rows(chat_tokenizer(), read_pairs(str(path)), 16)


def test_bad_dpo_settings_are_refused_before_compiling(files, tmp_path, capsys):
    with compiles() as compiled:
        assert cli_main(["train", "--objective", "dpo", "--from", str(files / "tiny.gguf"),
                         "--data", str(files / "pairs.jsonl"), "--frozen-dtype", "nf4",
                         "--out", str(tmp_path / "run")]) == 2
    assert compiled == []
    err = capsys.readouterr().err.strip()
    assert "--frozen-dtype='nf4': dpo's reference copy (full fine-tuning) is kept in a " \
           "floating dtype" in err and len(err.splitlines()) == 1, err
    with pytest.raises(ConfigError, match="frozen_dtype='bf16': only applies to LoRA"):
        TrainConfig(frozen_dtype="bf16")  # sft holds no reference
    with pytest.raises(ConfigError, match="batch_size=5: counts rows"):
        TrainConfig(objective="dpo", data="p.jsonl", model_from="x.gguf", lora_rank=2,
                    batch_size=5)
    with pytest.raises(ConfigError, match="beta=0.2: only applies to --objective dpo"):
        TrainConfig(beta=0.2)


def _full_argv(files, out, steps):
    return ["train", "--objective", "dpo", "--from", str(files / "tiny.gguf"), "--data",
            str(files / "pairs.jsonl"), "--steps", str(steps), "--batch-size", "4", "--seq-len",
            str(SEQ), "--eval-batches", "1", "--checkpoint-every", "2", "--lr", "1e-3",
            "--no-progress", "--out", str(out)]


def _losses(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_full_dpo_starts_at_its_reference_and_resumes_against_the_same_one(files, tmp_path,
                                                                          capsys):
    # Full fine-tuning: the reference is a frozen copy of the starting weights (the GGUF's).
    assert cli_main(_full_argv(files, tmp_path / "whole", 4)) == 0
    # The copy's bytes on the start-up line: the model's 107,840 parameters in float32.
    out = capsys.readouterr().out
    assert ", reference copy 431.36 KB (float32)" in out
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    accuracy = summary["eval_rewards/accuracies"]  # the done line says it
    assert f", eval reward accuracy {accuracy:.1%}, " in out
    whole = _losses(tmp_path / "whole")
    assert whole[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference
    assert whole[0]["rewards/margins"] == 0.0
    assert whole[-1]["loss"] != whole[0]["loss"] and whole[-1]["rewards/margins"] != 0.0
    assert {f"eval_{name}" for name in PAIR_METRICS} <= set(summary)
    assert 0.0 <= summary["eval_rewards/accuracies"] <= 1.0
    # Stopped at 2 and resumed to 4: the reference is made again from the source, not from
    # the resumed weights, so the losses are the uninterrupted run's.
    assert cli_main(_full_argv(files, tmp_path / "split", 2)) == 0
    assert cli_main([*_full_argv(files, tmp_path / "split", 4), "--allow-changes",
                     "steps"]) == 0
    assert [r["loss"] for r in _losses(tmp_path / "split")] == [r["loss"] for r in whole]


def test_full_dpos_loss_is_dpo_loss_against_the_copy(unfused, files):
    u = unfused
    job = plan_job(u.model, "fp32", optax.sgd(0.0), batch_size=4, masked=True,
                   segmented=False, objective=get_objective("dpo"), frozen_dtype="float32")
    assert jax.tree.structure(job.frozen) == jax.tree.structure(u.base)
    keys = jax.random.split(jax.random.key(5), len(jax.tree.leaves(u.base)))
    moved = jax.tree.unflatten(jax.tree.structure(u.base), [
        x + 0.02 * jax.random.normal(k, x.shape, x.dtype)
        for x, k in zip(jax.tree.leaves(u.base), keys, strict=True)])
    got = float(job.eval_step(moved, {**u.batch, "reference": u.base})[0])
    logps = _unfused_logps(jax.jit(u.model.logits_fn())(moved, u.batch["inputs"]), u.batch)
    counts = jnp.sum(u.batch["mask"] != 0, axis=1)
    want, _ = dpo_loss(logps[0::2], logps[1::2], u.ref[0::2], u.ref[1::2],
                       chosen_counts=counts[0::2], rejected_counts=counts[1::2])
    assert abs(float(logps[0] - u.ref[0])) > 1e-3  # the moved weights do change the policy
    np.testing.assert_allclose(got, float(want), rtol=1e-5)
    # Evaluation: each metric the mean of its validation batches', the copy in each batch.
    val = load_pairs(str(files / "pairs.jsonl"), u.model).val
    found = evaluate_metrics(job, moved, val, num_batches=2, frozen=u.base)
    each = [job.eval_step(moved, {**{k: jnp.asarray(v) for k, v in b.items()},
                                  "reference": u.base})
            for b in pair_eval_batches(val, batch_size=4, seq_len=SEQ, num_batches=2)]
    assert found["loss"] == pytest.approx(np.mean([float(v) for v, _ in each]), rel=1e-6)
    assert found["rewards/accuracies"] == pytest.approx(
        np.mean([float(m["rewards/accuracies"]) for _, m in each]), rel=1e-6)
    with pytest.raises(ConfigError, match="reference copy is kept in a floating dtype"):
        plan_job(u.model, "fp32", optax.sgd(0.0), batch_size=4, masked=True, segmented=False,
                 objective=get_objective("dpo"), frozen_dtype="nf4")


def test_an_old_config_without_an_objective_is_sft_and_the_same_run():
    old = {"seed": 0, "batch_size": 8, "precision": "fp32", "loss_scale": "none",
           "accumulate": 1, "lora_rank": None, "steps": 10, "lr": 1e-3,
           "run": {"corpus_sha256": "ab", "model_config": {"family": "gpt", "seq_len": 32}}}
    assert TrainConfig.from_dict(old).objective == "sft"
    new = {**old, **{k: v for k, v in TrainConfig().to_dict().items()
                     if k in ("objective", "beta", "dpo_loss", "label_smoothing",
                              "simpo_gamma", "cpo_alpha")}}
    assert identity(old) == identity(new)
    assert check_resume(old, new, (), where="ckpt") == {}
    dpo = {**new, "objective": "dpo", "lora_rank": 2}
    with pytest.raises(ConfigError, match="objective 'sft' -> "):
        check_resume({**old, "lora_rank": 2}, dpo, (), where="ckpt")


def test_the_config_lists_the_registrys_objectives_and_losses():
    assert OBJECTIVES == tuple(REGISTRY) and DPO_LOSSES == tuple(DPO_LOSS_TYPES)


def _train_argv(files, out, steps):
    return ["train", "--objective", "dpo", "--from", str(files / "tiny.gguf"), "--lora-rank", "2",
            "--data", str(files / "pairs.jsonl"), "--steps", str(steps), "--batch-size", "4",
            "--seq-len", str(SEQ), "--eval-batches", "1", "--checkpoint-every", "2",
            "--no-progress", "--out", str(out)]


def test_a_dpo_run_resumes_as_the_run_it_continues(files, tmp_path):
    # 2 steps, then on to 4: the same losses as 4 steps in one go.
    assert cli_main(_train_argv(files, tmp_path / "whole", 4)) == 0
    assert cli_main(_train_argv(files, tmp_path / "split", 2)) == 0
    _recorded_without(tmp_path / "split", ("simpo_gamma", "cpo_alpha"))  # before SimPO
    assert cli_main([*_train_argv(files, tmp_path / "split", 4), "--allow-changes",
                     "steps"]) == 0
    whole, split = ([json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl")
                     .read_text().splitlines()] for d in ("whole", "split"))
    assert split == whole
    # Another beta is another run.
    assert cli_main([*_train_argv(files, tmp_path / "split", 6), "--allow-changes", "steps",
                     "--beta", "0.5"]) == 2


def test_an_sft_run_recorded_before_objectives_resumes(tmp_path):
    from effijax.recipe import train

    cfg = TrainConfig(model="tiny", seq_len=16, steps=2, batch_size=2, eval_batches=0,
                      progress=False, out=str(tmp_path / "run"))
    assert train(cfg).status == "done"
    _recorded_without(tmp_path / "run", ("objective", "beta", "dpo_loss", "label_smoothing",
                                         "simpo_gamma", "cpo_alpha"))
    resumed = train(dataclasses.replace(cfg, steps=4, allow_changes="steps"))
    assert resumed.status == "done" and resumed.summary["steps"] == 4
    # resumed from step 2, not restarted
    assert json.loads((tmp_path / "run" / "config.json").read_text())["resumes"]


def _recorded_without(run, keys):
    """``run``'s settings as a run recorded before ``keys`` existed: its config.json and its
    checkpoints' (what a resume compares) without them."""
    steps = sorted(run.glob("checkpoints/*/_CHECKPOINT_METADATA"))
    assert steps
    for path in [run / "config.json", *steps]:
        record = json.loads(path.read_text())
        settings = (record if path.name == "config.json"
                    else record["custom_metadata"]["effijax"]["metadata"]["config"])
        for key in keys:
            del settings[key]
        path.write_text(json.dumps(record))
