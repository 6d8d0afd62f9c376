"""Memory estimate vs compiled measurement, per sharding strategy and for LoRA.

Each row compiles the sharded GPT train step that ``build_lm_job`` runs (``make_sharded_step``
on the abstract state, nothing allocated) on ``make_mesh()`` (8 devices, fsdp = 8), AdamW from
``make_optimizer``, global batch 8 (one sequence per device), and reads ``memory_analysis()``
per device. Configurations: ddp, zero1, zero2, fsdp (fp32 policy); LoRA rank 8 on every
attention and MLP kernel with the base frozen in the batch, f32 base (fp32 policy) or bf16
base (bf16 policy), under ddp and fsdp. Three groups:

* ``tiny`` GPT (seq 32), partition rules with ``min_shard_size=0`` (every leaf with a divisible
  dimension sharded, as :func:`effijax.memory.estimate_tree` assumes): the configurations of
  ``tests/test_memory_strategies.py``;
* the same with the default rules (leaves below 1024 elements stay whole);
* the sharding benchmark's GPT (d 256, L 4, seq 64, 3.2M parameters), default rules.

Per row: **arguments**, :func:`estimate_tree`'s per-device ``params_bytes + optimizer_bytes``
(the frozen base at its dtype) plus tokens, step and key, against the step's argument bytes;
**kept whole**, the argument bytes the rules leave replicated although ``estimate_tree`` shards
them (real shardings minus all-sharded ones, computed without compiling); **temporaries**,
:func:`compare`'s ``grads_bytes + activation_bytes`` against the step's temporaries; and
**activations / formula**: temporaries minus gradients (both at the strategy's sharding) over
the activation formula (Korthikanti et al. 2022) for one sequence per device, no dropout, 4
bytes per value. For bf16 compute the formula also takes 4 bytes per value and an f32 copy of
the frozen weights is subtracted: what XLA:CPU keeps (see ``tests/test_memory_strategies.py``);
the formula's view, p = 2 and nothing subtracted, is given in the notes.

Run: ``python benchmarks/memory_accuracy.py [--write]`` (3 to 5 minutes on a 2-core CPU); with
``--write`` it replaces the "Memory: estimate vs measured" section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before anything starts the backend

import jax.numpy as jnp  # noqa: E402
from harness import add_write_flag, command_line, device_description, markdown_table, publish  # noqa: E402

from effijax import lora  # noqa: E402
from effijax.memory import (  # noqa: E402
    activation_bytes,
    compare,
    estimate_tree,
    format_bytes,
    measure,
    tree_bytes,
)
from effijax.models import (  # noqa: E402
    abstract_params,
    abstract_split,
    gpt_config,
    make_loss_fn,
    param_count,
)
from effijax.precision import get_policy  # noqa: E402
from effijax.recipe import abstract_state  # noqa: E402
from effijax.sharding import (  # noqa: E402
    DEFAULT_MIN_SHARD_SIZE,
    batch_sharding,
    make_mesh,
    param_shardings,
    partition_specs,
    state_shardings,
    with_shardings,
)
from effijax.step import init_train_state, make_optimizer, make_sharded_step  # noqa: E402

BATCH = 8
STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}
SPEC = lora.LoraSpec(rank=8, alpha=16.0, targets=r"(attn/(q|k|v|o)|mlp/(fc_in|fc_out))/kernel")
# name -> (strategy, dtype of the frozen LoRA base or None for full training)
CONFIGS = {
    "ddp": ("ddp", None),
    "zero1": ("zero1", None),
    "zero2": ("zero2", None),
    "fsdp": ("fsdp", None),
    "LoRA f32 base, ddp": ("ddp", jnp.float32),
    "LoRA f32 base, fsdp": ("fsdp", jnp.float32),
    "LoRA bf16 base, ddp": ("ddp", jnp.bfloat16),
    "LoRA bf16 base, fsdp": ("fsdp", jnp.bfloat16),
}
GROUPS = {
    "tiny, all sharded": (gpt_config("tiny", seq_len=32), 0),
    "tiny, default rules": (gpt_config("tiny", seq_len=32), DEFAULT_MIN_SHARD_SIZE),
    "d256, default rules": (gpt_config("small", seq_len=64, d_model=256, n_layers=4, n_heads=4),
                            DEFAULT_MIN_SHARD_SIZE),
}
PRUNED_BYTES = 4  # the injected learning rate: recomputed by the schedule, dropped by jit


def measure_point(model, config: str, min_shard_size: int) -> dict:
    """Compiles one configuration's step and lines it up with the estimates."""
    strategy, base_dtype = CONFIGS[config]
    policy = get_policy("bf16" if base_dtype == jnp.bfloat16 else "fp32")
    mesh = make_mesh()
    optimizer = make_optimizer(1e-3, 100)
    graphdef, abstract = abstract_split(model, policy)
    tokens_sh = batch_sharding(mesh)
    tokens = {k: jax.ShapeDtypeStruct((BATCH, model.seq_len), jnp.int32, sharding=tokens_sh)
              for k in ("inputs", "targets")}
    base = None
    if base_dtype is None:
        loss_fn = make_loss_fn(graphdef)
        state = abstract_state(model, policy, optimizer)
        tree, trainable = abstract, None
    else:
        loss_fn = lora.freeze_base(make_loss_fn(graphdef, lora=SPEC))
        base = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, base_dtype),
                            abstract_params(model))
        state = jax.eval_shape(
            lambda key: init_train_state(lora.init(key, base, SPEC), optimizer, key),
            jax.random.key(0))
        tree = {"base": base, "lora": state.params}
        trainable = {"base": jax.tree.map(lambda _: False, base),
                     "lora": jax.tree.map(lambda _: True, state.params)}

    def held(size):
        """Per-device bytes of the state and the frozen base under rules with ``size``."""
        sh = state_shardings(state, mesh, strategy, min_shard_size=size)
        st = with_shardings(state, sh)
        frozen = None if base is None else with_shardings(
            base, param_shardings(base, mesh, strategy, min_shard_size=size))
        return sh, st, frozen

    shardings, sharded_state, sharded_base = held(min_shard_size)
    batch, batch_sh = tokens, tokens_sh
    if base is not None:
        batch = {**tokens, "base": sharded_base}
        batch_sh = {"inputs": tokens_sh, "targets": tokens_sh,
                    "base": jax.tree.map(lambda x: x.sharding, sharded_base)}
    step = make_sharded_step(loss_fn, optimizer, policy, mesh=mesh, strategy=strategy,
                             specs=partition_specs(state.params, mesh,
                                                   min_shard_size=min_shard_size),
                             shardings=shardings, has_aux=True, batch_sharding=batch_sh)
    t0 = time.perf_counter()
    m = measure(step.lower(sharded_state, batch).compile())
    compile_s = time.perf_counter() - t0
    _, all_state, all_base = held(0)
    kept_whole = (tree_bytes((sharded_state.params, sharded_state.opt_state, sharded_base))
                  - tree_bytes((all_state.params, all_state.opt_state, all_base)))

    est = estimate_tree(tree, optimizer, param_dtype=policy.param_dtype,
                        compute_dtype=policy.compute_dtype, zero_stage=STAGES[strategy],
                        devices=mesh.size, trainable=trainable)
    compute_bytes = jnp.dtype(policy.compute_dtype).itemsize

    def formula(p):
        return activation_bytes(layers=model.n_layers, hidden=model.d_model,
                                heads=model.n_heads, seq_len=model.seq_len,
                                batch_size=BATCH // mesh.size, bytes_per_value=p,
                                dropout=model.dropout > 0)

    # XLA:CPU keeps bf16-policy activations in f32, and an f32 copy of bf16 frozen weights.
    weight_copy = 2 * tree_bytes(sharded_base) if base_dtype == jnp.bfloat16 else 0
    arguments, temporaries = compare(
        est, m, activation_bytes=formula(4),
        other_argument_bytes=tree_bytes((tokens, sharded_state.step, sharded_state.rng)))
    # Everything the estimate misses is accounted for: the leaves kept whole and the one
    # pruned scalar.
    assert arguments.measured == arguments.estimate - PRUNED_BYTES + kept_whole, (
        config, arguments, kept_whole)
    return {
        "config": config, "arguments": arguments, "temporaries": temporaries,
        "kept_whole": kept_whole,
        "ratio": (m.temp_bytes - est.grads_bytes - weight_copy) / formula(4),
        "seed_ratio": (m.temp_bytes - est.grads_bytes) / formula(compute_bytes),
        "compute": {4: "f32", 2: "bf16"}[compute_bytes], "compile_s": compile_s,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    add_write_flag(ap)
    args = ap.parse_args(argv)

    rows, points = [], {}
    for group in args.groups:
        model, min_shard_size = GROUPS[group]
        for config in CONFIGS:
            p = measure_point(model, config, min_shard_size)
            points[group, config] = p
            a, t = p["arguments"], p["temporaries"]
            rows.append([group, config, p["compute"], format_bytes(a.estimate),
                         format_bytes(a.measured), f"{a.rel_error:+.4%}",
                         format_bytes(p["kept_whole"]), format_bytes(t.estimate),
                         format_bytes(t.measured), f"{t.rel_error:+.1%}", f"{p['ratio']:.2f}x"])
            print(" | ".join(str(c) for c in rows[-1]), f"(compiled in {p['compile_s']:.1f} s)",
                  flush=True)

    notes = []
    for group in args.groups:
        ps = [p for (g, _), p in points.items() if g == group]
        err = max(ps, key=lambda p: abs(p["arguments"].rel_error))
        ratios = {c: [p["ratio"] for p in ps if p["compute"] == c] for c in ("f32", "bf16")}
        seed = [f"{p['seed_ratio']:.2f}x ({p['config'].split(', ')[1]})" for p in ps
                if p["compute"] == "bf16"]
        notes.append(
            f"- {group}: largest argument error **{err['arguments'].rel_error:+.4%}** "
            f"({err['config']}); activations / formula {min(ratios['f32']):.2f}x to "
            f"{max(ratios['f32']):.2f}x with f32 compute, {min(ratios['bf16']):.2f}x to "
            f"{max(ratios['bf16']):.2f}x with bf16 compute (the formula's p = 2, no copy "
            f"subtracted: {', '.join(seed)}).")
    models = {g.split(",")[0]: GROUPS[g][0] for g in args.groups}
    sizes = ", ".join(f"{name} {param_count(model):,}" for name, model in models.items())
    body = "\n".join([
        f"On {device_description()}. Per device, mesh "
        f"fsdp=8, global batch {BATCH} (one sequence per device), `make_optimizer`'s AdamW, "
        f"fp32 policy (bf16 policy for the bf16 LoRA base); parameters: {sizes}. LoRA: rank "
        f"{SPEC.rank} on every attention and MLP kernel, the frozen base passed in the batch "
        "(`lora.freeze_base`). Each row is one compiled sharded train step "
        "(`make_sharded_step`, what `build_lm_job` runs); nothing is allocated. Bytes in "
        "decimal units.",
        "",
        "*Arguments*: `estimate_tree` (params + optimizer state at the strategy's ZeRO stage, "
        "the frozen base at its own dtype) + tokens, step and key vs the step's argument bytes "
        "(gradients are temporaries, not arguments). *Kept whole*: argument bytes the "
        "partition rules leave replicated although `estimate_tree` shards them (leaves below "
        "`min_shard_size`), times 7/8; in every row measured = estimate + kept whole - 4 B "
        "exactly (checked by the script; the 4 B: the schedule recomputes the injected "
        "learning rate, so jit drops the stale one from the arguments). *Temporaries*: "
        "`compare`'s gradients (sharded for zero2/fsdp) + the activation formula (4 B "
        "per value) vs the step's temporaries. *Activations / formula*: (temporaries - "
        "gradients - f32 copy of a bf16 frozen base) / formula.",
        "",
        markdown_table(["group", "configuration", "compute", "arguments: estimate",
                        "measured", "error", "kept whole", "temporaries: grads + formula",
                        "measured", "error", "activations / formula"], rows),
        "",
        *notes,
        "",
        "- Model states: with every divisible leaf sharded, `estimate_tree` is exact up to the "
        "4 B scalar for every strategy and for LoRA (`tests/test_memory_strategies.py` asserts "
        "within 5% and the 4 B). With the default rules the biases and LayerNorms (below 1024 "
        "elements) stay whole, and `estimate_tree`, which shards every divisible leaf, "
        "undercounts them: by up to 10% in the tiny model (d 64), where they weigh most under "
        "fsdp, and by about 0.1% in the d 256 model. `estimate_tree(..., min_shard_size="
        "effijax.sharding.DEFAULT_MIN_SHARD_SIZE)` applies the same floor and then matches "
        "the default rule's per-device bytes exactly (tested for every strategy).",
        "- Activations: the formula is a lower bound; with f32 compute the measurement "
        "stays within the suite's 1x to 4x band (the logits and the backward's working "
        "buffers are outside the formula). With bf16 compute the formula's "
        "p = 2 formula is much further off on this backend: XLA:CPU has no bf16 arithmetic "
        "(after its passes only the dots read bf16), so the intermediates it keeps are f32, "
        "and the backward's f32-accumulating input-gradient matmuls use an f32 copy of the "
        "weights (under ddp the whole frozen base). Counted that way (p = 4, copy "
        "subtracted) the bf16 rows fall in the same band. GPUs and TPUs compute in bf16 "
        "natively, so there the p = 2 formula should apply; this host has no accelerator with "
        "8 devices to check it.",
        "- `compare`'s temporaries row (gradients + formula) is a lower bound on XLA's "
        "temporaries, by the factor above: the planner's estimates of activations should be "
        "read the same way.",
    ])
    publish("Memory: estimate vs measured", body, command=command_line(__file__, argv),
            write=args.write)


if __name__ == "__main__":
    main()
