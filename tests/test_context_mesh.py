"""The ``context`` mesh axis by name: ``--mesh`` strings with it, and the checks a run on it
passes before anything is traced (:func:`effijax.sharding.check_context`)."""

import pytest

from effijax.errors import ConfigError
from effijax.sharding import CONTEXT_AXIS, check_context, make_mesh, parse_mesh


def test_parse_mesh_accepts_the_context_axis_and_make_mesh_places_it():
    axes = parse_mesh("fsdp=2, context=4")
    assert axes == {"fsdp": 2, "context": 4}
    assert dict(make_mesh(**axes).shape) == {"data": 1, "fsdp": 2, "context": 4, "tensor": 1}
    assert dict(make_mesh(**parse_mesh("fsdp=1, context=-1, tensor=2")).shape) == {
        "data": 1, "fsdp": 1, "context": 4, "tensor": 2}
    with pytest.raises(ConfigError, match=r"unknown axis 'sequence'; the axes are data, fsdp, "
                                          r"tensor, context"):
        parse_mesh("fsdp=2,sequence=4")
    with pytest.raises(ConfigError, match="axis 'context' is given twice"):
        parse_mesh("context=2,context=4")


MESH = {"data": 1, "fsdp": 2, CONTEXT_AXIS: 4, "tensor": 1}


@pytest.mark.parametrize(("mesh", "kwargs", "degree"), [
    (MESH, dict(seq_len=64), 4),
    (MESH, dict(seq_len=60, load_balanced=False), 4),  # contiguous chunks: 4 | 60 suffices
    ({"data": 2, "fsdp": 4, "tensor": 1}, dict(seq_len=63, dropout=0.1), 1),  # no context axis
    ({"data": 1, "fsdp": 8, CONTEXT_AXIS: 1, "tensor": 1}, dict(seq_len=63), 1),
    ({"data": 1, "fsdp": 1, CONTEXT_AXIS: 2, "tensor": 4}, dict(seq_len=36), 2),
])
def test_check_context_accepts(mesh, kwargs, degree):
    assert check_context(mesh, **kwargs) == degree


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(seq_len=60), r"^seq_len=60: context parallelism cuts each row into 2 x context = 8 "
                       r"equal chunks \(load-balanced: device i holds chunks i and 7 - i\), and 8 "
                       r"does not divide it; use a multiple of 8 \(e.g. 56 or 64\)"),
    (dict(seq_len=6), r"^seq_len=6: .* use a multiple of 8 \(e.g. 8\), or another context"),
    (dict(seq_len=62, load_balanced=False),
     r"^seq_len=62: context parallelism cuts each row into context = 4 equal chunks, and 4 "
     r"does not divide it; use a multiple of 4 \(e.g. 60 or 64\)"),
    (dict(seq_len=64, dropout=0.1),
     r"^dropout=0.1: ring attention over the mesh's context=4 has no attention dropout; set "
     r"the model's dropout to 0, or train without a context axis"),
    (dict(seq_len=0), r"^seq_len=0: expected a positive int"),
])
def test_check_context_refuses(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        check_context(MESH, **kwargs)


def test_plan_job_refuses_a_context_mesh_it_cannot_run():
    import optax

    from effijax.models import gpt_config, llama_config
    from effijax.recipe import plan_job

    mesh = make_mesh(fsdp=2, context=4)
    with pytest.raises(ConfigError, match=r"^seq_len=60: context parallelism cuts"):
        plan_job(llama_config("llama-tiny", seq_len=60), "fp32", optax.sgd(0.1), batch_size=2,
                 mesh=mesh)
    with pytest.raises(ConfigError, match=r"^dropout=0.1: ring attention"):
        plan_job(gpt_config("tiny", dropout=0.1), "fp32", optax.sgd(0.1), batch_size=2,
                 mesh=mesh)
    job = plan_job(llama_config("llama-tiny", seq_len=64), "fp32", optax.sgd(0.1),
                   batch_size=2, mesh=mesh)
    assert dict(job.mesh.shape)["context"] == 4
