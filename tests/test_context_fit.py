"""A sequence that does not fit one device of a stated memory fits with a context axis, and
trains (docs/sharding.md, "Memory on a context axis").

The tiny GPT (2 layers, width 64, learned positions) at 2048 tokens, one sequence per step, on
devices of ``MEMORY`` = 10 MB:

- the planner (:func:`effijax.memory.plan_mesh`, what ``effijax plan`` runs: mixed precision,
  block checkpointing and micro-batches tried) finds nothing that fits one device (its best,
  checkpointed, needs 9.53 MB of the 9 MB usable), and on 8 devices with ``context=8`` picks
  ``data=1,fsdp=1,context=8,tensor=1`` (5.94 MB, no recomputation);
- the estimate ``effijax memory`` prints for the run the test makes (f32, AdamW, each block
  recomputed: :func:`model_states` plus :func:`activation_bytes`) is 14.51 MB on one device and
  6.2 MB per device on ``context=8``;
- the pre-flight check of ``effijax train`` (:func:`effijax.sources.check_compiled_memory`,
  with ``--device-memory 10MB``) refuses the compiled one-device step (21.5 MB: arguments
  3.0 MB + temporaries 18.5 MB) and passes the ``context=8`` one, whose arguments and
  temporaries (``compiled.memory_analysis()``) are 8.1 MB per device.

The run is f32 so that its losses can be compared with the one device's to f32 rounding (the
planner counts 16-bit activations, a mixed-precision run's; f32's are twice as large, which is
why the run recomputes each block where the planner's 16-bit run would not need to). Two steps
on each: the one-device step runs on the CPU (its devices share the host's memory, so the
refused step can still run as the reference), and the losses agree within ``ULPS`` f32 roundings
of the loss (the bound of test_context_families; measured: 0 and 1.6 units on a 2-core
AMD EPYC, shared).

The planner's and the estimate's test is fast (no compilation); the two on the compiled steps
are slow: two compilations and four steps at 2048 tokens, 18-24 s on a shared 2-core host.
"""

import jax
import numpy as np
import optax
import pytest

from effijax.errors import ConfigError
from effijax.memory import activation_bytes, model_states, parse_bytes, plan_mesh
from effijax.models import gpt_config
from effijax.recipe import batch_fn, compile_job, init_state, plan_job
from effijax.sharding import make_mesh
from effijax.sources import check_compiled_memory

S = 2048
MEMORY = "10MB"
CONTEXT = 8
ULPS = 128
EPS = 2.0 ** -24  # f32 rounding, relative

MODEL = gpt_config("tiny", seq_len=S, remat="block")


def _shape() -> dict:
    """The model's shape as the planner and the activation formula take it (``effijax plan``'s
    and ``effijax memory``'s ``--model tiny``): one sequence per step, no dropout (the context
    axis has none), blockwise attention (``auto`` on a CPU)."""
    shape = MODEL.shape()
    assert MODEL.dropout == 0
    return {**shape.activation_args(), "seq_len": S, "dropout": False,
            "blockwise_attention": True}


def _plan(devices: int, context: int):
    return plan_mesh(MODEL.shape().num_params, devices=devices, device_memory=MEMORY,
                     global_batch=1, allow_lora=False, tensor=1, context=context, **_shape())


def _estimate(context: int) -> int:
    """``effijax memory --model tiny --seq-len 2048 --precision fp32 --checkpointing block
    --context N``'s total: the f32 AdamW model states and the block-checkpointed activations."""
    states = model_states(MODEL.shape().num_params, optimizer="adamw", precision="fp32")
    return states.model_state_bytes + activation_bytes(
        **_shape(), batch_size=1, bytes_per_value=4, checkpointing="block", context=context)


def test_the_planner_and_the_estimate_say_it_fits_only_with_the_context_axis():
    budget = parse_bytes(MEMORY)
    alone = _plan(devices=1, context=1)
    assert not alone.fits, alone.explain()
    split = _plan(devices=CONTEXT, context=CONTEXT)
    assert split.fits, split.explain()
    assert split.pick.mesh == f"data=1,fsdp=1,context={CONTEXT},tensor=1"
    assert _estimate(1) > budget >= _estimate(CONTEXT), (_estimate(1), _estimate(CONTEXT))


@pytest.fixture(scope="module")
def runs():
    """Per mesh: the job, its compiled step and the losses of two steps from the same state and
    batches (the one device's and ``context=8``'s)."""
    tokens = np.frombuffer(b"".join(b"def f%d(x):\n    return x * %d + 1\n" % (i, i % 7)
                                    for i in range(2000)), np.uint8)
    out = {}
    for name, mesh in [("one_device", None),
                       ("context", make_mesh(context=CONTEXT, devices=jax.devices()[:CONTEXT]))]:
        job = plan_job(MODEL, "fp32", optax.adamw(1e-3), batch_size=1, mesh=mesh, seed=3)
        compiled = compile_job(job, census=False)
        state, batch = init_state(job), batch_fn(job, tokens)
        losses = []
        for i in range(2):
            state, metrics = compiled.step(state, batch(i))
            losses.append(float(jax.device_get(metrics["loss"])))
        out[name] = (job, compiled, losses)
    return out


@pytest.mark.slow  # the fixture: two compilations and four steps at 2048 tokens
def test_the_preflight_refuses_one_device_and_passes_the_context_axis(runs):
    job, compiled, _ = runs["one_device"]
    with pytest.raises(ConfigError, match="the compiled step needs") as refused:
        check_compiled_memory(compiled.memory, job, MEMORY)
    assert refused.value.field == "device_memory"
    job, compiled, _ = runs["context"]
    check_compiled_memory(compiled.memory, job, MEMORY)  # passes
    m = compiled.memory
    assert m.arguments + m.temporaries <= parse_bytes(MEMORY), str(m)


@pytest.mark.slow
def test_the_context_axis_trains_to_the_one_device_losses(runs):
    *_, reference = runs["one_device"]
    *_, losses = runs["context"]
    assert np.all(np.isfinite(losses)) and losses[0] != losses[1]
    for got, want in zip(losses, reference, strict=True):
        assert abs(got - want) <= ULPS * EPS * abs(want), (losses, reference)
