"""``run_env(root)``: what the tests that run ``effijax train`` in subprocesses and interrupt
them share: a small corpus, and an environment in which this checkout's package comes first and
the runs share one JAX compilation cache (each later run skips XLA: minutes on 2 cores).
``compilation_cache(directory)``: those cache variables alone, for tests that build their own
environment. ``compiles_as_the_suite(env)``: an environment's ``XLA_FLAGS`` as the suite's
processes compile (every helper here applies it)."""

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


# How the suite compiles at XLA's lowest optimisation (JAX_DISABLE_MOST_OPTIMIZATIONS,
# tests/conftest.py): XLA:CPU's legacy fusion emitters, which compile the suite's programs
# several times quicker than its new ones (measured over the tiny Llama's and GPT's train steps:
# 3-10 s against 19-34 s, the same four programs), and LLVM's code generated as one module rather
# than split for threads that two busy workers do not have (split into 32 parts, the compiles of
# four test modules took 91 and 111 s against 80 and 84 s in one part, interleaved on a loaded
# 2-core host). Neither changes what a program computes beyond the emitters' fusion order.
SUITE_XLA_OPTIONS = {"xla_cpu_use_fusion_emitters": False,
                     "xla_cpu_parallel_codegen_split_count": 1}
# What a process the suite starts adds to XLA_FLAGS where it compiles as the suite does.
SUITE_XLA_FLAGS = " ".join(f"--{k}={str(v).lower()}" for k, v in SUITE_XLA_OPTIONS.items())


def compiles_as_the_suite(env: dict) -> dict:
    """``env`` with ``XLA_FLAGS`` as a process the suite starts gets it: the machine's own never
    (a developer's device count or dump flags would change what the process computes), the
    suite's where ``env`` compiles at XLA's lowest optimisation, none where it compiles as a
    user's run does.

    Example:
      >>> env = compiles_as_the_suite({"XLA_FLAGS": "--x", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"})
      >>> env["XLA_FLAGS"].split()
      ['--xla_cpu_use_fusion_emitters=false', '--xla_cpu_parallel_codegen_split_count=1']
      >>> compiles_as_the_suite({"XLA_FLAGS": "--x"})
      {}
    """
    env = {k: v for k, v in env.items() if k != "XLA_FLAGS"}
    if env.get("JAX_DISABLE_MOST_OPTIMIZATIONS") == "1":
        env["XLA_FLAGS"] = SUITE_XLA_FLAGS
    return env


def run_env(root: pathlib.Path) -> dict:
    """``{"root", "corpus", "env"}`` for subprocess runs under ``root``."""
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + 1\n" for i in range(300)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
           **compilation_cache(root / "jax-cache")}
    env = compiles_as_the_suite(env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return {"root": root, "corpus": str(corpus), "env": env}
