"""EffijaxLM in a run of 2 JAX processes (2 CPU devices each, gloo on 127.0.0.1) answers the
shipped tasks as one process on one device does.

Both processes run ``lm_eval.simple_evaluate`` over the shipped tasks on the tiny model
(tests/_harness_worker.py); ``EffijaxLM`` splits each batch's rows over the mesh of all 4
devices, both processes' (each process's devices score their block), and gathers the answers
onto every process. Every request's answer is compared with this test process's own run on one
device: log-likelihoods (plain and rolling) to 1e-5 nats, greedy generations the same text,
the tasks' metrics the same; and the two processes return the same results. Timeouts turn a
hang into a failure.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="the harness tests need lm-evaluation-harness "
                    "(pip install 'effijax[eval]')")
pytest.importorskip("gguf", reason="the tiny model is written as a GGUF file")

from _harness_worker import LIMIT, SETTINGS, TASKS, answers  # noqa: E402
from _launch import env, free_port, wait  # noqa: E402

PROCESSES, DEVICES = 2, 2
TIMEOUT_S = 300
# The same rows scored in batches of 8 on one device and of 2 rows per device on four: XLA:CPU
# may block the two shapes' matmuls differently, so a sum could differ in its last f32 bits
# (measured here: equal to the bit, sums of 116 to 3,360 nats); a wrong token or position moves
# it by ~0.1.
ATOL = 1e-5


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from _harness_models import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("processes") / "tiny.gguf",
                           SETTINGS["max_length"])


@pytest.fixture(scope="module")
def two_processes(tiny_gguf, tmp_path_factory):
    """Both processes' records (tests/_harness_worker.py), process 0's first."""
    folder = tmp_path_factory.mktemp("answers")
    worker = Path(__file__).resolve().parent / "_harness_worker.py"
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(worker), str(tiny_gguf),
                               str(folder / f"{i}.json"), coordinator, str(PROCESSES), str(i),
                               str(DEVICES)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env(), start_new_session=True)
             for i in range(PROCESSES)]
    wait(procs, TIMEOUT_S)
    return [json.loads((folder / f"{i}.json").read_text()) for i in range(PROCESSES)]


@pytest.fixture(scope="module")
def one_process(tiny_gguf):
    """The same tasks in this process, on one device."""
    import jax

    from effijax.harness import EffijaxLM

    lm = EffijaxLM(str(tiny_gguf), **SETTINGS)
    assert lm.mesh is None and jax.process_count() == 1
    return json.loads(json.dumps(answers(lm)))  # tuples as lists, as the workers' JSON


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_answer_every_request_as_one_process(two_processes, one_process):
    first, second = two_processes
    assert first["processes"] == PROCESSES and first["devices"] == PROCESSES * DEVICES
    assert first["mesh"] == {"data": 1, "fsdp": PROCESSES * DEVICES, "tensor": 1}
    # Every process returns every answer and the same results.
    assert first == second

    for task in TASKS:
        ours, want = first["answers"][task], one_process["answers"][task]
        assert sorted(ours, key=int) == [str(i) for i in range(LIMIT)] == sorted(want, key=int)
        for doc in want:
            for got, expected in zip(ours[doc], want[doc], strict=True):
                if task == "effijax_qa_choice":  # [[log-likelihood, is_greedy]]
                    (logp, greedy), (want_logp, want_greedy) = got[0], expected[0]
                    assert logp == pytest.approx(want_logp, abs=ATOL) and logp < -1.0
                    assert greedy == want_greedy
                elif task == "effijax_docs_perplexity":  # [rolling log-likelihood]
                    assert got[0] == pytest.approx(expected[0], abs=ATOL) and got[0] < -10.0
                else:  # [greedy text]
                    assert got == expected
        assert first["results"][task].keys() == one_process["results"][task].keys()
        for metric, value in one_process["results"][task].items():
            assert first["results"][task][metric] == pytest.approx(value, rel=1e-6), metric
    # Generation said something: the texts compared are not all empty.
    assert any(t[0] for t in first["answers"]["effijax_qa_exact"].values())
