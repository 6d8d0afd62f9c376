"""What a sharded program communicates and holds: a collective census and a memory report.

:func:`collective_census` reads the HLO module **right after XLA's SPMD partitioner**, which is
the partitioning plan with its real dtypes. The final optimised HLO misleads on CPU: XLA's CPU
pipeline promotes bf16 all-reduces to f32 (``all-reduce-promotion``) and never forms
reduce-scatters. jax 0.10.2 has no in-process handle on intermediate modules
(``compiled.as_text()`` and ``runtime_executable().hlo_modules()`` are the final module), but
``lowered.compile(compiler_options=...)`` takes XLA debug options per compilation, so the census
compiles once more with ``xla_dump_to=<tmpdir>`` and ``xla_dump_hlo_pass_re=spmd-partitioning``
and parses ``*after_spmd-partitioning*.txt``; no process-wide ``XLA_FLAGS`` are needed. With
JAX's persistent compilation cache on, the partitioned module is kept beside it, so a process
that loads the step from the cache has its census without running XLA.

After partitioning, a reduce-scatter appears on CPU as an ``all-reduce`` whose result is only
ever ``dynamic-slice`` d (through copies, transposes, reshapes, converts): exactly the pattern
XLA's ``ReduceScatterCreator`` rewrites into a ``reduce-scatter`` on GPU/TPU. The census
reports it as a reduce-scatter (``lowered_as="all-reduce+dynamic-slice"``). Counts are static:
a collective inside a loop body counts once.

Bytes are per device. ``bytes`` is the full tensor the collective works on (an all-gather's
result, a reduction's input); ``wire_bytes`` is what a ring sends per device:
``(g-1)/g * bytes`` for all-gather, reduce-scatter, all-to-all, ``2(g-1)/g * bytes`` for an
all-reduce (g = group size), ``bytes`` for a collective-permute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import math
import os
import pathlib
import re
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import jax.extend

from effijax import atomic
from effijax.paths import named_leaves

__all__ = ["Collective", "Census", "collective_census", "parse_collectives", "MemoryReport",
           "memory_report", "census_records", "compile_with_census"]

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_VIEW_OPS = {"bitcast", "copy", "transpose", "reshape", "convert"}

_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\(.*?\)|\S+)\s+"
    r"(?P<op>[a-z][\w\-]*)\((?P<args>[^)]*)\)(?P<rest>.*)$"
)
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the partitioned program.

    Attributes:
      kind: one of ``all-gather``, ``reduce-scatter``, ``all-reduce``, ``all-to-all``,
        ``collective-permute``.
      dtype: HLO element type (``"bf16"``, ``"f32"``, ``"pred"``).
      shape: the full tensor's shape (all-gather: result; others: operand).
      bytes: per-device bytes of that tensor.
      group_size: devices per replica group.
      wire_bytes: ring-algorithm bytes sent per device (see the module docstring).
      lowered_as: the HLO op(s) it appears as after partitioning.
      name: the HLO instruction name.
      op_name: the jax op that produced it (from the HLO metadata), when known.
    """

    kind: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    group_size: int
    wire_bytes: float
    lowered_as: str
    name: str
    op_name: str = ""


@dataclasses.dataclass(frozen=True)
class Census:
    """The collectives of a partitioned program, with queries.

    Attributes:
      ops: every collective, in HLO order.
      hlo: the post-partitioning HLO text it was read from.

    Example:
      >>> c = Census(ops=(Collective("all-gather", "bf16", (64, 32), 4096, 8, 3584.0,
      ...                            "all-gather", "ag"),), hlo="")
      >>> c.count("all-gather", dtype="bf16"), c.bytes("all-gather"), c.count("all-reduce")
      (1, 4096, 0)
    """

    ops: tuple[Collective, ...]
    hlo: str = dataclasses.field(repr=False, default="")

    def of(self, kind: str, *, dtype: str | None = None, min_bytes: int = 0) -> tuple:
        """The collectives of ``kind`` (optionally one dtype, at least ``min_bytes``)."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        return tuple(c for c in self.ops if c.kind == kind and c.bytes >= min_bytes
                     and (dtype is None or c.dtype == dtype))

    def count(self, kind: str, *, dtype: str | None = None, min_bytes: int = 0) -> int:
        """How many collectives of ``kind``."""
        return len(self.of(kind, dtype=dtype, min_bytes=min_bytes))

    def bytes(self, kind: str, *, dtype: str | None = None, min_bytes: int = 0) -> int:
        """Total per-device ``bytes`` of the collectives of ``kind``."""
        return sum(c.bytes for c in self.of(kind, dtype=dtype, min_bytes=min_bytes))

    def summary(self) -> dict[str, dict[str, Any]]:
        """``{kind: {"count", "bytes", "wire_bytes", "dtypes"}}`` for the kinds present."""
        out: dict[str, dict[str, Any]] = {}
        for kind in KINDS:
            ops = self.of(kind)
            if ops:
                out[kind] = {
                    "count": len(ops),
                    "bytes": sum(c.bytes for c in ops),
                    "wire_bytes": sum(c.wire_bytes for c in ops),
                    "dtypes": sorted({c.dtype for c in ops}),
                }
        return out

    def __str__(self) -> str:
        lines = [f"{'kind':<19}{'dtype':<6}{'shape':<18}{'bytes':>10}{'group':>6}  lowered_as"]
        for c in self.ops:
            lines.append(f"{c.kind:<19}{c.dtype:<6}{str(list(c.shape)):<18}{c.bytes:>10}"
                         f"{c.group_size:>6}  {c.lowered_as}")
        return "\n".join(lines)


def _arrays(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d))
            for dt, dims in _ARRAY.findall(shape_text)]


def _bits(dtype: str) -> int:
    if dtype == "pred":
        return 8
    m = re.match(r"[a-z]+(\d+)", dtype)
    return int(m.group(1)) if m else 0


def _nbytes(arrays) -> int:
    return sum(math.prod(shape) * _bits(dt) // 8 for dt, shape in arrays)


def _group_size(rest: str, num_devices: int) -> int:
    # e.g. mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", rest)
    if m:
        sizes = {k.strip("' "): int(v) for k, v in
                 (item.split("=") for item in m.group(1).split(",") if "=" in item)}
        axes = [a.strip("' ") for a in m.group(2).split(",") if a.strip("' ")]
        return math.prod(sizes[a] for a in axes) if axes else 1
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", rest)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    return num_devices


def parse_collectives(hlo_text: str, num_devices: int = 1) -> tuple[Collective, ...]:
    """Collectives of an HLO module's text (see the module docstring for the conventions).

    Example:
      >>> hlo = '''
      ... %ar = f32[16,64]{1,0} all-reduce(%dot), replica_groups=[1,8]<=[8], to_apply=%add
      ... %t = f32[64,16]{0,1} transpose(%ar), dimensions={1,0}
      ... %ds = f32[8,16]{0,1} dynamic-slice(%t, %i, %j), dynamic_slice_sizes={8,16}
      ... %ag = bf16[64,32]{1,0} all-gather(%p), replica_groups=[1,8]<=[8], dimensions={0}
      ... '''
      >>> for c in parse_collectives(hlo, num_devices=8):
      ...     print(c.kind, c.dtype, c.bytes, c.group_size, c.lowered_as)
      reduce-scatter f32 4096 8 all-reduce+dynamic-slice
      all-gather bf16 4096 8 all-gather
    """
    instrs: dict[str, tuple[str, str, list[str], str]] = {}
    order: list[str] = []
    users: dict[str, list[str]] = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, op = m.group("name"), m.group("op")
        operands = re.findall(r"%([\w.\-]+)", m.group("args"))
        instrs[name] = (op, m.group("shape"), operands, m.group("rest"))
        order.append(name)
        for o in operands:
            users.setdefault(o, []).append(name)

    def only_sliced(name: str) -> bool:
        seen, frontier, ends = set(), [name], []
        while frontier:
            cur = frontier.pop()
            for u in users.get(cur, []):
                if u in seen:
                    continue
                seen.add(u)
                if instrs[u][0] in _VIEW_OPS:
                    frontier.append(u)
                else:
                    ends.append(instrs[u][0])
        return bool(ends) and all(op == "dynamic-slice" for op in ends)

    out = []
    for name in order:
        op, shape_text, operands, rest = instrs[name]
        base = op.removesuffix("-start")
        if base not in KINDS:
            continue
        g = _group_size(rest, num_devices)
        result = _arrays(shape_text)
        operand_arrays = []
        for o in operands:
            if o in instrs:
                operand_arrays += _arrays(instrs[o][1])
        full = result if base == "all-gather" or not operand_arrays else operand_arrays
        if base == "all-gather" and op.endswith("-start"):
            full = result[len(result) // 2:]  # async start returns (operand, result)
        kind, lowered_as = base, op
        if base == "all-reduce" and only_sliced(name):
            kind, lowered_as = "reduce-scatter", "all-reduce+dynamic-slice"
        nbytes = _nbytes(full)
        factor = {"all-reduce": 2 * (g - 1) / g, "collective-permute": 1.0}.get(kind, (g - 1) / g)
        meta = re.search(r'op_name="([^"]*)"', rest)
        dtypes = sorted({dt for dt, _ in full})
        out.append(Collective(
            kind=kind,
            dtype=",".join(dtypes),
            shape=full[0][1] if len(full) == 1 else tuple(),
            bytes=nbytes,
            group_size=g,
            wire_bytes=factor * nbytes,
            lowered_as=lowered_as,
            name=name,
            op_name=meta.group(1) if meta else "",
        ))
    return tuple(out)


def _lower(fn: Callable, args, kwargs):
    if hasattr(fn, "lower"):
        return fn.lower(*args, **kwargs)
    return jax.jit(fn).lower(*args, **kwargs)


def collective_census(fn: Callable, *args, **kwargs) -> Census:
    """Compiles ``fn(*args, **kwargs)`` and counts the collectives XLA's partitioner planned.

    Args:
      fn: a ``jax.jit`` function, an :class:`~effijax.sharding.ShardedStep`, anything with
        ``.lower``, or a plain function (jitted with default shardings).
      *args, **kwargs: arrays or ``jax.ShapeDtypeStruct`` s (with shardings) to lower with.

    Returns:
      A :class:`Census`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> from effijax.sharding import make_mesh
      >>> mesh = make_mesh()
      >>> f = jax.jit(lambda w: w * 2.0, in_shardings=NamedSharding(mesh, P("fsdp")),
      ...             out_shardings=NamedSharding(mesh, P()))
      >>> census = collective_census(f, jax.ShapeDtypeStruct((64, 4), jnp.float32))
      >>> census.summary()["all-gather"]["count"], census.bytes("all-gather")
      (1, 1024)
    """
    lowered = _lower(fn, args, kwargs)
    num_devices = _num_devices(lowered)
    stored = _stored_census(lowered)
    if stored is not None and stored.is_file():
        lowered.compile()  # the executable itself may come from JAX's persistent cache
        text = stored.read_text()
        return Census(ops=parse_collectives(text, num_devices), hlo=text)
    # With a persistent cache, the dumped compilation is cached like a plain one (JAX's cache
    # key leaves the dump options out); a program already cached by a plain compilation skips
    # XLA and dumps nothing, so it is compiled once more with the cache off.
    text = _partitioned_hlo(lowered, cached=stored is not None)
    if text is None and stored is not None:
        text = _partitioned_hlo(lowered, cached=False)
    if text is None:
        if num_devices > 1:
            raise RuntimeError(
                f"collective_census: XLA wrote no partitioned module for a program on "
                f"{num_devices} devices (was it loaded from a compilation cache?); the "
                "census needs XLA to compile it")
        # A program on one device is never partitioned: nothing is communicated.
        return Census(ops=(), hlo="")
    if stored is not None:
        # Best effort: a census is only ever read back whole (written atomically), and one that
        # cannot be kept (a full disk, another process writing it now) is recomputed later.
        with contextlib.suppress(OSError):
            stored.parent.mkdir(exist_ok=True)
            atomic.write_text(stored, text)
    return Census(ops=parse_collectives(text, num_devices), hlo=text)


def _partitioned_hlo(lowered, *, cached: bool) -> str | None:
    """Compiles ``lowered`` with XLA dumping the module after SPMD partitioning: its text, or
    None when XLA wrote none (one device, or an executable loaded from the persistent cache,
    which ``cached=False`` rules out)."""
    keep_cache = contextlib.nullcontext() if cached else _no_persistent_cache()
    with tempfile.TemporaryDirectory(prefix="effijax-census-") as tmp, keep_cache:
        lowered.compile(compiler_options={
            "xla_dump_to": tmp,
            "xla_dump_hlo_pass_re": "spmd-partitioning",
            "xla_dump_hlo_as_text": True,
        })
        files = sorted(glob.glob(os.path.join(tmp, "*after_spmd-partitioning*.txt")))
        if not files:
            return None
        with open(files[-1]) as f:
            return f.read()


def _stored_census(lowered) -> pathlib.Path | None:
    """Where the partitioned module of ``lowered`` is kept next to JAX's persistent compilation
    cache (``<cache dir>/effijax-census/<sha256>.hlo.txt``), or None without one.

    A process that loads its executable from that cache never runs XLA's partitioner, so the
    census it would dump is kept beside the executable, keyed by what decides the partitioning:
    the lowered program (shardings and device count included), JAX and jaxlib's versions, the
    backend and its devices, and ``XLA_FLAGS``.
    """
    directory = jax.config.jax_compilation_cache_dir
    if not directory or not jax.config.jax_enable_compilation_cache:
        return None
    import jaxlib

    backend = jax.extend.backend.get_backend()
    key = hashlib.sha256()
    for part in (lowered.as_text(), jax.__version__, jaxlib.__version__, backend.platform,
                 backend.platform_version, ",".join(sorted({d.device_kind for d in jax.devices()})),
                 os.environ.get("XLA_FLAGS", "")):
        key.update(part.encode())
        key.update(b"\0")
    return pathlib.Path(directory) / "effijax-census" / f"{key.hexdigest()}.hlo.txt"


@contextlib.contextmanager
def _no_persistent_cache():
    """JAX's persistent compilation cache off for one compilation: an executable loaded from
    it skips XLA, so nothing would be dumped. JAX decides once per process whether the cache is
    used (``compilation_cache.is_cache_used``, memoised), so that decision is what is held."""
    from jax._src import compilation_cache

    lock = getattr(compilation_cache, "_cache_initialized_mutex", None)
    if lock is None or not hasattr(compilation_cache, "_cache_used"):
        yield  # another JAX: the empty-dump check above still refuses a cached program
        return
    with lock:
        saved = compilation_cache._cache_checked, compilation_cache._cache_used
        compilation_cache._cache_checked, compilation_cache._cache_used = True, False
    try:
        yield
    finally:
        with lock:
            compilation_cache._cache_checked, compilation_cache._cache_used = saved


def _num_devices(lowered) -> int:
    m = re.search(r"mhlo\.num_partitions\s*=\s*(\d+)", lowered.as_text())
    return int(m.group(1)) if m else 1


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-device bytes of a sharded training step.

    Attributes:
      params, opt_state, other_state: bytes of the state's leaves on one device (from the
        arrays' shards; ``other_state`` is step, PRNG key and anything else).
      grads: bytes of the gradients on one device (from their shardings; None if not given).
      arguments, outputs, temporaries, aliased: from ``compiled.memory_analysis()``.
      peak: XLA's peak estimate when the backend reports one, else None.
    """

    params: int
    opt_state: int
    other_state: int
    grads: int | None
    arguments: int
    outputs: int
    temporaries: int
    aliased: int
    peak: int | None

    def __str__(self) -> str:
        rows = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]
        return "\n".join(f"{k:<12}{'-' if v is None else f'{v:,}':>16} B" for k, v in rows)


def _device_bytes(leaf) -> int:
    if isinstance(leaf, jax.Array):
        shards = leaf.addressable_shards
        return shards[0].data.nbytes if shards else 0
    sharding = getattr(leaf, "sharding", None)
    shape = tuple(leaf.shape)
    if sharding is not None:
        shape = sharding.shard_shape(shape)
    return math.prod(shape) * leaf.dtype.itemsize


def _tree_device_bytes(tree) -> int:
    return sum(_device_bytes(leaf) for _, leaf in named_leaves(tree) if hasattr(leaf, "shape"))


def memory_report(compiled, state, *, grad_shardings=None) -> MemoryReport:
    """Per-device memory of a compiled step and its (sharded) state.

    Args:
      compiled: ``step.lower(state, batch).compile()``.
      state: a ``TrainState`` of arrays (``addressable_shards[0]`` is measured) or of
        ``ShapeDtypeStruct`` s with shardings.
      grad_shardings: the gradients' shardings (a tree shaped like the parameters, e.g. the
        ``state_shardings`` of the optimizer's ``mu``, or ``param_shardings`` for ddp/zero1);
        gradients take the parameters' dtypes.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from effijax.sharding import make_mesh, init_sharded
      >>> tx = optax.adam(1e-3)
      >>> init = lambda k: {"params": {"w": jnp.zeros((64, 32))}, "opt_state": tx.init(
      ...     {"w": jnp.zeros((64, 32))}), "rng": k}
      >>> state, sh = init_sharded(init, jax.random.key(0), mesh=make_mesh(), strategy="fsdp")
      >>> compiled = jax.jit(lambda s: s, in_shardings=(sh,), out_shardings=sh).lower(
      ...     state).compile()
      >>> r = memory_report(compiled, state, grad_shardings=sh["params"])
      >>> r.params, r.opt_state, r.grads  # 64*32*4 / 8 devices; Adam's mu + nu (+ count)
      (1024, 2052, 1024)
    """
    params = state.params if hasattr(state, "params") else state["params"]
    opt_state = state.opt_state if hasattr(state, "opt_state") else state["opt_state"]
    total = _tree_device_bytes(state)
    p, o = _tree_device_bytes(params), _tree_device_bytes(opt_state)
    grads = None
    if grad_shardings is not None:
        grads = 0
        for (_, leaf), (_, sh) in zip(named_leaves(params), named_leaves(grad_shardings),
                                      strict=True):
            grads += math.prod(sh.shard_shape(tuple(leaf.shape))) * leaf.dtype.itemsize
    ma = compiled.memory_analysis()
    peak = getattr(ma, "peak_memory_in_bytes", None)
    return MemoryReport(
        params=p,
        opt_state=o,
        other_state=total - p - o,
        grads=grads,
        arguments=int(ma.argument_size_in_bytes),
        outputs=int(ma.output_size_in_bytes),
        temporaries=int(ma.temp_size_in_bytes),
        aliased=int(ma.alias_size_in_bytes),
        peak=int(peak) if peak else None,
    )


def census_records(census: Census) -> list[dict]:
    """The census grouped by ``(kind, dtype)``: ``count``, ``bytes``, ``wire_bytes`` per device.

    Bytes follow :class:`~effijax.sharding.Collective`: ``bytes`` is the full tensor each
    collective works on, ``wire_bytes`` what a ring sends per device.

    Example:
      >>> from effijax.sharding import Census, Collective
      >>> c = Census(ops=(Collective("all-gather", "bf16", (64, 32), 4096, 8, 3584.0,
      ...                            "all-gather", "ag"),) * 2)
      >>> census_records(c)
      [{'kind': 'all-gather', 'dtype': 'bf16', 'count': 2, 'bytes': 8192, 'wire_bytes': 7168.0}]
    """
    groups: dict[tuple[str, str], dict] = {}
    for c in census.ops:
        row = groups.setdefault((c.kind, c.dtype), {"kind": c.kind, "dtype": c.dtype,
                                                     "count": 0, "bytes": 0,
                                                     "wire_bytes": 0.0})
        row["count"] += 1
        row["bytes"] += c.bytes
        row["wire_bytes"] += c.wire_bytes
    return list(groups.values())


class _Keep:
    """Stands in for a jitted function: :func:`collective_census` lowers through ``.lower`` and
    compiles the lowering (with its dump options); this keeps the executable it compiles."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = None

    def lower(self, *args, **kwargs):
        return _KeptLowering(self, self.fn.lower(*args, **kwargs))


class _KeptLowering:
    def __init__(self, keep: _Keep, lowered):
        self._keep = keep
        self._lowered = lowered

    def compile(self, *args, **kwargs):
        self._keep.compiled = self._lowered.compile(*args, **kwargs)
        return self._keep.compiled

    def __getattr__(self, name):  # as_text and the rest: the real lowering's
        return getattr(self._lowered, name)


def compile_with_census(fn, *args, **kwargs):
    """Compiles ``fn(*args)`` once and returns ``(compiled, census)``.

    :func:`~effijax.sharding.collective_census` compiles the program a second time (with XLA
    dumping the partitioned module) next to the one ``jit`` runs; here the census' compilation
    is the executable: call ``compiled(*args)`` to run the step (donation and shardings as
    lowered; no mesh context needed). XLA's dump options change what is written to disk, not
    the program.

    Args:
      fn: a ``jax.jit`` function or :class:`~effijax.sharding.ShardedStep` (anything with
        ``.lower``).
      *args, **kwargs: arrays or ``jax.ShapeDtypeStruct`` s with shardings.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> from effijax.sharding import make_mesh
      >>> rows = NamedSharding(make_mesh(), P("fsdp"))
      >>> total = jax.jit(lambda w: w.sum(0), in_shardings=rows)  # a sum across the devices
      >>> compiled, census = compile_with_census(total,
      ...                                        jax.ShapeDtypeStruct((64, 4), jnp.float32))
      >>> census.count("all-reduce"), float(compiled(jnp.ones((64, 4)))[0])
      (1, 64.0)
    """
    if not hasattr(fn, "lower"):
        raise TypeError(f"fn must be jitted (have .lower), got {type(fn).__name__}")
    keep = _Keep(fn)
    census = collective_census(keep, *args, **kwargs)
    return keep.compiled, census

