"""Memory: published memory tables from the estimator, and measured activations vs the formula.

Part 1 prints the analytic tables of:

* Biderman et al. 2024, "LoRA Learns Less and Forgets Less", appendix tables S1-S3: model +
  optimizer state per GPU for 7B / 70B / 405B, full fine-tuning vs LoRA (1% adapters, bf16
  frozen base), Adam vs Lion, FSDP over 1 / 8 / 32 GPUs;
* Rajbhandari et al. 2020 (ZeRO): the (2 + 2 + 12)Ψ mixed-precision Adam table (7B -> 112 GB,
  70B -> 1120 GB) and the ZeRO-1 worked example (7.5B on N_d = 64: 120 GB -> 31.4 GB);
* the activation formula L·p·s·b·h·(16 + 2/p + 2as/h + as/(p·h)) (Korthikanti et al. 2022,
  p bytes per value) for a 7B-shaped model, with flash attention and block checkpointing.

Part 2 compiles a GPT train step (f32, Adam) at several sequence lengths for naive vs blockwise
attention, with and without block rematerialisation, and sets the compiled temporaries minus
the gradients ("measured activations") against the formula with 4-byte values and no dropout.
Naive attention grows with s², blockwise attention linearly; the formula is a lower bound that
XLA's CPU buffers exceed by a bounded factor (see ``tests/test_memory_measure.py``).

Run: ``python experiments/memory.py [--preset smoke|default] [--out DIR]``. Writes
``results.json`` and ``memory.png`` (activation bytes vs s, measured and formula; their ratio).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from effijax.memory import (
    ACTIVATION_VARIANTS,
    GB,
    activation_bytes,
    activation_measure,
    format_bytes,
    model_states,
)
from effijax.models import gpt_config


@dataclasses.dataclass(frozen=True)
class Config:
    model: str = "mini"  # GPT preset of the measured sweep (its seq_len is replaced)
    seq_lens: tuple[int, ...] = (128, 256, 512, 1024)
    batch_size: int = 1
    variants: tuple[str, ...] = tuple(ACTIVATION_VARIANTS)
    out: str = "runs/memory"


PRESETS = {
    "default": Config(),
    "smoke": Config(model="tiny", seq_lens=(64, 128), out="runs/memory-smoke",
                    variants=("naive", "blockwise")),
}

LORA_PAPER_MODELS = ("7B", "70B", "405B")
LORA_PAPER_DEVICES = (1, 8, 32)


def lora_paper_table() -> list[dict]:
    """Model + optimizer state per GPU (GB) as in Biderman et al. 2024, tables S1-S3."""
    rows = []
    for model in LORA_PAPER_MODELS:
        for method in ("full", "lora"):
            for optimizer in ("adam", "lion"):
                cells = [model_states(model, optimizer=optimizer, precision="fp32", zero_stage=3,
                                      devices=n, lora_fraction=0.01 if method == "lora" else None,
                                      frozen_dtype="bf16").model_state_bytes / GB
                         for n in LORA_PAPER_DEVICES]
                rows.append({"model": model, "method": method, "optimizer": optimizer,
                             **{f"{n} GPU": c for n, c in zip(LORA_PAPER_DEVICES, cells,
                                                              strict=True)}})
    return rows


def model_state_tables() -> dict:
    """The ZeRO paper's (2 + 2 + 12)Ψ table and ZeRO-1 example, and the activation formula
    example."""
    states = []
    for model in ("7B", "70B"):
        st = model_states(model, optimizer="adam", precision="mixed")
        states.append({"model": model, "params (fp16)": st.params_bytes / GB,
                       "grads (fp16)": st.grads_bytes / GB,
                       "optimizer (fp32 master + moments)": st.optimizer_bytes / GB,
                       "total": st.model_state_bytes / GB})
    zero1 = {"model": "7.5B", "standard (DDP)": model_states("7.5B").model_state_bytes / GB,
             "ZeRO-1, N_d=64": model_states("7.5B", zero_stage=1,
                                            devices=64).model_state_bytes / GB,
             "limit 4/(4+K), K=12": 4 / 16}
    shape = {"layers": 32, "hidden": 4096, "heads": 32, "seq_len": 2048, "batch_size": 1}
    acts = []
    for label, kw in (("formula (bf16, dropout)", {}),
                      ("blockwise attention", {"blockwise_attention": True}),
                      ("block checkpointing", {"checkpointing": "block"}),
                      ("both", {"blockwise_attention": True, "checkpointing": "block"})):
        acts.append({"activations, 7B shape (L=32, h=4096, a=32, s=2048, b=1)": label,
                     "GB": activation_bytes(**shape, **kw) / GB})
    return {"states": states, "zero1": zero1, "activations": acts}


def _markdown(rows: list[dict], fmt: str = "{:g}") -> str:
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append("| " + " | ".join(fmt.format(v) if isinstance(v, float) else str(v)
                                       for v in r.values()) + " |")
    return "\n".join(lines)


def measured_activations(cfg: Config) -> list[dict]:
    """The compiled sweep, one dict per (variant, seq_len)."""
    variants = {name: ACTIVATION_VARIANTS[name] for name in cfg.variants}
    points = activation_measure(gpt_config(cfg.model), cfg.seq_lens, batch_size=cfg.batch_size,
                                variants=variants)
    rows = []
    for p in points:
        arguments = p.rows[0]
        rows.append({
            "variant": p.variant, "seq_len": p.seq_len, "temp_bytes": p.measurement.temp_bytes,
            "grads_bytes": p.states.grads_bytes, "activation_bytes": p.activation_bytes,
            "formula_bytes": p.formula_bytes, "ratio": p.ratio,
            "argument_bytes": arguments.measured, "argument_estimate": arguments.estimate,
            "argument_rel_error": arguments.rel_error,
        })
    return rows


def _measured_table(rows: list[dict]) -> str:
    lines = ["| variant | s | temporaries | - gradients = activations | formula (p=4) | "
             "measured / formula | arguments: estimate error |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['seq_len']} | {format_bytes(r['temp_bytes'])} | "
            f"{format_bytes(r['activation_bytes'])} | {format_bytes(r['formula_bytes'])} | "
            f"{r['ratio']:.2f}x | {r['argument_rel_error']:+.2%} |"
        )
    return "\n".join(lines)


def _plot(out: Path, rows: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_ratio) = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, variant in enumerate(dict.fromkeys(r["variant"] for r in rows)):
        rs = [r for r in rows if r["variant"] == variant]
        s = [r["seq_len"] for r in rs]
        color = f"C{i}"
        ax.plot(s, [r["activation_bytes"] / 2**20 for r in rs], "o-", color=color,
                label=f"{variant}: measured")
        ax.plot(s, [r["formula_bytes"] / 2**20 for r in rs], "--", color=color,
                label=f"{variant}: formula")
        ax_ratio.plot(s, [r["ratio"] for r in rs], "o-", color=color, label=variant)
    for a in (ax, ax_ratio):
        a.set_xscale("log", base=2)
        a.set_xlabel("sequence length s")
        a.grid(alpha=0.3)
    ax.set_yscale("log", base=2)
    ax.set_ylabel("MiB")
    ax.set_title(f"activations of a train step ({title}): measured vs formula")
    ax.legend(fontsize=7)
    ax_ratio.set_ylabel("measured / formula")
    ax_ratio.set_title("measured activations over the formula")
    ax_ratio.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=110)
    plt.close(fig)


def main(cfg: Config) -> dict:
    """Prints the published tables and the measured sweep; returns them (also in results.json)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    lora_paper = lora_paper_table()
    zero = model_state_tables()
    print("## Biderman et al. 2024, tables S1-S3: model + optimizer state per GPU (GB), FSDP\n")
    print(_markdown(lora_paper))
    print("\n## Rajbhandari et al. 2020 (ZeRO): (2 + 2 + 12)Ψ, mixed-precision Adam (GB)\n")
    print(_markdown(zero["states"]))
    print("\n## Rajbhandari et al. 2020 (ZeRO): ZeRO-1 worked example (GB)\n")
    print(_markdown([zero["zero1"]], fmt="{:.4g}"))
    print("\n## Activation formula (Korthikanti et al. 2022), 7B shape (GB)\n")
    print(_markdown(zero["activations"], fmt="{:.2f}"))

    measured = measured_activations(cfg)
    model = gpt_config(cfg.model)
    title = f"{cfg.model}: L={model.n_layers}, h={model.d_model}, a={model.n_heads}, " \
            f"b={cfg.batch_size}, f32"
    print(f"\n## Measured activations, {title}\n")
    print(_measured_table(measured))
    _plot(out, measured, title)
    results = {"lora_paper_tables": lora_paper, "zero_tables": zero, "measured": measured,
               "config": dataclasses.asdict(cfg)}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--preset", default="default", choices=sorted(PRESETS))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    c = PRESETS[a.preset]
    main(dataclasses.replace(c, out=a.out) if a.out else c)
