"""`effijax train` interrupted through the command line, compared with an uninterrupted run.

Every run goes through tests/_batch_hash_train.py (the real CLI, logging each training
batch's SHA-256), so besides the final state and metrics a test compares *which batches* the
interrupted run read. Processes share one JAX compilation cache, so each later process loads
the compiled step instead of compiling it.

* SIGINT stops at a step boundary and saves; the same command resumes; the end is bitwise the
  uninterrupted run's, and so is the sequence of batches.
* Ten SIGKILLs while checkpoints are written every step, each followed by the same command:
  every restart resumes from the newest committed step (never a fallback), and the run ends
  bitwise where the uninterrupted one did, having read the same batches. Each kill waits for
  events, not for a machine's speed: the process has committed a step past the one it resumed
  from, then a seeded random delay, one in each tenth of a 0.4 s window (stratified, so the
  kills spread over the window rather than bunching), then every other kill also waits for a
  write in flight (a temporary checkpoint directory), so that on a loaded machine as on a quiet
  one at least half of the kills land mid-write and each one leaves a newer step than the last.
* Two fresh runs with the same seed are bitwise equal.
* The corpus as a memory-mapped token store: killed and resumed, the file-fed run's batches
  and end, bitwise.
"""

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from _run_env import run_env

from effijax.checkpoint import latest_step, open_checkpoints, restore_target

pytestmark = pytest.mark.slow

HELPER = Path(__file__).with_name("_batch_hash_train.py")
STEPS = 120  # more than the trials' kills leave done (each trial makes a few steps)
TRIALS = 10
WINDOW_S = 0.4  # the kills land this long at most after a process's second batch
FLAGS = ["--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--eval-batches", "1",
         "--no-progress", "--steps", str(STEPS)]
TIMING = ("tokens_per_s", "step_time_s")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return run_env(tmp_path_factory.mktemp("interrupts"))


def _spawn(env, out, log, *extra):
    return subprocess.Popen(
        [sys.executable, str(HELPER), "train", *FLAGS, "--data", env["corpus"], "--out",
         str(out), *extra], env={**env["env"], "EFFIJAX_TEST_BATCH_LOG": str(log)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc, timeout=600):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err[-3000:]}"
    return out, err


def _hashes(log: Path) -> list[tuple[int, str]]:
    """``(step, sha256)`` per batch built; a line cut short by a kill is left out."""
    rows = []
    for line in log.read_text().splitlines() if log.exists() else []:
        parts = line.split()
        if len(parts) == 2 and len(parts[1]) == 64:
            rows.append((int(parts[0]), parts[1]))
    return rows


def _metrics(out) -> list[dict]:
    rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def _leaves(out):
    directory = Path(out) / "checkpoints"
    from effijax.models import model_from_dict
    from effijax.recipe import TrainConfig, abstract_state, optimizer_for

    with open_checkpoints(directory, every=1, keep=None) as ckpt:
        step = ckpt.latest_step()
        saved = ckpt.metadata(step)["metadata"]["config"]
        s = TrainConfig.from_dict(saved).sections
        abstract = abstract_state(model_from_dict(saved["run"]["model_config"]),
                                  s.precision.precision,
                                  optimizer_for(s.training, s.optimizer, s.precision),
                                  seed=s.training.seed)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        state = ckpt.restore(step, target_state_abstract=restore_target(abstract, device))
    return step, [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x) for x in jax.tree.leaves(state)]


def _assert_bitwise(a, b):
    (sa, la), (sb, lb) = a, b
    assert sa == sb == STEPS
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def reference(env):
    out, log = env["root"] / "straight", env["root"] / "straight.log"
    _finish(_spawn(env, out, log, "--checkpoint-every", str(STEPS)))
    hashes = _hashes(log)
    assert [s for s, _ in hashes] == list(range(STEPS))
    return {"out": out, "hashes": hashes, "metrics": _metrics(out), "leaves": _leaves(out)}


def test_two_fresh_runs_with_the_same_seed_are_bitwise_equal(env, reference):
    out, log = env["root"] / "again", env["root"] / "again.log"
    _finish(_spawn(env, out, log, "--checkpoint-every", "40"))
    assert _hashes(log) == reference["hashes"]
    assert _metrics(out) == reference["metrics"]
    _assert_bitwise(_leaves(out), reference["leaves"])


def _wait_for_batches(proc, log: Path, count: int, timeout=300.0) -> None:
    """Until this process has built ``count`` training batches (or ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None or len(_hashes(log)) >= count:
            return
        time.sleep(0.02)
    raise AssertionError("the run made no progress")


def _wait_for(proc, event, what: str, timeout=300.0) -> None:
    """Until ``event()`` holds; fails naming ``what`` if the process ends or ``timeout`` passes
    first (the process is killed then: no test after this one inherits it)."""
    deadline = time.monotonic() + timeout
    try:
        while not event():
            if proc.poll() is not None:
                raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} in {timeout:.0f} s")
            time.sleep(0.005)
    except BaseException:
        proc.kill()
        stdout, stderr = proc.communicate()
        print(stdout, stderr[-3000:])
        raise


def _committed(checkpoints: Path) -> int:
    """The newest committed step, from the names alone (orbax renames a step's temporary
    directory to its number when it commits; the run deletes old steps as this looks)."""
    try:
        return max((int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()), default=0)
    except FileNotFoundError:  # no directory yet
        return 0


def _wait_for_commit(proc, checkpoints: Path, start: int) -> None:
    """Until the process has committed a step past ``start``."""
    _wait_for(proc, lambda: _committed(checkpoints) > start,
              f"a checkpoint past step {start} was committed")


def _wait_for_write(proc, checkpoints: Path) -> None:
    """Until a checkpoint write is in flight (orbax's temporary directory exists)."""
    _wait_for(proc, lambda: any("tmp" in p.name for p in checkpoints.iterdir()),
              "a checkpoint write was in flight")


def test_sigint_stops_saves_and_resumes_bitwise_with_the_same_batches(env, reference):
    out, log = env["root"] / "sigint", env["root"] / "sigint.log"
    proc = _spawn(env, out, log, "--checkpoint-every", "4")
    _wait_for_batches(proc, log, 12)
    proc.send_signal(signal.SIGINT)
    stdout, _ = _finish(proc)
    stopped = latest_step(out / "checkpoints")
    assert f"stopped at step {stopped} by SIGINT; saved" in stdout, stdout
    assert 10 < stopped < STEPS
    assert [s for s, _ in _hashes(log)] == list(range(stopped))  # no batch read past the stop
    stdout, _ = _finish(_spawn(env, out, log, "--checkpoint-every", "4"))
    assert f"resuming from step {stopped}" in stdout
    assert _hashes(log) == reference["hashes"]
    assert _metrics(out) == reference["metrics"]
    _assert_bitwise(_leaves(out), reference["leaves"])


def test_kills_during_checkpoint_writes_each_resume_from_the_newest_step(env, reference):
    rng = random.Random(20_261_123)
    slots = rng.sample(range(TRIALS), TRIALS)  # which tenth of the window each trial kills in
    out, log = env["root"] / "killed", env["root"] / "killed.log"
    flags = ("--checkpoint-every", "1", "--keep", "2")
    read: list[tuple[int, str]] = []  # the batches that count: those before each restart
    trials = []
    for trial in range(TRIALS):
        newest = latest_step(out / "checkpoints")
        start = 0 if newest is None else newest
        # The batches before the restart point were read by earlier processes; from it on,
        # this process reads (again) what a killed one read past its last checkpoint.
        read = [h for h in read if h[0] < start]
        log.unlink(missing_ok=True)
        proc = _spawn(env, out, log, *flags)
        _wait_for_commit(proc, out / "checkpoints", start)
        delay = rng.uniform(slots[trial], slots[trial] + 1) * WINDOW_S / TRIALS
        time.sleep(delay)
        if trial % 2:
            _wait_for_write(proc, out / "checkpoints")
        proc.send_signal(signal.SIGKILL)
        stdout, stderr = proc.communicate()
        assert proc.returncode == -signal.SIGKILL, f"trial {trial} ended on its own:\n{stdout}"
        assert "cannot be restored" not in stderr, stderr  # never a fallback
        if newest is not None:
            assert f"resuming from step {newest} in" in stdout, (trial, stdout, stderr)
        read += _hashes(log)
        tmp = [p.name for p in (out / "checkpoints").iterdir() if "tmp" in p.name]
        trials.append({"trial": trial, "delay_s": round(delay, 3), "resumed_from": start,
                       "newest_after_kill": latest_step(out / "checkpoints"),
                       "write_in_flight": bool(tmp)})
    print(json.dumps(trials))
    assert trials[-1]["newest_after_kill"] < STEPS, "the run finished before the last kill"
    # Each kill came after a newer commit, and at least half of them while a step was being
    # written; each time the next process resumed from the newest committed step (asserted
    # above).
    assert all(t["newest_after_kill"] > t["resumed_from"] for t in trials), trials
    assert sum(t["write_in_flight"] for t in trials) >= TRIALS // 2, trials
    start = latest_step(out / "checkpoints")
    read = [h for h in read if h[0] < start]
    log.unlink(missing_ok=True)
    stdout, _ = _finish(_spawn(env, out, log, *flags))
    assert f"resuming from step {start} in" in stdout
    assert read + _hashes(log) == reference["hashes"]
    assert _metrics(out) == reference["metrics"]
    _assert_bitwise(_leaves(out), reference["leaves"])


def test_a_store_fed_run_killed_and_resumed_is_the_file_fed_run(env, reference):
    """The corpus prepared into a token store (``effijax data prepare``) and memory-mapped:
    SIGKILL, then the same command; the run reads the batches the file-fed run read and ends
    bitwise where it ended."""
    from effijax.sources._prepare import prepare

    store = env["root"] / "corpus.store"
    prepare(env["corpus"], store, processes=1)
    out, log = env["root"] / "store-fed", env["root"] / "store-fed.log"

    def spawn():
        return subprocess.Popen(
            [sys.executable, str(HELPER), "train", *FLAGS, "--data", str(store), "--out",
             str(out), "--checkpoint-every", "4"],
            env={**env["env"], "EFFIJAX_TEST_BATCH_LOG": str(log)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    proc = spawn()
    _wait_for_batches(proc, log, 12)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    newest = latest_step(out / "checkpoints")
    assert newest is not None and newest < STEPS
    read = [h for h in _hashes(log) if h[0] < newest]
    log.unlink()
    stdout, _ = _finish(spawn())
    assert f"resuming from step {newest} in" in stdout
    assert "memory-mapped" in stdout
    assert read + _hashes(log) == reference["hashes"]
    assert _metrics(out) == reference["metrics"]
    _assert_bitwise(_leaves(out), reference["leaves"])


@pytest.mark.parametrize("own, everyone, said", [
    (0, [0, 15], "SIGTERM to process 1"),  # not signalled (yet): names the signal and where
    (2, [2, 15], "SIGINT"),  # its own signal, whatever the others had
    (0, [0, 0], None),  # no one: runs on
])
def test_processes_agree_to_stop_and_name_the_signal(monkeypatch, own, everyone, said):
    """Two processes' stop flags, the exchange replaced by its result: the first process with
    a signal names it (a launcher that forwards SIGTERM to each rank in turn may reach this one
    only after the exchange; it must still say SIGTERM)."""
    from jax.experimental import multihost_utils

    from effijax.run import StopFlag

    sent = []
    monkeypatch.setattr(multihost_utils, "process_allgather",
                        lambda x: sent.append(int(x)) or np.asarray(everyone, np.int32))
    flag = StopFlag(num_processes=2, every=2)
    if own:
        flag._handle(own, None)
    assert flag() is False and sent == []  # between exchanges: no collective, no stop
    assert flag() is (said is not None) and sent == [own]
    assert flag.stopped is (said is not None) and flag.signal_name == said
