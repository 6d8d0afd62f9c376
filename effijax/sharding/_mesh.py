"""Device meshes with effijax's three named axes, and the batch sharding that goes with them.

Every effijax mesh has the axes ``("data", "fsdp", "tensor")`` in that order, size-1 axes
included, so that partition specs never depend on which axes a run happens to use:

* ``data``: pure replication of the model state (the outer level of hybrid sharding);
* ``fsdp``: the axis ZeRO-1/2/3 shard parameters, gradients and optimizer state over;
* ``tensor``: Megatron's tensor parallelism (:mod:`effijax.sharding._tensor`);
* ``context`` (only when asked for, between ``fsdp`` and ``tensor``): context parallelism, the
  sequence split over devices and attention computed as ring attention
  (:func:`effijax.models.context_attend`); no parameter is split over it.

The batch is split over ``("data", "fsdp")``, i.e. over every device of a (data, fsdp) mesh.
Activations at block boundaries follow one spec (:func:`activation_spec`): the batch axis over
``("data", "fsdp")`` and, with sequence parallelism on a ``tensor > 1`` mesh, the sequence axis
over ``tensor`` (Korthikanti et al.).
Axes are ``AxisType.Auto``: XLA's partitioner propagates shardings from the constraints
effijax places (jax 0.10's ``jax.make_mesh`` defaults to ``Explicit`` axes, i.e. sharding in
types, a different programming model that these strategies are not written for).
"""

from __future__ import annotations

import math

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from effijax.errors import ConfigError
from effijax.paths import named_leaves
from effijax.sharding._names import AXES, BATCH_AXES, CONTEXT_AXIS

__all__ = [
    "make_mesh",
    "replicated",
    "batch_sharding",
    "check_batch",
    "constrain_batch",
    "splits_sequence",
    "activation_spec",
    "constrain_activations",
]


def make_mesh(*, data: int = 1, fsdp: int = -1, tensor: int = 1, context: int = 1,
              devices=None) -> Mesh:
    """Builds a ``(data, fsdp, tensor)`` mesh over all (or the given) devices, with a
    ``context`` axis between ``fsdp`` and ``tensor`` when ``context > 1``.

    Exactly the device count must be used: JAX's own ``make_mesh((3, 2))`` on 8 devices silently
    leaves 2 idle, so a product that does not match is an error here.

    Args:
      data: replicas of the model state (hybrid sharding's outer axis).
      fsdp: devices each replica's state is sharded over; ``-1`` means "the rest".
      tensor: tensor-parallel axis size.
      context: devices each sequence is split over (context parallelism; the models' attention
        then runs as ring attention); 1: no ``context`` axis.
      devices: devices to use, default ``jax.devices()``.

    Returns:
      A ``jax.sharding.Mesh`` with axis names :data:`AXES` (``data, fsdp, context, tensor``
      with a context axis), every axis ``AxisType.Auto``.

    Raises:
      ConfigError: a size is not a positive int (or ``-1``), more than one ``-1`` is given, or
        the sizes do not multiply to the device count.

    Example:
      >>> import jax
      >>> mesh = make_mesh(data=2, devices=jax.devices()[:8])
      >>> dict(mesh.shape)
      {'data': 2, 'fsdp': 4, 'tensor': 1}
      >>> dict(make_mesh(fsdp=2, context=4).shape)
      {'data': 1, 'fsdp': 2, 'context': 4, 'tensor': 1}
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    if context != 1:
        sizes[CONTEXT_AXIS] = context
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
            raise ConfigError(name, size, "mesh axis sizes must be positive ints, or -1 for "
                              "'the remaining devices'")
    rest = [name for name, size in sizes.items() if size == -1]
    described = ", ".join(f"{k}={v}" for k, v in sizes.items())
    if len(rest) > 1:
        raise ConfigError("mesh", described, f"at most one axis may be -1, got {rest}")
    known = math.prod(size for size in sizes.values() if size != -1)
    if rest:
        if n % known:
            raise ConfigError("mesh", described, f"the other axes multiply to {known}, which "
                              f"does not divide the {n} devices")
        sizes[rest[0]] = n // known
    elif known != n:
        raise ConfigError("mesh", described, f"the axis sizes multiply to {known} but there "
                          f"are {n} devices; make them multiply to {n} or set one axis to -1")
    axes = AXES if CONTEXT_AXIS not in sizes else (*AXES[:2], CONTEXT_AXIS, *AXES[2:])
    shape = tuple(sizes[a] for a in axes)
    return jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes), devices=devices)


def _check_mesh(mesh) -> Mesh:
    if not isinstance(mesh, Mesh):
        raise ConfigError("mesh", type(mesh).__name__, "expected a jax.sharding.Mesh; build "
                          "one with effijax.sharding.make_mesh")
    missing = [a for a in BATCH_AXES if a not in mesh.axis_names]
    if missing:
        raise ConfigError("mesh", dict(mesh.shape), f"missing axes {missing}; build the mesh "
                          "with effijax.sharding.make_mesh")
    return mesh


def replicated(mesh: Mesh) -> NamedSharding:
    """The fully replicated sharding on ``mesh`` (scalars, PRNG keys, metrics).

    Example:
      >>> replicated(make_mesh()).spec
      P()
    """
    return NamedSharding(mesh, P())


def _batch_size_of_mesh(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over ``("data", "fsdp")``, i.e. over every data-parallel rank.

    One sharding serves a whole batch pytree as a ``jit`` ``in_shardings`` prefix.

    Example:
      >>> batch_sharding(make_mesh(data=2)).spec
      P(('data', 'fsdp'),)
    """
    _check_mesh(mesh)
    return NamedSharding(mesh, P(BATCH_AXES))


def check_batch(batch, mesh: Mesh) -> None:
    """Checks on the host, before compiling, that the global batch splits evenly over the mesh.

    Args:
      batch: an int batch size, or a pytree of arrays whose leading axis is the batch.
      mesh: the mesh the batch will be split over.

    Raises:
      ConfigError: naming the batch size (and the leaf path for a pytree) and data*fsdp.

    Example:
      >>> check_batch(16, make_mesh(data=2))
      >>> check_batch(12, make_mesh(data=2))
      Traceback (most recent call last):
      ...
      effijax.errors.ConfigError: batch_size=12: must be divisible by data*fsdp = 8 (data=2, \
fsdp=4): e.g. 8 or 16
    """
    _check_mesh(mesh)
    n = _batch_size_of_mesh(mesh)
    where = f"data*fsdp = {n} (data={mesh.shape['data']}, fsdp={mesh.shape['fsdp']})"
    if isinstance(batch, int) and not isinstance(batch, bool):
        if batch < 1 or batch % n:
            near = sorted({max(n, batch // n * n), (batch // n + 1) * n})
            raise ConfigError("batch_size", batch, f"must be divisible by {where}: e.g. "
                              + " or ".join(str(b) for b in near))
        return
    for path, leaf in named_leaves(batch):
        shape = getattr(leaf, "shape", None)
        if shape is None or len(shape) == 0:
            raise ConfigError(f"batch[{path}]", shape, "every batch leaf needs a leading batch "
                              "axis")
        if shape[0] % n:
            raise ConfigError(f"batch[{path}] batch_size", shape[0],
                              f"must be divisible by {where} (leaf shape {tuple(shape)})")


def splits_sequence(mesh_shape, seq_len: int) -> bool:
    """Whether a ``seq_len``-token pass under a mesh of this shape is sequence-parallel.

    True when the mesh has a ``tensor`` axis above 1 that divides ``seq_len``: the residual
    stream between blocks is then split along the sequence over ``tensor``. The training recipe
    refuses a sequence the tensor degree does not divide; any other pass (generation's one-token
    steps, a ragged prompt) keeps the batch-only layout.

    Args:
      mesh_shape: the mesh's ``{axis: size}`` (``mesh.shape``).
      seq_len: tokens per row.

    Example:
      >>> splits_sequence({"data": 1, "fsdp": 2, "tensor": 4}, 32)
      True
      >>> splits_sequence({"data": 1, "fsdp": 2, "tensor": 4}, 1)  # a decode step
      False
    """
    tensor = mesh_shape.get("tensor", 1)
    return tensor > 1 and seq_len % tensor == 0


def activation_spec(shape: tuple[int, ...], mesh_shape, *, sequence_parallel: bool) -> P:
    """The partition spec of an activation ``[B, S, ...]`` at a block boundary.

    The one place that decides how the residual stream is laid out: the leading (batch) axis over
    the mesh's ``("data", "fsdp")`` axes and, when ``sequence_parallel`` and
    :func:`splits_sequence` hold, the second (sequence) axis over ``tensor``, i.e.
    ``P(("data", "fsdp"), "tensor")``; otherwise ``P(("data", "fsdp"))``. On a mesh with a
    ``context`` axis (:data:`CONTEXT_AXIS`) that divides it, the sequence is split over
    ``context`` whatever ``sequence_parallel`` says (each device holds its contiguous chunk of
    the sequence, as ring attention expects), and over ``("context", "tensor")`` with sequence
    parallelism where both divide.

    Args:
      shape: the activation's shape (batch first; the sequence second for sequence parallelism).
      mesh_shape: the mesh's ``{axis: size}`` (``mesh.shape``).
      sequence_parallel: ask for the sequence split (it applies only where it divides).

    Raises:
      ValueError: the leading axis is not divisible by data*fsdp (a traced shape: no
        ConfigError, the recipe has already checked the batch).

    Example:
      >>> mesh = {"data": 1, "fsdp": 2, "tensor": 4}
      >>> activation_spec((8, 32, 64), mesh, sequence_parallel=True)
      P(('data', 'fsdp'), 'tensor')
      >>> activation_spec((8, 1, 64), mesh, sequence_parallel=True)  # 4 does not divide 1
      P(('data', 'fsdp'),)
      >>> activation_spec((8, 32, 64), {"data": 1, "fsdp": 2, "context": 4, "tensor": 1},
      ...                 sequence_parallel=False)
      P(('data', 'fsdp'), 'context')
    """
    axes = tuple(a for a in BATCH_AXES if a in mesh_shape)
    n = math.prod(mesh_shape[a] for a in axes)
    if len(shape) == 0 or shape[0] % n:
        raise ValueError(f"activation_spec: leading axis of shape {tuple(shape)} is not "
                         f"divisible by {'*'.join(axes)} = {n}")
    context = mesh_shape.get(CONTEXT_AXIS, 1)
    split = context > 1 and len(shape) >= 3 and shape[1] % context == 0
    tensor = (sequence_parallel and len(shape) >= 3
              and splits_sequence(mesh_shape, shape[1] // context if split else shape[1]))
    if split:
        return P(axes, (CONTEXT_AXIS, "tensor") if tensor else CONTEXT_AXIS)
    return P(axes, "tensor") if tensor else P(axes)


def constrain_activations(x: jax.Array, *, sequence_parallel: bool) -> jax.Array:
    """Pins an activation at a block boundary to :func:`activation_spec` when a mesh is set.

    Under ``with jax.set_mesh(mesh):`` (entered outside ``jit``, around the call or ``lower``)
    it applies ``with_sharding_constraint``; with no mesh set (single device, tests) it is the
    identity. Without such constraints XLA may split small batches the tensor-parallel way
    (gathering activations instead of FSDP's weights). With ``sequence_parallel`` on a
    ``tensor > 1`` mesh the residual stream is split along the sequence between the blocks, so
    XLA turns each row-parallel all-reduce into a reduce-scatter and all-gathers the sequence
    before the next column-parallel matmul (Megatron's g and g-bar): the same bytes on the
    wire, and the norms, dropouts and residual adds hold ``1/tensor`` of the tokens.

    Raises:
      ValueError: under a mesh, when the leading axis is not divisible by data*fsdp.

    Example:
      >>> import jax.numpy as jnp
      >>> constrain_activations(jnp.ones((2, 4, 3)), sequence_parallel=True).shape  # no mesh
      (2, 4, 3)
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not any(a in mesh.axis_names for a in BATCH_AXES):
        return x
    return jax.lax.with_sharding_constraint(
        x, activation_spec(x.shape, dict(mesh.shape), sequence_parallel=sequence_parallel))


def constrain_batch(x: jax.Array) -> jax.Array:
    """Pins the leading axis of an activation to ``("data", "fsdp")`` when a mesh is set.

    Call it at block boundaries. Under ``with jax.set_mesh(mesh):`` (jax 0.10 has no
    ``jax.sharding.use_mesh``; ``set_mesh`` must be entered outside ``jit``, around the call or
    ``lower``) it applies ``with_sharding_constraint(x, P(("data", "fsdp")))``; with no mesh
    set (single device, tests) it is the identity. Without such constraints XLA may split small
    batches the tensor-parallel way (gathering activations instead of FSDP's weights).

    Raises:
      ValueError: under a mesh, when the leading axis is not divisible by data*fsdp.

    Example:
      >>> import jax.numpy as jnp
      >>> constrain_batch(jnp.ones((3, 2))).shape  # no mesh set: identity
      (3, 2)
    """
    return constrain_activations(x, sequence_parallel=False)

