"""Model FLOPs utilisation (MFU) of the GPT train step, and its ratio to a measured matmul peak.

Per GPT preset and precision policy it reports:

* model FLOPs per token, from the architecture (PaLM, Chowdhery et al. 2022, appendix B):
  ``6·N + 12·L·H·K·S`` for a training step (forward + backward), where ``N`` counts the
  parameters that multiply activations (every parameter except the position embedding: the
  tied token embedding is the output head's matmul, the lookups are free), ``L`` layers, ``H``
  heads of width ``K``, ``S`` the sequence length. Causal masking is not discounted (PaLM's
  convention): the attention term counts the full ``S x S`` scores;
* tokens/s of the jitted, donated train step (``make_train_step`` + ``make_optimizer``, the
  ``effijax train`` optimizer: AdamW, warm-up, cosine decay, clipping), the median of warm steps;
* the device's peak for the compute dtype from :data:`PEAK_TFLOPS` (dense, no sparsity; unknown
  for a CPU) and MFU where it is known;
* the ratio to a matmul peak measured in the same run on the same device (the best time of a
  large ``n x n x n`` matmul in the models' form, f32 accumulation, interleaved with the train
  steps so both see the same noise).

Goal: the default ``effijax train`` step (``mini`` GPT, batch
16, seq 128, fp32) reaches >= 0.45 of the measured f32 matmul peak (0.40 before).

Met on a 2-core AMD EPYC with AVX512_BF16 (0.465 and 0.469 in two runs; the bf16 step of the
small preset at 0.47 of the bf16 peak, 1.3x its f32 step). Not met on the 2-core Xeon (AVX-512,
no AVX512_BF16) this was first written on: the mini fp32 step measured 0.27-0.38 of the 2048^3
matmul over five runs, the machine shared and noisy. ``--profile`` shows where the time
goes (XLA:CPU thunks from a ``jax.profiler`` trace): matmuls are only 30-55% of the step. The
rest is elementwise work (softmax, GELU, LayerNorm, Adam) and constant fills
(``wrapped_broadcast``, 20-50%) of the scan's stacked per-layer residual buffers
(``[L, B, H, S, S]`` attention probabilities, ``[L, B·S, F]`` MLP activations), which XLA
zero-initialises before the loop overwrites them. Those buffers are fresh memory every step: 37k
minor page faults per step (145 MiB touched for the first time), 0.10-0.12 s of kernel time per
~0.45 s of user time; glibc's malloc trimming tunables do not change it. The model's own matmuls
run alone at 1.0-1.7x the 2048^3 rate (they fit in cache), so the matmul rate is not the limit;
the weight-gradient dots (left operand contracted over its leading axis) leave XLA:CPU's YNNPACK
path (``dot.*`` rather than ``ynn_fusion.*``) and are 1.2-2x slower than the same product with
the transpose materialised. Blockwise attention (no ``[L, B, H, S, S]`` buffer) measured
0.37-0.40 on the same step; it is what the presets' default ``attention="auto"`` runs on a CPU
now, and this script's default (the recorded section says which attention it measured). Those
page faults are what the ``effijax`` program's huge pages remove
(``effijax.cli.reexec_with_hugepages``); run as a script, this one re-executes itself the same
way first, so it measures what ``effijax train`` runs (the section's first line says "huge
pages"; ``EFFIJAX_HUGEPAGES=0`` measures without).

Run: ``python benchmarks/mfu.py [--quick] [--models tiny,mini,small] [--base]
[--precisions fp32,bf16] [--attention auto] [--profile] [--write]``. Without ``--write`` it only
prints; with it, it replaces its own section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
from harness import (
    add_write_flag,
    command_line,
    device_description,
    markdown_table,
    publish,
    run_like_effijax,
    time_interleaved,
)

from effijax.models import gpt_config, param_count
from effijax.precision import dot, get_policy
from effijax.step import init_train_state, make_optimizer, make_train_step

FORMULA = ("model FLOPs/token = 6·N + 12·L·H·K·S (PaLM appendix B; N = parameters that multiply "
           "activations: all but the position embedding, the tied embedding counted once as the "
           "output head; full S x S attention, causal masking not discounted)")

# Dense peak TFLOP/s by device kind (substring of ``jax.Device.device_kind``) and matmul dtype,
# from the vendors' data sheets (SXM parts unless named). "tf32" is what an f32 matmul runs as on
# these GPUs under JAX's default matmul precision.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
}

GOAL = 0.45
DEFAULT_STEP = ("mini", "fp32", 16)  # `effijax train` with no flags: model, policy, batch


def model_flops_per_token(config) -> int:
    """Training FLOPs per token, ``6·N + 12·L·H·K·S`` (see :data:`FORMULA`).

    Example (the tiny preset: N = 120,576 parameters - 64·64 position embedding = 116,480):
      >>> model_flops_per_token(gpt_config("tiny"))  # 6·116480 + 12·2·4·16·64
      797184
    """
    n = param_count(config) - config.seq_len * config.d_model
    attention = 12 * config.n_layers * config.n_heads * config.head_dim * config.seq_len
    return 6 * n + attention


def matmul_dtype(precision: str) -> str:
    """The dtype the policy's matmuls run in, as a key of :data:`PEAK_TFLOPS` entries."""
    compute = jnp.dtype(get_policy(precision).compute_dtype)
    if compute == jnp.bfloat16:
        return "bf16"
    if compute == jnp.float16:
        return "fp16"
    on_gpu = jax.default_backend() == "gpu"
    full = str(jax.config.jax_default_matmul_precision).lower() in ("highest", "float32")
    return "tf32" if on_gpu and not full else "fp32"


def peak_flops(device_kind: str, dtype: str) -> float | None:
    """The table's peak FLOP/s for ``device_kind`` and ``dtype``, None when unknown.

    Example:
      >>> peak_flops("NVIDIA H100 80GB HBM3", "bf16")
      989400000000000.0
      >>> peak_flops("cpu", "fp32") is None
      True
    """
    for name, peaks in PEAK_TFLOPS.items():  # "H100 PCIe" is tried before "H100"
        if all(part in device_kind for part in name.split()):
            return peaks[dtype] * 1e12 if dtype in peaks else None
    return None


def _matmul_variant(n: int, dtype):
    def make():
        a = jax.random.normal(jax.random.key(0), (n, n), dtype)
        b = jax.random.normal(jax.random.key(1), (n, n), dtype)
        # The models' own matmul (f32 accumulation, the result in the operands' dtype): XLA:CPU
        # runs it on its bf16 GEMM, where a plain bf16 jnp.matmul takes the f32 rate.
        mm = jax.jit(functools.partial(dot, "ij,jk->ik"))

        def run():
            mm(a, b).block_until_ready()
        return run
    return make


def train_optimizer(loss_scale: str | None = None):
    """The benchmarks' optimizer: ``effijax train``'s (AdamW, warm-up, cosine decay, clipping),
    wrapped in ``dynamic_loss_scale`` with ``loss_scale="dynamic"``."""
    return make_optimizer(3e-3, 300, warmup_steps=15, weight_decay=0.01, clip_norm=1.0,
                          loss_scale=loss_scale)


def random_batch(config, batch_size: int) -> dict:
    """``inputs`` and ``targets`` of random tokens (key 2) for ``config``."""
    keys = jax.random.split(jax.random.key(2))
    return {name: jax.random.randint(k, (batch_size, config.seq_len), 0, config.vocab_size)
            for name, k in zip(("inputs", "targets"), keys, strict=True)}


def _step_variant(config, precision: str, batch_size: int):
    def make():
        loss_fn = config.loss_fn()
        tx = train_optimizer()
        step = jax.jit(make_train_step(loss_fn, tx, precision, has_aux=True), donate_argnums=0)
        params = config.init_params(jax.random.key(0), precision)
        state = [init_train_state(params, tx, jax.random.key(1))]
        batch = random_batch(config, batch_size)

        def run():
            state[0], metrics = step(state[0], batch)
            metrics["loss"].block_until_ready()
        return run
    return make


def measure(models=("tiny", "mini", "small"), precisions=("fp32",), *, batch_size: int = 16,
            attention: str = "auto", matmul_n: int = 2048, rounds: int = 5,
            steps_per_round: int = 5, warmup: int = 2) -> tuple[list[dict], dict[str, float]]:
    """Times every (model, precision) train step and the matmuls, interleaved.

    Returns ``(rows, matmul_peak)``: one dict per (model, precision) with ``model, precision,
    dtype, flops_per_token, tokens, step_s, best_step_s, tokens_per_s, flops_per_s, peak, mfu,
    matmul_peak, vs_f32_matmul, vs_dtype_matmul``, and the measured matmul FLOP/s by dtype.
    """
    configs = {m: dataclasses.replace(gpt_config(m), attention=attention) for m in models}
    dtypes = {p: matmul_dtype(p) for p in precisions}
    jnp_dtype = {"fp32": jnp.float32, "tf32": jnp.float32, "bf16": jnp.bfloat16,
                 "fp16": jnp.float16}
    variants = {f"matmul {d}": _matmul_variant(matmul_n, jnp_dtype[d])
                for d in sorted({"fp32", *dtypes.values()} - {"tf32"})}
    for m, config in configs.items():
        for p in precisions:
            variants[f"{m} {p}"] = _step_variant(config, p, batch_size)
    res = time_interleaved(variants, rounds=rounds, steps_per_round=steps_per_round,
                           warmup=warmup)
    mm_flops = 2 * matmul_n**3
    matmul_peak = {name.split()[1]: mm_flops / r["min_s"] for name, r in res.items()
                   if name.startswith("matmul")}
    kind = jax.devices()[0].device_kind
    rows = []
    for m, config in configs.items():
        for p in precisions:
            dtype = dtypes[p]
            r = res[f"{m} {p}"]
            tokens = batch_size * config.seq_len
            fpt = model_flops_per_token(config)
            flops_per_s = fpt * tokens / r["median_s"]
            peak = peak_flops(kind, dtype)
            own = matmul_peak.get("fp32" if dtype == "tf32" else dtype)
            rows.append({
                "model": m, "precision": p, "dtype": dtype, "flops_per_token": fpt,
                "tokens": tokens, "step_s": r["median_s"], "best_step_s": r["min_s"],
                "tokens_per_s": tokens / r["median_s"], "flops_per_s": flops_per_s,
                "peak": peak, "mfu": None if peak is None else flops_per_s / peak,
                "matmul_peak": own, "vs_f32_matmul": flops_per_s / matmul_peak["fp32"],
                "vs_dtype_matmul": flops_per_s / own,
            })
    return rows, matmul_peak


def quick(models=("tiny",), precisions=("fp32",)):
    """A few-second run: small matmul, one round of two steps (a smoke test, not a measurement)."""
    return measure(models, precisions, batch_size=4, matmul_n=256, rounds=1, steps_per_round=2,
                   warmup=1)


def _flops(x: float | None) -> str:
    if x is None:
        return "unknown"
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x / 1e6:.1f} MFLOP/s"


def render(rows: list[dict], matmul_peak: dict, *, matmul_n: int, batch_size: int) -> str:
    table = markdown_table(
        ["model", "precision", "FLOPs/token", "tokens/step", "step ms (median)", "tokens/s",
         "achieved", "device peak", "MFU", "/ f32 matmul peak", "/ same-dtype matmul peak"],
        [[r["model"], f"{r['precision']} ({r['dtype']} matmuls)", f"{r['flops_per_token']:,}",
          r["tokens"], f"{1e3 * r['step_s']:.1f}", f"{r['tokens_per_s']:,.0f}",
          _flops(r["flops_per_s"]), _flops(r["peak"]),
          "n/a" if r["mfu"] is None else f"{r['mfu']:.3f}", f"{r['vs_f32_matmul']:.3f}",
          f"{r['vs_dtype_matmul']:.3f}"] for r in rows])
    peaks = ", ".join(f"{d} {_flops(v)}" for d, v in sorted(matmul_peak.items()))
    lines = [
        f"- {FORMULA}.",
        f"- Measured matmul peak ({matmul_n}^3, best time, same run): {peaks}.",
    ]
    model, precision, batch = DEFAULT_STEP
    default = [r for r in rows if (r["model"], r["precision"]) == (model, precision)]
    if default and batch_size == batch:
        ratio = default[0]["vs_f32_matmul"]
        lines.append(f"- Goal: the default `effijax train` step ({model}, batch {batch}, seq "
                     f"{gpt_config(model).seq_len}, {precision}) at >= {GOAL:.2f} of the measured "
                     f"f32 matmul peak: **{ratio:.3f}**, {'met' if ratio >= GOAL else 'NOT met'}.")
    else:
        lines.append(f"- Goal (>= {GOAL:.2f} of the f32 matmul peak for the default step: "
                     f"{model}, batch {batch}, {precision}): not measured in this run.")
    if jax.default_backend() == "cpu" and any(r["dtype"] != "fp32" for r in rows):
        lines.append("- On a CPU, XLA's bf16 GEMM (where the CPU has AVX512_BF16 or AMX) runs the "
                     "models' matmuls, forward and backward (`effijax.models._dense`), at up to "
                     "twice the f32 rate; the rest of the step (elementwise work, the layers' "
                     "scan) is no faster in bf16, so the narrow presets gain little or nothing.")
    return "\n".join([table, "", *lines])


def _thunk_breakdown(run, steps: int = 5) -> dict[str, float] | None:
    """Seconds per step by kind of XLA:CPU thunk, from a ``jax.profiler`` trace of ``run()``.

    Kinds (by XLA:CPU's op names): ``matmul`` (``ynn_fusion*``: dots handed to YNNPACK, and
    ``dot*``: the others), ``buffer fill`` (``wrapped_broadcast*``: constant fills, mostly the
    zeros of the scan's stacked per-layer residual buffers), ``other`` (elementwise, reductions,
    copies, scatter). None when the trace has no per-thunk events (another backend).
    """
    import collections
    import glob
    import gzip
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(steps):
                run()
        files = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)
        if not files:
            return None
        with gzip.open(files[0]) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kinds: collections.Counter = collections.Counter()
    for e in events:
        name = e.get("name", "")
        src = str((e.get("args") or {}).get("_src", ""))
        # One event per executed thunk (loops and conditionals contain theirs: not counted).
        if (e.get("ph") != "X" or not src.endswith("thunk_executor.cc")
                or name.startswith(("ThunkExecutor", "while", "conditional", "call"))):
            continue
        if name.startswith(("ynn_fusion", "dot")):
            kinds["matmul"] += e["dur"]
        elif name.startswith("wrapped_broadcast"):
            kinds["buffer fill"] += e["dur"]
        else:
            kinds["other"] += e["dur"]
    return {k: us / 1e6 / steps for k, us in kinds.items()} if kinds else None


def profile(model: str = "mini", precision: str = "fp32", batch_size: int = 16,
            attention: str = "auto", rounds: int = 5, steps: int = 4) -> str:
    """Where the default step's time goes: forward, forward + backward and the full step; the
    model's own matmul shapes run alone; and the step's XLA:CPU thunks by kind."""
    config = dataclasses.replace(gpt_config(model), attention=attention)
    policy = get_policy(precision)
    loss_fn = config.loss_fn()
    params = policy.cast_to_compute(config.init_params(jax.random.key(0), precision))
    b, s, d, f, v = batch_size, config.seq_len, config.d_model, config.d_ff, config.vocab_size
    dt = jnp.dtype(policy.compute_dtype)
    batch = {"inputs": jnp.zeros((b, s), jnp.int32), "targets": jnp.ones((b, s), jnp.int32)}
    fwd = jax.jit(lambda p: loss_fn(p, batch, None)[0])
    fwd_bwd = jax.jit(jax.grad(lambda p: loss_fn(p, batch, None)[0]))

    def once(fn, *args):
        def make():
            return lambda: jax.block_until_ready(fn(*args))
        return make

    n = b * s
    # The model's parameter matmuls, forward shapes (x_NI @ w_IO), each alone and jitted.
    shapes = {"q/k/v/o (N,D)x(D,D)": (n, d, d), "fc_in (N,D)x(D,F)": (n, d, f),
              "fc_out (N,F)x(F,D)": (n, f, d), "head (N,D)x(D,V)": (n, d, v)}
    mm = jax.jit(jnp.matmul)
    step = _step_variant(config, precision, batch_size)
    variants = {"forward (loss)": once(fwd, params),
                "forward + backward (grad)": once(fwd_bwd, params), "full step": step}
    for name, (i, j, o) in shapes.items():
        variants[name] = once(mm, jnp.ones((i, j), dt), jnp.ones((j, o), dt))
    variants["matmul 2048^3"] = once(mm, jnp.ones((2048, 2048), dt), jnp.ones((2048, 2048), dt))
    res = time_interleaved(variants, rounds=rounds, steps_per_round=steps, warmup=2)
    step_s = res["full step"]["median_s"]
    rows = [[name, f"{1e3 * res[name]['median_s']:.1f}", f"{res[name]['median_s'] / step_s:.2f}"]
            for name in ("forward (loss)", "forward + backward (grad)", "full step")]
    peak = 2 * 2048**3 / res["matmul 2048^3"]["min_s"]
    mm_rows = []
    for name, (i, j, o) in shapes.items():
        rate = 2 * i * j * o / res[name]["min_s"]
        mm_rows.append([name, f"{1e3 * res[name]['min_s']:.3f}", _flops(rate),
                        f"{rate / peak:.2f}"])
    out = [
        f"Profile of the {model} {precision} step (batch {b}x{s}, attention={attention}):", "",
        markdown_table(["part", "median ms", "/ full step"], rows), "",
        f"The model's matmuls alone (best time) against the 2048^3 matmul ({_flops(peak)}):", "",
        markdown_table(["matmul", "ms", "rate", "/ 2048^3 rate"], mm_rows),
    ]
    kinds = _thunk_breakdown(step())
    if kinds:
        total = sum(kinds.values())
        out += ["", "The full step's XLA:CPU thunks by kind (jax.profiler trace, 5 steps):", "",
                markdown_table(["kind", "ms per step", "share"],
                               [[k, f"{1e3 * t:.1f}", f"{t / total:.0%}"]
                                for k, t in sorted(kinds.items(), key=lambda kv: -kv[1])])]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    if argv is None:  # as a script: measure what `effijax train` runs
        run_like_effijax()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--models", default="tiny,mini,small", help="GPT presets, comma-separated")
    ap.add_argument("--base", action="store_true", help="add the base preset (~100M parameters)")
    ap.add_argument("--precisions", default="fp32,bf16", help="policy presets, comma-separated")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--attention", default="auto",
                    help="GPTConfig.attention for every model; auto is the presets' own")
    ap.add_argument("--matmul-n", type=int, default=None,
                    help="size of the peak matmul (default 2048 on a CPU, 8192 elsewhere)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps-per-round", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny GPT, fp32, short: a smoke run")
    ap.add_argument("--profile", action="store_true",
                    help="also break the default step's time down (forward, backward, matmuls)")
    add_write_flag(ap)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    if args.quick:
        matmul_n, batch_size = 256, 4
        rows, peaks = quick()
    else:
        matmul_n = args.matmul_n or (2048 if jax.default_backend() == "cpu" else 8192)
        batch_size = args.batch_size
        models = args.models.split(",") + (["base"] if args.base else [])
        rows, peaks = measure(models, args.precisions.split(","), batch_size=batch_size,
                              attention=args.attention, matmul_n=matmul_n, rounds=args.rounds,
                              steps_per_round=args.steps_per_round)
    how = ("a quick smoke run (1 round x 2 steps)" if args.quick
           else f"{args.rounds} rounds x {args.steps_per_round} steps")
    body = "\n".join([
        f"On {device_description()}; batch {batch_size} x the preset's seq_len, "
        f"attention={'auto' if args.quick else args.attention}, random tokens; {how}, train "
        f"steps and matmuls interleaved ({time.perf_counter() - t0:.0f} s).",
        "",
        render(rows, peaks, matmul_n=matmul_n, batch_size=batch_size),
    ])
    if args.profile:
        body += "\n\n" + profile(batch_size=args.batch_size, attention=args.attention)
    publish("MFU (Accelerator performance)", body, command=command_line(__file__, argv),
            write=args.write)


if __name__ == "__main__":
    main()
