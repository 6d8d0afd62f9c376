"""Context parallelism on 8 forced CPU devices: the longest sequence that fits a device, with and
without the axis, and the ring against the all-gather variant.

**Longest sequence.** SmolLM2-135M's architecture (abstract weights: nothing is read or
allocated), full fine-tuning, one sequence a step, ``--precision`` (bf16 by default: f32 master
weights and AdamW state, as an accelerator trains it), per-device memory ``--device-memory``
(4 GB by default). For one device and for ``context=8`` (each sequence split over the eight,
ring attention; the model states whole on each), the longest ``--seq-len`` (a multiple of
``--step``, up to the model's 8,192 positions) whose step fits:

* predicted: ``effijax memory --json``'s ``total_bytes`` (model states + the activation
  formula) within the budget;
* compiled: ``effijax memory --compile --json``'s ``held`` (arguments + outputs not aliased +
  temporaries of the step ``effijax train`` compiles, what its pre-flight check holds against
  the device) within the budget.

Both are ``effijax memory`` run in this process (its ``main``), found by bisection (a step that
fits at ``s`` fits at every shorter length).

**Ring against all-gather.** :func:`effijax.models.context_attend`'s two variants, forward and
backward (gradients of q, k and v), on ``context=8``, SmolLM2's attention (9 query heads, 3
key/value heads of 64), bf16, batch 1, causal, load-balanced chunks: the median time of
interleaved steps and XLA's temporaries. The eight CPU devices share the host's two cores and
its memory: the memory split is the result here; the speed is an accelerator's question (there
the ring overlaps its hops with the tiles' work, which two cores cannot show).

Run: ``python benchmarks/context.py [--write]`` (about 3 minutes on a 2-core CPU); with
``--write`` it replaces the "Context parallelism" section of RESULTS.md. ``--dry-run`` runs the
same on the tiny GPT at small lengths (seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before anything starts the backend

import jax.numpy as jnp  # noqa: E402
from harness import (  # noqa: E402
    add_write_flag,
    command_line,
    host_line,
    load_averages,
    markdown_table,
    publish,
    time_interleaved,
)

from effijax.cli import main as effijax  # noqa: E402
from effijax.memory import format_bytes, parse_bytes  # noqa: E402
from effijax.models import context_attend, preset, to_load_balanced  # noqa: E402

CONTEXT = 8


def memory(model: str, seq_len: int, context: int, precision: str, *,
           compile: bool = False) -> dict:
    """``effijax memory --model MODEL --seq-len S --batch-size 1 [--context N] --json``'s
    object (with ``--compile``: its ``compiled`` rows too), run in this process."""
    argv = ["memory", "--model", model, "--seq-len", str(seq_len), "--batch-size", "1",
            "--precision", precision, "--json"]
    if context > 1:
        argv += ["--context", str(context)]
    if compile:
        argv.append("--compile")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = effijax(argv)
        except SystemExit as e:  # argparse's refusal of a flag
            code = e.code
    if code != 0:
        raise RuntimeError(f"effijax {' '.join(argv)} exited {code}: {err.getvalue()}")
    return json.loads(out.getvalue())


def longest(fits, step: int, cap: int) -> int | None:
    """The largest multiple of ``step`` up to ``cap`` at which ``fits`` holds (None: not even
    ``step``), by bisection: ``fits`` must hold at every length below one where it holds.

    Example:
      >>> longest(lambda s: s <= 3000, 512, 8192)
      2560
      >>> longest(lambda s: True, 512, 8192), longest(lambda s: False, 512, 8192)
      (8192, None)
    """
    lo, hi = 0, cap // step  # fits at lo (0: nothing asked), unknown above, hi the last multiple
    if hi == 0:
        return None
    if fits(hi * step):
        return hi * step
    while hi - lo > 1:  # fits at lo, not at hi
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    return lo * step or None


def fit_rows(model: str, budget: int, step: int, precision: str,
             cap: int) -> tuple[list[list], list]:
    """The longest-sequence table's rows (one device, ``context=8``; lengths up to ``cap``)
    and the points measured."""
    points = []

    def fits_by(context: int, compiled: bool):
        def fits(s):
            out = memory(model, s, context, precision, compile=compiled)
            held = out["compiled"]["held"] if compiled else out["total_bytes"]
            points.append(("compiled" if compiled else "predicted", context, s, held))
            return held <= budget
        return fits

    rows = []
    for context in (1, CONTEXT):
        by_formula = longest(fits_by(context, compiled=False), step, cap)
        by_compiler = longest(fits_by(context, compiled=True), step, cap)
        rows.append([f"context={context}" if context > 1 else "one device",
                     _length(by_formula, cap), _length(by_compiler, cap)])
    return rows, points


def _length(s: int | None, cap: int) -> str:
    if s is None:
        return "none"
    return f"{s:,}" + (" (the longest searched)" if s == cap else "")


def _attention_step(variant: str, seq_len: int, heads: int, kv_heads: int, head_dim: int,
                    dtype, mesh):
    """``context_attend``'s forward and backward on global arrays: (jitted step, its inputs)."""
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, seq_len, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (1, seq_len, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (1, seq_len, kv_heads, head_dim), dtype)
    g = jax.random.normal(keys[3], (1, seq_len, heads, head_dim), dtype)
    q, k, v, g = (to_load_balanced(x, CONTEXT) for x in (q, k, v, g))

    def forward_backward(q, k, v, g):
        out, vjp = jax.vjp(lambda q, k, v: context_attend(q, k, v, mesh=mesh, variant=variant),
                           q, k, v)
        return out, vjp(g)

    return jax.jit(forward_backward), (q, k, v, g)


def variant_rows(seq_lens: list[int], heads: int, kv_heads: int, head_dim: int, dtype, *,
                 rounds: int, steps: int) -> list[list]:
    """Per length: each variant's median step time and XLA's temporaries."""
    mesh = jax.make_mesh((CONTEXT,), ("context",), devices=jax.devices()[:CONTEXT],
                         axis_types=(jax.sharding.AxisType.Auto,))
    rows = []
    for s in seq_lens:
        runs, temps = {}, {}
        for variant in ("ring", "all_gather"):
            step, args = _attention_step(variant, s, heads, kv_heads, head_dim, dtype, mesh)
            compiled = step.lower(*args).compile()
            temps[variant] = compiled.memory_analysis().temp_size_in_bytes

            def make(compiled=compiled, args=args):
                def run():
                    jax.block_until_ready(compiled(*args))
                return run
            runs[variant] = make
        timing = time_interleaved(runs, rounds=rounds, steps_per_round=steps, warmup=1)
        ring = timing["ring"]["median_s"]
        for variant in ("ring", "all_gather"):
            t = timing[variant]["median_s"]
            rows.append([s, variant, f"{1e3 * t:.1f}", f"{t / ring:.2f}x",
                         format_bytes(temps[variant])])
    return rows


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a preset architecture")
    p.add_argument("--device-memory", default="4GB", help="per-device budget, e.g. 4GB")
    p.add_argument("--precision", default="bf16", help="the step's precision policy")
    p.add_argument("--step", type=int, default=512, help="sequence lengths searched: multiples")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="the longest length searched (default: the model's positions)")
    p.add_argument("--seq-lens", type=lambda t: [int(x) for x in t.split(",")],
                   default=[2048, 8192], help="ring vs all-gather lengths, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    p.add_argument("--dry-run", action="store_true",
                   help="the tiny GPT at small lengths and budget: a smoke test in seconds")
    add_write_flag(p)
    args = p.parse_args(argv)
    if args.dry_run:
        args.model, args.device_memory, args.step = "tiny", "12MB", 256
        args.max_seq_len = 4096
        args.seq_lens, args.rounds, args.steps = [256], 1, 1
    budget = parse_bytes(args.device_memory, field="device_memory")
    arch = preset(args.model)
    shape = arch.shape()
    heads, kv_heads = shape.heads, shape.activation_args().get("kv_heads") or shape.heads
    head_dim = shape.activation_args().get("head_dim") or shape.hidden // shape.heads
    load = load_averages()
    t0 = time.perf_counter()
    cap = args.max_seq_len or arch.max_context
    fits, points = fit_rows(args.model, budget, args.step, args.precision, cap)
    variants = variant_rows(args.seq_lens, heads, kv_heads, head_dim, jnp.bfloat16,
                            rounds=args.rounds, steps=args.steps)
    seconds = time.perf_counter() - t0
    measured = [[kind, f"context={c}" if c > 1 else "one device", f"{s:,}", format_bytes(b),
                 "yes" if b <= budget else "no"] for kind, c, s, b in points]
    body = "\n\n".join([
        f"On {host_line()}; load average {load} before, {load_averages()} after (1 / 5 / 15 "
        f"min); {seconds:.0f} s in all.",
        f"**The longest sequence that fits {args.device_memory} per device**: {args.model} "
        f"({shape.num_params:,} params; the architecture only, nothing allocated), full "
        f"fine-tuning, {args.precision}, AdamW, one sequence a step, lengths in multiples of "
        f"{args.step} up to {cap:,}; one device against context={CONTEXT} (8 forced CPU "
        "devices, ring attention, the model states whole on each). Predicted: `effijax "
        "memory`'s total (model states + the activation formula); compiled: `effijax "
        "memory --compile`'s held-at-once bytes of the step `effijax train` compiles "
        "(arguments + outputs not aliased + temporaries).",
        markdown_table(["mesh", "predicted (effijax memory)", "compiled (XLA:CPU)"], fits),
        "The points the search measured:",
        markdown_table(["bytes", "mesh", "seq_len", "per device", "fits"], measured),
        f"**Ring against all-gather** (`context_attend`, forward and backward, context="
        f"{CONTEXT}, {heads} query and {kv_heads} key/value heads of {head_dim}, bf16, batch 1, "
        f"causal, load-balanced): median of {args.rounds} interleaved rounds x {args.steps} "
        "steps. The eight CPU devices share two cores and one memory: the temporaries are the "
        "result (the all-gather's hold every device's K/V, the ring's one travelling shard); "
        "the times only say what the two cost here, where no hop overlaps any work.",
        markdown_table(["seq_len", "variant", "step ms (median)", "vs ring",
                        "XLA temporaries per device"], variants),
    ])
    return publish("Context parallelism", body, command=command_line(__file__, argv),
                   write=args.write)


if __name__ == "__main__":
    main()
