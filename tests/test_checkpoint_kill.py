"""SIGKILL tests of effijax.checkpoint, with subprocesses running tests/_ckpt_worker.py.

(a) Exact resume: a run killed after its step-k checkpoint and resumed in a new process ends
    bitwise equal (every state leaf, and every logged loss) to an uninterrupted run.
(b) Kill during an asynchronous write: over seeded random kill times, the latest committed
    checkpoint always restores, with exactly the values that were saved, and the run can go on
    saving into the same directory.
(c) A failed background write makes the process exit non-zero even if it never waits.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import numpy as np
import pytest
from _run_env import compilation_cache, compiles_as_the_suite

from effijax.checkpoint import open_checkpoints, restore_target, validate_resume
from effijax.run import read_metrics
from effijax.sharding import make_mesh, replicated

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("_ckpt_worker.py")
sys.path.insert(0, str(WORKER.parent))
import _ckpt_worker as worker  # noqa: E402

TRIALS = 8


_SPAWNED: list[subprocess.Popen] = []


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """The workers' environment: they share one JAX compilation cache, so a worker loads the
    programs an earlier one compiled (the same executables: the same numbers) instead of
    compiling them."""
    return compiles_as_the_suite({**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
                                  **compilation_cache(tmp_path_factory.mktemp("jax-cache"))})


@pytest.fixture(autouse=True)
def reap_workers():
    """A failed test must not leave workers running or their pipes open (an unclosed pipe
    is reported, as an error, in whichever test runs next on this pytest worker)."""
    yield
    while _SPAWNED:
        proc = _SPAWNED.pop()
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def spawn(env, *args) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(WORKER), *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _SPAWNED.append(proc)
    return proc


def finish(proc: subprocess.Popen, timeout=120) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{out}\n{err[-3000:]}"
    return out


def wait_for(path: Path, proc: subprocess.Popen, timeout=120) -> None:
    t0 = time.monotonic()
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"worker exited early: {proc.communicate()}")
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{path} did not appear in {timeout}s")
        time.sleep(0.01)


def losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run)]


def test_sigkill_and_resume_is_bitwise_exact(tmp_path, env):
    kill_after = 6  # poll for this step's checkpoint, then kill once the next step is logged
    ref = spawn(env, "train", "--dir", tmp_path / "ref", "--run", tmp_path / "ref-run",
                "--out", tmp_path / "ref.npz")
    victim = spawn(env, "train", "--dir", tmp_path / "ckpt", "--run", tmp_path / "run",
                   "--out", tmp_path / "never.npz", "--step-sleep", 0.3)
    wait_for(tmp_path / "ckpt" / str(kill_after), victim)
    while victim.stdout.readline().strip() != f"step {kill_after + 1}":
        pass
    victim.send_signal(signal.SIGKILL)
    victim.communicate()
    finish(ref)
    assert victim.returncode == -signal.SIGKILL
    assert not (tmp_path / "never.npz").exists()
    logged = [s for s, _ in losses(tmp_path / "run")]
    print(f"killed after logging step {logged[-1]}; checkpoint dir: "
          f"{sorted(p.name for p in (tmp_path / 'ckpt').iterdir())}")
    abstract = jax.eval_shape(worker.init_state, jax.random.key(worker.SEED))
    resume_from = validate_resume(tmp_path / "ckpt", abstract)
    assert kill_after <= resume_from < worker.STEPS
    # The killed run logged past its checkpoint: the resumed run must drop those records.
    assert logged[-1] > resume_from

    out = finish(spawn(env, "train", "--dir", tmp_path / "ckpt", "--run", tmp_path / "run",
                       "--out", tmp_path / "resumed.npz"))
    assert f"resumed {resume_from}" in out
    ref_state, resumed = np.load(tmp_path / "ref.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(ref_state.files) == sorted(resumed.files)
    for name in ref_state.files:  # params, Adam moments, loss-scale state, step, key data
        np.testing.assert_array_equal(resumed[name], ref_state[name], err_msg=name)
        assert resumed[name].dtype == ref_state[name].dtype, name
    assert int(resumed["step"]) == worker.STEPS
    # The log too: the records past the restored step were dropped and re-run identically.
    assert losses(tmp_path / "run") == losses(tmp_path / "ref-run")
    assert [s for s, _ in losses(tmp_path / "run")] == list(range(1, worker.STEPS + 1))


def spam_target():
    abstract = jax.eval_shape(worker.spam_state, 0)
    return restore_target(abstract, replicated(make_mesh(devices=jax.devices()[:1])))


def test_kill_during_async_write_always_leaves_a_restorable_checkpoint(tmp_path, env):
    rng = random.Random(1234)
    target = spam_target()
    outcomes = []
    for trial in range(TRIALS):
        d = tmp_path / f"trial{trial}"
        proc = spawn(env, "spam", "--dir", d)
        assert proc.stdout.readline().strip() == "ready", proc.communicate()
        delay = rng.uniform(0.0, 1.5)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        leftovers = sorted(p.name for p in d.iterdir() if "tmp" in p.name)
        with open_checkpoints(d, every=1, keep=2) as ckpt:
            step = ckpt.latest_step()
            assert step is not None and step >= 1
            restored = ckpt.restore(target_state_abstract=target)
            expected = worker.spam_state(step)
            chex.assert_trees_all_equal(worker.flat(restored), worker.flat(expected))
            # The run goes on: a new step saves and commits into the same directory.
            assert ckpt.save(worker.spam_state(step + 1)).saved
        assert open_checkpoints(d).latest_step() == step + 1
        assert not [p for p in d.iterdir() if "tmp" in p.name]  # removed on open
        outcomes.append({"trial": trial, "delay_s": round(delay, 3), "restored_step": step,
                         "tmp_dirs_left": leftovers})
    print(json.dumps(outcomes, indent=1))
    # Most kills land mid-write (a temporary directory was left behind) and none mattered.
    assert sum(bool(o["tmp_dirs_left"]) for o in outcomes) >= 1


def test_failed_background_write_exits_nonzero(tmp_path, env):
    proc = spawn(env, "fail", "--dir", tmp_path / "ckpt")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0, out
    assert "saved=True" in out  # save() started the write and returned ...
    assert "No space left on device" in err  # ... leaving the with block raised its error
    assert "exited the with block" not in out
