"""Adapters as a pytree: init, validation, merge/unmerge, counts, and adapter-only training.

The adapters are a nested dict that mirrors the parameter paths of the targeted kernels only:
``{"blocks": {"attn": {"q": {"kernel": {"a": a_LDR, "b": b_LRD}}}}}`` adapts
``blocks/attn/q/kernel``. Nothing else lives in it, so it is what an optimizer trains, what a
checkpoint of a fine-tune stores and what :func:`count_params` counts. Two ways to use it:

* factored, inside a model that knows about adapters (effijax's GPT:
  ``make_loss_fn(graphdef, lora=spec)``), computing ``x @ w + s·(x @ a) @ b`` without ever forming
  a ``d_in × d_out`` delta, and with :func:`freeze_base` so only the adapters are differentiated;
* merged, for any model: :func:`merge` folds ``w + s·(a @ b)`` into the weights (in f32).

Shape letters: ``L`` stacked layers, ``D`` kernel input width, ``F`` output width, ``R`` rank.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from effijax.errors import ConfigError
from effijax.lora._spec import LoraSpec
from effijax.paths import map_with_path, named_leaves

__all__ = [
    "select",
    "init",
    "validate",
    "pairs",
    "merge",
    "unmerge",
    "merge_error",
    "count_params",
    "trainable_report",
    "freeze_base",
]

_SHOWN_PATHS = 8
# Flax's names for biases and normalisation scales: never LoRA targets, whatever their shape.
_NOT_KERNELS = ("bias", "scale")


def _describe(leaf) -> str:
    dtype = getattr(leaf, "dtype", None)
    shape = getattr(leaf, "shape", None)
    if shape is None or dtype is None:
        return type(leaf).__name__
    return f"{tuple(shape)} {dtype}"


def _is_float(leaf) -> bool:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return False
    return bool(jnp.issubdtype(dtype, jnp.floating))


def select(params, spec: LoraSpec) -> list[str]:
    """The paths of the parameters ``spec`` adapts, checked: raises before anything is traced.

    Only shapes and dtypes are read, so ``params`` may be ``jax.ShapeDtypeStruct`` leaves.

    Raises:
      ConfigError: the targets select no parameter (the message lists the first paths), a
        target is not a >= 2-D floating kernel, or a rank exceeds ``min(d_in, d_out)``.

    Example:
      >>> import jax.numpy as jnp
      >>> params = {"attn": {"q": {"kernel": jnp.zeros((4, 4)), "bias": jnp.zeros(4)}}}
      >>> select(params, LoraSpec(rank=2))
      ['attn/q/kernel']
      >>> select(params, LoraSpec(targets="xyz"))
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: targets='xyz': regex matched 0 of 2 parameters; the first ...
    """
    leaves = named_leaves(params)
    chosen = [(path, leaf) for path, leaf in leaves if spec.matches(path, leaf)]
    what = "regex" if isinstance(spec.targets, str) else "predicate"
    if not chosen:
        shown = ", ".join(p for p, _ in leaves[:_SHOWN_PATHS])
        more = f", ... ({len(leaves) - _SHOWN_PATHS} more)" if len(leaves) > _SHOWN_PATHS else ""
        raise ConfigError(
            "targets", spec.targets,
            f"{what} matched 0 of {len(leaves)} parameters; the first paths are: {shown}{more}",
        )
    for path, leaf in chosen:
        shape = getattr(leaf, "shape", ())
        if path.rsplit("/", 1)[-1] in _NOT_KERNELS:
            # A stacked bias or norm scale (L, d) would pass the shape checks below.
            raise ConfigError(
                "targets", spec.targets,
                f"{what} selects {path!r} with shape {_describe(leaf)}: biases and norm scales "
                r"are not LoRA targets (PEFT's bias='none'); narrow the targets, e.g. "
                r"r'attn/(q|v)/kernel'",
            )
        if not _is_float(leaf) or len(shape) < 2:
            raise ConfigError(
                "targets", spec.targets,
                f"{what} selects {path!r} with shape {_describe(leaf)}, but LoRA adapts >= 2-D "
                f"floating kernels (..., d_in, d_out); narrow the targets, e.g. "
                r"r'attn/(q|v)/kernel'",
            )
        rank, (d_in, d_out) = spec.rank_for(path), shape[-2:]
        if rank > min(d_in, d_out):
            raise ConfigError(
                "rank", rank,
                f"larger than min(d_in, d_out) = {min(d_in, d_out)} of {path!r} with shape "
                f"{tuple(shape)}; lower the rank or add an override (regex, rank, alpha) for it",
            )
    return [path for path, _ in chosen]


def _nest(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        *parents, last = path.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


def _is_pair(node) -> bool:
    return isinstance(node, dict) and set(node) == {"a", "b"}


def pairs(adapters) -> dict[str, tuple[Any, Any]]:
    """Flattens an adapter tree to ``{kernel path: (a, b)}``.

    Example:
      >>> import jax.numpy as jnp
      >>> tree = {"attn": {"q": {"kernel": {"a": jnp.zeros((4, 2)), "b": jnp.zeros((2, 4))}}}}
      >>> list(pairs(tree))
      ['attn/q/kernel']
    """
    out: dict[str, tuple[Any, Any]] = {}

    def walk(node, path):
        if _is_pair(node):
            out[path] = (node["a"], node["b"])
        elif isinstance(node, dict) and node:
            for key, child in node.items():
                walk(child, f"{path}/{key}" if path else str(key))
        else:
            raise ConfigError(
                "adapters", type(node).__name__,
                f"at {path or '<root>'!r}: expected nested dicts ending in {{'a': ..., 'b': ...}} "
                "pairs (what effijax.lora.init returns)",
            )

    walk(adapters, "")
    return out


def _path_seed(path: str) -> int:
    # A stable per-path stream: an adapter's init depends on (key, path) only, not on which
    # other kernels happen to be targeted.
    return zlib.crc32(path.encode()) & 0x7FFFFFFF


def init(key: jax.Array, params, spec: LoraSpec) -> dict:
    """Creates adapters for the kernels ``spec`` targets; the model is unchanged at init.

    Args:
      key: a PRNG key.
      params: the base parameters (arrays or ``jax.ShapeDtypeStruct``: only shapes are read, so
        ``jax.eval_shape(lambda k: init(k, params, spec), key)`` allocates nothing).
      spec: the :class:`LoraSpec`.

    Returns:
      ``{...path...: {"a": (..., d_in, r), "b": (..., r, d_out)}}`` in ``spec.dtype``; ``b`` is
      zero, ``a`` is kaiming-uniform with bound ``1/sqrt(d_in)`` (or normal, std ``1/r``).

    Raises:
      ConfigError: see :func:`select`; raised before anything is traced.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> params = {"blocks": {"attn": {"q": {"kernel": jnp.zeros((2, 16, 32))}}}}
      >>> adapters = init(jax.random.key(0), params, LoraSpec(rank=4))
      >>> pair = adapters["blocks"]["attn"]["q"]["kernel"]
      >>> pair["a"].shape, pair["b"].shape, bool(jnp.all(pair["b"] == 0))
      ((2, 16, 4), (2, 4, 32), True)
    """
    leaves = dict(named_leaves(params))
    flat = {}
    for path in select(params, spec):
        *lead, d_in, d_out = leaves[path].shape
        rank, k = spec.rank_for(path), jax.random.fold_in(key, _path_seed(path))
        if spec.init == "kaiming":
            # PEFT: kaiming_uniform_(a=sqrt(5)) on the (r, d_in) weight, i.e. bound 1/sqrt(d_in).
            bound = 1.0 / math.sqrt(d_in)
            a = jax.random.uniform(k, (*lead, d_in, rank), jnp.float32, -bound, bound)
        else:
            a = jax.random.normal(k, (*lead, d_in, rank), jnp.float32) * (1.0 / rank)
        flat[path] = {"a": a.astype(spec.dtype), "b": jnp.zeros((*lead, rank, d_out), spec.dtype)}
    return _nest(flat)


def validate(params, adapters, spec: LoraSpec | None = None) -> None:
    """Checks that ``adapters`` fit ``params``: every pair names a kernel, shapes line up.

    Works on arrays, tracers and ``jax.ShapeDtypeStruct`` alike (only shapes are read).

    Raises:
      ConfigError: naming the adapter path, the adapter's and the kernel's shapes.

    Example:
      >>> import jax.numpy as jnp
      >>> params = {"w": jnp.zeros((4, 6))}
      >>> validate(params, {"w": {"a": jnp.zeros((4, 2)), "b": jnp.zeros((2, 6))}})
      >>> validate(params, {"w": {"a": jnp.zeros((5, 2)), "b": jnp.zeros((2, 6))}})
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: adapters='w': a (5, 2) and b (2, 6) do not fit the kernel ...
    """
    leaves = dict(named_leaves(params))
    for path, (a, b) in pairs(adapters).items():
        if path not in leaves:
            known = [p for p in leaves if _is_float(leaves[p]) and len(leaves[p].shape) >= 2]
            raise ConfigError(
                "adapters", path,
                f"no such parameter in the base; its >= 2-D kernels are: "
                f"{', '.join(known[:_SHOWN_PATHS])}{', ...' if len(known) > _SHOWN_PATHS else ''}",
            )
        shape = tuple(leaves[path].shape)
        a_shape, b_shape = tuple(a.shape), tuple(b.shape)
        ok = (len(shape) >= 2 and len(a_shape) == len(shape) == len(b_shape)
              and a_shape[:-1] == shape[:-1] and b_shape[:-2] == shape[:-2]
              and b_shape[-1] == shape[-1] and a_shape[-1] == b_shape[-2])
        if not ok:
            d_in, d_out = (shape[-2:] if len(shape) >= 2 else ("d_in", "d_out"))
            raise ConfigError(
                "adapters", path,
                f"a {a_shape} and b {b_shape} do not fit the kernel {shape}: expected "
                f"a (..., {d_in}, r) and b (..., r, {d_out})",
            )
        if a.dtype != b.dtype:
            raise ConfigError("adapters", path, f"a is {a.dtype} but b is {b.dtype}")
        if spec is not None and a_shape[-1] != spec.rank_for(path):
            raise ConfigError(
                "adapters", path,
                f"rank {a_shape[-1]} differs from the spec's rank {spec.rank_for(path)} for it",
            )


def _delta(a, b, scale: float) -> jax.Array:
    """``scale · a @ b`` in f32 at full precision (no TF32/bf16 passes on accelerators)."""
    ab = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)
    return ab * scale


def _apply_delta(params, adapters, spec: LoraSpec, sign: float):
    validate(params, adapters, spec)
    flat = pairs(adapters)

    def fn(path, w):
        if path not in flat:
            return w
        a, b = flat[path]
        return (w.astype(jnp.float32) + _delta(a, b, sign * spec.scale_for(path))).astype(w.dtype)

    return map_with_path(fn, params)


def merge(params, adapters, spec: LoraSpec):
    """Folds the adapters into the weights: ``w + s·(a @ b)``, computed in f32, stored as ``w``.

    Works for any model whose parameters the adapters mirror. The result has the base's dtypes;
    for a 16-bit base the small delta is rounded (see :func:`merge_error`).

    Example:
      >>> import jax.numpy as jnp
      >>> params = {"w": jnp.zeros((2, 2))}
      >>> adapters = {"w": {"a": jnp.ones((2, 1)), "b": jnp.ones((1, 2))}}
      >>> merge(params, adapters, LoraSpec(rank=1, alpha=2.0, targets="w"))["w"].tolist()
      [[2.0, 2.0], [2.0, 2.0]]
    """
    return _apply_delta(params, adapters, spec, 1.0)


def unmerge(params, adapters, spec: LoraSpec):
    """Undoes :func:`merge`: ``w - s·(a @ b)`` in f32 (exact up to rounding for an f32 base).

    Example:
      >>> import jax.numpy as jnp
      >>> spec = LoraSpec(rank=1, alpha=2.0, targets="w")
      >>> params = {"w": jnp.ones((2, 2))}
      >>> adapters = {"w": {"a": jnp.ones((2, 1)), "b": jnp.ones((1, 2))}}
      >>> unmerge(merge(params, adapters, spec), adapters, spec)["w"].tolist()
      [[1.0, 1.0], [1.0, 1.0]]
    """
    return _apply_delta(params, adapters, spec, -1.0)


def merge_error(params, adapters, spec: LoraSpec) -> dict[str, float]:
    """How much :func:`merge` loses by storing the merged weights in the base's dtype.

    Returns:
      ``{"max_abs": ..., "relative": ...}``: the largest ``|merged - (w + Δ)|`` over all adapted
      kernels (0 for an f32 base: the merge itself runs in f32), and ``||applied Δ - Δ|| /
      ||Δ||``, the fraction of the update lost to rounding, where the applied update is
      ``merged - w``. For an f32 base it is ~1e-7 to 1e-4 (f32 rounding of ``w + Δ``); for a
      bf16 base and a small Δ it approaches 1: keep such a model factored, or merge into f32.

    Example:
      >>> import jax.numpy as jnp
      >>> spec = LoraSpec(rank=1, alpha=1.0, targets="w")
      >>> adapters = {"w": {"a": jnp.full((2, 1), 1e-3), "b": jnp.ones((1, 2))}}
      >>> err = merge_error({"w": jnp.ones((2, 2))}, adapters, spec)
      >>> err["max_abs"], err["relative"] < 1e-4
      (0.0, True)
      >>> err = merge_error({"w": jnp.ones((2, 2), jnp.bfloat16)}, adapters, spec)
      >>> err["relative"]  # 1 + 1e-3 rounds back to 1 in bf16: the whole update is lost
      1.0
    """
    validate(params, adapters, spec)
    leaves, max_abs, lost_sq, delta_sq = dict(named_leaves(params)), 0.0, 0.0, 0.0
    for path, (a, b) in pairs(adapters).items():
        w = jnp.asarray(leaves[path]).astype(jnp.float32)
        delta = _delta(a, b, spec.scale_for(path))
        exact = w + delta
        merged = exact.astype(leaves[path].dtype).astype(jnp.float32)
        lost = np.asarray(merged - w - delta, np.float64)
        max_abs = max(max_abs, float(np.max(np.abs(np.asarray(merged - exact)))))
        lost_sq += float(np.sum(lost**2))
        delta_sq += float(np.sum(np.asarray(delta, np.float64) ** 2))
    relative = math.sqrt(lost_sq / delta_sq) if delta_sq > 0 else 0.0
    return {"max_abs": max_abs, "relative": relative}


def count_params(tree) -> int:
    """Number of scalars in a tree (adapters: ``r·(d_in + d_out)`` per adapted matrix).

    Example:
      >>> import jax.numpy as jnp
      >>> count_params({"w": {"a": jnp.zeros((64, 8)), "b": jnp.zeros((8, 64))}})
      1024
    """
    return sum(math.prod(x.shape if hasattr(x, "shape") else np.shape(x))
               for x in jax.tree.leaves(tree))


def trainable_report(params, adapters) -> str:
    """PEFT's ``print_trainable_parameters`` line; "all" counts the base plus the adapters.

    Example:
      >>> import jax.numpy as jnp
      >>> trainable_report({"w": jnp.zeros((64, 64))},
      ...                  {"w": {"a": jnp.zeros((64, 8)), "b": jnp.zeros((8, 64))}})
      'trainable params: 1,024 || all params: 5,120 || trainable%: 20.0000'
    """
    trainable = count_params(adapters)
    total = count_params(params) + trainable
    return (f"trainable params: {trainable:,d} || all params: {total:,d} || "
            f"trainable%: {100 * trainable / total:.4f}")


def freeze_base(loss_fn: Callable[..., Any], *, key: str = "base") -> Callable[..., Any]:
    """Makes a loss that differentiates only the adapters, with the frozen base in the batch.

    ``loss_fn(params, batch, rng)`` takes ``params = {"base": base, "adapters": adapters}`` (as
    ``effijax.models.make_loss_fn(graphdef, lora=spec)`` does). The returned
    ``loss(adapters, batch, rng)`` reads the base from ``batch[key]``, so under
    ``effijax.step.make_train_step`` the adapters are the train state's params: gradients and
    optimizer state exist for them only, and the base is an input of the compiled step (not a
    constant folded into the program), which may be bf16 and sharded like any batch entry. The
    step's policy casts only the adapters; store the base in the compute dtype yourself.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def loss_fn(params, batch, rng=None):
      ...     w = params["base"]["w"] + params["adapters"]["w"]["a"] @ params["adapters"]["w"]["b"]
      ...     return jnp.sum(batch["x"] @ w)
      >>> adapters = {"w": {"a": jnp.ones((2, 1)), "b": jnp.ones((1, 2))}}
      >>> batch = {"x": jnp.ones((1, 2)), "base": {"w": jnp.eye(2)}}
      >>> grads = jax.grad(freeze_base(loss_fn))(adapters, batch)
      >>> jax.tree.map(jnp.shape, grads)
      {'w': {'a': (2, 1), 'b': (1, 2)}}
    """
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable, got {type(loss_fn).__name__}")

    def loss(adapters, batch, rng=None):
        if not isinstance(batch, dict) or key not in batch:
            raise KeyError(
                f"freeze_base: the batch has no {key!r} entry; pass the frozen base parameters "
                f"in it, e.g. step(state, {{**batch, {key!r}: base}})"
            )
        rest = {k: v for k, v in batch.items() if k != key}
        # The base is never differentiated; stop_gradient makes that hold under any outer grad.
        base = jax.lax.stop_gradient(batch[key])
        return loss_fn({"base": base, "adapters": adapters}, rest, rng)

    return loss
