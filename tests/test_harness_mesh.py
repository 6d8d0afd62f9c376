"""EffijaxLM on the 8 forced CPU devices (``mesh=make_mesh()``) answers as on one device.

Log-likelihoods (plain and rolling) equal the one-device answers to f32 rounding, with each
batch's rows split over the 8 devices (data parallel: the scorer's input and output carry the
batch sharding); greedy generations are the same text. Parameters already placed on the mesh
(FSDP-sharded, as a training run's are) are used as they are, no copy, and score the same; a
batch the mesh cannot split, or something that is not a mesh, is refused before the model is
read.
"""

import dataclasses

import jax
import pytest

pytest.importorskip("lm_eval", reason="the harness tests need lm-evaluation-harness "
                    "(pip install 'effijax[eval]')")
pytest.importorskip("gguf", reason="the tiny model is written as a GGUF file")

from jax.sharding import PartitionSpec as P  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from effijax.errors import ConfigError  # noqa: E402
from effijax.harness import EffijaxLM  # noqa: E402
from effijax.sharding import BATCH_AXES, make_mesh, param_shardings  # noqa: E402

# Every scored row is 17 to 33 tokens long (one compiled length, 32) and the prompts are
# generated in one batch: each placement compiles one scorer and one generation.
MAX_LENGTH = 32
# One row's f32 sums computed in batches of 8 rows on one device and of 1 row per device on
# eight: XLA:CPU's matmuls block the two shapes differently, so sums of ~100 nats may differ in
# their last bits (measured: 7.6e-6 at most); a wrong token or position moves a sum by ~0.1.
ATOL, RTOL = 2e-5, 1e-6
CONTEXT = "Question: What is the signature of textwrap.dedent?\nAnswer:"
PAIRS = [(CONTEXT[:i], CONTEXT[i:i + 7]) for i in range(20, 60, 4)]  # 10: two batches of 8
GENERATE = [(CONTEXT[:i], {"until": ["\n\n"], "max_gen_toks": 8}) for i in (5, 12, 18, 24)]
ROLLING = [("Text wrapping and filling. " * 3,), ("the thin thing in the 12 rooms",)]


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    from _harness_models import write_tiny_gguf

    file = write_tiny_gguf(tmp_path_factory.mktemp("mesh") / "tiny.gguf", MAX_LENGTH)
    lm = EffijaxLM(str(file), batch_size=8, max_length=MAX_LENGTH)
    assert {d for x in jax.tree.leaves(lm.params) for d in x.devices()} == {jax.devices()[0]}
    return lm


@pytest.fixture(scope="module")
def answers(one):
    """The one-device answers."""
    return _ask(one)


def _requests(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def _ask(lm):
    return (lm.loglikelihood(_requests("loglikelihood", PAIRS)),
            lm.loglikelihood_rolling(_requests("loglikelihood_rolling", ROLLING)),
            lm.generate_until(_requests("generate_until", GENERATE)))


def _assert_same(got, want):
    (pairs, rolling, texts), (want_pairs, want_rolling, want_texts) = got, want
    for (logp, greedy), (want_logp, want_greedy) in zip(pairs, want_pairs, strict=True):
        assert logp == pytest.approx(want_logp, rel=RTOL, abs=ATOL) and greedy == want_greedy
    assert rolling == pytest.approx(want_rolling, rel=RTOL, abs=ATOL)
    assert texts == want_texts and any(texts)


def _spy(lm, monkeypatch):
    """Records the sharding of each scoring batch's rows and of its answers."""
    seen, real = [], lm._score

    def score(params, batch):
        out = real(params, batch)
        seen.append((batch["inputs"].sharding, out[0].sharding))
        return out

    monkeypatch.setattr(lm, "_score", score)
    return seen


def test_on_eight_devices_the_answers_are_the_one_device_answers(one, answers, monkeypatch):
    mesh = make_mesh()
    lm = EffijaxLM(loaded=one.loaded, batch_size=8, max_length=MAX_LENGTH, mesh=mesh)
    leaves = jax.tree.leaves(lm.params)
    assert all(x.sharding.spec == P() and len(x.devices()) == 8 for x in leaves)  # replicated
    seen = _spy(lm, monkeypatch)
    _assert_same(_ask(lm), answers)
    # 2 batches of pairs, 1 of rolling windows: every one split row by row over the 8 devices.
    assert len(seen) == 3
    for rows, logps in seen:
        assert rows.spec == P(BATCH_AXES) and logps.is_equivalent_to(rows, 1)
        assert len(rows.device_set) == 8


def test_parameters_sharded_on_the_mesh_are_used_as_they_are(one, answers, monkeypatch):
    mesh = make_mesh(data=2)  # 2 replicas of parameters sharded over 4 devices
    abstract = jax.eval_shape(lambda: one.params)
    params = jax.device_put(one.params, param_shardings(abstract, mesh, "fsdp", min_shard_size=0))
    assert {x.sharding.spec for x in jax.tree.leaves(params)} >= {P("fsdp"), P(None, "fsdp")}
    loaded = dataclasses.replace(one.loaded, params=params)
    lm = EffijaxLM(loaded=loaded, batch_size=8, max_length=MAX_LENGTH, mesh=mesh)
    assert all(a is b for a, b in zip(jax.tree.leaves(lm.params), jax.tree.leaves(params),
                                      strict=True))  # no second copy
    seen = _spy(lm, monkeypatch)
    pairs = lm.loglikelihood(_requests("loglikelihood", PAIRS))
    rolling = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", ROLLING))
    _assert_same((pairs, rolling, answers[2]), answers)  # generation: the test above's
    assert len(seen) == 3 and all(rows.spec == P(BATCH_AXES) for rows, _ in seen)


def test_a_batch_the_mesh_cannot_split_is_refused_before_the_model_is_read():
    with pytest.raises(ConfigError, match=r"batch_size=4: must be divisible by data\*fsdp = 8 "
                       r"\(data=1, fsdp=8\): e.g. 8"):
        EffijaxLM("no/such/model", batch_size=4, mesh=make_mesh())
    with pytest.raises(ConfigError, match="mesh='str': expected a jax.sharding.Mesh"):
        EffijaxLM("no/such/model", batch_size=8, mesh="data=8")
