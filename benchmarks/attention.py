"""Attention implementations side by side: the GPT train step with each ``GPTConfig.attention``.

For each preset, the same parameters, batch and optimizer (the ``effijax train`` one) run one
jitted train step per implementation, timed interleaved (``harness.time_interleaved``: median
over all timed steps). It also times the attention op alone (forward + backward w.r.t. q, k, v)
at the preset's shape, since the step's other work dilutes the differences. ``"auto"`` is not
timed separately: it runs one of the others (``effijax.models.choose_attention`` says which); this
measurement is what its CPU choice (``CPU_ATTENTION`` in ``effijax/models/_attention.py``) rests on.

Run: ``python benchmarks/attention.py [--models mini,small] [--precision fp32] [--write]``.
Without ``--write`` it only prints; with it, it replaces its section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
from harness import (
    add_write_flag,
    command_line,
    device_description,
    markdown_table,
    publish,
    time_interleaved,
)
from mfu import train_optimizer

from effijax.data import batch_at, load_corpus
from effijax.models import ATTENTION, choose_attention, gpt_config
from effijax.step import init_train_state, make_train_step

IMPLEMENTATIONS = ("naive", "blockwise", "xla")


def _step_variant(config, impl, policy, batch, params0):
    def make():
        model = dataclasses.replace(config, attention=impl)
        loss_fn = model.loss_fn()
        tx = train_optimizer()
        step = jax.jit(make_train_step(loss_fn, tx, policy, has_aux=True), donate_argnums=0)
        st = [init_train_state(jax.tree.map(jnp.copy, params0), tx, jax.random.key(1))]

        def run():
            st[0], m = step(st[0], batch)
            m["loss"].block_until_ready()
        return run
    return make


def _op_variant(fn, shape, dtype):
    def make():
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v, w = (jax.random.normal(kk, shape, dtype) for kk in keys)
        grad = jax.jit(jax.grad(
            lambda q, k, v: jnp.sum((fn(q, k, v) * w).astype(jnp.float32)), argnums=(0, 1, 2)))

        def run():
            jax.block_until_ready(grad(q, k, v))
        return run
    return make


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--models", default="mini,small")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--precision", default="fp32", help="policy preset (fp32, bf16, ...)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps-per-round", type=int, default=4)
    add_write_flag(ap)
    args = ap.parse_args(argv)

    tokens = load_corpus(max_bytes=1_000_000)
    rows, lines = [], []
    for name in args.models.split(","):
        config = gpt_config(name)
        batch = jax.device_put(batch_at(tokens, seed=0, step=0, batch_size=args.batch_size,
                                        seq_len=config.seq_len))
        params0 = config.init_params(jax.random.key(0), args.precision)
        step_res = time_interleaved(
            {impl: _step_variant(config, impl, args.precision, batch, params0)
             for impl in IMPLEMENTATIONS},
            rounds=args.rounds, steps_per_round=args.steps_per_round, warmup=2)
        dtype = jnp.bfloat16 if "16" in args.precision else jnp.float32
        shape = (args.batch_size, config.seq_len, config.n_heads, config.head_dim)
        op_res = time_interleaved(
            {impl: _op_variant(ATTENTION[impl], shape, dtype) for impl in IMPLEMENTATIONS},
            rounds=args.rounds, steps_per_round=args.steps_per_round * 2, warmup=2)
        best = min(IMPLEMENTATIONS, key=lambda i: step_res[i]["median_s"])
        best_op = min(IMPLEMENTATIONS, key=lambda i: op_res[i]["min_s"])
        for impl in IMPLEMENTATIONS:
            s, o = step_res[impl], op_res[impl]
            rows.append([name, impl, f"{1e3 * s['median_s']:.1f}", f"{1e3 * s['min_s']:.1f}",
                         f"{s['median_s'] / step_res[best]['median_s']:.3f}",
                         f"{1e3 * o['median_s']:.2f}", f"{1e3 * o['min_s']:.2f}"])
        auto = choose_attention(jax.ShapeDtypeStruct(shape, dtype), dropout=False).name
        lines.append(f"- `{name}`: fastest step (median) **{best}**, fastest op (best time) "
                     f"**{best_op}**; `auto` runs `{auto}` here")

    body = "\n".join([
        f"On {device_description()}; batch {args.batch_size} x the preset's "
        f"seq_len, {args.precision}, AdamW with clipping (`effijax train`'s optimizer). "
        f"Interleaved: {args.rounds} rounds x {args.steps_per_round} steps per variant; median.",
        "",
        markdown_table(["model", "attention", "train step ms (median)", "(best)",
                        "median vs fastest", "attention op fwd+bwd ms (median)", "(best)"],
                       rows),
        "",
        *lines,
    ])
    publish("Attention implementations on this device", body, command=command_line(__file__, argv),
            write=args.write)


if __name__ == "__main__":
    main()
