"""The experiments' CI smoke presets run end to end and show the effect they are about."""

import dataclasses
import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name):
    # "experiment_" keeps it apart from the benchmark script of the same name in one worker
    module_name = f"experiment_{name}"
    spec = importlib.util.spec_from_file_location(module_name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_precision_smoke(tmp_path):
    precision = _load("precision")
    cfg = dataclasses.replace(precision.PRESETS["smoke"], out=str(tmp_path))
    results = precision.main(cfg)
    steps = cfg.steps
    under, normal = results["underflow"], results["normal"]
    # Unscaled fp16 gets all-zero gradients when the loss sits below fp16's range...
    assert under["fp16"]["zero_grad_steps"] == steps
    # zero gradients -> Adam's update is exactly 0: the model never moves
    assert under["fp16"]["eval_loss"] == under["fp16"]["init_eval_loss"]
    # ...while dynamic scaling and bf16 learn like fp32.
    for label in ("fp32", "bf16", "fp16+dynamic"):
        assert under[label]["zero_grad_steps"] == 0
        assert under[label]["final_lm_loss"] < under[label]["first_lm_loss"] - 0.3
        assert under[label]["eval_loss"] < under[label]["init_eval_loss"] - 0.3
    assert abs(under["fp16+dynamic"]["final_lm_loss"] - under["fp32"]["final_lm_loss"]) < 0.1
    # The 2^24 initial scale overflows at first and is backed off.
    assert normal["fp16+dynamic"]["skipped_steps"] >= 1
    assert (tmp_path / "precision.png").stat().st_size > 1000
    assert (tmp_path / "results.json").exists()


@pytest.mark.slow
def test_lora_smoke(tmp_path):
    import json

    from effijax.models import gpt_config

    experiment = _load("lora")
    cfg = dataclasses.replace(experiment.PRESETS["smoke"], out=str(tmp_path))
    results = experiment.main(cfg)
    variants = results["variants"]
    assert list(variants) == ["full", *(f"lora-r{r}" for r in cfg.ranks)]
    full = variants["full"]
    assert full["trainable_params"] == results["base"]["params"]
    # Adapted matrices of one block, (d_in, d_out): attention q, k, v, o and MLP fc_in, fc_out.
    model = gpt_config(cfg.model, seq_len=cfg.seq_len)
    d, f = model.d_model, model.d_ff
    matrices = [(d, d)] * 4 + [(d, f), (f, d)]
    for r in cfg.ranks:
        v = variants[f"lora-r{r}"]
        assert v["trainable_params"] == model.n_layers * sum(r * (i + o) for i, o in matrices)
        # Adam's two moments per trainable parameter: the optimizer state shrinks with them.
        fraction = v["trainable_params"] / full["trainable_params"]
        assert abs(v["opt_state_bytes"] / full["opt_state_bytes"] / fraction - 1) < 0.01
        # The step returns the adapters and their moments, not the base and its moments.
        assert v["memory"]["output_bytes"] < full["memory"]["output_bytes"]
        assert v["model_states_formula_bytes"] < full["model_states_formula_bytes"]
    for label, v in variants.items():
        assert v["loss_B_before"] == results["base"]["loss_B"], label
        assert v["loss_B"] < v["loss_B_before"], label  # every variant learned the new corpus
        assert v["step_time_ms"] > 0 and v["memory"]["total_bytes"] > 0
    assert (tmp_path / "lora.png").stat().st_size > 1000
    assert json.loads((tmp_path / "results.json").read_text())["variants"].keys() == \
        variants.keys()


@pytest.fixture(scope="module")
def tiny_chat_gguf(tmp_path_factory):
    """A tiny random Llama GGUF with a chat template (the stand-in for SmolLM2), and its
    config: written once for the fine-tuning and preference runs, which only read it."""
    import jax
    from _llama_files import VOCAB_SIZE, write_gguf

    from effijax.models import llama_config

    model = llama_config("llama-tiny", vocab_size=VOCAB_SIZE, seq_len=256)
    gguf = tmp_path_factory.mktemp("tiny-chat-gguf") / "tiny.gguf"
    write_gguf(gguf, model, jax.jit(model.init_params)(jax.random.key(0)))
    return gguf, model


@pytest.mark.slow
def test_finetune_smoke(tmp_path, tiny_chat_gguf):
    # A tiny Llama GGUF with a chat template stands in for SmolLM2 (the default preset's
    # model): the same path through data, training, generation and scoring, in seconds.
    import json

    gguf, model = tiny_chat_gguf
    experiment = _load("finetune")
    # Through --model gemma3's chat template file (the tiny vocabulary spells its turn markers
    # in bytes, hence the longer rows): the base model's answers and every variant's data and
    # answers use it.
    template = experiment.MODELS["gemma3"][0]["chat_template"]
    cfg = dataclasses.replace(experiment.PRESETS["smoke"], out=str(tmp_path / "out"),
                              model_from=str(gguf), chat_template=template, seq_len=256)
    results = experiment.main(cfg)
    variants = results["variants"]
    assert list(variants) == ["LoRA r=2", "full"]
    lora, full = variants["LoRA r=2"], variants["full"]
    # Rank 2 on q, k, v, o (64x64, 64x32 for k and v), gate, up (64x128), down (128x64).
    assert lora["trainable_params"] == 2 * 2 * (2 * 128 + 2 * 96 + 3 * 192)
    assert full["trainable_params"] == model.num_params
    assert lora["model_states_bytes"] < full["model_states_bytes"]
    for v in variants.values():
        assert v["eval_loss_before"] > 0 and v["eval_loss_after"] > 0
        assert len(v["answers"]) == results["scored"] == cfg.held_out
        assert 0.0 <= v["exact_match"] <= 1.0
        # lm-evaluation-harness's exact match on a task over the same held-out records.
        assert 0.0 <= v["harness_exact_match"] <= 1.0
    assert 0.0 <= results["base"]["harness_exact_match"] <= 1.0
    assert (tmp_path / "out" / "harness" / "held_out.jsonl").read_text().count("\n") == 2
    # The same starting model and validation set for every variant.
    assert lora["eval_loss_before"] == full["eval_loss_before"]
    assert results["records"] > 300
    assert (tmp_path / "out" / "finetune.png").stat().st_size > 1000
    assert json.loads((tmp_path / "out" / "results.json").read_text())["scored"] == 2
    run = json.loads((tmp_path / "out" / "LoRAr2" / "config.json").read_text())["run"]
    assert run["chat_template"].startswith("{#- Gemma's turn format")
    # Every variant at the experiment's precision (fp32: docs/benchmarks.md's tables), not auto's.
    assert {json.loads((tmp_path / "out" / d / "config.json").read_text())["precision"]
            for d in ("LoRAr2", "full")} == {cfg.precision} == {"fp32"}


def test_preference_pairs_split_by_question():
    # No held-out question, answer or function object (os.path.join is posixpath.join) is
    # seen in training, and every rejected answer is another function's.
    from effijax.data import stdlib_qa

    experiment = _load("preference")
    records = stdlib_qa()
    training, held = experiment.build_pairs(records, 0.2, seed=0)
    assert len(training) + len(held) == len(records)  # every question, once
    assert 0.15 < len(held) / len(records) < 0.25
    assert not {p.group for p in training} & {p.group for p in held}
    assert not {p.prompt for p in training} & {p.prompt for p in held}
    seen = {p.chosen for p in training} | {p.rejected for p in training}
    assert not seen & ({p.chosen for p in held} | {p.rejected for p in held})
    functions = {p.function for p in held}
    twins = [f.replace("posixpath.", "os.path.") for f in functions if f.startswith("posixpath.")]
    assert twins and all(twin in functions for twin in twins)
    for p in training + held:
        assert p.chosen != p.rejected and p.kind in experiment.KINDS
    # The same seed, the same pairs; another seed, another split.
    assert experiment.build_pairs(records, 0.2, seed=0)[1] == held
    assert experiment.build_pairs(records, 0.2, seed=1)[1] != held


@pytest.mark.slow
def test_preference_smoke(tmp_path, tiny_chat_gguf):
    # DPO under LoRA on a tiny random Llama GGUF with a chat template (the default preset's
    # SmolLM2 takes minutes): pairs, training, scoring and greedy answers, end to end.
    import json

    import numpy as np

    gguf, _ = tiny_chat_gguf
    experiment = _load("preference")
    cfg = dataclasses.replace(experiment.PRESETS["smoke"], out=str(tmp_path / "out"),
                              model_from=str(gguf))
    results = experiment.main(cfg)
    out = tmp_path / "out"
    lines = {name: [json.loads(x) for x in (out / f"pairs_{name}.jsonl").read_text().splitlines()]
             for name in ("train", "held_out")}
    assert len(lines["train"]) == results["pairs"]["training"] > 0
    assert len(lines["held_out"]) == len(results["held_out"]) == results["pairs"]["held_out"] > 0
    assert not {r["prompt"] for r in lines["train"]} & {r["prompt"] for r in lines["held_out"]}
    assert json.loads((out / "dpo" / "config.json").read_text())["objective"] == "dpo"
    assert (out / "dpo" / "adapters.safetensors").exists()
    before, after = results["before"], results["after"]
    # Before training the policy is the reference: every reward is 0, every pair a tie.
    assert before["reward_accuracy"] == 0.5 and before["reward_margin"] == 0.0
    for numbers in (before, after, *before["by_kind"].values(), *after["by_kind"].values()):
        for key in ("reward_accuracy", "logp_preference", "closer", "exact_match"):
            assert 0.0 <= numbers[key] <= 1.0, key
    # The summaries agree with the per-pair log-probabilities they come from.
    logps_before = np.array([p["logps_before"] for p in results["held_out"]])
    logps_after = np.array([p["logps_after"] for p in results["held_out"]])
    assert (logps_before < 0).all() and (logps_after < 0).all()
    margins = cfg.beta * ((logps_after - logps_before) @ np.array([1.0, -1.0]))
    assert after["reward_accuracy"] == np.mean(np.sign(margins) / 2 + 0.5)
    assert np.isclose(after["reward_margin"], margins.mean())
    assert before["logp_preference"] == np.mean(np.sign(logps_before @ [1.0, -1.0]) / 2 + 0.5)
    assert json.loads((out / "results.json").read_text())["pairs"] == results["pairs"]


def test_sharding_smoke(tmp_path):
    # Layouts only (no compile): the 1-D sweep and the 2-D meshes with a tensor axis.
    experiment = _load("sharding")
    cfg = dataclasses.replace(experiment.PRESETS["smoke"], out=str(tmp_path))
    results = experiment.main(cfg)
    rows = results["rows"]
    assert len(rows) == len(cfg.strategies) * len(cfg.devices)
    tensor_rows = results["tensor_rows"]
    assert [(r["mesh"], r["strategy"]) for r in tensor_rows] == [
        ({"data": 1, "fsdp": 2, "tensor": 4}, "fsdp"), ({"data": 1, "fsdp": 1, "tensor": 8}, "ddp"),
        ({"data": 2, "fsdp": 1, "tensor": 4}, "zero1")]
    for r in rows + tensor_rows:
        # estimate_tree with the tensor layout is exact where every divisible leaf is split.
        assert r["estimate_matches_layout"], r
        assert r["measured"] == r["estimate"] + r["leftover"]
    psi = rows[0]["num_params"]
    by_mesh = {tuple(r["mesh"].values()): r for r in tensor_rows}
    # The closed form splits all Ψ by t (and by fsdp under FSDP): 16Ψ/8 for fsdp=2 x tensor=4
    # and tensor=8; ZeRO-1 on data=2 x tensor=4 shards nothing over fsdp=1: 16Ψ/4.
    assert by_mesh[(1, 2, 4)]["zero_paper_mixed"] == by_mesh[(1, 1, 8)]["zero_paper_mixed"] \
        == 16 * psi // 8
    assert by_mesh[(2, 1, 4)]["zero_paper_mixed"] == 16 * psi // 4
    # Measured: more than the closed form by what the layout keeps whole (norms, positions),
    # and a tensor=8 device holds less than a tensor=4 one.
    for r in tensor_rows:
        assert r["zero_paper_mixed"] < r["measured"]
    assert by_mesh[(1, 1, 8)]["measured"] < by_mesh[(2, 1, 4)]["measured"] / 1.8
    assert (tmp_path / "sharding.png").stat().st_size > 1000
