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

import numpy as np

from effijax.errors import ConfigError

__all__ = ["state_bytes", "storage", "step_bytes", "device_budget", "memory"]


def state_bytes(abstract_state) -> int:
    """The bytes a checkpoint of ``abstract_state`` holds (global shapes; keys as key data)."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(abstract_state):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.eval_shape(jax.random.key_data,
                                  jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        total += int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def _format(n: int) -> str:
    from effijax.memory import format_bytes

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
    existing = next((p for p in (ckpt_dir, *ckpt_dir.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise ConfigError("out", str(ckpt_dir), f"cannot hold checkpoints: {existing} is not a "
                          "directory")
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
        raise ConfigError("out", str(ckpt_dir), f"{_format(free)} free there, but {keep + 1} "
                          f"checkpoints of {_format(checkpoint_bytes)} (--keep {keep}, plus the "
                          f"one being written) need {_format(need)} more; free space, lower "
                          "--keep, or choose another --out")


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
    from effijax.memory import parse_bytes

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


def _suggestion(job, budget: int) -> str:
    """The planner's cheapest configuration that fits ``budget``, in one clause."""
    from effijax.memory import plan

    model = job.model
    shape = {}
    if not job.batch_size % job.mesh.size:
        s = model.shape()
        shape = dict(**s.activation_args(), seq_len=s.seq_len, global_batch=job.batch_size,
                     dropout=getattr(model, "dropout", 0) > 0)
    try:
        p = plan(job.num_params, devices=job.mesh.size, device_memory=f"{budget}B", **shape)
    except ConfigError:
        return "the planner has no suggestion for this model"
    if not p.fits:
        return (f"the planner finds no configuration that fits {_format(budget)} on "
                f"{job.mesh.size} device(s): use more devices")
    strategy = {0: "ddp", 1: "zero1", 2: "zero2", 3: "fsdp"}[p.zero_stage]
    parts = [f"--strategy {strategy}"]
    if p.checkpointing and p.checkpointing != "none":
        parts.append(f"remat {p.checkpointing}")
    if p.lora:
        parts.append("LoRA (--lora-rank)")
    if p.grad_accum_steps and p.grad_accum_steps > 1:
        parts.append(f"--accumulate {p.grad_accum_steps}")
    return (f"effijax memory plan suggests {', '.join(parts)} "
            f"({_format(p.total_bytes or 0)} per device)")


def memory(compiled_memory, job, setting: str | None) -> None:
    """Stops before step 1 when the compiled step does not fit the device's memory.

    Raises:
      ConfigError: with the per-device breakdown, the budget and where it comes from, and the
        planner's suggestion.
    """
    import jax

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
    raise ConfigError("device_memory", _format(budget), (
        f"the compiled step needs {_format(need)} per device"
        + (f", {_format(need - already)} beyond the state already allocated" if already else "")
        + f" (arguments {_format(m.arguments)}"
        f" + outputs {_format(m.outputs)} - donated {_format(m.aliased)} + temporaries "
        f"{_format(m.temporaries)}; of the arguments: params {_format(m.params)}, optimizer "
        f"{_format(m.opt_state)}), more than the {_format(budget)} of {source}; "
        f"{_suggestion(job, budget)}; or --device-memory 0 to skip this check"))
