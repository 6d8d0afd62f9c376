"""Sharding: meshes, ZeRO/FSDP strategies, partition rules, born-sharded init, collective census.

A run picks a mesh (``make_mesh(data=2, fsdp=4)``, or with a ``tensor`` axis for Megatron-style
tensor parallelism: ``make_mesh(fsdp=2, tensor=4)``) and one strategy knob (``ddp``, ``zero1``,
``zero2``, ``fsdp``). Partition rules (automatic by default, or ordered regex rules written in
logical axis names) give every parameter its sharded spec; :func:`state_shardings` derives the
sharding of every leaf of the train state from them, by tree path; :func:`init_sharded` creates
the state born sharded; :func:`constraints` and :func:`jit_sharded` are the pieces the train step
composes; :func:`collective_census` and :func:`memory_report` show what the compiled program
communicates and holds per device.
"""

from effijax._lazy import attach

# Each name is imported from its module on first use: importing the package (the CLI's
# flag checks, a config's validation) does not import JAX. __all__ lists every name.
__getattr__, __dir__, __all__ = attach(__name__, {
    "effijax.sharding._census": ("Collective", "Census", "collective_census",
        "parse_collectives", "MemoryReport", "memory_report", "census_records",
        "compile_with_census"),
    "effijax.sharding._device_bytes": ("DeviceBytes", "device_bytes"),
    "effijax.sharding._names": ("AXES", "BATCH_AXES", "CONTEXT_AXIS", "parse_mesh",
        "check_context", "Strategy", "STRATEGIES", "get_strategy"),
    "effijax.sharding._mesh": ("make_mesh", "replicated", "batch_sharding", "check_batch",
        "constrain_batch", "splits_sequence", "activation_spec", "constrain_activations"),
    "effijax.sharding._rules": ("LOGICAL_AXES", "DEFAULT_MIN_SHARD_SIZE",
        "ReplicatedParameterWarning", "partition_specs"),
    "effijax.sharding._strategy": ("param_shardings", "state_shardings",
        "assert_sharded_like_params", "init_sharded", "constraints", "jit_sharded",
        "ShardedStep", "grad_shardings", "with_shardings", "tensor_only", "match_param"),
    "effijax.sharding._tensor": ("TENSOR_SPLIT", "TensorLayout", "tensor_split", "tensor_dim"),
})
