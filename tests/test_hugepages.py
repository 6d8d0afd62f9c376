"""The program re-executes itself once with glibc's transparent-huge-page tunable
(effijax.cli._hugepages): the decision as a pure function, and the exec itself."""

import os
import subprocess
import sys

import pytest

from effijax.cli import _hugepages
from effijax.cli._hugepages import TUNABLE, reexec_command

PY = "/usr/bin/python3"
ARGV = ["python3", "-m", "effijax", "train", "--steps", "3"]
THP = "always [madvise] never"


def test_the_command_is_the_same_program_with_the_tunable_added():
    found = reexec_command({"HOME": "/h", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, ARGV,
                           PY, "glibc 2.39", "linux", THP)
    assert found is not None
    command, env = found
    assert command == [PY, "-m", "effijax", "train", "--steps", "3"]
    assert env == {"HOME": "/h", "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{TUNABLE}"}


@pytest.mark.parametrize("environ, libc, platform, thp", [
    ({_hugepages.SWITCH: "0"}, "glibc 2.36", "linux", THP),  # turned off
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "glibc 2.36", "linux", THP),  # the user's
    ({"GLIBC_TUNABLES": TUNABLE}, "glibc 2.36", "linux", THP),  # already re-executed
    ({}, "glibc 2.34", "linux", THP),  # no such tunable before 2.35
    ({}, "", "linux", THP),  # musl or unknown
    ({}, "glibc 2.36", "darwin", THP),
    ({}, "glibc 2.36", "linux", "always madvise [never]"),  # the kernel gives none
    ({}, "glibc 2.36", "linux", None),  # no such file
])
def test_nothing_happens_where_it_cannot_help(environ, libc, platform, thp):
    assert reexec_command(environ, ARGV, PY, libc, platform, thp) is None


@pytest.mark.parametrize("orig_argv", [["python3", "my_script.py"], ["python3", "-c", "..."],
                                       ["python3", "-m", "my_package"], []])
def test_only_the_program_itself_re_executes(orig_argv):
    """A user's script calling effijax.cli.main() would run its own code twice."""
    assert reexec_command({}, orig_argv, PY, "glibc 2.36", "linux", THP) is None


def test_a_benchmark_asks_for_its_own_script():
    """benchmarks/finetune.py measures what `effijax train` runs: it re-executes itself."""
    found = reexec_command({}, ["python3", "benchmarks/finetune.py", "--write"], PY, "glibc 2.36",
                           "linux", THP, script=True)
    assert found == ([PY, "benchmarks/finetune.py", "--write"], {"GLIBC_TUNABLES": TUNABLE})
    assert reexec_command({_hugepages.SWITCH: "0"}, ["python3", "b.py"], PY, "glibc 2.36",
                          "linux", THP, script=True) is None
    assert reexec_command({}, [], PY, "glibc 2.36", "linux", THP, script=True) is None


def _eligible() -> bool:
    libc, thp = _hugepages.host()
    return reexec_command({}, ["python", "-m", "effijax"], sys.executable, libc, sys.platform,
                          thp) is not None


PROBE = ("import os, sys\n"
         "print('start', os.environ.get('GLIBC_TUNABLES'), os.getpid(), flush=True)\n"
         "from effijax.cli._hugepages import reexec_with_hugepages\n"
         "reexec_with_hugepages()\n"
         "print('on', os.environ.get('GLIBC_TUNABLES'), os.getpid(), flush=True)\n")


@pytest.mark.skipif(not _eligible(), reason="needs Linux, glibc >= 2.35 and transparent huge "
                    "pages not set to never")
@pytest.mark.parametrize("switch", ["1", "0"])
def test_the_process_re_executes_once_with_the_same_id(switch, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env[_hugepages.SWITCH] = switch
    program = tmp_path / "effijax"  # what the console script is called
    program.write_text(PROBE)
    out = subprocess.run([sys.executable, str(program)], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split("\n")
    pid = out[0].split()[-1]
    if switch == "1":
        assert out[:3] == [f"start None {pid}", f"start {TUNABLE} {pid}", f"on {TUNABLE} {pid}"]
    else:
        assert out[:2] == [f"start None {pid}", f"on None {pid}"]
