"""The optimizer of a run, as a choice: which optax optimizer, its schedule, its weight decay.

``make_optimizer`` composes, from the outside in, ``accumulate(loss_scale(chain(clip,
optimizer)))``: gradient accumulation (``optax.MultiSteps`` with an overflow repair) around the
loss scale around a global-norm clip and the optimizer, whose hyperparameters are injected
(``optax.inject_hyperparams``) so the learning rate of each step is in the state and the
metrics.

* ``OPTIMIZERS``: ``adamw`` (the default: decoupled weight decay, b2 = 0.95 as in GPT-3 and
  Llama), ``adam``, ``lion`` (Chen et al. 2023: sign updates, b2 = 0.99; use a learning rate
  3-10x smaller than AdamW's), ``adafactor`` (factored second moments: optimizer state far
  below Adam's for large matrices) and ``sgd`` (with momentum 0.9, Nesterov off).
* ``SCHEDULES``: every one starts with a linear warm-up from 0, then ``constant``, ``linear``
  (to ``lr_end`` x the peak), ``cosine`` (the default; to ``lr_end`` x the peak) or ``wsd``
  (warm-up, stable, decay: constant until the last ``decay_fraction`` of the steps, then a
  linear decay to ``lr_end`` x the peak; Hu et al. 2024).
* Weight decay applies to every parameter unless ``no_decay`` names some: ``norms``,
  ``biases``, ``embeddings`` (comma-separated) or a regex over '/'-joined paths. Every parameter
  decays by default because that is what runs before this choice existed did (a resumed run
  must keep its arithmetic); ``no_decay="norms,biases"`` is the usual choice for new runs
  (decaying a norm's scale towards 0 fights the normalisation).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from effijax.errors import ConfigError, whole_number

# jax, optax and the precision transforms are imported where an optimizer is built: checking a
# config's choice (OPTIMIZERS, hyperparameters, decay_mask's regex) must not start jax, so
# that a bad flag fails in a fraction of a second (tests/test_cli_fast.py).

__all__ = ["OPTIMIZERS", "SCHEDULES", "DEFAULTS", "make_optimizer", "make_schedule",
           "decay_mask", "hyperparameters", "optax_promotion"]

OPTIMIZERS = ("adamw", "adam", "lion", "adafactor", "sgd")
SCHEDULES = ("constant", "linear", "cosine", "wsd")
# Each optimizer's hyperparameters and their defaults (what an unset one means).
DEFAULTS = {
    "adamw": {"b1": 0.9, "b2": 0.95, "eps": 1e-8},
    "adam": {"b1": 0.9, "b2": 0.95, "eps": 1e-8},
    "lion": {"b1": 0.9, "b2": 0.99},
    "adafactor": {"eps": 1e-30},
    "sgd": {"momentum": 0.9},
}
# What each names in no_decay.
_GROUPS = {
    "norms": r"(^|/)(ln[^/]*|[^/]*norm[^/]*)/[^/]+$",
    "biases": r"(^|/)bias$",
    "embeddings": r"(^|/)[^/]*embed[^/]*/[^/]+$",
}


def optax_promotion():
    """The dtype-promotion context optax calls run under (standard promotion).

    optax 0.2.8 is not clean under strict promotion (Adam's bias correction raises a float to an
    int32 count; schedules compare floats with int32 steps), so effijax runs *only* the optimizer's
    ``init`` and ``update`` under standard promotion; the model and the loss keep the caller's
    setting (the test suite runs them under strict promotion).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx, params = optax.adam(1e-3), {"w": jnp.ones(2)}
      >>> with optax_promotion():
      ...     updates, _ = tx.update(params, tx.init(params))
    """
    import jax

    return jax.numpy_dtype_promotion("standard")


def make_schedule(schedule: str, learning_rate: float, total_steps: int, *,
                  warmup_steps: int = 0, lr_end: float = 0.1,
                  decay_fraction: float = 0.2) -> Callable:
    """The learning rate of each optimizer step: a linear warm-up from 0 to ``learning_rate``,
    then ``schedule`` (see the module docstring) over the rest of ``total_steps``.

    Example:
      >>> s = make_schedule("wsd", 1.0, 110, warmup_steps=10, lr_end=0.0, decay_fraction=0.2)
      >>> [round(float(s(t)), 3) for t in (0, 5, 10, 89, 90, 100, 110)]
      [0.0, 0.5, 1.0, 1.0, 1.0, 0.5, 0.0]
      >>> make_schedule("step", 1.0, 100)
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: schedule='step': choose one of constant, linear, cosine, wsd
    """
    import optax

    if schedule not in SCHEDULES:
        raise ConfigError("schedule", schedule, f"choose one of {', '.join(SCHEDULES)}")
    end = learning_rate * lr_end
    if schedule == "cosine":  # optax's own, as every run before the choice existed used it
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
            decay_steps=max(total_steps, warmup_steps + 1), end_value=end)
    rest = max(total_steps - warmup_steps, 1)
    if schedule == "constant":
        after = optax.constant_schedule(learning_rate)
    elif schedule == "linear":
        after = optax.linear_schedule(learning_rate, end, rest)
    else:
        decay = max(1, round(rest * decay_fraction))
        after = optax.join_schedules([optax.constant_schedule(learning_rate),
                                      optax.linear_schedule(learning_rate, end, decay)],
                                     [rest - decay])
    if not warmup_steps:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, learning_rate, warmup_steps), after],
                                [warmup_steps])


def decay_mask(no_decay: str | None) -> Callable | None:
    """The weight-decay mask of ``no_decay`` (None: every parameter decays): a function of the
    parameters giving True where a leaf decays.

    Example:
      >>> import jax.numpy as jnp
      >>> params = {"ln1": {"scale": jnp.ones(2), "bias": jnp.ones(2)},
      ...           "q": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)},
      ...           "embed": {"embedding": jnp.ones((4, 2))}}
      >>> decay_mask("norms,biases")(params)
      {'embed': {'embedding': True}, 'ln1': {'bias': False, 'scale': False}, \
'q': {'bias': False, 'kernel': True}}
      >>> decay_mask("(")
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: no_decay='(': not norms, biases, embeddings, nor a valid regex ...
    """
    if no_decay is None:
        return None
    words = [w.strip() for w in no_decay.split(",") if w.strip()]
    if words and all(w in _GROUPS for w in words):
        pattern = "|".join(_GROUPS[w] for w in words)
    else:
        pattern = no_decay
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ConfigError("no_decay", no_decay, f"not {', '.join(_GROUPS)}, nor a valid regex "
                          f"({e})") from None

    def mask(params):
        import jax

        from effijax.paths import path_of

        return jax.tree_util.tree_map_with_path(
            lambda path, _: compiled.search(path_of(path)) is None, params)

    return mask


def _base(optimizer: str, schedule, weight_decay: float, mask, hyper: dict):
    """The optimizer itself, its hyperparameters injected (the schedule's value is in the
    state at every step)."""
    import optax

    # A mask is a function too: static, or inject_hyperparams would call it as a schedule.
    if optimizer == "adamw":
        return optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
            learning_rate=schedule, b1=hyper["b1"], b2=hyper["b2"], eps=hyper["eps"],
            weight_decay=weight_decay, mask=mask)
    if optimizer == "lion":
        return optax.inject_hyperparams(optax.lion, static_args=("mask",))(
            learning_rate=schedule, b1=hyper["b1"], b2=hyper["b2"], weight_decay=weight_decay,
            mask=mask)
    if optimizer == "adafactor":
        return optax.inject_hyperparams(_adafactor, static_args=("mask",))(
            learning_rate=schedule, eps=hyper["eps"], weight_decay=weight_decay, mask=mask)
    if optimizer == "adam":
        inner = optax.inject_hyperparams(optax.adam)(learning_rate=schedule, b1=hyper["b1"],
                                                     b2=hyper["b2"], eps=hyper["eps"])
    else:
        inner = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule,
                                                    momentum=hyper["momentum"])
    if not weight_decay:
        return inner
    # Adam and SGD have no decay of their own: L2 decay added to the gradient, as torch's
    # weight_decay does for them (use adamw for the decoupled kind).
    return optax.chain(optax.add_decayed_weights(weight_decay, mask), inner)


def _adafactor(learning_rate, eps, weight_decay, mask):
    """optax's adafactor with its defaults and decoupled weight decay: the update is
    ``-lr * (adafactor's direction + weight_decay * W)``, as AdamW's and Lion's are.

    Only these four are injected: optax's own ``inject_hyperparams(optax.adafactor)`` also
    turns its shape arguments (``min_dim_size_to_factor``) into arrays, which its factoring
    compares with shapes in Python, so no jitted step could run. optax's ``weight_decay_rate``
    adds ``rate * W`` after the learning rate, a decay of ``rate`` per step whatever the
    learning rate; here it is scaled by the learning rate of the step.
    """
    import optax

    return optax.chain(optax.adafactor(learning_rate, eps=eps),
                       optax.add_decayed_weights(-learning_rate * weight_decay, mask))


def make_optimizer(
    learning_rate: float,
    total_steps: int,
    *,
    optimizer: str = "adamw",
    schedule: str = "cosine",
    warmup_steps: int = 0,
    lr_end: float = 0.1,
    decay_fraction: float = 0.2,
    weight_decay: float = 0.0,
    no_decay: str | None = None,
    clip_norm: float | None = 1.0,
    b1: float | None = None,
    b2: float | None = None,
    eps: float | None = None,
    momentum: float | None = None,
    loss_scale: str | float | Callable | None = None,
    accumulate: int = 1,
) -> Any:
    """An optax optimizer with a warm-up schedule, clipping, loss scaling and accumulation.

    The composition is ``accumulate(loss_scale(chain(clip, optimizer)), k)`` (``accumulate`` is
    ``optax.MultiSteps`` with an accumulator that recovers from an overflow): the clip sees
    unscaled gradients, the schedule's counter does not advance on skipped steps, and with
    accumulation one finiteness check decides each effective step.

    Args:
      learning_rate: peak learning rate.
      total_steps: number of optimizer (effective) steps the schedule spans.
      optimizer: one of :data:`OPTIMIZERS`.
      schedule: one of :data:`SCHEDULES` (after the warm-up).
      warmup_steps: linear warm-up length.
      lr_end: the final learning rate of ``linear``, ``cosine`` and ``wsd``, as a fraction of
        the peak.
      decay_fraction: ``wsd``'s share of the steps (after the warm-up) spent decaying.
      weight_decay: decoupled weight decay (AdamW, Lion, Adafactor), or L2 decay added to the
        gradients (Adam, SGD).
      no_decay: parameters that do not decay (:func:`decay_mask`); None: every one decays.
      clip_norm: global-norm clip threshold, or None for no clipping.
      b1, b2, eps, momentum: the optimizer's hyperparameters; None takes :data:`DEFAULTS`
        (giving one the optimizer has not is an error). Scale ``eps`` with the loss when the
        objective is multiplied by a small constant: Adam is scale-invariant except there.
      loss_scale: None (no scaling), ``"dynamic"`` (:func:`dynamic_loss_scale` with PyTorch's
        defaults), a number (a static scale), or a wrapper such as
        ``functools.partial(dynamic_loss_scale, init_scale=2.0**24, growth_interval=100)``.
      accumulate: micro-steps per optimizer step (:func:`effijax.precision.accumulate`);
        1 means none.

    Example:
      >>> import jax.numpy as jnp
      >>> from effijax.step import learning_rate_of
      >>> tx = make_optimizer(1e-3, 100, warmup_steps=10, loss_scale="dynamic")
      >>> float(learning_rate_of(tx.init({"w": jnp.ones(2)})))
      0.0
      >>> tx = make_optimizer(3e-4, 100, optimizer="lion", schedule="wsd", no_decay="biases")
      >>> make_optimizer(1e-3, 100, optimizer="sgd", b2=0.99)
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: b2=0.99: sgd has no b2 (its hyperparameters: momentum)
    """
    import optax

    from effijax.precision import accumulate as accumulate_gradients
    from effijax.precision import dynamic_loss_scale, static_loss_scale

    if not (isinstance(learning_rate, int | float) and learning_rate > 0):
        raise ValueError(f"learning_rate must be > 0, got {learning_rate!r}")
    whole_number("total_steps", total_steps)
    if not (whole_number("warmup_steps", warmup_steps, minimum=0) <= total_steps):
        raise ValueError(f"warmup_steps must be in [0, total_steps={total_steps}], "
                         f"got {warmup_steps!r}")
    if clip_norm is not None and not clip_norm > 0:
        raise ValueError(f"clip_norm must be > 0 or None, got {clip_norm!r}")
    whole_number("accumulate", accumulate)
    hyper = hyperparameters(optimizer, b1=b1, b2=b2, eps=eps, momentum=momentum)
    lr = make_schedule(schedule, learning_rate, total_steps, warmup_steps=warmup_steps,
                       lr_end=lr_end, decay_fraction=decay_fraction)
    tx = _base(optimizer, lr, weight_decay, decay_mask(no_decay), hyper)
    tx = tx if clip_norm is None else optax.chain(optax.clip_by_global_norm(clip_norm), tx)
    if loss_scale == "dynamic":
        tx = dynamic_loss_scale(tx)
    elif isinstance(loss_scale, int | float) and not isinstance(loss_scale, bool):
        tx = static_loss_scale(tx, float(loss_scale))
    elif callable(loss_scale):
        tx = loss_scale(tx)
    elif loss_scale is not None:
        raise ValueError(
            f"loss_scale must be None, 'dynamic', a positive number or a wrapper callable, "
            f"got {loss_scale!r}"
        )
    if accumulate > 1:
        tx = accumulate_gradients(tx, accumulate)
    return _standard_promotion(tx)


def hyperparameters(optimizer: str, **given) -> dict:
    """The optimizer's hyperparameters: those given (not None), else :data:`DEFAULTS`.

    Raises:
      ConfigError: an unknown optimizer, or a hyperparameter it does not have.

    Example:
      >>> hyperparameters("lion", b1=0.95)
      {'b1': 0.95, 'b2': 0.99}
    """
    if optimizer not in DEFAULTS:
        raise ConfigError("optimizer", optimizer, f"choose one of {', '.join(OPTIMIZERS)}")
    own = DEFAULTS[optimizer]
    for name, value in given.items():
        if value is not None and name not in own:
            raise ConfigError(name, value, f"{optimizer} has no {name} (its hyperparameters: "
                              f"{', '.join(own) or 'none'})")
    return {name: given.get(name) if given.get(name) is not None else default
            for name, default in own.items()}


def _standard_promotion(tx):
    """``tx`` with its init and update run under :func:`optax_promotion`, so it can be used
    directly under strict promotion too."""
    import optax

    tx = optax.with_extra_args_support(tx)

    def init(params):
        with optax_promotion():
            return tx.init(params)

    def update(updates, state, params=None, **extra):
        with optax_promotion():
            return tx.update(updates, state, params, **extra)

    return optax.GradientTransformationExtraArgs(init, update)
