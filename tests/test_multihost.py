"""`effijax train` under two processes (4 CPU devices each, gloo) equals one process with 8.

Every process runs the same command; they meet at a coordinator on 127.0.0.1 (a free port
found by binding port 0), each builds only its own rows of every global batch, and only
process 0 prints and writes the run directory. Subprocesses force their own device counts; this
test process keeps conftest's 8. Timeouts turn a hang into a failure.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from _gloo import not_gloo
from _run_env import compilation_cache

TIMEOUT_S = 240
# The processes exchange their stop flags every 10 steps: a run signalled after its first
# checkpoint (step 2) stops at 10 (or 20, had it made 8 steps before the signal came), and
# resumes for at least one step.
STEPS = 21
ARGS = ["--model", "tiny", "--seq-len", "32", "--batch-size", "8", "--steps", str(STEPS),
        "--strategy", "fsdp", "--eval-batches", "1", "--no-progress", "--checkpoint-every", "2"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("EFFIJAX_", "JAX_COORDINATOR", "XLA_FLAGS"))}
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra)
    return env


def _launch(args, env=None):
    return subprocess.Popen([sys.executable, "-m", "effijax", "train", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or _env())


def _wait(procs):
    """Waits for all; on a timeout kills them (only the processes started here)."""
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=TIMEOUT_S))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.communicate()
        pytest.fail(f"a process did not finish within {TIMEOUT_S}s (hang?)")
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{out}\nstderr:\n{err}"
    return outs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x * {i} + 1\n" for i in range(400)))
    return str(path)


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _pair(args, port, env=None):
    return [_launch([*args, "--cpu-devices", "4", "--coordinator", f"127.0.0.1:{port}",
                     "--num-processes", "2", "--process-id", str(i)], env) for i in range(2)]


@pytest.fixture(scope="module")
def cached_env(tmp_path_factory) -> dict:
    """Processes that share JAX's persistent compilation cache: the first launch compiles the
    programs around the step (initialisation, evaluation), the later ones load them; each run's
    step is compiled afresh for its collective census, which its summary lists."""
    return _env(**compilation_cache(tmp_path_factory.mktemp("jax-cache")))


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus, cached_env):
    """One uninterrupted run of ``ARGS`` on 2 processes of 4 devices, and its process 0's and
    process 1's stdout: what one process of 8 must equal, and what the interrupted and resumed
    run must equal bit for bit (one launch serves both tests)."""
    run = tmp_path_factory.mktemp("2x4") / "straight"
    (out0, _), (out1, _) = _wait(_pair([*ARGS, "--data", corpus, "--out", str(run)],
                                      _free_port(), cached_env))
    return run, out0, out1


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_of_four_devices_match_one_process_of_eight(tmp_path, corpus, straight,
                                                                  cached_env):
    multi, out0, out1 = straight
    assert f"done: {STEPS} steps" in out0 and "2 process(es)" in out0
    # Only process 0 prints (gloo's C++ connection lines are not effijax's to silence).
    assert not_gloo(out1.splitlines()) == []
    single = tmp_path / "1x8"
    _wait([_launch([*ARGS, "--data", corpus, "--out", str(single), "--cpu-devices", "8"],
                   cached_env)])

    _same_run(multi, single, STEPS, {"data": 1, "fsdp": 8, "tensor": 1})


def _same_run(multi, single, steps: int, mesh: dict) -> None:
    """The 2 x 4 run ``multi`` trained as the 1 x 8 run ``single`` on ``mesh``: the same
    losses (gloo's all-reduces sum in another order than one process's: f32 rounding), the same
    partitioned program (per-device parameter bytes, collectives)."""
    m2, m1 = _metrics(multi), _metrics(single)
    assert [r["step"] for r in m2] == [r["step"] for r in m1] == list(range(1, steps + 1))
    np.testing.assert_allclose([r["loss"] for r in m2], [r["loss"] for r in m1], rtol=1e-5)
    s2 = json.loads((multi / "summary.json").read_text())
    s1 = json.loads((single / "summary.json").read_text())
    np.testing.assert_allclose(s2["eval_loss"], s1["eval_loss"], rtol=1e-5)
    c2 = json.loads((multi / "config.json").read_text())
    assert c2["run"]["process_count"] == 2 and len(c2["run"]["devices"]) == 8
    assert c2["mesh"] == s1["mesh"] == mesh and c2["strategy"] == "fsdp"
    assert s2["memory"]["params"] == s1["memory"]["params"]
    assert s2["collectives"] and s2["collectives"] == s1["collectives"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_to_one_of_two_processes_stops_both_at_one_step_and_resumes_exactly(
        tmp_path, corpus, straight, cached_env):
    args = [*ARGS, "--data", corpus]
    run, env = tmp_path / "run", cached_env
    procs = _pair([*args, "--out", str(run)], _free_port(), env)
    checkpoints = run / "checkpoints"
    deadline = time.monotonic() + TIMEOUT_S
    while not (checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())):
        assert all(p.poll() is None for p in procs), "a process exited before its checkpoint"
        if time.monotonic() > deadline:
            _wait(procs)  # kills both, fails
        time.sleep(0.01)
    procs[1].send_signal(signal.SIGTERM)  # process 1 only: a preempted host
    (out0, _), _ = _wait(procs)  # both exit 0
    last = _metrics(run)[-1]["step"]
    assert last < STEPS, "the run finished before the signal; make it longer"
    assert f"stopped at step {last} by a signal to process 1; saved" in out0
    # Both processes saved that step together (orbax commits it only when all have written).
    assert max(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == last

    # The resumed run loads the programs around the step that the uninterrupted run (the
    # fixture) compiled: its steps after the stop must still equal that run's bit for bit.
    (out0, _), _ = _wait(_pair([*args, "--out", str(run)], _free_port(), env))
    assert f"resuming from step {last}" in out0 and f"done: {STEPS} steps" in out0
    reference, _, _ = straight
    resumed = _metrics(run)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    # The same program on the same devices: bit for bit.
    assert [r["loss"] for r in resumed] == [r["loss"] for r in _metrics(reference)]
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
def test_a_tensor_axis_across_two_processes_matches_one_process_of_eight(tmp_path, corpus,
                                                                         llama8, cached_env):
    args = ["--from", llama8, "--mesh", "tensor=8", "--strategy", "fsdp", "--seq-len", "32",
            "--batch-size", "8", "--steps", str(TENSOR_STEPS), "--eval-batches", "1",
            "--no-progress", "--data", corpus]
    multi, single = tmp_path / "2x4", tmp_path / "1x8"
    (out0, _), _ = _wait(_pair([*args, "--out", str(multi)], _free_port(), cached_env))
    assert "2 process(es)" in out0 and "mesh tensor=8" in out0, out0
    _wait([_launch([*args, "--out", str(single), "--cpu-devices", "8"], cached_env)])
    _same_run(multi, single, TENSOR_STEPS, {"data": 1, "fsdp": 1, "tensor": 8})
    collectives = json.loads((multi / "summary.json").read_text())["collectives"]
    assert any(r["kind"] == "all-reduce" for r in collectives)  # Megatron's, across processes
