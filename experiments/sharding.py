"""Per-device model-state memory of DDP, ZeRO-1, ZeRO-2 and FSDP as the device count grows.

For each strategy and N in ``devices`` (meshes over the first N devices, ``fsdp=N``), the GPT's
train state is laid out abstractly (``jax.eval_shape`` + :func:`effijax.sharding.state_shardings`:
nothing is allocated) and the bytes one device holds of the parameters, gradients and optimizer
state are read off the shardings. They are set against:

* ``estimate_tree``: :func:`effijax.memory.estimate_tree` for the job's real dtypes. Under the
  ``bf16`` policy the stored parameters are the f32 master (4 B) and so are the gradients (the
  cast's transpose returns f32), Adam's moments are f32 (8 B): 16 bytes per parameter, split
  4 + 4 + 8, not the ZeRO paper's 2 + 2 + 12. It shards every leaf that has a divisible dimension;
  the automatic partition rule keeps leaves below ``min_shard_size`` (biases, LayerNorms) whole,
  which the ``leftover`` column accounts for exactly (measured == estimate + leftover).
* ``ZeRO``: the closed form of the ZeRO paper (Rajbhandari et al. 2020),
  :func:`effijax.memory.model_states` with ``precision="mixed"``: DDP 16Ψ, ZeRO-1
  4Ψ + 12Ψ/N, ZeRO-2 2Ψ + 14Ψ/N, ZeRO-3 16Ψ/N. Same totals at N = 1 and for FSDP; ZeRO-1/2
  differ because our replicated params/grads are f32.

With ``compile=True`` each configuration's step is also compiled (abstractly, still nothing
allocated) and ``compiled.memory_analysis()`` adds the temporaries: activations and, under FSDP,
the gathered weights.

Then the 2-D meshes with a ``tensor`` axis (``fsdp=2,tensor=4``, ``tensor=8``,
``data=2,tensor=4``, each with one strategy) are laid out the same way with the model's
Megatron layout (:meth:`tensor_layout`): measured bytes against ``estimate_tree`` with that
layout and the closed form ``model_states(..., tensor=t)`` (which splits every parameter; the
norms stay whole, the ``replicated`` column). Compiled, their census is set against
:func:`effijax.memory.communication`: the ``[b, s, h]`` activation all-reduces over the tensor
axis of one layer (Megatron's 2 forward + 2 backward; the layers are scanned, so the census
sees one layer's body once) and their ring bytes. On jax 0.10.2 (the default preset, CPU) every
2-D mesh shows 6 per layer, in f32: XLA reduces the q, k and v input gradients separately (3
where Megatron has 1) and reduces the dots' partial sums in their f32 accumulator, before the
cast to bf16; so 3x the bf16 prediction on the wire (6/4 collectives x 4/2 bytes).

Run: ``python experiments/sharding.py [--preset smoke|default] [--out DIR]``. Writes
``results.json`` and ``sharding.png`` to ``--out``. Needs max(devices) devices: forces 8 CPU
devices when run as a script on a CPU-only machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from effijax.memory import communication, estimate_tree, format_bytes, model_states
from effijax.models import abstract_split, gpt_config, init_params, make_loss_fn
from effijax.precision import get_policy
from effijax.sharding import (
    batch_sharding,
    collective_census,
    device_bytes,
    grad_shardings,
    make_mesh,
    memory_report,
    parse_mesh,
    partition_specs,
    state_shardings,
    with_shardings,
)
from effijax.step import init_train_state, make_optimizer, make_sharded_step

ZERO_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}


@dataclasses.dataclass(frozen=True)
class Config:
    model: str = "mini"
    seq_len: int = 128
    n_heads: int = 8  # tensor=8 must divide the heads (parameter shapes do not depend on it)
    policy: str = "bf16"  # f32 master parameters, bf16 compute
    strategies: tuple[str, ...] = ("ddp", "zero1", "zero2", "fsdp")
    devices: tuple[int, ...] = (1, 2, 4, 8)
    # 2-D meshes (as `effijax train --mesh` spells them) and the strategy each is measured with.
    tensor_meshes: tuple[tuple[str, str], ...] = (
        ("fsdp=2,tensor=4", "fsdp"), ("tensor=8", "ddp"), ("data=2,tensor=4", "zero1"))
    compile: bool = True  # also compile each step for its temporaries
    batch_size: int = 8  # for compile: sequences per step (divisible by max(devices))
    out: str = "runs/sharding"


PRESETS = {
    "default": Config(),
    "smoke": Config(model="tiny", seq_len=32, compile=False, out="runs/sharding-smoke"),
}


def device_pool(n: int) -> list:
    """The first ``n`` devices of the default backend, else of the CPU (forced CPU devices
    stand in for a single accelerator: the layouts are what is measured)."""
    for devices in (jax.devices(), jax.devices("cpu")):
        if len(devices) >= n:
            return devices[:n]
    raise RuntimeError(f"need {n} devices, found {len(jax.devices())}; force CPU devices with "
                       "jax.config.update('jax_num_cpu_devices', 8) before using jax")


def measure(cfg: Config, strategy: str, axes: dict, abstract, optimizer, policy,
            layout=None) -> dict:
    """One (strategy, mesh) configuration: measured bytes, the two formulas, the leftovers.

    ``axes``: the mesh's sizes (``{"fsdp": N}`` for the 1-D sweep); ``layout``: the model's
    tensor layout, used when the mesh has a ``tensor`` axis.
    """
    axes = {"data": 1, "fsdp": 1, "tensor": 1, **axes}
    n = math.prod(axes.values())
    mesh = make_mesh(**axes, devices=device_pool(n))
    layout = layout if axes["tensor"] > 1 else None
    specs = partition_specs(abstract.params, mesh, tensor_layout=layout)
    shardings = state_shardings(abstract, mesh, strategy, tensor_layout=layout)
    state = with_shardings(abstract, shardings)
    grads = grad_shardings(specs, mesh, strategy)
    measured = device_bytes(state, grad_shardings=grads, strategy=strategy)
    # The same layout with every divisible leaf sharded: what estimate_tree counts.
    all_specs = partition_specs(abstract.params, mesh, min_shard_size=0, tensor_layout=layout)
    everything = device_bytes(
        with_shardings(abstract, state_shardings(abstract, mesh, strategy, min_shard_size=0,
                                                 tensor_layout=layout)),
        grad_shardings=grad_shardings(all_specs, mesh, strategy))
    stage = ZERO_STAGE[strategy]
    estimate = estimate_tree(abstract.params, optimizer, param_dtype=policy.param_dtype,
                             compute_dtype=policy.compute_dtype, zero_stage=stage,
                             devices=axes["fsdp"], tensor=axes["tensor"], tensor_layout=layout)
    num_params = sum(x.size for x in jax.tree.leaves(abstract.params))
    paper = model_states(num_params, optimizer="adam", precision="mixed", zero_stage=stage,
                         devices=axes["fsdp"], tensor=axes["tensor"])
    row = {
        "strategy": strategy, "devices": n, "mesh": axes, "num_params": num_params,
        "params": measured.params, "grads": measured.grads, "opt_state": measured.opt_state,
        "measured": measured.model_states, "replicated": measured.replicated,
        "estimate": estimate.model_state_bytes,
        "leftover": measured.model_states - everything.model_states,
        "estimate_matches_layout": everything.model_states == estimate.model_state_bytes,
        "zero_paper_mixed": paper.model_state_bytes,
    }
    if cfg.compile:
        row.update(_compiled(cfg, mesh, strategy, specs, shardings, state, grads, optimizer,
                             policy))
    return row


def _compiled(cfg, mesh, strategy, specs, shardings, state, grads, optimizer, policy) -> dict:
    model = gpt_config(cfg.model, seq_len=cfg.seq_len, n_heads=cfg.n_heads)
    graphdef, _ = abstract_split(model, policy)
    lm_loss = make_loss_fn(graphdef)
    step = make_sharded_step(lm_loss, optimizer, policy, mesh=mesh, strategy=strategy,
                             specs=specs, shardings=shardings, has_aux=True)
    batch = {k: jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len), jnp.int32,
                                     sharding=batch_sharding(mesh))
             for k in ("inputs", "targets")}
    report = memory_report(step.lower(state, batch).compile(), state, grad_shardings=grads)
    row = {"temporaries": report.temporaries, "arguments": report.arguments}
    t = mesh.shape["tensor"]
    if t > 1:
        row.update(_tensor_census(cfg, model, mesh, step, state, batch, strategy))
    return row


def _tensor_census(cfg, model, mesh, step, state, batch, strategy) -> dict:
    """The tensor axis' activation all-reduces of one layer: the census against Megatron's."""
    t, ranks = mesh.shape["tensor"], mesh.shape["data"] * mesh.shape["fsdp"]
    rows = cfg.batch_size // ranks
    num_params = sum(x.size for x in jax.tree.leaves(state.params))
    predicted = communication(num_params, layers=model.n_layers, hidden=model.d_model,
                              seq_len=cfg.seq_len, batch_size=rows, data=mesh.shape["data"],
                              fsdp=mesh.shape["fsdp"], tensor=t,
                              zero_stage=ZERO_STAGE[strategy])
    census = collective_census(step, state, batch)
    values = rows * cfg.seq_len * model.d_model  # one [b, s, h] activation
    acts = [op for op in census.of("all-reduce") if op.group_size == t
            and math.prod(op.shape) == values and "_run_layers" in (op.op_name or "")]
    return {
        "tensor_allreduces_per_layer": len(acts),
        "tensor_allreduces_per_layer_predicted": predicted.tensor_collectives // model.n_layers,
        "tensor_allreduce_dtypes": sorted({op.dtype for op in acts}),
        "tensor_wire_per_layer": sum(op.wire_bytes for op in acts),
        # Megatron's count at 2-byte (bf16) activations, per layer.
        "tensor_wire_per_layer_predicted": predicted.tensor_wire_bytes / model.n_layers,
    }


def main(cfg: Config) -> dict:
    """Measures every (strategy, N); returns ``{"config", "rows"}`` and writes the outputs."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model = gpt_config(cfg.model, seq_len=cfg.seq_len, n_heads=cfg.n_heads)
    policy = get_policy(cfg.policy)
    optimizer = make_optimizer(1e-3, 100)  # AdamW, clipping, schedule: the `effijax train` one
    abstract = jax.eval_shape(
        lambda key: init_train_state(init_params(model, policy, key), optimizer, key),
        jax.random.key(0))
    rows = [measure(cfg, strategy, {"fsdp": n}, abstract, optimizer, policy)
            for strategy in cfg.strategies for n in cfg.devices]
    layout = model.tensor_layout()
    tensor_rows = [measure(cfg, strategy, parse_mesh(spec), abstract, optimizer, policy, layout)
                   for spec, strategy in cfg.tensor_meshes]
    results = {"config": dataclasses.asdict(cfg), "rows": rows, "tensor_rows": tensor_rows}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    _plot(out / "sharding.png", cfg, rows)
    print(_table(rows))
    if tensor_rows:
        print(_table(tensor_rows))
    return results


def _table(rows: list[dict]) -> str:
    head = (f"{'strategy':<8}{'mesh':>9}{'params':>11}{'grads':>11}{'opt':>11}{'measured':>11}"
            f"{'estimate':>11}{'leftover':>10}{'ZeRO':>11}")
    lines = [head]
    for r in rows:
        cells = [format_bytes(r[k]) for k in ("params", "grads", "opt_state", "measured",
                                               "estimate", "leftover", "zero_paper_mixed")]
        lines.append(f"{r['strategy']:<8}{_mesh_label(r['mesh']):>9}" + "".join(
            f"{c:>{w}}" for c, w in zip(cells, (11, 11, 11, 11, 11, 10, 11), strict=True)))
        if "temporaries" in r:
            lines[-1] += f"   temporaries {format_bytes(r['temporaries'])}"
        if "tensor_allreduces_per_layer" in r:
            lines[-1] += (f"   tensor all-reduces/layer {r['tensor_allreduces_per_layer']} "
                          f"(Megatron {r['tensor_allreduces_per_layer_predicted']}), "
                          f"{format_bytes(round(r['tensor_wire_per_layer']))} on the wire "
                          f"(bf16: {format_bytes(round(r['tensor_wire_per_layer_predicted']))})")
    return "\n".join(lines)


def _mesh_label(axes: dict) -> str:
    """``8`` for the 1-D sweep's ``fsdp=8``; ``f2xt4``, ``t8``, ``d2xt4`` for the 2-D meshes."""
    if axes["data"] == axes["tensor"] == 1:
        return str(axes["fsdp"])
    return "x".join(f"{name[0]}{size}" for name, size in axes.items() if size > 1)


def _plot(path: Path, cfg: Config, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, strategy in enumerate(cfg.strategies):
        mine = [r for r in rows if r["strategy"] == strategy]
        ns = [r["devices"] for r in mine]
        color = f"C{i}"
        ax.plot(ns, [r["measured"] / 1e6 for r in mine], "o-", color=color,
                label=f"{strategy} measured")
        ax.plot(ns, [r["estimate"] / 1e6 for r in mine], "x--", color=color, alpha=0.7,
                label=f"{strategy} estimate_tree")
        ax.plot(ns, [r["zero_paper_mixed"] / 1e6 for r in mine], ":", color=color, alpha=0.6,
                label=f"{strategy} ZeRO paper (2+2+12)Ψ")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(cfg.devices), [str(n) for n in cfg.devices])
    ax.set_xlabel("devices N")
    ax.set_ylabel("params + grads + optimizer state per device (MB)")
    ax.set_title(f"{cfg.model} GPT ({rows[0]['num_params']:,} params), {cfg.policy} policy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--preset", default="default", choices=sorted(PRESETS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu-devices", type=int, default=8,
                    help="CPU devices to force (used when there is no accelerator)")
    args = ap.parse_args()
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    config = PRESETS[args.preset]
    if args.out:
        config = dataclasses.replace(config, out=args.out)
    main(config)
