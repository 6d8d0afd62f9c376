"""Joining a run from its launcher's environment (SLURM, Open MPI, ...), and real launches.

The unit tests set a launcher's variables with monkeypatch and ask
:func:`effijax.distributed.find_launch` (nothing connects). The slow ones start `effijax train`
under Open MPI's `mpirun -np 2` and under an emulated `srun` (its variables set for two local
processes), 4 CPU devices each, and compare with one process of 8 devices: the check of
tests/test_multihost.py, with the launcher instead of flags, against the same run of one process
of 8 (conftest's ``one_process_of_eight``; the emulated srun's run is conftest's
``two_processes_of_four``, test_multihost's reference too; each launched once for both modules:
tests/_launch.py). All traffic stays on the loopback interface: each launch checks the
coordinator address before anything starts.
"""

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _gloo import not_gloo
from _launch import (
    ARGS,
    EVERY,
    STEPS,
    TIMEOUT_S,
    env,
    is_loopback,
    metrics,
    same_run,
    train,
    wait,
    without_launcher_variables,
)

from effijax import distributed
from effijax.errors import ConfigError
from effijax.recipe._config import CLUSTERS

LONG_S = 900  # the SIGTERM test's runs, on a 2-core machine that other jobs share
# Every real launch trains tests/_launch.py's run (ARGS); the SIGTERM test's signal comes to
# mpirun once the ranks train (their first step logged) and the ranks get it GRACE_S later, by
# step ~11 (see GRACE_S): they stop at 10 or 20, before STEPS.
MESH = {"data": 1, "fsdp": 8, "tensor": 1}
MPIRUN = ["mpirun", "-np", "2", "--allow-run-as-root", "--oversubscribe", "--tag-output",
          "--mca", "oob_tcp_if_include", "lo", "--mca", "btl_tcp_if_include", "lo"]


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables from the machine running the tests."""
    return without_launcher_variables(monkeypatch)


def _slurm(monkeypatch, procid=0, ntasks=2, nodes="localhost", job_id="4097", num_nodes=1):
    monkeypatch.setenv("SLURM_JOB_ID", str(job_id))
    monkeypatch.setenv("SLURM_NTASKS", str(ntasks))
    monkeypatch.setenv("SLURM_PROCID", str(procid))
    monkeypatch.setenv("SLURM_LOCALID", str(procid))
    monkeypatch.setenv("SLURM_STEP_NODELIST", nodes)
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", str(num_nodes))


def _ompi(monkeypatch, rank=1, size=2, local_size=2):
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "1423310848.0;tcp://127.0.0.1:53661")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", str(size))
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", str(rank))
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", str(rank))
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", str(local_size))


# --------------------------------------------------------------------------------------------
# Detection (no processes started)
# --------------------------------------------------------------------------------------------

def test_the_config_and_the_library_name_the_same_launchers():
    assert CLUSTERS == distributed.CLUSTERS


def test_srun_environment_gives_count_id_and_its_first_node_as_coordinator(clean_env):
    _slurm(clean_env, procid=1, nodes="node[003-005],gpu7", job_id=4096 * 3 + 5, num_nodes=2,
           ntasks=2)
    launch = distributed.find_launch()
    # jax's rule: the first host of the step, port 61440 + job id mod 4096.
    assert launch == (("node003:61445", 2, 1), "slurm", None)  # one task per node: all devices
    assert launch.describe() == "process 1 of 2 (launcher slurm), coordinator node003:61445"
    clean_env.setenv("SLURM_STEP_NUM_NODES", "1")  # both tasks on one node: one device each
    assert distributed.find_launch().local_device_ids == (1,)
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "3")  # srun --gpus-per-task bound one already
    assert distributed.find_launch().local_device_ids is None


def test_mpirun_environment_gives_count_id_and_the_launcher_host(clean_env):
    _ompi(clean_env, rank=1, size=2)
    launch = distributed.find_launch()
    assert launch.launcher == "ompi" and launch.settings[1:] == (2, 1)
    host, port = distributed.parse_address(launch.settings.coordinator_address)
    assert host == "127.0.0.1" and 65535 - 4096 < port <= 65535
    assert launch.local_device_ids == (1,)
    clean_env.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "1")
    assert distributed.find_launch().local_device_ids is None


def test_explicit_settings_win_over_the_launcher(clean_env):
    _slurm(clean_env, procid=1)
    assert distributed.find_launch("127.0.0.1:1234", 2, 0) == (("127.0.0.1:1234", 2, 0), "flags",
                                                                None)
    assert distributed.find_launch(num_processes=1).settings == (None, 1, 0)
    clean_env.setenv("EFFIJAX_NUM_PROCESSES", "4")
    clean_env.setenv("EFFIJAX_PROCESS_ID", "3")
    clean_env.setenv("EFFIJAX_COORDINATOR", "10.0.0.1:80")
    assert distributed.find_launch() == (("10.0.0.1:80", 4, 3), "environment", None)
    for name in ("EFFIJAX_NUM_PROCESSES", "EFFIJAX_PROCESS_ID"):
        clean_env.delenv(name)
    # A coordinator alone replaces only the launcher's address; JAX_COORDINATOR_PORT its port.
    assert distributed.find_launch() == (("10.0.0.1:80", 2, 1), "slurm", (1,))
    clean_env.delenv("EFFIJAX_COORDINATOR")
    clean_env.setenv("JAX_COORDINATOR_PORT", "5555")
    assert distributed.find_launch().settings.coordinator_address == "localhost:5555"
    assert distributed.find_launch(cluster="none").settings == (None, 1, 0)


def test_a_launcher_of_one_process_is_a_single_process_run(clean_env):
    _slurm(clean_env, procid=0, ntasks=1)
    assert distributed.find_launch() == ((None, 1, 0), "slurm", None)
    assert distributed.find_launch().describe() == "1 process (launcher slurm)"


@pytest.mark.parametrize("setup, match", [
    # srun's step, with a variable dropped on the way (a container, a wrapper script).
    (lambda m: (_slurm(m), m.delenv("SLURM_PROCID")),
     r"cluster='slurm': srun's step environment lacks SLURM_PROCID"),
    (lambda m: _slurm(m, procid=2, ntasks=2),
     r"SLURM_PROCID=2: outside \[0, SLURM_NTASKS=2\)"),
    (lambda m: (_slurm(m), m.setenv("SLURM_NTASKS", "two")),
     r"SLURM_NTASKS='two': must be an integer"),
    (lambda m: (_ompi(m), m.delenv("OMPI_COMM_WORLD_RANK")),
     r"cluster='ompi': mpirun's environment lacks OMPI_COMM_WORLD_RANK"),
    # Open MPI 5 sets the rank variables but not the URI jax reads.
    (lambda m: (_ompi(m), m.delenv("OMPI_MCA_orte_hnp_uri")),
     r"OMPI_COMM_WORLD_SIZE is set but not OMPI_MCA_orte_hnp_uri.*--num-processes "
     r"\$OMPI_COMM_WORLD_SIZE"),
    (lambda m: (m.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1"),
                m.setenv("JOB_COMPLETION_INDEX", "3")),
     r"Kubernetes indexed Job \(JOB_COMPLETION_INDEX=3\).*pip install 'jax\[k8s\]'"),
])
def test_a_partial_or_inconsistent_launcher_environment_is_an_error(clean_env, setup, match):
    if "Kubernetes" in match and importlib.util.find_spec("kubernetes") is not None:
        pytest.skip("the kubernetes package is installed here: that environment is complete")
    setup(clean_env)
    with pytest.raises(ConfigError, match=match):
        distributed.find_launch()
    with pytest.raises(ConfigError, match=match):  # initialize checks before connecting
        distributed.initialize()


def test_forced_launchers_and_ids_the_launcher_owns(clean_env):
    with pytest.raises(ConfigError, match=r"cluster='slurm': no srun task environment here "
                                          r"\(missing SLURM_JOB_ID"):
        distributed.find_launch(cluster="slurm")
    with pytest.raises(ConfigError, match=r"cluster='ompi': no Open MPI 4 task environment"):
        distributed.find_launch(cluster="ompi")
    with pytest.raises(ConfigError, match=r"cluster='pbs': choose one of auto, none"):
        distributed.find_launch(cluster="pbs")
    _slurm(clean_env, procid=1)
    assert distributed.find_launch(cluster="slurm").launcher == "slurm"
    with pytest.raises(ConfigError, match=r"process_id=0: slurm numbers the processes"):
        distributed.find_launch(process_id=0)
    # Nothing found under auto: a plain single process, as before.
    clean_env.delenv("SLURM_STEP_NODELIST")
    for name in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"):
        clean_env.delenv(name)
    assert distributed.find_launch() == ((None, 1, 0), None, None)


def test_the_cli_refuses_an_unknown_launcher_before_starting_jax(capsys):
    from effijax.cli import main

    with pytest.raises(SystemExit) as refused:  # argparse's refusal, before any work
        main(["train", "--cluster", "pbs"])
    assert refused.value.code == 2 and "invalid choice: 'pbs'" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Real launches: mpirun and an emulated srun, each against one process of 8 devices
# --------------------------------------------------------------------------------------------
#
# Two launches of the run (tests/_launch.py lists them all): the emulated srun's, uninterrupted,
# is conftest's ``two_processes_of_four``, shared with test_multihost (its comparison with one
# process of 8 devices here, and the bitwise reference of both modules' SIGTERM tests: how the
# processes found each other changes no bit of the same program on the same devices); mpirun's,
# stopped by SIGTERM and resumed, serves two tests (the SIGTERM test, and mpirun's comparison
# with one process of 8 devices: its steps before the stop and after the resume, its summary
# and its printed lines).

_TAG = re.compile(r"\[1,(\d+)\]<std(?:out|err)>:")


def _by_rank(tagged: str) -> dict[int, list[str]]:
    """mpirun --tag-output lines ('[1,0]<stdout>:text') by the rank of their first tag.

    mpirun tags each chunk it reads, so a line written in pieces carries a tag before each
    piece ('[1,1]<stdout>:[Gloo] Rank [1,1]<stdout>:1 is connected ...'): the later tags go.
    """
    lines = {0: [], 1: []}
    for line in tagged.splitlines():
        first = _TAG.match(line)
        if first:
            lines[int(first.group(1))].append(_TAG.sub("", line))
    return lines


needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason=(
    "Open MPI's mpirun is not installed (apt-get install openmpi-bin; .ci/run installs it)"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_emulated_srun_two_processes_match_one_process_of_eight(two_processes_of_four,
                                                                 one_process_of_eight):
    out, coordinator, out0, out1 = two_processes_of_four
    assert (f"effijax train: process 0 of 2 (launcher slurm), coordinator "
            f"{coordinator}") in out0
    assert f"done: {STEPS} steps" in out0 and not_gloo(out1.splitlines()) == []
    same_run(out, one_process_of_eight, STEPS, MESH)


# Open MPI 4.1's mpirun, on SIGTERM, sends SIGTERM to every rank after odls_base_sigkill_timeout
# seconds (default 1) and SIGKILL after as many again: the ranks get that long to reach a step
# boundary and save. (Measured here: with the default, a rank's SIGTERM handler runs and the
# rank is killed a second later. With 10 s, a loaded machine, whose steps sometimes stall for
# seconds, failed to reach the step where the ranks agree to stop, ten steps at most, in time.)
GRACE_S = 20
# The signalled run must still be training GRACE_S after mpirun got the signal. Until its ranks
# get SIGTERM its batches take BATCH_DELAY_S each (tests/_slow_batches_train.py: a slow data
# pipeline, same numbers), so it makes at most GRACE_S / BATCH_DELAY_S = 10 steps past the step
# at which mpirun got the signal (the first logged one: both ranks are in the training loop,
# their SIGTERM handlers installed, and none of the grace passes before they are) before then,
# however fast the machine: its ranks have it by step ~11, and stop at 10 or 20, before
# STEPS = 24, without hundreds of steps. From the signal on it runs at full speed to the step
# where the ranks agree to stop. (Signalling at the first checkpoint instead only waited EVERY
# slow batches more before the grace began.)
BATCH_DELAY_S = 2.0
SLOW_BATCHES = Path(__file__).with_name("_slow_batches_train.py")


def _own_output(directory: Path) -> list[str]:
    """A command prefix under which each rank writes its stdout and stderr to
    ``directory/RANK.out`` itself. mpirun forwards its ranks' output from an event loop that
    sleeps through its kill sequence (GRACE_S before the SIGTERM, and as long again before the
    SIGKILL, even once every rank has exited: measured, 18 s of 20): with the output in files,
    the test need not wait out the second sleep to read what the ranks said."""
    return ["sh", "-c", f'exec "$0" "$@" > "{directory}/$OMPI_COMM_WORLD_RANK.out" 2>&1']


def _wait_for_ranks(proc: subprocess.Popen, timeout: float) -> None:
    """Until every rank (child) of mpirun ``proc`` has exited, then kills mpirun's session (it
    would sleep on before exiting; its ranks are done). Where /proc lists no children, waits
    for mpirun itself."""
    tasks = Path(f"/proc/{proc.pid}/task")
    deadline = time.monotonic() + timeout
    while proc.poll() is None and (tasks / str(proc.pid) / "children").exists():
        try:
            children = [c for t in tasks.iterdir()
                        for c in (t / "children").read_text().split()]
            # A rank that has exited stays a zombie (state Z) until mpirun reaps it.
            ended = all(Path(f"/proc/{c}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
                        for c in children)
        except OSError:  # mpirun reaped a rank, or exited, while we read: look again
            ended = False
        if ended:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        if time.monotonic() > deadline:
            wait([proc], 1)  # kills, fails
        time.sleep(0.05)
    proc.communicate(timeout=timeout)


@pytest.fixture(scope="module")
def under_mpirun(tmp_path_factory, launch_corpus, launch_cache):
    """The run under ``mpirun -np 2``, 4 devices each, stopped by SIGTERM to mpirun once its
    ranks train (its first step logged) and resumed under mpirun to the end. Returns the run
    directory, its last step and newest checkpoint as the stop left them, what ranks 0 and 1
    said until the stop, and mpirun's tagged stdout of the resumption.

    Before anything trains, both ranks of a bare ``mpirun -np 2`` must see one loopback
    coordinator, from mpirun alone."""
    # One write per rank: mpirun --tag-output tags each chunk it reads, so print's separate
    # writes (under PYTHONUNBUFFERED, as in CI) interleaved the two ranks mid-line.
    probe = subprocess.run(
        [*MPIRUN, sys.executable, "-c", "import os; from effijax.distributed import find_launch; "
         "l = find_launch(); os.write(1, ' '.join(map(str, (l.launcher, *l.settings))).encode() + "
         "b'\\n')"],
        capture_output=True, text=True, env=env(), timeout=TIMEOUT_S)
    assert probe.returncode == 0, probe.stderr
    seen = {tuple(lines[-1].split()) for lines in _by_rank(probe.stdout).values()}
    assert len(seen) == 2, probe.stdout
    (launcher, address, count, _), _ = sorted(seen)
    assert launcher == "ompi" and count == "2" and is_loopback(address), seen

    tmp = tmp_path_factory.mktemp("mpirun")
    args = [*ARGS, "--data", launch_corpus, "--cpu-devices", "4"]
    # Its session directory under tmp: mpirun, killed once its ranks are done (see
    # _wait_for_ranks), leaves it behind.
    launcher = [*MPIRUN, "--mca", "odls_base_sigkill_timeout", str(GRACE_S),
                "--mca", "orte_tmpdir_base", str(tmp)]
    run = tmp / "run"
    # The helper runs as a script: put this checkout's package first on its path.
    repo = str(SLOW_BATCHES.resolve().parents[1])
    slow = env(**launch_cache, EFFIJAX_TEST_BATCH_DELAY_S=BATCH_DELAY_S, PYTHONPATH=os.pathsep.join(
        [repo, *filter(None, [os.environ.get("PYTHONPATH")])]))
    said = tmp / "ranks"
    said.mkdir()
    proc = subprocess.Popen([*launcher, *_own_output(said), sys.executable, str(SLOW_BATCHES),
                             "train", *args, "--out", str(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=slow, start_new_session=True)
    checkpoints, logged = run / "checkpoints", run / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    while not (logged.is_file() and logged.read_text().strip()):
        assert proc.poll() is None, "mpirun exited before the first step"
        if time.monotonic() > deadline:
            wait([proc], 1)  # kills, fails
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)  # to mpirun, as a scheduler's preemption does
    _wait_for_ranks(proc, timeout=LONG_S)
    last = metrics(run)[-1]["step"]
    saved = max(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    out0, out1 = ((said / f"{rank}.out").read_text() for rank in (0, 1))

    # The resumed run reads its batches at full speed and loads the programs around the step
    # from the cache.
    (resumed, _), = wait([train([*args, "--out", str(run)], env(**launch_cache), MPIRUN)],
                         LONG_S)
    return run, last, saved, out0, out1, resumed


@needs_mpirun
@pytest.mark.slow
@pytest.mark.multiprocess
def test_mpirun_two_processes_of_four_devices_match_one_process_of_eight(
        under_mpirun, one_process_of_eight):
    out, _, _, _, _, stdout = under_mpirun
    lines = _by_rank(stdout)
    assert any(x.startswith("effijax train: process 0 of 2 (launcher ompi), coordinator "
                            "127.0.0.1:") for x in lines[0]), stdout
    assert any(f"done: {STEPS} steps" in x for x in lines[0]) and not_gloo(lines[1]) == [], stdout
    # Its steps before the stop and after the resumption, its eval, partitioned program and
    # memory: as one process of 8 devices.
    same_run(out, one_process_of_eight, STEPS, MESH)


@needs_mpirun
@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_through_mpirun_stops_both_at_one_step_and_resumes_exactly(
        under_mpirun, two_processes_of_four):
    run, last, saved, out0, out1, out = under_mpirun
    assert EVERY <= last < STEPS, f"stopped at {last}: the signal must land mid-run"
    # mpirun forwards the signal to each rank in turn: rank 0 has it by the processes' exchange,
    # or hears of it there as rank 1's. Either way it names the signal, and both stop together.
    assert re.search(rf"effijax train: stopped at step {last} by SIGTERM( to process 1)?; "
                     "saved; resume with: effijax train", out0), out0 + out1
    assert saved == last

    assert f"resuming from step {last}" in out and f"done: {STEPS} steps" in out
    # The steps after the stop must agree bit for bit with an uninterrupted run's (the emulated
    # srun's: the same program on the same devices).
    straight, _, _, _ = two_processes_of_four
    resumed, reference = metrics(run), metrics(straight)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in reference]
