"""``effijax memory --compile``: the step ``effijax train`` would run, compiled for the devices
asked, and XLA's bytes per device beside the formula's.

The formula (:func:`effijax.memory.activation_bytes`) is the papers' lower bound and the same
on every backend; what a step holds is what XLA's buffer assignment keeps, which differs by
backend and by version (XLA:CPU keeps more than the formula's activations: 1.3x to 1.9x in the
suite's activation tests, 2.2x for SmolLM2 at 2,048 tokens, up to 4.8x for the tiny GPT's short
sequences). ``--compile`` asks the compiler: the model's abstract state and batch (nothing
allocated, no weights read), planned and compiled by the library functions ``effijax train``
plans and compiles with (:func:`~effijax.recipe.plan_job`, :func:`~effijax.recipe.compile_job`),
on this machine's devices: an accelerator's when it has as many as the mesh needs, else forced
CPU devices (``JAX_PLATFORMS=cpu`` forces them where an accelerator has fewer).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from typing import TYPE_CHECKING, NamedTuple

from effijax.errors import ConfigError

if TYPE_CHECKING:  # the recipe imports JAX; --params never does
    from effijax.recipe import Sections

__all__ = ["CompiledBytes", "Target", "check", "claim_devices", "compiled_bytes",
           "compiled_text"]


class Target(NamedTuple):
    """What :func:`check` found the step can be compiled for: the devices, and effijax train's
    settings for it (a :class:`~effijax.recipe.TrainConfig`'s sections, checked)."""

    devices: list
    sections: Sections


class CompiledBytes(NamedTuple):
    """Per-device bytes of the compiled step (``compiled.memory_analysis()``), and where.

    Attributes:
      platform, devices, mesh: what it was compiled for (``mesh`` None: one device).
      params, opt_state, other_state: the train state's leaves on one device.
      arguments: every argument (state, batch, and a LoRA base or a reference copy).
      outputs, aliased: the outputs, and those written into a donated argument's buffer.
      temporaries: XLA's working buffers, the gradients among them (``grads``).
      held: held at once: arguments + outputs not aliased + temporaries (what the pre-flight
        check of ``effijax train`` compares with the device's memory).
    """

    platform: str
    devices: int
    mesh: dict | None
    params: int
    opt_state: int
    other_state: int
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    grads: int
    held: int

    @property
    def activations(self) -> int:
        """Temporaries less the gradients: what the formula's activations count."""
        return self.temporaries - self.grads


def _device_count(args: argparse.Namespace) -> int:
    return args.devices * args.context * args.tensor


def _forced_cpu_devices() -> int:
    """The CPU devices this process is set to start with (``jax_num_cpu_devices``, else
    ``XLA_FLAGS``' ``--xla_force_host_platform_device_count``, else 1)."""
    import jax

    count = jax.config.values["jax_num_cpu_devices"]
    if count > 0:
        return count
    found = re.search(r"--xla_force_host_platform_device_count=(\d+)",
                      os.environ.get("XLA_FLAGS", ""))
    return int(found.group(1)) if found else 1


def claim_devices(args: argparse.Namespace) -> None:
    """Forces ``--devices x --context x --tensor`` CPU devices in this process before anything
    starts JAX's backends, where it is set to start with fewer (a process that asked for more,
    a test's, keeps them; :func:`check` takes the first). Nothing changes for an accelerator's
    devices, nor once JAX has started (:func:`check` then says what is missing)."""
    import jax

    n = _device_count(args)
    if _forced_cpu_devices() >= n:
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # the backend already started: check() reports the shortfall
        pass


def _devices(n: int) -> list:
    import jax

    have = jax.devices()
    if len(have) < n:
        platform = have[0].platform
        fix = ("run it with JAX_PLATFORMS=cpu to compile for CPU devices (XLA:CPU's buffers, not "
               f"the {platform}'s)" if platform != "cpu" else
               "run it in a process of its own (this one started JAX with fewer devices)")
        raise ConfigError("--devices", n, f"--compile compiles for --devices x --context x "
                          f"--tensor = {n} device(s), and this process has {len(have)} "
                          f"{platform} device(s); ask for fewer, or {fix}")
    return have[:n]


def _model(args: argparse.Namespace):
    """The architecture the formula counted, with its checkpointing, attention and dropout."""
    model = args.architecture
    names = {f.name for f in dataclasses.fields(model)}
    changes = {"remat": "block" if args.checkpointing == "block" else "none"}
    if args.attention not in (None, "auto") and "attention" in names:
        changes["attention"] = args.attention
    if not args.dropout and getattr(model, "dropout", 0) > 0:
        changes["dropout"] = 0.0
    return dataclasses.replace(model, **{k: v for k, v in changes.items() if k in names})


def _config(args: argparse.Namespace, reference: bool):
    """effijax train's settings for this step (its optimizer, LoRA, objective sections)."""
    from effijax.recipe import TrainConfig

    lora = args.lora_rank is not None
    frozen = args.frozen_dtype if (lora or reference) and args.frozen_dtype != "auto" else "auto"
    values = dict(precision=args.precision, optimizer=args.optimizer, strategy=args.strategy,
                  objective=args.objective, beta=args.beta,
                  precompute_reference=args.precompute_reference,
                  num_generations=args.num_generations,
                  max_completion_length=args.max_completion_length,
                  batch_size=args.batch_size * args.devices)
    # The objective's pairs are not read: the step's shapes are its rows'.
    if args.objective != "sft":
        values.update(data="(not read)")
    if lora:
        values.update(lora_rank=args.lora_rank, frozen_dtype=frozen, model_from=args.model_from,
                      lora_random_base=args.model_from is None)
    elif reference:
        values.update(frozen_dtype=frozen)
    return TrainConfig(**values)


def check(args: argparse.Namespace, *, reference: bool) -> Target:
    """What ``--compile`` needs, checked before anything is printed or compiled (``args``:
    ``effijax memory``'s parsed flags after the formula's rows, ``args.architecture`` set;
    ``reference``: the run holds a reference copy): the devices and train's settings.

    Raises:
      ConfigError: naming the flag: a bare ``--params`` (no model to compile), LoRA as a
        fraction, a GGUF file's own blocks, GRPO (its rollout needs the tokenizer), a setting
        ``effijax train`` refuses (an odd batch of preference pairs), or more devices than
        this process has.
    """
    if getattr(args, "architecture", None) is None:
        raise ConfigError("--compile", True, "compiles a model's step: give --model PRESET or "
                          "--from SOURCE instead of --params")
    if args.lora_fraction is not None and args.lora_rank is None:
        raise ConfigError("--compile", True, "compiles real adapters: give LoRA as --lora-rank "
                          "R instead of --lora-fraction")
    if args.frozen_dtype == "gguf":
        raise ConfigError("--compile", True, "with --frozen-dtype gguf the step decodes the "
                          "file's own blocks, which --compile does not read; effijax train "
                          "--from FILE --frozen-dtype gguf prints its compiled step's bytes "
                          "before it trains")
    if args.objective == "grpo":
        raise ConfigError("--compile", True, "with --objective grpo the step trains the rows its "
                          "rollout samples with the model's tokenizer, which --compile does not "
                          "read; effijax train --objective grpo prints its compiled step's bytes "
                          "before it trains")
    sections = _config(args, reference).sections  # train's own checks of these settings
    return Target(_devices(_device_count(args)), sections)


def compiled_bytes(args: argparse.Namespace, target: Target) -> CompiledBytes:
    """Plans and compiles ``effijax train``'s step for ``args`` on ``target`` (from
    :func:`check`) and reads XLA's bytes.

    Raises:
      ConfigError: a setting the planner refuses (named as effijax train names it).

    Example:
      >>> from effijax.cli._main import main
      >>> main(["memory", "--model", "tiny", "--seq-len", "64", "--precision", "fp32",
      ...       "--compile"])  # doctest: +ELLIPSIS
      tiny GPT: 2 layers, ...
      compiled: effijax train's step on 1 cpu device, XLA's bytes per device
        params ...
      0
    """
    from effijax.recipe import compile_job, get_objective, optimizer_for, plan_job
    from effijax.sharding import make_mesh
    from effijax.sources import step_bytes

    devices, s = target
    n = len(devices)
    model = _model(args)
    objective = get_objective(s.objective.objective)
    pairs = objective.load is not None  # preference pairs: the completions' tokens trained
    mesh = None if n == 1 else make_mesh(fsdp=args.devices, context=args.context,
                                         tensor=args.tensor, devices=devices)
    print(f"effijax memory: compiling effijax train's step for {n} {devices[0].platform} "
          f"device(s) (nothing is allocated)...", file=sys.stderr, flush=True)
    job = plan_job(model, args.precision, optimizer_for(s.training, s.optimizer, s.precision),
                   batch_size=s.training.batch_size, mesh=mesh, strategy=args.strategy,
                   lora=s.lora.spec(model.lora_targets),
                   frozen_dtype=None if s.lora.frozen_dtype == "auto" else s.lora.frozen_dtype,
                   seed=s.training.seed, masked=pairs, segmented=False,
                   sequence_parallel=args.sequence_parallel, objective=objective,
                   objective_settings=s.objective.settings)
    m = compile_job(job, census=False).memory
    return CompiledBytes(
        platform=devices[0].platform, devices=n,
        mesh=None if mesh is None else {k: int(v) for k, v in mesh.shape.items()},
        params=m.params, opt_state=m.opt_state, other_state=m.other_state,
        arguments=m.arguments, outputs=m.outputs, aliased=m.aliased,
        temporaries=m.temporaries, grads=m.grads or 0, held=step_bytes(m))


def compiled_text(c: CompiledBytes, activations: int | None, frozen: str = "") -> str:
    """The compiled step's rows, in the formula table's columns, and its activations against
    the formula's (``activations``); ``frozen`` names what the batch carries beside its tokens
    (``"frozen base"``, ``"reference"``)."""
    from effijax.memory import format_bytes

    where = (f"{c.devices} {c.platform} device{'s' if c.devices > 1 else ''}"
             + ("" if c.mesh is None else
                " (" + ",".join(f"{k}={v}" for k, v in c.mesh.items()) + ")"))
    batch = c.arguments - c.params - c.opt_state - c.other_state
    rows = [("params", c.params), ("optimizer", c.opt_state),
            ("batch" + (f" and {frozen}" if frozen else ""), batch),
            ("temporaries", c.temporaries), ("  of which grads", c.grads),
            ("held at once", c.held)]
    lines = [f"compiled: effijax train's step on {where}, XLA's bytes per device"]
    lines += [f"  {name:<22}{format_bytes(value):>12}  {value:>18,}" for name, value in rows]
    if activations:
        lines.append(f"  activations (temporaries less grads) {format_bytes(c.activations)}: "
                     f"{c.activations / activations:.2f}x the formula's "
                     f"{format_bytes(activations)} ({c.platform}'s buffers; another "
                     "backend's differ)")
    return "\n".join(lines)
