"""Checks before the first step: the checkpoint storage, and the compiled step against memory.

Both failures would otherwise surface late and loudly: an unwritable or full checkpoint
directory at the first save (after the compute is spent, in a chain of orbax tracebacks), an
out-of-memory at step 1 (from XLA's allocator). Here each is one :class:`ConfigError` before
anything trains, with the numbers and the fix.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np

from effijax.errors import NO_VALUE, ConfigError
from effijax.memory import format_bytes, parse_bytes

__all__ = ["checkpoint_folder", "state_bytes", "storage", "step_bytes", "device_budget",
           "check_compiled_memory", "check_memory"]


def checkpoint_folder(ckpt_dir: Path) -> Path:
    """The nearest existing folder at or above ``ckpt_dir``: where the checkpoints will be
    created. A file in their way is refused (a path check, made before anything is planned).

    Example:
      >>> import tempfile, pathlib
      >>> root = pathlib.Path(tempfile.mkdtemp())
      >>> checkpoint_folder(root / "run" / "checkpoints") == root
      True
    """
    existing = next((p for p in (ckpt_dir, *ckpt_dir.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise ConfigError("out", str(ckpt_dir), f"cannot hold checkpoints: {existing} is not a "
                          "directory")
    return existing


def state_bytes(abstract_state) -> int:
    """The bytes a checkpoint of ``abstract_state`` holds (global shapes; keys as key data)."""
    total = 0
    for leaf in jax.tree.leaves(abstract_state):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.eval_shape(jax.random.key_data,
                                  jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        total += int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def _format(n: int) -> str:
    return format_bytes(int(n))


def _held(directory: Path) -> int:
    """Bytes of the committed steps already in ``directory`` (they count towards ``keep``)."""
    return sum(f.stat().st_size for p in directory.iterdir() if p.name.isdigit()
               for f in p.rglob("*") if f.is_file())


def storage(ckpt_dir: Path, checkpoint_bytes: int, keep: int) -> None:
    """The checkpoint directory can be written and has room for ``keep`` checkpoints plus the
    one being written.

    Raises:
      ConfigError: naming the directory, the error or the bytes free and needed.

    Example:
      >>> import tempfile, pathlib
      >>> storage(pathlib.Path(tempfile.mkdtemp()) / "checkpoints", 10**6, keep=3)
      >>> storage(pathlib.Path(tempfile.mkdtemp()), 10**18, keep=3)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: out=...: ... free there, but 4 checkpoints of ... more; ...
    """
    existing = checkpoint_folder(ckpt_dir)
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".effijax-write-test-"):
            pass
    except OSError as e:
        raise ConfigError("out", str(ckpt_dir), f"checkpoints cannot be written in {existing} "
                          f"({e.strerror}); make it writable, choose another --out, or train "
                          "with --no-checkpoints") from None
    held = _held(ckpt_dir) if ckpt_dir.is_dir() else 0
    need = max(checkpoint_bytes, (keep + 1) * checkpoint_bytes - held)
    free = shutil.disk_usage(existing).free
    if free < need:
        # The most checkpoints that fit beside the one being written, counting those held.
        fits = (free + held) // checkpoint_bytes - 1 if checkpoint_bytes else keep
        fix = (f"lower --keep to {fits}, " if 1 <= fits < keep else
               "train with --no-checkpoints, " if fits < 1 else "")
        raise ConfigError("out", str(ckpt_dir), f"{_format(free)} free there, but {keep + 1} "
                          f"checkpoints of {_format(checkpoint_bytes)} (--keep {keep}, plus the "
                          f"one being written) need {_format(need)} more; {fix}free space, or "
                          "choose another --out")


def step_bytes(memory) -> int:
    """Per-device bytes the compiled step holds at once: arguments, plus outputs not aliased
    to a donated argument, plus temporaries (from ``compiled.memory_analysis()``)."""
    return int(memory.arguments + memory.outputs - memory.aliased + memory.temporaries)


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def device_budget(device, setting: str | None, local_devices: int) -> tuple[int | None, str]:
    """``(bytes per device, where the number comes from)``; None: nothing to compare with.

    ``setting`` (``--device-memory``) wins; else the device's own ``bytes_limit``
    (GPU/TPU); else, on CPU, the host's available memory shared by its local devices.
    """
    if setting is not None:
        return parse_bytes(setting, field="device_memory"), "--device-memory"
    stats = None
    try:
        stats = device.memory_stats()
    except (AttributeError, NotImplementedError, RuntimeError):
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.device_kind}'s memory"
    if device.platform == "cpu":
        available = _meminfo_available()
        if available is not None:
            return available // max(1, local_devices), (
                f"the host's available memory / {local_devices} local device(s)")
    return None, "unknown"


# What a refusal may suggest must be a flag of `effijax train` with values that fit this run:
# the measured step, scaled by what each flag changes, with this margin for what the scaling
# does not see (XLA's buffer reuse changes with the shapes).
_MARGIN = 0.85


def _fitting_flags(m, job, budget: int, already: int,
                   steps: int) -> list[tuple[str, str, int]]:
    """``[(flags, why, estimated bytes)]`` of the changes that fit ``budget``, best first.

    * ``--strategy fsdp`` over several devices: the model states divide by the device count.
    * Fewer sequences per step with gradient accumulation for the same optimizer batch
      (``--batch-size B/K --accumulate K --steps S*K``): the temporaries (the activations,
      mostly) divide by about K; the accumulator adds one copy of the trainable parameters.
    """
    need = step_bytes(m) - already
    grads = m.grads or 0
    devices = job.mesh.size
    options = []
    if devices > 1 and job.strategy != "fsdp":
        states = m.params + grads + m.opt_state
        options.append(("--strategy fsdp", "the model states sharded over the devices",
                        need - states + states // devices))
    for k in (2, 4, 8, 16, 32, 64):
        micro = job.batch_size // k
        if job.batch_size % k or micro < 1 or micro % devices:  # every device gets rows
            continue
        estimate = need - m.temporaries + m.temporaries // k + m.params
        options.append((f"--batch-size {micro} --accumulate {k} --steps {steps * k}",
                        "the same sequences per optimizer update, in smaller micro-batches",
                        estimate))
    return [option for option in options if option[2] <= _MARGIN * budget]


def _suggestion(m, job, budget: int, already: int, steps: int) -> str:
    """What to run instead, in one clause: flags of ``effijax train`` that fit."""
    fits = _fitting_flags(m, job, budget, already, steps)
    if not fits:
        return (f"no --strategy or --accumulate change fits {_format(budget)} per device: "
                "shorten --seq-len, or use a device with more memory")
    flags, why, estimate = fits[0]
    return f"try {flags} ({why}: about {_format(estimate)} per device)"


def check_compiled_memory(compiled_memory, job, setting: str | None, steps: int = 1) -> None:
    """Stops before step 1 when the compiled step does not fit the device's memory.

    Args:
      compiled_memory: the compiled step's :class:`~effijax.memory.MemoryReport`.
      job: the planned job.
      setting: ``--device-memory`` (None: the device's own; ``0`` skips the check).
      steps: the run's ``--steps`` (a suggestion of gradient accumulation scales them).

    Raises:
      ConfigError: with the per-device breakdown, the budget and where it comes from, and
        flags of ``effijax train`` that fit (``device_memory`` when that setting gave the
        budget, else ``memory``).
    """
    if setting is not None and setting.strip() in ("0", "0B"):
        return
    m = compiled_memory
    device = job.mesh.devices.flat[0] if hasattr(job.mesh, "devices") else jax.local_devices()[0]
    local = sum(1 for d in np.asarray(job.mesh.devices).flat
                if d.process_index == jax.process_index())
    budget, source = device_budget(device, setting, local)
    need = step_bytes(m)
    # The host's available memory is read with the state already allocated: only what the
    # step adds (outputs, temporaries) must still fit.
    already = m.arguments if source.startswith("the host's") else 0
    if budget is None or need - already <= budget:
        return
    field, value = (("device_memory", _format(budget)) if setting is not None
                    else ("memory", NO_VALUE))
    raise ConfigError(field, value, (
        f"the compiled step needs {_format(need)} per device"
        + (f", {_format(need - already)} beyond the state already allocated" if already else "")
        + f" (arguments {_format(m.arguments)}"
        f" + outputs {_format(m.outputs)} - donated {_format(m.aliased)} + temporaries "
        f"{_format(m.temporaries)}; of the arguments: params {_format(m.params)}, optimizer "
        f"{_format(m.opt_state)}), more than the {_format(budget)} of {source}; "
        f"{_suggestion(m, job, budget, already, steps)}; or --device-memory 0 to skip this "
        "check"))


def check_memory(need: int, held: int, *, what: str, fix: str, device=None) -> None:
    """Stops a generation or an evaluation before it runs when it cannot fit in memory: the
    check :func:`memory` makes of the train step, for the programs that run a model without
    training it (they have no ``--device-memory``: the budget is the device's own, or on CPU
    the host's available memory).

    Args:
      need: bytes the program holds at once (parameters, cache or batch, temporaries).
      held: of them, the bytes already allocated (the parameters): the host's available
        memory is read with them in it.
      what: the program, in words (``"generating 300,000 prompts"``).
      fix: what to do instead, in words.
      device: the device it runs on (default: the first local one).

    Raises:
      ConfigError: ``field="memory"``, with the numbers, where the budget comes from and
        ``fix``.

    Example:
      >>> check_memory(10**6, 0, what="evaluating", fix="lower --batch-size")
      >>> check_memory(10**18, 0, what="evaluating", fix="lower --batch-size")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      effijax.errors.ConfigError: memory: evaluating needs 1000000000 GB, more than the ...
    """
    device = jax.local_devices()[0] if device is None else device
    # One device runs it: on CPU the host's whole available memory is its budget.
    budget, source = device_budget(device, None, 1)
    already = held if source.startswith("the host's") else 0
    if budget is None or need - already <= budget:
        return
    beyond = f" (of which {_format(already)} already loaded)" if already else ""
    raise ConfigError("memory", NO_VALUE, f"{what} needs {_format(need)}{beyond}, more than "
                      f"the {_format(budget)} of {source}; {fix}")
