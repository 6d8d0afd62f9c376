"""Step overhead: effijax's train step vs hand-written equivalents, side by side in one run.

Same model (the ``mini`` GPT), batch, optimizer (AdamW) and math in every variant:

* ``optax fp32``: a hand-written ``value_and_grad`` + ``optax`` step (the floor);
* ``effijax fp32``: ``make_train_step`` with the fp32 policy (adds the metrics: gradient norm,
  finiteness, learning rate);
* ``jmp fp16 + DynamicLossScale``: jmp's README recipe (cast with a jmp policy, scale, unscale,
  ``all_finite``, ``adjust``, ``select_tree``);
* ``flax DynamicScale fp16``: Flax's ``DynamicScale.value_and_grad`` recipe with ``select_tree``;
* ``effijax fp16 + dynamic``: ``make_train_step`` with ``dynamic_loss_scale(adamw)``;
* ``effijax recipe job fp32``: the step ``effijax train`` runs (``effijax.recipe.plan_job`` on a
  1-device mesh: sharding constraints, the ``lm_loss``/``accuracy`` metrics), same AdamW.

Goals: effijax fp32 <= 1.02x optax fp32; effijax fp16 <= 1.0x the jmp / Flax steps.
Run: ``python benchmarks/step_overhead.py [--batch-size 8 --rounds 5 --steps-per-round 10]``.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from flax.training.dynamic_scale import DynamicScale
from harness import (
    add_write_flag,
    command_line,
    device_description,
    markdown_table,
    publish,
    time_interleaved,
)

from effijax.data import batch_at, load_corpus
from effijax.models import abstract_split, gpt_config, init_params, make_loss_fn
from effijax.precision import dynamic_loss_scale, get_policy
from effijax.recipe import init_state, plan_job
from effijax.sharding import batch_sharding
from effijax.step import init_train_state, make_train_step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", default="mini")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps-per-round", type=int, default=10)
    add_write_flag(ap)
    args = ap.parse_args(argv)

    config = gpt_config(args.model)
    graphdef, _ = abstract_split(config)
    lm_loss = make_loss_fn(graphdef)
    tokens = load_corpus(max_bytes=1_000_000)
    batch = jax.device_put(batch_at(tokens, seed=0, step=0, batch_size=args.batch_size,
                                    seq_len=config.seq_len))
    params0 = init_params(config, "fp32", jax.random.key(0))
    key = jax.random.key(1)
    tx = optax.adamw(1e-3)

    def loss_only(p, b, rng):
        return lm_loss(p, b, rng)[0]

    def fresh_params():
        return jax.tree.map(jnp.copy, params0)

    # --- hand-written optax fp32 -------------------------------------------------------------
    def make_optax():
        @jax.jit
        def step(p, s, b):
            loss, g = jax.value_and_grad(loss_only)(p, b, key)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        st = [fresh_params()]
        st.append(tx.init(st[0]))

        def run():
            st[0], st[1], loss = step(st[0], st[1], batch)
            loss.block_until_ready()
        return run

    # --- effijax (any policy / optimizer) ----------------------------------------------------
    def make_effijax(policy, optimizer):
        def make():
            step = jax.jit(make_train_step(loss_only, optimizer, policy))
            st = [init_train_state(fresh_params(), optimizer, key)]

            def run():
                st[0], m = step(st[0], batch)
                m["loss"].block_until_ready()
            return run
        return make

    # --- the recipe's job step (what `effijax train` runs) ---------------------------------
    def make_recipe():
        job = plan_job(config, "fp32", tx, batch_size=args.batch_size)
        st = [init_state(job)]
        st[0] = st[0]._replace(params=fresh_params())
        b = jax.device_put(batch, batch_sharding(job.mesh))

        def run():
            st[0], m = job.step(st[0], b)
            m["loss"].block_until_ready()
        return run

    # --- jmp's README recipe --------------------------------------------------------------
    jmp_policy = jmp.get_policy("params=float32,compute=float16,output=float32")

    def make_jmp():
        @jax.jit
        def step(p, s, ls, b):
            def scaled(q):
                return ls.scale(loss_only(jmp_policy.cast_to_compute(q), b, key))
            g = jax.grad(scaled)(p)
            g = ls.unscale(jmp_policy.cast_to_param(g))
            finite = jmp.all_finite(g)
            ls = ls.adjust(finite)
            u, ns = tx.update(g, s, p)
            np_ = optax.apply_updates(p, u)
            p, s = jmp.select_tree(finite, (np_, ns), (p, s))
            return p, s, ls

        p = fresh_params()
        st = [p, tx.init(p), jmp.DynamicLossScale(jnp.float32(2.0**15))]

        def run():
            st[0], st[1], st[2] = step(st[0], st[1], st[2], batch)
            st[2].loss_scale.block_until_ready()
        return run

    # --- Flax DynamicScale recipe ---------------------------------------------------------
    policy16 = get_policy("fp16")

    def make_flax():
        @jax.jit
        def step(p, s, ds, b):
            grad_fn = ds.value_and_grad(lambda q: loss_only(policy16.cast_to_compute(q), b, key))
            ds, is_fin, loss, g = grad_fn(p)
            u, ns = tx.update(g, s, p)
            np_ = optax.apply_updates(p, u)
            p, s = jax.tree.map(lambda a, c: jnp.where(is_fin, a, c), (np_, ns), (p, s))
            return p, s, ds, loss

        p = fresh_params()
        st = [p, tx.init(p), DynamicScale()]

        def run():
            st[0], st[1], st[2], loss = step(st[0], st[1], st[2], batch)
            loss.block_until_ready()
        return run

    variants = {
        "optax fp32 (hand-written)": make_optax,
        "effijax fp32": make_effijax("fp32", tx),
        "jmp fp16 + DynamicLossScale": make_jmp,
        "flax DynamicScale fp16": make_flax,
        "effijax fp16 + dynamic_loss_scale": make_effijax("fp16", dynamic_loss_scale(tx)),
        "effijax recipe job fp32 (1-device mesh)": make_recipe,
    }
    res = time_interleaved(variants, rounds=args.rounds, steps_per_round=args.steps_per_round)
    base = res["optax fp32 (hand-written)"]["median_s"]
    best16 = min(res["jmp fp16 + DynamicLossScale"]["median_s"],
                 res["flax DynamicScale fp16"]["median_s"])
    rows = []
    for name, r in res.items():
        rows.append([name, f"{1e3 * r['median_s']:.1f}", f"{1e3 * r['p10_s']:.1f}",
                     f"{1e3 * r['p90_s']:.1f}", f"{r['median_s'] / base:.3f}", r["n"]])
    ratio32 = res["effijax fp32"]["median_s"] / base
    ratio16 = res["effijax fp16 + dynamic_loss_scale"]["median_s"] / best16
    ratio_job = res["effijax recipe job fp32 (1-device mesh)"]["median_s"] / base
    tokens = args.batch_size * config.seq_len
    n_params = sum(x.size for x in jax.tree.leaves(params0))
    body = "\n".join([
        f"On {device_description()}; `{args.model}` GPT ({n_params:,} params), "
        f"batch {args.batch_size}x{config.seq_len} ({tokens} tokens), AdamW. "
        f"Interleaved: {args.rounds} rounds x {args.steps_per_round} steps per variant; "
        "median step time.",
        "",
        markdown_table(["variant", "median ms", "p10 ms", "p90 ms", "vs optax fp32", "steps"],
                       rows),
        "",
        f"- effijax fp32 / hand-written optax fp32: **{ratio32:.3f}x** (goal <= 1.02x: "
        f"{'met' if ratio32 <= 1.02 else 'MISSED'})",
        f"- effijax fp16+dynamic / best of jmp and Flax fp16: **{ratio16:.3f}x** (goal <= 1.0x: "
        f"{'met' if ratio16 <= 1.0 else 'MISSED'})",
        f"- the recipe's job step (`effijax train`'s, with the accuracy metric) / hand-written "
        f"optax fp32: **{ratio_job:.3f}x** (goal <= 1.02x: "
        f"{'met' if ratio_job <= 1.02 else 'MISSED'})",
        "- bf16/fp16 speed-ups and MFU on a GPU: the section \"Accelerator: one command\" "
        "(`benchmarks/accelerator.py`).",
    ])
    publish("Step overhead", body, command=command_line(__file__, argv),
            write=args.write)
    np.testing.assert_array_less(0, base)  # a benchmark that measured nothing is a bug


if __name__ == "__main__":
    main()
