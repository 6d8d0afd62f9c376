"""One process of tests/test_harness_processes.py: the shipped tasks through ``EffijaxLM`` in a
run of several JAX processes, each answer written out.

    python tests/_harness_worker.py GGUF OUT.json COORDINATOR PROCESSES PROCESS_ID DEVICES

joins the run (gloo on CPU, ``DEVICES`` forced CPU devices in this process), runs
``lm_eval.simple_evaluate`` over :data:`TASKS` (the first :data:`LIMIT` documents each) on the
model ``GGUF`` with the default mesh (every process's devices), and writes to ``OUT.json`` the
harness's results (``results``), every request's answer (``answers``: task -> doc_id -> the
responses), the mesh and the process count. Settings the test's one-process reference shares
are here: :data:`TASKS`, :data:`LIMIT`, :data:`SETTINGS`.
"""

import json
import sys

TASKS = ("effijax_qa_choice", "effijax_qa_exact", "effijax_docs_perplexity")
LIMIT = 4
# The EffijaxLM both sides build: a prompt of up to 64 tokens and 48 generated share one shape.
SETTINGS = {"batch_size": 8, "max_length": 112}


def answers(lm) -> dict:
    """``{"results", "answers"}`` of the tasks on ``lm`` (JSON-ready)."""
    import lm_eval

    from effijax.harness import task_manager
    from effijax.harness._tasks import _environment_from_jax

    # The machine recorded from JAX, as evaluate_tasks does (the harness's own report runs
    # torch's collect_env: seconds of pip in subprocesses), and only for this call.
    with _environment_from_jax():
        out = lm_eval.simple_evaluate(model=lm, tasks=list(TASKS), limit=LIMIT,
                                      task_manager=task_manager(include_defaults=False),
                                      log_samples=True, bootstrap_iters=0,
                                      torch_random_seed=None)
    return {"results": {t: {k: v for k, v in out["results"][t].items() if k != "alias"}
                        for t in TASKS},
            "answers": {t: {str(s["doc_id"]): s["resps"] for s in out["samples"][t]}
                        for t in TASKS}}


def main(gguf, out, coordinator, processes, process_id, devices) -> None:
    from effijax.distributed import initialize

    initialize(coordinator, int(processes), int(process_id), cluster="none",
               local_device_count=int(devices), join_timeout=120)
    import jax

    from effijax.harness import EffijaxLM

    lm = EffijaxLM(gguf, **SETTINGS)
    record = answers(lm)
    record |= {"mesh": dict(lm.mesh.shape), "processes": jax.process_count(),
               "devices": len(lm.mesh.devices.flat)}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
