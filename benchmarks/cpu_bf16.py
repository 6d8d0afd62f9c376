"""bf16 vs f32 on the CPU: XLA:CPU's matmul rate by layout, and the SmolLM2-shaped train step
with the models' plain dots against their CPU backward (``effijax.models._dense``).

Two tables from one process, every variant timed interleaved with the others (harness):

* ``n x n x n`` matmuls (``--matmul-n``, 2048) in each layout a dense layer's forward and
  backward use: ``x @ W`` (forward), ``dy @ Wᵀ`` (input gradient), ``xᵀ @ dy`` (weight gradient),
  in f32, in bf16, and as the plain autodiff's backward computes them from a bf16 layer (f32
  cotangent times bf16 operand). Rates are the best of all timed runs (the machine is shared).
* the train step of a SmolLM2-135M-shaped Llama (random weights; ``--layers`` to shorten it),
  batch ``--batch-size`` x ``--seq-len``, LoRA rank 8 on every projection and full
  fine-tuning, AdamW: f32, bf16 with the plain dots ("plain": the program traced for a TPU, run
  here: the same attention and every dot as ``dot_general`` autodiff made it) and bf16 with the
  CPU backward (what ``effijax train --precision bf16`` runs on this CPU). f32 is the same
  program either way (the CPU backward is for 16-bit operands only).

Goal: bf16 / f32 tokens/s approaching torch's 1.5-1.7x on this CPU (its autocast bf16 LoRA
step against its f32 one).
Run: ``python benchmarks/cpu_bf16.py [--layers 30] [--batch-size 4 --seq-len 128] [--write]``.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import optax
from harness import (
    add_write_flag,
    command_line,
    device_description,
    markdown_table,
    publish,
    time_interleaved,
)

from effijax.lora import LoraSpec
from effijax.models import attention_backend, llama_config
from effijax.recipe import compile_job, init_frozen, init_state, plan_job

# (name, lhs contracting axis, rhs contracting axis) of a 2-D dot_general.
LAYOUTS = (("x @ W", 1, 0), ("dy @ Wᵀ", 1, 1), ("xᵀ @ dy", 0, 0))
# (name, lhs dtype, rhs dtype): the plain autodiff of a bf16 layer multiplies an f32 cotangent.
OPERANDS = (("f32", jnp.float32, jnp.float32), ("bf16", jnp.bfloat16, jnp.bfloat16),
            ("f32 x bf16", jnp.float32, jnp.bfloat16))


def _matmul(n: int, lhs_axis: int, rhs_axis: int, lhs_dtype, rhs_dtype):
    def make():
        a = jax.random.normal(jax.random.key(0), (n, n)).astype(lhs_dtype)
        b = jax.random.normal(jax.random.key(1), (n, n)).astype(rhs_dtype)
        dims = (((lhs_axis,), (rhs_axis,)), ((), ()))
        mm = jax.jit(lambda a, b: jax.lax.dot_general(a, b, dims,
                                                      preferred_element_type=jnp.float32))

        def run():
            mm(a, b).block_until_ready()
        return run
    return make


def train_step(model, params, precision: str, lora: bool, backend: str, batch_size: int):
    """A variant (harness) running one train step of ``model``, AdamW, in ``precision``: of
    LoRA rank 8 adapters on every projection (``lora``) or of all of ``params``, traced for
    ``backend``'s dots, on a fixed batch of random tokens."""
    def make():
        spec = LoraSpec(rank=8, alpha=16, targets=model.lora_targets) if lora else None
        with attention_backend(backend):
            job = plan_job(model, precision, optax.adamw(1e-4, weight_decay=0.01),
                           batch_size=batch_size, lora=spec)
            state = init_state(job) if spec else init_state(job, params)
            step = compile_job(job, census=False).step
        keys = jax.random.split(jax.random.key(2))
        feed = {k: jax.random.randint(key, (batch_size, model.seq_len), 0, model.vocab_size)
                for k, key in zip(("inputs", "targets"), keys, strict=True)}
        if spec:
            feed["base"] = init_frozen(job, params)
        box = [state]

        def run():
            box[0], metrics = step(box[0], feed)
            float(metrics["lm_loss"])
        return run
    return make


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--matmul-n", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=30, help="SmolLM2-135M has 30")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps-per-round", type=int, default=2)
    add_write_flag(ap)
    args = ap.parse_args(argv)

    load_before = os.getloadavg()[0]
    n = args.matmul_n
    variants = {f"{op} {layout}": _matmul(n, la, ra, ld, rd)
                for layout, la, ra in LAYOUTS for op, ld, rd in OPERANDS
                if op != "f32 x bf16" or layout != "x @ W"}
    model = llama_config("smollm2-135m", n_layers=args.layers).with_seq_len(args.seq_len)
    params = model.init_params(jax.random.key(0))
    steps = {}
    for mode in ("LoRA", "full"):
        steps[(mode, "f32")] = train_step(model, params, "fp32", mode == "LoRA", "cpu",
                                          args.batch_size)
        steps[(mode, "bf16 plain")] = train_step(model, params, "bf16", mode == "LoRA", "tpu",
                                                 args.batch_size)
        steps[(mode, "bf16")] = train_step(model, params, "bf16", mode == "LoRA", "cpu",
                                           args.batch_size)
    variants.update({f"{mode} {p}": make for (mode, p), make in steps.items()})
    timing = time_interleaved(variants, rounds=args.rounds,
                              steps_per_round=args.steps_per_round, warmup=1)

    gflops = {k: 2 * n**3 / timing[k]["min_s"] / 1e9 for k in timing if "@" in k}
    rows = []
    for layout, _, _ in LAYOUTS:
        cells = [f"{gflops[f'{op} {layout}']:.0f}" if f"{op} {layout}" in gflops else "-"
                 for op, _, _ in OPERANDS]
        bf16 = gflops[f"bf16 {layout}"] / gflops[f"f32 {layout}"]
        rows.append([f"`{layout}`", *cells, f"{bf16:.2f}x"])
    layouts = markdown_table(["layout", "f32 GFLOP/s", "bf16 GFLOP/s", "f32 x bf16 GFLOP/s",
                              "bf16 / f32"], rows)

    tokens = args.batch_size * args.seq_len
    speed = {(m, p): tokens / timing[f"{m} {p}"]["median_s"] for m, p in steps}
    rows = []
    for mode in ("LoRA", "full"):
        f32, plain, ours = (speed[(mode, p)] for p in ("f32", "bf16 plain", "bf16"))
        rows.append([mode, f"{f32:.0f}", f"{plain:.0f}", f"{ours:.0f}", f"{plain / f32:.2f}x",
                     f"{ours / f32:.2f}x", f"{ours / plain:.2f}x"])
    table = markdown_table(["job", "f32 tokens/s", "bf16 plain dots tokens/s",
                            "bf16 CPU backward tokens/s", "plain bf16 / f32",
                            "bf16 / f32", "CPU backward / plain"], rows)
    load = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    body = (f"On {device_description()}, {os.cpu_count()} cores, load average {load} (other "
            "processes share the cores: compare within a table, not across runs). Matmuls: "
            f"{n}³, best of {timing['f32 x @ W']['n']} "
            f"interleaved runs. Steps: SmolLM2-135M-shaped Llama with {args.layers} layers "
            f"(random weights), batch {args.batch_size} x {args.seq_len} tokens, AdamW; median "
            f"of {timing['LoRA f32']['n']} interleaved steps per variant.\n\n{layouts}\n\n"
            f"{table}\n\nGoal: bf16 / f32 approaching torch's 1.5-1.7x (torch autocast bf16 vs "
            "f32, LoRA, same CPU).")
    publish("bf16 vs f32 on the CPU: matmul layouts and the train step", body,
            command=command_line(__file__, argv), write=args.write)


if __name__ == "__main__":
    main()
