"""fp32 vs bf16 vs fp16 (unscaled) vs fp16 with dynamic loss scaling, on one model and corpus.

Two settings:

* ``normal``: the plain language-model loss. All four learn; the dynamic scaler starts high
  (2^24), overflows, backs off within a few steps, then grows every ``growth_interval`` steps.
* ``underflow``: the loss is multiplied by ``2^-20`` (Adam's eps scaled with it, so fp32 is
  unaffected). The gradient of the logits is then at most 2^-20/tokens < 1e-8, below half of
  fp16's smallest subnormal (2^-25): unscaled fp16 receives all-zero gradients and does not
  learn, dynamic scaling recovers fp32's curve, and bf16 (fp32's exponent range) needs no
  scaling.

Run: ``python experiments/precision.py [--preset smoke|default] [--out DIR]``. Writes
``results.json`` and ``precision.png`` (loss curves and loss scale over time) to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path

import numpy as np

from effijax.data import load_corpus, split_corpus
from effijax.models import gpt_config
from effijax.precision import dynamic_loss_scale
from effijax.recipe import build_lm_job
from effijax.run import RunDir, read_metrics, train_loop
from effijax.step import make_optimizer


@dataclasses.dataclass(frozen=True)
class Config:
    model: str = "mini"
    seq_len: int = 128
    steps: int = 200
    batch_size: int = 16
    lr: float = 3e-3
    seed: int = 0
    corpus_bytes: int = 4_000_000
    underflow_multiplier: float = 2.0**-20
    init_scale: float = 2.0**24
    growth_interval: int = 50
    out: str = "runs/precision"
    progress: bool = True


PRESETS = {
    "default": Config(),
    "smoke": Config(model="tiny", seq_len=32, steps=12, batch_size=4, corpus_bytes=200_000,
                    growth_interval=4, out="runs/precision-smoke", progress=False),
}

VARIANTS = (  # (label, policy, loss scaling)
    ("fp32", "fp32", None),
    ("bf16", "bf16", None),
    ("fp16", "fp16", None),
    ("fp16+dynamic", "fp16", "dynamic"),
)


def run_variant(cfg: Config, label: str, policy: str, scaling, multiplier: float, out: Path,
                train_tokens, val_tokens) -> dict:
    """Trains one variant; returns its summary (also written under ``out/label``)."""
    wrapper = None
    if scaling == "dynamic":
        wrapper = functools.partial(dynamic_loss_scale, init_scale=cfg.init_scale,
                                    growth_interval=cfg.growth_interval)
    tx = make_optimizer(cfg.lr, cfg.steps, warmup_steps=max(1, cfg.steps // 20),
                        eps=1e-8 * multiplier, weight_decay=0.0, loss_scale=wrapper)
    model = gpt_config(cfg.model, seq_len=cfg.seq_len)
    job = build_lm_job(model, policy, tx, train_tokens=train_tokens, val_tokens=val_tokens,
                       batch_size=cfg.batch_size, seed=cfg.seed, loss_multiplier=multiplier,
                       allow_unscaled_fp16=True)
    init_eval_loss = job.evaluate(job.state.params)
    run_dir = RunDir(out / label, config={**dataclasses.asdict(cfg), "variant": label,
                                          "policy": policy, "loss_multiplier": multiplier})
    state, summary = train_loop(job.step, job.state, job.batch, num_steps=cfg.steps,
                                tokens_per_step=job.tokens_per_step, run_dir=run_dir,
                                progress=cfg.progress)
    records = read_metrics(run_dir.path)
    summary["final_lm_loss"] = float(np.mean([r["lm_loss"] for r in records[-10:]]))
    summary["first_lm_loss"] = records[0]["lm_loss"]
    summary["zero_grad_steps"] = sum(1 for r in records if r["grad_norm"] == 0.0)
    summary["eval_loss"] = job.evaluate(state.params)
    summary["init_eval_loss"] = init_eval_loss
    run_dir.finish(summary, title=label)
    return summary


def main(cfg: Config) -> dict:
    """Runs every variant in both settings; returns ``{setting: {variant: summary}}``."""
    out = Path(cfg.out)
    tokens = load_corpus(max_bytes=cfg.corpus_bytes)
    train_tokens, val_tokens = split_corpus(tokens)
    results = {}
    for setting, mult in (("normal", 1.0), ("underflow", cfg.underflow_multiplier)):
        results[setting] = {
            label: run_variant(cfg, label, policy, scaling, mult, out / setting,
                               train_tokens, val_tokens)
            for label, policy, scaling in VARIANTS
        }
    _plot(out, results)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(_table(results))
    return results


def _plot(out: Path, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for ax, setting in zip(axes[:2], results, strict=True):
        for label in results[setting]:
            rec = read_metrics(out / setting / label)
            ax.plot([r["step"] for r in rec], [r["lm_loss"] for r in rec], label=label, lw=1.1)
        ax.set_title(f"{setting}: training loss")
        ax.set_xlabel("step")
        ax.legend()
        ax.grid(alpha=0.3)
    for setting in results:
        rec = read_metrics(out / setting / "fp16+dynamic")
        axes[2].plot([r["step"] for r in rec], [r["loss_scale"] for r in rec],
                     label=f"{setting}")
    axes[2].set_yscale("log", base=2)
    axes[2].set_title("fp16+dynamic: loss scale")
    axes[2].set_xlabel("step")
    axes[2].legend()
    axes[2].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "precision.png", dpi=110)
    plt.close(fig)


def _table(results: dict) -> str:
    lines = ["| setting | variant | first loss | final loss | eval loss (init -> end) | "
             "zero-grad steps | skipped | final scale | tokens/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for setting, variants in results.items():
        for label, s in variants.items():
            lines.append(
                f"| {setting} | {label} | {s['first_lm_loss']:.3f} | {s['final_lm_loss']:.3f} "
                f"| {s['init_eval_loss']:.3f} -> {s['eval_loss']:.3f} | {s['zero_grad_steps']} "
                f"| {s['skipped_steps']} | "
                f"{s['final_loss_scale']:.4g} | {s['tokens_per_s']:.0f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--preset", default="default", choices=sorted(PRESETS))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    c = PRESETS[a.preset]
    main(dataclasses.replace(c, out=a.out) if a.out else c)
