"""Attention implementations side by side: the GPT train step with each ``GPTConfig.attention``.

For each preset, the same parameters, batch and optimizer (the ``effijax train`` one) run one
jitted train step per implementation, timed interleaved (``harness.time_interleaved``: median
over all timed steps). It also times the attention op alone (forward + backward w.r.t. q, k, v)
at the preset's shape, since the step's other work dilutes the differences. ``"auto"`` is not
timed separately: it runs one of the others (``effijax.models.choose_attention`` says which); this
measurement is what its CPU choice (``CPU_ATTENTION`` in ``effijax/models/_attention.py``) rests on.

``--blocks`` times instead the blockwise kernel alone (forward + backward) at the pretrained
families' head shapes (SmolLM2: 9 heads over 3 kv heads of 64; Gemma 3 270M: 4 over 1 of 256,
also under its sliding window of 512) from 128 to 2,048 tokens, with each block size and with
``default_block_size``'s choice: the measurement that rule rests on (its own section of
RESULTS.md).

Run: ``python benchmarks/attention.py [--models mini,small] [--precision fp32] [--write]``, or
``python benchmarks/attention.py --blocks [--lengths 128,256,512,1024,2048] [--write]``.
Without ``--write`` it only prints; with it, it replaces its section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

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
from effijax.models import (
    ATTENTION,
    blockwise_attend,
    choose_attention,
    default_block_size,
    gpt_config,
)
from effijax.step import init_train_state, make_train_step

IMPLEMENTATIONS = ("naive", "blockwise", "xla")

# --blocks: (name, query heads, kv heads, head width, sliding window) of the pretrained
# families' attention; a windowed shape is timed at the lengths longer than its window.
HEAD_SHAPES = (("SmolLM2", 9, 3, 64, None), ("Gemma 3 270M", 4, 1, 256, None),
               ("Gemma 3 270M, window 512", 4, 1, 256, 512))
BLOCK_SIZES = (64, 128, 256)
TOKENS_PER_BATCH = 2048  # batch x length: 4 x 512 down to 1 x 2048, capped at 4 rows


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


def _op_variant(fn, shape, dtype, kv_heads=None):
    """Forward + backward of the attention ``fn`` on queries ``shape`` over ``kv_heads``
    key/value heads (None: as many as the queries')."""
    def make():
        b, s, h, k = shape
        keys = jax.random.split(jax.random.key(0), 4)
        q, w = (jax.random.normal(kk, shape, dtype) for kk in keys[:2])
        kv = [jax.random.normal(kk, (b, s, kv_heads or h, k), dtype) for kk in keys[2:]]
        grad = jax.jit(jax.grad(
            lambda q, k, v: jnp.sum((fn(q, k, v) * w).astype(jnp.float32)), argnums=(0, 1, 2)))

        def run():
            jax.block_until_ready(grad(q, *kv))
        return run
    return make


def _blockwise_variant(shape_q, kv_heads, block, window=None):
    """:func:`_op_variant` of ``blockwise_attend`` with ``block`` x ``block`` tiles under
    ``window``, f32."""
    fn = functools.partial(blockwise_attend, block_q=block, block_k=block, window=window)
    return _op_variant(fn, shape_q, jnp.float32, kv_heads)


def block_sizes(lengths, *, rounds: int, steps_per_round: int) -> str:
    """The blockwise kernel timed per block size at each length and head shape: the section's
    text."""
    rows = []
    for name, heads, kv_heads, width, window in HEAD_SHAPES:
        for length in [n for n in lengths if window is None or n > window]:
            batch = max(1, min(4, TOKENS_PER_BATCH // length))
            shape = (batch, length, heads, width)
            sizes = [b for b in BLOCK_SIZES if b < length] + [length]
            res = time_interleaved(
                {b: _blockwise_variant(shape, kv_heads, b, window) for b in sizes},
                rounds=rounds, steps_per_round=steps_per_round, warmup=1)
            best = min(sizes, key=lambda b: res[b]["median_s"])
            chosen = default_block_size(length)
            tile = {length: "one tile"}
            rows.append([name, f"{batch} x {length}", *_cells(res, length),
                         tile.get(chosen, str(chosen)), tile.get(best, str(best)),
                         f"{res[chosen]['median_s'] / res[best]['median_s']:.2f}",
                         f"{res[64]['median_s'] / res[chosen]['median_s']:.2f}"
                         if 64 in res and chosen != 64 else "-"])
    return "\n".join([
        f"On {device_description()}; f32, forward + backward w.r.t. q, k, v of the causal "
        f"kernel alone, blocks of the same size for queries and keys. Interleaved: {rounds} "
        f"rounds x {steps_per_round} calls per block size; median ms.",
        "",
        markdown_table(["heads", "batch x tokens", *(f"{b}" for b in BLOCK_SIZES),
                        "one tile", "default", "fastest", "default / fastest",
                        "64 / default"], rows),
        "",
        "- default: `default_block_size(length)`, the block the kernel takes when none is "
        "given; `default / fastest` is its time over the fastest size's, `64 / default` the "
        "64 x 64 tiles' (every length's default before) over its.",
    ])


def _cells(res, length):
    """The table's time cells: one per block size below ``length``, then one tile (the whole
    sequence); '-' where that size is not below the length."""
    cells = [f"{1e3 * res[b]['median_s']:.1f}" if b in res and b < length else "-"
             for b in BLOCK_SIZES]
    return [*cells, f"{1e3 * res[length]['median_s']:.1f}"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--blocks", action="store_true",
                    help="time the blockwise kernel's block sizes instead of the implementations")
    ap.add_argument("--lengths", default="128,256,512,1024,2048",
                    help="with --blocks: sequence lengths, comma-separated")
    ap.add_argument("--models", default="mini,small")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--precision", default="fp32", help="policy preset (fp32, bf16, ...)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps-per-round", type=int, default=4)
    add_write_flag(ap)
    args = ap.parse_args(argv)
    if args.blocks:
        lengths = [int(n) for n in args.lengths.split(",")]
        name = "Blockwise attention: block sizes"
        body = block_sizes(lengths, rounds=args.rounds, steps_per_round=args.steps_per_round)
    else:
        name, body = "Attention implementations on this device", implementations(args)
    publish(name, body, command=command_line(__file__, argv), write=args.write)


def implementations(args) -> str:
    """The GPT presets' train step and attention op with each implementation: the section's
    text."""
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
    return body


if __name__ == "__main__":
    main()
