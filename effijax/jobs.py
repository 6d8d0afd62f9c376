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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from effijax.data import batch_at, eval_batches
from effijax.distributed import global_batch
from effijax.errors import ConfigError
from effijax.models import GPTConfig, abstract_split, init_params, make_apply, make_loss_fn
from effijax.precision import Policy, cross_entropy, get_policy
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


def abstract_lm_state(model: GPTConfig, policy: Policy | str,
                      optimizer: optax.GradientTransformation, *, seed: int = 0) -> TrainState:
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
    _, key_run = jax.random.split(jax.random.key(seed))
    _, abstract = abstract_split(model, policy)
    return jax.eval_shape(lambda p, k: init_train_state(p, optimizer, k), abstract, key_run)


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

    Returns:
      An :class:`LMJob` whose ``step`` is jitted with the state donated.

    Raises:
      ConfigError: with a mesh, an unknown strategy, bad rules, or a ``batch_size`` that does
        not split over data*fsdp or over the processes; before anything is compiled.

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
    lm_loss = make_loss_fn(graphdef)
    apply = make_apply(graphdef)
    mult = jnp.float32(loss_multiplier)
    num_params = int(sum(x.size for x in jax.tree.leaves(abstract)))

    def loss_fn(p, batch, rng):
        loss, aux = lm_loss(p, batch, rng)
        return loss * mult, {"lm_loss": loss, **aux}

    def eval_loss(p, b):
        logits = apply(policy.cast_to_compute(p), b["inputs"])
        return cross_entropy(logits, b["targets"])

    def evaluator(eval_fn, evals):
        def evaluate(p) -> float:
            if not evals:
                raise ValueError("this job was built with num_eval_batches=0: nothing to "
                                 "evaluate")
            return float(np.mean([float(eval_fn(p, b)) for b in evals]))

        return evaluate

    if mesh is None:
        params = init_params(model, policy, key_params)
        step = jax.jit(
            make_train_step(loss_fn, optimizer, policy, has_aux=True,
                            allow_unscaled_fp16=allow_unscaled_fp16),
            donate_argnums=0,
        )
        state = init_train_state(params, optimizer, key_run)

        def batch(step_no: int) -> dict:
            return batch_at(train_tokens, seed=seed, step=step_no, batch_size=batch_size,
                            seq_len=model.seq_len)

        evals = eval_batches(val_tokens, batch_size=batch_size, seq_len=model.seq_len,
                             num_batches=num_eval_batches) if num_eval_batches else []
        abstract_state = with_shardings(state, jax.tree.map(lambda x: x.sharding, state))
        abstract_batch = {k: jax.ShapeDtypeStruct((batch_size, model.seq_len), jnp.int32)
                          for k in ("inputs", "targets")}

        def compile_step(census: bool = True) -> CompiledStep:
            del census  # one device communicates nothing
            compiled = step.lower(abstract_state, abstract_batch).compile()
            grads = jax.tree.map(lambda x: x.sharding, abstract_state.params)
            report = memory_report(compiled, abstract_state, grad_shardings=grads)
            return CompiledStep(compiled, report, Census(ops=()))

        return LMJob(state, step, batch, evaluator(jax.jit(eval_loss), evals),
                     batch_size * model.seq_len, num_params, compile=compile_step)

    return _sharded_job(
        model, policy, optimizer, loss_fn=loss_fn, eval_loss=eval_loss, evaluator=evaluator,
        keys=(key_params, key_run), train_tokens=train_tokens, val_tokens=val_tokens,
        batch_size=batch_size, seed=seed, num_eval_batches=num_eval_batches,
        allow_unscaled_fp16=allow_unscaled_fp16, mesh=mesh, strategy=strategy, rules=rules,
        num_params=num_params)


def _sharded_job(model, policy, optimizer, *, loss_fn, eval_loss, evaluator, keys, train_tokens,
                 val_tokens, batch_size, seed, num_eval_batches, allow_unscaled_fp16, mesh,
                 strategy, rules, num_params) -> LMJob:
    strategy = get_strategy(strategy)
    check_batch(batch_size, mesh)
    index, count = jax.process_index(), jax.process_count()
    if batch_size % count:
        raise ConfigError("batch_size", batch_size, f"must be divisible by the {count} "
                          "processes (each builds its own rows of the global batch)")
    key_params, key_run = keys

    def init(key_params, key_run):
        return init_train_state(init_params(model, policy, key_params), optimizer, key_run)

    run = make_sharded_training(
        init, key_params, key_run, loss_fn=loss_fn, optimizer=optimizer, policy=policy,
        mesh=mesh, strategy=strategy, rules=rules, has_aux=True,
        allow_unscaled_fp16=allow_unscaled_fp16)
    batch_sh = batch_sharding(mesh)
    # FSDP gathers the weights in the compute dtype for evaluation too.
    constrain_params = constraints(mesh, strategy, run.specs)[0] or (lambda p: p)

    def batch(step_no: int) -> dict:
        local = batch_at(train_tokens, seed=seed, step=step_no, batch_size=batch_size,
                         seq_len=model.seq_len, process_index=index, process_count=count)
        return global_batch(local, batch_sh)

    def sharded_eval_loss(p, b):
        return eval_loss(constrain_params(policy.cast_to_compute(p)), b)

    eval_fn = ShardedStep(jax.jit(sharded_eval_loss, in_shardings=(run.shardings.params,
                                                                   batch_sh),
                                  out_shardings=replicated(mesh)), mesh)
    evals = [global_batch(b, batch_sh) for b in eval_batches(
        val_tokens, batch_size=batch_size, seq_len=model.seq_len, num_batches=num_eval_batches,
        process_index=index, process_count=count)] if num_eval_batches else []
    abstract_state = with_shardings(run.state, run.shardings)
    abstract_batch = {k: jax.ShapeDtypeStruct((batch_size, model.seq_len), jnp.int32,
                                              sharding=batch_sh) for k in ("inputs", "targets")}

    def compile_step(census: bool = True) -> CompiledStep:
        if census:  # one compilation gives the executable and the partitioned module
            compiled, found = compile_with_census(run.step, abstract_state, abstract_batch)
        else:
            compiled, found = run.step.lower(abstract_state, abstract_batch).compile(), None
        report = memory_report(compiled, abstract_state, grad_shardings=run.grad_shardings)
        return CompiledStep(compiled, report, found if found is not None else Census(ops=()))

    return LMJob(run.state, run.step, batch, evaluator(eval_fn, evals),
                 batch_size * model.seq_len, num_params, shardings=run.shardings, mesh=mesh,
                 strategy=strategy.name, compile=compile_step)
