"""Data at scale: preparing a token store, and what training on a large one costs the host.

Three measurements, one run:

* **prepare throughput** (tokens/s) on SmolLM2's tokenizer, over the same Parquet file of
  documents (the standard library's ``.py`` files, one per row): ``effijax data prepare`` with 1
  and 2 processes, against ``datasets``' ``Dataset.map(batched=True, num_proc=2)`` calling the
  same ``tokenizers`` tokenizer (each side writes its result to disk; best of two alternating
  rounds). Goals: effijax (2) >= 1.0x datasets, and 2 processes / 1 process >= 1.7x (on a
  machine with 2 free cores).
* **host memory and start-up vs store size**: a small and a large byte-level store (the large
  one's size is ``--large-mb``); in a fresh process each (its imports done), the time to open
  the data (``load_dataset``) and draw the first batch, and the peak RSS after drawing 200
  batches, with its private (``RssAnon``) and mapped-file (``RssFile``) parts.
  Goals: RSS difference < 100 MB, start-up difference < 2 s.
* **data time per step** (its own section): the default model (``mini``, batch 16) trained by
  :func:`effijax.run.train_loop` from the large store, with each batch built on the main thread
  between the steps (``--prefetch 0``) and built ahead by :class:`effijax.data.Prefetcher`
  (``--prefetch 2``, the default), side by side in rounds that alternate: the main thread's time
  waiting for (or building) the next batch, and the time per step. Also the time to assemble one
  batch alone. Goal: the data time not hidden behind the step < 2% of the step.

Run: ``python benchmarks/data.py [--large-mb 2048] [--only step] [--write]`` (``--only step``:
only the data time per step, writing only its section).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

_OPEN = """
import json, sys, time
from effijax.data import batch_at
from effijax.models import gpt_config
from effijax.sources import load_dataset
t0 = time.perf_counter()
data = load_dataset(sys.argv[1], gpt_config("mini"))
batch_at(data.train, seed=0, step=0, batch_size=16, seq_len=256)
first = time.perf_counter() - t0
for step in range(1, 200):
    batch_at(data.train, seed=0, step=step, batch_size=16, seq_len=256)
# VmHWM, not ru_maxrss (which keeps the forking parent's high-water mark across exec); RssAnon
# is the process' own memory, RssFile the mapped pages of the page cache (the store's included).
status = {line.split(":")[0]: int(line.split()[1]) / 1024 for line in open("/proc/self/status")
          if line.startswith(("VmHWM", "RssAnon", "RssFile"))}
print(json.dumps({"first_batch_s": first, **status}))
"""


def _documents(max_bytes: int) -> list[str]:
    from effijax.data import load_documents

    return [d.decode("utf-8", errors="replace") for d in load_documents(max_bytes=max_bytes)]


def _prepare_rates(work: Path, mb: int, rounds: int = 2) -> list[list[object]]:
    """Each contender ``rounds`` times, alternating, from nothing (its output removed); the
    best time of each (the machine's noise only ever adds)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from effijax.sources import prepare, prepare_tokenizer

    docs = _documents(mb * 2**20)
    source = work / "docs.parquet"
    pq.write_table(pa.table({"text": docs}), source, row_group_size=256)
    tokenizer = prepare_tokenizer("smollm2")
    spec = tokenizer.spec

    def tokenize(batch, _cache={}):  # noqa: B006 (one tokenizer per worker process)
        if "tok" not in _cache:
            from tokenizers import Tokenizer

            _cache["tok"] = Tokenizer.from_str(spec)
        encodings = _cache["tok"].encode_batch(batch["text"], add_special_tokens=False)
        return {"ids": [e.ids for e in encodings]}

    def effijax_prepare(processes):
        out = work / f"store{processes}"
        shutil.rmtree(out, ignore_errors=True)
        return prepare(source, out, tokenizer=tokenizer, processes=processes)["tokens"]

    def datasets_map():
        shutil.rmtree(work / "hf-cache", ignore_errors=True)
        ds = datasets.Dataset.from_parquet(str(source), cache_dir=str(work / "hf-cache"))
        mapped = ds.map(tokenize, batched=True, num_proc=2, remove_columns=["text"],
                        cache_file_name=str(work / "hf-cache" / "mapped.arrow"))
        return sum(len(ids) for ids in mapped["ids"])

    datasets.disable_progress_bars()
    contenders = {"effijax data prepare, 1 process(es)": lambda: effijax_prepare(1),
                  "effijax data prepare, 2 process(es)": lambda: effijax_prepare(2),
                  "datasets.map(batched=True, num_proc=2)": datasets_map}
    best: dict[str, tuple[float, int]] = {}
    for _ in range(rounds):
        for name, run in contenders.items():
            t0 = time.perf_counter()
            tokens = run()
            seconds = time.perf_counter() - t0
            best[name] = min(best.get(name, (seconds, tokens)), (seconds, tokens))
    return [[name, tokens, round(seconds, 2), round(tokens / seconds)]
            for name, (seconds, tokens) in best.items()]


def _prepare_shards(source: Path) -> str:
    from effijax.sources import default_shard_bytes

    return f"{default_shard_bytes(source.stat().st_size) // 2**10} KiB each"


def _byte_store(work: Path, name: str, mb: int) -> Path:
    """A byte-level store of ``mb`` MiB of printable text (generated: its content does not
    matter to what is measured)."""
    from effijax.sources import prepare

    source = work / f"{name}.txt"
    rng = np.random.default_rng(0)
    with open(source, "wb") as f:
        for _ in range(mb // 64):
            f.write(rng.integers(32, 127, 64 * 2**20, np.uint8).tobytes())
        f.write(rng.integers(32, 127, (mb % 64) * 2**20, np.uint8).tobytes())
    prepare(source, work / f"{name}.store", processes=2)
    source.unlink()
    return work / f"{name}.store"


def _open_in_fresh_process(store: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", _OPEN, str(store)], capture_output=True,
                         text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _step_share(store: Path, steps: int, rounds: int) -> tuple[str, list[list[object]]]:
    """The default model's training loop on the store, its batches built between the steps
    (depth 0) and ahead of them (depth 2), in alternating rounds from the same state, each call
    for a batch timed; and one batch's assembly alone."""
    import jax
    import optax

    from effijax.data import Prefetcher, batch_at
    from effijax.models import gpt_config
    from effijax.recipe import batch_fn, compile_job, init_state, plan_job
    from effijax.run import train_loop
    from effijax.sources import load_dataset

    model = gpt_config("mini")
    data = load_dataset(str(store), model)
    job = plan_job(model, "fp32", optax.adamw(1e-3), batch_size=16)
    step = compile_job(job, census=False).step
    fetch = batch_fn(job, data.train)
    start = init_state(job)
    jax.block_until_ready(step(jax.tree.map(lambda x: x.copy(), start), fetch(0)))  # warm
    t0 = time.perf_counter()
    for i in range(200):
        batch_at(data.train, seed=0, step=i, batch_size=16, seq_len=model.seq_len)
    assembly_ms = (time.perf_counter() - t0) / 200 * 1e3
    totals = {depth: {"first": [], "later": [], "wall": 0.0, "step": []} for depth in (0, 2)}
    for _ in range(rounds):
        for depth, total in totals.items():
            waits = []
            with Prefetcher(fetch, range(steps), depth=depth) as batches:
                def timed(step_no, batches=batches, waits=waits):
                    t = time.perf_counter()
                    batch = batches(step_no)
                    waits.append(time.perf_counter() - t)
                    return batch

                t0 = time.perf_counter()
                state, summary = train_loop(step, jax.tree.map(lambda x: x.copy(), start),
                                            timed, num_steps=steps,
                                            tokens_per_step=job.tokens_per_step,
                                            progress=False)
                jax.block_until_ready(state)
                total["wall"] += time.perf_counter() - t0
            total["first"].append(waits[0])
            total["later"] += waits[1:]
            total["step"].append(job.tokens_per_step / summary["tokens_per_s"])
    rows = []
    for depth, total in totals.items():
        later_ms, step_ms = np.mean(total["later"]) * 1e3, np.median(total["step"]) * 1e3
        rows.append([f"{depth}" + (" (between the steps)" if depth == 0 else " (ahead)"),
                     f"{np.mean(total['first']) * 1e3:.2f}", f"{later_ms:.3f}",
                     f"{np.max(total['later']) * 1e3:.2f}", f"{step_ms:.1f}",
                     f"{total['wall'] / (steps * rounds) * 1e3:.1f}",
                     f"{later_ms / step_ms:.3%}"])
    return f"{assembly_ms:.3f}", rows


def main(argv: list[str] | None = None) -> None:
    # Imported here, not at the top: prepare's worker processes are spawned, and each imports
    # this script again; at the top, harness would bring jax into every worker (seconds each,
    # which no user's `effijax data prepare` pays: its workers import no jax).
    from harness import add_write_flag, command_line, device_description, markdown_table, publish

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare-mb", type=int, default=8, help="MiB of documents to "
                        "tokenize for the throughput comparison (default 8)")
    parser.add_argument("--small-mb", type=int, default=10)
    parser.add_argument("--large-mb", type=int, default=2048, help="the large store's size "
                        "(default 2048: the issue's >= 2 GB)")
    parser.add_argument("--dir", default=None, help="work folder (default: a temporary one, "
                        "removed at the end)")
    parser.add_argument("--only", choices=("step",), default=None, help="step: measure (and "
                        "write) only the data time per step")
    parser.add_argument("--steps", type=int, default=20, help="training steps per round of the "
                        "data time per step (default 20)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each with and without "
                        "prefetch (default 2)")
    add_write_flag(parser)
    args = parser.parse_args(argv)
    work = Path(args.dir or tempfile.mkdtemp(prefix="effijax-data-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]  # other jobs on the same cores change every number below
    step_only = args.only == "step"
    try:
        if not step_only:
            rates = _prepare_rates(work, args.prepare_mb)
        stores = {name: _byte_store(work, name, mb)
                  for name, mb in (("small", args.small_mb), ("large", args.large_mb))
                  if name == "large" or not step_only}
        if not step_only:
            opened = {name: _open_in_fresh_process(path) for name, path in stores.items()}
        assembly_ms, share = _step_share(stores["large"], args.steps, args.rounds)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    machine = (f"Device: {device_description()}; {os.cpu_count()} CPU cores, Python "
               f"{sysconfig.get_python_version()}; load average {load:.1f} at the start, "
               f"{os.getloadavg()[0]:.1f} at the end (other jobs share the cores).")
    sections = [("Data time per step", "\n".join([
        machine, "",
        f"The default `mini` GPT (batch 16 x 256, fp32) trained by `effijax.run.train_loop` "
        f"from a {args.large_mb} MiB byte store, {args.rounds} rounds of {args.steps} steps "
        "each way, alternating, from the same state. The wait is the main thread's time in "
        "`batch(step)`: building the batch (and putting it on the device) between the steps, "
        "or taking the one a `effijax.data.Prefetcher` built ahead (`effijax train --prefetch "
        "N`, default 2); the first batch of a run (nothing built yet: the worker thread starts) "
        "apart from the others, whose mean and largest wait are shown. The step time is the "
        "median over the steps after each round's first; `share` is the mean wait after the "
        "first over the step time.", "",
        markdown_table(["prefetch depth", "first batch wait (ms)", "later waits, mean (ms)",
                        "largest later wait (ms)", "step (ms)", "wall per step (ms)",
                        "share"], share), "",
        f"Assembling one batch alone (`effijax.data.batch_at`, no device copy): {assembly_ms} "
        "ms."]))]
    if not step_only:
        base = rates[-1][3]
        sections.insert(0, ("Data at scale", "\n".join([
            machine, "",
            f"Prepare throughput, SmolLM2's tokenizer, {args.prepare_mb} MiB of the standard "
            "library's source as a Parquet file; each side twice, alternating, from nothing; "
            "its best time (the default shards: "
            f"{_prepare_shards(work / 'docs.parquet')}):", "",
            markdown_table(["", "tokens", "seconds", "tokens/s", "vs datasets"],
                           [[*r, f"{r[3] / base:.2f}x"] for r in rates]), "",
            f"2 processes / 1 process: {rates[1][3] / rates[0][3]:.2f}x.", "",
            "Opening a store and drawing batches in a fresh process (the `mini` GPT's batch "
            "16 x 256):", "",
            markdown_table(["store", "MiB", "open + first batch (s)", "peak RSS (MB)",
                            "of which private (RssAnon)", "mapped files (RssFile)"],
                           [[name, mb, f"{opened[name]['first_batch_s']:.3f}",
                             *(f"{opened[name][k]:.0f}" for k in ("VmHWM", "RssAnon",
                                                                   "RssFile"))]
                            for name, mb in (("small", args.small_mb),
                                             ("large", args.large_mb))]), "",
            "Peak RSS counts the store's pages while they are mapped (2 MiB at a time where the "
            "kernel caches the file in large folios); each batch unmaps what it read "
            "(`effijax.data.release_pages`), so the peak is one batch's pages, whatever the "
            "store's size.", "",
            "The data time per step: its own section, 'Data time per step'."])))
    for name, body in sections:
        publish(name, body, command=command_line(__file__, argv), write=args.write)


if __name__ == "__main__":
    main()
