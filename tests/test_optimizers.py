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


@pytest.mark.parametrize("name, reference", [
    ("adamw", lambda lr: optax.adamw(lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.01)),
    ("adam", lambda lr: optax.chain(optax.add_decayed_weights(0.01),
                                    optax.adam(lr, b1=0.9, b2=0.95, eps=1e-8))),
    ("lion", lambda lr: optax.lion(lr, b1=0.9, b2=0.99, weight_decay=0.01)),
    ("adafactor", lambda lr: optax.adafactor(lr, eps=1e-30, weight_decay_rate=0.01)),
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
