"""Tensor parallelism for the families beyond the GPT and the Llama (tests/test_tensor_parallel.py):
Qwen2 (q/k/v biases, split with their kernels' outputs), Mistral (a sliding window shorter
than the sequence) and Gemma 3 (its own head_dim, q/k norms on split heads, sandwich norms,
GeGLU, local and global layers, the tied head vocabulary-parallel) train 3 steps on
``fsdp=2,tensor=4`` (key/value heads replicated: 2 do not split over 4) and give their
single-device losses and parameters, within f32 reduction-order rounding (rtol 1e-5, atol 1e-6,
tests/test_sharded_training.py's). The optimizer is plain SGD, so that the parameters carry the
gradients' rounding as it is: Adam divides each element's gradient by its own scale, which
turns rounding in a near-zero gradient (Qwen2's key bias, which only the rotary positions make
nonzero) into a step of up to the learning rate. Each job compiles once, at XLA's lowest
backend optimisation level, two at a time.
"""

from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import optax
import pytest

from effijax.data import load_corpus, split_corpus
from effijax.models import preset
from effijax.paths import named_leaves
from effijax.recipe import build_lm_job
from effijax.sharding import make_mesh

FAMILIES = {
    "qwen2": preset("qwen2-tiny").with_seq_len(32),
    "mistral": preset("mistral-tiny").with_seq_len(32),  # window 8 < 32
    "gemma3": preset("gemma3-tiny").with_seq_len(32),  # window 8, 5 local : 1 global
}
MESH = {"fsdp": 2, "tensor": 4}
N_STEPS, BATCH, LR = 3, 8, 0.5
RTOL, ATOL = 1e-5, 1e-6
FAST_COMPILE = {"xla_backend_optimization_level": 0}

pytestmark = pytest.mark.slow  # 6 compiles (a minute on 2 cores)


def _build(corpus, model, axes):
    return build_lm_job(model, "fp32", optax.sgd(LR),
                        train_tokens=corpus[0], val_tokens=corpus[1], batch_size=BATCH,
                        mesh=None if axes is None else make_mesh(**axes),
                        strategy="fsdp" if axes else "ddp", num_eval_batches=0)


@pytest.fixture(scope="module")
def runs():
    corpus = split_corpus(load_corpus(max_bytes=200_000))
    jobs = {(name, split): _build(corpus, model, MESH if split else None)
            for name, model in FAMILIES.items() for split in (False, True)}
    with ThreadPoolExecutor(max_workers=2) as pool:  # XLA compiles without the GIL
        compiled = dict(zip(jobs, pool.map(
            lambda job: job.step.lower(job.state, job.batch(0)).compile(FAST_COMPILE),
            jobs.values()), strict=True))
    out = {}
    for key, job in jobs.items():
        state, losses = job.state, []
        for i in range(N_STEPS):
            with jax.set_mesh(job.mesh):
                state, metrics = compiled[key](state, job.batch(i))
            losses.append(float(metrics["lm_loss"]))
        out[key] = (job, state, losses)
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_fsdp_by_tensor_gives_the_single_device_run(name, runs):
    _, ref_state, ref_losses = runs[name, False]
    job, state, losses = runs[name, True]
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert losses[-1] < losses[0]  # it trained
    for (path, a), (_, b) in zip(named_leaves(state.params), named_leaves(ref_state.params),
                                 strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL,
                                   err_msg=path)
    # The Megatron split is there: every attention and MLP kernel is split over the tensor axis
    # (key/value kernels replicated: 2 heads over 4 devices), and so are the biases of the
    # split outputs (Qwen2's q bias).
    specs = {path: leaf.sharding.spec for path, leaf in named_leaves(state.params)}
    split = [p for p, spec in specs.items() if "tensor" in jax.tree.leaves(tuple(spec))]
    for kind in ("q_proj/kernel", "o_proj/kernel", "down_proj/kernel"):
        assert any(p.endswith(kind) for p in split), (kind, sorted(specs))
    assert not any(p.endswith(("k_proj/kernel", "v_proj/kernel")) for p in split)
    if name == "qwen2":
        assert any(p.endswith("q_proj/bias") for p in split)
