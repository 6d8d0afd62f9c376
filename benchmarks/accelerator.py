"""One command for the first GPU: every measurement the project still owes, in one run.

Run it from the repository root on the machine with the accelerator::

    python benchmarks/accelerator.py --write --out-dir $OUT

It measures on whatever device JAX finds (a GPU; a CPU gives numbers too, but 16-bit math is
emulated there) and, after each section, writes everything measured so far: the section
"Accelerator: one command" of ``benchmarks/RESULTS.md`` (with ``--write``) and, with
``--out-dir DIR``, ``DIR/accelerator.md`` and ``DIR/accelerator.json``, so a run cut short
still returns what it measured. Each section has a time budget (checked between its units of
work, and an alarm that ends it soon after); one that fails is reported in one line (its
traceback on stderr) and the others still run. The whole run is sized for about 7 minutes on
one H100/H200. The model is the GPT (GPT-2/3 shapes, random init, random tokens: nothing is
downloaded), so ``benchmarks/mfu.py``'s FLOP formula applies unchanged. Sections, in run order:

* **memory**: :mod:`effijax.memory`'s estimate (model states + the bf16 compute copy + the
  activation formula with 2-byte values and the f32 logits) against the compiled step's
  ``memory_analysis()`` and the device's ``memory_stats()['peak_bytes_in_use']`` after one bf16
  step of the 0.35B model. Why: the planner and the pre-flight rest on the estimate, and until
  now it was only checked on XLA:CPU, which keeps 16-bit activations in f32. First, so that the
  process-wide peak is this step's.
* **precision**: fp32, bf16, and fp16 with dynamic loss scaling, same model and batch, the
  steps interleaved (``harness.time_interleaved``): step time, tokens/s, speed-up over fp32.
  Why: mixed precision is the library's first promise, and a CPU cannot show its speed.
* **loss scaling**: the fp16 step with ``dynamic_loss_scale`` against the same step without it
  (``allow_unscaled_fp16``) and a hand-written fp16 ``value_and_grad`` + optax step,
  interleaved. Why: the scaling transform should cost next to nothing on the device it is for.
* **MFU**: the bf16 step on a ladder of sizes (the 0.35B model, compiled already, then the
  largest the memory estimate allows and down, until the time budget ends; a size out of memory
  is skipped), each interleaved with a large bf16 matmul; MFU against the data-sheet peak
  (``mfu.PEAK_TFLOPS``) and against the measured matmul peak. Why: the one number that says how
  well the step uses the chip, for the largest model one device trains.
* **profile**: the bf16 step of the GPT and of the Llama family (Llama 3.2's shapes) at about
  1B parameters, then at the largest sizes, each traced with ``jax.profiler`` and summed by
  :func:`effijax.observe.step_breakdown`: matmuls, attention, norms and elementwise, copies,
  the head and loss, the optimizer update, collectives and idle, each with its time and the
  achieved TFLOP/s of its matmuls. Why: to raise the step toward the peak, first know where it
  goes.
* **attention**: the fused kernel (``xla_attend``: cuDNN where it applies), the pure-JAX
  blockwise kernel and the naive one, forward + backward at sequence lengths 1k-8k: time and
  XLA's temporaries (the memory the op needs beyond its inputs and outputs). Why: ``auto``'s
  choice on a GPU and the blockwise kernel's memory claim were only measured on a CPU.
* **determinism**: ``XLA_FLAGS=--xla_gpu_deterministic_ops=true`` and its cost: this process
  runs a small bf16 model without the flag, a child process (XLA reads flags at start-up) with
  it; step time, and whether two runs from the same start end with bitwise-equal parameters.
  Why: bitwise resume is tested on a CPU; on a GPU it needs the flag, at a price.

``--dry-run`` runs every section on tiny sizes (a CPU smoke test: about a minute of CPU time on
2 cores, longer on a shared machine); it writes RESULTS.md only with ``--write``.
``--sections memory,MFU`` runs a subset, ``--time-limit S`` caps the run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import glob
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from harness import (
    add_write_flag,
    command_line,
    device_description,
    markdown_table,
    publish,
    time_interleaved,
)
from mfu import (
    _flops,
    _matmul_variant,
    model_flops_per_token,
    peak_flops,
    random_batch,
    train_optimizer,
)

from effijax.memory import activation_bytes, estimate_tree, format_bytes, measure, tree_bytes
from effijax.models import (
    GPTConfig,
    LlamaConfig,
    attend,
    blockwise_attend,
    choose_attention,
    keeps_scores,
    param_count,
    xla_attend,
)
from effijax.observe import step_breakdown
from effijax.precision import get_policy
from effijax.step import init_train_state, make_train_step, optax_promotion

TITLE = "Accelerator: one command"
REPO = Path(__file__).resolve().parents[1]
DETERMINISM_FLAG = "--xla_gpu_deterministic_ops=true"
_CHILD_TAG = "accelerator-child-result:"


def _gpt(d_model: int, n_layers: int, n_heads: int, seq_len: int, vocab_size: int,
         attention: str = "auto") -> GPTConfig:
    return GPTConfig(vocab_size=vocab_size, seq_len=seq_len, d_model=d_model,
                     n_layers=n_layers, n_heads=n_heads, attention=attention)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every size a run uses (:data:`GPU` by default, :data:`DRY_RUN` with ``--dry-run``).

    Attributes:
      model: the model of the memory, precision and loss-scaling sections (the ladder's
        smallest rung).
      batch_size: sequences per step for ``model`` and the ladder.
      ladder: the MFU sizes, smallest first.
      matmul_n: the ``n x n x n`` bf16 matmul whose best time is the measured peak.
      attention_bhk: batch, heads and head width of the attention op.
      attention_seqs: its sequence lengths.
      determinism_model, determinism_batch, determinism_steps: the child processes' model, batch
        and the number of steps of each of its two runs.
      profile_models: the models whose bf16 step is profiled, in order (GPT and Llama family,
        about 1B first, then the largest sizes).
      rounds, steps_per_round: ``time_interleaved``'s rounds and timed steps per turn.
      budgets_s: seconds per section.
    """

    model: GPTConfig
    batch_size: int
    ladder: tuple[GPTConfig, ...]
    matmul_n: int
    attention_bhk: tuple[int, int, int]
    attention_seqs: tuple[int, ...]
    determinism_model: GPTConfig
    determinism_batch: int
    determinism_steps: int
    profile_models: tuple
    rounds: int
    steps_per_round: int
    budgets_s: dict[str, float]


_VOCAB = 50304  # GPT-2's 50257 rounded up to a multiple of 128
# Llama 3.2's 1B and 3B shapes (grouped-query attention, tied embeddings), at the GPT's 1,024
# tokens a row.
_LLAMA_1B = LlamaConfig(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                        head_dim=64, d_ff=8192, rope_theta=500000.0, tie_embeddings=True,
                        seq_len=1024, max_position=1024)
_LLAMA_3B = dataclasses.replace(_LLAMA_1B, d_model=3072, n_layers=28, n_heads=24,
                                head_dim=128)
GPU = Sizes(
    model=_gpt(1024, 24, 16, 1024, _VOCAB),  # 0.35B, GPT-2 medium
    batch_size=8,
    ladder=(_gpt(1024, 24, 16, 1024, _VOCAB),  # 0.35B
            _gpt(2048, 24, 16, 1024, _VOCAB),  # 1.3B, GPT-3 XL
            _gpt(2560, 32, 20, 1024, _VOCAB),  # 2.6B, GPT-3 2.7B
            _gpt(3072, 32, 24, 1024, _VOCAB),  # 3.8B
            _gpt(4096, 32, 32, 1024, _VOCAB)),  # 6.6B, GPT-3 6.7B
    matmul_n=8192,
    attention_bhk=(1, 16, 128),
    attention_seqs=(1024, 2048, 4096, 8192),
    determinism_model=_gpt(512, 8, 8, 1024, _VOCAB),
    determinism_batch=4,
    determinism_steps=3,
    profile_models=(_gpt(2048, 24, 16, 1024, _VOCAB), _LLAMA_1B,  # 1.3B, 1.2B
                    _gpt(3072, 32, 24, 1024, _VOCAB), _LLAMA_3B),  # 3.8B, 3.2B
    rounds=3,
    steps_per_round=5,
    # 420 s in all; a section may overrun its budget by the 20 s grace before its alarm.
    # (The precision and loss-scaling sections each compile two 0.35B steps.)
    budgets_s={"memory": 40, "precision": 70, "loss scaling": 60, "MFU": 75,
               "profile": 90, "attention": 40, "determinism": 45},
)
DRY_RUN = Sizes(
    # Still 2 scanned layers, 4 heads and blockwise attention, at the smallest widths: each of
    # the run's programs compiles a little quicker than at d 64, seq 64, vocab 256 (the dry-run
    # test: about 7% less CPU).
    model=_gpt(32, 2, 4, 16, 64),
    batch_size=2,
    ladder=(_gpt(32, 2, 4, 16, 64),),  # the model: a second size would cost a compilation
    matmul_n=128,
    attention_bhk=(1, 2, 16),
    attention_seqs=(128,),
    determinism_model=_gpt(32, 2, 4, 16, 64),  # the model: its step is compiled already
    determinism_batch=2,
    determinism_steps=2,
    # The model (compiled already) and the Llama family's smallest shape.
    profile_models=(_gpt(32, 2, 4, 16, 64),
                    LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                d_ff=64, seq_len=16, max_position=16)),
    rounds=1,
    steps_per_round=2,
    # Generous: on a shared 2-core CPU compilation dominates, and a smoke test should not fail
    # on time. Idle, the whole dry run takes about 40 s.
    budgets_s={"memory": 60, "precision": 60, "loss scaling": 60, "MFU": 60, "profile": 60,
               "attention": 60, "determinism": 90},
)


# ----------------------------------------------------------------------------------------------
# Train steps.


def _optimizer(loss_scaling: bool = False) -> optax.GradientTransformation:
    """``effijax train``'s optimizer (``mfu.train_optimizer``), wrapped in
    ``dynamic_loss_scale`` with ``loss_scaling``."""
    return train_optimizer("dynamic" if loss_scaling else None)


@functools.cache
def _init_state_fn(config: GPTConfig, policy: str, loss_scaling: bool) -> Callable:
    optimizer = _optimizer(loss_scaling)
    return jax.jit(lambda key: init_train_state(config.init_params(key, policy), optimizer,
                                                jax.random.key(1)))


def _init_state(config: GPTConfig, policy: str, loss_scaling: bool):
    """A train state from key 0, initialised by one compiled program, cached by configuration
    (op by op, a big model's init dispatches hundreds of small programs, each compiled once)."""
    return _init_state_fn(config, policy, loss_scaling)(jax.random.key(0))


# The steps are cached by configuration: sections that time the same step share one compilation.
@functools.cache
def _effijax_step(config: GPTConfig, policy: str, loss_scaling: bool, allow_unscaled_fp16: bool):
    return jax.jit(make_train_step(config.loss_fn(), _optimizer(loss_scaling), policy,
                                   has_aux=True, allow_unscaled_fp16=allow_unscaled_fp16),
                   donate_argnums=0)


@functools.cache
def _hand_written_fp16_step(config: GPTConfig):
    policy, optimizer, loss_fn = get_policy("fp16"), _optimizer(), config.loss_fn()

    def loss(params, batch, rng):
        return loss_fn(policy.cast_to_compute(params), batch, rng)[0].astype(jnp.float32)

    def step(state, batch):
        value, grads = jax.value_and_grad(loss)(state.params, batch, state.rng)
        with optax_promotion():
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return state._replace(step=state.step + 1, params=params, opt_state=opt_state), value

    return jax.jit(step, donate_argnums=0)


class Runner:
    """One jitted, donating train step with its state and batch; calling it runs one step and
    blocks (what ``time_interleaved`` times)."""

    def __init__(self, step: Callable, state: Any, batch: dict):
        self.step, self.state, self.batch = step, state, batch

    def __call__(self) -> None:
        self.state, metrics = self.step(self.state, self.batch)
        jax.block_until_ready(metrics)


def train_variant(config: GPTConfig, policy: str, batch_size: int, *,
                  loss_scaling: bool = False, allow_unscaled_fp16: bool = False
                  ) -> Callable[[], Runner]:
    """A ``time_interleaved`` variant: ``make()`` returns a :class:`Runner` of effijax's step
    (``make_train_step``) for ``config`` under ``policy``, ``make_optimizer``'s AdamW, with
    ``dynamic_loss_scale`` when ``loss_scaling``, on random tokens.

    Example:
      >>> runner = train_variant(DRY_RUN.model, "bf16", 2)()
      >>> runner(); runner(); int(runner.state.step)
      2
    """
    def make() -> Runner:
        return Runner(_effijax_step(config, policy, loss_scaling, allow_unscaled_fp16),
                      _init_state(config, policy, loss_scaling), random_batch(config, batch_size))
    return make


def hand_written_fp16_variant(config: GPTConfig, batch_size: int) -> Callable[[], Runner]:
    """A plain fp16 step written out: cast to fp16, ``value_and_grad``, the optimizer's update
    (the same AdamW); no loss scaling, no metrics: the floor the fp16 steps are compared with.

    Example:
      >>> runner = hand_written_fp16_variant(DRY_RUN.model, 2)()
      >>> runner(); int(runner.state.step), runner.state.params["embed"]["embedding"].dtype
      (1, dtype('float32'))
    """
    def make() -> Runner:
        return Runner(_hand_written_fp16_step(config), _init_state(config, "fp16", False),
                      random_batch(config, batch_size))
    return make


def _attention_used(config: GPTConfig, dtype) -> str:
    """What the model's attention setting runs for ``dtype`` on this device."""
    if config.attention != "auto":
        return config.attention
    choice = choose_attention(_queries(config, dtype), dropout=False)
    return "cuDNN fused" if choice.fused else choice.name


def _queries(config: GPTConfig, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((1, config.seq_len, config.n_heads, config.head_dim), dtype)


def _params(config: GPTConfig) -> str:
    n = param_count(config)
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def _describe(config) -> str:
    family = {"gpt": "GPT", "llama": "Llama"}.get(config.family, config.family)
    kv = (f", G {config.n_kv_heads}" if getattr(config, "n_kv_heads", None) not in
          (None, config.n_heads) else "")
    return (f"{family} {_params(config)} (d {config.d_model}, L {config.n_layers}, H "
            f"{config.n_heads}{kv}, seq {config.seq_len}, vocab {config.vocab_size})")


# ----------------------------------------------------------------------------------------------
# Sections. Each takes a Context and returns a JSON-able dict; render_* turns it into markdown.


@dataclasses.dataclass
class Context:
    """What the sections share: the sizes and the time left."""

    sizes: Sizes
    dry_run: bool
    deadline: float  # time.monotonic() by which the running section should finish

    def time_left(self) -> float:
        return self.deadline - time.monotonic()


def _memory_stats() -> dict | None:
    stats = jax.devices()[0].memory_stats()
    return dict(stats) if stats else None


def bytes_limit() -> int | None:
    """The device's memory limit (None where the backend reports none: a CPU).

    Example:
      >>> bytes_limit() is None or bytes_limit() > 0
      True
    """
    stats = _memory_stats()
    return None if stats is None else stats.get("bytes_limit")


def _estimate(config: GPTConfig, batch_size: int):
    """:mod:`effijax.memory`'s numbers for the bf16 step: ``(model states, activations)``. The
    states count the f32 master, gradients, AdamW and the bf16 compute copy; the activation
    formula takes 2-byte values, no dropout, the f32 logits, and no stored scores unless the
    attention is the naive one."""
    policy = get_policy("bf16")
    states = estimate_tree(config.abstract_params(policy), _optimizer(),
                           param_dtype=policy.param_dtype, compute_dtype=policy.compute_dtype)
    acts = activation_bytes(**config.shape().activation_args(), seq_len=config.seq_len,
                            batch_size=batch_size, bytes_per_value=2, dropout=False,
                            blockwise_attention=not keeps_scores(
                                config.attention, _queries(config, jnp.bfloat16), dropout=False))
    return states, acts


def _memory_section(ctx: Context) -> dict:
    """Estimate vs compiled vs device peak for one bf16 step of ``sizes.model``."""
    config, batch_size = ctx.sizes.model, ctx.sizes.batch_size
    before = _memory_stats()
    runner = train_variant(config, "bf16", batch_size)()
    # Compiled before it runs: the scratch buffers of XLA's autotuning are then allocated next to
    # the state only, not next to the step's activations, and stay under the step's peak.
    compiled = measure(runner.step, runner.state, runner.batch)
    runner()
    after = _memory_stats()
    states, acts = _estimate(config, batch_size)
    attention = _attention_used(config, jnp.bfloat16)
    other = tree_bytes((runner.batch, runner.state.step, runner.state.rng))
    estimate = states.model_state_bytes + states.compute_copy_bytes + acts + other
    device_peak, why = None, "the backend reports no memory_stats() (a CPU)"
    if before is not None and after is not None:
        # More than 64 MiB freed before this section: another allocation's peak may be the one
        # the process-wide reading keeps.
        if before.get("peak_bytes_in_use", 0) > before.get("bytes_in_use", 0) + 2**26:
            why = ("an earlier allocation's peak is in the process-wide reading; run this "
                   "section first (--sections memory)")
        else:
            device_peak, why = after["peak_bytes_in_use"] - before.get("bytes_in_use", 0), None
    return {
        "model": _describe(config), "batch_size": batch_size, "attention": attention,
        "params_and_optimizer": states.params_bytes + states.optimizer_bytes,
        "grads": states.grads_bytes, "compute_copy": states.compute_copy_bytes,
        "activations_formula": acts, "batch_and_counters": other, "estimate": estimate,
        "compiled_total": compiled.total_bytes, "compiled_temp": compiled.temp_bytes,
        "device_peak": device_peak, "device_peak_missing": why,
        "bytes_limit": None if after is None else after.get("bytes_limit"),
    }


def _render_memory(r: dict) -> str:
    def ratio(x):
        return "n/a" if not x else f"{r['estimate'] / x:.2f}"
    rows = [[k, format_bytes(r[k])] for k in ("params_and_optimizer", "grads", "compute_copy",
                                              "activations_formula", "batch_and_counters")]
    peak = ("n/a: " + r["device_peak_missing"]) if r["device_peak"] is None else \
        format_bytes(r["device_peak"])
    return "\n".join([
        f"{r['model']}, batch {r['batch_size']}, bf16 policy (f32 master, bf16 compute), "
        f"attention {r['attention']}, `make_optimizer`'s AdamW; one step.", "",
        markdown_table(["estimate term", "bytes"], rows), "",
        markdown_table(["", "bytes", "estimate / this"], [
            ["estimate (sum above)", format_bytes(r["estimate"]), "1.00"],
            ["compiled step (`memory_analysis`: args + outputs - aliased + temps)",
             format_bytes(r["compiled_total"]), ratio(r["compiled_total"])],
            ["device `peak_bytes_in_use` (init + step)", peak, ratio(r["device_peak"])],
        ]),
        "",
        "- The activation formula (Korthikanti et al., p = 2, no dropout, f32 logits) is a lower "
        "bound: XLA's backward keeps working buffers it does not count.",
    ])


def _precision_section(ctx: Context) -> dict:
    """fp32, bf16 and fp16 + dynamic loss scaling, interleaved."""
    s = ctx.sizes
    variants = {
        "fp32": train_variant(s.model, "fp32", s.batch_size),
        "bf16": train_variant(s.model, "bf16", s.batch_size),
        "fp16 + dynamic loss scaling": train_variant(s.model, "fp16", s.batch_size,
                                                     loss_scaling=True),
    }
    res = time_interleaved(variants, rounds=s.rounds, steps_per_round=s.steps_per_round,
                           warmup=2)
    tokens = s.batch_size * s.model.seq_len
    base = res["fp32"]["median_s"]
    dtypes = {"fp32": jnp.float32, "bf16": jnp.bfloat16,
              "fp16 + dynamic loss scaling": jnp.float16}
    return {"model": _describe(s.model), "tokens_per_step": tokens, "rows": [
        {"precision": name, "attention": _attention_used(s.model, dtypes[name]),
         "step_s": r["median_s"], "p10_s": r["p10_s"], "p90_s": r["p90_s"],
         "tokens_per_s": tokens / r["median_s"], "speedup_vs_fp32": base / r["median_s"],
         "steps": r["n"]} for name, r in res.items()]}


def _render_precision(r: dict) -> str:
    return "\n".join([
        f"{r['model']}, {r['tokens_per_step']} tokens per step, `make_optimizer`'s AdamW; "
        "interleaved, median step time.", "",
        markdown_table(["precision", "attention", "step ms (median)", "p10", "p90", "tokens/s",
                        "speed-up vs fp32", "steps"],
                       [[x["precision"], x["attention"], f"{1e3 * x['step_s']:.1f}",
                         f"{1e3 * x['p10_s']:.1f}", f"{1e3 * x['p90_s']:.1f}",
                         f"{x['tokens_per_s']:,.0f}", f"{x['speedup_vs_fp32']:.2f}x",
                         x["steps"]] for x in r["rows"]]),
    ])


def _loss_scaling_section(ctx: Context) -> dict:
    """fp16 with ``dynamic_loss_scale`` vs without it vs a hand-written fp16 step."""
    s = ctx.sizes
    variants = {
        "effijax fp16 + dynamic_loss_scale": train_variant(s.model, "fp16", s.batch_size,
                                                           loss_scaling=True),
        "effijax fp16, no scaling": train_variant(s.model, "fp16", s.batch_size,
                                                  allow_unscaled_fp16=True),
        "hand-written fp16 (value_and_grad + optax)": hand_written_fp16_variant(
            s.model, s.batch_size),
    }
    res = time_interleaved(variants, rounds=s.rounds, steps_per_round=s.steps_per_round,
                           warmup=2)
    hand = res["hand-written fp16 (value_and_grad + optax)"]["median_s"]
    return {"model": _describe(s.model), "rows": [
        {"variant": name, "step_s": r["median_s"], "p10_s": r["p10_s"], "p90_s": r["p90_s"],
         "vs_hand_written": r["median_s"] / hand, "steps": r["n"]} for name, r in res.items()]}


def _render_loss_scaling(r: dict) -> str:
    rows = {x["variant"]: x for x in r["rows"]}
    scaled = rows["effijax fp16 + dynamic_loss_scale"]["step_s"]
    plain = rows["effijax fp16, no scaling"]["step_s"]
    return "\n".join([
        f"{r['model']}, same AdamW, interleaved, median step time.", "",
        markdown_table(["variant", "step ms (median)", "p10", "p90", "vs hand-written",
                        "steps"],
                       [[x["variant"], f"{1e3 * x['step_s']:.1f}", f"{1e3 * x['p10_s']:.1f}",
                         f"{1e3 * x['p90_s']:.1f}", f"{x['vs_hand_written']:.3f}x",
                         x["steps"]] for x in r["rows"]]), "",
        f"- The scaling transform's own cost (scaled / unscaled effijax step): "
        f"**{scaled / plain:.3f}x**; effijax's metrics (gradient norm, finiteness) are in both.",
    ])


def mfu_row(config: GPTConfig, tokens: int, step_s: float, device_kind: str,
            matmul_flops_per_s: float) -> dict:
    """Achieved FLOP/s of a bf16 train step and MFU against the data sheet and the matmul.

    Example (one step of 1,000 tokens in 1 s of a model with 6,192 FLOPs per token):
      >>> config = GPTConfig(vocab_size=10, seq_len=4, d_model=8, n_layers=1, n_heads=2)
      >>> r = mfu_row(config, 1000, 1.0, "NVIDIA H100 80GB HBM3", 12.384e6)
      >>> r["flops_per_s"], round(r["mfu_vs_spec"] * 989.4e12), r["mfu_vs_matmul"]
      (6192000.0, 6192000, 0.5)
    """
    flops_per_s = model_flops_per_token(config) * tokens / step_s
    spec = peak_flops(device_kind, "bf16")
    return {"model": _describe(config), "params": param_count(config), "tokens": tokens,
            "step_s": step_s, "tokens_per_s": tokens / step_s, "flops_per_s": flops_per_s,
            "spec_peak": spec, "mfu_vs_spec": None if spec is None else flops_per_s / spec,
            "matmul_peak": matmul_flops_per_s, "mfu_vs_matmul": flops_per_s / matmul_flops_per_s}


def _fits(config: GPTConfig, batch_size: int, limit: int | None) -> tuple[bool, int]:
    """Whether the bf16 step's memory estimate (without the batch's few bytes) stays within 90%
    of the device's limit (None: unknown, try it), and the estimate."""
    states, acts = _estimate(config, batch_size)
    need = states.model_state_bytes + states.compute_copy_bytes + acts
    return limit is None or need <= 0.9 * limit, need


def fitting(config, batch_size: int, limit: int | None, notes: list[str],
            label: str | None = None) -> int | None:
    """The bf16 step's memory estimate when it fits (:func:`_fits`), else None, with a note
    naming ``label`` (default: the model) appended to ``notes``.

    Example:
      >>> notes = []
      >>> fitting(DRY_RUN.model, 2, None, notes) > 0, notes  # no limit known: it fits
      (True, [])
      >>> fitting(DRY_RUN.model, 2, 1000, notes, "tiny"), notes[0].split(",")[0]
      (None, 'tiny: skipped')
    """
    fits, need = _fits(config, batch_size, limit)
    if not fits:
        notes.append(f"{label or _describe(config)}: skipped, the estimate "
                     f"{format_bytes(need)} is over 90% of the device's {format_bytes(limit)}")
        return None
    return need


def _out_of_memory(error: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(error) or "out of memory" in str(error).lower()


def ladder(ctx: Context, candidates, measure: Callable, describe: Callable[[Any], str]
           ) -> tuple[list, list]:
    """Runs ``measure(candidate)`` for each candidate in order (a row, or None for one it
    skips), while the section's time left holds 1.5 times the last one's; one that runs out of
    memory is noted and the next runs; the section's timeout keeps the rows measured. Returns
    ``(rows, notes)``, each row with its ``seconds``.

    Example:
      >>> ctx = Context(DRY_RUN, True, time.monotonic() + 60)
      >>> def measure(n):
      ...     if n == 2:
      ...         raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
      ...     return None if n == 3 else {"n": n}
      >>> rows, notes = ladder(ctx, [1, 2, 3, 4], measure, lambda n: f"size {n}")
      >>> [r["n"] for r in rows], notes
      ([1, 4], ['size 2: out of memory'])
    """
    rows, notes, last_s = [], [], 0.0
    for candidate in candidates:
        if rows and ctx.time_left() < 1.5 * last_s:
            notes.append(f"{describe(candidate)}: not run, {ctx.time_left():.0f} s left of the "
                         f"budget (the last took {last_s:.0f} s)")
            continue
        t0 = time.monotonic()
        try:
            row = measure(candidate)
        except SectionTimeout:
            notes.append(f"{describe(candidate)}: stopped, past the section's time budget")
            break
        except Exception as e:  # noqa: BLE001 - out of memory: the next candidate
            if not _out_of_memory(e):
                raise
            notes.append(f"{describe(candidate)}: out of memory")
            continue
        finally:
            gc.collect()
        last_s = time.monotonic() - t0
        if row is not None:
            rows.append({**row, "seconds": last_s})
    return rows, notes


def _mfu_section(ctx: Context) -> dict:
    """The bf16 step of the ladder's sizes, largest that fits first, each with the matmul."""
    s = ctx.sizes
    kind = jax.devices()[0].device_kind
    limit = bytes_limit()
    matmul = _matmul_variant(s.matmul_n, jnp.bfloat16)
    mm_flops = 2 * s.matmul_n**3
    # The smallest size is the precision section's model: its step is compiled already, so it is
    # measured first; then the largest that the estimate allows, down.
    order = [s.ladder[0], *sorted((c for c in s.ladder[1:]), key=lambda c: -param_count(c))]
    skipped = []

    def measure(config):
        need = fitting(config, s.batch_size, limit, skipped)
        if need is None:
            return None
        res = time_interleaved(
            {"matmul": matmul, "step": train_variant(config, "bf16", s.batch_size)},
            rounds=s.rounds, steps_per_round=s.steps_per_round, warmup=2)
        row = mfu_row(config, s.batch_size * config.seq_len, res["step"]["median_s"], kind,
                      mm_flops / res["matmul"]["min_s"])
        print(f"  MFU {row['model']}: {row['tokens_per_s']:,.0f} tokens/s, "
              f"{_flops(row['flops_per_s'])}", flush=True)
        return {**row, "estimate": need}

    rows, notes = ladder(ctx, order, measure, _describe)
    notes = skipped + notes
    if not rows:
        raise RuntimeError("no size of the ladder ran: " + "; ".join(notes))
    best_matmul = max(r["matmul_peak"] for r in rows)
    for r in rows:  # one matmul peak for every size: the best time of the whole section
        r["matmul_peak"] = best_matmul
        r["mfu_vs_matmul"] = r["flops_per_s"] / best_matmul
    rows.sort(key=lambda r: r["params"])
    return {"device_kind": kind, "matmul_n": s.matmul_n, "matmul_peak": best_matmul,
            "spec_peak": peak_flops(kind, "bf16"), "batch_size": s.batch_size, "rows": rows,
            "notes": notes, "largest": rows[-1]["model"]}


def _render_mfu(r: dict) -> str:
    def mfu(x):
        return "n/a" if x is None else f"{x:.3f}"
    return "\n".join([
        f"bf16 policy, batch {r['batch_size']}, `make_optimizer`'s AdamW, attention `auto`; "
        f"each size interleaved with a {r['matmul_n']}^3 bf16 matmul. Data-sheet bf16 peak "
        f"(`mfu.PEAK_TFLOPS`, dense): {_flops(r['spec_peak'])}; measured matmul peak (best time): "
        f"{_flops(r['matmul_peak'])}.", "",
        markdown_table(["model", "step ms", "tokens/s", "achieved", "MFU (data sheet)",
                        "MFU (measured matmul)", "memory estimate"],
                       [[x["model"], f"{1e3 * x['step_s']:.1f}", f"{x['tokens_per_s']:,.0f}",
                         _flops(x["flops_per_s"]), mfu(x["mfu_vs_spec"]),
                         mfu(x["mfu_vs_matmul"]), format_bytes(x["estimate"])]
                        for x in r["rows"]]), "",
        "- FLOPs per token: `mfu.model_flops_per_token` (6·N + 12·L·H·K·S, PaLM appendix B).",
        f"- Largest size measured: **{r['largest']}**.",
        *[f"- {n}." for n in r["notes"]],
    ])


def _attention_runner(fn: Callable, shape: tuple, dtype) -> tuple[Callable[[], None], int]:
    """``(run, temp_bytes)``: one forward + backward of ``fn`` (``jax.vjp``, all three input
    gradients), compiled once; XLA's temporaries from its ``memory_analysis``."""
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, cotangent = (jax.random.normal(key, shape, dtype) for key in keys)

    def forward_backward(q, k, v, cotangent):
        out, pullback = jax.vjp(fn, q, k, v)
        return out, pullback(cotangent)

    compiled = jax.jit(forward_backward).lower(q, k, v, cotangent).compile()
    temp = measure(compiled).temp_bytes
    jax.block_until_ready(compiled(q, k, v, cotangent))

    def run():
        jax.block_until_ready(compiled(q, k, v, cotangent))
    return run, temp


ATTENTION_IMPLS = {
    "fused (xla_attend)": xla_attend,
    "blockwise (pure JAX)": functools.partial(blockwise_attend, implementation="jax"),
    "naive": attend,
}


def _attention_section(ctx: Context) -> dict:
    """Fused vs blockwise vs naive attention, forward + backward, bf16, per sequence length."""
    s = ctx.sizes
    b, h, k = s.attention_bhk
    dtype = jnp.bfloat16
    rows, notes = [], []
    for seq in s.attention_seqs:
        if rows and ctx.time_left() <= 0:
            notes.append(f"seq {seq}: not run, out of the section's time")
            continue
        shape = (b, seq, h, k)
        runners, temps = {}, {}
        try:
            for name, fn in ATTENTION_IMPLS.items():
                try:
                    runners[name], temps[name] = _attention_runner(fn, shape, dtype)
                except Exception as e:  # noqa: BLE001 - out of memory is a result
                    if not _out_of_memory(e):
                        raise
                    rows.append({"seq": seq, "impl": name, "error": "out of memory"})
            res = time_interleaved({n: (lambda r=r: r) for n, r in runners.items()},
                                   rounds=s.rounds, steps_per_round=s.steps_per_round, warmup=1)
        except SectionTimeout:  # keep the lengths measured so far
            notes.append(f"seq {seq}: stopped, past the section's time budget")
            break
        for name, r in res.items():
            # Forward 2 matmuls, backward 4 (dq, dk, dv, dp), each 2·B·H·S²·K, halved by the mask.
            flops = 6 * 2 * b * h * seq * seq * k / 2
            rows.append({"seq": seq, "impl": name, "fwd_bwd_s": r["median_s"],
                         "best_s": r["min_s"], "temp_bytes": temps[name],
                         "flops_per_s": flops / r["median_s"]})
        del runners
        gc.collect()
    choice = choose_attention(jax.ShapeDtypeStruct((b, s.attention_seqs[0], h, k), dtype),
                              dropout=False)
    fused = ("cuDNN's fused kernel" if choice.fused else
             f"XLA's composed attention ({choice.reason or 'no GPU'})")
    return {"bhk": [b, h, k], "dtype": "bf16", "fused_runs": fused, "rows": rows,
            "notes": notes}


def _render_attention(r: dict) -> str:
    b, h, k = r["bhk"]
    table = markdown_table(
        ["seq", "implementation", "fwd+bwd ms (median)", "best ms", "causal TFLOP/s",
         "XLA temporaries"],
        [[x["seq"], x["impl"], x.get("error", f"{1e3 * x.get('fwd_bwd_s', 0):.2f}"),
          "" if "error" in x else f"{1e3 * x['best_s']:.2f}",
          "" if "error" in x else f"{x['flops_per_s'] / 1e12:.2f}",
          "" if "error" in x else format_bytes(x["temp_bytes"])] for x in r["rows"]])
    return "\n".join([
        f"Causal self-attention op alone, {r['dtype']}, batch {b}, {h} heads of {k}; forward + "
        "backward (`jax.vjp`, gradients of q, k, v), interleaved per length. The fused column "
        f"ran {r['fused_runs']}. Temporaries: XLA's `memory_analysis` of the compiled op "
        "(beyond its inputs and outputs).", "", table, *[f"- {n}." for n in r["notes"]],
    ])


def _determinism_run(sizes: Sizes) -> dict:
    """The bf16 step's time, and whether two runs from the same start end bitwise equal (the
    process' XLA_FLAGS decide which kernels run)."""
    make = train_variant(sizes.determinism_model, "bf16", sizes.determinism_batch)
    runs = [make(), make()]
    for runner in runs:
        for _ in range(sizes.determinism_steps):
            runner()
    equal = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), runs[0].state.params,
                         runs[1].state.params)
    timing = time_interleaved({"step": lambda: runs[0]}, rounds=sizes.rounds,
                              steps_per_round=sizes.steps_per_round, warmup=1)["step"]
    return {"step_s": timing["median_s"], "bitwise_equal": all(jax.tree.leaves(equal)),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


def _determinism_section(ctx: Context) -> dict:
    """The determinism run here (this process' XLA_FLAGS) and in a child with the flag added."""
    s = ctx.sizes
    child = child_process(__file__, "determinism", dry_run=ctx.dry_run,
                          xla_flags=DETERMINISM_FLAG, timeout=ctx.time_left())
    t0 = time.monotonic()
    here = {**_determinism_run(s), "process_s": time.monotonic() - t0}
    rows = [{"flag": "(none)", "where": "this process", **here},
            {"flag": DETERMINISM_FLAG, "where": "a child process", **child}]
    return {"model": _describe(s.determinism_model), "batch_size": s.determinism_batch,
            "steps": s.determinism_steps, "rows": rows,
            "cost": child["step_s"] / here["step_s"]}


def _render_determinism(r: dict) -> str:
    return "\n".join([
        f"{r['model']}, batch {r['batch_size']}, bf16. Each process runs {r['steps']} steps twice "
        "from the same initial state, compares the parameters bitwise, then times the step; XLA "
        "reads its flags at start-up, so the flagged run is a child process.",
        "",
        markdown_table(["XLA_FLAGS added", "where", "step ms (median)", "two runs bitwise equal",
                        "seconds (with start-up for the child)"],
                       [[x["flag"], x["where"], f"{1e3 * x['step_s']:.1f}",
                         "yes" if x["bitwise_equal"] else "**no**", f"{x['process_s']:.0f}"]
                        for x in r["rows"]]), "",
        f"- Cost of `{DETERMINISM_FLAG}`: **{r['cost']:.3f}x** the step time.",
    ])


def profile_step(config, batch_size: int, *, steps: int = 3, spec_peak: float | None = None
                 ) -> dict:
    """The bf16 train step of ``config`` (``_effijax_step``: AdamW, attention ``auto``) on random
    tokens: its median time over ``steps`` untraced steps, then ``steps`` more under
    ``jax.profiler``, summed by :func:`effijax.observe.step_breakdown` (each category's time,
    its matmuls' FLOPs counted from the compiled HLO and their rate), with the step's model
    FLOPs (6N + 12·L·H·K·S) and MFU against ``spec_peak``.

    Example:
      >>> r = profile_step(DRY_RUN.model, 2, steps=2)
      >>> r["categories"][0]["category"], r["counted_flops"] == sum(
      ...     c["flops"] for c in r["categories"])
      ('matmuls', True)
    """
    runner = train_variant(config, "bf16", batch_size)()
    runner.step = compiled = runner.step.lower(runner.state, runner.batch).compile()
    runner()  # warm
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        runner()
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(steps):
                runner()
        (trace,) = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)
        got = step_breakdown(trace, compiled.as_text(), steps, step_s=step_s)
    tokens = batch_size * config.seq_len
    model_flops = model_flops_per_token(config) * tokens
    counted = sum(r.flops for r in got.rows)
    return {"model": _describe(config), "params": param_count(config), "tokens": tokens,
            "step_s": step_s, "busy_s": got.busy_s, "model_flops": model_flops,
            "counted_flops": counted, "spec_peak": spec_peak,
            "mfu": None if not spec_peak else model_flops / step_s / spec_peak,
            "categories": [{**r._asdict(), "flops_per_s": r.flops_per_s} for r in got.rows],
            "table": got.markdown(spec_peak)}


def _profile_section(ctx: Context) -> dict:
    """Each profile model's bf16 step, traced and summed by kind of work, until the budget
    ends (a size the estimate does not fit, or out of memory, is skipped)."""
    s = ctx.sizes
    kind = jax.devices()[0].device_kind
    spec = peak_flops(kind, "bf16")
    limit = bytes_limit()
    skipped = []

    def measure(config):
        if fitting(config, s.batch_size, limit, skipped) is None:
            return None
        row = profile_step(config, s.batch_size, steps=s.steps_per_round, spec_peak=spec)
        print(f"  profile {row['model']}: {1e3 * row['step_s']:.1f} ms a step", flush=True)
        return row

    rows, notes = ladder(ctx, s.profile_models, measure, _describe)
    notes = skipped + notes
    if not rows:
        raise RuntimeError("no model was profiled: " + "; ".join(notes))
    return {"device_kind": kind, "spec_peak": spec, "batch_size": s.batch_size,
            "models": rows, "notes": notes}


def _render_profile(r: dict) -> str:
    lines = [f"bf16 policy, batch {r['batch_size']}, AdamW, attention `auto`, random tokens; "
             "each step traced with `jax.profiler` and summed by "
             "`effijax.observe.step_breakdown` (op times by category, per step; FLOPs of the "
             "matmuls counted from the compiled HLO, 2·M·N·K each, recomputation included; "
             "rows overlap where streams run concurrently, `idle` is the step's time with no op "
             "running). Data-sheet bf16 peak: "
             + (_flops(r["spec_peak"]) if r["spec_peak"] else "unknown for this device") + "."]
    for m in r["models"]:
        mfu = "n/a" if m["mfu"] is None else f"{m['mfu']:.3f}"
        lines += ["", f"**{m['model']}**: {1e3 * m['step_s']:.1f} ms a step of "
                  f"{m['tokens']:,} tokens, MFU {mfu} (model FLOPs 6·N + 12·L·H·K·S: "
                  f"{_flops(m['model_flops'] / m['step_s'])}; counted in the HLO: "
                  f"{_flops(m['counted_flops'] / m['step_s'])}).", "", m["table"]]
    lines += [f"- {n}." for n in r["notes"]]
    return "\n".join(lines)


class Section(NamedTuple):
    """A measurement: ``measure(ctx) -> dict`` (JSON-able), ``render(dict) -> markdown``."""

    name: str
    measure: Callable[[Context], dict]
    render: Callable[[dict], str]


SECTIONS = (
    Section("memory", _memory_section, _render_memory),
    Section("precision", _precision_section, _render_precision),
    Section("loss scaling", _loss_scaling_section, _render_loss_scaling),
    Section("MFU", _mfu_section, _render_mfu),
    Section("profile", _profile_section, _render_profile),
    Section("attention", _attention_section, _render_attention),
    Section("determinism", _determinism_section, _render_determinism),
)


# ----------------------------------------------------------------------------------------------
# Running the sections.


class SectionTimeout(Exception):
    """A section ran past its budget by more than the grace period."""


@contextlib.contextmanager
def _alarm(seconds: float):
    """Raises :class:`SectionTimeout` in the block after ``seconds`` (main thread, where there is
    SIGALRM). Compiled JAX code is not interrupted: the exception lands when it returns."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not \
            threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise SectionTimeout("over its time budget")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_sections(sections, ctx: Context, *, time_limit: float, grace_s: float,
                 after_each: Callable[[dict], None]) -> dict:
    """Runs ``sections`` in order, each under its budget (``ctx.sizes.budgets_s``, default 60 s)
    and the run's ``time_limit``; calls ``after_each(results)`` after every one.

    Returns ``{name: {"status": "ok" | "failed" | "skipped", "seconds", "budget_s", "result"
    or "error"}}``. A failing section is reported in one line (traceback on stderr); the others
    still run.

    Example:
      >>> ctx = Context(DRY_RUN, True, 0.0)
      >>> def boom(ctx): raise ValueError("no")
      >>> results = run_sections([Section("a", boom, str), Section("b", lambda c: {"x": 1}, str)],
      ...                        ctx, time_limit=60, grace_s=5, after_each=lambda r: None)
      ... # doctest: +ELLIPSIS
      section a (budget 60 s) ...
      section a failed: ValueError: no
      section a: failed in 0.0 s
      section b (budget ... s) ...
      >>> results["a"]["status"], results["b"]["status"], results["b"]["result"]
      ('failed', 'ok', {'x': 1})
    """
    start = time.monotonic()
    results: dict[str, dict] = {}
    for section in sections:
        budget = ctx.sizes.budgets_s.get(section.name, 60.0)
        left = time_limit - (time.monotonic() - start)
        entry = {"budget_s": budget, "seconds": 0.0}
        if left <= 0:
            entry.update(status="skipped", error=f"the run's {time_limit:g} s were used up")
            print(f"section {section.name} skipped: {entry['error']}", flush=True)
        else:
            t0 = time.monotonic()
            ctx.deadline = t0 + min(budget, left)
            print(f"section {section.name} (budget {min(budget, left):.0f} s) ...", flush=True)
            try:
                with _alarm(min(budget, left) + grace_s):
                    entry.update(status="ok", result=section.measure(ctx))
            except Exception as e:  # noqa: BLE001 - reported; the other sections still run
                entry.update(status="failed", error=f"{type(e).__name__}: {e}".splitlines()[0])
                print(f"section {section.name} failed: {entry['error']}", flush=True)
                traceback.print_exc(file=sys.stderr)
            entry["seconds"] = time.monotonic() - t0
            print(f"section {section.name}: {entry['status']} in {entry['seconds']:.1f} s",
                  flush=True)
        gc.collect()  # the section's states, before the next one allocates
        results[section.name] = entry
        after_each(results)
    return results


def render(results: dict, sections, *, device: str, dry_run: bool, total_s: float) -> str:
    """The markdown of a (possibly partial) run: a summary line per section, then each one."""
    renderers = {s.name: s.render for s in sections}
    lines = [f"On {device}" + (" (--dry-run: tiny sizes, a smoke test, not a measurement)"
                               if dry_run else "")
             + (f"; {total_s:.0f} s in all." if len(results) == len(sections)
                else f"; {total_s:.0f} s so far ({len(results)} of {len(sections)} sections)."),
             ""]
    lines.append(markdown_table(
        ["section", "status", "seconds", "budget s"],
        [[name, e["status"] + ("" if "error" not in e else f": {e['error']}"),
          f"{e['seconds']:.1f}", f"{e['budget_s']:.0f}"] for name, e in results.items()]))
    for name, e in results.items():
        lines += ["", f"### {name}", ""]
        if e["status"] != "ok":
            lines.append(f"Not measured ({e['status']}: {e.get('error', '')}).")
            continue
        try:
            lines.append(renderers[name](e["result"]))
        except Exception as err:  # noqa: BLE001 - a rendering bug must not lose the numbers
            lines.append(f"Rendering failed ({type(err).__name__}: {err}); the numbers are in "
                         "accelerator.json.")
    return "\n".join(lines)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


class Script(NamedTuple):
    """A GPU script made of sections: its title in RESULTS.md, its description (``--help``),
    its sections, its sizes on a GPU and with ``--dry-run``, its file (the command line
    RESULTS.md records), and what a child process it starts runs: ``child(sizes, name) ->
    dict``, for the hidden ``--child NAME`` flag (:func:`child_process`)."""

    title: str
    description: str
    sections: tuple
    gpu: Sizes | Any
    dry_run: Sizes | Any
    file: str
    child: Callable[[Any, str], dict] | None = None


def run_script(script: Script, argv: list[str] | None = None) -> None:
    """Parses ``argv`` (``--dry-run``, ``--out-dir``, ``--sections``, ``--time-limit``,
    ``--write``) and runs the script's sections, writing what it measured after each."""
    stem = Path(script.file).stem
    ap = argparse.ArgumentParser(description=script.description, allow_abbrev=False)
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny sizes: every section on a CPU in under a minute")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help=f"also write {stem}.md and {stem}.json here after each section")
    ap.add_argument("--sections", default=",".join(s.name for s in script.sections),
                    help="comma-separated subset of: " + ", ".join(s.name for s in
                                                                   script.sections))
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds for the whole run (default: the sum of the sections' budgets)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    add_write_flag(ap)
    args = ap.parse_args(argv)
    sizes = script.dry_run if args.dry_run else script.gpu
    if args.child is not None and script.child is not None:
        print(_CHILD_TAG + json.dumps(script.child(sizes, args.child)), flush=True)
        return
    names = [n.strip() for n in args.sections.split(",") if n.strip()]
    known = {s.name: s for s in script.sections}
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"--sections: unknown {', '.join(map(repr, unknown))}; choose from "
                 + ", ".join(known))
    if args.out_dir is not None and args.out_dir.exists() and not args.out_dir.is_dir():
        ap.error(f"--out-dir {args.out_dir}: exists and is not a directory; name a directory")
    sections = [known[n] for n in names]
    time_limit = args.time_limit or sum(sizes.budgets_s.get(n, 60.0) for n in names)
    t0 = time.monotonic()
    device = device_description()
    print(f"{stem} benchmark on {device}: {', '.join(names)} "
          f"(time limit {time_limit:.0f} s)", flush=True)

    def after_each(results: dict) -> None:
        text = render(results, sections, device=device, dry_run=args.dry_run,
                      total_s=time.monotonic() - t0)
        published = publish(script.title, text, command=command_line(script.file, argv),
                            write=args.write)
        sys.stdout.flush()
        if args.out_dir is not None:
            args.out_dir.mkdir(parents=True, exist_ok=True)
            (args.out_dir / f"{stem}.md").write_text(published + "\n")
            (args.out_dir / f"{stem}.json").write_text(json.dumps(_jsonable(
                {"device": device, "dry_run": args.dry_run, "sections": results}), indent=1))

    ctx = Context(sizes, args.dry_run, time.monotonic())
    results = run_sections(sections, ctx, time_limit=time_limit, grace_s=20.0,
                           after_each=after_each)
    failed = [n for n, e in results.items() if e["status"] != "ok"]
    print(f"done in {time.monotonic() - t0:.0f} s" +
          (f"; not measured: {', '.join(failed)}" if failed else ""), flush=True)


def child_process(script_file: str, child: str, *, dry_run: bool, xla_flags: str = "",
                  timeout: float = 600.0, memory_fraction: float = 0.1) -> dict:
    """Runs ``script_file --child CHILD`` in a new process (XLA reads its flags at start-up),
    ``xla_flags`` added to this process' ``XLA_FLAGS``, and returns the dict it printed, with
    ``process_s`` (its wall time, start-up included). The child takes what it needs of the
    GPU's memory, up to ``memory_fraction`` (this process may hold the rest)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(x for x in (os.environ.get("XLA_FLAGS", ""), xla_flags) if x)
    env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false",
               XLA_PYTHON_CLIENT_MEM_FRACTION=str(memory_fraction),
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p))
    cmd = [sys.executable, str(Path(script_file).resolve()), "--child", child,
           *(["--dry-run"] if dry_run else [])]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=max(5.0, timeout))
    lines = [x for x in proc.stdout.splitlines() if x.startswith(_CHILD_TAG)]
    if proc.returncode or not lines:
        raise RuntimeError(f"the child with XLA_FLAGS={env['XLA_FLAGS']!r} exited "
                           f"{proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return {**json.loads(lines[-1][len(_CHILD_TAG):]), "process_s": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> None:
    run_script(Script(TITLE, __doc__.split("\n\n")[0], SECTIONS, GPU, DRY_RUN, __file__,
                      lambda sizes, _: _determinism_run(sizes)), argv)


if __name__ == "__main__":
    # The ladder wants most of the GPU; the determinism children get part of the rest. Read
    # when the backend starts, so set before anything touches a device; a user's value wins.
    if "--dry-run" not in sys.argv and "--child" not in sys.argv:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")
    main()
