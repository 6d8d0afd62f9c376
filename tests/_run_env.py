"""``run_env(root)``: what the tests that run ``effijax train`` in subprocesses and interrupt
them share: a small corpus, and an environment in which this checkout's package comes first and
the runs share one JAX compilation cache (each later run skips XLA: minutes on 2 cores).
``compilation_cache(directory)``: those cache variables alone, for tests that build their own
environment."""

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def compilation_cache(directory) -> dict[str, str]:
    """The variables under which subprocesses share JAX's persistent compilation cache in
    ``directory``: every program is cached, however small or quick to compile, and a later
    process loads what an earlier one compiled. (The collective census of a multi-device step
    keeps its partitioned module beside the cache, so a later process skips XLA for it too.)"""
    return {"JAX_COMPILATION_CACHE_DIR": str(directory),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def run_env(root: pathlib.Path) -> dict:
    """``{"root", "corpus", "env"}`` for subprocess runs under ``root``."""
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + 1\n" for i in range(300)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
           **compilation_cache(root / "jax-cache")}
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return {"root": root, "corpus": str(corpus), "env": env}
