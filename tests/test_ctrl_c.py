"""Ctrl-C (SIGINT) at any moment of `effijax train` before its first step: one line, exit 130.

The slow tests start the program itself (`python -m effijax ...`, which owns SIGINT), wait for
a moment they can see from outside, without a hook in the code under test, send SIGINT, and
then run the same command again, which must start (or resume) and finish normally:

* during imports: jaxlib's shared library is mapped into the process (``/proc/PID/maps``), so
  ``import jax`` is under way (Python used to crash freeing the half-imported extension);
* during compilation: the run directory's lock names the process and its checkpoint folder
  exists (what the run does last before it initialises the state and compiles the step:
  seconds of XLA's threads at work, which used to crash at exit), with no compilation cache,
  so the compilation really runs;
* during a resume's restore: the lock names the process, in a directory that holds a finished
  3-step run, with a command that raises ``--steps``;
* after the first line (`effijax train: tiny GPT, ...`, printed once compiled): the loop may
  have taken the signal over (a stop that saves and exits 0), or the run may be in its final
  save or evaluation (exit 130): either, never a traceback.

`effijax eval` and `effijax generate` say `effijax COMMAND: interrupted` and exit 130 too.
(`effijax memory` and `effijax data` end within a few tenths of a second, most of it Python's
own start-up: there is no moment to catch reliably; they share the handler.) The processes
share one JAX compilation cache, filled by the first complete run, so the later runs load
their executables instead of compiling them. That first complete run is the same command run
again after the interrupt during imports (which made nothing: the rerun is a fresh run), so the
module starts one process fewer than a test of its own would; and only the process interrupted
during compilation compiles as a user's run does (XLA's default optimisation, a compilation
long enough to interrupt): the others load, or compile once, as the suite's other processes do
(``JAX_DISABLE_MOST_OPTIMIZATIONS``, tests/conftest.py).

The fast tests: the line `effijax train` says for each state of its run directory; the
handler flushes what was printed before its line; a library call (`main(argv)`) and a SIGINT
the parent ignores are left alone.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from _run_env import compiles_as_the_suite, run_env

from effijax.cli import main
from effijax.cli._train import _interrupted
from effijax.recipe import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["train", "--model", "tiny", "--seq-len", "32", "--batch-size", "4", "--steps", "3",
         "--no-progress"]
JAXLIB = "libjax_common.so"
LINE = ("effijax train: interrupted before the first checkpoint; nothing was saved (run the "
        "same command to start again)")
# The tests that run the commands watch them through /proc.
linux = pytest.mark.skipif(not sys.platform.startswith("linux"),
                           reason="watches the process through /proc")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return run_env(tmp_path_factory.mktemp("ctrl_c"))


@pytest.fixture(scope="module")
def first_run(env):
    """The module's first command, SIGINT while ``import jax`` is under way (jaxlib's library
    mapped), then the same command again, which trains the finished 3-step run every later test
    starts from (and fills the compilation cache). What test_during_imports asserts is kept:
    the interrupt's ``(exit code, stdout, stderr)`` (or the failure that kept it from coming),
    whether the interrupted process had made the run directory, and the rerun's output. The
    rerun's own exit code is asserted here: every test needs its run."""
    out = env["root"] / "finished"
    argv = [*TRAIN, "--out", str(out)]
    proc = _Proc(env, argv, cache=True)
    try:
        proc.wait_until(lambda: proc.maps(JAXLIB))
        interrupted = proc.interrupt()
    except AssertionError as e:  # test_during_imports raises it; the run is still needed
        interrupted = e
    finally:
        proc.end()
    made = out.exists()
    return {"out": out, "interrupted": interrupted, "made": made,
            "rerun": _complete(env, argv)}


@pytest.fixture(scope="module")
def finished(first_run):
    """A finished 3-step run (its command was first interrupted during imports)."""
    return first_run["out"]


@pytest.fixture
def spawn(env):
    """Starts ``python -m effijax ARGV``; whatever a test leaves running is killed."""
    started = []

    def start(argv, cache=True):
        started.append(_Proc(env, argv, cache))
        return started[-1]

    yield start
    for proc in started:
        proc.end()


class _Proc:
    """A started command (in its own process group), its output read as it comes."""

    def __init__(self, env, argv, cache):
        run_env = dict(env["env"])
        if not cache:  # it compiles: as long as a user's compilation, to be interrupted
            run_env.pop("JAX_COMPILATION_CACHE_DIR")
            run_env.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
            run_env = compiles_as_the_suite(run_env)
        self.popen = subprocess.Popen([sys.executable, "-m", "effijax", *argv], env=run_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True)
        self.out, self.err = [], []
        self.readers = [threading.Thread(target=lambda s=s, d=d: d.extend(s), daemon=True)
                        for s, d in ((self.popen.stdout, self.out),
                                     (self.popen.stderr, self.err))]
        for r in self.readers:
            r.start()

    def wait_until(self, seen, timeout=240.0) -> None:
        """Until ``seen()`` is true; fails if the process ends first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise AssertionError(f"ended (exit {self.popen.returncode}) before the moment "
                                     f"came:\n{''.join(self.out)}{''.join(self.err)[-3000:]}")
            if seen():
                return
            time.sleep(0.005)
        raise AssertionError("the moment never came")

    def maps(self, name: str) -> bool:
        try:
            return name in Path(f"/proc/{self.popen.pid}/maps").read_text()
        except OSError:
            return False

    def locked(self, out: Path) -> bool:
        try:
            return json.loads((out / ".effijax.lock").read_text() or "{}").get(
                "pid") == self.popen.pid
        except (OSError, ValueError):  # not there yet, or between truncation and write
            return False

    def interrupt(self, timeout=120.0) -> tuple[int, str, str]:
        """SIGINT, then ``(exit code, stdout, stderr)``."""
        self.popen.send_signal(signal.SIGINT)
        try:
            self.popen.wait(timeout)
        finally:
            self.end()
        return self.popen.returncode, "".join(self.out), "".join(self.err)

    def end(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()
        for r in self.readers:
            r.join(10)
        self.popen.stdout.close()
        self.popen.stderr.close()


def _complete(env, argv) -> str:
    proc = subprocess.run([sys.executable, "-m", "effijax", *argv], env=env["env"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _assert_one_line(code, stdout, stderr, line):
    assert "Traceback" not in stdout + stderr, stderr
    assert "Segmentation fault" not in stdout + stderr, stderr
    assert code == 130, f"exit {code}\n{stdout}\n{stderr[-3000:]}"
    assert stderr.splitlines() == [line], stderr


@linux
@pytest.mark.slow
def test_during_imports(first_run):
    # The interrupted command and its rerun are the module's first run (see first_run).
    interrupted = first_run["interrupted"]
    if isinstance(interrupted, AssertionError):
        raise interrupted
    _assert_one_line(*interrupted, LINE)
    assert not first_run["made"]  # nothing was made
    assert "done: 3 steps" in first_run["rerun"]


@linux
@pytest.mark.slow
def test_during_compilation(env, finished, spawn):
    out = env["root"] / "compile"
    argv = [*TRAIN, "--out", str(out)]
    proc = spawn(argv, cache=False)
    proc.wait_until(lambda: proc.locked(out) and (out / "checkpoints").is_dir())
    code, stdout, stderr = proc.interrupt()
    _assert_one_line(code, stdout, stderr, LINE)
    assert stdout == ""  # the first line comes once the step is compiled
    # What the run had made: its lock (released by the kernel) and its checkpoint folder.
    assert sorted(p.name for p in out.iterdir()) == [".effijax.lock", "checkpoints"]
    assert not any((out / "checkpoints").iterdir())
    assert "done: 3 steps" in _complete(env, argv)


@linux
@pytest.mark.slow
def test_during_a_resumes_restore(env, finished, spawn):
    out = env["root"] / "resume"
    shutil.copytree(finished, out)
    metrics, config = (out / "metrics.jsonl").read_text(), (out / "config.json").read_text()
    argv = [*TRAIN, "--out", str(out), "--steps", "6", "--allow-changes", "steps"]
    proc = spawn(argv)
    proc.wait_until(lambda: proc.locked(out))
    _assert_one_line(*proc.interrupt(), "effijax train: interrupted; nothing after step 3 "
                     "was saved (run the same command to resume from it)")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["3"]
    assert (out / "metrics.jsonl").read_text() == metrics
    assert (out / "config.json").read_text() == config
    stdout = _complete(env, argv)
    assert "resuming from step 3 in" in stdout, stdout
    assert "done: 6 steps (3 after resuming at 3)" in stdout, stdout
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]


@linux
@pytest.mark.slow
def test_after_the_first_line(env, finished, spawn):
    out = env["root"] / "first-line"
    argv = [*TRAIN, "--out", str(out)]
    proc = spawn(argv)
    proc.wait_until(lambda: any(x.startswith("effijax train: tiny GPT") for x in proc.out))
    code, stdout, stderr = proc.interrupt()
    assert "Traceback" not in stdout + stderr and "Segmentation fault" not in stdout + stderr
    if code == 0:  # the loop had taken SIGINT over: it stopped at a step boundary and saved
        assert "by SIGINT; saved; resume with: effijax train" in stdout, stdout
        assert stderr == ""
    else:  # before the loop, or in the final save, evaluation or summary after it
        assert code == 130, f"exit {code}\n{stdout}\n{stderr[-3000:]}"
        assert len(stderr.splitlines()) == 1 and stderr.startswith("effijax train: interrupted")
    stdout = _complete(env, argv)  # resumes, or finds the run finished (its last step saved)
    assert "done: 3 steps" in stdout or "already holds this run, finished at step 3" in stdout


@linux
@pytest.mark.slow
@pytest.mark.parametrize("command", ["eval", "generate"])
def test_other_commands_say_one_line(env, finished, spawn, command):
    argv = {"eval": ["eval", "--from", str(finished), env["corpus"], "--seq-len", "32"],
            "generate": ["generate", "--from", str(finished), "--prompt", "def"]}[command]
    proc = spawn(argv)
    proc.wait_until(lambda: proc.maps(JAXLIB))
    _assert_one_line(*proc.interrupt(), f"effijax {command}: interrupted")


def test_the_line_says_what_the_run_directory_holds(tmp_path):
    config = TrainConfig(out=str(tmp_path / "run"), steps=6)
    output = config.sections.output
    assert _interrupted(output, 6) == LINE  # not even created
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    # A write in flight, and a damaged step set aside, are not checkpoints.
    (folder / "2.orbax-checkpoint-tmp").mkdir()
    (folder / "4.corrupt-1").mkdir()
    assert _interrupted(output, 6) == LINE
    (folder / "2").mkdir()
    (folder / "10").write_text("")  # a file, not a step
    assert _interrupted(output, 6) == ("effijax train: interrupted; nothing after step 2 was "
                                    "saved (run the same command to resume from it)")
    (folder / "6").mkdir()
    assert _interrupted(output, 6) == (
        "effijax train: interrupted after the last step (6) was saved, before the final "
        "evaluation, exports and summary.json were written (run the same command to complete "
        "them)")
    (tmp_path / "run" / "summary.json").write_text(json.dumps({"steps": 6}))
    assert _interrupted(output, 6) == "effijax train: interrupted; the run had finished at step 6"
    unsaved = TrainConfig(out=str(tmp_path / "run"), checkpoints=False).sections.output
    assert _interrupted(unsaved, 6) == (
        "effijax train: interrupted; nothing was saved (--no-checkpoints; run the same command "
        "to start again)")


HANDLER = textwrap.dedent("""
    import os, signal, sys, time
    from effijax.cli import _interrupt
    if sys.argv[1] == "ignored":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    print("installed" if _interrupt.install("memory") else "left alone")  # block-buffered
    _interrupt.describe(lambda: "effijax memory: interrupted while " + sys.argv[1])
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1)  # the handler runs here
    print("went on")
""")


@pytest.mark.parametrize("parent", ["default", "ignored"])
def test_the_handler_flushes_then_says_one_line(parent):
    proc = subprocess.run([sys.executable, "-c", HANDLER, parent], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if parent == "ignored":  # nohup, or a background job of a script: it stays ignored
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, "left alone\nwent on\n", "")
    else:
        assert (proc.returncode, proc.stdout, proc.stderr) == (
            130, "installed\n", "effijax memory: interrupted while default\n")


def test_a_library_call_keeps_its_keyboard_interrupt(capsys):
    before = signal.getsignal(signal.SIGINT)
    assert main(["memory", "--params", "7B"]) == 0
    assert signal.getsignal(signal.SIGINT) is before
    assert "model states" in capsys.readouterr().out
