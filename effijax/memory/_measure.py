"""Compiled-memory measurement: what XLA allocates, set against the analytic estimates.

:func:`measure` compiles a function and reads ``compiled.memory_analysis()``: per device, the
bytes of the arguments, the outputs (``alias_bytes`` of them reuse donated arguments), the
temporaries XLA's buffer assignment needs at its peak, and the generated code. Nothing runs:
``ShapeDtypeStruct`` arguments are enough.

For a jitted train step these line up with the estimates as follows:

* arguments = parameters + optimizer state + batch (+ step counter and PRNG key): exactly
  :func:`estimate_tree`'s ``params_bytes + optimizer_bytes`` plus :func:`tree_bytes` of the rest;
* temporaries = gradients + activations + working buffers of the backward pass, the logits and
  the loss (neither in the activation formula), and the optimizer's update.

:func:`compare` makes those rows; :func:`activation_measure` sweeps a GPT's train step over
sequence lengths for naive vs blockwise attention vs rematerialisation, with the activation formula
(:func:`activation_bytes`) next to every point. How close they get on the CPU is recorded in
``tests/test_memory_measure.py``: for f32 the measured activations (temporaries minus
gradients) are 1.5x to 3.8x the formula, which is a lower bound.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from effijax.errors import ConfigError, whole_number
from effijax.memory._activations import activation_bytes
from effijax.memory._estimate import ModelStateBytes, format_bytes
from effijax.memory._tree import estimate_tree

__all__ = [
    "ACTIVATION_VARIANTS",
    "ActivationPoint",
    "Measurement",
    "ROW_HEADER",
    "Row",
    "activation_measure",
    "compare",
    "measure",
    "tree_bytes",
]


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Per-device bytes of one compiled program (``compiled.memory_analysis()``).

    Attributes:
      argument_bytes: inputs, donated or not.
      output_bytes: outputs, including those aliased to donated inputs.
      alias_bytes: output bytes that reuse a donated input's buffer.
      temp_bytes: temporaries (XLA's buffer assignment: live intermediates at their peak).
      generated_code_bytes: compiled code (0 on the CPU).
      peak_bytes: the backend's peak estimate, when it reports one, else None.
    """

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    peak_bytes: int | None = None

    @property
    def total_bytes(self) -> int:
        """Arguments + outputs not aliased to arguments + temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def measure(fn: Callable, *args, **kwargs) -> Measurement:
    """Compiles ``fn(*args, **kwargs)`` and returns its per-device memory.

    Args:
      fn: a ``jax.jit`` function (or anything with ``.lower``: its donation and shardings are
        honoured); a plain function is jitted with defaults; or an already compiled
        ``jax.stages.Compiled`` (then without arguments), to measure what will be run.
      *args, **kwargs: arrays or ``jax.ShapeDtypeStruct`` s (with shardings, for a sharded
        program); nothing is executed.

    Returns:
      A :class:`Measurement`.

    Raises:
      ValueError: a ``Compiled`` program given together with arguments.
      RuntimeError: when the backend reports no memory analysis.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
      >>> m = measure(jax.jit(lambda a: jnp.sin(a) @ a), x)
      >>> m.argument_bytes, m.output_bytes  # 256 * 256 * 4
      (262144, 262144)
    """
    if isinstance(fn, jax.stages.Compiled):
        if args or kwargs:
            # A ValueError, not a ConfigError: a call that mixes up the two ways of calling
            # measure is a bug in the calling code, not a setting.
            raise ValueError("measure: a Compiled program takes no arguments here; pass the "
                             "jitted function and its arguments, or the Compiled alone")
        compiled = fn
    elif hasattr(fn, "lower"):
        compiled = fn.lower(*args, **kwargs).compile()
    else:
        compiled = jax.jit(fn).lower(*args, **kwargs).compile()
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError(
            f"measure: the {jax.default_backend()} backend reports no memory analysis for this "
            "program"
        )
    peak = getattr(stats, "peak_memory_in_bytes", None)
    return Measurement(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        generated_code_bytes=int(stats.generated_code_size_in_bytes),
        peak_bytes=None if peak is None else int(peak),
    )


def _leaf_device_bytes(leaf) -> int:
    shape = tuple(leaf.shape)
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None and hasattr(sharding, "shard_shape"):
        shape = sharding.shard_shape(shape)
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended):
        return math.prod(shape) * leaf.dtype.itemsize  # typed PRNG keys: their uint32 words
    return -(-math.prod(shape) * jax.dtypes.itemsize_bits(leaf.dtype) // 8)


def tree_bytes(tree: Any) -> int:
    """Per-device bytes of a pytree of arrays or ``ShapeDtypeStruct`` s (shards when sharded).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> tree_bytes({"x": jnp.zeros((4, 8), jnp.bfloat16), "key": jax.random.key(0)})
      72
    """
    return sum(_leaf_device_bytes(leaf) for leaf in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class Row:
    """One estimate next to its measurement.

    Attributes:
      quantity: what is compared.
      estimate: estimated bytes.
      measured: measured bytes.
    """

    quantity: str
    estimate: int
    measured: int

    @property
    def rel_error(self) -> float:
        """``(estimate - measured) / measured``: negative when the estimate is too low."""
        if self.measured == 0:
            return 0.0 if self.estimate == 0 else math.inf
        return (self.estimate - self.measured) / self.measured

    def cells(self) -> list[str]:
        """``[quantity, estimate, measured, relative error]`` as strings (for a table)."""
        return [self.quantity, format_bytes(self.estimate), format_bytes(self.measured),
                f"{self.rel_error:+.1%}"]


ROW_HEADER = ["quantity", "estimate", "measured", "relative error"]


def compare(
    estimate: ModelStateBytes,
    measurement: Measurement,
    *,
    other_argument_bytes: int = 0,
    activation_bytes: int | None = None,
) -> tuple[Row, ...]:
    """Lines an estimate up with a compiled train step's measurement.

    Rows:

    * ``arguments``: ``params_bytes + optimizer_bytes + other_argument_bytes`` (the batch, step
      counter, PRNG key: :func:`tree_bytes`) vs the step's argument bytes. Gradients are not
      arguments: a step creates them.
    * ``temporaries`` (when ``activation_bytes`` is given): ``grads_bytes + activation_bytes``
      vs the temporaries; the rest of the temporaries is what the formulas do not count.

    Args:
      estimate: per-device model states (:func:`estimate_tree` or :func:`model_states`).
      measurement: :func:`measure` of the step.
      other_argument_bytes: bytes of the step's non-state arguments.
      activation_bytes: an activation estimate (:func:`activation_bytes`), or None.

    Returns:
      A tuple of :class:`Row` s.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> params = {"w": jax.ShapeDtypeStruct((512, 512), jnp.float32)}
      >>> est = estimate_tree(params, optax.sgd(0.1), param_dtype=jnp.float32,
      ...                     compute_dtype=jnp.float32)
      >>> step = jax.jit(lambda p, x: jax.tree.map(
      ...     lambda w, g: w - 0.1 * g, p, jax.grad(lambda q: jnp.sum(x @ q["w"]))(p)))
      >>> x = jax.ShapeDtypeStruct((8, 512), jnp.float32)
      >>> row, = compare(est, measure(step, params, x), other_argument_bytes=tree_bytes(x))
      >>> row.quantity, row.rel_error
      ('arguments', 0.0)
    """
    rows = [Row("arguments", estimate.params_bytes + estimate.optimizer_bytes
                + other_argument_bytes, measurement.argument_bytes)]
    if activation_bytes is not None:
        rows.append(Row("temporaries", estimate.grads_bytes + activation_bytes,
                        measurement.temp_bytes))
    return tuple(rows)


# ----------------------------------------------------------------------------------------------
# Activation memory of a GPT train step.

# Variant name -> GPTConfig overrides.
ACTIVATION_VARIANTS: dict[str, dict[str, str]] = {
    "naive": {"attention": "naive", "remat": "none"},
    "blockwise": {"attention": "blockwise", "remat": "none"},
    "naive+remat": {"attention": "naive", "remat": "block"},
    "blockwise+remat": {"attention": "blockwise", "remat": "block"},
}


@dataclasses.dataclass(frozen=True)
class ActivationPoint:
    """One compiled train step of :func:`activation_measure`.

    Attributes:
      variant: name of the variant (a key of the ``variants`` mapping).
      seq_len: sequence length s.
      batch_size: sequences per step b.
      attention, remat: the GPT's attention implementation and remat mode.
      measurement: the compiled step's memory.
      states: model-state estimate of the step's parameters (:func:`estimate_tree`).
      formula_bytes: the activation formula for this shape (:func:`activation_bytes` with the
        compute dtype's bytes, dropout masks iff the model has dropout,
        ``checkpointing="block"`` for ``remat="block"``, ``blockwise_attention`` for
        ``attention="blockwise"``); None for remat modes the formula does not model
        (``"dots"``).
      rows: :func:`compare` of ``states`` (and the formula) with the measurement: arguments vs
        params + optimizer state + batch, step and key; temporaries vs gradients + formula.
      compiled: the compiled step, ``compiled(state, batch) -> (state, metrics)`` (donates
        ``state``), to run what was measured (state from ``init_train_state(init_params(config,
        policy, key), optimizer, key)``).
    """

    variant: str
    seq_len: int
    batch_size: int
    attention: str
    remat: str
    measurement: Measurement
    states: ModelStateBytes
    formula_bytes: int | None
    rows: tuple[Row, ...]
    compiled: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def activation_bytes(self) -> int:
        """Measured activations: the step's temporaries minus its gradients."""
        return self.measurement.temp_bytes - self.states.grads_bytes

    @property
    def ratio(self) -> float | None:
        """Measured activations over the formula (None without a formula)."""
        return None if not self.formula_bytes else self.activation_bytes / self.formula_bytes


def _keeps_scores(cfg, shape, batch_size: int, seq_len: int, policy) -> bool:
    """Whether ``cfg.attention`` stores ``s x s`` scores for the backward pass here."""
    from effijax.models import keeps_scores

    q = jax.ShapeDtypeStruct((batch_size, seq_len, shape.heads, shape.head_dim),
                             policy.compute_dtype)
    return keeps_scores(cfg.attention, q, dropout=getattr(cfg, "dropout", 0) > 0)


def _check_seq_lens(seq_lens: Sequence[int]) -> tuple[int, ...]:
    """``seq_lens`` as a tuple of whole, positive lengths, or one error about the sequence."""
    seq_lens = tuple(seq_lens)
    try:
        if seq_lens:
            return tuple(whole_number("seq_lens", s) for s in seq_lens)
    except ConfigError:
        pass  # reported below, about the whole sequence: the argument the caller gave
    raise ConfigError("seq_lens", seq_lens, "expected a non-empty sequence of positive ints, "
                      "e.g. (256, 512, 1024)")


def activation_measure(
    config: Any,
    seq_lens: Sequence[int],
    *,
    batch_size: int = 1,
    variants: Mapping[str, Mapping[str, Any]] | None = None,
    policy: Any = "fp32",
    optimizer: Any = None,
) -> tuple[ActivationPoint, ...]:
    """Compiled memory of a model's train step over sequence lengths, per variant, with the
    formula.

    Each point compiles ``jax.jit(make_train_step(loss, optimizer, policy), donate_argnums=0)``
    for ``dataclasses.replace(config, seq_len=s, **variants[name])`` on abstract state and
    batch (nothing is allocated or run) and reads :func:`measure`. The formula takes the
    model's :meth:`~effijax.models.LanguageModel.shape` (grouped-query attention and a gated
    MLP for the Llama family) and counts its fused head and loss.

    Args:
      config: any :class:`effijax.models.LanguageModel` with ``seq_len``, ``remat`` and
        ``attention`` fields (the GPT, the Llama family); its ``seq_len`` is replaced by each of
        ``seq_lens``.
      seq_lens: sequence lengths to measure.
      batch_size: sequences per step.
      variants: ``{name: GPTConfig overrides}``; default :data:`ACTIVATION_VARIANTS` (naive vs
        blockwise attention, with and without block remat). ``"blockwise"`` attention must be
        registered in ``effijax.models.ATTENTION``.
      policy: precision policy (name or :class:`~effijax.precision.Policy`).
      optimizer: optax optimizer; default ``optax.adam(1e-3)``.

    Returns:
      :class:`ActivationPoint` s, variant-major, in the order of ``variants`` and ``seq_lens``.

    Raises:
      ConfigError: for an empty or non-positive ``seq_lens`` (``field="seq_lens"``), or an
        override the config rejects (``field="variants['name']"``).
    """
    # Imported here: models pull in flax, which `import effijax.memory` (the CLI's estimator)
    # does not need.
    import optax

    from effijax.precision import get_policy
    from effijax.step import init_train_state, make_train_step

    seq_lens = _check_seq_lens(seq_lens)
    variants = dict(ACTIVATION_VARIANTS if variants is None else variants)
    policy = get_policy(policy)
    optimizer = optax.adam(1e-3) if optimizer is None else optimizer
    bytes_per_value = jnp.dtype(policy.compute_dtype).itemsize

    points = []
    for name, overrides in variants.items():
        for s in seq_lens:
            try:
                cfg = dataclasses.replace(config, seq_len=s, **overrides)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"variants[{name!r}]", overrides,
                                  f"the model config rejects it: {e}") from e
            abstract = cfg.abstract_params(policy)
            loss_fn = cfg.loss_fn()
            step = jax.jit(make_train_step(lambda p, b, r, f=loss_fn: f(p, b, r)[0],
                                           optimizer, policy), donate_argnums=0)
            state = jax.eval_shape(lambda p: init_train_state(p, optimizer, jax.random.key(0)),
                                   abstract)
            tokens = jax.ShapeDtypeStruct((batch_size, s), jnp.int32)
            batch = {"inputs": tokens, "targets": tokens}
            compiled = step.lower(state, batch).compile()
            measurement = measure(compiled)
            states = estimate_tree(abstract, optimizer, param_dtype=policy.param_dtype,
                                   compute_dtype=policy.compute_dtype)
            formula = None
            if cfg.remat in ("none", "block"):
                shape = cfg.shape()
                formula = activation_bytes(
                    **shape.activation_args(), seq_len=s, batch_size=batch_size,
                    bytes_per_value=bytes_per_value, dropout=getattr(cfg, "dropout", 0) > 0,
                    checkpointing=cfg.remat,
                    blockwise_attention=not _keeps_scores(cfg, shape, batch_size, s, policy),
                )
            rows = compare(states, measurement, activation_bytes=formula,
                           other_argument_bytes=tree_bytes((batch, state.step, state.rng)))
            points.append(ActivationPoint(
                variant=name, seq_len=s, batch_size=batch_size, attention=cfg.attention,
                remat=cfg.remat, measurement=measurement, states=states, formula_bytes=formula,
                rows=rows, compiled=compiled,
            ))
    return tuple(points)
