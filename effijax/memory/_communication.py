"""Communication per training step on a ``(data, fsdp, tensor)`` mesh, per device.

Two kinds of traffic, each counted as a ring sends it (``(g-1)/g`` of the tensor for an
all-gather or reduce-scatter over ``g`` devices, twice that for an all-reduce; the census's
``wire_bytes``):

* **tensor parallelism** (Megatron, Shoeybi et al. 2019; Korthikanti et al. 2022): each layer
  all-reduces its ``[b, s, h]`` activations twice in the forward pass (after the row-parallel
  attention output and MLP output projections) and twice in the backward pass (the
  column-parallel q/k/v and MLP input projections' input gradients), ``p·s·b·h`` bytes each.
  Block checkpointing repeats the forward's two. Sequence parallelism turns each all-reduce
  into an all-gather and a reduce-scatter: twice the collectives, the same bytes on the wire;
* **data parallelism** over the ``data·fsdp`` devices, of one tensor shard of the model
  (``Ψ/t`` parameters of ``q`` bytes): ``2Ψ/t`` for DDP and ZeRO-1/2 (a reduce-scatter and an
  all-gather, or an all-reduce), ``3Ψ/t`` for ZeRO-3/FSDP (the parameters are gathered for the
  forward and again for the backward pass), after Rajbhandari et al. (2020), section 7.

The compiled program's census (:func:`effijax.sharding.collective_census`) counts what XLA
really planned; on jax 0.10.2 its backward pass all-reduces the q, k and v input gradients
separately (the partitioner reduces each dot's partial sums before they are added), three
collectives of the same size where Megatron's hand-written backward has one.
"""

from __future__ import annotations

import dataclasses

from effijax.errors import ConfigError, whole_number
from effijax.memory._estimate import _check_choice

__all__ = ["Communication", "communication"]


@dataclasses.dataclass(frozen=True)
class Communication:
    """Per-device communication of one training step (one micro-batch for the activations).

    Attributes:
      tensor_collectives: collectives over the ``tensor`` axis per step: ``4L`` all-reduces
        (``6L`` with block checkpointing), twice as many with sequence parallelism.
      tensor_bytes: bytes of one of them (``p·s·b·h``).
      tensor_wire_bytes: what a device sends for them per step.
      grad_sync_wire_bytes: what a device sends to synchronise (and for ZeRO-3, gather) the
        parameters and gradients over the data-parallel devices.
      wire_bytes: the sum.
    """

    tensor_collectives: int
    tensor_bytes: int
    tensor_wire_bytes: float
    grad_sync_wire_bytes: float
    wire_bytes: float = dataclasses.field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "wire_bytes", self.tensor_wire_bytes + self.grad_sync_wire_bytes)


def communication(
    num_params: int,
    *,
    layers: int,
    hidden: int,
    seq_len: int,
    batch_size: int,
    data: int = 1,
    fsdp: int = 1,
    tensor: int = 1,
    zero_stage: int = 0,
    bytes_per_value: int = 2,
    grad_bytes: int = 2,
    sequence_parallel: bool = False,
    checkpointing: str = "none",
) -> Communication:
    """Per-device communication of one step on a ``(data, fsdp, tensor)`` mesh.

    Args:
      num_params: Ψ, the model's parameters.
      layers, hidden, seq_len: the transformer's ``L``, ``h``, ``s``.
      batch_size: sequences per data-parallel rank per micro-batch (``b``).
      data, fsdp, tensor: the mesh's axis sizes.
      zero_stage: 0 (DDP) to 3 (FSDP).
      bytes_per_value: ``p``, bytes of an activation (2 for bf16).
      grad_bytes: ``q``, bytes of a gradient / gathered parameter.
      sequence_parallel: all-gathers and reduce-scatters instead of all-reduces.
      checkpointing: ``"none"`` or ``"block"`` (the forward's collectives run twice).

    Returns:
      A :class:`Communication`.

    Raises:
      ConfigError: naming the argument, for non-positive sizes or an unknown stage or mode.

    Example:
      >>> # Llama-2-7B-like, fsdp=2 x tensor=4, 1 sequence of 4096 per rank, bf16.
      >>> c = communication(6_738_415_616, layers=32, hidden=4096, seq_len=4096,
      ...                   batch_size=1, fsdp=2, tensor=4, zero_stage=3)
      >>> c.tensor_collectives, c.tensor_bytes, round(c.wire_bytes / 1e9, 2)
      (128, 33554432, 11.5)
    """
    for name, value in (("num_params", num_params), ("layers", layers), ("hidden", hidden),
                        ("seq_len", seq_len), ("batch_size", batch_size), ("data", data),
                        ("fsdp", fsdp), ("tensor", tensor), ("bytes_per_value", bytes_per_value),
                        ("grad_bytes", grad_bytes)):
        whole_number(name, value, maximum=None)
    zero_stage = whole_number("zero_stage", zero_stage, minimum=0, maximum=3)
    checkpointing = _check_choice("checkpointing", checkpointing, ("none", "block"))
    if not isinstance(sequence_parallel, bool):
        raise ConfigError("sequence_parallel", sequence_parallel, "expected True or False")
    t = tensor
    per_layer = 6 if checkpointing == "block" else 4
    tensor_bytes = bytes_per_value * seq_len * batch_size * hidden
    if t == 1:
        collectives, tensor_wire = 0, 0.0
    elif sequence_parallel:
        collectives = 2 * per_layer * layers  # an all-gather and a reduce-scatter each
        tensor_wire = collectives * (t - 1) / t * tensor_bytes
    else:
        collectives = per_layer * layers
        tensor_wire = collectives * 2 * (t - 1) / t * tensor_bytes
    n = data * fsdp
    shard = -(-num_params // t) * grad_bytes
    grad_sync = (3 if zero_stage == 3 else 2) * (n - 1) / n * shard
    return Communication(collectives, tensor_bytes if t > 1 else 0, tensor_wire, grad_sync)
