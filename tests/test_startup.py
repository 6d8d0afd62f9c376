"""Multi-process start-up: the processes meet before jax's own start-up, say whom they wait for,
and a missing process is one error line naming it, not jax's five-minute C++ abort.

The meeting itself (``effijax._rendezvous.meet``) runs here in threads of this process, on
127.0.0.1 and free ports: nothing in it touches jax. The slow tests start ``effijax train``
processes whose partners never come, with a join timeout of a few seconds, and read what they
print and how they exit. tests/test_multihost.py covers the start that succeeds.
"""

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from _launch import free_port
from _run_env import compiles_as_the_suite

from effijax import _rendezvous, distributed
from effijax.errors import ConfigError
from effijax.recipe import TrainConfig

ADDRESS = "127.0.0.1:{port}"
# Outcomes that must never reach a user: jax's C++ abort and Python's traceback.
CRASH_MARKS = ("Traceback", "DEADLINE_EXCEEDED", "Check failed", "Check failure", "Aborted")


def _connect(port) -> socket.socket:
    """A raw connection to process 0's port, once its thread listens."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=5)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class _Process(threading.Thread):
    """One process' side of ``meet``, in a thread: what it printed and how it ended."""

    def __init__(self, port, n, pid, timeout_s=20.0, delay_s=0.0):
        super().__init__(daemon=True)
        self.port, self.n, self.pid, self.timeout_s, self.delay_s = port, n, pid, timeout_s, \
            delay_s
        self.lines, self.error, self.done = [], None, False
        self.start()

    def run(self):
        time.sleep(self.delay_s)
        try:
            _rendezvous.meet(ADDRESS.format(port=self.port), ("127.0.0.1", self.port), self.n,
                             self.pid, timeout_s=self.timeout_s, print_fn=self.lines.append)
            self.done = True
        except _rendezvous.JoinError as e:
            self.error = e

    def result(self):
        self.join(timeout=self.timeout_s + 30)
        assert not self.is_alive(), f"process {self.pid} still waits"
        return self


def test_every_process_meets_in_any_order_and_the_port_is_free_for_jax_at_once():
    port = free_port()
    # The others come before process 0 listens, and one after.
    procs = [_Process(port, 4, 1), _Process(port, 4, 3), _Process(port, 4, 0, delay_s=0.5),
             _Process(port, 4, 2, delay_s=1.0)]
    for p in procs:
        assert p.result().done, p.error
    # jax's coordinator binds the port next (gRPC, like create_server, sets SO_REUSEADDR).
    socket.create_server(("127.0.0.1", port)).close()


def test_process_0_alone_names_the_missing_process_after_its_timeout():
    port = free_port()
    start = time.monotonic()
    lead = _Process(port, 2, 0, timeout_s=1).result()
    took = time.monotonic() - start
    assert 1 <= took < 5, took
    assert lead.error.setting == "num_processes" and lead.error.missing == (1,)
    assert lead.error.problem == f"process 1 did not join 127.0.0.1:{port} within 1 s"
    # It said, while waiting, what for.
    assert lead.lines and lead.lines[0].startswith(
        f"process 0 of 2: waiting for 1 more at 127.0.0.1:{port}: process 1 (timeout 1 s")


def test_a_process_alone_names_process_0():
    port = free_port()
    other = _Process(port, 2, 1, timeout_s=1).result()
    assert other.error.setting == "num_processes" and other.error.missing == (0,)
    assert other.error.problem == f"process 0 did not answer at 127.0.0.1:{port} within 1 s"
    assert other.lines[0].startswith(f"process 1 of 2: waiting for process 0 at 127.0.0.1:"
                                     f"{port} (timeout 1 s")


def test_processes_that_came_learn_from_process_0_who_is_missing():
    port = free_port()
    start = time.monotonic()
    lead, one = _Process(port, 4, 0, timeout_s=2.5), _Process(port, 4, 1, timeout_s=30)
    lead.result(), one.result()
    assert time.monotonic() - start < 10  # process 1 stopped with process 0, not at its 30 s
    for p in (lead, one):
        assert p.error.missing == (2, 3), p.error
        assert p.error.problem.startswith("processes 2-3 did not join"), p.error
    assert any("waiting for 2 more" in x and "processes 2-3" in x and "process 0 is up" in x
               for x in one.lines), one.lines


def test_a_process_that_dies_before_everyone_came_is_named():
    port = free_port()
    lead = _Process(port, 3, 0, timeout_s=1)
    with _connect(port) as s:
        s.sendall(b"effijax-join-1 3 1\n")
        assert s.recv(64) == b"wait 2\n"
    lead.result()
    assert lead.error.missing == (1, 2)
    assert lead.error.problem.endswith("within 1 s (process 1 joined, then hung up: see its "
                                       "output)")


def test_different_process_counts_stop_both_sides():
    port = free_port()
    lead, other = _Process(port, 2, 0), _Process(port, 3, 1, delay_s=0.2)
    lead.result(), other.result()
    for p in (lead, other):
        assert p.error.setting == "num_processes", p.error
        assert p.error.problem == ("process 1 was started with 3 processes and process 0 with "
                                   "2: start every process with the same process count")


def test_an_id_taken_twice_stops_the_run():
    port = free_port()
    lead = _Process(port, 3, 0)
    first = _Process(port, 3, 1)
    time.sleep(0.5)  # the first process 1 has joined
    second = _Process(port, 3, 1)
    for p in (lead, first, second):
        p.result()
        assert p.error.setting == "process_id" and p.error.value == 1, p.error
        assert p.error.problem == "two processes were started as process 1 of 3: each needs " \
            "its own id in [0, 3)"
        assert p.error.missing == ()  # not a missing process: no "start it" advice follows


def test_a_stranger_on_the_port_is_ignored():
    port = free_port()
    lead = _Process(port, 2, 0)
    with _connect(port) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert _Process(port, 2, 1).result().done
    assert lead.result().done


@pytest.mark.parametrize("answer, setting, problem", [
    (b"", "num_processes", "process 0 at {address} hung up before every process had joined "
     "(see its output)"),
    (b"HTTP/1.0 400 Bad Request\r\n", "coordinator_address",
     "something other than effijax's process 0 answers at {address}"),
])
def test_a_process_0_that_hangs_up_or_a_stranger_is_named_as_such(answer, setting, problem):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        other = _Process(port, 2, 1, timeout_s=10)
        conn, _ = server.accept()
        with conn:
            assert conn.recv(64) == b"effijax-join-1 2 1\n"
            conn.sendall(answer)
        other.result()
    assert other.error.setting == setting and other.error.missing == ()
    assert other.error.problem == problem.format(address=f"127.0.0.1:{port}")


def test_a_port_in_use_is_an_error_of_the_coordinator_address():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        lead = _Process(port, 2, 0).result()
    assert lead.error.setting == "coordinator_address"
    assert f"process 0 cannot listen on 127.0.0.1:{port}" in lead.error.problem


def test_ids_collapse_runs():
    assert _rendezvous.ids([5, 1, 2, 3, 9]) == "processes 1-3, 5, 9"


# --------------------------------------------------------------------------------------------
# effijax.distributed: the error under the setting's own name, with what to do
# --------------------------------------------------------------------------------------------

@pytest.fixture
def no_launcher(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "PMIX_", "EFFIJAX_", "JAX_COORDINATOR",
                            "KUBERNETES_", "JOB_COMPLETION_INDEX")):
            monkeypatch.delenv(name)
    return monkeypatch


def test_join_names_the_missing_process_and_how_to_start_it(no_launcher):
    port = free_port()
    lines = []
    with pytest.raises(ConfigError) as e:
        distributed.join(distributed.find_launch(ADDRESS.format(port=port), 2, 1),
                         join_timeout=1, print_fn=lines.append)
    assert e.value.field == "num_processes" and e.value.value == 2
    assert str(e.value) == (
        f"num_processes=2: process 0 did not answer at 127.0.0.1:{port} within 1 s; start "
        "process 0 (it hosts the coordinator) there with the same process count, and check "
        "that this host can reach that address")
    assert lines and "waiting for process 0" in lines[0]


def test_join_names_settings_as_the_environment_or_the_launcher_gave_them(no_launcher):
    port = free_port()
    no_launcher.setenv("EFFIJAX_NUM_PROCESSES", "2")
    no_launcher.setenv("EFFIJAX_PROCESS_ID", "1")
    no_launcher.setenv("EFFIJAX_COORDINATOR", ADDRESS.format(port=port))
    with pytest.raises(ConfigError, match=r"^EFFIJAX_NUM_PROCESSES=2: process 0 did not "):
        distributed.join(join_timeout=1, print_fn=lambda line: None)
    for name in ("EFFIJAX_NUM_PROCESSES", "EFFIJAX_PROCESS_ID", "EFFIJAX_COORDINATOR"):
        no_launcher.delenv(name)
    # An emulated srun task (tests/test_launchers.py's variables), process 0 alone.
    for k, v in {"SLURM_JOB_ID": "4097", "SLURM_NTASKS": "2", "SLURM_PROCID": "0",
                 "SLURM_LOCALID": "0", "SLURM_STEP_NODELIST": "localhost",
                 "SLURM_STEP_NUM_NODES": "1"}.items():
        no_launcher.setenv(k, v)
    no_launcher.setenv("EFFIJAX_COORDINATOR", ADDRESS.format(port=port))
    with pytest.raises(ConfigError) as e:
        distributed.join(join_timeout=1, print_fn=lambda line: None)
    assert str(e.value) == (f"SLURM_NTASKS=2: process 1 did not join 127.0.0.1:{port} within "
                            "1 s; slurm started it: see its output, and check that it can "
                            "reach that address")


@pytest.mark.parametrize("bad", [0, -5, "soon", 2.5])
def test_join_timeout_is_checked_before_anything_waits(bad):
    with pytest.raises(ConfigError, match="^join_timeout="):
        distributed.join(join_timeout=bad)


def test_the_config_has_a_join_timeout_with_the_library_default():
    assert TrainConfig().join_timeout == 300
    with pytest.raises(ConfigError, match=r"^join_timeout=0: must be an integer >= 1"):
        TrainConfig(join_timeout=0)


# --------------------------------------------------------------------------------------------
# `effijax train` with a partner that never comes
# --------------------------------------------------------------------------------------------

JOIN_TIMEOUT_S = 5
# Starting Python and importing effijax and jax takes seconds on a shared 2-core machine; what
# matters is that the process ends near its join timeout, not after jax's 300 s.
STARTUP_SLACK_S = 45


def _train(port, n, pid, tmp_path, join_timeout=JOIN_TIMEOUT_S):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("EFFIJAX_", "JAX_COORDINATOR", "XLA_FLAGS", "SLURM_", "OMPI_"))}
    env = compiles_as_the_suite({**env, "JAX_PLATFORMS": "cpu"})
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "effijax", "train", "--model", "tiny", "--batch-size", "12",
         "--cpu-devices", "4", "--coordinator", ADDRESS.format(port=port), "--num-processes",
         str(n), "--process-id", str(pid), "--join-timeout", str(join_timeout), "--out",
         str(tmp_path / "run"), "--no-progress"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env)
    proc.started = started
    return proc


def _ended(proc):
    """(exit code, stdout, stderr, seconds since it started); kills it (only it) if it hangs."""
    start = proc.started
    try:
        out, err = proc.communicate(timeout=JOIN_TIMEOUT_S + STARTUP_SLACK_S + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the process did not end after its join timeout")
    return proc.returncode, out, err, time.monotonic() - start


def _check_one_error_line(code, out, err, took, error):
    assert code == 2, (code, out, err)
    assert JOIN_TIMEOUT_S <= took < JOIN_TIMEOUT_S + STARTUP_SLACK_S, took
    assert not any(mark in out + err for mark in CRASH_MARKS), out + err
    errors = [x for x in err.splitlines() if x.startswith("effijax train: error:")]
    assert errors == [error], err
    assert err.splitlines()[-1] == error, err  # the last word, nothing after it
    assert "did not" not in out  # the error goes to stderr only


@pytest.mark.slow
@pytest.mark.multiprocess
def test_process_0_without_its_partner_says_so_and_exits_2(tmp_path):
    port = free_port()
    code, out, err, took = _ended(_train(port, 2, 0, tmp_path))
    assert f"effijax train: process 0 of 2: waiting for 1 more at 127.0.0.1:{port}: process 1 " \
        f"(timeout {JOIN_TIMEOUT_S} s" in err, err
    _check_one_error_line(code, out, err, took, (
        f"effijax train: error: --num-processes=2: process 1 did not join 127.0.0.1:{port} "
        f"within {JOIN_TIMEOUT_S} s; start it with process id 1 and the same coordinator and "
        "process count, or lower the process count"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_process_1_without_process_0_says_so_and_exits_2(tmp_path):
    port = free_port()
    code, out, err, took = _ended(_train(port, 2, 1, tmp_path))
    assert f"effijax train: process 1 of 2: waiting for process 0 at 127.0.0.1:{port} " \
        f"(timeout {JOIN_TIMEOUT_S} s" in err, err
    assert out == ""  # only process 0 prints to stdout
    _check_one_error_line(code, out, err, took, (
        f"effijax train: error: --num-processes=2: process 0 did not answer at 127.0.0.1:{port} "
        f"within {JOIN_TIMEOUT_S} s; start process 0 (it hosts the coordinator) there with the "
        "same process count, and check that this host can reach that address"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_of_three_processes_both_name_the_third(tmp_path):
    port = free_port()
    # Process 1 would wait far longer: it stops when process 0 gives up, told who is missing.
    procs = [_train(port, 3, 0, tmp_path), _train(port, 3, 1, tmp_path, join_timeout=300)]
    for code, out, err, took in map(_ended, procs):
        _check_one_error_line(code, out, err, took, (
            f"effijax train: error: --num-processes=3: process 2 did not join 127.0.0.1:{port} "
            f"within {JOIN_TIMEOUT_S} s; start it with process id 2 and the same coordinator "
            "and process count, or lower the process count"))
