"""`effijax train` under two processes (4 CPU devices each, gloo) equals one process with 8.

Every process runs the same command; they meet at a coordinator on 127.0.0.1 (a free port
found by binding port 0), each builds only its own rows of every global batch, and only
process 0 prints and writes the run directory. Subprocesses force their own device counts; this
test process keeps conftest's 8. Timeouts turn a hang into a failure. The run is
tests/test_launchers.py's too (tests/_launch.py): its one process of 8 devices and its
uninterrupted two processes of 4 (the emulated srun's) are conftest's ``one_process_of_eight``
and ``two_processes_of_four``, launched once for both modules; this module's own launch of it,
told the ranks by flags, is stopped by SIGTERM and resumed, and serves both of its tests.
"""

import json
import signal
import time

import pytest
from _gloo import not_gloo
from _launch import ARGS, STEPS, TIMEOUT_S, env, free_port, metrics, same_run, train, wait

MESH = {"data": 1, "fsdp": 8, "tensor": 1}


def _pair(args, port, environment):
    return [train([*args, "--cpu-devices", "4", "--coordinator", f"127.0.0.1:{port}",
                   "--num-processes", "2", "--process-id", str(i)], environment)
            for i in range(2)]


@pytest.fixture(scope="module")
def cached_env(launch_cache) -> dict:
    """Processes that share JAX's persistent compilation cache with every launch of the same
    run (conftest's ``launch_cache``): the programs a launch of the same shape compiled before
    are loaded."""
    return env(**launch_cache)


@pytest.fixture(scope="module")
def stopped_and_resumed(tmp_path_factory, launch_corpus, cached_env):
    """The run on 2 processes of 4 devices, stopped by SIGTERM to process 1 once its first
    checkpoint exists and resumed to the end (one run serves both tests). Returns the run
    directory, its last step and newest checkpoint as the stop left them, process 0's stdout
    until the stop, and process 0's and process 1's stdout of the resumption."""
    args = [*ARGS, "--data", launch_corpus]
    run = tmp_path_factory.mktemp("2x4") / "run"
    procs = _pair([*args, "--out", str(run)], free_port(), cached_env)
    checkpoints = run / "checkpoints"
    deadline = time.monotonic() + TIMEOUT_S
    while not (checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())):
        assert all(p.poll() is None for p in procs), "a process exited before its checkpoint"
        if time.monotonic() > deadline:
            wait(procs, 1)  # kills both, fails
        time.sleep(0.01)
    procs[1].send_signal(signal.SIGTERM)  # process 1 only: a preempted host
    (stopped, _), _ = wait(procs, TIMEOUT_S)  # both exit 0
    last = metrics(run)[-1]["step"]
    saved = max(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())

    # The resumption loads the programs around the step from the cache (the stopped launch, or
    # an earlier one of the same shape, compiled them).
    (out0, _), (out1, _) = wait(_pair([*args, "--out", str(run)], free_port(), cached_env),
                                TIMEOUT_S)
    return run, last, saved, stopped, out0, out1


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_of_four_devices_match_one_process_of_eight(stopped_and_resumed,
                                                                  one_process_of_eight):
    multi, _, _, _, out0, out1 = stopped_and_resumed
    assert f"done: {STEPS} steps" in out0 and "2 process(es)" in out0
    # Only process 0 prints (gloo's C++ connection lines are not effijax's to silence).
    assert not_gloo(out1.splitlines()) == []
    # Its steps before the stop and after the resumption, its eval, partitioned program and
    # memory: as one process of 8 devices.
    same_run(multi, one_process_of_eight, STEPS, MESH)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_to_one_of_two_processes_stops_both_at_one_step_and_resumes_exactly(
        stopped_and_resumed, two_processes_of_four):
    run, last, saved, stopped, out0, _ = stopped_and_resumed
    assert last < STEPS, "the run finished before the signal; make it longer"
    assert f"stopped at step {last} by SIGTERM to process 1; saved" in stopped
    # Both processes saved that step together (orbax commits it only when all have written).
    assert saved == last

    assert f"resuming from step {last}" in out0 and f"done: {STEPS} steps" in out0
    # The steps after the stop must equal an uninterrupted run's bit for bit: conftest's (the
    # emulated srun's; how the processes found each other changes no bit).
    reference, _, _, _ = two_processes_of_four
    resumed = metrics(run)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    # The same program on the same devices: bit for bit.
    assert [r["loss"] for r in resumed] == [r["loss"] for r in metrics(reference)]
    s_resumed = json.loads((run / "summary.json").read_text())
    s_reference = json.loads((reference / "summary.json").read_text())
    assert s_resumed["eval_loss"] == s_reference["eval_loss"]


# A Llama of 8 query heads (4 key/value heads, replicated at tensor=8), its vocabulary of 264
# and its MLP width of 128 all divisible by 8: ``tensor=8`` splits every matrix across both
# processes' devices.
TENSOR_STEPS = 4


@pytest.fixture(scope="module")
def llama8(tmp_path_factory):
    import jax
    from _llama_files import write_gguf

    from effijax.models import llama_config

    model = llama_config("llama-tiny", seq_len=32, n_heads=8, n_kv_heads=4, head_dim=8,
                         vocab_size=264)
    path = tmp_path_factory.mktemp("llama8") / "llama8.gguf"
    write_gguf(path, model, jax.jit(model.init_params)(jax.random.key(0)))
    return str(path)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_tensor_axis_across_two_processes_matches_one_process_of_eight(tmp_path,
                                                                         launch_corpus, llama8,
                                                                         cached_env):
    args = ["--from", llama8, "--mesh", "tensor=8", "--strategy", "fsdp", "--seq-len", "32",
            "--batch-size", "8", "--steps", str(TENSOR_STEPS), "--eval-batches", "1",
            "--no-progress", "--data", launch_corpus]
    multi, single = tmp_path / "2x4", tmp_path / "1x8"
    # The one process of 8 runs beside the pair, which spends much of its time waiting on its
    # collectives over gloo (each launch compiles its own programs: none are shared).
    (out0, _), _, _ = wait([*_pair([*args, "--out", str(multi)], free_port(), cached_env),
                            train([*args, "--out", str(single), "--cpu-devices", "8"],
                                  cached_env)], TIMEOUT_S)
    assert "2 process(es)" in out0 and "mesh tensor=8" in out0, out0
    same_run(multi, single, TENSOR_STEPS, {"data": 1, "fsdp": 1, "tensor": 8})
    collectives = json.loads((multi / "summary.json").read_text())["collectives"]
    assert any(r["kind"] == "all-reduce" for r in collectives)  # Megatron's, across processes
