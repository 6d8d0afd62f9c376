"""Writes the golden checkpoints that guard effijax's checkpoint format.

Two states of a tiny model, each after one training step so that every optimizer leaf holds
non-trivial values: a full TrainState (f32 and bf16 parameters, AdamW moments, a dynamic loss
scale, an accumulation counter, a typed PRNG key) and a LoRA state (rank-2 adapters of the same
kernels, with their optimizer state). Each is written with ``effijax.checkpoint`` to
``OUT/format-<N>/<name>/`` (N: the writing library's FORMAT_VERSION) beside ``<name>.npz``,
every leaf's exact value (PRNG keys as key data) under its '/'-joined path.

tests/test_golden_checkpoints.py restores every committed format with today's code and compares
each leaf bit for bit. format-1 was written by this script at the commit before the format-2
change (FORMAT_VERSION 1), format-2 by the current one::

    python tests/golden/make_golden.py            # writes tests/golden/format-<current>/
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from effijax import lora  # noqa: E402
from effijax.checkpoint import FORMAT_VERSION, open_checkpoints  # noqa: E402
from effijax.paths import named_leaves  # noqa: E402
from effijax.step import init_train_state, make_optimizer, make_train_step  # noqa: E402

HERE = Path(__file__).resolve().parent
SPEC = lora.LoraSpec(rank=2, alpha=4.0, targets=r"kernel$")


def params():
    """The tiny model: an embedding, two kernels and a bf16 norm scale."""
    k = jax.random.split(jax.random.key(11), 3)
    return {"embed": jax.random.normal(k[0], (16, 8), jnp.float32),
            "block": {"attn": {"kernel": jax.random.normal(k[1], (8, 12), jnp.float32)},
                      "mlp": {"kernel": jax.random.normal(k[2], (8, 16), jnp.float32)},
                      "norm": {"scale": jnp.ones((8,), jnp.bfloat16)}}}


def optimizer():
    return make_optimizer(1e-2, 10, warmup_steps=2, loss_scale="dynamic", accumulate=1)


def _loss(p, batch, rng):
    del rng
    return sum(jnp.sum(jnp.square(x.astype(jnp.float32) - batch)) for x in jax.tree.leaves(p))


def full_state():
    tx = optimizer()
    state = init_train_state(params(), tx, jax.random.key(5))
    state, _ = jax.jit(make_train_step(_loss, tx))(state, jnp.float32(0.5))
    return state


def lora_state():
    base = params()
    adapters = lora.init(jax.random.key(7), base, SPEC)
    adapters = jax.tree.map(lambda x: x + 0.25, adapters)  # b starts at zero: make it count
    tx = optimizer()
    state = init_train_state(adapters, tx, jax.random.key(9))
    state, _ = jax.jit(make_train_step(_loss, tx))(state, jnp.float32(0.5))
    return state


STATES = {"full": full_state, "lora": lora_state}


def host_values(state) -> dict[str, np.ndarray]:
    """Every leaf on the host under its path; typed PRNG keys as their key data."""
    out = {}
    for path, leaf in named_leaves(state):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[path] = np.asarray(leaf)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE))
    out = Path(parser.parse_args().out) / f"format-{FORMAT_VERSION}"
    for name, build in STATES.items():
        state = build()
        directory = out / name
        shutil.rmtree(directory, ignore_errors=True)
        with open_checkpoints(directory, every=1, keep=None, async_save=False,
                              metadata={"golden": name}) as ckpt:
            assert ckpt.save(state, force=True).saved
        values = host_values(state)
        # bf16 has no numpy dtype of its own in npz: store its bits, named so.
        stored = {(p + "#bf16bits" if v.dtype.name == "bfloat16" else p):
                  (v.view(np.uint16) if v.dtype.name == "bfloat16" else v)
                  for p, v in values.items()}
        np.savez(out / f"{name}.npz", **stored)
        size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
        print(f"{directory}: step {int(state.step)}, {len(values)} leaves, {size} bytes")


if __name__ == "__main__":
    main()
