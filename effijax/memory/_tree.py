"""Model-state bytes counted from a real abstract parameter pytree and a real optax optimizer:
the same fields as :func:`~effijax.memory.model_states`' closed form, leaf by leaf.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from effijax.errors import ConfigError, whole_number
from effijax.memory._estimate import ModelStateBytes
from effijax.paths import named_leaves, path_of
from effijax.precision import QUANTIZED_FORMATS, is_quantizable, quantized_bytes
from effijax.sharding import match_param, tensor_dim, tensor_split

__all__ = ["estimate_tree", "frozen_base_bytes"]

_DTYPE_NAMES = {
    "fp32": jnp.float32,
    "f32": jnp.float32,
    "float32": jnp.float32,
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "fp16": jnp.float16,
    "f16": jnp.float16,
    "float16": jnp.float16,
}



def _to_dtype(value: Any, name: str) -> np.dtype:
    if isinstance(value, str) and value.strip().lower() in _DTYPE_NAMES:
        return np.dtype(_DTYPE_NAMES[value.strip().lower()])
    try:
        return np.dtype(value)
    except TypeError:
        raise ConfigError(
            name, value, f"not a dtype; use a dtype or one of {', '.join(_DTYPE_NAMES)}"
        ) from None


def _leaf_bytes(shape: tuple[int, ...], dtype: Any, sharded: bool, devices: int,
                min_shard_size: int = 0, split: tuple[int | None, int] = (None, 1)
                ) -> tuple[int, int]:
    """(bytes on one device, of which replicated although the stage shards it).

    ``split``: ``(dimension, tensor degree)`` of a tensor-parallel leaf (every strategy keeps
    it split); the stage's ``fsdp`` split takes another dimension, as the automatic rule does.
    """
    split_dim, tensor = split
    total = -(-math.prod(shape) * jax.dtypes.itemsize_bits(dtype) // 8)
    if split_dim is not None:
        total //= tensor
    if not sharded or devices == 1:
        return total, 0
    if math.prod(shape) >= min_shard_size and any(dim % devices == 0 and dim > 0
                                                  for d, dim in enumerate(shape)
                                                  if d != split_dim):
        return total // devices, 0
    return total, total


def _trainable_mask(trainable, treedef, with_paths) -> list[bool]:
    """One bool per leaf: ``trainable`` (a pytree of bools shaped like the parameters, checked
    leaf by leaf), or all True for None."""
    if trainable is None:
        return [True] * len(with_paths)
    try:
        mask = treedef.flatten_up_to(trainable)
    except (ValueError, TypeError):
        raise ConfigError(
            "trainable", jax.tree.structure(trainable), "must be a pytree of bools with the "
            f"structure of abstract_params ({treedef.num_leaves} leaves), or None"
        ) from None
    for (path, _), flag in zip(with_paths, mask, strict=True):
        if not isinstance(flag, bool | np.bool_):
            raise ConfigError(
                "trainable", path_of(path), f"leaf is {flag!r}; expected True (trained) or "
                "False (frozen)"
            )
    return [bool(flag) for flag in mask]


def estimate_tree(
    abstract_params: Any,
    optimizer: Any,
    *,
    param_dtype: Any,
    compute_dtype: Any,
    zero_stage: int = 0,
    devices: int = 1,
    trainable: Any = None,
    min_shard_size: int = 0,
    tensor: int = 1,
    tensor_layout: Any = None,
) -> ModelStateBytes:
    """Per-device model-state bytes of a real parameter pytree under a real optax optimizer.

    Nothing is allocated: optimizer state shapes come from
    ``jax.eval_shape(optimizer.init, trainable_params)``.

    What is counted (effijax's train step stores the trainable parameters in ``param_dtype`` and
    casts them to ``compute_dtype`` inside the step):

    * ``params_bytes``: trainable leaves at ``param_dtype`` (whatever their dtype in
      ``abstract_params``) plus frozen leaves at their own dtype. Stored params are the master
      copy, so ``master_bytes`` is 0.
    * ``grads_bytes``: trainable leaves at ``param_dtype``: the gradient with respect to an f32
      parameter cast to bf16 is f32 (the cast's transpose), so gradients never come out in
      ``compute_dtype``.
    * ``optimizer_bytes``: every leaf of the optimizer state, small counters included.
    * ``compute_copy_bytes``: the cast of every parameter whose dtype differs from
      ``compute_dtype``; a transient inside the step, reported but not in ``model_state_bytes``.

    For Adam with f32 params this is 4 + 4 + 8 = 16 bytes per parameter, the same total as
    :func:`model_states`'s ``"bf16"`` (2 + 2 + 12) and the same fields as its ``"fp32"``.

    ZeRO sharding follows :func:`model_states`: stage >= 1 shards optimizer leaves, >= 2 gradient
    leaves, 3 parameter (and frozen, and compute-copy) leaves. A leaf is sharded only if one of
    its dimensions divides by ``devices`` (how a sharding rule splits an array in jax); other
    leaves stay whole on every device and are added up in ``replicated_bytes``.

    Args:
      abstract_params: a pytree of ``jax.ShapeDtypeStruct`` or arrays (e.g. from
        ``jax.eval_shape(model.init, ...)``).
      optimizer: an ``optax.GradientTransformation``; its ``init`` receives the trainable
        parameters at ``param_dtype``, with frozen leaves replaced by ``None``.
      param_dtype: storage dtype of the trainable parameters (``jnp.float32``, ``"bf16"``, ...).
      compute_dtype: dtype of the forward and backward pass.
      zero_stage: 0 (DDP) to 3 (FSDP).
      devices: data-parallel devices (>= 1).
      min_shard_size: leaves with fewer elements stay whole even when the stage shards
        them, as :func:`effijax.sharding.partition_specs`' automatic rule does; pass
        ``effijax.sharding.DEFAULT_MIN_SHARD_SIZE`` to count what the default rule lays out
        (0, the default here, shards every divisible leaf).
      trainable: None (everything trains) or a pytree of bools with exactly the structure of
        ``abstract_params``; False leaves are frozen (no gradient, no optimizer state). For
        LoRA, put the frozen base and the adapters in one tree, e.g.
        ``{"base": base, "lora": adapters}`` with mask ``{"base": False..., "lora": True...}``.
      tensor: the mesh's ``tensor`` degree; with ``tensor_layout`` (a model's
        ``tensor_layout()``) the leaves it splits are counted ``1/tensor`` per device under
        every stage (their gradients and optimizer state too), and ``devices`` is the
        ``fsdp`` size the stage shards over.
      tensor_layout: see ``tensor``.

    Returns:
      A :class:`ModelStateBytes` for one device.

    Raises:
      ConfigError: naming the argument (and the leaf's '/'-joined path): a ``trainable`` tree of
        another structure or with non-bool leaves, an empty tree or a leaf without shape and
        dtype, an unknown dtype, or out-of-range stage/devices.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
      >>> est = estimate_tree(params, optax.adam(1e-3), param_dtype=jnp.float32,
      ...                     compute_dtype=jnp.bfloat16)
      >>> est.params_bytes, est.grads_bytes, est.optimizer_bytes - 8 * 2**20
      (4194304, 4194304, 4)
    """
    zero_stage = whole_number("zero_stage", zero_stage, minimum=0, maximum=3)
    devices = whole_number("devices", devices, maximum=None)
    tensor = whole_number("tensor", tensor, maximum=None)
    min_shard_size = whole_number("min_shard_size", min_shard_size, minimum=0, maximum=None)
    param_dtype = _to_dtype(param_dtype, "param_dtype")
    compute_dtype = _to_dtype(compute_dtype, "compute_dtype")

    with_paths, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
    if not with_paths:
        raise ConfigError("abstract_params", abstract_params, "the tree has no leaves; pass the "
                          "parameters, e.g. jax.eval_shape(model.init, ...)")
    leaves = []
    for path, leaf in with_paths:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise ConfigError(
                "abstract_params", path_of(path), f"leaf is {type(leaf).__name__}, not an array; "
                "pass jax.ShapeDtypeStruct leaves (jax.eval_shape) or arrays"
            )
        leaves.append((tuple(leaf.shape), np.dtype(leaf.dtype)))
    split = tensor_split(tensor_layout, tensor) if tensor_layout is not None else frozenset()
    dims = {path_of(path): (tensor_dim(path_of(path), leaf.shape, tensor_layout, split), tensor)
            for path, leaf in with_paths}
    splits = list(dims.values())

    mask = _trainable_mask(trainable, treedef, with_paths)

    shard_opt, shard_grads, shard_params = zero_stage >= 1, zero_stage >= 2, zero_stage >= 3
    params_bytes = grads_bytes = frozen_bytes = replicated = compute_copy = 0
    trainable_count = frozen_count = 0
    for (shape, dtype), train, cut in zip(leaves, mask, splits, strict=True):
        size = math.prod(shape)
        stored = param_dtype if train else dtype
        nbytes, rep = _leaf_bytes(shape, stored, shard_params, devices, min_shard_size, cut)
        params_bytes, replicated = params_bytes + nbytes, replicated + rep
        if stored != compute_dtype:
            compute_copy += _leaf_bytes(shape, compute_dtype, shard_params, devices,
                                        min_shard_size, cut)[0]
        if train:
            trainable_count += size
            nbytes, rep = _leaf_bytes(shape, param_dtype, shard_grads, devices, min_shard_size,
                                      cut)
            grads_bytes, replicated = grads_bytes + nbytes, replicated + rep
        else:
            frozen_count += size
            frozen_bytes += nbytes

    trainable_tree = jax.tree.unflatten(
        treedef,
        [
            jax.ShapeDtypeStruct(shape, param_dtype) if train else None
            for (shape, _), train in zip(leaves, mask, strict=True)
        ],
    )
    opt_state = jax.eval_shape(optimizer.init, trainable_tree)
    optimizer_bytes = 0
    shapes = {path: shape for path, (shape, _) in zip(dims, leaves, strict=True)}
    for path, leaf in named_leaves(opt_state):
        # A moment shaped like its parameter is laid out like it (state_shardings' matching).
        param = match_param(path, list(dims))
        cut = dims[param] if param and shapes[param] == tuple(leaf.shape) else (None, 1)
        nbytes, rep = _leaf_bytes(tuple(leaf.shape), leaf.dtype, shard_opt, devices,
                                  min_shard_size, cut)
        optimizer_bytes, replicated = optimizer_bytes + nbytes, replicated + rep

    return ModelStateBytes(
        params_bytes=params_bytes,
        grads_bytes=grads_bytes,
        optimizer_bytes=optimizer_bytes,
        master_bytes=0,
        frozen_bytes=frozen_bytes,
        trainable_params=trainable_count,
        frozen_params=frozen_count,
        devices=devices,
        zero_stage=zero_stage,
        replicated_bytes=replicated,
        compute_copy_bytes=compute_copy,
    )


def frozen_base_bytes(abstract_params, frozen_dtype: str, *, dtype: Any = jnp.bfloat16) -> int:
    """Exact bytes of a LoRA job's frozen base (before sharding) stored as ``frozen_dtype``.

    ``nf4``/``int8``: the layer stack's kernels quantized (codes + double-quantized scales, as
    :func:`effijax.precision.quantize_kernels` stores them), every other floating leaf in
    ``dtype`` (the compute dtype); a floating ``frozen_dtype`` (``bf16``, ...) casts them all.
    Equal to the sum of the real arrays' ``nbytes`` (tested).

    Example:
      >>> import jax
      >>> params = {"layers": {"kernel": jax.ShapeDtypeStruct((2, 64, 128), "float32")},
      ...           "norm": {"scale": jax.ShapeDtypeStruct((64,), "float32")}}
      >>> frozen_base_bytes(params, "nf4"), frozen_base_bytes(params, "bf16")
      (8600, 32896)
    """
    quantized = frozen_dtype in QUANTIZED_FORMATS
    if not quantized:
        dtype = _to_dtype(frozen_dtype, "frozen_dtype")
    total = 0
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        path = path_of(keypath)
        if quantized and is_quantizable(path, leaf):
            total += quantized_bytes(leaf.shape, frozen_dtype)
        else:
            floating = jnp.issubdtype(leaf.dtype, jnp.floating)
            total += math.prod(leaf.shape) * np.dtype(dtype if floating else leaf.dtype).itemsize
    return total
