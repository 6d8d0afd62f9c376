"""Preference tuning's arithmetic: per-sequence log-probabilities from the fused head (exact
against full logits, values and gradients, with and without LoRA) and DPO / SimPO / ORPO equal
to TRL's own code (losses, gradients w.r.t. the policy's log-probabilities, metrics).

The TRL reference is TRL 1.x's code itself, run on the same numbers, with a stand-in ``self``
(``types.SimpleNamespace``) in place of a trainer: ``DPOTrainer._compute_loss`` (TRL 1.x has no
separate ``dpo_loss``; it reads the policy's per-token log-probabilities from the model's
output, so a stand-in model returns them), ``CPOTrainer.get_batch_loss_metrics`` with
``cpo_loss`` (``loss_type="simpo"``) and ``ORPOTrainer.get_batch_loss_metrics`` with
``odds_ratio_loss``; their ``concatenated_forward`` is replaced by one returning the
log-probabilities, since it needs a real model's logits. What that replacement computes is the
length normalisation of ``get_batch_logps`` (``average_log_prob=True``: sum / count) and, for
CPO, ``nn.CrossEntropyLoss``'s mean over the chosen completions' tokens, transcribed below. The
reference follows TRL 1.0's refactor (PR #3906): ``sigmoid`` takes no label smoothing, the
smoothed loss is ``robust``. The tests that need TRL skip without it (the interop extra); they
and the model-level tests are marked slow (see ``slow`` below).
"""

import functools
import types
import warnings
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from effijax import lora
from effijax.errors import ConfigError
from effijax.models import (
    abstract_split,
    gpt_config,
    head_sequence_logps,
    llama_config,
    make_sequence_logps,
)
from effijax.models._head import head_logits
from effijax.objectives import dpo_loss, orpo_loss, simpo_loss
from effijax.precision import loss_chunk_positions

# Importing TRL (torch, transformers, accelerate, datasets) takes about 6 s of CPU, and each
# tiny model's four programs (policy and reference, fused and unfused, with gradients) about
# 5 s to compile: past the fast tier's 4 s a test (tests/_budget.py), so those tests are slow
# and run with the full suite.
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def trl():
    """TRL's three trainers (the classes, never instantiated)."""
    pytest.importorskip("trl", minversion="1.16",
                        reason="trl>=1.16 (the interop extra) is not installed: the parity "
                        "tests against TRL's preference losses skip")
    from trl import DPOTrainer

    with warnings.catch_warnings():
        # trl.experimental (CPO, ORPO) says on its first import that its APIs may change: why
        # the interop extra bounds TRL's version and these tests name what they call.
        warnings.filterwarnings("ignore", message="You are importing from 'trl.experimental'")
        from trl.experimental.cpo import CPOTrainer
        from trl.experimental.orpo import ORPOTrainer
    return types.SimpleNamespace(DPOTrainer=DPOTrainer, CPOTrainer=CPOTrainer,
                                 ORPOTrainer=ORPOTrainer)


# Per-sequence log-probabilities ---------------------------------------------------------------


def _unfused_logps(logits_BSV, targets_BS, where_BS):
    """The reference: full logits, log_softmax, gather, masked row sums."""
    logp_BSV = jax.nn.log_softmax(logits_BSV.astype(jnp.float32), axis=-1)
    safe_BS = jnp.where(where_BS, targets_BS, 0)
    picked_BS = jnp.take_along_axis(logp_BSV, safe_BS[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(where_BS, picked_BS, 0.0), axis=1)


@pytest.mark.parametrize("transposed", [True, False])
def test_head_sequence_logps_equal_the_unfused_head_over_several_chunks(transposed):
    b, s, d, v = 2, 1024, 16, 96  # 2,048 tokens: 4 chunks of 256 positions
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(k1, (b, s, d))
    kernel = jax.random.normal(k2, (v, d) if transposed else (d, v)) * 0.5
    targets = jax.random.randint(k3, (b, s), 0, v)
    where = jax.random.bernoulli(k4, 0.6, (b, s))
    targets = jnp.where(where, targets, -100)  # unmarked ids are never read
    weights = jax.random.normal(k5, (b,))

    def fused(x, k):
        logps, counts = head_sequence_logps(x, k, targets, where, transposed=transposed)
        return jnp.sum(weights * logps), (logps, counts)

    def unfused(x, k):
        logps = _unfused_logps(head_logits(x, k, transposed=transposed), targets, where)
        return jnp.sum(weights * logps), (logps, None)

    results = [jax.jit(jax.value_and_grad(fn, (0, 1), has_aux=True))(x, kernel)
               for fn in (fused, unfused)]
    ((_, (logps, counts)), (dx, dk)), ((_, (plain, _)), (dx_ref, dk_ref)) = results
    np.testing.assert_array_equal(counts, jnp.sum(where, axis=1))
    np.testing.assert_allclose(logps, plain, rtol=1e-6)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dk, dk_ref, rtol=1e-5, atol=1e-5)
    # Without the kernel's gradient the forward forms dx per row (a cotangent of 1) and the
    # backward scales it: the same dx but for rounding (the row's cotangent multiplies the dot's
    # result instead of its terms), next to entries of order 1.
    dx_only = jax.jit(jax.grad(lambda x: fused(x, kernel)[0]))(x)
    np.testing.assert_allclose(dx_only, dx_ref, rtol=1e-5, atol=1e-6)


def test_head_sequence_logps_in_bf16_within_one_rounding():
    b, s, d, v = 2, 256, 16, 96
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(k1, (b, s, d)).astype(jnp.bfloat16)
    kernel = (jax.random.normal(k2, (v, d)) * 0.5).astype(jnp.bfloat16)
    targets = jax.random.randint(k3, (b, s), 0, v)
    where = jax.random.bernoulli(k4, 0.6, (b, s))
    weights = jax.random.normal(k5, (b,))

    def fused(x):
        return jnp.sum(weights * head_sequence_logps(x, kernel, targets, where,
                                                     transposed=True)[0])

    def unfused(x):
        logits = head_logits(x, kernel, transposed=True)
        return jnp.sum(weights * _unfused_logps(logits, targets, where))

    both = jax.jit(lambda x: [jax.value_and_grad(fn)(x) for fn in (fused, unfused)])
    (value, dx), (value_ref, dx_ref) = both(x)
    assert dx.dtype == jnp.bfloat16
    np.testing.assert_allclose(value, value_ref, rtol=1e-6)  # f32 logits and sums in both
    # dx: the row's cotangent scales the bf16 dot's result, not its bf16 terms: a bf16 rounding
    # of the terms, which cancel, so measured against the row's largest entry.
    dx, dx_ref = np.asarray(dx, np.float32), np.asarray(dx_ref, np.float32)
    scale = np.max(np.abs(dx_ref), axis=(1, 2), keepdims=True)
    assert np.all(np.abs(dx - dx_ref) <= 2.0 ** -7 * scale)  # measured: 0.0052 (2^-7.6)


def _pairs_batch(b=4, s=32, seed=0):
    """Rows of different lengths (right padding, targets -100 there) with a prompt each: the
    mask marks the completion's targets."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    tokens = jax.random.randint(k1, (b, s), 1, 256)
    lengths = jnp.array([s, s - 5, s - 11, 9])[:b]
    prompts = jnp.array([4, 7, 2, 3])[:b]
    pos = jnp.arange(s)
    real = pos < lengths[:, None]
    inputs = jnp.where(real, tokens, 0)
    targets = jnp.where(pos < lengths[:, None] - 1, jnp.roll(tokens, -1, axis=1), -100)
    mask = (pos >= prompts[:, None] - 1) & (pos < lengths[:, None] - 1)
    weights = jax.random.normal(k2, (b,))
    return {"inputs": inputs, "targets": targets, "mask": mask}, weights


@pytest.fixture
def four_chunks(monkeypatch):
    """The head's chunks made small, so a [4, 32] batch takes several."""
    monkeypatch.setattr("effijax.precision._loss_chunks.LOSS_CHUNK_TOKENS", 32)


@slow
@pytest.mark.parametrize("model", [gpt_config("tiny"), llama_config("llama-tiny")],
                         ids=["gpt-tied", "llama-untied"])
def test_sequence_logps_of_a_model_equal_its_logits(model, four_chunks):
    assert loss_chunk_positions(4, 32) == 8  # 4 chunks
    graphdef, _ = abstract_split(model)
    params = model.init_params(jax.random.key(0))
    batch, weights = _pairs_batch()
    where = batch["mask"]
    spec = lora.LoraSpec(rank=4, targets=model.lora_targets)
    adapters = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(3), a.shape),
                            lora.init(jax.random.key(2), params, spec))

    def fused(params, adapters):
        # The policy (adapters on, frozen base as the recipe runs it) and the reference (the
        # same base, adapters off): one base, no copy.
        policy = make_sequence_logps(graphdef, spec, frozen_base=True)
        logps, counts = policy({"base": params, "adapters": adapters}, batch)
        ref, ref_counts = make_sequence_logps(graphdef)(params, batch)
        return jnp.sum(weights * logps) + jnp.sum(weights * ref), (logps, ref, counts,
                                                                    ref_counts)

    def unfused(params, adapters):
        base = jax.lax.stop_gradient(params)  # frozen_base: no gradient from the policy pass
        logits = model.logits_fn(spec)({"base": base, "adapters": adapters}, batch["inputs"])
        ref_logits = model.logits_fn()(params, batch["inputs"])
        logps = _unfused_logps(logits, batch["targets"], where)
        ref = _unfused_logps(ref_logits, batch["targets"], where)
        return jnp.sum(weights * logps) + jnp.sum(weights * ref), (logps, ref, None, None)

    both = jax.jit(lambda *a: [jax.value_and_grad(fn, (0, 1), has_aux=True)(*a)
                               for fn in (fused, unfused)])  # one compilation
    ((_, (logps, ref, counts, ref_counts)), grads), ((_, (logps0, ref0, _, _)), grads0) = both(
        params, adapters)
    np.testing.assert_array_equal(counts, jnp.sum(where, axis=1))
    np.testing.assert_array_equal(ref_counts, counts)
    np.testing.assert_allclose(logps, logps0, rtol=1e-6)
    np.testing.assert_allclose(ref, ref0, rtol=1e-6)
    assert not np.allclose(logps, ref)  # the adapters matter
    # Gradients: the base's from the reference pass (kernel trained: the backward re-runs the
    # chunks), the adapters' from the policy pass (dx scaled per row).
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=2e-4, atol=1e-6),
                 grads, grads0)


@slow
def test_a_completion_window_scores_the_same_positions(four_chunks):
    """``window``: the head reads each row's span from its first marked position only; the
    log-probabilities and every gradient are the whole row's, and a row whose marked positions
    reach past the window is NaN, never a shorter sum."""
    model = llama_config("llama-tiny")
    graphdef, _ = abstract_split(model)
    params = model.init_params(jax.random.key(0))
    batch, weights = _pairs_batch()
    spans = [28, 20, 19, 6]  # first to last marked position, plus one (the rows' completions)
    marked = np.asarray(batch["mask"])
    assert [int(np.flatnonzero(r)[-1] - np.flatnonzero(r)[0] + 1) for r in marked] == spans

    def total(window):
        def fn(params):
            logps, counts = make_sequence_logps(graphdef, window=window)(params, batch)
            return jnp.sum(weights * logps), (logps, counts)
        return jax.value_and_grad(fn, has_aux=True)

    ((_, (whole, counts)), grads), ((_, (near, near_counts)), near_grads), \
        ((_, (short, _)), _) = jax.jit(lambda p: [total(w)(p) for w in (None, 28, 20)])(params)
    np.testing.assert_array_equal(near_counts, counts)
    np.testing.assert_allclose(near, whole, rtol=1e-6)
    # Two computations in one program, fused and summed in their own orders: f32 rounding,
    # relative to each gradient's own scale (XLA:CPU's legacy fusion emitters leave 4e-7 on
    # elements of 0.014 in a leaf whose largest is about 0.1).
    for x, y in zip(jax.tree.leaves(near_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-5 * float(np.max(np.abs(y))))
    assert np.isnan(short[0]) and not np.isnan(short[1:]).any()  # row 0's span is 28 > 20
    np.testing.assert_allclose(short[1:], whole[1:], rtol=1e-6)
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        make_sequence_logps(graphdef, window=0)


def test_sequence_logps_name_what_the_batch_lacks():
    graphdef, _ = abstract_split(gpt_config("tiny"))
    with pytest.raises(KeyError, match="targets"):
        make_sequence_logps(graphdef)({}, {"inputs": jnp.zeros((1, 4), jnp.int32)})
    with pytest.raises(ValueError, match="integer class ids"):
        head_sequence_logps(jnp.zeros((1, 4, 3)), jnp.zeros((3, 5)), jnp.zeros((1, 4)))


# The losses' settings -------------------------------------------------------------------------

P = 8  # pairs


def _logps(seed=0, pairs=P):
    rng = np.random.default_rng(seed)
    chosen = -rng.uniform(5, 60, pairs)
    rejected = -rng.uniform(5, 60, pairs)
    ref_chosen = chosen + rng.normal(0, 8, pairs)
    ref_rejected = rejected + rng.normal(0, 8, pairs)
    counts = rng.integers(3, 30, (2, pairs))
    return ([a.astype(np.float32) for a in (chosen, rejected, ref_chosen, ref_rejected)],
            counts.astype(np.int32))


@pytest.mark.parametrize("kwargs, field", [
    ({"loss_type": "kto_pair"}, "loss_type"),
    ({"beta": 0.0}, "beta"),
    ({"beta": -1}, "beta"),
    ({"loss_type": "robust", "label_smoothing": 0.5}, "label_smoothing"),
    ({"loss_type": "robust", "label_smoothing": -0.1}, "label_smoothing"),
    ({"label_smoothing": 0.1}, "label_smoothing"),  # sigmoid: smoothing moved to robust in 1.0
    ({"loss_type": "ipo"}, "chosen_counts"),
])
def test_dpo_settings_are_checked_before_tracing(kwargs, field):
    (c, r, rc, rr), _ = _logps()
    with pytest.raises(ConfigError) as e:
        dpo_loss(c, r, rc, rr, **kwargs)
    assert e.value.field == field
    if field == "loss_type":
        assert "'sigmoid', 'ipo', 'hinge', 'robust'" in str(e.value)


def test_reference_free_settings_are_checked():
    (c, r, _, _), (nc, nr) = _logps()
    with pytest.raises(ConfigError, match="beta"):
        simpo_loss(c, r, nc, nr, beta=0)
    with pytest.raises(ConfigError, match="label_smoothing"):
        simpo_loss(c, r, nc, nr, label_smoothing=0.7)
    with pytest.raises(ConfigError, match="cpo_alpha"):
        simpo_loss(c, r, nc, nr, cpo_alpha=-1.0)
    with pytest.raises(ConfigError, match="beta"):
        orpo_loss(c, r, nc, nr, nll=jnp.float32(1.0), beta=-0.1)
    with pytest.raises(ValueError, match="shape"):
        dpo_loss(c, r[:3], c, r)


# Parity with TRL ------------------------------------------------------------------------------


def _accelerator(torch):
    return types.SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x,
                                 gather_for_metrics=lambda x: x)


def _trl_dpo(torch, DPOTrainer, beta, loss_type, label_smoothing, logps, counts):
    """TRL's DPOTrainer._compute_loss on these sequence log-probabilities: (loss, grads of the
    chosen and rejected log-probs, metrics)."""
    chosen, rejected, ref_chosen, ref_rejected = (torch.tensor(a) for a in logps)
    policy = torch.cat([chosen, rejected]).requires_grad_(True)
    s = int(counts.max()) + 2
    counts_2P = torch.tensor(np.concatenate(counts))
    pos = torch.arange(s)
    completion_mask = ((pos >= 1) & (pos <= counts_2P[:, None])).long()  # after a 1-token prompt
    first = torch.zeros(1, s - 1)
    first[0, 0] = 1.0

    def model(**kwargs):  # per-token log-probs whose sum over the sequence is `policy`
        zeros = torch.zeros(2 * P, s - 1)
        return types.SimpleNamespace(log_probs=policy[:, None] * first, entropy=zeros,
                                     mean_logits=zeros, is_top1=zeros.bool())

    self = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=_accelerator(torch),
        aux_loss_enabled=False, precompute_ref_logps=True, ld_alpha=None,
        f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
        beta=beta, label_smoothing=label_smoothing, use_weighting=False,
        _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
        args=types.SimpleNamespace(gradient_checkpointing_kwargs=None))
    inputs = {"input_ids": torch.ones(2 * P, s, dtype=torch.long),
              "attention_mask": torch.ones(2 * P, s, dtype=torch.long),
              "completion_mask": completion_mask,
              "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    loss = DPOTrainer._compute_loss(self, model, inputs, False)
    loss.backward()
    grads = policy.grad.numpy()
    metrics = {k: v[0] for k, v in self._metrics["train"].items()}
    return loss.item(), (grads[:P], grads[P:]), metrics


REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                  "logps/chosen", "logps/rejected")


def _close(ours, theirs, what):
    np.testing.assert_allclose(np.asarray(ours, np.float64), np.asarray(theirs, np.float64),
                               rtol=2e-6, atol=2e-6, err_msg=what)


@slow
@pytest.mark.parametrize("loss_type, beta, smoothing", [
    ("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.0), ("ipo", 0.1, 0.0), ("ipo", 1.0, 0.0),
    ("hinge", 0.1, 0.0), ("robust", 0.1, 0.0), ("robust", 0.1, 0.1), ("robust", 0.3, 0.4),
])
def test_dpo_equals_trl(trl, loss_type, beta, smoothing):
    import torch

    logps, counts = _logps(seed=1)
    kw = {"beta": beta, "loss_type": loss_type, "label_smoothing": smoothing}

    @jax.jit
    def ours(c, r, rc, rr, nc, nr):
        return jax.value_and_grad(lambda c, r: dpo_loss(c, r, rc, rr, chosen_counts=nc,
                                                        rejected_counts=nr, **kw),
                                  (0, 1), has_aux=True)(c, r)

    (loss, metrics), grads = ours(*logps, *counts)
    trl_loss, trl_grads, trl_metrics = _trl_dpo(torch, trl.DPOTrainer, beta, loss_type, smoothing,
                                                logps, counts)
    _close(loss, trl_loss, "loss")
    _close(grads[0], trl_grads[0], "d loss / d chosen_logps")
    _close(grads[1], trl_grads[1], "d loss / d rejected_logps")
    for name in REWARD_METRICS:
        _close(metrics[name], trl_metrics[name], name)


def _trl_reference_free(torch, trainer, stand_in, logps, counts, nll_of):
    """``trainer.get_batch_loss_metrics`` (CPO's or ORPO's) on these log-probabilities: TRL's
    ``concatenated_forward`` replaced by one returning the length-normalised log-probabilities
    (``get_batch_logps(average_log_prob=True)``: sum / count) and the NLL ``nll_of`` makes."""
    chosen, rejected = (torch.tensor(a).requires_grad_(True) for a in logps[:2])
    nc, nr = (torch.tensor(c.astype(np.float32)) for c in counts)
    logits = torch.zeros(P, 2, 3)

    def concatenated_forward(model, batch):
        return chosen / nc, rejected / nr, logits, logits, nll_of(chosen, nc)

    stand_in.accelerator = _accelerator(torch)
    stand_in.aux_loss_enabled = False
    stand_in.concatenated_forward = concatenated_forward
    loss, metrics = trainer.get_batch_loss_metrics(stand_in, None, {})
    loss.backward()
    return loss.item(), (chosen.grad.numpy(), rejected.grad.numpy()), metrics


@slow
@pytest.mark.parametrize("beta, gamma, smoothing, cpo_alpha", [
    (0.1, 0.5, 0.0, 0.0), (2.0, 1.0, 0.0, 0.0), (2.0, 0.5, 0.2, 0.0), (0.1, 0.5, 0.0, 1.0),
])
def test_simpo_equals_trls_cpo(trl, beta, gamma, smoothing, cpo_alpha):
    import torch

    CPOTrainer = trl.CPOTrainer
    logps, counts = _logps(seed=2)
    self = types.SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=gamma, beta=beta,
                                 label_smoothing=smoothing, cpo_alpha=cpo_alpha)
    self.cpo_loss = functools.partial(CPOTrainer.cpo_loss, self)

    def nll_of(chosen, nc):  # nn.CrossEntropyLoss's mean over the chosen completions' tokens
        return -chosen.sum() / nc.sum() if cpo_alpha else torch.tensor(0.0)

    trl_loss, trl_grads, trl_metrics = _trl_reference_free(torch, CPOTrainer, self, logps,
                                                           counts, nll_of)
    kw = {"beta": beta, "gamma": gamma, "label_smoothing": smoothing, "cpo_alpha": cpo_alpha}

    @jax.jit
    def ours(c, r, nc, nr):
        return jax.value_and_grad(lambda c, r: simpo_loss(c, r, nc, nr, **kw), (0, 1),
                                  has_aux=True)(c, r)

    (loss, metrics), grads = ours(*logps[:2], *counts)
    _close(loss, trl_loss, "loss")
    _close(grads[0], trl_grads[0], "d loss / d chosen_logps")
    _close(grads[1], trl_grads[1], "d loss / d rejected_logps")
    for name in REWARD_METRICS + (("nll_loss",) if cpo_alpha else ()):
        _close(metrics[name], trl_metrics[name], name)


@slow
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_orpo_equals_trl(trl, beta):
    import torch

    ORPOTrainer = trl.ORPOTrainer
    logps, counts = _logps(seed=3)
    # Average log-probabilities in (-3, -0.05): both of log1mexp's branches are taken.
    logps[0] = (-np.linspace(0.05, 3.0, P) * counts[0]).astype(np.float32)
    logps[1] = (-np.linspace(2.5, 0.1, P) * counts[1]).astype(np.float32)
    nll = np.float32(1.7)  # TRL's is over the prompt and completion: an input here
    self = types.SimpleNamespace(beta=beta)
    self.odds_ratio_loss = functools.partial(ORPOTrainer.odds_ratio_loss, self)
    trl_loss, trl_grads, trl_metrics = _trl_reference_free(
        torch, ORPOTrainer, self, logps, counts, lambda c, nc: torch.tensor(float(nll)))

    @jax.jit
    def ours(c, r, nc, nr):
        return jax.value_and_grad(lambda c, r: orpo_loss(c, r, nc, nr, nll=jnp.float32(nll),
                                                         beta=beta), (0, 1), has_aux=True)(c, r)

    (loss, metrics), grads = ours(*logps[:2], *counts)
    _close(loss, trl_loss, "loss")
    _close(grads[0], trl_grads[0], "d loss / d chosen_logps")
    _close(grads[1], trl_grads[1], "d loss / d rejected_logps")
    for name in REWARD_METRICS + ("nll_loss", "log_odds_ratio", "log_odds_chosen"):
        _close(metrics[name], trl_metrics[name], name)
