"""What the real multi-process launches of tests/test_multihost.py (flags) and
tests/test_launchers.py (mpirun, an emulated srun) share: one run, ``ARGS`` (a tiny GPT, FSDP,
``STEPS`` steps, a checkpoint every ``EVERY``), its corpus, the environment its processes start
in, and :func:`same_run`, the check that a run of 2 processes of 4 CPU devices trained as one
process of 8 devices.

Four runs of it serve the five tests of both modules that train it:

- conftest's ``one_process_of_eight`` (once per test process): the run in one process of 8
  devices, what every 2 x 4 run must reproduce;
- conftest's ``two_processes_of_four`` (:func:`under_srun`, once per test process): 2 processes
  of 4 devices that find each other from an emulated srun's variables, uninterrupted:
  test_launchers' srun comparison with the one process of 8, and both modules' SIGTERM tests'
  bitwise reference (how the processes found each other changes no bit of the same program on
  the same devices);
- test_multihost's flags-launched run and test_launchers' mpirun run, each stopped by SIGTERM
  and resumed: its module's SIGTERM test, and its module's comparison with the one process of
  8 (its steps before the stop and after the resumption, its summary, its printed lines).

test_multihost's SIGTERM test signals its run once the first checkpoint (step ``EVERY``) exists,
test_launchers' signals mpirun once the ranks train (their first step logged; mpirun passes it
on a grace period later); the processes agree to stop every 10 steps, so the run stops at 10 or
20, before ``STEPS``, and its resumption has steps left (14 or 4) to compare bit for bit.
(Measured on a 2-core machine: a step of the 2 processes takes 0.25-0.5 s, mostly the 8
devices' collectives over gloo, against 0.05 s in one process; each launch also pays 15-20 s
for its imports, its programs from the cache, the collective census, the eval and the
checkpoints. Process 1 of a launch never loads a program from the cache: jax writes entries
from process 0 only, and a key holds the topology of the process's own devices, so process
1's keys are never written; one process of 8 devices shares no key with either.)
"""

import ipaddress
import json
import os
import random
import socket
import subprocess
import sys

import numpy as np
import pytest
from _run_env import compiles_as_the_suite

STEPS, EVERY = 24, 4
TIMEOUT_S = 300  # a launch's limit: a hang fails instead of stopping the suite
ARGS = ["--model", "tiny", "--seq-len", "32", "--batch-size", "8", "--steps", str(STEPS),
        "--strategy", "fsdp", "--eval-batches", "1", "--no-progress", "--checkpoint-every",
        str(EVERY)]
CORPUS = "".join(f"def f{i}(x):\n    return x * {i} + 1\n" for i in range(400))
# The machine's own launcher variables (a test run inside a SLURM job, say) must not reach the
# processes: each test says how they find each other.
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMIX_", "EFFIJAX_", "JAX_COORDINATOR", "JAX_LOCAL",
                     "KUBERNETES_", "JOB_COMPLETION_INDEX", "XLA_FLAGS")


def env(**extra) -> dict:
    """This process's environment without launcher variables, on CPU, plus ``extra``."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    out["JAX_PLATFORMS"] = "cpu"
    out.update({k: str(v) for k, v in extra.items()})
    return compiles_as_the_suite(out)


def train(args, environment, prefix=()) -> subprocess.Popen:
    """``effijax train ARGS`` started in its own session (``prefix``: a launcher)."""
    return subprocess.Popen([*prefix, sys.executable, "-m", "effijax", "train", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=environment, start_new_session=True)


def wait(procs, timeout: float) -> list[tuple[str, str]]:
    """Waits for all; on a timeout kills them (only the processes started here). Every one
    must exit 0; returns their ``(stdout, stderr)``."""
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.communicate()
        pytest.fail(f"a process did not finish within {timeout}s (hang?)")
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{out}\nstderr:\n{err}"
    return outs


def metrics(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def same_run(multi, single, steps: int, mesh: dict) -> None:
    """The 2 x 4 run ``multi`` trained as the 1 x 8 run ``single`` on ``mesh``: the same
    losses (gloo's all-reduces sum in another order than one process's: f32 rounding), the same
    partitioned program (per-device parameter bytes, collectives)."""
    m2, m1 = metrics(multi), metrics(single)
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


def without_launcher_variables(patch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """``patch`` with this process's launcher variables (``LAUNCHER_PREFIXES``) deleted: a test
    run inside a SLURM job, say, sets only what the test sets."""
    for name in list(os.environ):
        if name.startswith(LAUNCHER_PREFIXES):
            patch.delenv(name)
    return patch


def is_loopback(address: str) -> bool:
    from effijax.distributed import parse_address

    host, _ = parse_address(address)
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's pick), for a run's
    coordinator."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_slurm_job_id() -> int:
    """A job id whose jax-derived coordinator port (61440 + id mod 4096) is free here."""
    ports = list(range(65536 - 4096, 65536))
    random.shuffle(ports)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return 4096 * 100 + port - (65536 - 4096)
    pytest.skip("no free port in the ephemeral range jax derives SLURM ports from")


def under_srun(out, corpus: str, cache: dict) -> tuple[str, str, str]:
    """The run in two processes that find each other from an emulated srun's variables (set
    for two local processes), 4 devices each, uninterrupted, into directory ``out`` (``cache``:
    conftest's ``launch_cache``). Returns the coordinator this process's
    :func:`effijax.distributed.find_launch` derived from the same variables (checked to be on the
    loopback interface before anything starts), and both processes' stdout."""
    from effijax import distributed

    job_id = free_slurm_job_id()
    slurm = {"SLURM_JOB_ID": job_id, "SLURM_NTASKS": 2, "SLURM_STEP_NODELIST": "localhost",
             "SLURM_STEP_NUM_NODES": 1, "SLURM_NNODES": 1, "SLURM_JOB_NODELIST": "localhost"}
    with pytest.MonkeyPatch.context() as patch:
        without_launcher_variables(patch)
        for k, v in {**slurm, "SLURM_PROCID": 0, "SLURM_LOCALID": 0}.items():
            patch.setenv(k, str(v))
        launch = distributed.find_launch()
    assert launch.launcher == "slurm" and launch.settings.num_processes == 2
    assert is_loopback(launch.settings.coordinator_address)  # before anything starts

    procs = [train([*ARGS, "--data", corpus, "--out", str(out), "--cpu-devices", "4"],
                   env(**slurm, **cache, SLURM_PROCID=i, SLURM_LOCALID=i))
             for i in range(2)]
    (out0, _), (out1, _) = wait(procs, TIMEOUT_S)
    return launch.settings.coordinator_address, out0, out1
