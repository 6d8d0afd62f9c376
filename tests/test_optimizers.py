"""The optimizer as a choice: each one equals optax's own, the schedules' values, the weight-decay
mask, the default bitwise equal to the composition every earlier run trained with, and the
choice recorded, checked on resume and refused when it changes the optimizer state."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from effijax.errors import ConfigError
from effijax.models import gpt_config, preset
from effijax.optimizers import DEFAULTS, OPTIMIZERS, decay_mask, make_optimizer, make_schedule
from effijax.paths import named_leaves
from effijax.recipe import TrainConfig, train
from effijax.recipe._identity import check_resume
from effijax.step import optax_promotion

PARAMS = {"ln1": {"scale": jnp.ones(3), "bias": jnp.full(3, 0.5)},
          "q": {"kernel": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "bias": jnp.ones(4)},
          "embed": {"embedding": jnp.linspace(0.0, 1.0, 8).reshape(4, 2)}}


def _grads(step: int):
    return jax.tree.map(lambda p: jnp.sin(p * (step + 1.0)) + 0.1, PARAMS)


def _run(tx, steps=4):
    """Parameters after ``steps`` updates of ``tx`` with fixed gradients."""
    params = PARAMS
    with optax_promotion():
        state = tx.init(params)
        for step in range(steps):
            updates, state = tx.update(_grads(step), state, params)
            params = optax.apply_updates(params, updates)
    return params


def _equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_the_default_is_the_composition_earlier_runs_trained_with():
    """AdamW, b2 0.95, warm-up then cosine to 10%, decay on every parameter, clipped: bitwise
    the same updates as before the optimizer became a choice (resumed runs stay exact)."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10, 1e-3)
    before = optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(
        learning_rate=schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.01))
    _equal(_run(make_optimizer(1e-2, 10, warmup_steps=2, weight_decay=0.01)), _run(before))


def _decoupled_decay(schedule, rate):
    """``-schedule(step) * rate * W`` added to the updates: decoupled decay after an optimizer
    whose updates already carry the learning rate and the sign."""

    def init(params):
        return jnp.zeros([], jnp.int32)

    def update(updates, count, params):
        lr = schedule(count)
        return jax.tree.map(lambda u, p: u - lr * rate * p, updates, params), count + 1

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("name, reference", [
    ("adamw", lambda lr: optax.adamw(lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.01)),
    ("adam", lambda lr: optax.chain(optax.add_decayed_weights(0.01),
                                    optax.adam(lr, b1=0.9, b2=0.95, eps=1e-8))),
    ("lion", lambda lr: optax.lion(lr, b1=0.9, b2=0.99, weight_decay=0.01)),
    ("adafactor", lambda lr: optax.chain(optax.adafactor(lr, eps=1e-30),
                                         _decoupled_decay(lr, 0.01))),
    ("sgd", lambda lr: optax.chain(optax.add_decayed_weights(0.01),
                                   optax.sgd(lr, momentum=0.9))),
])
def test_each_optimizer_is_optaxs_own(name, reference):
    schedule = make_schedule("linear", 1e-2, 10, warmup_steps=2)
    ours = make_optimizer(1e-2, 10, optimizer=name, schedule="linear", warmup_steps=2,
                          weight_decay=0.01, clip_norm=None)
    jax.tree.map(  # the same arithmetic, in another grouping of the chain
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        _run(ours), _run(reference(schedule)))
    assert set(DEFAULTS) == set(OPTIMIZERS)


def test_a_hyperparameter_reaches_the_optimizer():
    a = _run(make_optimizer(1e-2, 10, optimizer="lion", b2=0.5, clip_norm=None))
    b = _run(make_optimizer(1e-2, 10, optimizer="lion", clip_norm=None))
    assert not np.array_equal(a["q"]["kernel"], b["q"]["kernel"])


@pytest.mark.parametrize("schedule, values", [
    ("constant", [0.0, 0.5, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [0.0, 0.5, 1.0, 0.775, 0.55, 0.1]),
    ("cosine", [0.0, 0.5, 1.0, 0.868, 0.55, 0.1]),
    ("wsd", [0.0, 0.5, 1.0, 1.0, 1.0, 0.1]),
])
def test_schedules_warm_up_then_follow_their_shape(schedule, values):
    s = make_schedule(schedule, 1.0, 20, warmup_steps=4, lr_end=0.1, decay_fraction=0.25)
    got = [round(float(s(t)), 3) for t in (0, 2, 4, 8, 12, 20)]
    assert got == pytest.approx(values, abs=2e-3), got


def test_wsd_stays_constant_until_its_decay_then_falls_linearly():
    s = make_schedule("wsd", 1.0, 104, warmup_steps=4, lr_end=0.0, decay_fraction=0.2)
    assert [float(s(t)) for t in (4, 50, 84)] == [1.0, 1.0, 1.0]
    assert float(s(94)) == pytest.approx(0.5) and float(s(104)) == 0.0


def test_decay_mask_names_norms_biases_and_embeddings_of_every_family():
    for model in (gpt_config("tiny"), preset("smollm2-135m")):
        mask = decay_mask("norms,biases,embeddings")(model.abstract_params())
        kept = sorted(path for path, decays in named_leaves(mask) if decays)
        assert kept and all(path.endswith("/kernel") for path in kept), kept
        spared = [path for path, decays in named_leaves(mask) if not decays]
        assert any("norm" in p or "/ln" in p or p.startswith("ln") for p in spared), spared
    regex = decay_mask(r"attn/")(gpt_config("tiny").abstract_params())
    assert not regex["blocks"]["attn"]["q"]["kernel"] and regex["blocks"]["mlp"]["fc_in"]["kernel"]


def test_no_decay_spares_what_it_names():
    """With zero gradients only weight decay moves a parameter: the spared ones stay."""
    params = PARAMS
    tx = make_optimizer(0.1, 10, schedule="constant", weight_decay=0.5, no_decay="norms,biases",
                        clip_norm=None)
    with optax_promotion():
        updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    moved = {p for p, u in named_leaves(updates) if np.any(np.asarray(u) != 0)}
    assert moved == {"q/kernel", "embed/embedding"}, moved


@pytest.mark.parametrize("change, message", [
    (dict(optimizer="rmsprop"), "optimizer='rmsprop': choose one of adamw, adam, lion, "
     "adafactor, sgd"),
    (dict(schedule="step"), "schedule='step': choose one of constant, linear, cosine, wsd"),
    (dict(optimizer="sgd", b2=0.99), "b2=0.99: sgd has no b2 (its hyperparameters: momentum)"),
    (dict(momentum=0.9), "momentum=0.9: adamw has no momentum"),
    (dict(b1=1.0), "b1=1.0: must be in [0, 1)"),
    (dict(lr_end=2), "lr_end=2.0: must be a fraction of --lr in [0, 1]"),
    (dict(no_decay="("), "no_decay='(': not norms, biases, embeddings, nor a valid regex"),
])
def test_bad_optimizer_settings_are_refused_by_name(change, message):
    with pytest.raises(ConfigError) as e:
        TrainConfig(**change)
    assert str(e.value).startswith(message), str(e.value)


def test_a_run_records_its_optimizer_and_a_resume_keeps_it(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(200)))
    cfg = TrainConfig(model="tiny", seq_len=16, batch_size=2, eval_batches=1, progress=False,
                      steps=6, warmup=2, data=str(corpus), out=str(tmp_path / "run"),
                      optimizer="lion", lr=1e-3, schedule="wsd", decay_fraction=0.5,
                      lr_end=0.0, no_decay="norms,biases")
    assert train(cfg).status == "done"
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["optimizer"], config["schedule"], config["b1"], config["b2"],
            config["no_decay"]) == ("lion", "wsd", 0.9, 0.99, "norms,biases")
    rates = [json.loads(line)["learning_rate"]
             for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # Warm-up over 2, stable, then the last half of the 4 after it decaying to 0 at step 6.
    np.testing.assert_allclose(rates, [0.0, 5e-4, 1e-3, 1e-3, 1e-3, 5e-4], atol=1e-9)
    with pytest.raises(ConfigError, match=r"optimizer 'lion' -> 'adamw' \(must match"):
        train(cfg.with_overrides(optimizer="adamw", steps=8, allow_changes="steps"))
    with pytest.raises(ConfigError, match=r"b2 0.99 -> 0.98 \(add --allow-changes "):
        train(cfg.with_overrides(b2=0.98, steps=8, allow_changes="steps"))


def test_a_run_recorded_before_the_choice_resumes_as_adamw():
    """A config.json without the new keys trained with AdamW, b2 0.95, cosine to 10%: the same
    run today has no difference."""
    old = {"seed": 0, "lr": 3e-3, "steps": 10, "run": {}}
    new = {**old, "optimizer": "adamw", "schedule": "cosine", "lr_end": 0.1,
           "decay_fraction": 0.2, "b1": 0.9, "b2": 0.95, "eps": 1e-8, "momentum": None,
           "no_decay": None}
    assert check_resume(old, new, (), where="ckpt") == {}
    with pytest.raises(ConfigError, match=r"optimizer 'adamw' -> 'lion'"):
        check_resume(old, {**new, "optimizer": "lion", "b2": 0.99}, (), where="ckpt")


# Wide enough that adafactor factors its second moments (both dims >= optax's 128).
FACTORED = {"w": jnp.linspace(-1.0, 1.0, 256 * 128).reshape(256, 128), "b": jnp.ones(128)}


def _jitted_updates(tx, steps=3):
    """Each step's updates of ``tx``, its update jitted, with gradients that change per step."""
    params, out = FACTORED, []
    with optax_promotion():
        state = jax.jit(tx.init)(params)
        update = jax.jit(tx.update)
        for step in range(steps):
            grads = jax.tree.map(lambda p, s=step: jnp.cos(p * (s + 2.0)), params)
            updates, state = update(grads, state, params)
            params = optax.apply_updates(params, updates)
            out.append(updates)
    return out


def test_adafactor_jitted_equals_optaxs_jitted_adafactor():
    """Under jit (a training step), with factored moments: no decay gives optax's own updates
    bit for bit; a decay adds exactly ``-lr * rate * W`` (decoupled, as AdamW's)."""
    schedule = make_schedule("linear", 1e-2, 10, warmup_steps=1)
    plain = dict(optimizer="adafactor", schedule="linear", warmup_steps=1, clip_norm=None)
    ours = _jitted_updates(make_optimizer(1e-2, 10, **plain))
    theirs = _jitted_updates(optax.adafactor(schedule, eps=1e-30))
    with optax_promotion():
        assert len(optax.adafactor(1.0).init(FACTORED)[0].v_row["w"].shape) == 1  # factored
    for a, b in zip(ours, theirs, strict=True):
        _equal(a, b)
    decayed = _jitted_updates(make_optimizer(1e-2, 10, weight_decay=0.5, **plain), steps=1)
    first_lr = float(schedule(0))
    np.testing.assert_allclose(decayed[0]["w"], ours[0]["w"] - first_lr * 0.5 * FACTORED["w"],
                               rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_trains_in_the_jitted_step(name):
    """Each optimizer through the planned, jitted train step of a model wide enough to factor
    (the path ``effijax train`` takes): two steps, the loss finite, every kernel moved."""
    from effijax.recipe import build_lm_job

    toks = np.frombuffer(b"def f(x):\n    return x + 1\n" * 40, np.uint8)
    tx = make_optimizer(1e-3, 10, optimizer=name, weight_decay=0.01)
    job = build_lm_job(gpt_config("tiny", d_model=128, n_layers=1, seq_len=16), "fp32", tx,
                       train_tokens=toks, val_tokens=toks, batch_size=2)
    state, first = job.step(job.state, job.batch(0))
    state, second = job.step(state, job.batch(1))
    assert int(state.step) == 2
    assert np.isfinite(float(first["lm_loss"])) and np.isfinite(float(second["lm_loss"]))
    before, after = dict(named_leaves(job.state.params)), dict(named_leaves(state.params))
    for path in (p for p in before if p.endswith("kernel")):
        assert not np.array_equal(before[path], after[path]), (name, path)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3"])
def test_adafactor_trains_every_family(family):
    """Adafactor (factored: 128 wide) through each family's jitted train step: the loss falls
    over a few steps on a repeated text."""
    from effijax import models
    from effijax.recipe import build_lm_job

    config = getattr(models, f"{family}_config")(f"{family}-tiny", d_model=128, seq_len=16)
    toks = np.frombuffer(b"def f(x):\n    return x + 1\n" * 40, np.uint8)
    tx = make_optimizer(3e-2, 20, optimizer="adafactor", weight_decay=0.01, schedule="constant")
    job = build_lm_job(config, "fp32", tx, train_tokens=toks, val_tokens=toks, batch_size=2)
    state, losses = job.state, []
    for step in range(6):
        state, metrics = job.step(state, job.batch(step))
        losses.append(float(metrics["lm_loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5, losses
