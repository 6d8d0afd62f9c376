"""Host memory of `effijax train --data DIR` on a folder of text files, small and large.

Text and JSONL data larger than `effijax.sources.MEMORY_BYTES` trains from a token store prepared
once in effijax's cache and memory-mapped; smaller data is read in memory at every start (the
way all text was read before: 3.3 GB of RSS on 1.5 GB of `.txt` files against 0.55 GB on 2 MB,
the text held about twice at the peak).

Each row is one fresh `effijax train --model tiny --data DIR --steps 2` (the program itself),
its peak RSS that of the largest of it and its processes (the prepare's workers), as
`/usr/bin/time -v` reports it:

* the small folder (read in memory);
* with ``--before TREE`` (an effijax source tree of the earlier code, e.g. ``git archive
  COMMIT effijax | tar -x -C TREE``), the large folder read by that code;
* the large folder's first start (it prepares the store) and a second one (it reuses it).

The large runs' final losses are the same: the store gives the batches of the files read in
memory. Goal: the large store runs within 150 MB of the small run.

Run: ``python benchmarks/data_memory.py [--large-mb 1536] [--small-mb 2] [--before TREE]
[--write]``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A small process that runs the measured one and prints its peak RSS in KiB: ru_maxrss of the
# children (the largest of them and of their own, as /usr/bin/time reports). Not the benchmark
# itself: a child keeps the high-water mark of the process it was forked from across exec.
_METER = """
import resource, subprocess, sys, time
start = time.perf_counter()
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(done.stdout + done.stderr)
print("PEAK", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, time.perf_counter() - start,
      done.returncode)
"""


def cpu_name() -> str:
    """The host CPU's model name (``lscpu``'s "Model name"), or the machine's architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.machine()


def write_folder(folder: Path, mb: int) -> None:
    """``mb`` MiB of text in files of 1 MiB: the standard library's source, over and over."""
    folder.mkdir(parents=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = b"".join(p.read_bytes() for p in sorted(stdlib.glob("*.py")))
    for i in range(mb):
        at = (i * 7919 * 4096) % (len(text) - 2**20)
        (folder / f"{i:05d}.txt").write_bytes(text[at:at + 2**20])


def measure(data: Path, out: Path, env: dict) -> dict:
    """One run of the program: ``{"peak_mb", "seconds", "loss", "read"}``."""
    command = [sys.executable, "-m", "effijax", "train", "--model", "tiny", "--data", str(data),
               "--steps", "2", "--no-progress", "--no-checkpoints", "--out", str(out)]
    # Run from the work folder: `python -m` puts the current folder first on the path, ahead
    # of PYTHONPATH's tree.
    done = subprocess.run([sys.executable, "-c", _METER, *command], capture_output=True,
                          text=True, env=env, cwd=out.parent, timeout=3600)
    peak_line = done.stdout.strip().splitlines()[-1].split()
    if done.returncode or peak_line[0] != "PEAK" or peak_line[3] != "0":
        raise SystemExit(f"the run failed:\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
    loss = re.search(r"final loss ([0-9.]+)", done.stdout)
    read = ("store, prepared now" if re.search(r"prepared [\d,]+ tokens", done.stdout)
            else "store, reused" if "memory-mapped" in done.stdout else "in memory")
    return {"peak_mb": int(peak_line[1]) / 1024, "seconds": float(peak_line[2]),
            "loss": loss[1] if loss else "?", "read": read}


def main(argv: list[str] | None = None) -> None:
    # Imported here, not at the top: prepare's worker processes are spawned, and each imports
    # this script again (benchmarks/data.py does the same).
    from harness import add_write_flag, command_line, cpu_extensions, markdown_table, publish

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small-mb", type=int, default=2, help="the small folder (default 2)")
    parser.add_argument("--large-mb", type=int, default=1536, help="the large folder "
                        "(default 1536, 1.5 GiB)")
    parser.add_argument("--dir", default=None, help="work folder (default: a temporary one, "
                        "removed at the end)")
    parser.add_argument("--before", default=None, metavar="TREE", help="a source tree of the "
                        "earlier effijax (holding effijax/): its reading of the large folder "
                        "is measured too")
    add_write_flag(parser)
    args = parser.parse_args(argv)
    from effijax.sources import MEMORY_BYTES

    work = Path(args.dir or tempfile.mkdtemp(prefix="effijax-data-memory-"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XDG_CACHE_HOME": str(work / "cache")}
    load = os.getloadavg()[0]
    rows, runs = [], []
    try:
        for name, mb in (("small", args.small_mb), ("large", args.large_mb)):
            if not (work / name).exists():
                write_folder(work / name, mb)
        plan = [("small", args.small_mb, ROOT),
                *([("large", args.large_mb, Path(args.before).resolve())]
                  if args.before else []),
                ("large", args.large_mb, ROOT),  # prepares the store
                ("large", args.large_mb, ROOT)]  # reuses it
        shutil.rmtree(work / "cache", ignore_errors=True)
        for i, (name, mb, tree) in enumerate(plan):
            run = measure(work / name, work / f"run{i}", {**env, "PYTHONPATH": str(tree)})
            read = run["read"] + ("" if tree == ROOT else " (the earlier code)")
            print(f"{name} ({mb} MiB), {read}: peak RSS {run['peak_mb']:.0f} MB, "
                  f"{run['seconds']:.1f} s, final loss {run['loss']}", flush=True)
            runs.append(run | {"store": tree == ROOT and run["read"] != "in memory"})
            rows.append([f"{mb:,} MiB ({name})", read, f"{run['peak_mb']:.0f}",
                         f"{run['peak_mb'] - runs[0]['peak_mb']:+.0f}", f"{run['seconds']:.1f}",
                         run["loss"]])
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    worst = max(r["peak_mb"] for r in runs if r["store"]) - runs[0]["peak_mb"]
    body = "\n".join([
        f"Host: {cpu_name()} ({os.cpu_count()} cores{cpu_extensions()}), Python "
        f"{sysconfig.get_python_version()}, the CPU backend; load average {load:.1f} at the "
        f"start, {os.getloadavg()[0]:.1f} at the end (other jobs share the cores).", "",
        f"`effijax train --model tiny --data DIR --steps 2 --no-checkpoints` on folders of 1 MiB "
        "text files (the standard library's source), each run a fresh process; peak RSS of the "
        "largest of it and its processes (as `/usr/bin/time -v` reports it), wall time of the "
        f"whole run. Text up to {MEMORY_BYTES // 2**20} MiB (`effijax.sources.MEMORY_BYTES`) is "
        "read in memory at every start; more is prepared once into a token store in effijax's "
        "cache (2 worker processes, each file tokenized in blocks) and memory-mapped."
        + (f" The earlier code: effijax's source at {args.before}, which read all text in "
           "memory." if args.before else ""), "",
        markdown_table(["data", "read", "peak RSS (MB)", "vs small (MB)", "seconds",
                        "final loss"], rows), "",
        f"Store runs vs the small run: {worst:+.0f} MB at most (goal: under 150 MB). The same "
        "final loss in the large runs: the store gives the batches of the files read in "
        "memory."])
    publish("Host memory of text data", body, command=command_line(__file__, argv),
            write=args.write)


if __name__ == "__main__":
    main()
