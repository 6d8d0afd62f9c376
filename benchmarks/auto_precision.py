"""What ``--precision auto`` chooses on this CPU, and what bf16 buys each model width here.

``auto`` picks bf16 on a CPU with native bf16 matmuls (AVX512_BF16, AMX) for a model at least
``effijax.precision.AUTO_BF16_MIN_WIDTH`` wide, fp32 otherwise. This script measures the rule's
ground: the full training step (AdamW, what ``effijax train`` runs without LoRA) of models of
several widths, in fp32 and in bf16, every variant interleaved with the others in one process
(harness). Layers are cut to ``--layers`` (the embedding, the head and the loss stay whole), so
the whole table takes minutes.

Models (``--models``): the GPT presets ``tiny`` (width 64), ``mini`` (128), ``small`` (384) and
``base`` (768), on bytes, ``gpt:WIDTH`` (``mini`` at another width, 64 per head), and
``smollm2`` (576, a 49,152-token vocabulary; random weights).
Each row says what ``auto`` picks for that width on this CPU; the rule holds here when bf16 is
faster on exactly the rows marked bf16 (the section's last line says whether it did).

Run: ``python benchmarks/auto_precision.py [--models mini,small,smollm2] [--layers 4]
[--batch-size 8 --seq-len 128] [--write]``.
"""

from __future__ import annotations

import argparse
import os

import jax
from cpu_bf16 import train_step
from harness import (
    add_write_flag,
    command_line,
    device_description,
    markdown_table,
    publish,
    time_interleaved,
)

from effijax.models import gpt_config, llama_config
from effijax.precision import AUTO_BF16_MIN_WIDTH, auto_precision, cpu_flags

MODELS = ("tiny", "mini", "gpt:256", "small", "base", "smollm2")
PRECISIONS = ("fp32", "bf16")


def model_of(name: str, layers: int, seq_len: int):
    """The model ``name`` (:data:`MODELS`) with ``layers`` layers and ``seq_len`` positions.

    Example:
      >>> m = model_of("small", 2, 32)
      >>> m.shape().hidden, m.n_layers, m.seq_len
      (384, 2, 32)
      >>> m = model_of("gpt:256", 2, 32)
      >>> m.shape().hidden, m.n_heads
      (256, 4)
    """
    if name == "smollm2":
        return llama_config("smollm2-135m", n_layers=layers).with_seq_len(seq_len)
    if name.startswith("gpt:"):
        width = int(name.removeprefix("gpt:"))
        return gpt_config("mini", d_model=width, n_heads=max(1, width // 64),
                          n_layers=layers).with_seq_len(seq_len)
    return gpt_config(name, n_layers=layers).with_seq_len(seq_len)


def rows_of(models: dict, timing: dict, tokens: int, flags) -> list[dict]:
    """One row per model: its width, tokens/s in each precision, their ratio, and what
    ``auto`` picks for it on a CPU with ``flags``.

    Example:
      >>> timing = {"mini fp32": {"median_s": 0.5}, "mini bf16": {"median_s": 0.5}}
      >>> row, = rows_of({"mini": model_of("mini", 1, 8)}, timing, 100, {"avx512_bf16"})
      >>> row["width"], row["fp32"], row["bf16 / fp32"], row["auto"]
      (128, 200.0, 1.0, 'fp32')
    """
    rows = []
    for name, model in models.items():
        speed = {p: tokens / timing[f"{name} {p}"]["median_s"] for p in PRECISIONS}
        width = model.shape().hidden
        rows.append({"model": name, "width": width, **speed,
                     "bf16 / fp32": speed["bf16"] / speed["fp32"],
                     "auto": auto_precision("cpu", width, flags).precision})
    return rows


def render(rows: list[dict], *, layers: int, batch_size: int, seq_len: int, rounds: int,
           load: str) -> str:
    """The section's text: the table and what it says of the rule."""
    table = markdown_table(
        ["model", "width", "fp32 tokens/s", "bf16 tokens/s", "bf16 / fp32", "auto here"],
        [[r["model"], r["width"], f"{r['fp32']:.0f}", f"{r['bf16']:.0f}",
          f"{r['bf16 / fp32']:.2f}x", r["auto"]] for r in rows])
    right = all((r["bf16 / fp32"] > 1) == (r["auto"] == "bf16") for r in rows)
    return (f"On {device_description()}, {os.cpu_count()} cores, load average {load}. Full "
            f"training step (AdamW), {layers} layer(s) per model, batch {batch_size} x "
            f"{seq_len} tokens, random weights; median of the interleaved steps of {rounds} "
            f"rounds per variant.\n\n{table}\n\n`auto` picks bf16 on a CPU with native bf16 "
            f"matmuls from width {AUTO_BF16_MIN_WIDTH}; on this table's rows it picks bf16 "
            + ("exactly where bf16 is faster." if right else
               "where bf16 is not faster, or fp32 where bf16 is (see the rows)."))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated, of {', '.join(MODELS)} or gpt:WIDTH (default: "
                    "those listed)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps-per-round", type=int, default=3)
    add_write_flag(ap)
    args = ap.parse_args(argv)
    names = args.models.split(",")
    unknown = sorted(n for n in set(names) - set(MODELS)
                     if not (n.startswith("gpt:") and n[4:].isdigit() and int(n[4:]) >= 8))
    if unknown:
        ap.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}, "
                 "or gpt:WIDTH")

    load_before = os.getloadavg()[0]
    models = {n: model_of(n, args.layers, args.seq_len) for n in names}
    params = {n: m.init_params(jax.random.key(0)) for n, m in models.items()}
    variants = {f"{n} {p}": train_step(m, params[n], p, False, "cpu", args.batch_size)
                for n, m in models.items() for p in PRECISIONS}
    timing = time_interleaved(variants, rounds=args.rounds,
                              steps_per_round=args.steps_per_round, warmup=1, settle=1)
    rows = rows_of(models, timing, args.batch_size * args.seq_len, cpu_flags())
    load = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    body = render(rows, layers=args.layers, batch_size=args.batch_size, seq_len=args.seq_len,
                  rounds=args.rounds, load=load)
    publish("auto precision on the CPU: bf16 / fp32 by model width", body,
            command=command_line(__file__, argv), write=args.write)


if __name__ == "__main__":
    main()
