"""Sharding: meshes, ZeRO/FSDP strategies, partition rules, born-sharded init, collective census.

A run picks a mesh (``make_mesh(data=2, fsdp=4)``) and one strategy knob (``ddp``, ``zero1``,
``zero2``, ``fsdp``). Partition rules (automatic by default, or ordered regex rules written in
logical axis names) give every parameter its sharded spec; :func:`state_shardings` derives the
sharding of every leaf of the train state from them, by tree path; :func:`init_sharded` creates
the state born sharded; :func:`constraints` and :func:`jit_sharded` are the pieces the train step
composes; :func:`collective_census` and :func:`memory_report` show what the compiled program
communicates and holds per device.
"""

from effijax.sharding._census import (
    Census,
    Collective,
    MemoryReport,
    collective_census,
    memory_report,
    parse_collectives,
)
from effijax.sharding._job import (
    DeviceBytes,
    census_records,
    compile_with_census,
    device_bytes,
    grad_shardings,
    with_shardings,
)
from effijax.sharding._mesh import (
    AXES,
    BATCH_AXES,
    batch_sharding,
    check_batch,
    constrain_batch,
    make_mesh,
    parse_mesh,
    replicated,
)
from effijax.sharding._rules import (
    DEFAULT_MIN_SHARD_SIZE,
    LOGICAL_AXES,
    ReplicatedParameterWarning,
    partition_specs,
)
from effijax.sharding._strategy import (
    STRATEGIES,
    ShardedStep,
    Strategy,
    assert_sharded_like_params,
    constraints,
    get_strategy,
    init_sharded,
    jit_sharded,
    param_shardings,
    state_shardings,
)

__all__ = [
    "AXES",
    "BATCH_AXES",
    "make_mesh",
    "parse_mesh",
    "replicated",
    "batch_sharding",
    "check_batch",
    "constrain_batch",
    "LOGICAL_AXES",
    "DEFAULT_MIN_SHARD_SIZE",
    "ReplicatedParameterWarning",
    "partition_specs",
    "Strategy",
    "STRATEGIES",
    "get_strategy",
    "param_shardings",
    "state_shardings",
    "assert_sharded_like_params",
    "init_sharded",
    "constraints",
    "jit_sharded",
    "ShardedStep",
    "Collective",
    "Census",
    "collective_census",
    "parse_collectives",
    "MemoryReport",
    "memory_report",
    "grad_shardings",
    "DeviceBytes",
    "device_bytes",
    "with_shardings",
    "census_records",
    "compile_with_census",
]
