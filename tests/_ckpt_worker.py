"""Subprocess worker of tests/test_checkpoint_kill.py (run as a script; not a test module).

Modes:

* ``train``: trains a tiny MLP (bf16 compute, dropout from the per-step key, AdamW with dynamic
  loss scaling) to ``--steps``, checkpointing every ``--every`` steps asynchronously and logging
  ``metrics.jsonl``. If ``--dir`` holds a checkpoint it resumes from it (validate_resume, restore,
  truncate_metrics). At the end it writes every state leaf to ``--out`` (``.npz``).
* ``spam``: saves a few-MB state asynchronously, step after step, until it is killed; the values
  are a function of the step (:func:`spam_state`) so a restore can be checked exactly. Prints
  ``ready`` once the first checkpoint is committed.
* ``fail``: its background write fails (as on a full disk) and it never calls ``wait``: leaving
  the ``with`` block must raise, so the process exits non-zero.

Batches and keys are functions of ``(seed, step)``: a resumed run needs only the state.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# This checkout's package, installed or not (the worker runs as a script from tests/).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from effijax.checkpoint import (  # noqa: E402
    open_checkpoints,
    restore_target,
    truncate_metrics,
    validate_resume,
)
from effijax.run import RunDir  # noqa: E402
from effijax.sharding import make_mesh, replicated  # noqa: E402
from effijax.step import init_train_state, make_optimizer, make_train_step  # noqa: E402

SEED = 0
STEPS = 16


def init_params(key):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (32, 64), jnp.float32) / 6.0,
        "b1": jnp.zeros((64,), jnp.float32),
        "w2": jax.random.normal(k2, (64, 8), jnp.float32) / 8.0,
    }


def optimizer():
    return make_optimizer(1e-2, STEPS, warmup_steps=2, weight_decay=0.1, loss_scale="dynamic")


def init_state(key):
    return init_train_state(init_params(key), optimizer(), key)


def loss_fn(p, batch, rng):
    x = batch["x"].astype(p["w1"].dtype)  # p arrives in bf16
    h = jax.nn.gelu(x @ p["w1"] + p["b1"])
    keep = jax.random.bernoulli(rng, 0.8, h.shape)  # dropout from the per-step key
    h = jnp.where(keep, h / jnp.asarray(0.8, h.dtype), jnp.zeros_like(h))
    y = (h @ p["w2"]).astype(jnp.float32)
    return jnp.mean(jnp.square(y - batch["y"]))


def batch_at(step: int):
    rng = np.random.default_rng((SEED, step))
    x = rng.normal(size=(16, 32)).astype(np.float32)
    return {"x": x, "y": np.sin(x[:, :8]).astype(np.float32)}


def flat(state) -> dict[str, np.ndarray]:
    from effijax.paths import named_leaves

    out = {}
    for path, leaf in named_leaves(state):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[path] = np.asarray(leaf)
    return out


def train(args) -> None:
    mesh = make_mesh()
    abstract = jax.eval_shape(init_state, jax.random.key(SEED))
    target = restore_target(abstract, replicated(mesh))
    run = RunDir(args.run, config={"steps": args.steps}, append=True)
    start = validate_resume(args.dir, abstract)
    with open_checkpoints(args.dir, every=args.every, keep=3,
                          metadata={"seed": SEED, "steps": args.steps}) as ckpt:
        if start is None:
            state = jax.jit(init_state, out_shardings=target_shardings(target))(
                jax.random.key(SEED))
        else:
            state = ckpt.restore(start, target_state_abstract=target)
            truncate_metrics(run.path, start)
            print(f"resumed {start}", flush=True)
        step_fn = jax.jit(make_train_step(loss_fn, optimizer(), "bf16"), donate_argnums=0)
        while int(state.step) < args.steps:
            s = int(state.step)
            state, metrics = step_fn(state, batch_at(s))
            run.log({"step": s + 1, "loss": float(metrics["loss"]),
                     "loss_scale": float(metrics["loss_scale"])})
            ckpt.save(state)
            print(f"step {s + 1}", flush=True)
            time.sleep(args.step_sleep)
        ckpt.save(state, force=True)
    np.savez(args.out, **flat(state))


def target_shardings(target):
    return jax.tree.map(lambda leaf: leaf.sharding, target)


SPAM_SHAPES = {"a": (512, 512), "b": (256, 1024), "c": (1024,)}  # 0.75M floats: ~9 MB w/ Adam


def spam_state(step: int):
    """A TrainState whose every value is a function of ``step`` (Adam moments included)."""
    params = {k: (jnp.arange(np.prod(s), dtype=jnp.float32).reshape(s) * 1e-3
                  + jnp.float32(step)) for k, s in SPAM_SHAPES.items()}
    state = init_train_state(params, optax.adam(1e-3), jax.random.key(step))
    mu, nu = state.opt_state[0].mu, state.opt_state[0].nu
    opt = state.opt_state[0]._replace(
        count=jnp.int32(step),
        mu=jax.tree.map(lambda p, _: p * 0.5, params, mu),
        nu=jax.tree.map(lambda p, _: p * 0.25, params, nu))
    return state._replace(step=jnp.int32(step), opt_state=(opt,) + state.opt_state[1:])


def spam(args) -> None:
    with open_checkpoints(args.dir, every=1, keep=2) as ckpt:
        ckpt.save(spam_state(1))
        ckpt.wait()
        print("ready", flush=True)
        for step in range(2, 100_000):
            ckpt.save(spam_state(step))  # waits for the previous write, starts this one


def fail(args) -> None:
    from orbax.checkpoint._src.checkpointers import async_checkpointer

    real = async_checkpointer._background_wait_for_commit_futures

    def full_disk(directory, commit_futures, on_commit_callback, **kwargs):
        real(directory, commit_futures, lambda: None, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    async_checkpointer._background_wait_for_commit_futures = full_disk
    with open_checkpoints(args.dir) as ckpt:
        print(ckpt.save(spam_state(1)), flush=True)
    print("exited the with block without an error", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["train", "spam", "fail"])
    p.add_argument("--dir", required=True)
    p.add_argument("--run", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args(argv)
    {"train": train, "spam": spam, "fail": fail}[args.mode](args)


if __name__ == "__main__":
    main(sys.argv[1:])
