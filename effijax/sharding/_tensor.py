"""Tensor parallelism: Megatron's layout of a model's weights over the ``tensor`` mesh axis.

A model declares, for each weight it wants split, the *logical* name of every dimension
(:class:`TensorLayout`): a query kernel ``[L, D, H*K]`` is ``("layers", "embed", "heads")``, an
MLP output kernel ``("layers", "mlp", "embed")``, the token embedding ``("vocab", "embed")``.
The split names (:data:`TENSOR_SPLIT`) go to the ``tensor`` axis, which is Megatron's layout:

* q/k/v column-parallel (each device computes its heads), o row-parallel (a partial sum that
  one all-reduce completes), MLP in column- then row-parallel: two all-reduces per layer
  forward, two backward;
* embedding and head vocabulary-parallel: the logits stay split along the vocabulary and the
  cross-entropy's max, sum and label pick become all-reduces of ``[B, S]`` values (XLA's
  partitioner does this for :func:`effijax.precision.cross_entropy`; the tests check that no
  ``[B, S, V]`` all-gather appears);
* everything the layout does not name (norms, learned positions) is replicated over ``tensor``;
* sequence parallelism (on by default with ``tensor > 1``; the activations, not the weights:
  :func:`~effijax.sharding.activation_spec`): between the blocks the residual stream, the norms'
  outputs and the dropouts are split along the sequence over ``tensor``, so the row-parallel
  outputs are reduce-scattered and the sequence all-gathered before q/k/v and the MLP's input
  (Megatron's g-bar and g: an all-reduce's bytes), and those activations divide by the tensor
  degree (Korthikanti et al.'s ``34/t``). The training recipe refuses a ``seq_len`` the degree
  does not divide; generation keeps the batch-only layout.

Key/value heads of grouped-query attention are split when the tensor degree divides them and
replicated otherwise (each device then holds every kv head). Query heads, the MLP width and the
vocabulary must divide: :func:`tensor_split` refuses a mesh that does not, naming the field.
The ``fsdp`` split of the remaining dimensions stays the automatic rule's
(:func:`~effijax.sharding.partition_specs`), so the two compose on a ``(data, fsdp, tensor)``
mesh; a tensor degree of 1 leaves every spec as it was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from effijax.errors import ConfigError

__all__ = ["TENSOR_SPLIT", "TensorLayout", "tensor_split", "tensor_dim"]

#: Logical dimension names split over ``tensor``, and the model field each one counts (what
#: the refusal names). ``kv`` (key/value heads) is split only when divisible (replicated
#: otherwise). The names are :data:`~effijax.sharding.LOGICAL_AXES`' (what explicit rules
#: speak), ``heads`` meaning query heads.
TENSOR_SPLIT: Mapping[str, str] = {
    "heads": "n_heads",
    "kv": "n_kv_heads",
    "mlp": "d_ff",
    "vocab": "vocab_size",
}


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """A model's tensor-parallel layout: the logical dimension names of its split weights.

    Attributes:
      dims: ``((path, names), ...)``: a weight's '/'-joined path and one logical name (or
        None) per dimension, e.g. ``("layers/attn/q/kernel", ("layers", "embed", "heads"))``.
      sizes: the count behind each split name in :data:`TENSOR_SPLIT` (``heads``: query heads,
        ``kv``: key/value heads, ``mlp``: the MLP width, ``vocab``); the tensor degree must
        divide them (``kv``: or the key/value weights are replicated).
      model: the model's name, for messages.

    Example:
      >>> layout = TensorLayout(dims=(("w", ("embed", "mlp")),), sizes={"mlp": 64})
      >>> layout.names_of("w"), layout.names_of("b")
      (('embed', 'mlp'), None)
    """

    dims: tuple[tuple[str, tuple[str | None, ...]], ...]
    sizes: Mapping[str, int]
    model: str = "model"

    def __post_init__(self):
        for path, names in self.dims:
            unknown = [n for n in names if n is not None and not isinstance(n, str)]
            if not isinstance(path, str) or unknown:
                raise ConfigError("tensor_layout", path, "expected (path, tuple of logical "
                                  "dimension names or None)")
        missing = sorted({n for _, names in self.dims for n in names if n in TENSOR_SPLIT}
                         - set(self.sizes))
        if missing:
            raise ConfigError("tensor_layout.sizes", dict(self.sizes), f"no count for the "
                              f"split dimension(s) {missing}")

    def names_of(self, path: str) -> tuple[str | None, ...] | None:
        """The logical names of ``path``'s dimensions, or None when the layout omits it."""
        for p, names in self.dims:
            if p == path:
                return names
        return None


def tensor_split(layout: TensorLayout, tensor: int) -> frozenset[str]:
    """The logical names split over a ``tensor`` axis of this size; refuses what does not divide.

    Args:
      layout: the model's :class:`TensorLayout`.
      tensor: the mesh's ``tensor`` size.

    Returns:
      The split names (empty for ``tensor == 1``; without ``kv`` when it does not divide).

    Raises:
      ConfigError: ``tensor`` does not divide the query heads, the MLP width or the vocabulary,
        naming the field and both numbers.

    Example:
      >>> layout = TensorLayout(dims=(), sizes={"heads": 8, "kv": 2, "mlp": 64})
      >>> sorted(tensor_split(layout, 4))  # kv heads replicated: 2 % 4 != 0
      ['heads', 'mlp']
      >>> tensor_split(layout, 16)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: n_heads=8: model: the mesh's tensor=16 does not divide ...
    """
    if tensor == 1:
        return frozenset()
    split = set()
    for name, field in TENSOR_SPLIT.items():
        size = layout.sizes.get(name)
        if size is None:
            continue
        if size % tensor == 0:
            split.add(name)
        elif name != "kv":
            divisors = [d for d in range(1, size + 1) if size % d == 0 and d <= tensor]
            raise ConfigError(field, size, f"{layout.model}: the mesh's tensor={tensor} does not "
                              f"divide {field}={size} (the {name} dimension is split over the "
                              f"tensor axis); use tensor={divisors[-1]} or another size that "
                              f"divides {size}")
    return frozenset(split)


def tensor_dim(path: str, shape, layout: TensorLayout | None, split: frozenset[str]
               ) -> int | None:
    """The dimension of the parameter at ``path`` that is split over ``tensor``, or None.

    Args:
      path: the parameter's '/'-joined path.
      shape: its shape (checked against the layout's names).
      layout: the model's layout, or None (nothing split).
      split: the split names, from :func:`tensor_split`.

    Raises:
      ConfigError: the layout names a different number of dimensions than the shape has.

    Example:
      >>> layout = TensorLayout(dims=(("w", ("embed", "mlp")),), sizes={"mlp": 64})
      >>> tensor_dim("w", (16, 64), layout, tensor_split(layout, 4))
      1
    """
    names = None if layout is None or not split else layout.names_of(path)
    if names is None:
        return None
    if len(names) != len(shape):
        raise ConfigError("tensor_layout", path, f"{len(names)} dimension names {names} for a "
                          f"parameter of shape {tuple(shape)}")
    dims = [d for d, name in enumerate(names) if name in split]
    return dims[0] if dims else None
