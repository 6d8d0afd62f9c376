"""LoRA vs full fine-tuning, side by side on the same model and batch.

Variants (AdamW everywhere, fp32 policy, same GPT, same batch):

* ``full fine-tuning``: every parameter trained;
* ``LoRA factored``: rank-8 adapters on attention (q, k, v, o) and MLP (fc_in, fc_out) kernels,
  computed as ``W0·x + s·B(A·x)`` with the base frozen (no weight-gradient matmuls for W0, no
  optimizer state for it);
* ``LoRA merge-in-step``: the same adapters, but the step merges ``W0 + s·A@B`` and runs the
  plain model, so a full-size gradient of every adapted weight is computed (what most
  implementations do).

Reported: median step time (interleaved), trainable parameters, optimizer-state bytes (goal: the
adapter fraction of full fine-tuning's, within 1%), and compiled memory (arguments, outputs,
temporaries) from ``memory_analysis()``. Goal: LoRA step time <= 0.80x full fine-tuning.
Run: ``python benchmarks/lora.py [--model small --batch-size 4]``.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax
from harness import device_description, markdown_table, time_interleaved, write_section

from effijax import lora
from effijax.data import batch_at, load_corpus
from effijax.models import abstract_split, gpt_config, init_params, make_loss_fn
from effijax.train import init_train_state, make_train_step

TARGETS = r"(attn/(q|k|v|o)|mlp/(fc_in|fc_out))/kernel"


def tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps-per-round", type=int, default=5)
    args = ap.parse_args()

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

    variants = {
        "full fine-tuning": (plain_loss, lambda: jax.tree.map(jnp.copy, base), batch),
        "LoRA factored": (factored_loss, lambda: jax.tree.map(jnp.copy, adapters0),
                          {**batch, "base": base}),
        "LoRA merge-in-step": (merged_loss, lambda: jax.tree.map(jnp.copy, adapters0),
                               {**batch, "base": base}),
    }
    info, makers = {}, {}
    for name, (loss_fn, fresh, b) in variants.items():
        step = jax.jit(make_train_step(loss_fn, tx, "fp32", has_aux=True), donate_argnums=0)
        state = init_train_state(fresh(), tx, 0)
        mem = step.lower(state, b).compile().memory_analysis()
        info[name] = {
            "trainable": sum(x.size for x in jax.tree.leaves(state.params)),
            "opt_bytes": tree_bytes(state.opt_state),
            "args": mem.argument_size_in_bytes,
            "out": mem.output_size_in_bytes,
            "temp": mem.temp_size_in_bytes,
        }

        def make(step=step, fresh=fresh, b=b):
            st = [init_train_state(fresh(), tx, 0)]

            def run():
                st[0], m = step(st[0], b)
                m["loss"].block_until_ready()
            return run

        makers[name] = make

    res = time_interleaved(makers, rounds=args.rounds, steps_per_round=args.steps_per_round)
    full = res["full fine-tuning"]["median_s"]
    total = sum(x.size for x in jax.tree.leaves(base))
    rows = []
    for name, r in res.items():
        i = info[name]
        rows.append([name, f"{1e3 * r['median_s']:.0f}", f"{r['median_s'] / full:.3f}",
                     f"{i['trainable']:,}", f"{i['opt_bytes']:,}",
                     f"{i['opt_bytes'] / info['full fine-tuning']['opt_bytes']:.5f}",
                     f"{i['temp'] / 2**20:.1f}",
                     f"{(i['args'] + i['out'] + i['temp']) / 2**20:.1f}"])
    fraction = info["LoRA factored"]["trainable"] / total
    opt_ratio = info["LoRA factored"]["opt_bytes"] / info["full fine-tuning"]["opt_bytes"]
    step_ratio = res["LoRA factored"]["median_s"] / full
    merge_ratio = res["LoRA merge-in-step"]["median_s"] / full
    body = "\n".join([
        f"`python benchmarks/lora.py --model {args.model} --batch-size {args.batch_size}` on "
        f"{device_description()}; `{args.model}` GPT ({total:,} params), batch "
        f"{args.batch_size}x{config.seq_len}, LoRA rank {args.rank} on `{TARGETS}`, AdamW, fp32. "
        f"Interleaved: {args.rounds} rounds x {args.steps_per_round} steps per variant.",
        "",
        markdown_table(["variant", "median ms", "vs full", "trainable params",
                        "optimizer-state bytes", "vs full", "temp MiB",
                        "args+out+temp MiB"], rows),
        "",
        f"- LoRA factored step time / full fine-tuning: **{step_ratio:.3f}x** (goal <= 0.80x: "
        f"{'met' if step_ratio <= 0.80 else 'MISSED'}); merge-in-step: {merge_ratio:.3f}x.",
        f"- Optimizer-state bytes, LoRA / full: {opt_ratio:.5f} vs adapter fraction "
        f"{fraction:.5f} (goal: within 1%: "
        f"{'met' if abs(opt_ratio / fraction - 1) <= 0.01 else 'MISSED'}, "
        f"off by {100 * abs(opt_ratio / fraction - 1):.3f}%).",
    ])
    print(body)
    write_section("LoRA vs full fine-tuning (issue 4)", body)


if __name__ == "__main__":
    main()
