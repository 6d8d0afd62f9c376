"""A training job for any :class:`~effijax.models.LanguageModel`: one code path, any mesh.

:func:`plan_job` decides everything abstractly (nothing is allocated or compiled): the train
state's shapes, dtypes and shardings, the frozen base's (LoRA), the jitted step and the
evaluation function. A single device is a 1-device mesh, so one device and many run the same
program. Full training differentiates every parameter; LoRA differentiates the adapters, and the
frozen base rides in every batch as ``batch["base"]`` (an input of the compiled step, laid out as
the strategy lays out parameters; each adapter is laid out like its kernel). An objective with a
reference (DPO) in full training holds a frozen copy of the starting weights likewise, as
``batch["reference"]``.

The pieces that allocate take the job: :func:`init_state` (born sharded, fresh or from given
parameters), :func:`init_frozen` (the LoRA base or the reference copy), :func:`batch_fn` and
:func:`evaluate`, and :func:`compile_job` (one compilation: the executable, per-device memory
and collectives). :func:`build_lm_job` does all of it in one call (an :class:`LMJob`) for code
that drives :func:`effijax.run.train_loop` itself.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from effijax import lora as lora_lib
from effijax.distributed import global_batch, process_rows
from effijax.errors import INT32_MAX, ConfigError, whole_number
from effijax.models import LanguageModel
from effijax.paths import map_with_path, named_leaves
from effijax.precision import (
    QUANTIZED_FORMATS,
    Policy,
    cast_floating,
    dequantized_shapes,
    get_policy,
    is_quantized,
    parse_dtype,
    quantize,
    quantize_kernels,
    quantized_sharding,
)
from effijax.recipe._objective import ROLLOUT_METRICS, SFT, Objective
from effijax.sharding import (
    Census,
    MemoryReport,
    ReplicatedParameterWarning,
    ShardedStep,
    Strategy,
    batch_sharding,
    check_batch,
    check_context,
    compile_with_census,
    constraints,
    get_strategy,
    grad_shardings,
    make_mesh,
    memory_report,
    param_shardings,
    partition_specs,
    replicated,
    splits_sequence,
    state_shardings,
    tensor_split,
    with_shardings,
)
from effijax.step import TrainState, init_train_state, make_sharded_step

__all__ = ["Job", "CompiledStep", "plan_job", "abstract_state", "abstract_batch", "init_state",
           "init_frozen", "frozen_key", "batch_fn", "evaluate", "evaluate_metrics", "compile_job",
           "adapter_key", "LMJob", "build_lm_job"]


class CompiledStep(NamedTuple):
    """The job's step compiled once, with what it holds and communicates per device.

    Attributes:
      step: the executable ``step(state, batch) -> (state, metrics)``, donating the state.
      memory: per-device bytes (state leaves and gradients from the shardings; arguments,
        outputs and temporaries from ``compiled.memory_analysis()``).
      census: the collectives after XLA's SPMD partitioner (empty on one device).
    """

    step: Callable[[TrainState, Any], tuple[TrainState, dict]]
    memory: MemoryReport
    census: Census


class Job(NamedTuple):
    """An abstract training job (see :func:`plan_job`): shapes, shardings and functions.

    Attributes:
      model, policy, optimizer, lora: what was planned (``lora`` None: full training).
      mesh, strategy: where it runs (a 1-device mesh and ``ddp`` on one device).
      batch_size: the global batch (sequences per step); ``seq_len`` is the model's.
      state: the initial train state as ``ShapeDtypeStruct`` s carrying their shardings.
      frozen: with LoRA, the frozen base likewise; in full training with an objective that
        has a reference (DPO), the reference copy of the starting weights; else None.
      specs: the trainable parameters' sharded specs; ``grads``: the gradients' shardings.
      step: the jitted, donating step (a :class:`~effijax.sharding.ShardedStep`).
      eval_step: jitted ``eval_step(params, batch) -> (loss, metrics)``: the f32 loss without
        dropout, and the objective's ``eval_metrics`` of the batch.
      num_params: parameters of the model; ``trainable_params``: those that get gradients.
      seed: the seed of the parameters, adapters, dropout keys and batch order.
      masked: batches carry a loss mask (``batch["mask"]``, int32 ``[B, S]``, sharded like
        the inputs): chat data trained on the assistant's tokens.
      segmented: batches carry the packed examples' ids (``batch["segments"]``, int32
        ``[B, S]``, sharded like the inputs): attention stays within an example and positions
        restart at each one.
      sequence_parallel: the step splits the activations between the blocks along the
        sequence over the mesh's ``tensor`` axis (False without a ``tensor`` axis above 1).
      objective: what the step optimises (an :class:`~effijax.recipe._objective.Objective`;
        None: next-token cross-entropy, ``SFT``): its loss, batches and evaluation.
      rollout: an objective that samples its batches (GRPO): its ``draw`` bound to the model
        and settings (:attr:`Objective.rollout`); :func:`batch_fn` then reads the parameters.
    """

    model: LanguageModel
    policy: Policy
    optimizer: optax.GradientTransformation
    lora: lora_lib.LoraSpec | None
    mesh: Any
    strategy: Strategy
    batch_size: int
    state: TrainState
    frozen: Any
    specs: Any
    grads: Any
    step: ShardedStep
    eval_step: Callable
    num_params: int
    trainable_params: int
    seed: int
    masked: bool = False
    segmented: bool = False
    sequence_parallel: bool = False
    objective: Objective | None = None
    rollout: Callable | None = None

    @property
    def shardings(self):
        """The ``NamedSharding`` of every state leaf."""
        return jax.tree.map(lambda x: x.sharding, self.state)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.model.seq_len


def _keys(seed: int) -> tuple[jax.Array, jax.Array]:
    """``(key_params, key_run)``: the parameters' key and the run's (dropout) key."""
    return tuple(jax.random.split(jax.random.key(seed)))


def adapter_key(seed: int) -> jax.Array:
    """The adapters' init key: the base keeps the parameters' key, so a LoRA job on a fresh
    base starts from the same base as a full job with the same seed."""
    return jax.random.fold_in(_keys(seed)[0], 1)


def _size(tree) -> int:
    return int(sum(x.size for x in jax.tree.leaves(tree)))


def _one_device_mesh():
    return make_mesh(devices=jax.local_devices()[:1])


def abstract_state(model: LanguageModel, policy: Policy | str,
                   optimizer: optax.GradientTransformation, *, seed: int = 0,
                   lora: lora_lib.LoraSpec | None = None) -> TrainState:
    """The shapes and dtypes of a job's initial state, without shardings or a mesh.

    What a pre-flight check such as :func:`effijax.checkpoint.validate_resume` compares a
    checkpoint against (``jax.eval_shape`` only).

    Example:
      >>> import optax
      >>> from effijax.models import gpt_config
      >>> s = abstract_state(gpt_config("tiny", seq_len=16), "fp32", optax.adam(1e-3))
      >>> s.step.shape, s.step.dtype
      ((), dtype('int32'))
    """
    return _abstract_state(model.abstract_params(get_policy(policy)), optimizer, seed, lora)


def _abstract_state(abstract_params, optimizer, seed: int, lora) -> TrainState:
    """The state's shapes from the model's abstract parameters: their adapters' with LoRA."""
    trainable = abstract_params
    if lora is not None:
        if not isinstance(lora, lora_lib.LoraSpec):
            raise ConfigError("lora", type(lora).__name__, "expected an effijax.lora.LoraSpec")
        lora_lib.select(abstract_params, lora)  # its errors, before anything is traced
        trainable = jax.eval_shape(lambda k: lora_lib.init(k, abstract_params, lora),
                                   adapter_key(seed))
    return jax.eval_shape(lambda p, k: init_train_state(p, optimizer, k), trainable,
                          _keys(seed)[1])


def plan_job(
    model: LanguageModel,
    policy: Policy | str,
    optimizer: optax.GradientTransformation,
    *,
    batch_size: int,
    mesh=None,
    strategy: str | Strategy = "ddp",
    rules: Sequence[tuple] | None = None,
    lora: lora_lib.LoraSpec | None = None,
    frozen_dtype: Any = None,
    seed: int = 0,
    loss_multiplier: float = 1.0,
    allow_unscaled_fp16: bool = False,
    masked: bool = False,
    segmented: bool | None = None,
    sequence_parallel: bool = True,
    kept_blocks: Any = None,
    objective: Objective | None = None,
    objective_settings: dict | None = None,
) -> Job:
    """Plans a training job without allocating or compiling anything.

    Args:
      model: any :class:`~effijax.models.LanguageModel` (its ``seq_len`` is the window).
      policy: precision policy or preset name.
      optimizer: any optax transformation (see :func:`effijax.step.make_optimizer`).
      batch_size: global batch (sequences per step).
      mesh: a mesh from :func:`effijax.sharding.make_mesh` (every process' devices in a
        multi-process run); None: this process' first device.
      strategy: ``ddp``, ``zero1``, ``zero2`` or ``fsdp`` (``zero3``).
      rules: partition rules (default: the model's, else automatic).
      lora: train LoRA adapters of a frozen base instead of every parameter.
      frozen_dtype: in full training with an objective that has a reference, its copy's
        floating dtype (default: the compute dtype); with ``lora``, the base's storage dtype
        (default: the compute dtype), or a
        quantized format, ``"nf4"`` or ``"int8"`` (QLoRA: the layer stack's kernels stored
        quantized with double-quantized blockwise scales, dequantized per layer in the step;
        the other leaves in the compute dtype; see :func:`effijax.precision.quantize`), or
        ``"gguf"``: the kernels a GGUF file holds in blocks kept as they are (``kept_blocks``).
      seed: seeds the parameters, the adapters, the dropout keys and the batch order.
      loss_multiplier: multiplies the training objective (the metric ``lm_loss`` keeps the
        unmultiplied loss); values far below 1 push gradients below fp16's range.
      allow_unscaled_fp16: see :func:`effijax.step.make_train_step`.
      masked: batches carry ``"mask"`` (int32 ``[B, S]``, nonzero = trained), which the loss
        honours; the step's ``tokens`` metric counts the trained positions either way.
      segmented: batches carry ``"segments"`` (int32 ``[B, S]``, the ids of the examples packed
        into each row; :func:`~effijax.data.pack_examples`), which the model honours. None:
        the same as ``masked`` (packed chat rows carry both).
      sequence_parallel: on a mesh with ``tensor > 1``, split the activations between the
        blocks along the sequence (Korthikanti et al.; on by default, as Megatron-LM
        recommends: the same bytes communicated, ``1/tensor`` of the norm, dropout and residual
        activations); the tensor degree must then divide the model's ``seq_len``. Ignored
        without a ``tensor`` axis.
      kept_blocks: with ``frozen_dtype="gguf"``, the base as
        :func:`~effijax.interop.load_gguf` loads it with ``keep_blocks=True`` (or its
        abstract shapes): its :class:`~effijax.precision.GGMLBlocks` kernels are the frozen
        base's, decoded per layer in the step.
      objective: the training objective (default: next-token cross-entropy,
        :data:`~effijax.recipe._objective.SFT`); ``objective_settings``: its loss's keyword
        arguments (DPO's ``beta``, ``loss_type``, ``label_smoothing``; SimPO's ``beta``,
        ``gamma``, ``cpo_alpha``, ``label_smoothing``; ORPO's ``beta``), checked when the loss
        is built.

    Raises:
      ConfigError: a bad strategy, mesh or rules; a batch that does not split over the data
        axes or the processes; LoRA targets matching nothing or a rank above a dimension.

    Example:
      >>> import optax
      >>> from effijax.models import gpt_config
      >>> job = plan_job(gpt_config("tiny", seq_len=16), "fp32", optax.adam(1e-3), batch_size=2)
      >>> job.num_params, job.state.step.shape
      (117504, ())
    """
    policy = get_policy(policy)
    strategy = get_strategy(strategy)
    whole_number("batch_size", batch_size)
    if batch_size * model.seq_len > INT32_MAX:  # the step counts its tokens in int32
        raise ConfigError("batch_size", batch_size, f"{batch_size:,} sequences of "
                          f"{model.seq_len:,} tokens is {batch_size * model.seq_len:,} tokens a "
                          f"step, over the {INT32_MAX:,} a step counts; use at most "
                          f"{INT32_MAX // model.seq_len:,}")
    if not loss_multiplier > 0:
        raise ConfigError("loss_multiplier", loss_multiplier, "must be > 0")
    mesh = _one_device_mesh() if mesh is None else mesh
    check_batch(batch_size, mesh)
    if batch_size % jax.process_count():
        raise ConfigError("batch_size", batch_size, f"must be divisible by the "
                          f"{jax.process_count()} processes (each builds its own rows)")
    rules = model.partition_rules() if rules is None else rules
    layout = model.tensor_layout()  # Megatron's split over the mesh's tensor axis
    if layout is not None:
        tensor_split(layout, mesh.shape.get("tensor", 1))  # refused before anything is traced
    sequence_parallel = _check_sequence_parallel(model, mesh, sequence_parallel)
    check_context(mesh.shape, model.seq_len, dropout=getattr(model, "dropout", 0.0))
    objective = SFT if objective is None else objective
    settings = dict(objective_settings or {})
    objective = objective.configured(settings)  # e.g. dpo with its reference precomputed
    reference = objective.needs_reference(settings)
    if lora is None and frozen_dtype is not None and not reference:
        raise ConfigError("frozen_dtype", frozen_dtype, "only applies to LoRA (the base) or to "
                          "an objective with a reference (its frozen copy); pass lora=")
    abstract = model.abstract_params(policy)
    abstract_state = _abstract_state(abstract, optimizer, seed, lora)
    trainable = abstract_state.params
    frozen = frozen_sh = None
    if lora is None and reference:
        frozen_sh = param_shardings(abstract, mesh, strategy, rules=rules, tensor_layout=layout)
        frozen = with_shardings(cast_floating(abstract, _reference_dtype(policy, frozen_dtype)),
                                frozen_sh)
    if lora is not None:
        quantized = frozen_dtype in (*QUANTIZED_FORMATS, "gguf")
        dtype = (policy.compute_dtype if frozen_dtype is None or quantized
                 else parse_dtype(frozen_dtype))
        base = cast_floating(abstract, dtype)
        frozen_sh = kernel_sh = param_shardings(base, mesh, strategy, rules=rules,
                                               tensor_layout=layout)
        if quantized:
            base = (_with_kept_blocks(base, kept_blocks) if frozen_dtype == "gguf" else
                    jax.eval_shape(lambda b: quantize_kernels(b, frozen_dtype), base))
            frozen_sh = jax.tree.map(
                lambda q, sh: quantized_sharding(sh, q) if is_quantized(q) else sh,
                base, frozen_sh, is_leaf=is_quantized)
        frozen = with_shardings(base, frozen_sh)
        # The adapters' own rules first: a rule for the base kernels ('.*/kernel') also matches
        # the adapters' paths ('.../kernel/a').
        rules = lora_lib.adapter_rules(kernel_sh, trainable) + list(rules or [])
    loss = objective.loss(model, lora, sequence_parallel=sequence_parallel, **settings)
    draw = (None if objective.rollout is None
            else objective.rollout(model, lora, policy=policy, **settings))
    specs = partition_specs(abstract_state.params, mesh, rules=rules,
                            tensor_layout=layout)  # warns once per leaf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedParameterWarning)  # warned just above
        shardings = state_shardings(abstract_state, mesh, strategy, rules=rules,
                                    tensor_layout=layout)
    mult = jnp.float32(loss_multiplier)

    def train_loss(p, batch, rng):
        value, aux = loss(p, batch, rng)
        named = {} if objective.metric is None else {objective.metric: value}
        return value * mult, {**named, "tokens": _trained_tokens(batch), **aux}

    segmented = bool(masked) if segmented is None else bool(segmented)
    batch_sh = _batch_shardings(mesh, frozen_sh, masked, segmented,
                                frozen_key=frozen_key(lora),
                                row_values=objective.row_values + objective.token_values)
    step = make_sharded_step(train_loss, optimizer, policy, mesh=mesh, strategy=strategy,
                             specs=specs, shardings=shardings, has_aux=True,
                             allow_unscaled_fp16=allow_unscaled_fp16, batch_sharding=batch_sh)
    # FSDP gathers the weights in the compute dtype for evaluation too.
    gather = constraints(mesh, strategy, specs)[0] or (lambda p: p)

    def eval_step(p, batch):
        value, aux = loss(gather(policy.cast_to_compute(p)), batch, None)
        return value, {name: aux[name] for name in objective.eval_metrics}

    eval_jit = ShardedStep(jax.jit(eval_step, in_shardings=(shardings.params, batch_sh),
                                   out_shardings=replicated(mesh)), mesh)
    return Job(model=model, policy=policy, optimizer=optimizer, lora=lora, mesh=mesh,
               strategy=strategy, batch_size=batch_size,
               state=with_shardings(abstract_state, shardings), frozen=frozen, specs=specs,
               grads=grad_shardings(specs, mesh, strategy), step=step, eval_step=eval_jit,
               num_params=_size(abstract), trainable_params=_size(trainable), seed=seed,
               masked=bool(masked), segmented=segmented, sequence_parallel=sequence_parallel,
               objective=objective, rollout=draw)


def _check_sequence_parallel(model, mesh, sequence_parallel) -> bool:
    """Whether the job runs sequence-parallel; refuses a ``seq_len`` the tensor degree does not
    divide (each device would hold a ragged slice of every row)."""
    if not isinstance(sequence_parallel, bool):
        raise ConfigError("sequence_parallel", sequence_parallel, "expected True or False")
    tensor = mesh.shape.get("tensor", 1)
    if not sequence_parallel or tensor == 1:
        return False
    if not splits_sequence(mesh.shape, model.seq_len):
        lower, higher = model.seq_len // tensor * tensor, (model.seq_len // tensor + 1) * tensor
        raise ConfigError("seq_len", model.seq_len, f"sequence parallelism splits each row over "
                          f"the mesh's tensor={tensor}, which does not divide it; use a multiple "
                          f"of {tensor} (e.g. {lower or higher} or {higher})")
    return True


def _trained_tokens(batch) -> jax.Array:
    """The target positions the loss counts (int32): the mask's nonzeros, else all."""
    mask = batch.get("mask")
    if mask is None:
        return jnp.int32(batch["targets"].size)
    return jnp.sum(mask != 0, dtype=jnp.int32)


def _batch_keys(masked: bool, segmented: bool) -> tuple[str, ...]:
    """The arrays of a job's batches (all int32 ``[B, S]``, sharded by rows)."""
    return ("inputs", "targets", *(("mask",) if masked else ()),
            *(("segments",) if segmented else ()))


def _check_batch_keys(job: Job, local: dict) -> None:
    """A batch has the arrays the job was compiled for (before anything is traced)."""
    objective = job.objective or SFT
    want = set(_batch_keys(job.masked, job.segmented)) | set(objective.row_values) | set(
        objective.token_values)
    if set(local) != want:
        got = "packed rows" if "mask" in local else "a corpus"
        raise ConfigError("tokens", got, f"batches with {sorted(local)}, but the job was planned "
                          f"with masked={job.masked}, segmented={job.segmented} "
                          f"(batches with {sorted(want)})")


def _batch_shardings(mesh, frozen_shardings, masked: bool = False,
                     segmented: bool = False, frozen_key: str = "base",
                     row_values: tuple[str, ...] = ()) -> dict:
    rows = batch_sharding(mesh)
    out = dict.fromkeys((*_batch_keys(masked, segmented), *row_values), rows)
    return out if frozen_shardings is None else {**out, frozen_key: frozen_shardings}


def frozen_key(lora) -> str:
    """Where a job's frozen tree rides in its batches: ``"base"`` (LoRA's base, ``lora`` a
    :class:`~effijax.lora.LoraSpec`) or ``"reference"`` (a full fine-tune's reference copy).

    Example:
      >>> frozen_key(None)
      'reference'
    """
    return "base" if lora is not None else "reference"


def _reference_dtype(policy: Policy, frozen_dtype: Any):
    """A full fine-tune's reference copy's dtype: ``frozen_dtype`` (a floating dtype), or the
    compute dtype (the policy's own arithmetic at step 0)."""
    if frozen_dtype is None:
        return policy.compute_dtype
    if frozen_dtype in (*QUANTIZED_FORMATS, "gguf"):
        raise ConfigError("frozen_dtype", frozen_dtype, "a full fine-tune's reference copy is "
                          "kept in a floating dtype (fp32, bf16, fp16); quantized storage is "
                          "for LoRA's base (--lora-rank R)")
    return parse_dtype(frozen_dtype)


def _with_kept_blocks(base, kept_blocks):
    """``base`` (abstract) with the kernels ``kept_blocks`` holds as a GGUF file's blocks."""
    kept = {path: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), leaf)
            for path, leaf in named_leaves(kept_blocks, is_leaf=is_quantized)
            if is_quantized(leaf)} if kept_blocks is not None else {}
    if not kept:
        raise ConfigError("frozen_dtype", "gguf", "keeps a GGUF file's quantized blocks: load "
                          "the base with load_gguf(..., keep_blocks=True) and pass it as "
                          "kept_blocks (the file must hold its layers' kernels quantized)")
    _check_params(dequantized_shapes(kept_blocks), base, "kept_blocks")
    return map_with_path(lambda path, x: kept.get(path, x), base)


def _check_params(params, abstract, field: str) -> None:
    """Given parameters must have exactly the model's paths and shapes."""
    want = dict(named_leaves(abstract))
    got = dict(named_leaves(params))
    for path, leaf in want.items():
        if path not in got:
            raise ConfigError(field, path, "the model has this parameter but the given tree "
                              "does not: it comes from another model configuration")
        if tuple(got[path].shape) != tuple(leaf.shape):
            raise ConfigError(field, path, f"shape {tuple(got[path].shape)} but the model "
                              f"expects {tuple(leaf.shape)}: it comes from another model "
                              "configuration")
    extra = sorted(set(got) - set(want))
    if extra:
        raise ConfigError(field, extra[0], f"the given tree has {len(extra)} parameters the "
                          "model does not: it comes from another model configuration")


def init_state(job: Job, params: Any = None) -> TrainState:
    """The job's initial train state, born sharded.

    Args:
      job: from :func:`plan_job`.
      params: full training only: start from these parameters (any sharding; cast to the
        policy's parameter dtype) instead of a fresh initialisation from ``job.seed``.

    Example:
      >>> import optax
      >>> from effijax.models import gpt_config
      >>> job = plan_job(gpt_config("tiny", seq_len=16), "fp32", optax.adam(1e-3), batch_size=2)
      >>> int(init_state(job).step)
      0
    """
    key_params, key_run = _keys(job.seed)
    shardings = job.shardings
    if params is not None:
        if job.lora is not None:
            raise ConfigError("params", "given", "a LoRA job trains fresh adapters; pass the "
                              "base to init_frozen instead")
        _check_params(params, job.state.params, "params")
        dtypes = jax.tree.map(lambda x: x.dtype, job.state.params)

        def from_params(p, key):
            p = jax.tree.map(lambda x, d: x.astype(d), p, dtypes)
            return init_train_state(p, job.optimizer, key)

        return jax.jit(from_params, out_shardings=shardings)(params, key_run)
    if job.lora is None:
        def fresh(kp, kr):
            return init_train_state(job.model.init_params(kp, job.policy), job.optimizer, kr)
    else:
        abstract = job.model.abstract_params(job.policy)

        def fresh(kp, kr):
            del kp
            adapters = lora_lib.init(adapter_key(job.seed), abstract, job.lora)
            return init_train_state(adapters, job.optimizer, kr)

    return jax.jit(fresh, out_shardings=shardings)(key_params, key_run)


def init_frozen(job: Job, base: Any = None) -> Any:
    """A job's frozen tree in its dtype and layout: a LoRA job's base, or a full job's
    reference copy (an objective with a reference); None for other jobs.

    Args:
      job: from :func:`plan_job`.
      base: the base (or starting) parameters (any sharding: e.g. a pretrained model); None
        initialises them from ``job.seed`` exactly as a full job would.
    """
    if job.frozen is None:
        if base is not None:
            raise ConfigError("base", "given", "only LoRA jobs and full jobs whose objective "
                              "has a reference hold a frozen tree")
        return None
    shardings = jax.tree.map(lambda x: x.sharding, job.frozen)

    def cast(p):
        return jax.tree.map(_to_frozen, job.frozen, p, is_leaf=is_quantized)

    if base is None:
        return jax.jit(lambda key: cast(job.model.init_params(key, job.policy)),
                       out_shardings=shardings)(_keys(job.seed)[0])
    _check_params(dequantized_shapes(base), dequantized_shapes(job.frozen), "base")
    if not any(is_quantized(x) for x in jax.tree.leaves(job.frozen, is_leaf=is_quantized)):
        return jax.jit(cast, out_shardings=shardings)(base)
    # One leaf at a time: a quantized base never exists in full precision, not even while it
    # is being quantized (a loaded base's leaves are freed as the caller drops them).
    frozen_leaves, treedef = jax.tree.flatten(job.frozen, is_leaf=is_quantized)
    return treedef.unflatten([
        jax.jit(functools.partial(_to_frozen, _FrozenLeaf.of(want)), out_shardings=sh)(x)
        for want, x, sh in zip(frozen_leaves, treedef.flatten_up_to(base),
                               treedef.flatten_up_to(shardings), strict=True)])


class _FrozenLeaf(NamedTuple):
    """What one frozen leaf becomes, as a static (hashable) value: a dtype or a format."""

    dtype: Any
    format: str | None
    double_quant: bool

    @classmethod
    def of(cls, leaf) -> _FrozenLeaf:
        if is_quantized(leaf):
            return cls(None, leaf.format, leaf.format != "gguf"
                       and not hasattr(leaf.scales, "shape"))
        return cls(leaf.dtype, None, False)


def _to_frozen(want, x):
    """``x`` as the frozen leaf ``want`` (an abstract leaf or a :class:`_FrozenLeaf`) says."""
    want = want if isinstance(want, _FrozenLeaf) else _FrozenLeaf.of(want)
    if want.format is None:
        return x.astype(want.dtype)
    if want.format == "gguf":  # a GGUF file's blocks, kept as loaded
        if not is_quantized(x) or x.format != "gguf":
            raise ConfigError("base", "floating", "the job keeps a GGUF file's blocks "
                              "(frozen_dtype='gguf'): pass the base as load_gguf(..., "
                              "keep_blocks=True) loads it")
        return x
    return quantize(x, want.format, double_quant=want.double_quant)


def batch_fn(job: Job, tokens: np.ndarray, frozen: Any = None,
             params: Callable[[], Any] | None = None) -> Callable[[int], dict]:
    """``batch(step)``: the global training batch of that step, a pure function of
    ``(job.seed, step)``; each process builds only its own rows.

    A job whose objective samples its batches (``job.rollout``, GRPO) needs ``params``: a
    function that returns the train state's current parameters when step ``step``'s batch is
    built (before that step runs and donates them); the batch then also holds the rollout's
    host-side statistics under ``ROLLOUT_METRICS``, for the loop to log (not a step input).
    """
    rows = batch_sharding(job.mesh)
    index, count = process_rows(rows, job.batch_size)
    draw = (job.objective or SFT).batch
    if job.rollout is not None:
        if params is None:
            raise ConfigError("params", None, f"the {job.objective.name} objective samples each "
                              "batch from the current parameters: pass params=, a function "
                              "returning them")

        def draw(tokens, **kw):
            return job.rollout(tokens, params=params(), frozen=frozen, **kw)

    def batch(step_no: int) -> dict:
        local = draw(tokens, seed=job.seed, step=step_no, batch_size=job.batch_size,
                     **({} if job.rollout is not None else {"seq_len": job.model.seq_len}),
                     process_index=index, process_count=count)
        extra = {k: local.pop(k) for k in [k for k in local if k == ROLLOUT_METRICS]}
        _check_batch_keys(job, local)
        out = global_batch(local, rows, job.batch_size)
        return {**out, **({} if frozen is None else {frozen_key(job.lora): frozen}), **extra}

    return batch


def evaluate(job: Job, params: Any, tokens: np.ndarray, *, num_batches: int,
             frozen: Any = None) -> float:
    """Mean loss of ``params`` over ``num_batches`` fixed validation batches of ``tokens``
    (:func:`evaluate_metrics`' ``"loss"``).

    ``tokens`` is a 1-D corpus or :class:`~effijax.data.Packed` rows (for a job planned with
    ``masked=True``); with rows, the mean is over the trained tokens (each batch's masked mean
    weighted by its trained tokens).

    Example:
      >>> import numpy as np, optax
      >>> from effijax.models import gpt_config
      >>> job = plan_job(gpt_config("tiny", seq_len=16), "fp32", optax.adam(1e-3), batch_size=2)
      >>> toks = np.frombuffer(b"hello world " * 50, np.uint8)
      >>> evaluate(job, init_state(job).params, toks, num_batches=2) > 4.0
      True
    """
    return evaluate_metrics(job, params, tokens, num_batches=num_batches, frozen=frozen)["loss"]


def evaluate_metrics(job: Job, params: Any, tokens: np.ndarray, *, num_batches: int,
                     frozen: Any = None) -> dict[str, float]:
    """``{"loss": mean loss, **metrics}`` of ``params`` over ``num_batches`` fixed validation
    batches: the loss as :func:`evaluate` averages it, and each of the objective's
    ``eval_metrics`` (DPO's ``rewards/accuracies``, ...) as the mean of its batches' values
    (every batch holds as many pairs).

    Example:
      >>> import numpy as np, optax
      >>> from effijax.models import gpt_config
      >>> job = plan_job(gpt_config("tiny", seq_len=16), "fp32", optax.adam(1e-3), batch_size=2)
      >>> toks = np.frombuffer(b"hello world " * 50, np.uint8)
      >>> sorted(evaluate_metrics(job, init_state(job).params, toks, num_batches=2))
      ['loss']
    """
    whole_number("num_batches", num_batches)
    objective = job.objective or SFT
    eval_batches = objective.eval_batches
    rows = batch_sharding(job.mesh)
    kw = {"batch_size": job.batch_size, "seq_len": job.model.seq_len, "num_batches": num_batches}
    losses, metrics = [], []
    index, count = process_rows(rows, job.batch_size)
    for local in eval_batches(tokens, **kw, process_index=index, process_count=count):
        _check_batch_keys(job, local)
        b = global_batch(local, rows, job.batch_size)
        if frozen is not None:
            b = {**b, frozen_key(job.lora): frozen}
        value, aux = job.eval_step(params, b)
        losses.append(float(value))
        metrics.append({name: float(v) for name, v in aux.items()})
    means = {name: float(np.mean([m[name] for m in metrics])) for name in objective.eval_metrics}
    if not job.masked or not objective.token_mean:
        return {"loss": float(np.mean(losses)), **means}
    # Every process counts the global batches' trained tokens (host arrays, cheap).
    counts = [np.count_nonzero(b["mask"]) for b in eval_batches(tokens, **kw)]
    return {"loss": float(sum(loss * n for loss, n in zip(losses, counts, strict=True) if n)
                          / max(sum(counts), 1)), **means}


def abstract_batch(job: Job) -> dict:
    """The global batch the job's step takes, as ``jax.ShapeDtypeStruct`` s with shardings.

    What :func:`compile_job` compiles the step for, and what ``jax.export`` lowers it for: the
    int32 ``[batch_size, seq_len]`` arrays split by rows (``mask`` and ``segments`` when the job
    was planned with them) and the frozen tree (:func:`frozen_key`: LoRA's base, or a full
    fine-tune's reference copy).

    Example:
      >>> import optax
      >>> from effijax.models import gpt_config
      >>> job = plan_job(gpt_config("tiny", seq_len=16), "fp32", optax.adam(1e-3), batch_size=2)
      >>> {k: v.shape for k, v in abstract_batch(job).items()}
      {'inputs': (2, 16), 'targets': (2, 16)}
    """
    rows = batch_sharding(job.mesh)
    batch = {k: jax.ShapeDtypeStruct((job.batch_size, job.model.seq_len), jnp.int32,
                                     sharding=rows)
             for k in _batch_keys(job.masked, job.segmented)}
    for k in (job.objective or SFT).row_values:  # per-row values (GRPO's advantages)
        batch[k] = jax.ShapeDtypeStruct((job.batch_size,), jnp.float32, sharding=rows)
    for k in (job.objective or SFT).token_values:  # per-position values (GRPO's old_logps)
        batch[k] = jax.ShapeDtypeStruct((job.batch_size, job.model.seq_len), jnp.float32,
                                        sharding=rows)
    if job.frozen is not None:
        batch[frozen_key(job.lora)] = job.frozen
    return batch


def compile_job(job: Job, *, census: bool = True) -> CompiledStep:
    """Compiles the step from the job's abstract state (nothing is allocated): the
    executable, its per-device memory and, with ``census`` on several devices, the collectives
    XLA planned (read from the same compilation)."""
    batch = abstract_batch(job)
    if census and job.mesh.size > 1:
        compiled, found = compile_with_census(job.step, job.state, batch)
    else:
        compiled, found = job.step.lower(job.state, batch).compile(), Census(ops=())
    report = memory_report(compiled, job.state, grad_shardings=job.grads)
    return CompiledStep(compiled, report, found)


# A ready-to-run job in one call --------------------------------------------------------------
# For experiments and notebooks that drive effijax.run.train_loop themselves: the job planned,
# its state and frozen base created, the batches and the evaluation bound to token arrays.



class LMJob(NamedTuple):
    """A ready-to-run training job (see :func:`build_lm_job`).

    Attributes:
      state: the initial ``TrainState`` (donated by the first ``step``).
      step: ``step(state, batch) -> (state, metrics)``, jitted, donating the state.
      batch: ``batch(step_no)``: the global batch of that step.
      evaluate: ``evaluate(params) -> float``: mean loss over the fixed validation batches.
      tokens_per_step: tokens in one global batch.
      num_params: parameters of the model.
      shardings: the ``NamedSharding`` of every state leaf.
      mesh: the mesh (a 1-device mesh when none was given).
      strategy: the strategy's name (None when no mesh was given).
      compile: ``compile(census=True) -> CompiledStep``.
      trainable_params: parameters that get gradients (``num_params`` without LoRA).
      lora: the job's :class:`~effijax.lora.LoraSpec` (None: full training).
      frozen: the job's frozen tree (:func:`frozen_key`: with LoRA the frozen base, what
        ``batch(step)["base"]`` holds; a full job's reference copy).
      sequence_parallel: the step splits the activations between the blocks along the
        sequence over the mesh's ``tensor`` axis (see :func:`plan_job`).
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
    sequence_parallel: bool = False


def build_lm_job(
    model: LanguageModel,
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
    sequence_parallel: bool = True,
) -> LMJob:
    """Plans, initialises and binds a training job for any :class:`~effijax.models.LanguageModel`.

    Arguments are :func:`effijax.recipe.plan_job`'s, plus the token arrays
    (:func:`effijax.data.split_corpus`), ``num_eval_batches`` fixed validation batches, and
    ``base_params`` (with ``lora``: the frozen base, e.g. an earlier run's parameters; None
    initialises it from ``seed``).

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
    if lora is None and base_params is not None:
        raise ConfigError("base_params", "given", "belongs to LoRA jobs; pass lora=, or start a "
                          "full job from parameters with effijax.recipe.init_state(job, params)")
    job = plan_job(model, policy, optimizer, batch_size=batch_size, mesh=mesh,
                   strategy=strategy, rules=rules, lora=lora, frozen_dtype=frozen_dtype,
                   seed=seed, loss_multiplier=loss_multiplier,
                   allow_unscaled_fp16=allow_unscaled_fp16, sequence_parallel=sequence_parallel)
    frozen = init_frozen(job, base_params)

    def evaluate_params(params) -> float:
        if not num_eval_batches:
            raise ValueError("this job was built with num_eval_batches=0: nothing to evaluate")
        return evaluate(job, params, val_tokens, num_batches=num_eval_batches, frozen=frozen)

    return LMJob(init_state(job), job.step, batch_fn(job, train_tokens, frozen), evaluate_params,
                 job.tokens_per_step, job.num_params, shardings=job.shardings, mesh=job.mesh,
                 strategy=None if mesh is None else job.strategy.name,
                 compile=lambda census=True: compile_job(job, census=census),
                 trainable_params=job.trainable_params, lora=lora, frozen=frozen,
                 sequence_parallel=job.sequence_parallel)
