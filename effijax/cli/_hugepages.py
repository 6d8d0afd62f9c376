"""Transparent huge pages for the program's large buffers (Linux with glibc 2.35 or later).

XLA:CPU allocates an executable's temporaries afresh on every call, and glibc serves an
allocation above its mmap threshold (32 MB at most; any size a worker thread's arena cannot
hold) with a fresh anonymous mapping, unmapped again when it is freed. Every 4 KiB page of a
train step's temporaries therefore faults, and is zeroed by the kernel, on every step: the LoRA
step of Gemma 3 270M at 4 x 128 tokens faulted about 600,000 pages (2.35 GB) a step on this
project's 2-core host, 2.0-3.7 s of system time. With glibc's tunable ``glibc.malloc.hugetlb=1``
malloc asks the kernel for transparent huge pages on its mappings (``madvise``), and the same
step faults about 12,000 times. Measured with ``benchmarks/finetune.py`` on that host, the same
code with and without the tunable: the LoRA step of Gemma 3 270M at 4 x 128 tokens 8.64 -> 7.96 s
(median), SmolLM2's at 4 x 512 21.1 -> 19.2 s; ``transformers`` + ``peft`` in the same process
gains as much on SmolLM2 (22.1 -> 19.9 s), so the ratio between the two stays where it was. In
a process of its own, peft's bf16 LoRA step at 4 x 128 is slower with it (2.07 s against 1.89,
side by side), so the benchmark times torch without it.

glibc reads its tunables once, when the process starts, so the ``effijax`` commands that run
compiled steps (:data:`COMMANDS`) re-execute themselves with the tunable added to
``GLIBC_TUNABLES`` before they import anything heavy: same interpreter, same arguments, same
process id (``memory``, ``plan``, ``data`` and ``--help`` start once, as before). A benchmark
that measures what ``effijax train`` runs calls
``effijax.cli.reexec_with_hugepages(script=True)`` first. ``EFFIJAX_HUGEPAGES=0`` turns this
off; nothing happens where the tunable is already set, off Linux, under another C library, or
where the kernel's transparent huge pages are ``never``, nor in a Python program of the user's
that calls :func:`effijax.cli.main` (its code before the call would run twice). A library user
(a notebook, a script) starts Python with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` for the same
effect.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence

__all__ = ["COMMANDS", "SWITCH", "TUNABLE", "host", "reexec_command",
           "reexec_with_hugepages"]

# The subcommands whose steps allocate XLA's temporaries over and over.
COMMANDS = ("train", "eval", "generate")
TUNABLE = "glibc.malloc.hugetlb=1"
SWITCH = "EFFIJAX_HUGEPAGES"
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def reexec_command(environ: Mapping[str, str], orig_argv: Sequence[str], executable: str,
                   libc: str, platform: str, thp: str | None, *, script: bool = False
                   ) -> tuple[list[str], dict[str, str]] | None:
    """The command line and environment to re-execute the program with, or None to go on as is.

    Args:
      environ: the process's environment.
      orig_argv: the interpreter's own command line (``sys.orig_argv``).
      executable: the interpreter (``sys.executable``).
      libc: ``os.confstr("CS_GNU_LIBC_VERSION")`` (``"glibc 2.36"``), ``""`` where unknown.
      platform: ``sys.platform``.
      thp: the kernel's transparent huge page setting (the file's text), None where unreadable.
      script: re-execute whatever program the interpreter runs (a script that calls this first
        thing), not only ``effijax`` itself.

    Example:
      >>> cmd, env = reexec_command({"PATH": "/bin"}, ["python3", "-m", "effijax", "train"],
      ...                           "/usr/bin/python3", "glibc 2.36", "linux",
      ...                           "always [madvise] never")
      >>> cmd, env["GLIBC_TUNABLES"]
      (['/usr/bin/python3', '-m', 'effijax', 'train'], 'glibc.malloc.hugetlb=1')
      >>> reexec_command({**env}, cmd, "/usr/bin/python3", "glibc 2.36", "linux", "[madvise]")
      >>> reexec_command({}, cmd, "/usr/bin/python3", "glibc 2.31", "linux", "[madvise]")
    """
    if environ.get(SWITCH, "1").strip() == "0" or platform != "linux":
        return None
    if "glibc.malloc.hugetlb" in environ.get("GLIBC_TUNABLES", ""):
        return None  # set by the user or by an earlier execution of this function
    version = re.fullmatch(r"glibc (\d+)\.(\d+).*", libc or "")
    if version is None or (int(version[1]), int(version[2])) < (2, 35):
        return None
    if thp is None or "[never]" in thp or not executable or not orig_argv:
        return None
    if not script and not _runs_effijax(orig_argv):
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    env = {**environ, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}" if tunables else TUNABLE}
    return [executable, *orig_argv[1:]], env


def _runs_effijax(orig_argv: Sequence[str]) -> bool:
    """Whether the interpreter runs the program itself (``python -m effijax``, the console
    script): a user's script that calls ``effijax.cli.main()`` is not re-executed, since its own
    code before that call would run twice."""
    args = list(orig_argv[1:])
    if any(a == "-m" and b == "effijax" for a, b in zip(args, args[1:], strict=False)):
        return True
    return any(os.path.basename(a) == "effijax" and os.path.isfile(a) for a in args[:3])


def host() -> tuple[str, str | None]:
    """This host's C library and transparent-huge-page setting, as :func:`reexec_command` takes
    them: ``(libc, thp)``, ``""`` and None where they cannot be read.

    Example:
      >>> libc, thp = host()
      >>> isinstance(libc, str)
      True
    """
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError, AttributeError):
        libc = ""
    try:
        with open(_THP) as f:
            thp = f.read()
    except OSError:
        thp = None
    return libc, thp


def reexec_with_hugepages(*, script: bool = False) -> None:
    """Replaces this process with the same command under :data:`TUNABLE` where
    :func:`reexec_command` says so; returns (doing nothing) otherwise, or if the exec fails.

    ``script=True`` re-executes a Python program of the caller's own (a benchmark measuring
    what ``effijax train`` runs): call it first thing, since the program restarts from its top.

    Example:
      >>> from effijax.cli import reexec_with_hugepages
      >>> reexec_with_hugepages()  # in a test: not the effijax program, so it returns
    """
    libc, thp = host()
    found = reexec_command(os.environ, getattr(sys, "orig_argv", []), sys.executable, libc,
                           sys.platform, thp, script=script)
    if found is None:
        return
    command, env = found
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(command[0], command, env)
    except OSError:
        return  # the program runs on as it is, without huge pages
