"""Partition rules: which dimension of each parameter is split over which mesh axis.

A parameter's *sharded spec* is the ``PartitionSpec`` it has when a strategy shards it (FSDP
shards the parameter itself, ZeRO-1/2 only its optimizer state, DDP nothing). Specs come from:

1. explicit ``rules``, ``[(path_regex, spec), ...]``, first match wins (``re.search`` on the
   '/'-joined path of :mod:`effijax.paths`). ``spec`` is a ``PartitionSpec`` of mesh axes, a
   tuple of logical axis names looked up in ``logical_axes`` (``("layers", "embed", "mlp")``),
   or ``None`` (replicate);
2. otherwise the automatic rule: a leaf with at least ``min_shard_size`` elements is split
   along its largest dimension divisible by the ``fsdp`` size (the first such on ties); smaller
   leaves are replicated silently (a collective's latency costs more than their bytes), and
   large ones with no divisible dimension are replicated with a
   :class:`ReplicatedParameterWarning` naming the path and shape.

Everything is validated before anything is traced: a rule that matches nothing, a spec longer
than the leaf's rank, an unknown mesh axis or logical name, and (for explicit rules) a
dimension not divisible by its mesh axes are :class:`~effijax.errors.ConfigError` s naming the
rule, the path and the shape. (``jit``/``device_put`` would raise on the last one too, later and
without naming the parameter.)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from effijax.errors import ConfigError, whole_number
from effijax.paths import compile_pattern, named_leaves
from effijax.sharding._mesh import _check_mesh
from effijax.sharding._tensor import TensorLayout, tensor_dim, tensor_split

__all__ = [
    "LOGICAL_AXES",
    "DEFAULT_MIN_SHARD_SIZE",
    "ReplicatedParameterWarning",
    "partition_specs",
]

#: Logical axis name -> mesh axis (or tuple of axes, or None for "not split"). Rules written in
#: logical names stay valid when the table changes, e.g. to ``{"mlp": "tensor", ...}``.
LOGICAL_AXES: Mapping[str, Any] = {
    "embed": "fsdp",
    "mlp": None,
    "vocab": None,
    "heads": None,
    "kv": None,
    "layers": None,
}

#: Leaves with fewer elements are replicated by the automatic rule: 1024 f32 elements are 4 KiB,
#: below which a collective's fixed latency outweighs the memory it saves.
DEFAULT_MIN_SHARD_SIZE = 2**10


class ReplicatedParameterWarning(UserWarning):
    """A parameter big enough to shard had no dimension divisible by the ``fsdp`` size."""


def _mesh_axes_of(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def _resolve_spec(index: int, spec, mesh: Mesh, logical_axes: Mapping[str, Any]) -> P:
    """Turns a rule's spec (PartitionSpec, logical names or None) into a mesh PartitionSpec."""
    field = f"rules[{index}]"
    if spec is None:
        return P()
    if isinstance(spec, P):
        entries = list(spec)
    elif isinstance(spec, tuple | list):
        entries = []
        for name in spec:
            if name is None:
                entries.append(None)
            elif isinstance(name, str) and name in logical_axes:
                entries.append(logical_axes[name])
            else:
                raise ConfigError(field, spec, f"unknown logical axis {name!r}; the table "
                                  f"has {sorted(logical_axes)} (or write a PartitionSpec of "
                                  f"mesh axes {list(mesh.axis_names)})")
    else:
        raise ConfigError(field, spec, "a spec must be a PartitionSpec of mesh axes, a tuple "
                          "of logical axis names, or None (replicate)")
    used: list[str] = []
    for entry in entries:
        for axis in _mesh_axes_of(entry):
            if axis not in mesh.axis_names:
                raise ConfigError(field, spec, f"unknown mesh axis {axis!r}; the mesh has "
                                  f"{list(mesh.axis_names)}")
            if axis in used:
                raise ConfigError(field, spec, f"mesh axis {axis!r} is used twice")
            used.append(axis)
    return P(*entries)


def _check_rule_fits(index: int, pattern: str, spec: P, path: str, shape, mesh: Mesh) -> None:
    field = f"rules[{index}]"
    if len(spec) > len(shape):
        raise ConfigError(field, pattern, f"spec {spec} has {len(spec)} entries but parameter "
                          f"{path!r} has shape {tuple(shape)} (rank {len(shape)})")
    for dim, entry in enumerate(spec):
        axes = _mesh_axes_of(entry)
        n = math.prod(mesh.shape[a] for a in axes)
        if n > 1 and shape[dim] % n:
            raise ConfigError(field, pattern, f"parameter {path!r} of shape {tuple(shape)}: "
                              f"dimension {dim} ({shape[dim]}) is not divisible by "
                              f"{'*'.join(axes)} = {n}; pick another dimension in the rule "
                              "or replicate it with (pattern, None)")


def _auto_spec(path: str, shape, n: int, min_shard_size: int, split_dim: int | None = None
               ) -> P:
    """The automatic fsdp split; ``split_dim`` (already split over ``tensor``) is skipped."""
    entries = [None] * len(shape)
    if split_dim is not None:
        entries[split_dim] = "tensor"
    if n == 1 or len(shape) == 0 or math.prod(shape) < min_shard_size:
        return _trimmed(entries)
    divisible = [d for d, size in enumerate(shape)
                 if size % n == 0 and size > 0 and d != split_dim]
    if not divisible:
        warnings.warn(
            f"parameter {path!r} of shape {tuple(shape)} has no dimension divisible by the "
            f"fsdp size {n}: it is replicated. Add a rule to shard it another way, or pad it.",
            ReplicatedParameterWarning,
            stacklevel=4,
        )
        return _trimmed(entries)
    dim = max(divisible, key=lambda d: (shape[d], -d))
    entries[dim] = "fsdp"
    return _trimmed(entries)


def _trimmed(entries) -> P:
    """``P(*entries)`` without trailing Nones (``P()`` when nothing is split)."""
    entries = list(entries)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def partition_specs(
    abstract_params,
    mesh: Mesh,
    *,
    rules: Sequence[tuple] | None = None,
    logical_axes: Mapping[str, Any] | None = None,
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
    tensor_layout: TensorLayout | None = None,
):
    """The sharded ``PartitionSpec`` of every parameter (what FSDP stores, ZeRO shards opt on).

    Args:
      abstract_params: a pytree of arrays or ``jax.ShapeDtypeStruct`` (``jax.eval_shape``).
      mesh: a mesh from :func:`~effijax.sharding.make_mesh`.
      rules: ordered ``[(path_regex, spec), ...]``; first match wins; unmatched leaves get the
        automatic rule. ``spec``: ``PartitionSpec`` (mesh axes), tuple of logical names, or None.
      logical_axes: logical name -> mesh axis table; default :data:`LOGICAL_AXES`.
      min_shard_size: the automatic rule replicates leaves with fewer elements.
      tensor_layout: the model's :class:`~effijax.sharding.TensorLayout`; on a mesh with
        ``tensor > 1`` the weights it names are split Megatron's way over ``tensor`` (the
        automatic rule then splits another dimension over ``fsdp``). Explicit rules still win.

    Returns:
      A pytree of ``PartitionSpec`` with the structure of ``abstract_params``.

    Raises:
      ConfigError: bad rule (matches nothing, unknown axis or name, too long, not divisible);
        a tensor degree that does not divide the heads, MLP width or vocabulary.

    Warns:
      ReplicatedParameterWarning: an automatic leaf with no dimension divisible by ``fsdp``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from effijax.sharding import make_mesh
      >>> mesh = make_mesh(data=2)  # fsdp = 4
      >>> params = {"emb": jax.ShapeDtypeStruct((50256, 16), jnp.float32),
      ...           "blocks": {"w": jax.ShapeDtypeStruct((2, 16, 64), jnp.float32)},
      ...           "b": jax.ShapeDtypeStruct((64,), jnp.float32)}
      >>> specs = partition_specs(params, mesh)
      >>> specs["emb"], specs["blocks"]["w"], specs["b"]
      (P('fsdp',), P(None, None, 'fsdp'), P())
      >>> partition_specs(params, mesh, rules=[("blocks/w", ("layers", "embed", "mlp"))])["blocks"]
      {'w': P(None, 'fsdp', None)}
    """
    mesh = _check_mesh(mesh)
    table = dict(LOGICAL_AXES if logical_axes is None else logical_axes)
    whole_number("min_shard_size", min_shard_size, minimum=0, maximum=None)  # elements
    compiled = []
    for i, rule in enumerate(rules or ()):
        if not (isinstance(rule, tuple | list) and len(rule) == 2):
            raise ConfigError(f"rules[{i}]", rule, "expected (path_regex, spec)")
        pattern, spec = rule
        regex = compile_pattern(pattern, field=f"rules[{i}]")
        compiled.append((regex, _resolve_spec(i, spec, mesh, table)))

    leaves = named_leaves(abstract_params)
    for path, leaf in leaves:
        if not hasattr(leaf, "shape"):
            raise ConfigError(f"params[{path}]", type(leaf).__name__,
                              "expected an array or jax.ShapeDtypeStruct leaf")
    paths = [path for path, _ in leaves]
    for i, (regex, _) in enumerate(compiled):
        if not any(regex.search(p) for p in paths):
            shown = ", ".join(repr(p) for p in paths[:8])
            raise ConfigError(f"rules[{i}]", regex.pattern, f"matched 0 of {len(paths)} "
                              f"parameters; the first paths are: {shown}")

    n = mesh.shape["fsdp"]
    tensor = mesh.shape.get("tensor", 1)
    split = frozenset() if tensor_layout is None else tensor_split(tensor_layout, tensor)

    def spec_of(path: str, leaf) -> P:
        for i, (regex, spec) in enumerate(compiled):
            if regex.search(path):
                _check_rule_fits(i, regex.pattern, spec, path, leaf.shape, mesh)
                return spec
        return _auto_spec(path, leaf.shape, n, min_shard_size,
                          tensor_dim(path, leaf.shape, tensor_layout, split))

    specs = [spec_of(path, leaf) for path, leaf in leaves]
    treedef = jax.tree.structure(abstract_params)
    return jax.tree.unflatten(treedef, specs)
