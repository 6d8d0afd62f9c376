"""Batches built ahead of the step (effijax.data.Prefetcher): the same batches in the same order
as building each one when it is needed, the worker's errors raised in the caller, and no thread
left behind however the caller's block ends. The recipe's loop with it: tests/test_recipe_stages.py
(in-process) and the resume / interrupt tests (a killed run resumed equals an uninterrupted one),
which run with the default prefetch."""

import threading
import time

import jax
import numpy as np
import optax
import pytest

from effijax.cli import build_parser
from effijax.cli._train import config_from_args
from effijax.data import Prefetcher, batch_at
from effijax.errors import ConfigError
from effijax.models import gpt_config
from effijax.recipe import TrainConfig, batch_fn, plan_job
from effijax.sharding import make_mesh

SEQ, BATCH, SEED = 16, 8, 3
TOKENS = np.frombuffer(b"".join(b"def f%d(x):\n    return x * %d\n" % (i, i)
                                for i in range(100)), np.uint8)


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "effijax-prefetch"]


@pytest.fixture(scope="module")
def fetch():
    """The recipe's ``batch(step)`` of a job on the 8-device mesh: global arrays, split by rows
    (planned only; nothing is compiled)."""
    job = plan_job(gpt_config("tiny", seq_len=SEQ), "fp32", optax.adam(1e-3),
                   batch_size=BATCH, mesh=make_mesh(), seed=SEED)
    return batch_fn(job, TOKENS)


@pytest.mark.parametrize("depth", [0, 1, 2, 5])
def test_prefetched_batches_are_the_batches_of_their_steps_in_order(fetch, depth):
    steps = range(3, 11)
    with Prefetcher(fetch, steps, depth=depth) as batches:
        got = [batches(step) for step in steps]
    assert not _workers()
    for step, batch in zip(steps, got, strict=True):
        want = batch_at(TOKENS, seed=SEED, step=step, batch_size=BATCH, seq_len=SEQ)
        direct = fetch(step)
        assert sorted(batch) == sorted(want) == ["inputs", "targets"]
        for key, value in batch.items():
            assert isinstance(value, jax.Array) and value.sharding == direct[key].sharding
            assert len(value.addressable_shards) == 8  # put on the devices, split by rows
            np.testing.assert_array_equal(np.asarray(value), want[key],
                                          err_msg=f"step {step} {key}")
    assert not any(np.array_equal(np.asarray(a["inputs"]), np.asarray(b["inputs"]))
                   for a, b in zip(got[:-1], got[1:], strict=True))  # each step its own batch


def test_batches_are_asked_for_in_order(fetch):
    with Prefetcher(fetch, range(2, 4), depth=2) as batches:
        with pytest.raises(ValueError, match=r"expected step 2, got 3"):
            batches(3)
        batches(2)
        batches(3)
        with pytest.raises(ValueError, match=r"expected step 4, got 4"):  # past the range
            batches(4)
    with pytest.raises(RuntimeError, match="closed"):
        batches(4)
    with pytest.raises(TypeError, match="a range of consecutive steps"):
        Prefetcher(fetch, [1, 2])
    with pytest.raises(ConfigError, match="depth=-1"):
        Prefetcher(fetch, range(3), depth=-1)


@pytest.mark.parametrize("depth", [0, 2])
def test_an_error_building_a_batch_is_raised_in_the_caller(depth):
    raised, built = [], []

    def failing(step):
        built.append(step)
        if step == 2:
            raised.append(ConfigError("data", "corpus.txt", "the window of step 2 is gone"))
            raise raised[0]
        return step

    got = []
    with pytest.raises(ConfigError) as e, Prefetcher(failing, range(6), depth=depth) as batches:
        for step in range(6):
            got.append(batches(step))
    assert e.value is raised[0]  # the worker's exception itself: its type, message, traceback
    assert str(e.value) == "data='corpus.txt': the window of step 2 is gone"
    assert got == [0, 1] and built == [0, 1, 2]  # nothing built after the failure
    assert not _workers()


def test_leaving_early_drops_the_batches_ahead_and_joins_the_thread():
    built = []

    def slow(step):
        time.sleep(0.02)
        built.append(step)
        return step

    with Prefetcher(slow, range(1000), depth=2) as batches:
        assert [batches(0), batches(1)] == [0, 1]
    assert not _workers()
    assert len(built) <= 2 + 2 + 1  # the two read, two waiting, at most one being built
    # A signal or an error in the caller's block (the step) ends it the same way.
    with pytest.raises(KeyboardInterrupt), Prefetcher(slow, range(1000), depth=3) as batches:
        batches(0)
        raise KeyboardInterrupt
    assert not _workers()


def test_closing_waits_only_for_the_batch_being_built():
    started = threading.Event()

    def slow(step):
        started.set()
        time.sleep(0.2)
        return step

    batches = Prefetcher(slow, range(100), depth=2)
    started.wait(5)
    t0 = time.perf_counter()
    batches.close()
    assert time.perf_counter() - t0 < 2.0 and not _workers()
    batches.close()  # idempotent


def test_the_caller_waits_less_for_prefetched_batches():
    """A 30 ms batch behind an 80 ms step: built between the steps, every batch is waited
    for; prefetched, only the first (sleeps: no core is needed, so a busy machine agrees)."""
    def build(step):
        time.sleep(0.03)
        return step

    waited = {0: 0.0, 2: 0.0}
    for depth in waited:
        with Prefetcher(build, range(5), depth=depth) as batches:
            for step in range(5):
                t0 = time.perf_counter()
                batches(step)
                waited[depth] += time.perf_counter() - t0
                time.sleep(0.08)  # the step
    assert waited[0] >= 5 * 0.03
    assert waited[2] < waited[0] / 2, waited


def test_prefetch_is_a_setting_and_a_flag():
    assert TrainConfig().prefetch == 2
    assert config_from_args(build_parser().parse_args(["train", "--prefetch", "0"])).prefetch == 0
    with pytest.raises(ConfigError, match="prefetch=-1"):
        TrainConfig(prefetch=-1)
