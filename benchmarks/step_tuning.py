"""What raises the bf16 training step toward the GPU's peak: one command, each choice side by side.

Run it on the machine with the accelerator, after ``benchmarks/accelerator.py`` (whose
``profile`` section says where the step's time goes)::

    python benchmarks/step_tuning.py --write --out-dir $OUT

Like ``accelerator.py`` (whose runner it uses) it writes everything measured so far after each
section: the section "Accelerator: tuning the step" of ``benchmarks/RESULTS.md`` (with
``--write``) and ``DIR/step_tuning.md`` and ``DIR/step_tuning.json`` (with ``--out-dir``);
each section has a time budget, and one that fails is reported in one line while the others
run. About 5 minutes on one H100/H200. The models are the GPT (random init, random tokens), so
``benchmarks/mfu.py``'s FLOP formula (6N + 12·L·H·K·S a token) gives every MFU. Sections, in
run order:

* **XLA flags**: the 1.3B step in a child process per flag (XLA reads its flags at start-up):
  none, the latency-hiding scheduler, Triton's GEMMs off (cuBLAS), command buffers off. What
  each flag is worth on this GPU, measured. First, while this process holds no model, so that
  each child can take most of the GPU.
* **tokens**: the 1.3B GPT's step at several batch x sequence shapes, 4k to 32k tokens a
  step (a shape the memory estimate does not fit is skipped): does the GPU fill up with more
  tokens, and at which shape does MFU stop rising?
* **remat**: the largest GPT the estimate fits without recomputation, with ``remat`` none,
  ``dots`` (matmul outputs kept, the rest recomputed) and ``block`` (each block recomputed):
  step time, MFU (model FLOPs: recomputation is not counted as work) and XLA's temporaries.

``--dry-run`` runs every section on tiny sizes (a CPU smoke test; its XLA flags section starts
only the child without flags). ``--sections tokens,remat`` runs a subset, ``--time-limit S``
caps the run.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import jax
from accelerator import (
    DRY_RUN,
    GPU,
    Context,
    Script,
    Section,
    _describe,
    _fits,
    bytes_limit,
    child_process,
    fitting,
    ladder,
    run_script,
    train_variant,
)
from harness import markdown_table, time_interleaved
from mfu import _flops, model_flops_per_token, peak_flops

from effijax.memory import format_bytes
from effijax.models import GPTConfig

TITLE = "Accelerator: tuning the step"
# The flags the XLA flags section compares with none (each alone, in a child process).
FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true",
         "--xla_gpu_enable_triton_gemm=false",
         "--xla_gpu_enable_command_buffer=")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The sizes of a run (:data:`TUNING_GPU`, or :data:`TUNING_DRY_RUN` with ``--dry-run``).

    Attributes:
      model: the GPT of the tokens and XLA flags sections.
      shapes: ``(batch, sequence)`` pairs of the tokens section.
      remat_ladder: the remat section's candidates, largest first (the first the estimate fits
        without recomputation is measured).
      remat_batch: its batch size.
      flags_batch: the XLA flags section's batch size (sequences of ``model.seq_len``).
      flags: the flags compared with none.
      rounds, steps_per_round: ``time_interleaved``'s rounds and timed steps per turn.
      budgets_s: seconds per section.
    """

    model: GPTConfig
    shapes: tuple[tuple[int, int], ...]
    remat_ladder: tuple[GPTConfig, ...]
    remat_batch: int
    flags_batch: int
    flags: tuple[str, ...]
    rounds: int
    steps_per_round: int
    budgets_s: dict[str, float]


TUNING_GPU = Sizes(
    model=GPU.ladder[1],  # 1.3B
    shapes=((4, 1024), (8, 1024), (16, 1024), (32, 1024), (8, 2048), (8, 4096)),
    remat_ladder=tuple(sorted(GPU.ladder, key=lambda c: -c.d_model * c.n_layers)),
    remat_batch=GPU.batch_size,
    flags_batch=GPU.batch_size,
    flags=FLAGS,
    rounds=3,
    steps_per_round=3,
    # 300 s in all (each shape, policy and child compiles a 1-4B step: 10-30 s each).
    budgets_s={"tokens": 100, "remat": 90, "XLA flags": 110},
)
TUNING_DRY_RUN = Sizes(
    model=DRY_RUN.model,
    shapes=((2, 16), (2, 32)),
    remat_ladder=(DRY_RUN.model,),
    remat_batch=2,
    flags_batch=2,
    flags=(),  # the child without flags: the plumbing, not the flags, is what a CPU can check
    rounds=1,
    steps_per_round=2,
    budgets_s={"tokens": 60, "remat": 60, "XLA flags": 90},
)


def _row(config: GPTConfig, batch: int, step_s: float, spec: float | None) -> dict:
    tokens = batch * config.seq_len
    flops = model_flops_per_token(config) * tokens / step_s
    return {"model": _describe(config), "batch": batch, "seq_len": config.seq_len,
            "tokens": tokens, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "flops_per_s": flops, "mfu": None if spec is None else flops / spec}


def _timed(config: GPTConfig, batch: int, sizes: Sizes, *, temporaries: bool = False):
    """The median step time of ``config``'s bf16 step at ``batch`` (compiled once), and with
    ``temporaries`` also XLA's temporary bytes for it: ``(seconds, bytes or None)``."""
    runner = train_variant(config, "bf16", batch)()
    compiled = runner.step.lower(runner.state, runner.batch).compile()
    runner.step = compiled
    res = time_interleaved({"step": lambda: runner}, rounds=sizes.rounds,
                           steps_per_round=sizes.steps_per_round, warmup=2)
    memory = compiled.memory_analysis() if temporaries else None
    return res["step"]["median_s"], None if memory is None else memory.temp_size_in_bytes


def _tokens_section(ctx: Context) -> dict:
    s, limit = ctx.sizes, bytes_limit()
    spec = peak_flops(jax.devices()[0].device_kind, "bf16")
    skipped = []

    def measure(shape):
        batch, seq = shape
        config = dataclasses.replace(s.model, seq_len=seq)
        need = fitting(config, batch, limit, skipped, f"batch {batch} x {seq}")
        if need is None:
            return None
        row = _row(config, batch, _timed(config, batch, s)[0], spec)
        print(f"  tokens {batch} x {seq}: {row['tokens_per_s']:,.0f} tokens/s", flush=True)
        return {**row, "estimate": need}

    rows, notes = ladder(ctx, s.shapes, measure, lambda sh: f"batch {sh[0]} x {sh[1]}")
    if not rows:
        raise RuntimeError("no shape ran: " + "; ".join(skipped + notes))
    return {"model": _describe(s.model), "spec_peak": spec, "rows": rows,
            "notes": skipped + notes}


def _render_tokens(r: dict) -> str:
    return "\n".join([
        f"{r['model']} at each batch x sequence length, bf16, AdamW, attention `auto`; MFU "
        "against the data sheet's bf16 peak "
        + (_flops(r["spec_peak"]) if r["spec_peak"] else "(unknown for this device)") + ".", "",
        markdown_table(["batch x seq", "tokens a step", "step ms", "tokens/s", "achieved",
                        "MFU", "memory estimate"],
                       [[f"{x['batch']} x {x['seq_len']}", f"{x['tokens']:,}",
                         f"{1e3 * x['step_s']:.1f}", f"{x['tokens_per_s']:,.0f}",
                         _flops(x["flops_per_s"]),
                         "n/a" if x["mfu"] is None else f"{x['mfu']:.3f}",
                         format_bytes(x["estimate"])] for x in r["rows"]]),
        *[f"- {n}." for n in r["notes"]],
    ])


def _remat_section(ctx: Context) -> dict:
    s, limit = ctx.sizes, bytes_limit()
    spec = peak_flops(jax.devices()[0].device_kind, "bf16")
    fit = [c for c in s.remat_ladder if _fits(c, s.remat_batch, limit)[0]]
    if not fit:
        raise RuntimeError("no model of the ladder fits the estimate without recomputation")
    base = fit[0]

    def measure(policy):
        config = dataclasses.replace(base, remat=policy)
        step_s, temp = _timed(config, s.remat_batch, s, temporaries=True)
        row = _row(config, s.remat_batch, step_s, spec)
        print(f"  remat {policy}: {1e3 * row['step_s']:.1f} ms", flush=True)
        return {**row, "remat": policy, "temp_bytes": temp}

    rows, notes = ladder(ctx, ("none", "dots", "block"), measure, lambda p: f"remat {p}")
    if not rows:
        raise RuntimeError("no remat policy ran: " + "; ".join(notes))
    return {"model": _describe(base), "batch": s.remat_batch, "spec_peak": spec, "rows": rows,
            "notes": notes}


def _render_remat(r: dict) -> str:
    none = next((x for x in r["rows"] if x["remat"] == "none"), r["rows"][0])
    return "\n".join([
        f"{r['model']}, batch {r['batch']}, bf16: the largest GPT the memory estimate fits "
        "without recomputation, with each `remat` policy (MFU counts the model's FLOPs, not the "
        "recomputed ones).", "",
        markdown_table(["remat", "step ms", "vs none", "MFU", "XLA temporaries"],
                       [[x["remat"], f"{1e3 * x['step_s']:.1f}",
                         f"{x['step_s'] / none['step_s']:.3f}x",
                         "n/a" if x["mfu"] is None else f"{x['mfu']:.3f}",
                         "n/a" if x["temp_bytes"] is None else format_bytes(x["temp_bytes"])]
                        for x in r["rows"]]),
        *[f"- {n}." for n in r["notes"]],
    ])


def flags_child(sizes: Sizes, _child: str) -> dict:
    """In a child process: the median bf16 step time of ``sizes.model`` (this process' XLA
    flags apply)."""
    return {"step_s": _timed(sizes.model, sizes.flags_batch, sizes)[0]}


def _flags_section(ctx: Context) -> dict:
    s = ctx.sizes
    spec = peak_flops(jax.devices()[0].device_kind, "bf16")

    def measure(flag):
        got = child_process(__file__, "flags", dry_run=ctx.dry_run, xla_flags=flag,
                            timeout=ctx.time_left(), memory_fraction=0.8)
        row = _row(s.model, s.flags_batch, got["step_s"], spec)
        print(f"  XLA flags {flag or '(none)'}: {1e3 * row['step_s']:.1f} ms", flush=True)
        return {**row, "flag": flag, "process_s": got["process_s"]}

    rows, notes = ladder(ctx, ("", *s.flags), measure, lambda f: f or "(none)")
    if not rows or rows[0]["flag"] != "":
        raise RuntimeError("the child without flags did not run: " + "; ".join(notes))
    return {"model": _describe(s.model), "batch": s.flags_batch, "rows": rows, "notes": notes}


def _render_flags(r: dict) -> str:
    base = r["rows"][0]["step_s"]
    return "\n".join([
        f"{r['model']}, batch {r['batch']}, bf16, each in a child process whose `XLA_FLAGS` add "
        "one flag (XLA reads them at start-up).", "",
        markdown_table(["XLA flag", "step ms", "vs none", "MFU", "process s"],
                       [[f"`{x['flag']}`" if x["flag"] else "(none)",
                         f"{1e3 * x['step_s']:.1f}", f"{x['step_s'] / base:.3f}x",
                         "n/a" if x["mfu"] is None else f"{x['mfu']:.3f}",
                         f"{x['process_s']:.0f}"] for x in r["rows"]]),
        *[f"- {n}." for n in r["notes"]],
    ])


SECTIONS = (  # the children of XLA flags first, while this process holds no model
    Section("XLA flags", _flags_section, _render_flags),
    Section("tokens", _tokens_section, _render_tokens),
    Section("remat", _remat_section, _render_remat),
)
SCRIPT = Script(TITLE, __doc__.split("\n\n")[0], SECTIONS, TUNING_GPU, TUNING_DRY_RUN,
                str(Path(__file__).resolve()), flags_child)


def main(argv: list[str] | None = None) -> None:
    run_script(SCRIPT, argv)


if __name__ == "__main__":
    # The XLA flags section runs first, its children each needing most of the GPU: this process
    # allocates only what it uses (read when the backend starts; a user's value wins).
    if "--dry-run" not in sys.argv and "--child" not in sys.argv:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")
    main()
