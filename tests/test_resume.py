"""`effijax train` checkpoints: periodic saves, exact resume, SIGKILL/SIGTERM, pre-flight."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compiles import compiles

from effijax.checkpoint import open_checkpoints, restore_target
from effijax.cli import main
from effijax.run import NonFiniteError, train_loop
from effijax.step import init_train_state

TINY = ["--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1",
        "--no-progress"]
TIMING = ("tokens_per_s", "step_time_s")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(300)))
    return str(path)


def _metrics(out) -> list[dict]:
    records = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def _final_leaves(out) -> tuple[int, list[np.ndarray]]:
    """The latest checkpoint's step and every leaf (key data for PRNG keys) on the host."""
    directory = Path(out) / "checkpoints"
    with open_checkpoints(directory, every=1, keep=None) as ckpt:
        step = ckpt.latest_step()
        saved = ckpt.metadata(step)["metadata"]["config"]
    # The target: the same job's abstract state on one device.
    from effijax.models import model_from_dict
    from effijax.recipe import TrainConfig, abstract_state, optimizer_for

    s = TrainConfig.from_dict(saved).sections
    abstract = abstract_state(model_from_dict(saved["run"]["model_config"]), s.precision.precision,
                              optimizer_for(s.training, s.optimizer, s.precision),
                              seed=s.training.seed)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with open_checkpoints(directory, every=1, keep=None) as ckpt:
        state = ckpt.restore(step, target_state_abstract=restore_target(abstract, device))
    leaves = [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x) for x in jax.tree.leaves(state)]
    return step, leaves


def _assert_same_leaves(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_resume_continues_bit_for_bit(tmp_path, corpus, capsys):
    # One 10-step run checkpointing every 2 steps is the uninterrupted reference; dropping its
    # checkpoints past step 6 (and nothing else) makes its directory look like a run stopped
    # at 6 (metrics.jsonl of 10 steps is truncated by the resume). The schedule spans --steps,
    # so the interrupted run must have been started with the same --steps.
    out = tmp_path / "run"
    flags = ["--steps", "10", "--checkpoint-every", "2", "--keep", "10", "--data", corpus,
             "--out", str(out), *TINY]
    assert main(["train", *flags]) == 0
    reference_metrics = _metrics(out)
    assert [r["step"] for r in reference_metrics] == list(range(1, 11))
    ref_step, reference = _final_leaves(out)
    assert ref_step == 10
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()
                  if p.name.isdigit()) == [2, 4, 6, 8, 10]
    for step in (8, 10):
        shutil.rmtree(out / "checkpoints" / str(step))
    capsys.readouterr()

    assert main(["train", *flags]) == 0
    printed = capsys.readouterr().out
    assert "resuming from step 6" in printed, printed
    assert _metrics(out) == reference_metrics  # steps 1..10 exactly once, same numbers
    step, resumed = _final_leaves(out)
    assert step == 10
    _assert_same_leaves(resumed, reference)


def _spawn(out, corpus, steps, every, cache=None):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    if cache is not None:  # JAX's persistent compilation cache: later runs load, not compile
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return subprocess.Popen(
        [sys.executable, "-m", "effijax", "train", "--steps", str(steps), "--checkpoint-every",
         str(every), "--data", corpus, "--out", str(out), *TINY],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for_checkpoint(proc, out, timeout=240.0):
    directory = Path(out) / "checkpoints"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir()):
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended before a checkpoint: {proc.communicate()}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("no checkpoint appeared")


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted(tmp_path, corpus):
    steps = 40
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    # The resumed and the uninterrupted runs load the executables the killed run compiled; the
    # steps the killed run logged must still equal the uninterrupted run's exactly.
    cache = tmp_path / "jax-cache"
    proc = _spawn(killed, corpus, steps, 4, cache)
    _wait_for_checkpoint(proc, killed)
    proc.kill()
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    logged = _metrics(killed)
    assert len(logged) < steps, "the run finished before it was killed; make it longer"

    resumed = _spawn(killed, corpus, steps, 4, cache)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert "resuming from step" in out, out
    reference = _spawn(straight, corpus, steps, 4, cache)
    _, err = reference.communicate(timeout=300)
    assert reference.returncode == 0, err

    records = _metrics(killed)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert records == _metrics(straight)
    (s1, a), (s2, b) = _final_leaves(killed), _final_leaves(straight)
    assert s1 == s2 == steps
    _assert_same_leaves(a, b)


@pytest.mark.slow
def test_sigterm_saves_and_exits_zero(tmp_path, corpus):
    out = tmp_path / "run"
    proc = _spawn(out, corpus, 100_000, 3)
    _wait_for_checkpoint(proc, out)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    # The hint is the command itself, runnable as printed.
    hint = stdout.split("resume with: ")[1].splitlines()[0]
    assert shlex.split(hint) == ["effijax", "train", "--steps", "100000", "--checkpoint-every",
                                 "3", "--data", corpus, "--out", str(out), *TINY], stdout
    last = _metrics(out)[-1]["step"]
    assert f"stopped at step {last} by SIGTERM" in stdout
    with open_checkpoints(out / "checkpoints", every=1) as ckpt:
        assert ckpt.latest_step() == last


def test_checkpoint_every_zero_is_rejected(capsys, tmp_path):
    assert main(["train", "--checkpoint-every", "0", "--out", str(tmp_path)]) == 2
    assert "--checkpoint-every=0: must be an integer >= 1" in capsys.readouterr().err
    assert main(["train", "--keep", "0", "--out", str(tmp_path)]) == 2
    assert "--keep=0" in capsys.readouterr().err


def test_the_compile_listener_sees_a_compilation():
    with compiles() as compiled:
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0)).block_until_ready()
    assert len(compiled) >= 1, compiled


@pytest.mark.parametrize("change, shown", [
    (["--seq-len", "16"], "seq_len 32 -> 16 (must match the checkpointed run)"),
    (["--model", "mini"], "model {d_model=64, n_layers=2} -> {d_model=128, n_layers=4} (must "
     "match the checkpointed run)")])
def test_resume_with_another_model_fails_fast(tmp_path, corpus, capsys, change, shown):
    out = tmp_path / "run"
    flags = ["--steps", "2", "--checkpoint-every", "2", "--data", corpus, "--out", str(out)]
    assert main(["train", *flags, *TINY]) == 0
    assert (out / "checkpoints" / "2").is_dir()
    capsys.readouterr()
    other = [*TINY]
    i = other.index(change[0])
    other[i + 1] = change[1]
    longer = [*flags]
    longer[1] = "4"  # an unfinished run: it resumes, so its checkpoint is checked
    with compiles() as compiled:
        assert main(["train", *longer, *other]) == 2
    err = capsys.readouterr().err
    # The settings are compared before the arrays' shapes: every difference is named, not
    # the first parameter whose shape it changed.
    assert "effijax train: error: resume=" in err and shown in err, err
    # Fast means refused before XLA compiles anything (a wall-clock bound flaked under load).
    assert compiled == [], compiled


def test_failed_save_raises_and_non_finite_is_a_warning(tmp_path, corpus, capsys, monkeypatch):
    from effijax.checkpoint import Checkpointer, SaveResult

    def refuse(self, state, *, force=False, step=None, extra=None):
        return SaveResult(int(state.step), False, "non_finite")

    monkeypatch.setattr(Checkpointer, "save", refuse)
    flags = ["--steps", "2", "--checkpoint-every", "1", "--data", corpus, *TINY]
    assert main(["train", *flags, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "step 1 has non-finite" in err and "step 2 has non-finite" in err, err

    def fail(self, state, *, force=False, step=None, extra=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Checkpointer, "save", fail)
    capsys.readouterr()
    assert main(["train", *flags, "--out", str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    log = tmp_path / "b" / "error.log"
    assert err == [f"effijax train: error: saving the checkpoint of step 1 to "
                   f"{(tmp_path / 'b' / 'checkpoints').resolve()} failed: [Errno 28] No space "
                   f"left on device (traceback in {log})"], err
    assert "Traceback (most recent call last)" in log.read_text()
    assert "OSError: [Errno 28] No space left on device" in log.read_text()
    # Every record of the steps that ran is whole, and the lock was released.
    assert [r["step"] for r in _metrics(tmp_path / "b")] == [1]
    from effijax.checkpoint import lock_run_dir

    lock_run_dir(tmp_path / "b").release()


def test_consecutive_non_finite_steps_stop_the_run_naming_the_last_good_checkpoint(
        tmp_path, corpus, capsys):
    # fp32, no loss scale: a learning rate of 1e30 makes step 2's loss NaN, and every step after.
    out = tmp_path / "run"
    args = ["train", "--steps", "30", "--lr", "1e30", "--warmup", "0", "--checkpoint-every",
            "1", "--data", corpus, "--out", str(out), *TINY]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "steps 2..4: 3 consecutive steps with a non-finite loss" in err, err
    assert f"the last good checkpoint is step 1 in {out / 'checkpoints'}" in err, err
    # The advice names flags with values for this run.
    assert ("Lower the learning rate (--lr 1e+29), clip harder (--clip 0.25), or skip such "
            "steps with a loss scale (--loss-scale dynamic)") in err, err
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3, 4]  # stopped at the third
    with open_checkpoints(out / "checkpoints", every=1) as ckpt:
        assert ckpt.all_steps() == [1]  # the non-finite states were never written
    assert main([*args[:-len(TINY)], "--max-non-finite", "5", *TINY, "--out",
                 str(tmp_path / "five")]) == 1
    assert "steps 2..6: 5 consecutive" in capsys.readouterr().err
    assert main(["train", "--max-non-finite", "-1", "--out", str(tmp_path)]) == 2
    assert "--max-non-finite=-1: must be an integer >= 0" in capsys.readouterr().err


def _fake_step(losses, skipped):
    """A 'step' that replays given losses (and skip flags) as its metrics."""
    def step(state, batch):
        i = int(state.step)
        return state._replace(step=state.step + 1), {
            "loss": jnp.float32(losses[i]), "skipped": jnp.bool_(skipped[i]),
            "grads_finite": jnp.bool_(np.isfinite(losses[i]))}
    return step


def test_train_loop_counts_only_applied_non_finite_steps():
    state = init_train_state({"w": jnp.zeros(2)}, optax.sgd(0.1), 0)
    nan = float("nan")
    losses = [1.0, nan, 1.0, nan, nan, 1.0, nan, 1.0]
    # Skipped overflows (a loss scale backing off) never count; a finite step resets the streak.
    _, summary = train_loop(_fake_step(losses, [x != x for x in losses]), state,
                            lambda s: None, num_steps=8, tokens_per_step=1, progress=False,
                            max_non_finite=2)
    assert summary["skipped_steps"] == 4
    with pytest.raises(NonFiniteError, match=r"steps 4\.\.5: 2 consecutive") as info:
        train_loop(_fake_step(losses, [False] * 8), state, lambda s: None, num_steps=8,
                   tokens_per_step=1, progress=False, max_non_finite=2)
    assert (info.value.first_step, info.value.step, info.value.count) == (4, 5, 2)
    _, summary = train_loop(_fake_step(losses, [False] * 8), state, lambda s: None,
                            num_steps=8, tokens_per_step=1, progress=False, max_non_finite=3)
    assert summary["steps"] == 8


def test_resume_on_another_mesh_and_strategy_continues_the_run(tmp_path, corpus, capsys):
    # fsdp on 8 devices to step 6 (checkpoints 2, 4, 6); as if it had died after step 2, resume
    # under zero1 on a data=2 x fsdp=4 mesh, then on 1 device: every leaf lands in its new layout.
    out = tmp_path / "run"
    common = ["train", "--steps", "6", "--checkpoint-every", "2", "--batch-size", "8",
              "--data", corpus, "--out", str(out), *TINY[:4], "--eval-batches", "1",
              "--no-progress"]
    assert main([*common, "--strategy", "fsdp"]) == 0
    straight = [r["loss"] for r in _metrics(out)]
    for step in ("4", "6"):
        shutil.rmtree(out / "checkpoints" / step)
    assert main([*common, "--strategy", "zero1", "--mesh", "data=2,fsdp=4"]) == 0
    assert "resuming from step 2" in capsys.readouterr().out
    resumed = [r["loss"] for r in _metrics(out)]
    shutil.rmtree(out / "checkpoints" / "6")
    assert main(common) == 0  # one device
    assert "resuming from step 4" in capsys.readouterr().out
    single = [r["loss"] for r in _metrics(out)]
    assert len(straight) == len(resumed) == len(single) == 6
    assert resumed[:2] == single[:2] == straight[:2]  # the records before the resume are kept
    # Another device count sums the batch in another order: equal to f32 rounding, not bitwise.
    np.testing.assert_allclose(resumed, straight, rtol=1e-5)
    np.testing.assert_allclose(single, straight, rtol=1e-5)
