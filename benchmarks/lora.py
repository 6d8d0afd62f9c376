"""LoRA vs full fine-tuning, side by side on the same model and batch.

Variants (AdamW everywhere, fp32 policy, same GPT, same batch):

* ``full fine-tuning``: every parameter trained;
* ``LoRA factored``: rank-8 adapters on attention (q, k, v, o) and MLP (fc_in, fc_out) kernels,
  computed as ``W0·x + s·B(A·x)`` with the base frozen (no weight-gradient matmuls for W0, no
  optimizer state for it);
* ``LoRA merge-in-step``: the same adapters, but the step merges ``W0 + s·A@B`` and runs the
  plain model, so a full-size gradient of every adapted weight is computed (what most
  implementations do);
* ``frozen base, no adapters``: the floor LoRA can approach: the whole base frozen and only the
  position embedding trained, so the backward pass carries input gradients through every layer
  but computes no weight gradient.

Reported: median step time (interleaved) and median process CPU time per step (user + system,
both cores; less sensitive than wall time to other jobs on a shared machine), trainable
parameters, optimizer-state bytes (goal: the adapter fraction of full fine-tuning's, within 1%),
compiled memory (arguments, outputs, temporaries) from ``memory_analysis()``, and the number of
2-D dots in the compiled step whose left operand contracts over its leading axis (XLA:CPU runs
those outside YNNPACK, see the bullets). Goal: LoRA step time <= 0.80x full fine-tuning.
Run: ``python benchmarks/lora.py [--model small --batch-size 4]``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

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

from effijax import lora
from effijax.data import batch_at, load_corpus
from effijax.models import abstract_split, gpt_config, init_params, make_loss_fn
from effijax.step import init_train_state, make_train_step

TARGETS = r"(attn/(q|k|v|o)|mlp/(fc_in|fc_out))/kernel"


def tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def transposed_lhs_dots(hlo: str) -> int:
    """2-D dots (no batch dims) whose left operand contracts over its leading axis.

    XLA:CPU gives only dots whose left operand contracts over its last axis to YNNPACK; these take
    a generic fallback (``x^T @ dy``-shaped weight gradients are the usual source).
    """
    return sum(1 for line in hlo.splitlines()
               if re.search(r"\bdot\(", line) and "lhs_batch_dims" not in line
               and "lhs_contracting_dims={0}" in line)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps-per-round", type=int, default=5)
    add_write_flag(ap)
    args = ap.parse_args(argv)

    config = gpt_config(args.model, seq_len=args.seq_len)
    graphdef, _ = abstract_split(config)
    spec = lora.LoraSpec(rank=args.rank, alpha=16.0, targets=TARGETS)
    base = init_params(config, "fp32", jax.random.key(0))
    adapters0 = lora.init(jax.random.key(1), base, spec)
    # Non-zero B so the factored and merged paths do real work (B = 0 at init by design).
    adapters0 = jax.tree.map(lambda x: x + 0.01, adapters0)
    tokens = load_corpus(max_bytes=2_000_000)
    batch = jax.device_put(batch_at(tokens, seed=0, step=0, batch_size=args.batch_size,
                                    seq_len=config.seq_len))
    tx = optax.adamw(1e-4)
    plain_loss = make_loss_fn(graphdef)
    factored_loss = lora.freeze_base(make_loss_fn(graphdef, lora=spec))

    def merged_loss(adapters, b, rng):
        frozen = jax.lax.stop_gradient(b["base"])
        rest = {k: v for k, v in b.items() if k != "base"}
        return plain_loss(lora.merge(frozen, adapters, spec), rest, rng)

    def floor_loss(pos_embed, b, rng):
        frozen = jax.lax.stop_gradient(b["base"])
        rest = {k: v for k, v in b.items() if k != "base"}
        return plain_loss({**frozen, "pos_embed": pos_embed}, rest, rng)

    variants = {
        "full fine-tuning": (plain_loss, lambda: jax.tree.map(jnp.copy, base), batch),
        "LoRA factored": (factored_loss, lambda: jax.tree.map(jnp.copy, adapters0),
                          {**batch, "base": base}),
        "LoRA merge-in-step": (merged_loss, lambda: jax.tree.map(jnp.copy, adapters0),
                               {**batch, "base": base}),
        "frozen base, no adapters": (floor_loss, lambda: jax.tree.map(jnp.copy, base["pos_embed"]),
                                     {**batch, "base": base}),
    }
    info, makers, cpu = {}, {}, {}
    for name, (loss_fn, fresh, b) in variants.items():
        step = jax.jit(make_train_step(loss_fn, tx, "fp32", has_aux=True), donate_argnums=0)
        state = init_train_state(fresh(), tx, 0)
        compiled = step.lower(state, b).compile()
        mem = compiled.memory_analysis()
        info[name] = {
            "slow_dots": transposed_lhs_dots(compiled.as_text()),
            "trainable": sum(x.size for x in jax.tree.leaves(state.params)),
            "opt_bytes": tree_bytes(state.opt_state),
            "args": mem.argument_size_in_bytes,
            "out": mem.output_size_in_bytes,
            "temp": mem.temp_size_in_bytes,
        }

        cpu[name] = []

        def make(step=step, fresh=fresh, b=b, cpu_s=cpu[name]):
            st = [init_train_state(fresh(), tx, 0)]

            def run():
                c0 = time.process_time()
                st[0], m = step(st[0], b)
                m["loss"].block_until_ready()
                cpu_s.append(time.process_time() - c0)
            return run

        makers[name] = make

    warmup = 3
    res = time_interleaved(makers, rounds=args.rounds, steps_per_round=args.steps_per_round,
                           warmup=warmup)
    cpu = {name: statistics.median(ts[warmup:]) for name, ts in cpu.items()}
    full = res["full fine-tuning"]["median_s"]
    total = sum(x.size for x in jax.tree.leaves(base))
    rows = []
    for name, r in res.items():
        i = info[name]
        rows.append([name, f"{1e3 * r['median_s']:.0f}", f"{r['median_s'] / full:.3f}",
                     f"{cpu[name] / cpu['full fine-tuning']:.3f}",
                     f"{i['trainable']:,}", f"{i['opt_bytes']:,}",
                     f"{i['opt_bytes'] / info['full fine-tuning']['opt_bytes']:.5f}",
                     f"{i['temp'] / 2**20:.1f}",
                     f"{(i['args'] + i['out'] + i['temp']) / 2**20:.1f}", i["slow_dots"]])
    fraction = info["LoRA factored"]["trainable"] / total
    opt_ratio = info["LoRA factored"]["opt_bytes"] / info["full fine-tuning"]["opt_bytes"]
    step_ratio = res["LoRA factored"]["median_s"] / full
    merge_ratio = res["LoRA merge-in-step"]["median_s"] / full
    floor_ratio = res["frozen base, no adapters"]["median_s"] / full
    cpu_ratio = cpu["LoRA factored"] / cpu["full fine-tuning"]
    cpu_floor = cpu["frozen base, no adapters"] / cpu["full fine-tuning"]
    body = "\n".join([
        f"On {device_description()}; `{args.model}` GPT ({total:,} params), batch "
        f"{args.batch_size}x{config.seq_len}, LoRA rank {args.rank} on `{TARGETS}`, AdamW, fp32. "
        f"Interleaved: {args.rounds} rounds x {args.steps_per_round} steps per variant.",
        "",
        markdown_table(["variant", "median ms", "vs full", "CPU time vs full",
                        "trainable params", "optimizer-state bytes", "vs full", "temp MiB",
                        "args+out+temp MiB", "transposed-lhs dots"], rows),
        "",
        f"- LoRA factored step time / full fine-tuning: **{step_ratio:.3f}x** (goal <= 0.80x: "
        f"{'met' if step_ratio <= 0.80 else 'MISSED'}); merge-in-step: {merge_ratio:.3f}x. "
        f"CPU time per step: {cpu_ratio:.3f}x.",
        f"- The floor: a frozen base with no adapters takes {floor_ratio:.3f}x full fine-tuning's "
        f"step ({cpu_floor:.3f}x in CPU time), so the adapters themselves cost "
        f"{step_ratio - floor_ratio:.3f} of a full step ({cpu_ratio - cpu_floor:.3f} in CPU "
        "time). Dropping the weight gradients saves less than the third of the matmul FLOPs "
        "they are: on XLA:CPU at this size much of the step is not matmuls (activations saved "
        "for the backward pass written, zero-filled and read back; the compiled step's "
        "temporaries, hundreds of MiB, page-faulted in afresh on every call: ~0.25 s of system "
        "time per step), and full "
        "fine-tuning's weight-gradient dots are independent of the input-gradient chain, so "
        "they fill the second core better than anything in the frozen step does.",
        "- Why LoRA was slower than the theory: autodiff of the factored "
        "`(x a) b` gives the adapter gradients as `x^T dh` and `h^T du`, 2-D dots whose left "
        "operand contracts over its leading (token) axis. XLA:CPU hands only dots whose left "
        "operand contracts over its last axis to YNNPACK; the rest run on a generic fallback "
        "that is 4-7x slower for these thin d x 8 outputs (measured: 4.3 ms vs 0.6 ms for "
        "`x^T dh` with x 1024 x 1536, 0.7 ms vs 0.19 ms with x 1024 x 384). Every layer had 12 "
        "of them. `_dense` now gives the adapter term a hand-written backward that computes "
        "`da^T = dh^T x` and `db = h^T du` from row-major r x n operands and transposes only the "
        "small results, pinned with `optimization_barrier` (XLA otherwise folds the transposes "
        "back into the slow form); the last column counts what is left in each compiled step "
        "(full fine-tuning's are its d x d weight gradients, where the fallback is only ~1.2x "
        "slower). Before/after, interleaved in one process on an otherwise idle machine: "
        "0.863x -> 0.848x wall, 0.827x -> 0.803x CPU time.",
        "- Then the GELU: differentiated as is, tanh-GELU keeps ~5 intermediates the size of "
        "its input per layer; the model's GELU now keeps only its input and recomputes the "
        "rest in the backward pass (a custom VJP). Full fine-tuning's temporaries fell from "
        "486 to 342 MiB and every variant got faster, the frozen ones most (they spend a "
        "larger share of the step outside matmuls). Three runs of 4 rounds x 5 steps after it "
        "gave LoRA 0.826x, 0.790x, 0.868x wall (0.774x, 0.748x, 0.829x CPU time), on a quiet "
        "machine: with ratios this close to 0.80 the verdict above depends on the run.",
        "- Measurement: on this 2-core machine shared with other jobs, wall-clock ratios swing "
        "with the load (the earlier 0.996x, and attention-only or MLP-only adapters at ~0.52x "
        "while all six gave ~0.9x, were such swings: in CPU time per step the adapters' costs "
        "add up, attention 0.036 and MLP 0.048 of a full step over the floor, together 0.095). "
        "Compare the CPU-time column when the load changed during a run.",
        f"- Optimizer-state bytes, LoRA / full: {opt_ratio:.5f} vs adapter fraction "
        f"{fraction:.5f} (goal: within 1%: "
        f"{'met' if abs(opt_ratio / fraction - 1) <= 0.01 else 'MISSED'}, "
        f"off by {100 * abs(opt_ratio / fraction - 1):.3f}%).",
    ])
    publish("LoRA vs full fine-tuning", body, command=command_line(__file__, argv),
            write=args.write)


if __name__ == "__main__":
    main()
