"""Adapter layouts derived from their base kernels' layouts.

A kernel ``w: (..., d_in, d_out)`` laid out as ``(..., s_in, s_out)`` gets adapters
``a: (..., d_in, r)`` laid out ``(..., s_in, None)`` and ``b: (..., r, d_out)`` laid out
``(..., None, s_out)``: the rank axis is never split (it is tiny), and ``x @ a`` then needs the
same input layout as ``x @ w``. An entry whose mesh axes do not divide the adapter's dimension
is dropped (that dimension is replicated). The result is a list of partition rules, the format
:func:`effijax.sharding.partition_specs`, ``state_shardings`` and ``init_sharded`` take, so the
adapters' optimizer state follows the adapters by the sharding library's own path matching.

Only ``jax.sharding`` is used here: the lora package does not depend on effijax's sharding
package (the layering test checks it).
"""

from __future__ import annotations

import math
import re

from jax.sharding import NamedSharding, PartitionSpec

from effijax.errors import ConfigError
from effijax.lora._adapters import pairs
from effijax.paths import named_leaves

__all__ = ["adapter_rules"]


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def adapter_rules(base_shardings, adapters) -> list[tuple[str, PartitionSpec]]:
    """Partition rules that lay each adapter out like the kernel it adapts.

    Args:
      base_shardings: a pytree of ``NamedSharding`` with the structure of the base parameters
        (e.g. ``effijax.sharding.param_shardings(base, mesh, strategy)``).
      adapters: the adapter tree (arrays or ``jax.ShapeDtypeStruct``; see
        :func:`effijax.lora.init`).

    Returns:
      ``[(regex, PartitionSpec), ...]``, one rule per adapter factor, anchored on its full
      path (``^blocks/attn/q/kernel/a$``).

    Raises:
      ConfigError: an adapter's kernel has no sharding in ``base_shardings``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> from effijax.lora import LoraSpec, init
      >>> mesh = jax.make_mesh((8,), ("fsdp",))
      >>> base = {"q": {"kernel": jnp.zeros((64, 32))}}
      >>> adapters = init(jax.random.key(0), base, LoraSpec(rank=4, targets="q"))
      >>> adapter_rules({"q": {"kernel": NamedSharding(mesh, P("fsdp", None))}}, adapters)
      [('^q/kernel/a$', P('fsdp', None)), ('^q/kernel/b$', P(None, None))]
    """
    kernels = dict(named_leaves(base_shardings,
                                is_leaf=lambda x: isinstance(x, NamedSharding)))
    rules = []
    for path, (a, b) in pairs(adapters).items():
        sharding = kernels.get(path)
        if not isinstance(sharding, NamedSharding):
            raise ConfigError("base_shardings", path, "no NamedSharding for this adapted "
                              "kernel; pass the shardings of the base the adapters were made for")
        mesh = sharding.mesh
        for name, leaf, rank_axis in (("a", a, a.ndim - 1), ("b", b, b.ndim - 2)):
            spec = tuple(sharding.spec) + (None,) * (leaf.ndim - len(sharding.spec))
            entries = []
            for dim, entry in enumerate(spec):
                size = math.prod(mesh.shape[x] for x in _axes(entry))
                keep = dim != rank_axis and _axes(entry) and leaf.shape[dim] % size == 0
                entries.append(entry if keep else None)
            rules.append((f"^{re.escape(path)}/{name}$", PartitionSpec(*entries)))
    return rules
