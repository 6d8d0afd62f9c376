"""The language-model training job: GPT + offline corpus + policy + optimizer, assembled once.

``effijax train``, the experiments and the notebooks all train through :func:`build_lm_job`, so
a setting means the same thing everywhere. A job is a bundle of pure pieces: the initial
``TrainState``, the jitted (donating) step, ``batch(step)`` (a deterministic function of the
step) and ``evaluate(params)``.

With a ``mesh`` the job is data-parallel under a sharding strategy (ddp, zero1, zero2, fsdp):
the state is born sharded (no device ever holds the whole model), every process builds only its
own rows of each global batch, and ``compile()`` compiles the step once and reports its
per-device memory and the collectives XLA planned. Without a mesh it runs on one device, as
it always did.

With a :class:`~effijax.lora.LoraSpec` the job fine-tunes low-rank adapters of a frozen base
(:func:`effijax.lora.freeze_base`): the state's params are the adapters (f32, with their
optimizer state), the base is stored in ``frozen_dtype`` and travels in every batch as
``batch["base"]`` (an input of the compiled step, laid out as the strategy lays out parameters;
the adapters are laid out like their kernels, :func:`effijax.lora.adapter_rules`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from effijax import lora as lora_lib
from effijax.data import batch_at, eval_batches
from effijax.distributed import global_batch
from effijax.errors import ConfigError
from effijax.models import GPTConfig, abstract_split, init_params, make_apply, make_loss_fn
from effijax.paths import named_leaves
from effijax.precision import Policy, cast_floating, cross_entropy, get_policy, parse_dtype
from effijax.sharding import (
    Census,
    MemoryReport,
    ShardedStep,
    batch_sharding,
    check_batch,
    compile_with_census,
    constraints,
    get_strategy,
    memory_report,
    param_shardings,
    replicated,
    with_shardings,
)
from effijax.train import TrainState, init_train_state, make_sharded_training, make_train_step

__all__ = ["LMJob", "CompiledStep", "build_lm_job", "abstract_lm_state"]


class CompiledStep(NamedTuple):
    """The job's step compiled once, with what it holds and communicates per device.

    Attributes:
      step: the executable: ``step(state, batch) -> (state, metrics)``, donating the state,
        the same program as ``LMJob.step`` (train with it to skip a second compilation).
      memory: per-device bytes: state leaves (params, opt_state, other) and gradients from the
        shardings; arguments, outputs, temporaries from ``compiled.memory_analysis()``.
      census: the collectives after XLA's SPMD partitioner (empty on one device, or when not
        asked for).
    """

    step: Callable[[TrainState, Any], tuple[TrainState, dict]]
    memory: MemoryReport
    census: Census


class LMJob(NamedTuple):
    """A ready-to-run training job (see :func:`build_lm_job`).

    Attributes:
      state: the initial ``TrainState`` (donated by the first ``step``).
      step: ``step(state, batch) -> (state, metrics)``, jitted, donating the state.
      batch: ``batch(step_no)``: the global batch of that step (global arrays when sharded).
      evaluate: ``evaluate(params) -> float``: mean loss over the fixed validation batches.
      tokens_per_step: tokens in one global batch.
      num_params: parameters of the model.
      shardings: the ``NamedSharding`` of every state leaf (None on a single device).
      mesh: the mesh (None on a single device).
      strategy: the strategy's name (None on a single device).
      compile: ``compile(census=True) -> CompiledStep``: compiles the step from the state's
        shapes and shardings (its buffers are not touched, so it works after training too):
        the executable, the per-device memory and, with ``census``, the collectives (read from
        the same compilation).
      trainable_params: parameters that get gradients (``num_params`` without LoRA).
      lora: the job's :class:`~effijax.lora.LoraSpec` (None: full training).
      frozen: with LoRA, the frozen base parameters (what ``batch(step)["base"]`` holds).
    """

    state: TrainState
    step: Callable[[TrainState, Any], tuple[TrainState, dict]]
    batch: Callable[[int], dict]
    evaluate: Callable[[Any], float]
    tokens_per_step: int
    num_params: int
    shardings: Any = None
    mesh: Any = None
    strategy: str | None = None
    compile: Callable[..., CompiledStep] | None = None
    trainable_params: int = 0
    lora: lora_lib.LoraSpec | None = None
    frozen: Any = None


def abstract_lm_state(model: GPTConfig, policy: Policy | str,
                      optimizer: optax.GradientTransformation, *, seed: int = 0,
                      lora: lora_lib.LoraSpec | None = None) -> TrainState:
    """The shapes and dtypes of :func:`build_lm_job`'s initial state, without building it.

    Nothing is initialized or compiled (``jax.eval_shape`` only): what a pre-flight check such
    as :func:`effijax.checkpoint.validate_resume` compares a checkpoint against.

    Example:
      >>> import optax
      >>> from effijax.models import gpt_config
      >>> s = abstract_lm_state(gpt_config("tiny", seq_len=16), "fp32", optax.adam(1e-3))
      >>> s.step.shape, s.step.dtype
      ((), dtype('int32'))
    """
    policy = get_policy(policy)
    key_params, key_run = jax.random.split(jax.random.key(seed))
    _, abstract = abstract_split(model, policy)
    if lora is not None:
        abstract = _abstract_adapters(abstract, lora, key_params)
    return jax.eval_shape(lambda p, k: init_train_state(p, optimizer, k), abstract, key_run)


def _adapter_key(key_params: jax.Array) -> jax.Array:
    """The adapters' init key: the base keeps ``key_params``, so a LoRA job on a fresh base
    starts from the same base as a full job with the same seed."""
    return jax.random.fold_in(key_params, 1)


def _abstract_adapters(abstract_base, spec: lora_lib.LoraSpec, key_params: jax.Array):
    """Shapes of the adapters; raises the spec's ConfigError before anything is built."""
    key = _adapter_key(key_params)
    lora_lib.init(key, abstract_base, spec)  # errors outside of a trace read better
    return jax.eval_shape(lambda k: lora_lib.init(k, abstract_base, spec), key)


def _check_base(base_params, abstract_base) -> None:
    """A given base must have exactly the model's parameter paths and shapes."""
    want = dict(named_leaves(abstract_base))
    got = dict(named_leaves(base_params))
    for path, leaf in want.items():
        if path not in got:
            raise ConfigError("base_params", path, "the model has this parameter but the base "
                              "does not: it was trained with another model configuration")
        if tuple(got[path].shape) != tuple(leaf.shape):
            raise ConfigError("base_params", path, f"shape {tuple(got[path].shape)} but the "
                              f"model expects {tuple(leaf.shape)}: it was trained with another "
                              "model configuration")
    extra = sorted(set(got) - set(want))
    if extra:
        raise ConfigError("base_params", extra[0], f"the base has {len(extra)} parameters the "
                          "model does not: it was trained with another model configuration")


def build_lm_job(
    model: GPTConfig,
    policy: Policy | str,
    optimizer: optax.GradientTransformation,
    *,
    train_tokens: np.ndarray,
    val_tokens: np.ndarray,
    batch_size: int,
    seed: int = 0,
    num_eval_batches: int = 4,
    loss_multiplier: float = 1.0,
    allow_unscaled_fp16: bool = False,
    mesh=None,
    strategy: str = "ddp",
    rules: Sequence[tuple] | None = None,
    lora: lora_lib.LoraSpec | None = None,
    base_params: Any = None,
    frozen_dtype: Any = None,
) -> LMJob:
    """Assembles a GPT language-model training job on a byte corpus.

    Args:
      model: the GPT configuration (its ``seq_len`` is the training sequence length).
      policy: precision policy or preset name.
      optimizer: any optax transformation (see :func:`effijax.train.make_optimizer`).
      train_tokens, val_tokens: uint8 corpora (see :func:`effijax.data.split_corpus`).
      batch_size: global batch size (sequences per step).
      seed: seeds the parameters, the dropout keys and the batch order.
      num_eval_batches: fixed validation batches used by ``evaluate``.
      loss_multiplier: multiplies the training objective. Values far below 1 push gradients
        below fp16's range (the precision experiment uses 2^-16); the metric ``lm_loss``
        always reports the unmultiplied loss.
      allow_unscaled_fp16: see :func:`effijax.train.make_train_step`.
      mesh: a mesh from :func:`effijax.sharding.make_mesh` for data-parallel training over
        its devices (every process' devices in a multi-process run); None: one device.
      strategy: with a mesh, ``ddp``, ``zero1``, ``zero2`` or ``fsdp`` (``zero3``).
      rules: with a mesh, partition rules (:func:`effijax.sharding.partition_specs`).
      lora: fine-tune LoRA adapters of a frozen base instead of every parameter; the
        adapters are initialised from ``seed``.
      base_params: with ``lora``, the frozen base (e.g. an earlier run's parameters; any
        sharding, resharded as the strategy says); None: initialised from ``seed`` as a full
        job would.
      frozen_dtype: with ``lora``, the base's storage dtype (default: the policy's compute
        dtype, e.g. bf16 under the bf16 policy; the adapters stay in their spec's dtype).

    Returns:
      An :class:`LMJob` whose ``step`` is jitted with the state donated.

    Raises:
      ConfigError: with a mesh, an unknown strategy, bad rules, or a ``batch_size`` that does
        not split over data*fsdp or over the processes; with ``lora``, targets that match no
        kernel, a rank above a kernel's dimension, or a ``base_params`` of another model;
        before anything is compiled.

    Example:
      >>> import numpy as np, optax
      >>> from effijax.models import gpt_config
      >>> toks = np.frombuffer(b"hello world " * 200, np.uint8)
      >>> job = build_lm_job(gpt_config("tiny", seq_len=16), "fp32", optax.adam(1e-3),
      ...                    train_tokens=toks, val_tokens=toks, batch_size=2)
      >>> state, metrics = job.step(job.state, job.batch(0))
      >>> int(state.step), bool(metrics["lm_loss"] > 4.0)
      (1, True)
    """
    policy = get_policy(policy)
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if not loss_multiplier > 0:
        raise ValueError(f"loss_multiplier must be > 0, got {loss_multiplier!r}")
    key_params, key_run = jax.random.split(jax.random.key(seed))
    graphdef, abstract = abstract_split(model, policy)
    num_params = int(sum(x.size for x in jax.tree.leaves(abstract)))
    if lora is None:
        if base_params is not None or frozen_dtype is not None:
            raise ValueError("base_params and frozen_dtype belong to LoRA jobs; pass lora=")
        part = _full_part(model, policy, graphdef, abstract)
    else:
        part = _lora_part(model, policy, graphdef, abstract, key_params, lora, base_params,
                          frozen_dtype)
    mult = jnp.float32(loss_multiplier)

    def loss_fn(p, batch, rng):
        loss, aux = part.loss(p, batch, rng)
        return loss * mult, {"lm_loss": loss, **aux}

    def evaluator(eval_fn, evals):
        def evaluate(p) -> float:
            if not evals:
                raise ValueError("this job was built with num_eval_batches=0: nothing to "
                                 "evaluate")
            return float(np.mean([float(eval_fn(p, b)) for b in evals]))

        return evaluate

    trainable = int(sum(x.size for x in jax.tree.leaves(part.abstract_trainable)))
    extras = {"trainable_params": trainable, "lora": lora}
    if mesh is None:
        frozen = part.make_frozen(None)
        with_frozen = part.with_frozen(frozen)
        step = jax.jit(
            make_train_step(loss_fn, optimizer, policy, has_aux=True,
                            allow_unscaled_fp16=allow_unscaled_fp16),
            donate_argnums=0,
        )
        state = init_train_state(part.init(key_params), optimizer, key_run)

        def batch(step_no: int) -> dict:
            return with_frozen(batch_at(train_tokens, seed=seed, step=step_no,
                                        batch_size=batch_size, seq_len=model.seq_len))

        evals = [with_frozen(b) for b in eval_batches(
            val_tokens, batch_size=batch_size, seq_len=model.seq_len,
            num_batches=num_eval_batches)] if num_eval_batches else []
        abstract_state = with_shardings(state, jax.tree.map(lambda x: x.sharding, state))
        abstract_batch = with_frozen({
            k: jax.ShapeDtypeStruct((batch_size, model.seq_len), jnp.int32)
            for k in ("inputs", "targets")})

        def compile_step(census: bool = True) -> CompiledStep:
            del census  # one device communicates nothing
            compiled = step.lower(abstract_state, abstract_batch).compile()
            grads = jax.tree.map(lambda x: x.sharding, abstract_state.params)
            report = memory_report(compiled, abstract_state, grad_shardings=grads)
            return CompiledStep(compiled, report, Census(ops=()))

        return LMJob(state, step, batch, evaluator(jax.jit(part.eval_loss), evals),
                     batch_size * model.seq_len, num_params, compile=compile_step,
                     frozen=frozen, **extras)

    return _sharded_job(
        model, policy, optimizer, part=part, loss_fn=loss_fn, evaluator=evaluator,
        keys=(key_params, key_run), train_tokens=train_tokens, val_tokens=val_tokens,
        batch_size=batch_size, seed=seed, num_eval_batches=num_eval_batches,
        allow_unscaled_fp16=allow_unscaled_fp16, mesh=mesh, strategy=strategy, rules=rules,
        num_params=num_params, extras=extras)


class _Part(NamedTuple):
    """What differs between full and LoRA training: what trains, and what rides in the batch.

    ``init(key_params)`` makes the trainable tree; ``loss``/``eval_loss`` read the frozen base
    (if any) from ``batch["base"]``; ``make_frozen(shardings)`` builds the frozen base (None
    for full training) and ``with_frozen(frozen)`` returns the function that adds it to a batch.
    ``frozen_shardings(mesh, strategy, rules)`` lays the base out; ``rules`` lays the trainable
    tree out given those shardings.
    """

    abstract_trainable: Any
    init: Callable[[jax.Array], Any]
    loss: Callable
    eval_loss: Callable
    make_frozen: Callable[[Any], Any]
    with_frozen: Callable[[Any], Callable[[Any], Any]]
    frozen_shardings: Callable[..., Any]
    rules: Callable[[Any, Any], Any]


def _full_part(model: GPTConfig, policy: Policy, graphdef, abstract) -> _Part:
    apply = make_apply(graphdef)

    def eval_loss(p, b):
        return cross_entropy(apply(policy.cast_to_compute(p), b["inputs"]), b["targets"])

    return _Part(
        abstract_trainable=abstract,
        init=lambda key: init_params(model, policy, key),
        loss=make_loss_fn(graphdef),
        eval_loss=eval_loss,
        make_frozen=lambda shardings: None,
        with_frozen=lambda frozen: lambda b: b,
        frozen_shardings=lambda mesh, strategy, rules: None,
        rules=lambda frozen_shardings, user_rules: user_rules,
    )


def _lora_part(model: GPTConfig, policy: Policy, graphdef, abstract, key_params,
               spec: lora_lib.LoraSpec, base_params, frozen_dtype) -> _Part:
    if not isinstance(spec, lora_lib.LoraSpec):
        raise TypeError(f"lora: expected a LoraSpec, got {type(spec).__name__}")
    dtype = policy.compute_dtype if frozen_dtype is None else parse_dtype(frozen_dtype)
    abstract_adapters = _abstract_adapters(abstract, spec, key_params)
    if base_params is not None:
        _check_base(base_params, abstract)
    abstract_base = cast_floating(abstract, dtype)
    apply = make_apply(graphdef, lora=spec)

    def make_frozen(shardings):
        """The base in ``dtype``, laid out by ``shardings`` (None: where jax puts it)."""
        if base_params is None:
            def fresh(key):
                return cast_floating(init_params(model, policy, key), dtype)
            return jax.jit(fresh, out_shardings=shardings)(key_params)
        cast = jax.jit(lambda p: cast_floating(p, dtype), out_shardings=shardings)
        return cast(base_params)

    def with_frozen(frozen):
        return lambda b: {**b, "base": frozen}

    def eval_loss(p, b):
        params = {"base": b["base"], "adapters": policy.cast_to_compute(p)}
        return cross_entropy(apply(params, b["inputs"]), b["targets"])

    def frozen_shardings(mesh, strategy, rules):
        return param_shardings(abstract_base, mesh, strategy, rules=rules)

    def rules(base_shardings, user_rules):
        # The adapters' own rules come first: a user rule written for the base kernels
        # (e.g. '.*/kernel') also matches the adapters' paths ('.../kernel/a').
        return lora_lib.adapter_rules(base_shardings, abstract_adapters) + list(user_rules or [])

    return _Part(
        abstract_trainable=abstract_adapters,
        init=lambda key: lora_lib.init(_adapter_key(key), abstract, spec),
        loss=lora_lib.freeze_base(make_loss_fn(graphdef, lora=spec)),
        eval_loss=eval_loss,
        make_frozen=make_frozen,
        with_frozen=with_frozen,
        frozen_shardings=frozen_shardings,
        rules=rules,
    )


def _sharded_job(model, policy, optimizer, *, part, loss_fn, evaluator, keys, train_tokens,
                 val_tokens, batch_size, seed, num_eval_batches, allow_unscaled_fp16, mesh,
                 strategy, rules, num_params, extras) -> LMJob:
    strategy = get_strategy(strategy)
    check_batch(batch_size, mesh)
    index, count = jax.process_index(), jax.process_count()
    if batch_size % count:
        raise ConfigError("batch_size", batch_size, f"must be divisible by the {count} "
                          "processes (each builds its own rows of the global batch)")
    key_params, key_run = keys
    frozen_sh = part.frozen_shardings(mesh, strategy, rules)
    frozen = part.make_frozen(frozen_sh)
    with_frozen = part.with_frozen(frozen)

    def init(key_params, key_run):
        return init_train_state(part.init(key_params), optimizer, key_run)

    batch_sh = batch_sharding(mesh)
    step_batch_sh = part.with_frozen(frozen_sh)({"inputs": batch_sh, "targets": batch_sh})
    run = make_sharded_training(
        init, key_params, key_run, loss_fn=loss_fn, optimizer=optimizer, policy=policy,
        mesh=mesh, strategy=strategy, rules=part.rules(frozen_sh, rules), has_aux=True,
        allow_unscaled_fp16=allow_unscaled_fp16, batch_sharding=step_batch_sh)
    # FSDP gathers the weights in the compute dtype for evaluation too.
    constrain_params = constraints(mesh, strategy, run.specs)[0] or (lambda p: p)

    def batch(step_no: int) -> dict:
        local = batch_at(train_tokens, seed=seed, step=step_no, batch_size=batch_size,
                         seq_len=model.seq_len, process_index=index, process_count=count)
        return with_frozen(global_batch(local, batch_sh))

    def sharded_eval_loss(p, b):
        return part.eval_loss(constrain_params(policy.cast_to_compute(p)), b)

    eval_fn = ShardedStep(jax.jit(sharded_eval_loss, in_shardings=(run.shardings.params,
                                                                   step_batch_sh),
                                  out_shardings=replicated(mesh)), mesh)
    evals = [with_frozen(global_batch(b, batch_sh)) for b in eval_batches(
        val_tokens, batch_size=batch_size, seq_len=model.seq_len, num_batches=num_eval_batches,
        process_index=index, process_count=count)] if num_eval_batches else []
    abstract_state = with_shardings(run.state, run.shardings)
    abstract_batch = with_frozen({
        k: jax.ShapeDtypeStruct((batch_size, model.seq_len), jnp.int32, sharding=batch_sh)
        for k in ("inputs", "targets")})

    def compile_step(census: bool = True) -> CompiledStep:
        if census:  # one compilation gives the executable and the partitioned module
            compiled, found = compile_with_census(run.step, abstract_state, abstract_batch)
        else:
            compiled, found = run.step.lower(abstract_state, abstract_batch).compile(), None
        report = memory_report(compiled, abstract_state, grad_shardings=run.grad_shardings)
        return CompiledStep(compiled, report, found if found is not None else Census(ops=()))

    return LMJob(run.state, run.step, batch, evaluator(eval_fn, evals),
                 batch_size * model.seq_len, num_params, shardings=run.shardings, mesh=mesh,
                 strategy=strategy.name, compile=compile_step, frozen=frozen, **extras)
