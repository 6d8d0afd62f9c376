"""Side-by-side timing and the RESULTS.md writer shared by the benchmark scripts.

Machines here are noisy, so variants are timed *interleaved*: each round runs every variant for a
few steps, rounds repeat, and a variant's time is the median over all its timed steps. Ratios are
taken between variants of the same run, never across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax

RESULTS = Path(__file__).with_name("RESULTS.md")


def device_description() -> str:
    """One line naming the backend, device kind and count, and the host (its CPU's widest
    vector extension: 16-bit matmuls are native only with AVX512_BF16 or AMX; on a CPU, whether
    malloc serves XLA's buffers on transparent huge pages, see :func:`run_like_effijax`)."""
    d = jax.devices()
    pages = ""
    if jax.default_backend() == "cpu":
        on = "glibc.malloc.hugetlb=1" in os.environ.get("GLIBC_TUNABLES", "")
        pages = ", huge pages" if on else ", no huge pages"
    return (f"{jax.default_backend()} x{len(d)} ({d[0].device_kind}), "
            f"{platform.machine()} host{cpu_extensions()}{pages}, jax {jax.__version__}")


def host_line() -> str:
    """The CPU's model name (``lscpu``'s), its core count and whether it has AVX512_BF16 and
    AMX, then :func:`device_description`: the host line of a side-by-side benchmark."""
    from effijax.precision import cpu_flags

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = next((line.split(":", 1)[1].strip() for line in out.splitlines()
                     if line.startswith("Model name")), "unknown CPU")
    except (OSError, subprocess.CalledProcessError):
        name = "unknown CPU"
    has = [f for f in ("avx512_bf16", "amx_bf16") if f in cpu_flags()]
    return (f"{name} ({os.cpu_count()} cores, {', '.join(has) if has else 'no avx512_bf16'}), "
            f"{device_description()}")


def load_averages() -> str:
    """The machine's load averages over 1, 5 and 15 minutes, ``"1.02 / 0.88 / 0.75"``: what
    other processes took of the cores while a side-by-side benchmark ran."""
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def run_like_effijax() -> None:
    """Re-executes the benchmark script once the way the ``effijax`` program runs its steps:
    with glibc's transparent-huge-page tunable (``effijax.cli.reexec_with_hugepages``; on
    Linux with glibc >= 2.35, off with ``EFFIJAX_HUGEPAGES=0``). Call it first thing in a
    script's ``main`` when run as a script: the script restarts from its top."""
    from effijax.cli import reexec_with_hugepages

    reexec_with_hugepages(script=True)


def cpu_extensions() -> str:
    """``" with AVX2"``, ``" with AVX512_BF16"``, ...: the widest of the host CPU's vector
    extensions that decide matmul speed (from /proc/cpuinfo; empty where it cannot be read)."""
    from effijax.precision import cpu_flags

    flags = cpu_flags()
    for flag in ("amx_bf16", "avx512_bf16", "avx512f", "avx2"):
        if flag in flags:
            return f" with {flag.upper()}"
    return ""


def time_interleaved(
    variants: dict[str, Callable[[], Callable[[], object]]],
    *,
    rounds: int = 5,
    steps_per_round: int = 10,
    warmup: int = 3,
    settle: int = 0,
) -> dict[str, dict]:
    """Times several step functions interleaved; returns ``{name: {"median_s", "min_s", ...}}``.

    Args:
      variants: ``{name: make}`` where ``make()`` builds the variant's state and returns a
        zero-argument ``run()`` that performs ONE step and blocks until it is done.
      rounds: how many times every variant gets its turn.
      steps_per_round: timed steps per turn.
      warmup: untimed steps per variant before the first round (compilation).
      settle: untimed steps at the start of every turn. A step returns the buffers it frees
        to the kernel, and faulting them in again cost more after other work or a pause than
        right after the same step. Measured on SmolLM2's LoRA step at 4 x 512 tokens: the
        first effijax step after a ``peft`` step took 11.4-12.2 s, 4.7-4.9 s of it in the
        kernel, where the next ones took 9.3-9.7 s (0.7-0.9 s in the kernel); at 4 x 128 in
        bf16, 2.1 s after a pause of 1 s against 1.2 s back to back. A training run repeats
        one step, so with ``settle=1`` the median is of steps that follow their own.
    """
    runners = {name: make() for name, make in variants.items()}
    for run in runners.values():
        for _ in range(warmup):
            run()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            for _ in range(settle):
                run()
            for _ in range(steps_per_round):
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
    out = {}
    for name, ts in times.items():
        ts = sorted(ts)
        out[name] = {
            "median_s": statistics.median(ts),
            "min_s": ts[0],
            "p10_s": ts[len(ts) // 10],
            "p90_s": ts[(9 * len(ts)) // 10],
            "n": len(ts),
        }
    return out


@contextlib.contextmanager
def busy_processes(n: int):
    """A shared machine, on purpose: ``n`` processes that each spin one core while inside.

    Each is a Python interpreter running ``while True: pass`` (no memory, no I/O: it competes
    for CPU time only); they are killed and reaped on the way out, however it is left.
    """
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def wait_or_kill(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Waits for ``proc`` to end, killing it after ``timeout_s`` seconds."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def ask_worker(proc: subprocess.Popen, request: dict, prefix: str, who: str, *,
               echo=lambda line: True) -> dict:
    """Sends ``request`` (one JSON line) to a worker reading its stdin and returns its reply
    (the line of its stdout after ``prefix``, as JSON; the worker prints it itself, without
    importing this module and JAX); the lines before it are printed where ``echo(line)`` says
    so. A worker that exits first raises a ``RuntimeError`` naming ``who``."""
    with contextlib.suppress(BrokenPipeError):  # a worker that died: said below
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
    for line in proc.stdout:
        if line.startswith(prefix):
            return json.loads(line[len(prefix):])
        if echo(line):
            print(line, end="")
    raise RuntimeError(f"the {who} worker exited (status {proc.wait()}) during {request}; its "
                       "error is above")


def end_worker(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Ends a worker that reads its requests from its standard input: the input closed (its
    cue to exit), the process waited for (killed after ``timeout_s`` seconds), its output
    closed."""
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.close()
    wait_or_kill(proc, timeout_s)
    proc.stdout.close()


def write_section(name: str, body: str) -> None:
    """Replaces (or appends) the section ``## name`` of RESULTS.md with ``body``."""
    text = RESULTS.read_text() if RESULTS.exists() else (
        "# Benchmark results\n\nWritten by the scripts in `benchmarks/`; each section says how it "
        "was produced. Re-run a script to refresh its section.\n"
    )
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    section = f"{start}\n## {name}\n\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else (
        text.rstrip() + "\n\n" + section + "\n")
    RESULTS.write_text(text if text.endswith("\n") else text + "\n")


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def add_write_flag(parser: argparse.ArgumentParser) -> None:
    """``--write``: without it a script only prints; with it, it also replaces its section of
    RESULTS.md (a short smoke run never overwrites a recorded result by accident)."""
    parser.add_argument("--write", action="store_true",
                        help="also replace this script's section of benchmarks/RESULTS.md with "
                        "the result and this command line (default: print only)")


def command_line(script: str, argv: list[str] | None = None) -> str:
    """The command that ran ``script`` with ``argv`` (default: this process' arguments), as a
    user would type it from the repository root."""
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join(["python", f"benchmarks/{Path(script).name}", *args])


def publish(name: str, body: str, *, command: str, write: bool) -> str:
    """Prints a result headed by the exact command that produced it; with ``write``, also
    replaces the section ``## name`` of RESULTS.md with it. Returns the text."""
    text = f"Command: `{command}`\n\n{body.strip()}"
    print(text)
    if write:
        write_section(name, text)
        print(f"\nwrote the section {name!r} of {RESULTS}")
    else:
        print(f"\n(printed only; add --write to replace the section {name!r} of "
              "benchmarks/RESULTS.md)")
    return text
