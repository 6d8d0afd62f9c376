"""Tests for effijax.checkpoint: round trips, every/keep, async, finiteness, metadata, restore
onto other meshes and strategies, resume pre-flight, failed saves, adapter checkpoints and the
metrics truncation of exact resume.

All on the 8 CPU devices forced by conftest. The model is a hand-written 3-layer MLP (as in
tests/test_sharding.py) trained with effijax.step.make_optimizer: AdamW with clipping, a cosine
schedule and dynamic loss scaling, so the state holds f32, int32 and bool leaves and a typed key.
"""

import errno
import gc
import json
import os
import sys
import time
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _damage import truncate_largest_array_file

from effijax.checkpoint import (
    FORMAT_VERSION,
    Checkpointer,
    SaveResult,
    base_reference,
    open_checkpoints,
    restore_adapters_checkpoint,
    restore_newest,
    restore_target,
    save_adapters_checkpoint,
    truncate_metrics,
    validate_resume,
)
from effijax.errors import ConfigError
from effijax.paths import named_leaves
from effijax.run import RunDir, read_metrics
from effijax.sharding import (
    constrain_batch,
    constraints,
    init_sharded,
    jit_sharded,
    make_mesh,
    partition_specs,
    replicated,
    state_shardings,
)
from effijax.step import init_train_state, make_optimizer, make_train_step

RTOL, ATOL = 1e-5, 1e-6  # one step on another mesh reorders reductions (see test_sharding)


def optimizer():
    return make_optimizer(3e-2, 100, warmup_steps=2, weight_decay=0.1, loss_scale="dynamic")


def init_params(key, width=64):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "w1": jax.random.normal(k1, (16, width), jnp.float32) / 4.0,
        "b1": jnp.zeros((width,), jnp.float32),
        "w2": jax.random.normal(k2, (width, 32), jnp.float32) / 8.0,
        "b2": jnp.zeros((32,), jnp.float32),
        "w3": jax.random.normal(k3, (32, 8), jnp.float32) / 6.0,
    }


def init_state(key):
    return init_train_state(init_params(key), optimizer(), key)


def loss_fn(p, batch, rng):
    dt = p["w1"].dtype
    h = constrain_batch(jnp.tanh(batch["x"].astype(dt) @ p["w1"] + p["b1"]))
    # Dropout-like use of the step key, so the key matters for the result.
    keep = jax.random.bernoulli(rng, 0.9, h.shape)
    h = jnp.where(keep, h, jnp.zeros_like(h))
    h = constrain_batch(jnp.tanh(h @ p["w2"] + p["b2"]))
    y = constrain_batch(h @ p["w3"])
    return jnp.mean(jnp.square(y.astype(jnp.float32) - batch["y"]))


def batch(i, size=16):
    rng = np.random.default_rng(i)
    x = rng.normal(size=(size, 16)).astype(np.float32)
    return {"x": x, "y": np.tanh(x[:, :8]).astype(np.float32)}


def sharded_run(mesh, strategy):
    """(step function, shardings) of the MLP on ``mesh`` under ``strategy``."""
    abstract = jax.eval_shape(init_state, jax.random.key(0))
    sh = state_shardings(abstract, mesh, strategy, min_shard_size=0)
    cp, cg = constraints(mesh, strategy, partition_specs(abstract.params, mesh, min_shard_size=0))
    step = make_train_step(loss_fn, optimizer(), "fp32", constrain_params=cp, constrain_grads=cg)
    return jit_sharded(step, mesh, sh, donate=False), sh


@pytest.fixture(scope="module")
def fsdp8():
    """A state trained 3 steps with fsdp on 8 devices, and its step function."""
    mesh = make_mesh()
    state, sh = init_sharded(init_state, jax.random.key(0), mesh=mesh, strategy="fsdp",
                             min_shard_size=0)
    step, _ = sharded_run(mesh, "fsdp")
    for i in range(3):
        state, _ = step(state, batch(i))
    return state, sh, step


def host(tree):
    """Every leaf as numpy (typed keys as their key data), for bitwise comparison."""
    return jax.tree.map(
        lambda x: np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
            x.dtype, jax.dtypes.prng_key) else x), tree)


def abstract_of(state):
    return jax.eval_shape(lambda: state)


def committed(directory):
    return sorted(int(p.name) for p in Path(directory).iterdir() if p.name.isdigit())


# --------------------------------------------------------------------------------------------
# Round trip, every/keep, async, finiteness, metadata.
# --------------------------------------------------------------------------------------------


def test_round_trip_is_bitwise_and_keeps_dtypes_and_typed_key(fsdp8, tmp_path):
    state, sh, _ = fsdp8
    with open_checkpoints(tmp_path, every=1) as ckpt:
        assert ckpt.save(state) == SaveResult(3, True, "saved")
        ckpt.wait()
        restored = ckpt.restore(target_state_abstract=restore_target(abstract_of(state), sh))
    chex.assert_trees_all_equal(host(restored), host(state))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    assert jax.dtypes.issubdtype(restored.rng.dtype, jax.dtypes.prng_key)
    assert str(jax.random.key_impl(restored.rng)) == str(jax.random.key_impl(state.rng))
    dtypes = {str(leaf.dtype) for _, leaf in named_leaves(restored)}
    assert {"float32", "int32", "bool"} <= dtypes
    for (path, a), (_, b) in zip(named_leaves(restored), named_leaves(state), strict=True):
        assert a.dtype == b.dtype and a.sharding == b.sharding, path


def test_every_k_and_keep_n(fsdp8, tmp_path):
    state = fsdp8[0]
    with open_checkpoints(tmp_path, every=2, keep=2) as ckpt:
        reasons = [ckpt.save(state._replace(step=jnp.int32(s))).reason for s in range(1, 8)]
        assert reasons == ["not_due", "saved", "not_due", "saved", "not_due", "saved", "not_due"]
        assert ckpt.save(state._replace(step=jnp.int32(7)), force=True).saved
        assert ckpt.save(state._replace(step=jnp.int32(7)), force=True).reason == "exists"
        ckpt.wait()
        assert ckpt.all_steps() == [6, 7] and ckpt.latest_step() == 7
    assert committed(tmp_path) == [6, 7]
    with pytest.raises(ConfigError, match="every"):
        open_checkpoints(tmp_path, every=0)
    with pytest.raises(ConfigError, match="keep"):
        open_checkpoints(tmp_path, keep=0)


def test_async_save_returns_then_wait_commits(fsdp8, tmp_path):
    state = fsdp8[0]
    ckpt = open_checkpoints(tmp_path, every=1, async_save=True)
    assert ckpt.save(state).saved
    ckpt.wait()  # after wait the step is committed: renamed from its temporary directory
    assert committed(tmp_path) == [3]
    assert not [p for p in tmp_path.iterdir() if "tmp" in p.name]
    assert (tmp_path / "3" / "commit_success.txt").exists() or (tmp_path / "3" / "state").is_dir()
    ckpt.close()
    ckpt.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        ckpt.save(state)


@pytest.mark.parametrize("where", ["params", "opt_state"])
def test_non_finite_state_is_not_written(fsdp8, tmp_path, where):
    state = fsdp8[0]
    if where == "params":
        bad = state._replace(params={**state.params, "b2": state.params["b2"].at[3].set(jnp.nan)})
    else:
        bad = state._replace(opt_state=jax.tree.map(
            lambda x: x * jnp.inf if x.shape == (32, 8) else x, state.opt_state))
    with open_checkpoints(tmp_path, every=1) as ckpt:
        assert ckpt.save(bad) == SaveResult(3, False, "non_finite")
        assert ckpt.save(bad, force=True).reason == "non_finite"
        ckpt.wait()
        assert ckpt.latest_step() is None
    assert committed(tmp_path) == []


def test_metadata_round_trip(fsdp8, tmp_path):
    state = fsdp8[0]
    config = {"model": "mlp", "lr": 3e-2, "steps": [1, 2], "nested": {"policy": "fp32"},
              "out": tmp_path, "dtype": jnp.float32}
    with open_checkpoints(tmp_path, metadata=config) as ckpt:
        ckpt.save(state)
    record = Checkpointer(tmp_path).metadata()  # a fresh reader of the same directory
    assert record["step"] == 3 and record["format"] == FORMAT_VERSION == 2
    assert record["state_bytes"] == sum(x.nbytes for x in jax.tree.leaves(
        jax.tree.map(lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(
            x.dtype, jax.dtypes.prng_key) else x, state)))
    assert record["metadata"]["nested"] == {"policy": "fp32"}
    assert record["metadata"]["lr"] == 3e-2 and record["metadata"]["steps"] == [1, 2]
    assert record["metadata"]["out"] == str(tmp_path)  # non-JSON values stored as str()
    assert record["versions"]["jax"] == jax.__version__ and "orbax-checkpoint" in record["versions"]
    assert record["prng_keys"] == {"rng": "threefry2x32"}
    step_file = json.loads((tmp_path / "3" / "_CHECKPOINT_METADATA").read_text())
    assert "lr" in json.dumps(step_file)  # plain JSON on disk
    with pytest.raises(ConfigError, match="metadata"):
        open_checkpoints(tmp_path, metadata=["not", "a", "dict"])


# --------------------------------------------------------------------------------------------
# Restore onto other meshes and strategies.
# --------------------------------------------------------------------------------------------


def assert_laid_out_as(state, target):
    for (path, leaf), (_, t) in zip(named_leaves(state), named_leaves(target), strict=True):
        assert leaf.sharding == t.sharding, (path, leaf.sharding, t.sharding)
        assert leaf.shape == t.shape and leaf.dtype == t.dtype, path


def test_a_damaged_step_is_skipped_quietly_naming_the_file_and_the_fault(tmp_path, monkeypatch):
    # orbax closes its event loop as soon as one read fails, leaving the other reads pending:
    # without effijax.checkpoint._orphans each printed "Exception ignored ..." (a coroutine
    # raising when collected, or a finished read calling the closed loop), dozens per step.
    keys = jax.random.split(jax.random.key(0), 6)
    params = {f"w{i}": jax.random.normal(k, (16, 64)) for i, k in enumerate(keys)}
    state = init_train_state(params, optax.adam(1e-3), 0)
    with open_checkpoints(tmp_path, keep=None) as ckpt:
        for s in (1, 2):
            ckpt.save(state._replace(step=jnp.int32(s)))
    truncate_largest_array_file(tmp_path / "2")
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    target = restore_target(abstract_of(state), replicated(make_mesh()))
    for _ in range(5):  # whether reads are still pending when one fails is a race: retry it
        found = restore_newest(tmp_path, target_state_abstract=target)
        assert found.step == 1 and int(found.state.step) == 1
    (step, reason), = found.bad
    # TensorStore's own error, not orbax's wrapper (whose last line ends a spec dump).
    assert step == 2 and reason.startswith("ValueError: OUT_OF_RANGE: Error reading "), reason
    assert "is not valid for value of size" in reason, reason
    # Reads still in flight finish on TensorStore's threads; then what they left reports itself
    # when collected. Two full collections, not one every 50 ms: in a pytest worker that has
    # run many tests each takes up to seconds (this test took 45 s in the full suite; after
    # three compile-heavy modules in one process, 12.1 s with twenty collections, 3.4 s with two).
    time.sleep(1.0)
    gc.collect()
    gc.collect()
    assert unraisable == [], [repr(u.exc_value)[:200] for u in unraisable]


def test_restore_8_to_4_to_2_to_1_devices_and_continue(fsdp8, tmp_path):
    state, _, step8 = fsdp8
    expected = host(state)
    reference, _ = step8(state, batch(3))  # the next step, on the original mesh
    abstract = jax.eval_shape(init_state, jax.random.key(0))
    directory = tmp_path / "8"
    with open_checkpoints(directory) as ckpt:
        ckpt.save(state)
    for n in (4, 2, 1):
        mesh = make_mesh(devices=jax.devices()[:n])
        step, sh = sharded_run(mesh, "fsdp")
        target = restore_target(abstract, sh)
        with open_checkpoints(directory) as ckpt:
            restored = ckpt.restore(target_state_abstract=target)
        assert_laid_out_as(restored, target)
        if n > 1:
            assert restored.params["w2"].sharding.spec == jax.sharding.PartitionSpec("fsdp")
            assert restored.params["w2"].addressable_shards[0].data.shape == (64 // n, 32)
        chex.assert_trees_all_equal(host(restored), expected)
        # Training continues on the new mesh: one step matches the 8-device run's next step.
        nxt, metrics = step(restored, batch(3))
        assert int(nxt.step) == 4 and np.isfinite(float(metrics["loss"]))
        assert_laid_out_as(nxt, target)
        chex.assert_trees_all_close(host(nxt.params), host(reference.params), rtol=RTOL,
                                    atol=ATOL)
        # ... and the state saved from this mesh is the next hop's source.
        directory = tmp_path / str(n)
        with open_checkpoints(directory) as ckpt:
            ckpt.save(restored)


def test_restore_fsdp_as_ddp(fsdp8, tmp_path):
    state, _, _ = fsdp8
    with open_checkpoints(tmp_path) as ckpt:
        ckpt.save(state)
    mesh = make_mesh()
    step, sh = sharded_run(mesh, "ddp")
    target = restore_target(jax.eval_shape(init_state, jax.random.key(0)), sh)
    with open_checkpoints(tmp_path) as ckpt:
        restored = ckpt.restore(target_state_abstract=target)
    assert_laid_out_as(restored, target)
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(restored))
    chex.assert_trees_all_equal(host(restored), host(state))
    nxt, _ = step(restored, batch(3))
    assert int(nxt.step) == 4
    assert_laid_out_as(nxt, target)


def test_restore_target_puts_a_sharding_on_every_leaf(fsdp8, tmp_path):
    state, sh, _ = fsdp8
    abstract = jax.eval_shape(init_state, jax.random.key(0))
    target = restore_target(abstract, sh)
    assert all(leaf.sharding is not None for leaf in jax.tree.leaves(target))
    assert target.step.shape == () and target.step.sharding.spec == jax.sharding.PartitionSpec()
    assert jax.dtypes.issubdtype(target.rng.dtype, jax.dtypes.prng_key)
    one = restore_target(abstract, replicated(make_mesh()))
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(one))
    with open_checkpoints(tmp_path) as ckpt:
        ckpt.save(state)
        # A target without shardings would put scalars on one device: refused up front.
        with pytest.raises(ConfigError, match="no sharding.*restore_target"):
            ckpt.restore(target_state_abstract=abstract)
        with pytest.raises(FileNotFoundError, match="step 99"):
            ckpt.restore(99, target_state_abstract=target)
    with pytest.raises(ConfigError, match="shardings"):
        restore_target(abstract, {"not": "matching"})
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        open_checkpoints(tmp_path / "empty").restore(target_state_abstract=target)


# --------------------------------------------------------------------------------------------
# Resume pre-flight.
# --------------------------------------------------------------------------------------------


def test_validate_resume(fsdp8, tmp_path):
    state = fsdp8[0]
    abstract = jax.eval_shape(init_state, jax.random.key(0))
    assert validate_resume(tmp_path / "missing", abstract) is None
    assert validate_resume(tmp_path, abstract) is None  # exists, no checkpoint yet
    with open_checkpoints(tmp_path / "run") as ckpt:
        ckpt.save(state)
    assert validate_resume(tmp_path / "run", abstract) == 3

    wider = jax.eval_shape(lambda k: init_train_state(init_params(k, 128), optimizer(), k),
                           jax.random.key(0))
    with pytest.raises(ConfigError) as e:
        validate_resume(tmp_path / "run", wider)
    msg = str(e.value)
    assert "'params/b1'" in msg and "float32[64]" in msg and "float32[128]" in msg
    assert "use a fresh --out or the same --model" in msg

    bf16 = jax.eval_shape(lambda k: init_train_state(
        jax.tree.map(lambda x: x.astype(jnp.bfloat16), init_params(k)), optimizer(), k),
        jax.random.key(0))
    with pytest.raises(ConfigError, match=r"'params/b1' as float32\[64\].*bfloat16\[64\]"):
        validate_resume(tmp_path / "run", bf16)

    other_optimizer = jax.eval_shape(lambda k: init_train_state(init_params(k),
                                                                optax.sgd(0.1), k),
                                     jax.random.key(0))
    with pytest.raises(ConfigError, match="tree structure differs"):
        validate_resume(tmp_path / "run", other_optimizer)

    extra = jax.eval_shape(lambda k: init_train_state({**init_params(k), "w4": jnp.ones(3)},
                                                      optimizer(), k), jax.random.key(0))
    with pytest.raises(ConfigError, match="no leaf 'opt_state/.*w4'|no leaf 'params/w4'"):
        validate_resume(tmp_path / "run", extra)

    # restore() runs the same check before touching the arrays.
    mesh = make_mesh()
    with open_checkpoints(tmp_path / "run") as ckpt, pytest.raises(ConfigError, match="b1"):
        ckpt.restore(target_state_abstract=restore_target(wider, replicated(mesh)))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        validate_resume(tmp_path / "file", abstract)


# --------------------------------------------------------------------------------------------
# Failed saves surface as exceptions.
# --------------------------------------------------------------------------------------------


def test_unwritable_directory_raises(fsdp8, tmp_path):
    (tmp_path / "file").write_text("a regular file")  # we run as root: chmod would not stop us
    with pytest.raises(OSError) as e:
        open_checkpoints(tmp_path / "file" / "ckpt")
    assert any("could not open checkpoint directory" in n for n in e.value.__notes__)
    # The directory vanishes under a running Checkpointer: save itself raises.
    for async_save in (True, False):
        d = tmp_path / f"gone-{async_save}"
        ckpt = open_checkpoints(d, async_save=async_save)
        d.rmdir()
        d.write_text("now a file")
        with pytest.raises(OSError) as e:
            ckpt.save(fsdp8[0])
        assert any("saving step 3" in n for n in e.value.__notes__)
        ckpt.close()


@pytest.fixture
def failing_commit(monkeypatch):
    """Makes orbax's background write fail as a full disk would: the array files are written,
    the commit (the rename of the temporary directory) never happens."""
    from orbax.checkpoint._src.checkpointers import async_checkpointer

    real = async_checkpointer._background_wait_for_commit_futures

    def fail(directory, commit_futures, on_commit_callback, **kwargs):
        real(directory, commit_futures, lambda: None, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(async_checkpointer, "_background_wait_for_commit_futures", fail)


def test_async_write_failure_surfaces_from_wait(fsdp8, tmp_path, failing_commit):
    state = fsdp8[0]
    ckpt = open_checkpoints(tmp_path)
    assert ckpt.save(state).saved  # the write is in the background
    with pytest.raises(OSError, match="No space left") as e:
        ckpt.wait()
    assert any("the asynchronous write of step 3 to" in n for n in e.value.__notes__)
    assert committed(tmp_path) == []  # nothing was committed
    ckpt.close()


def test_async_write_failure_surfaces_from_next_save_and_close(fsdp8, tmp_path,
                                                               failing_commit):
    state = fsdp8[0]
    ckpt = open_checkpoints(tmp_path)
    ckpt.save(state)
    with pytest.raises(OSError, match="No space left"):
        ckpt.save(state._replace(step=jnp.int32(4)))
    ckpt2 = open_checkpoints(tmp_path / "b")
    ckpt2.save(state)
    with pytest.raises(OSError, match="No space left"):
        ckpt2.close()
    assert committed(tmp_path / "b") == []
    with pytest.raises(OSError, match="No space left"), open_checkpoints(tmp_path / "c") as c:
        c.save(state)


# --------------------------------------------------------------------------------------------
# Adapter-only checkpoints.
# --------------------------------------------------------------------------------------------


def test_adapter_checkpoint_round_trip_and_base_mismatch(tmp_path):
    base = {"w": jax.random.normal(jax.random.key(1), (256, 256))}  # 256 KiB, never copied
    adapters = {"w": {"a": jax.random.normal(jax.random.key(2), (256, 2)) * 0.01,
                      "b": jnp.zeros((2, 256))}}
    def adapter_loss(p, b, rng):
        del rng
        w = base["w"] + p["w"]["a"] @ p["w"]["b"]
        return jnp.mean(jnp.square(b @ w))

    # The "params" of a LoRA TrainState are just the adapters (the base is closed over).
    state = init_train_state(adapters, optimizer(), 0)
    step = jax.jit(make_train_step(adapter_loss, optimizer()))
    state, _ = step(state, jnp.ones((4, 256)))
    ref = base_reference("runs/base", base)
    assert save_adapters_checkpoint(tmp_path, 1, state, base_reference=ref,
                                    metadata={"rank": 2}).saved
    size = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    assert size < 256 * 256 * 4 / 4, size  # adapters + Adam moments, not the base

    # A fresh base loaded from the same place: same bytes, same fingerprint.
    fresh = {"w": jax.random.normal(jax.random.key(1), (256, 256))}
    target = restore_target(abstract_of(state), replicated(make_mesh()))
    restored = restore_adapters_checkpoint(
        tmp_path, target_state_abstract=target,
        base_reference=base_reference("/moved/base", fresh))
    chex.assert_trees_all_equal(host(restored), host(state))
    assert Checkpointer(tmp_path).metadata()["base_reference"] == ref

    other = {"w": jax.random.normal(jax.random.key(3), (256, 256))}
    with pytest.raises(ConfigError) as e:
        restore_adapters_checkpoint(tmp_path, target_state_abstract=target,
                                    base_reference=base_reference("runs/other", other))
    msg = str(e.value)
    assert "runs/base" in msg and ref["fingerprint"] in msg and "trained on the base" in msg
    with pytest.raises(ConfigError, match="base_reference"):
        save_adapters_checkpoint(tmp_path, 2, state, base_reference={"path": "x"})
    # An ordinary checkpoint is not an adapter checkpoint.
    with open_checkpoints(tmp_path / "full") as ckpt:
        ckpt.save(state)
    with pytest.raises(ConfigError, match="no base reference"):
        restore_adapters_checkpoint(tmp_path / "full", target_state_abstract=target,
                                    base_reference=ref)


# --------------------------------------------------------------------------------------------
# Exact resume: the metrics log.
# --------------------------------------------------------------------------------------------


def test_truncate_metrics(tmp_path):
    run = RunDir(tmp_path, config={"lr": 1.0})
    for s in range(1, 7):
        run.log({"step": s, "loss": 1.0 / s})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')  # the kill cut this write short
    assert truncate_metrics(tmp_path, 4) == 3
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    assert [p.name for p in tmp_path.iterdir() if "tmp" in p.name] == []
    assert truncate_metrics(tmp_path / "metrics.jsonl", 4) == 0  # idempotent
    RunDir(tmp_path, config={}, append=True).log({"step": 5, "loss": 0.2})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    assert truncate_metrics(tmp_path / "nothing", 3) == 0
    # A damaged line elsewhere is said and dropped: the log is rebuilt up to the step.
    (tmp_path / "bad.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    said = []
    assert truncate_metrics(tmp_path / "bad.jsonl", 1, report=said.append) == 2
    assert len(said) == 1 and "line 2 is not a metrics record" in said[0], said
    assert read_metrics(tmp_path / "bad.jsonl") == [{"step": 1}]
    assert os.path.exists(tmp_path / "bad.jsonl")


def test_truncate_metrics_says_which_steps_are_lost_and_puts_the_rest_in_order(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [f'{{"step": {s}, "loss": {1.0 / s}}}\n' for s in (6, 2, 1, 2, 9, 4, 7)]
    path.write_text("".join(lines))
    said = []
    # Steps 7 and 9 are past the checkpoint, step 2 is recorded twice: three dropped.
    assert truncate_metrics(path, 6, report=said.append) == 3
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 4, 6]
    assert said == [f"effijax: {path}: records out of step order; put them back in order",
                    f"effijax: {path}: holds no record of 2 of steps 1-6 (3, 5); the run's "
                    "whole-run numbers (summary.json, loss.png) leave them out, and "
                    "summary.json counts them as missing_metrics"]
    said.clear()
    assert truncate_metrics(path, 6, report=said.append) == 0  # in order now; 3, 5 still lost
    assert len(said) == 1 and "holds no record of 2 of steps 1-6 (3, 5)" in said[0]
    path.unlink()
    assert truncate_metrics(path, 4, report=said.append) == 0
    assert said[-1] == (f"effijax: {path}: missing, so the run's whole-run numbers "
                        "(summary.json, loss.png) leave out steps 1-4; summary.json counts them "
                        "as missing_metrics")
    said.clear()
    assert truncate_metrics(path, 0, report=said.append) == 0 and said == []  # nothing to lose


def test_the_whole_run_numbers_count_the_steps_without_records(tmp_path):
    from effijax.recipe._finish import _whole_run

    records = [{"step": s, "loss": float(s), "tokens": 10} for s in (5, 1, 2, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    whole = _whole_run(tmp_path, {"steps": 6, "start_step": 4})
    assert whole == {"final_loss": 3.5, "final_loss_steps": 4, "trained_tokens": 40,
                     "missing_metrics": 2}
    records += [{"step": s, "loss": float(s), "tokens": 10} for s in (3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "missing_metrics" not in _whole_run(tmp_path, {"steps": 6, "start_step": 4})


def test_read_params_needs_only_the_parameters_shapes(tmp_path):
    # Opening a run's model (effijax.sources.open_model) knows its model, not its optimizer:
    # the parameters come back whatever optimizer state sits beside them, and a model that does
    # not fit them is refused naming the leaf.
    from effijax.checkpoint import read_params

    params = {"w": jnp.arange(4.0), "b": {"x": jnp.ones((2, 3))}}
    state = init_train_state(params, make_optimizer(1e-3, 10, accumulate=2), 0)
    with open_checkpoints(tmp_path) as ckpt:
        assert ckpt.save(state).saved
    restored = read_params(tmp_path, params_abstract=jax.eval_shape(lambda: params))
    chex.assert_trees_all_equal(restored, params)
    with pytest.raises(ConfigError, match="'w'"):
        read_params(tmp_path, params_abstract={"w": jax.ShapeDtypeStruct((5,), jnp.float32),
                                               "b": {"x": jax.ShapeDtypeStruct((2, 3),
                                                                               jnp.float32)}})
